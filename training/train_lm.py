"""Train any causal LM of this package from scratch on a text dataset, with the papers' language-modelling protocol.

Protocol (Schlag et al. 2021 sec. 6.3; Irie et al. 2021 sec. 4.1 and appendix A.1): the train split is one token stream (every document
followed by the tokenizer's eos), cut into fixed-length segments of ``--segment_length`` tokens (256 by default).

- Without ``--carry_state`` every segment is an independent training example (shuffled), read from an empty state.
- With ``--carry_state`` ("full context" training) the stream is cut into ``world_size * batch_size`` parallel
  streams, and batch row ``b`` of step ``i`` holds segment ``i`` of stream ``b``: the data are read in order (no
  shuffling) and the fast-weight state of each row is carried from one step to the next through
  ``cache``, detached at every segment boundary (truncated back-propagation). The state is reset at the
  start of every epoch and when resuming from a checkpoint.

Evaluation (valid and test) reports both protocols: perplexity with the state carried over the whole split (batch 1,
``training.eval_lm.score_split``) and perplexity of independent segments (``training.demo.evaluate_loss``).

Data: ``--dataset_name`` (any ``datasets.load_dataset`` name, with ``--dataset_config_name`` / ``--text_column``), or
local text files (``--train_file`` / ``--validation_file`` / ``--test_file``, documents separated by blank lines), or
by default the offline Wikipedia corpus (``training.data``, prepared into ``--data_dir`` when missing).

    python -m training.train_lm --model_type fwp_delta_net \\
        --config_overrides hidden_size=128,num_hidden_layers=2,feature_map=dpfp --max_steps 200 --carry_state \\
        --output_dir outputs/train_lm_delta_net
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

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Dict, List, Optional  # noqa: E402

import datasets  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from torch.utils.data import SequentialSampler  # noqa: E402
from transformers import (  # noqa: E402
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedConfig,
    PreTrainedTokenizerBase,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    default_data_collator,
    set_seed,
)

import modeling_fwp  # noqa: E402,F401  (registers the Auto classes)
from modeling_fwp.cache_fwp import output_cache  # noqa: E402

from . import leave_process_group  # noqa: E402
from .data import prepare_wiki  # noqa: E402
from .demo import evaluate_loss, valid_blocks  # noqa: E402
from .dynamic_eval import detach_cache  # noqa: E402
from .eval_lm import score_split  # noqa: E402
from .hub_options import add_hub_arguments, args_without_secrets, push_if_requested  # noqa: E402
from .tokenizer import gpt2_tokenizer, train_bpe_tokenizer  # noqa: E402
from .train_transfo_xl import encode_stream, read_documents  # noqa: E402

logger = logging.getLogger("training.train_lm")

SPLITS = ("train", "valid", "test")


# --------------------------------------------------------------------------------------------------
# Arguments
# --------------------------------------------------------------------------------------------------


def parse_overrides(text: Optional[str]) -> Dict[str, Any]:
    """``--config_overrides`` as a dict: a JSON object, or ``key=value`` pairs separated by commas (each value read
    as JSON when it parses, else as a string: ``hidden_size=128,feature_map=dpfp,sum_normalization=false``)."""
    if not text:
        return {}
    text = text.strip()
    if text.startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"--config_overrides is not valid JSON: {err}") from err
        if not isinstance(value, dict):
            raise ValueError(f"--config_overrides must be a JSON object, got {type(value).__name__}")
        return value
    overrides: Dict[str, Any] = {}
    for pair in filter(None, (p.strip() for p in text.split(","))):
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--config_overrides: expected key=value, got {pair!r}")
        try:
            overrides[key.strip()] = json.loads(raw)
        except json.JSONDecodeError:
            overrides[key.strip()] = raw
    return overrides


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = p.add_argument_group("model")
    g.add_argument("--model_type", default="fwp_delta_net",
                   help="a registered model_type (fwp_linear_transformer, fwp_delta_net, fwp_delta_rnn, ...)")
    g.add_argument("--config_overrides", default=None,
                   help="config fields as JSON ('{\"hidden_size\": 128}') or key=value,key=value")
    g = p.add_argument_group("data")
    g.add_argument("--dataset_name", default=None, help="datasets.load_dataset name (e.g. wikitext)")
    g.add_argument("--dataset_config_name", default=None, help="its configuration (e.g. wikitext-103-raw-v1)")
    g.add_argument("--text_column", default="text")
    g.add_argument("--train_file", default=None)
    g.add_argument("--validation_file", default=None)
    g.add_argument("--test_file", default=None)
    g.add_argument("--data_dir", default="data/wiki", help="offline Wikipedia corpus (default data source)")
    g.add_argument("--tokenizer", default="bpe", choices=["bpe", "gpt2"],
                   help="bpe: byte-level BPE trained on the train split; gpt2: GPT-2's BPE")
    g.add_argument("--vocab_size", type=int, default=8192, help="BPE vocabulary size (--tokenizer bpe)")
    g.add_argument("--segment_length", type=int, default=256, help="tokens per training/evaluation segment")
    g.add_argument("--carry_state", action="store_true",
                   help="carry the state between consecutive segments of a stream (full-context training)")
    g = p.add_argument_group("training")
    g.add_argument("--output_dir", default="outputs/train_lm")
    g.add_argument("--max_steps", type=int, default=1000)
    g.add_argument("--batch_size", type=int, default=8, help="per-process batch size")
    g.add_argument("--gradient_accumulation_steps", type=int, default=1)
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--warmup_steps", type=int, default=100)
    g.add_argument("--weight_decay", type=float, default=0.01)
    g.add_argument("--max_grad_norm", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--logging_steps", type=int, default=10)
    g.add_argument("--save_steps", type=int, default=500)
    g.add_argument("--resume_from_checkpoint", default=None,
                   help="a checkpoint folder, or 'latest' for the newest one under <output_dir>/checkpoints")
    g = p.add_argument_group("evaluation")
    g.add_argument("--eval_max_tokens", type=int, default=None, help="score only the first N tokens of each split")
    g.add_argument("--eval_batch_size", type=int, default=8, help="batch size of the independent-segment evaluation")
    add_hub_arguments(p)
    args = p.parse_args(argv)
    for name in ("max_steps", "batch_size", "segment_length", "lr", "gradient_accumulation_steps", "vocab_size"):
        if getattr(args, name) <= 0:
            p.error(f"--{name} must be positive, got {getattr(args, name)}")
    if args.segment_length < 2:
        p.error(f"--segment_length must be at least 2, got {args.segment_length}")
    if args.dataset_name and args.train_file:
        p.error("give either --dataset_name or --train_file, not both")
    try:
        args.overrides = parse_overrides(args.config_overrides)
    except ValueError as err:
        p.error(str(err))
    return args


# --------------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------------


def load_documents(args: argparse.Namespace) -> Dict[str, List[str]]:
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


def build_tokenizer(args: argparse.Namespace, train_documents: List[str]) -> PreTrainedTokenizerBase:
    """GPT-2's BPE, or a byte-level BPE trained on the train documents. Saved to ``<output_dir>/tokenizer`` and
    reloaded from there afterwards, so that a resumed run uses the very same vocabulary."""
    folder = Path(args.output_dir) / "tokenizer"
    if (folder / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(folder)
    if args.tokenizer == "gpt2":
        tokenizer = gpt2_tokenizer()
        tokenizer.pad_token = tokenizer.eos_token
    else:
        corpus = Path(args.output_dir) / "tokenizer_train.txt"
        corpus.write_text("\n\n".join(train_documents) + "\n", encoding="utf-8")
        tokenizer = train_bpe_tokenizer(corpus, vocab_size=args.vocab_size)
        corpus.unlink()
    tokenizer.save_pretrained(folder)
    return tokenizer


def segment_dataset(ids: torch.Tensor, segment_length: int, num_streams: int = 1) -> datasets.Dataset:
    """Fixed-length segments (``input_ids``, ``labels``) of the token stream ``ids``.

    ``num_streams == 1``: segments in stream order. ``num_streams == S``: the stream is cut into S equal parallel
    streams of ``n`` whole segments each (the remainder is dropped) and example ``i * S + s`` is segment ``i`` of
    stream ``s``; read in order with per-process batch size B and S = world_size * B, row b of process p's step i
    then always continues the row of step i - 1 (accelerate hands process p the batches p, p + W, p + 2W, ...).
    """
    if num_streams < 1:
        raise ValueError(f"`num_streams` must be >= 1, got {num_streams}")
    per_stream = ids.numel() // num_streams // segment_length
    if per_stream == 0:
        raise ValueError(
            f"the train split ({ids.numel()} tokens) is too short for {num_streams} streams of --segment_length "
            f"{segment_length}"
        )
    streams = ids[: num_streams * per_stream * segment_length].view(num_streams, per_stream, segment_length)
    segments = streams.transpose(0, 1).reshape(-1, segment_length)  # [per_stream * S, L], segment-major
    return datasets.Dataset.from_dict({"input_ids": segments.tolist(), "labels": segments.tolist()}).with_format("torch")


# --------------------------------------------------------------------------------------------------
# Trainer with carried state
# --------------------------------------------------------------------------------------------------


class StateCarryingTrainer(Trainer):
    """``Trainer`` that reads the train set in order and passes each step's final state (``cache``,
    detached) to the next step. Only meaningful with ``segment_dataset(..., num_streams=world_size * batch)``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.carried_state = None
        self.add_callback(_ResetStateCallback(self))

    def _get_train_sampler(self, train_dataset=None) -> SequentialSampler:
        return SequentialSampler(train_dataset if train_dataset is not None else self.train_dataset)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if not model.training:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        state = self.carried_state
        outputs = model(**inputs, cache=state, use_cache=True, num_items_in_batch=num_items_in_batch)
        # Stop gradients at the segment boundary; the graph of this step is already built.
        self.carried_state = detach_state(output_cache(outputs))
        loss = outputs.loss
        if self.args.average_tokens_across_devices and self.model_accepts_loss_kwargs and num_items_in_batch is not None:
            loss = loss * self.accelerator.num_processes  # as Trainer.compute_loss does
        return (loss, outputs) if return_outputs else loss


