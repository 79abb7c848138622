"""Train a small word-level Transformer-XL (optionally with a Fast Weight Layer) on the offline Wikipedia text.

The papers' recipe at toy scale, on CPU (Dai et al. 2019 sec. 3.2; Clark et al. 2022 sec. 3):
- a word-level vocabulary from the train split (words seen at least --min_count times, sorted by frequency, so that
  the adaptive softmax's head cluster holds the frequent words), as a ``tokenizers`` WordLevel tokenizer;
- the train split as one token stream (each document followed by ``<eos>``) cut into --per_device_train_batch_size
  (times the processes) parallel streams; consecutive segments of --block_size tokens continue each stream, with the
  memories (and the FWL's decayed running update) carried from one segment to the next and gradients stopped at
  segment boundaries (``training.trainer_utils.StateCarryingTrainer``);
- AdamW, linear warm-up then cosine decay to 10% of the peak, gradient clipping at 0.25, for --max_train_minutes, or
  --max_steps (then Trainer's ``cosine_with_min_lr`` schedule; ``--max_steps 0`` saves the initial model).

``python -m training.train_transfo_xl --output_dir outputs/transfo_xl [--use_fwl] [--max_train_minutes 3]`` writes
the model and tokenizer (``save_pretrained``) and ``train_log.json``. Every ``TrainingArguments`` option works
(``--bf16``, ``--report_to``, ...); ``--help`` lists them with their defaults.

Continued training: ``--model_name_or_path DIR`` starts from a model saved by this script (its architecture,
tokenizer and weights; ``--use_fwl`` attaches a new FWL head, ``--fwl_residual`` one that starts as the identity) and
continues the data streams where that run stopped (``--start_segment``, default: the steps of DIR's
``train_log.json``). Continuing
the base model and attaching the FWL from the same checkpoint, for the same steps on the same data, compares the two
at equal training (``benchmarks/bench_transfo_xl.py``).
"""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import copy  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import time  # noqa: E402
from collections import Counter  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple  # noqa: E402

import torch  # noqa: E402
from transformers import TrainingArguments, default_data_collator  # noqa: E402

import model_cards  # noqa: E402,F401  (registers the card publisher: the saved model gets this project's card)
from modeling_fwp import TransfoXLConfig, TransfoXLForCausalLM  # noqa: E402
from modeling_fwp.convert_transfo_xl import build_word_level_tokenizer  # noqa: E402

from .arguments import ParsedArguments, parse_arguments, require_positive  # noqa: E402
from .trainer_utils import KeepFreedCpuMemory, StateCarryingTrainer, budget_optimizers, segment_dataset  # noqa: E402

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger("training.train_transfo_xl")

SPECIALS = ["<eos>", "<unk>"]


def read_documents(path: Path) -> List[str]:
    """Documents of a prepared split (``training.data`` layout: blocks separated by blank lines)."""
    text = Path(path).read_text(encoding="utf-8")
    return [block.strip() for block in text.split("\n\n") if block.strip()]


def build_word_vocabulary(documents: List[str], min_count: int = 3, max_size: Optional[int] = None) -> List[str]:
    """``<eos>``, ``<unk>``, then the words seen at least `min_count` times, most frequent first (ties by first
    occurrence), with the same word splitting as ``build_word_level_tokenizer(split_punctuation=True)``."""
    from tokenizers import pre_tokenizers

    split = pre_tokenizers.Whitespace()
    counts: Counter = Counter()
    for doc in documents:
        counts.update(word for word, _ in split.pre_tokenize_str(doc))
    words = [w for w, c in counts.most_common() if c >= min_count and w not in SPECIALS]
    return SPECIALS + words[: None if max_size is None else max_size - len(SPECIALS)]


def encode_stream(tokenizer: PreTrainedTokenizerBase, documents: List[str]) -> torch.Tensor:
    """One stream of ids: every document followed by ``<eos>``."""
    ids: List[int] = []
    for doc in documents:
        ids.extend(tokenizer(doc, add_special_tokens=False).input_ids + [tokenizer.eos_token_id])
    return torch.tensor(ids, dtype=torch.long)


