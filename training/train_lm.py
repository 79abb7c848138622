"""Train any causal LM of this package from scratch on a text dataset, with the papers' language-modelling protocol.

Protocol (Schlag et al. 2021 sec. 6.3; Irie et al. 2021 sec. 4.1 and appendix A.1): the train split is one token stream
(every document followed by the tokenizer's eos), cut into fixed-length segments of ``--block_size`` tokens (256 by
default).

- Without ``--carry_state`` every segment is an independent training example (shuffled), read from an empty state.
- With ``--carry_state`` ("full context" training) the stream is cut into ``world_size *
  per_device_train_batch_size`` parallel
  streams, and batch row ``b`` of step ``i`` holds segment ``i`` of stream ``b``: the data are read in order (no
  shuffling) and the fast-weight state of each row is carried from one step to the next through
  ``cache``, detached at every segment boundary (truncated back-propagation). The state is reset at the
  start of every epoch and when resuming from a checkpoint.
- With ``--in_order`` the data are read as with ``--carry_state`` (parallel streams, in order) but every segment
  starts from an empty state: the ablation that separates full-context training's data order from its carried state.

Evaluation (valid and test) reports both protocols: perplexity with the state carried over the whole split (batch 1,
``training.eval_lm.score_split``) and perplexity of independent segments (``training.demo.evaluate_loss``).

Data: ``--dataset_name`` (any ``datasets.load_dataset`` name, with ``--dataset_config_name`` / ``--text_column``), or
local text files (``--train_file`` / ``--validation_file`` / ``--test_file``, documents separated by blank lines), or
by default the offline Wikipedia corpus (``training.data``, prepared into ``--data_dir`` when missing).

Options: this script's own (model, data, evaluation) and every ``TrainingArguments`` option (``--bf16``,
``--report_to``, ``--save_total_limit``, ``--gradient_checkpointing``, ...); ``--help`` lists them with their
defaults. ``--resume_from_checkpoint latest`` continues from the newest checkpoint under ``<output_dir>/checkpoints``;
``--model_name_or_path <saved model> --tokenizer_name <its tokenizer>`` trains a saved model further (new optimizer
and schedule), e.g. one trained on independent segments, now with ``--carry_state``.

    python -m training.train_lm --model_type fwp_delta_net \\
        --config_overrides hidden_size=128,num_hidden_layers=2,feature_map=dpfp --max_steps 200 --carry_state \\
        --output_dir outputs/train_lm_delta_net          # or: fwp-train-lm ... (the installed command)
    accelerate launch --multi_gpu --num_processes 2 -m training.train_lm ...
        # several processes; on a CPU-only machine this runs torchrun with the gloo backend (plain
        # `accelerate launch --num_processes 2` without --multi_gpu starts a single process there)

Outputs in ``--output_dir``: ``model/`` (model + tokenizer, ``save_pretrained``), ``results.json`` (perplexities,
config, steps, tokens/s), Trainer checkpoints under ``checkpoints/`` (for ``--resume_from_checkpoint``), and with
``--push_to_hub`` (Trainer's Hub options: ``--hub_model_id``, ``--hub_private_repo``, ``--hub_token``, and
``--hub_dry_run``) a Hub export folder ``hub_export/`` with the code and this project's card, uploaded by
``training.hub_options.push_if_requested``.
"""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import copy  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Dict, List, Optional  # noqa: E402

import datasets  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import (  # noqa: E402
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Trainer,
    TrainingArguments,
    default_data_collator,
    set_seed,
)

import modeling_fwp  # noqa: E402,F401  (registers the Auto classes)

from . import leave_process_group  # noqa: E402
from .arguments import (  # noqa: E402
    DataArguments,
    HubExportArguments,
    ParsedArguments,
    parse_arguments,
    parse_overrides,
    require_positive,
)
from .data import prepare_wiki  # noqa: E402
from .demo import evaluate_loss, valid_blocks  # noqa: E402
from .eval_lm import score_split  # noqa: E402
from .hub_options import hub_request, push_if_requested  # noqa: E402
from .result_file import environment  # noqa: E402
from .tokenizer import gpt2_tokenizer, train_bpe_tokenizer  # noqa: E402
from .train_transfo_xl import encode_stream, read_documents  # noqa: E402
from .trainer_utils import (  # noqa: E402,F401  (segment_dataset: API)
    InOrderTrainer, KeepFreedCpuMemory, StateCarryingTrainer, segment_dataset)

logger = logging.getLogger("training.train_lm")

SPLITS = ("train", "valid", "test")


# --------------------------------------------------------------------------------------------------
# Arguments
# --------------------------------------------------------------------------------------------------