def detach_state(cache: Any) -> Any:
    """The cache with gradients stopped: every tensor in it, nested caches included (an FWL model's ``base_cache``,
    e.g. a Llama's keys and values), see ``training.dynamic_eval.detach_cache``."""
    return detach_cache(cache)


class _ResetStateCallback(TrainerCallback):
    """Starts every epoch (and a resumed run) from an empty state."""

    def __init__(self, trainer: StateCarryingTrainer) -> None:
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        self.trainer.carried_state = None

    def on_epoch_begin(self, args, state, control, **kwargs):
        self.trainer.carried_state = None


# --------------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------------


def build_config(args: argparse.Namespace, tokenizer: PreTrainedTokenizerBase) -> PreTrainedConfig:
    """``AutoConfig.for_model(--model_type, **overrides)`` with the tokenizer's vocabulary and special tokens."""
    try:
        config = AutoConfig.for_model(args.model_type, **args.overrides)
    except ValueError as err:
        raise ValueError(f"--model_type {args.model_type!r} / --config_overrides {args.overrides}: {err}") from err
    unknown = [k for k in args.overrides if not hasattr(config, k)]
    if unknown:
        raise ValueError(f"--config_overrides: {unknown} are not fields of {type(config).__name__}")
    config.vocab_size = len(tokenizer)
    config.bos_token_id = tokenizer.bos_token_id
    config.eos_token_id = tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    return config


