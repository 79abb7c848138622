"""Perplexity over long documents with carried state: the papers' evaluation protocol, for any causal LM of
modeling_fwp (Transformer-XL, Transformer-XL + FWL, the Delta Net family, FWLForCausalLM) or of transformers (e.g.
SmolLM2, a Llama, with its key/value cache carried), optionally with dynamic evaluation (Krause et al. 2019) as the
baseline (``training.dynamic_eval``).

Protocol (Dai et al. 2019 sec. 4; Clark et al. 2022 sec. 3): batch 1; the split is one token stream (every document
followed by the tokenizer's eos; ``--per_document`` restarts the state at every document instead); it is read in
consecutive segments of ``--block_size`` tokens, each continuing from the previous segment's cache (memories,
fast weights, FWL running update); every token but the first is scored exactly once. Transformer-XL's memory length
can be changed with ``--mem_len`` (the papers evaluate with longer memories than they train with).

    python -m training.eval_lm --model_name_or_path outputs/transfo_xl outputs/transfo_xl_fwl --split test \\
        --dynamic_eval --dynamic_lr 1e-3 3e-3 --results_file outputs/eval_lm.json     # or: fwp-eval-lm ...

Dynamic evaluation adapts every parameter, or those named by ``--dynamic_eval_params`` (names or globs, e.g.
``'model.layers.*.mlp.*'``), with plain SGD steps or Krause et al.'s RMS-normalised steps (``--dynamic_method rms``).
Its step size is chosen on the valid split first (lowest perplexity among ``--dynamic_lr``, by default a small grid
per method; one value skips the choice), then used on ``--split``; the rows report the chosen value, the perplexities
tried and the time per token. ``--help`` lists every option with its default.
"""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json  # noqa: E402
import logging  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import TYPE_CHECKING, Callable, Dict, List, Literal, Optional, Tuple  # noqa: E402

import torch  # noqa: E402

import modeling_fwp  # noqa: E402,F401  (registers the Auto classes)

from .arguments import ParsedArguments, parse_arguments, require_positive  # noqa: E402
from .dynamic_eval import (  # noqa: E402
    DEFAULT_STEP_SIZES,
    DynamicEvaluation,
    ScoreResult,
    choose_step_size,
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


def score_split(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, documents: List[str], segment_length: int,
    per_document: bool = False, dynamic: Optional[DynamicEvaluation] = None, max_tokens: Optional[int] = None,
) -> ScoreResult:
    """Scores a split (one stream, or each document alone) and returns the merged result."""
    groups = [[doc] for doc in documents] if per_document else [documents]
    streams = [encode_stream(tokenizer, group) for group in groups]
    result = ScoreResult()
    budget = max_tokens
    for ids in streams:
        if budget is not None:
            if budget <= 1:
                break
            ids = ids[:budget]
            budget -= ids.numel()
        if ids.numel() >= 2:
            result = result.merge(score_stream(model, ids[None], segment_length, dynamic=dynamic))
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


def parse_args(argv=None) -> ParsedArguments:
    """The command line (``--help``: every option with its default); ValueError names a bad option."""
    args = parse_arguments((EvalArguments, DynamicEvalArguments), argv, description=__doc__)
    require_positive(args, ("block_size", "mem_len", "max_eval_tokens", "threads"))
    return args


def main(argv=None) -> List[Dict[str, object]]:
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