@dataclass
class ModelArguments:
    """The model (trained from scratch, or continued from a saved one) and its tokenizer."""

    model_name_or_path: Optional[str] = field(default=None, metadata={
        "help": "continue training this saved model (a folder or Hub id) instead of a new one from --model_type; "
                "--tokenizer_name must give its tokenizer (e.g. the same folder)"})
    model_type: str = field(default="fwp_delta_net", metadata={
        "help": "a registered model_type (fwp_linear_transformer, fwp_delta_net, fwp_delta_rnn, ...)"})
    config_overrides: Optional[str] = field(default=None, metadata={
        "help": "config fields as JSON ('{\"hidden_size\": 128}') or key=value,key=value"})
    tokenizer_name: str = field(default="bpe", metadata={
        "help": "bpe: a byte-level BPE trained on the train split; gpt2: GPT-2's BPE; else a tokenizer folder"})
    vocab_size: int = field(default=8192, metadata={"help": "BPE vocabulary size (--tokenizer_name bpe)"})


@dataclass
class LMDataArguments(DataArguments):
    """The text (``DataArguments``), its test split, segments, and the evaluation at the end."""

    test_file: Optional[str] = field(default=None, metadata={"help": "a local text file to test on"})
    data_dir: str = field(default="data/wiki", metadata={
        "help": "offline Wikipedia corpus (the data source when no dataset or file is given)"})
    block_size: int = field(default=256, metadata={"help": "tokens per training / evaluation segment"})
    carry_state: bool = field(default=False, metadata={
        "help": "carry the state between consecutive segments of a stream (full-context training)"})
    in_order: bool = field(default=False, metadata={
        "help": "read the train split in parallel streams, in order, as --carry_state does, but start every segment "
                "from an empty state (an ablation of full-context training)"})
    max_eval_tokens: Optional[int] = field(default=None, metadata={
        "help": "score only the first N tokens of each split"})


# This script's choices for Trainer options (shown by --help, overridden like any option).
TRAINING_DEFAULTS = dict(
    output_dir="outputs/train_lm", max_steps=1000, per_device_train_batch_size=8, learning_rate=1e-3,
    lr_scheduler_type="cosine", warmup_steps=100, weight_decay=0.01, adam_beta2=0.98, max_grad_norm=1.0, seed=0,
    logging_steps=10, logging_first_step=True, save_steps=500, use_cpu=not torch.cuda.is_available(),
    dataloader_drop_last=True, remove_unused_columns=False, ddp_find_unused_parameters=False,
)


def parse_args(argv: Optional[List[str]] = None) -> ParsedArguments:
    """The command line (``--help``: every option with its default); ValueError names a bad option."""
    args = parse_arguments((ModelArguments, LMDataArguments, TrainingArguments, HubExportArguments), argv,
                           description=__doc__, defaults=TRAINING_DEFAULTS)
    require_positive(args, ("per_device_train_batch_size", "learning_rate",
                            "gradient_accumulation_steps", "vocab_size", "block_size"), minimum={"block_size": 2})
    parse_overrides(args.config_overrides)  # a malformed value fails before any work
    return args


# --------------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------------


def load_documents(args: ParsedArguments) -> Dict[str, List[str]]:
    """The documents of each split (``train``, ``valid``, ``test``; a split may be empty) from the chosen source."""
    if args.dataset_name:
        raw = datasets.load_dataset(args.dataset_name, args.dataset_config_name)
        names = {"train": ["train"], "valid": ["validation", "valid"], "test": ["test"]}
        docs: Dict[str, List[str]] = {}
        for split, candidates in names.items():
            found = next((raw[c] for c in candidates if c in raw), None)
            if found is not None and args.text_column not in found.column_names:
                raise ValueError(f"--text_column {args.text_column!r} not in {found.column_names}")
            docs[split] = [t for t in found[args.text_column] if t.strip()] if found is not None else []
        if not docs["train"]:
            raise ValueError(f"--dataset_name {args.dataset_name!r} has no non-empty 'train' split")
        return docs
    if args.train_file:
        files = {"train": args.train_file, "valid": args.validation_file, "test": args.test_file}
        return {split: read_documents(Path(f)) if f else [] for split, f in files.items()}
    data_dir = Path(args.data_dir)
    if not all((data_dir / f"{s}.txt").is_file() for s in SPLITS):
        prepare_wiki(data_dir)
    return {split: read_documents(data_dir / f"{split}.txt") for split in SPLITS}


