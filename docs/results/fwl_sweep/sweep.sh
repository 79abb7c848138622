#!/bin/bash
# issue 17 item 4's sweep, docs/RESULTS.md's commands (resumable: rerun this script from the repository root;
# it skips configurations whose valid_documents.json exists)
source .venv/bin/activate
run() {  # name block extra-options...; resumable: rerun the same line
  name=$1 block=$2; shift 2
  if [ -f outputs/fwl_sweep/$name/valid_documents.json ]; then echo "== $name done"; return; fi
  echo "== $name start $(date -u +%FT%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
  mkdir -p outputs/fwl_sweep/shared_b$block/base_finetuned outputs/fwl_sweep/$name
  ln -sfn ../shared_b$block/base_finetuned outputs/fwl_sweep/$name/base_finetuned
  python -m training.finetune_fwl --output_dir outputs/fwl_sweep/$name --max_steps 100 --block_size $block \
    --per_device_train_batch_size $((1024 / block)) --save_steps 50 --document_eval_documents 0 --max_new_tokens 0 "$@" || return 1
  python -m training.document_eval --split valid --max_length 4096 --methods finetuned fwl fwl_slow_only \
    --finetuned_model outputs/fwl_sweep/$name/base_finetuned/final --fwl_model outputs/fwl_sweep/$name/base_fwl/final \
    --threads 2 --results_file outputs/fwl_sweep/$name/valid_documents.json || return 1
  echo "== $name end $(date -u +%FT%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
}
run mlp_1e-3 512 --fwl_head_type mlp --fwl_step_size_init 1e-3
run output_3e-5 512 --fwl_head_type output --fwl_step_size_init 3e-5
# session 28's order: the decay first (the question mlp_1e-3 raised), then its output-side twin
run mlp_1e-3_decay 512 --fwl_head_type mlp --fwl_step_size_init 1e-3 --fwl_decay_init 0.5 --fwl_segment_length 512
run output_3e-5_decay 512 --fwl_head_type output --fwl_step_size_init 3e-5 --fwl_decay_init 0.5 --fwl_segment_length 512
run mlp_1e-2 512 --fwl_head_type mlp --fwl_step_size_init 1e-2
run mlp_1e-3_frozen 512 --fwl_head_type mlp --fwl_step_size_init 1e-3 --freeze_base
run mlp_1e-3_lr3e-4 512 --fwl_head_type mlp --fwl_step_size_init 1e-3 --fwl_learning_rate 3e-4
run mlp_1e-3_c 512 --fwl_head_type mlp --fwl_step_size_init 1e-3 \
  --fwl_fast_parameters up_proj.weight up_proj.bias down_proj.weight down_proj.bias norm.weight norm.bias output_bias
run mlp_1e-3_b1024 1024 --fwl_head_type mlp --fwl_step_size_init 1e-3
echo "== sweep finished $(date -u +%FT%T)"