def evaluate_split(model, tokenizer, split: str, documents: List[str], args: argparse.Namespace) -> List[Dict[str, Any]]:
    """Two evaluation entries (``model_cards`` format) for a split: perplexity with the state carried through the
    whole split (batch 1), and perplexity of independent segments (each read from an empty state)."""
    if not documents:
        return []
    carried = score_split(model, tokenizer, documents, args.segment_length, max_tokens=args.eval_max_tokens)
    ids = encode_stream(tokenizer, documents)
    if args.eval_max_tokens:
        ids = ids[: args.eval_max_tokens]
    start = time.perf_counter()
    loss, count = evaluate_loss(model, valid_blocks(ids.tolist(), args.segment_length), args.eval_batch_size)
    seconds = time.perf_counter() - start
    common = {"split": split, "segment_tokens": args.segment_length}
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


def build_training_arguments(args: argparse.Namespace, out_dir: Path) -> TrainingArguments:
    """``TrainingArguments`` of the run: cosine schedule with warmup, checkpoints every ``--save_steps`` under
    ``<out_dir>/checkpoints``, no evaluation during training (the script evaluates at the end)."""
    return TrainingArguments(
        output_dir=str(out_dir / "checkpoints"),
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        max_steps=args.max_steps,
        learning_rate=args.lr,
        lr_scheduler_type="cosine",
        warmup_steps=args.warmup_steps,
        weight_decay=args.weight_decay,
        adam_beta2=0.98,
        max_grad_norm=args.max_grad_norm,
        logging_steps=args.logging_steps,
        logging_first_step=True,
        save_strategy="steps",
        save_steps=args.save_steps,
        eval_strategy="no",
        report_to="none",
        use_cpu=not torch.cuda.is_available(),
        seed=args.seed,
        data_seed=args.seed,
        dataloader_drop_last=True,
        remove_unused_columns=False,
        ddp_find_unused_parameters=False,
    )


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    transformers.utils.logging.disable_progress_bar()
    datasets.disable_progress_bars()
    set_seed(args.seed)
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    training_args = build_training_arguments(args, out_dir)
    is_main = training_args.process_index == 0

    documents = load_documents(args)
    with training_args.main_process_first(desc="tokenizer"):
        tokenizer = build_tokenizer(args, documents["train"])
    train_ids = encode_stream(tokenizer, documents["train"])
    num_streams = training_args.world_size * args.batch_size if args.carry_state else 1
    train_ds = segment_dataset(train_ids, args.segment_length, num_streams)
    logger.info("train: %d tokens -> %d segments of %d (%s)", train_ids.numel(), len(train_ds), args.segment_length,
                f"{num_streams} streams, state carried" if args.carry_state else "independent segments")

    config = build_config(args, tokenizer)
    model = AutoModelForCausalLM.from_config(config)
    model.config.use_cache = False
    n_params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    logger.info("%s: %.2fM parameters", type(model).__name__, n_params / 1e6)

    trainer_cls = StateCarryingTrainer if args.carry_state else Trainer
    trainer = trainer_cls(model=model, args=training_args, train_dataset=train_ds, data_collator=default_data_collator)
    resume = args.resume_from_checkpoint
    if resume == "latest":
        resume = True
    start = time.perf_counter()
    train_output = trainer.train(resume_from_checkpoint=resume)
    train_s = time.perf_counter() - start
    steps = trainer.state.global_step
    tokens_per_step = args.batch_size * training_args.world_size * args.gradient_accumulation_steps * args.segment_length
    results: Dict[str, Any] = {}
    if is_main:
        model = trainer.model
        model_dir = out_dir / "model"
        trainer.save_model(str(model_dir))
        tokenizer.save_pretrained(model_dir)
        model.eval()
        evaluation = [e for split in ("valid", "test") for e in evaluate_split(model, tokenizer, split, documents[split], args)]
        results = {
            "model": {"class": type(model).__name__, "model_type": config.model_type, "parameters": n_params,
                      "config": json.loads(model.config.to_json_string())},
            "data": {"source": None if args.dataset_name else (args.train_file or str(Path(args.data_dir) / "train.txt")),
                     "dataset": args.dataset_name, "tokenizer": args.tokenizer,
                     "vocab_size": len(tokenizer), "train_tokens": int(train_ids.numel()),
                     "train_segments": len(train_ds)},
            "training": {
                "steps": steps, "segment_length": args.segment_length, "carry_state": args.carry_state,
                "num_streams": num_streams, "world_size": training_args.world_size,
                "tokens_seen": steps * tokens_per_step, "seconds": train_s,
                "tokens_per_second": train_output.metrics.get("train_samples_per_second", 0.0) * args.segment_length,
                "train_loss": train_output.training_loss, "resumed_from": resume if resume else None,
                "loss_curve": [{"step": h["step"], "loss": h["loss"]} for h in trainer.state.log_history if "loss" in h],
            },
            "evaluation": evaluation,
            "environment": {"python": platform.python_version(), "torch": torch.__version__,
                            "transformers": transformers.__version__, "threads": torch.get_num_threads()},
            "args": args_without_secrets(args),
        }
        (out_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
        for entry in evaluation:
            logger.info("%s perplexity %.2f (%d tokens)", entry["name"], entry["perplexity"], entry["scored_tokens"])
        push_if_requested(args, model, tokenizer, out_dir, results=[out_dir / "results.json"])
    leave_process_group()
    return results


if __name__ == "__main__":
    main()