def build_tokenizer(args: ParsedArguments, train_documents: List[str]) -> PreTrainedTokenizerBase:
    """GPT-2's BPE, a byte-level BPE trained on the train documents, or a saved tokenizer. Saved to
    ``<output_dir>/tokenizer`` and reloaded from there afterwards, so that a resumed run uses the very same
    vocabulary."""
    folder = Path(args.output_dir) / "tokenizer"
    if (folder / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(folder)
    if args.tokenizer_name not in ("bpe", "gpt2"):
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_name)
        tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    elif args.tokenizer_name == "gpt2":
        tokenizer = gpt2_tokenizer()
        tokenizer.pad_token = tokenizer.eos_token
    else:
        corpus = Path(args.output_dir) / "tokenizer_train.txt"
        corpus.write_text("\n\n".join(train_documents) + "\n", encoding="utf-8")
        tokenizer = train_bpe_tokenizer(corpus, vocab_size=args.vocab_size)
        corpus.unlink()
    tokenizer.save_pretrained(folder)
    return tokenizer


# --------------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------------


def build_config(args: ParsedArguments, tokenizer: PreTrainedTokenizerBase) -> PreTrainedConfig:
    """``AutoConfig.for_model(--model_type, **overrides)`` with the tokenizer's vocabulary and special tokens."""
    overrides = parse_overrides(args.config_overrides)
    try:
        config = AutoConfig.for_model(args.model_type, **overrides)
    except ValueError as err:
        raise ValueError(f"--model_type {args.model_type!r} / --config_overrides {overrides}: {err}") from err
    unknown = [k for k in overrides if not hasattr(config, k)]
    if unknown:
        raise ValueError(f"--config_overrides: {unknown} are not fields of {type(config).__name__}")
    config.vocab_size = len(tokenizer)
    config.bos_token_id = tokenizer.bos_token_id
    config.eos_token_id = tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    return config


def build_model(args: ParsedArguments, tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel:
    """A new model of ``build_config``, or the saved ``--model_name_or_path`` (its vocabulary must be the
    tokenizer's: ValueError otherwise)."""
    if not args.model_name_or_path:
        return AutoModelForCausalLM.from_config(build_config(args, tokenizer))
    if args.config_overrides:
        raise ValueError("--config_overrides applies to a new model; with --model_name_or_path leave it out")
    model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path)
    if model.config.vocab_size != len(tokenizer):
        raise ValueError(f"--model_name_or_path {args.model_name_or_path!r} has a vocabulary of "
                         f"{model.config.vocab_size}, the tokenizer ({args.tokenizer_name!r}) {len(tokenizer)}: pass "
                         "the model's own tokenizer with --tokenizer_name")
    return model


def evaluate_split(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, split: str, documents: List[str], args: ParsedArguments
) -> List[Dict[str, Any]]:
    """Two evaluation entries (``model_cards`` format) for a split: perplexity with the state carried through the
    whole split (batch 1), and perplexity of independent segments (each read from an empty state)."""
    if not documents:
        return []
    carried = score_split(model, tokenizer, documents, args.block_size, max_tokens=args.max_eval_tokens)
    ids = encode_stream(tokenizer, documents)
    if args.max_eval_tokens:
        ids = ids[: args.max_eval_tokens]
    start = time.perf_counter()
    loss, count = evaluate_loss(model, valid_blocks(ids.tolist(), args.block_size), args.per_device_eval_batch_size)
    seconds = time.perf_counter() - start
    common = {"split": split, "segment_tokens": args.block_size}
    return [
        {**common, "name": f"{split}, carried state", "protocol": "carried_state", "loss": carried.loss,
         "perplexity": carried.perplexity, "scored_tokens": carried.num_tokens,
         "tokens_per_second": carried.tokens_per_second,
         "method": "The split is one token stream (documents separated by eos), read with batch 1 in consecutive "
                   "segments, each continuing from the previous segment's state."},
        {**common, "name": f"{split}, independent segments", "protocol": "independent_segments", "loss": loss,
         "perplexity": math.exp(loss), "scored_tokens": count, "tokens_per_second": count / max(seconds, 1e-9),
         "method": "Every segment is read from an empty state."},
    ]


def trainer_arguments(args: ParsedArguments) -> TrainingArguments:
    """The parsed ``TrainingArguments`` with Trainer's folder under the run's: checkpoints go to
    ``<output_dir>/checkpoints``; no evaluation during training (the script evaluates at the end)."""
    training = copy.copy(args.training)
    training.output_dir = str(Path(args.output_dir) / "checkpoints")
    return training


@dataclass
class TrainedModel:
    """What :func:`train_model` hands back: the trained model and tokenizer, the documents of each split, the
    parameter count, the ``"data"`` and ``"training"`` entries of ``results.json``, whether this process is the
    main one (the one that saves and evaluates), and the Trainer (``trainer.save_model`` saves the model)."""

    model: Any
    tokenizer: PreTrainedTokenizerBase
    documents: Dict[str, List[str]]
    parameters: int
    data: Dict[str, Any]
    training: Dict[str, Any]
    is_main: bool
    trainer: Trainer


