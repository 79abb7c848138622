#!/bin/bash
# Issue 22 item 1: Schlag et al. 2021 Table 1 at this machine's scale, on the gettext En-De corpus
# (training/gettext_corpus.py). Run from the repository root; two runs at a time, one thread each; resumable
# (a configuration whose results file exists is skipped). Results: docs/results/mt_gettext/<name>.json for seed 0,
# <name>_seed<S>.json for SEED=S (e.g. `SEED=1 bash docs/results/mt_gettext/run.sh`). Several copies of the script
# may run at once (PARALLEL=1 each): a configuration being trained holds outputs/mt_gettext/<name>.running, so the
# others skip it; remove those folders after stopping a run by hand. ONLY="softmax dpfp_128" runs those names alone.
source .venv/bin/activate
SEED=${SEED:-0}
suffix=$([ "$SEED" = 0 ] || echo "_seed$SEED")
common="--hidden_size 128 --num_attention_heads 4 --num_layers 2 --intermediate_size 512 --vocab_size 4000
  --max_tokens 48 --max_steps 1500 --per_device_train_batch_size 64 --learning_rate 1e-3 --warmup_steps 150
  --dropout 0.1 --eval_examples 0 --num_beams 4 --seed $SEED --save_strategy no --report_to none --disable_tqdm true
  --logging_steps 50 --use_cpu"
one() {  # name, then the model's options
  name=$1$suffix; shift
  [ -f docs/results/mt_gettext/$name.json ] && { echo "== $name done"; return; }
  mkdir outputs/mt_gettext/$name.running 2>/dev/null || { echo "== $name running elsewhere"; return; }
  echo "== $name start $(date -u +%FT%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
  OMP_NUM_THREADS=1 python -m training.train_seq2seq "$@" $common --output_dir outputs/mt_gettext/$name \
    > outputs/mt_gettext/$name.log 2>&1 && cp outputs/mt_gettext/$name/results.json docs/results/mt_gettext/$name.json
  rmdir outputs/mt_gettext/$name.running
  echo "== $name end $(date -u +%FT%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
}
export -f one; export common suffix
mkdir -p outputs/mt_gettext
printf '%s\n' \
  "favor_256 --feature_map favor --d_dot 256" \
  "dpfp_256 --feature_map dpfp --d_dot 256" \
  "dpfp_128_delta --feature_map dpfp --d_dot 128 --update_rule delta" \
  "favor_128 --feature_map favor --d_dot 128" \
  "dpfp_128 --feature_map dpfp --d_dot 128" \
  "favor_32 --feature_map favor --d_dot 32" \
  "linear_32 --feature_map elu" \
  "softmax --model softmax" |
  while read -r line; do [ -z "$ONLY" ] || [[ " $ONLY " == *" ${line%% *} "* ]] && echo "$line"; done |
  xargs -P "${PARALLEL:-2}" -I{} bash -c 'one {}'
echo "== finished $(date -u +%FT%T)"
