"""Perplexity over long documents with carried state: the papers' evaluation protocol, for any causal LM of
modeling_fwp (Transformer-XL, Transformer-XL + FWL, the Delta Net family, FWLForCausalLM) or of transformers (e.g.
SmolLM2, a Llama, with its key/value cache carried), optionally with dynamic evaluation (Krause et al. 2019) as the
baseline (``training.dynamic_eval``).

Protocol (Dai et al. 2019 sec. 4; Clark et al. 2022 sec. 3): batch 1; the split is one token stream (every document
followed by the tokenizer's eos; ``--per_document`` restarts the state at every document instead); it is read in
consecutive segments of ``--block_size`` tokens, each continuing from the previous segment's cache (memories,
fast weights, FWL running update); every token but the first is scored exactly once. Transformer-XL's memory length
can be changed with ``--mem_len`` (the papers evaluate with longer memories than they train with).

``--eval_mode sliding_window`` is the papers' protocol for models with a limited context (Schlag et al. 2021 sec.
6.3; Irie et al. 2021 appendix A.1; Al-Rfou et al. 2019): no state is carried between windows; every token is
predicted from at most the previous ``--window_size`` tokens (default: ``--block_size``, the training span). The
first window scores all its positions; each later window ends ``--stride`` tokens further and scores only its last
``--stride`` positions (the last window: the tokens left), so every token but the first is scored exactly once. The
papers use stride 1; stride == window scores independent consecutive segments. Works for every causal LM (ours,
transformers' Llama, ...): one plain forward per window, windows batched by ``--per_device_eval_batch_size``.

    python -m training.eval_lm --model_name_or_path outputs/transfo_xl outputs/transfo_xl_fwl --split test \\
        --dynamic_eval --dynamic_lr 1e-3 3e-3 --results_file outputs/eval_lm.json     # or: fwp-eval-lm ...
    python -m training.eval_lm --model_name_or_path outputs/train_lm/model --eval_mode sliding_window \
        --window_size 256 --stride 32

Dynamic evaluation adapts every parameter, or those named by ``--dynamic_eval_params`` (names or globs, e.g.
``'model.layers.*.mlp.*'``), with plain SGD steps or Krause et al.'s RMS-normalised steps (``--dynamic_method rms``).
Its step size is chosen on the valid split first (lowest perplexity among ``--dynamic_lr``, by default a small grid
per method; one value skips the choice), then used on ``--split``; the rows report the chosen value, the perplexities
tried and the time per token. ``--help`` lists every option with its default.
"""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import inspect  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
import logging  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import TYPE_CHECKING, Callable, Dict, Iterator, List, Literal, Optional, Tuple  # noqa: E402

import torch  # noqa: E402

import modeling_fwp  # noqa: E402,F401  (registers the Auto classes)

from .arguments import ParsedArguments, parse_arguments, require_positive  # noqa: E402
from .dynamic_eval import (  # noqa: E402
    DEFAULT_STEP_SIZES,
    DynamicEvaluation,
    ScoreResult,
    choose_step_size,
    eval_mode,
    score_stream,
)
from .train_transfo_xl import encode_stream, read_documents  # noqa: E402

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger("training.eval_lm")


def load_model_and_tokenizer(
    path: str, tokenizer_path: Optional[str] = None, mem_len: Optional[int] = None
) -> Tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The causal LM at `path` (eval mode) and its tokenizer (from `tokenizer_path` if given); `mem_len` overrides a
    Transformer-XL's memory length (a ValueError for other models)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path or path)
    if mem_len is not None:
        if not hasattr(model.config, "mem_len"):
            raise ValueError(f"--mem_len applies to Transformer-XL models; {path} is a {model.config.model_type}")
        model.config.mem_len = mem_len
    return model, tokenizer