def default_cutoffs(vocab_size: int) -> List[int]:
    """Head cluster of about the 15% most frequent words, a middle cluster up to 45% (two tails)."""
    cutoffs = [max(2, vocab_size * 15 // 100), max(3, vocab_size * 45 // 100)]
    return [c for c in cutoffs if c < vocab_size]


def small_config(vocab_size: int, args: ParsedArguments) -> TransfoXLConfig:
    """The model of the arguments (``--hidden_size``, ``--num_hidden_layers``, ...) for a `vocab_size`-word
    vocabulary, with adaptive-softmax cutoffs from :func:`default_cutoffs`."""
    heads = args.num_attention_heads
    return TransfoXLConfig(
        vocab_size=vocab_size, cutoffs=default_cutoffs(vocab_size), hidden_size=args.hidden_size,
        embedding_size=args.hidden_size, num_attention_heads=heads, head_dim=args.hidden_size // heads,
        intermediate_size=4 * args.hidden_size, num_hidden_layers=args.num_hidden_layers, div_val=2, tie_projs=None,
        mem_len=args.mem_len, clamp_len=4 * args.mem_len, same_length=True, hidden_dropout=args.hidden_dropout,
        attention_dropout=0.0, eos_token_id=0, use_fwl=args.use_fwl, fwl_step_size_init=args.fwl_step_size_init,
        fwl_segment_length=args.block_size, fwl_residual=args.fwl_residual, pre_lnorm=args.pre_lnorm,
    )


def continued_model(
    directory: Path, args: Any
) -> Tuple[TransfoXLForCausalLM, PreTrainedTokenizerBase, int]:
    """(model, tokenizer, first data segment) to continue the run saved in `directory`: its architecture and weights,
    plus a new FWL head when ``args.use_fwl`` (the only parameters not found in the checkpoint)."""
    from transformers import AutoTokenizer

    saved = TransfoXLForCausalLM.from_pretrained(directory)
    if saved.config.use_fwl and not args.use_fwl:
        raise ValueError(f"--model_name_or_path {directory} holds an FWL model; continuing it needs --use_fwl")
    fields = {k: v for k, v in saved.config.to_dict().items() if k in TransfoXLConfig.__dataclass_fields__}
    if args.use_fwl and not saved.config.use_fwl:
        fields = {k: v for k, v in fields.items() if not k.startswith("fwl_")}
        fields.update(use_fwl=True, fwl_step_size_init=args.fwl_step_size_init, fwl_segment_length=args.block_size,
                      fwl_residual=args.fwl_residual)
    fields["hidden_dropout"] = args.hidden_dropout
    model = TransfoXLForCausalLM(TransfoXLConfig(**fields))
    missing, unexpected = model.load_state_dict(saved.state_dict(), strict=False)
    new = [name for name in missing if not name.startswith(("fwl_head.", "fwl_decay."))]
    if new or unexpected:
        raise ValueError(f"--model_name_or_path {directory} does not match the model: missing {new}, "
                         f"unexpected {unexpected}")
    log_path = directory / "train_log.json"
    log = json.loads(log_path.read_text()) if log_path.exists() else {}
    next_segment = (log.get("start_segment") or 0) + log.get("steps", 0)
    return model, AutoTokenizer.from_pretrained(args.tokenizer_name or directory), next_segment


def train(
    model: TransfoXLForCausalLM, stream: torch.Tensor, args: ParsedArguments, start_segment: int = 0
) -> Dict[str, Any]:
    """Truncated BPTT over ``world_size * per_device_train_batch_size`` parallel streams with carried memories
    (``StateCarryingTrainer``), from segment `start_segment` of the streams (memories start empty); the FWL's own
    parameters (``fwl_*``) train at ``--fwl_learning_rate``. Returns the log dict."""
    training_args = copy.copy(args.training)
    num_streams = training_args.world_size * args.per_device_train_batch_size
    data = segment_dataset(stream, args.block_size, num_streams, next_token_labels=True, start_segment=start_segment)
    fwl_rate = [(lambda name: name.startswith("fwl_"), args.fwl_learning_rate or args.learning_rate)]
    optimizers, budget = budget_optimizers(model, training_args, args.max_train_minutes, fwl_rate)
    trainer = StateCarryingTrainer(
        model=model, args=training_args, train_dataset=data, data_collator=default_data_collator,
        optimizers=optimizers, callbacks=[budget, KeepFreedCpuMemory()],
        forward_kwargs={"logits_to_keep": 1},  # the loss needs no logits
    )
    start = time.perf_counter()
    output = trainer.train()
    seconds = time.perf_counter() - start
    model.eval()
    steps = trainer.state.global_step
    tokens = steps * num_streams * args.gradient_accumulation_steps * args.block_size
    history = [{"step": h["step"], "loss": h["loss"]} for h in trainer.state.log_history if "loss" in h]
    return {
        "steps": steps, "seconds": round(seconds, 1), "tokens": tokens, "stopped_by_budget": budget.stopped_by_budget,
        "train_tokens_per_second": round(tokens / max(seconds, 1e-9), 1),
        # the last logged loss (over --logging_steps steps), else the mean over the run
        "final_train_loss": history[-1]["loss"] if history else output.training_loss, "history": history,
    }


@dataclass
class TransfoXLModelArguments:
    """The model: a new one of this size, or one saved by this script (continued); its vocabulary; the FWL."""

    model_name_or_path: Optional[str] = field(default=None, metadata={
        "help": "continue from a model saved by this script (its architecture, tokenizer and weights)"})
    tokenizer_name: Optional[str] = field(default=None, metadata={
        "help": "a saved tokenizer folder to reuse; unset: a word-level vocabulary of the train split"})
    min_count: int = field(default=3, metadata={"help": "words seen fewer times are <unk>"})
    hidden_size: int = field(default=128, metadata={"help": "model width"})
    num_hidden_layers: int = field(default=4, metadata={"help": "layers"})
    num_attention_heads: int = field(default=4, metadata={"help": "heads"})
    mem_len: int = field(default=64, metadata={"help": "memory length (tokens kept from earlier segments)"})
    hidden_dropout: float = field(default=0.1, metadata={"help": "dropout"})
    pre_lnorm: bool = field(default=False, metadata={"help": "pre-LayerNorm blocks"})
    use_fwl: bool = field(default=False, metadata={"help": "train Transformer-XL + FWL"})
    fwl_residual: bool = field(default=False, metadata={"help": "FWL reads h + f(h), starting as the identity"})
    fwl_step_size_init: float = field(default=0.01, metadata={"help": "initial step size of the fast updates"})
    fwl_learning_rate: Optional[float] = field(default=None, metadata={
        "help": "learning rate of the FWL's own parameters; unset: --learning_rate"})


@dataclass
class TransfoXLDataArguments:
    """The corpus, the segments and the budget."""

    data_dir: str = field(default="data/wiki", metadata={"help": "prepared corpus folder (train.txt)"})
    block_size: int = field(default=64, metadata={"help": "tokens per segment of each stream"})
    start_segment: Optional[int] = field(default=None, metadata={
        "help": "first segment of the data streams; unset: 0, or the steps of --model_name_or_path's run"})
    max_train_minutes: float = field(default=3.0, metadata={
        "help": "wall-clock training budget (--max_steps: a fixed number of steps, still capped by it)"})
    threads: Optional[int] = field(default=None, metadata={"help": "torch threads; unset: torch's"})


# This script's choices for Trainer options (shown by --help, overridden like any option); --max_steps -1: as many
# steps as fit in --max_train_minutes.
TRAINING_DEFAULTS = dict(
    output_dir="outputs/transfo_xl", per_device_train_batch_size=16, learning_rate=1e-3, warmup_steps=50,
    weight_decay=0.01, max_grad_norm=0.25, lr_scheduler_type="cosine_with_min_lr",
    lr_scheduler_kwargs={"min_lr_rate": 0.1}, seed=0, logging_steps=50, save_strategy="no",
    use_cpu=not torch.cuda.is_available(), disable_tqdm=True, dataloader_drop_last=True, remove_unused_columns=False,
)


def parse_args(argv: Optional[List[str]] = None) -> ParsedArguments:
    """The command line (``--help``: every option with its default); ValueError names a bad option."""
    args = parse_arguments((TransfoXLModelArguments, TransfoXLDataArguments, TrainingArguments), argv,
                           description=__doc__, defaults=TRAINING_DEFAULTS)
    require_positive(args, ("block_size", "mem_len", "hidden_size", "num_hidden_layers", "num_attention_heads",
                            "per_device_train_batch_size", "learning_rate", "max_train_minutes"))
    if args.hidden_size % args.num_attention_heads:
        raise ValueError(f"--hidden_size {args.hidden_size} is not a multiple of --num_attention_heads "
                         f"{args.num_attention_heads}")
    return args


def main(argv: Optional[List[str]] = None) -> Dict[str, object]:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    data_dir, out = Path(args.data_dir), Path(args.output_dir)
    train_docs = read_documents(data_dir / "train.txt")
    if args.tokenizer_name:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_name)
    else:
        symbols = build_word_vocabulary(train_docs, args.min_count)
        tokenizer = build_word_level_tokenizer(symbols, split_punctuation=True)
    start_segment = args.start_segment or 0
    if args.model_name_or_path:
        model, tokenizer, start = continued_model(Path(args.model_name_or_path), args)
        start_segment = start if args.start_segment is None else args.start_segment
        config = model.config
    stream = encode_stream(tokenizer, train_docs)
    if not args.model_name_or_path:
        config = small_config(len(tokenizer), args)
        model = TransfoXLForCausalLM(config)
    logger.info("vocabulary %d words, cutoffs %s, %.2fM parameters, %d train tokens", len(tokenizer), config.cutoffs,
                sum(p.numel() for p in model.parameters()) / 1e6, stream.numel())
    untrained = {"steps": 0, "seconds": 0.0, "final_train_loss": None}  # --max_steps 0: the initial model
    log = train(model, stream, args, start_segment) if args.max_steps != 0 else untrained
    log.update(args.record(), vocab_size=len(tokenizer), parameters=sum(p.numel() for p in model.parameters()))
    log["start_segment"] = start_segment
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "train_log.json").write_text(json.dumps(log, indent=2) + "\n")
    logger.info("saved %s after %d steps (%.0f s), final train loss %s", out, log["steps"], log["seconds"],
                log["final_train_loss"])
    return log


if __name__ == "__main__":
    main()