def train_model(args: ParsedArguments) -> TrainedModel:
    """The training half of the script: data, tokenizer, a model from ``--model_type`` / ``--config_overrides`` (or
    ``--model_name_or_path``), Trainer (``StateCarryingTrainer`` with ``--carry_state``, ``InOrderTrainer`` with
    ``--in_order``), resumed with ``--resume_from_checkpoint``."""
    set_seed(args.seed)
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    training_args = trainer_arguments(args)
    documents = load_documents(args)
    with training_args.main_process_first(desc="tokenizer"):
        tokenizer = build_tokenizer(args, documents["train"])
    train_ids = encode_stream(tokenizer, documents["train"])
    in_order = args.carry_state or args.in_order
    num_streams = training_args.world_size * args.per_device_train_batch_size if in_order else 1
    train_ds = segment_dataset(train_ids, args.block_size, num_streams)
    logger.info("train: %d tokens -> %d segments of %d (%s)", train_ids.numel(), len(train_ds), args.block_size,
                f"{num_streams} streams, state {'carried' if args.carry_state else 'reset every segment'}"
                if in_order else "independent segments")

    model = build_model(args, tokenizer)
    model.config.use_cache = False
    n_params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    logger.info("%s: %.2fM parameters", type(model).__name__, n_params / 1e6)

    trainer_cls = StateCarryingTrainer if args.carry_state else InOrderTrainer if args.in_order else Trainer
    allocator = KeepFreedCpuMemory()
    trainer = trainer_cls(model=model, args=training_args, train_dataset=train_ds, data_collator=default_data_collator,
                          callbacks=[allocator])
    resume = True if args.resume_from_checkpoint == "latest" else args.resume_from_checkpoint
    start = time.perf_counter()
    train_output = trainer.train(resume_from_checkpoint=resume)
    train_s = time.perf_counter() - start
    steps = trainer.state.global_step
    tokens_per_step = (args.per_device_train_batch_size * training_args.world_size * args.gradient_accumulation_steps
                       * args.block_size)
    data = {"source": None if args.dataset_name else (args.train_file or str(Path(args.data_dir) / "train.txt")),
            "dataset": args.dataset_name, "tokenizer": args.tokenizer_name,
            "vocab_size": len(tokenizer), "train_tokens": int(train_ids.numel()), "train_segments": len(train_ds)}
    training = {
        "steps": steps, "block_size": args.block_size, "carry_state": args.carry_state, "in_order": in_order,
        "num_streams": num_streams, "world_size": training_args.world_size,
        "tokens_seen": steps * tokens_per_step, "seconds": train_s,
        "tokens_per_second": train_output.metrics.get("train_samples_per_second", 0.0) * args.block_size,
        "train_loss": train_output.training_loss, "resumed_from": resume if resume else None,
        "cpu_keep_freed_memory": allocator.kept,  # glibc told to keep freed memory (keep_freed_cpu_memory)
        "loss_curve": [{"step": h["step"], "loss": h["loss"]} for h in trainer.state.log_history if "loss" in h],
    }
    return TrainedModel(trainer.model, tokenizer, documents, n_params, data, training,
                        is_main=training_args.process_index == 0, trainer=trainer)


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    args = parse_args(argv)
    hub = hub_request(args)  # acted on by push_if_requested at the end, not by Trainer
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    transformers.utils.logging.disable_progress_bar()
    datasets.disable_progress_bars()
    run = train_model(args)
    results: Dict[str, Any] = {}
    if run.is_main:
        out_dir, model, tokenizer = Path(args.output_dir), run.model, run.tokenizer
        run.trainer.save_model(str(out_dir / "model"))
        tokenizer.save_pretrained(out_dir / "model")
        model.eval()
        evaluation = [e for split in ("valid", "test")
                      for e in evaluate_split(model, tokenizer, split, run.documents[split], args)]
        results = {
            "model": {"class": type(model).__name__, "model_type": model.config.model_type,
                      "parameters": run.parameters, "config": json.loads(model.config.to_json_string())},
            "data": run.data,
            "training": run.training,
            "evaluation": evaluation,
            "environment": environment(),
            "args": args.record(),
        }
        (out_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
        for entry in evaluation:
            logger.info("%s perplexity %.2f (%d tokens)", entry["name"], entry["perplexity"], entry["scored_tokens"])
        push_if_requested(hub, model, tokenizer, out_dir, results=[out_dir / "results.json"])
    leave_process_group()
    return results


if __name__ == "__main__":
    main()