def split_streams(
    tokenizer: PreTrainedTokenizerBase, documents: List[str], per_document: bool = False,
    max_tokens: Optional[int] = None,
) -> List[torch.Tensor]:
    """The token streams [N] a split is scored as: one stream of every document (each followed by eos), or one per
    document with `per_document`; `max_tokens` keeps only the first N tokens in all; streams under 2 tokens dropped."""
    groups = [[doc] for doc in documents] if per_document else [documents]
    streams, budget = [], max_tokens
    for group in groups:
        ids = encode_stream(tokenizer, group)
        if budget is not None:
            if budget <= 1:
                break
            ids = ids[:budget]
            budget -= ids.numel()
        if ids.numel() >= 2:
            streams.append(ids)
    return streams


def score_split(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, documents: List[str], segment_length: int,
    per_document: bool = False, dynamic: Optional[DynamicEvaluation] = None, max_tokens: Optional[int] = None,
) -> ScoreResult:
    """Scores a split (one stream, or each document alone) with the state carried, and returns the merged result."""
    result = ScoreResult()
    for ids in split_streams(tokenizer, documents, per_document, max_tokens):
        result = result.merge(score_stream(model, ids[None], segment_length, dynamic=dynamic))
    return result


def sliding_windows(num_tokens: int, window_size: int, stride: int) -> Iterator[Tuple[int, int, int]]:
    """The windows over a stream of `num_tokens` tokens: ``(start, end, first_scored)``, the window's inputs being
    ``ids[start:end]`` (at most `window_size` tokens), its targets ``ids[start + 1 : end + 1]``, and the positions
    ``first_scored .. end - 1`` scored. The first window scores all its positions, each later one the `stride` (the
    last: fewer) positions after the previous window's end; together every position 0 .. num_tokens - 2 once."""
    if window_size < 1:
        raise ValueError(f"`window_size` must be >= 1, got {window_size}")
    if not 1 <= stride <= window_size:
        raise ValueError(f"`stride` must be between 1 and `window_size` ({window_size}), got {stride}")
    last = num_tokens - 1  # positions that have a next token
    end = min(window_size, last)
    if end > 0:
        yield 0, end, 0
    while end < last:
        start, scored_from, end = max(0, min(end + stride, last) - window_size), end, min(end + stride, last)
        yield start, end, scored_from


def _window_nll(model: PreTrainedModel, inputs: torch.Tensor, targets: torch.Tensor, scored: List[int]) -> float:
    """Summed NLL of the last ``scored[b]`` targets of every row b of ``inputs [B, W]`` (one plain forward, no
    cache)."""
    kwargs = {"input_ids": inputs, "use_cache": False}
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        kwargs["logits_to_keep"] = max(scored)
    logits = model(**kwargs).logits
    total = 0.0
    for b, n in enumerate(scored):
        log_probs = torch.log_softmax(logits[b, -n:].float(), dim=-1)
        total -= float(log_probs.gather(-1, targets[b, -n:, None]).sum())
    return total


@torch.no_grad()
def score_sliding_window(
    model: PreTrainedModel, input_ids: torch.Tensor, window_size: int, stride: int, batch_size: int = 8
) -> ScoreResult:
    """Sliding-window scoring of the stream ``input_ids [N]`` (:func:`sliding_windows`): every window read from an
    empty state, `batch_size` windows per forward (they are independent: batching changes no score)."""
    if input_ids.dim() != 1 or input_ids.numel() < 2:
        raise ValueError(f"`input_ids` must be one stream [>= 2 tokens], got {tuple(input_ids.shape)}")
    if batch_size < 1:
        raise ValueError(f"`batch_size` must be >= 1, got {batch_size}")
    ids = input_ids.to(next(model.parameters()).device)
    windows = list(sliding_windows(ids.numel(), window_size, stride))
    result = ScoreResult()
    with eval_mode(model):
        # only the first window can be shorter than the others: it runs alone
        for batch in [windows[:1]] + [windows[i : i + batch_size] for i in range(1, len(windows), batch_size)]:
            if not batch:
                continue
            begin = time.perf_counter()
            inputs = torch.stack([ids[a:e] for a, e, _ in batch])
            targets = torch.stack([ids[a + 1 : e + 1] for a, e, _ in batch])
            scored = [e - f for _, e, f in batch]
            nll = _window_nll(model, inputs, targets, scored)
            result = result.merge(ScoreResult(nll, sum(scored), time.perf_counter() - begin, [nll]))
    return result


def score_split_sliding_window(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, documents: List[str], window_size: int, stride: int,
    per_document: bool = False, max_tokens: Optional[int] = None, batch_size: int = 8,
) -> ScoreResult:
    """:func:`score_sliding_window` over a split (one stream, or each document alone): the merged result."""
    result = ScoreResult()
    for ids in split_streams(tokenizer, documents, per_document, max_tokens):
        result = result.merge(score_sliding_window(model, ids, window_size, stride, batch_size))
    return result


def row(name: str, mode: str, result: ScoreResult, **extra) -> Dict[str, object]:
    return {
        "model": name, "mode": mode, "tokens": result.num_tokens, "loss": round(result.loss, 5),
        "perplexity": round(result.perplexity, 3), "tokens_per_second": round(result.tokens_per_second, 1),
        "ms_per_token": round(1000 * result.seconds_per_token, 4), "seconds": round(result.seconds, 2), **extra,
    }


def dynamic_row(
    args: ParsedArguments,
    name: str,
    score: Callable[[List[str], Optional[DynamicEvaluation]], ScoreResult],
    documents: List[str],
) -> Dict[str, object]:
    """Dynamic evaluation of one model on ``--split``, its step size chosen on the valid split first: the result row,
    with the chosen ``dynamic_lr`` and ``dynamic_lr_on_valid`` (``{step size: valid perplexity}``, empty when a
    single ``--dynamic_lr`` was given)."""
    options = dict(method=args.dynamic_method, decay=args.dynamic_decay, parameters=args.dynamic_eval_params)
    candidates = args.dynamic_lr or DEFAULT_STEP_SIZES[args.dynamic_method]
    valid = read_documents(Path(args.data_dir) / "valid.txt") if len(candidates) > 1 else []
    lr, tried = choose_step_size(lambda dynamic: score(valid, dynamic), candidates, **options)
    if tried:
        logger.info("dynamic evaluation step sizes on valid (perplexity): %s -> %g", tried, lr)
    result = score(documents, DynamicEvaluation(lr, **options))
    return row(name, f"dynamic ({args.dynamic_method}, lr {lr:g})", result, dynamic_lr=lr,
               dynamic_lr_on_valid={f"{k:g}": round(v, 3) for k, v in tried.items()},
               dynamic_eval_params=args.dynamic_eval_params)


@dataclass
class EvalArguments:
    """The models, the split and the protocol."""

    model_name_or_path: List[str] = field(metadata={"help": "saved causal LM folder(s), scored in turn"})
    tokenizer_name: Optional[str] = field(default=None, metadata={
        "help": "tokenizer folder; unset: each model's folder"})
    data_dir: str = field(default="data/wiki", metadata={"help": "prepared corpus folder (train/valid/test.txt)"})
    split: Literal["train", "valid", "test"] = field(default="test", metadata={"help": "the split scored"})
    block_size: int = field(default=64, metadata={"help": "tokens per segment (the state is carried across)"})
    eval_mode: Literal["carried", "sliding_window"] = field(default="carried", metadata={
        "help": "carried: consecutive segments, the state carried; sliding_window: no state across windows"})
    window_size: Optional[int] = field(default=None, metadata={
        "help": "sliding_window: tokens of context per window (unset: --block_size)"})
    stride: Optional[int] = field(default=None, metadata={
        "help": "sliding_window: positions scored per window after the first (unset: --window_size; the papers: 1)"})
    per_device_eval_batch_size: int = field(default=8, metadata={"help": "sliding_window: windows per forward"})
    mem_len: Optional[int] = field(default=None, metadata={"help": "override Transformer-XL's memory length"})
    per_document: bool = field(default=False, metadata={"help": "restart the state at every document"})
    max_eval_tokens: Optional[int] = field(default=None, metadata={"help": "score only the first N tokens"})
    threads: Optional[int] = field(default=None, metadata={"help": "torch threads; unset: torch's"})
    results_file: Optional[str] = field(default=None, metadata={"help": "write the results as JSON here"})


@dataclass
class DynamicEvalArguments:
    """Dynamic evaluation (Krause et al. 2019) as the baseline: ``training.dynamic_eval``."""

    dynamic_eval: bool = field(default=False, metadata={"help": "also score with dynamic evaluation"})
    dynamic_lr: Optional[List[float]] = field(default=None, metadata={
        "help": f"step sizes, the best on the valid split is used (unset: per method, {DEFAULT_STEP_SIZES})"})
    dynamic_method: Literal["sgd", "rms"] = field(default="sgd", metadata={
        "help": "sgd: theta -= lr g; rms: theta -= lr g / sqrt(running mean of g^2) (Krause et al. 2019)"})
    dynamic_decay: float = field(default=0.0, metadata={"help": "rms: decay towards the trained weights"})
    dynamic_eval_params: Optional[List[str]] = field(default=None, metadata={
        "help": "adapt only these parameters (names or fnmatch globs; default: all)"})


def parse_args(argv: Optional[List[str]] = None) -> ParsedArguments:
    """The command line (``--help``: every option with its default); ValueError names a bad option."""
    args = parse_arguments((EvalArguments, DynamicEvalArguments), argv, description=__doc__)
    require_positive(args, ("block_size", "mem_len", "max_eval_tokens", "threads", "window_size", "stride",
                            "per_device_eval_batch_size"))
    if args.eval_mode == "sliding_window":
        args.window_size = args.window_size or args.block_size
        args.stride = args.stride or args.window_size
        if args.stride > args.window_size:
            raise ValueError(f"--stride ({args.stride}) must not exceed --window_size ({args.window_size})")
        if args.dynamic_eval:
            raise ValueError("--dynamic_eval adapts along the carried state: use it with --eval_mode carried")
    elif args.window_size is not None or args.stride is not None:
        raise ValueError("--window_size / --stride apply to --eval_mode sliding_window")
    return args


def main(argv: Optional[List[str]] = None) -> List[Dict[str, object]]:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    documents = read_documents(Path(args.data_dir) / f"{args.split}.txt")
    rows = []
    for path in args.model_name_or_path:
        model, tokenizer = load_model_and_tokenizer(path, args.tokenizer_name, args.mem_len)
        score = lambda docs, dynamic=None: score_split(  # noqa: E731
            model, tokenizer, docs, args.block_size, args.per_document, dynamic, args.max_eval_tokens
        )
        if args.eval_mode == "sliding_window":
            result = score_split_sliding_window(model, tokenizer, documents, args.window_size, args.stride,
                                                args.per_document, args.max_eval_tokens,
                                                args.per_device_eval_batch_size)
            rows.append(row(path, f"sliding window ({args.window_size}, stride {args.stride})", result,
                            window_size=args.window_size, stride=args.stride))
        else:
            rows.append(row(path, "static", score(documents)))
        if args.dynamic_eval:
            rows.append(dynamic_row(args, path, score, documents))
        for r in rows[-(2 if args.dynamic_eval else 1) :]:
            logger.info("%s  %-28s ppl %9.2f  %8.1f tok/s  %.3f ms/token  (%d tokens)", r["model"], r["mode"],
                        r["perplexity"], r["tokens_per_second"], r["ms_per_token"], r["tokens"])
    if args.results_file:
        Path(args.results_file).parent.mkdir(parents=True, exist_ok=True)
        Path(args.results_file).write_text(json.dumps({"args": args.record(), "results": rows}, indent=2) + "\n")
    return rows


if __name__ == "__main__":
    main()
