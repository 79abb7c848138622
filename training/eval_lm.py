"""Perplexity over long documents with carried state: the papers' evaluation protocol, for any causal LM of this
package (Transformer-XL, Transformer-XL + FWL, the Delta Net family, FWLForCausalLM), optionally with dynamic
evaluation (Krause et al. 2019) as the baseline.

Protocol (Dai et al. 2019 sec. 4; Clark et al. 2022 sec. 3): batch 1; the split is one token stream (every document
followed by the tokenizer's eos; ``--per_document`` restarts the state at every document instead); it is read in
consecutive segments of ``--segment_length`` tokens, each continuing from the previous segment's cache (memories,
fast weights, FWL running update); every token but the first is scored exactly once. Transformer-XL's memory length
can be changed with ``--mem_len`` (the papers evaluate with longer memories than they train with).

    python -m training.eval_lm --model outputs/transfo_xl --model outputs/transfo_xl_fwl --split test \\
        --dynamic_eval --dynamic_lr 1e-3 3e-3 --output outputs/eval_lm.json

With several ``--dynamic_lr`` values the step size is chosen on the valid split first (lowest perplexity), then used
on ``--split``.
"""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple  # noqa: E402

import torch  # noqa: E402

import modeling_fwp  # noqa: E402,F401  (registers the Auto classes)
from modeling_fwp.dynamic_eval import DynamicEvaluation, ScoreResult, score_stream  # noqa: E402

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
    streams = [encode_stream(tokenizer, [doc]) for doc in documents] if per_document else [encode_stream(tokenizer, documents)]
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
        "seconds": round(result.seconds, 2), **extra,
    }


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", action="append", required=True, help="a saved model folder (repeatable)")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder (default: each model's folder)")
    p.add_argument("--data_dir", default="data/wiki")
    p.add_argument("--split", default="test", choices=["train", "valid", "test"])
    p.add_argument("--segment_length", type=int, default=64)
    p.add_argument("--mem_len", type=int, default=None, help="override Transformer-XL's memory length")
    p.add_argument("--per_document", action="store_true", help="restart the state at every document")
    p.add_argument("--max_tokens", type=int, default=None, help="score only the first N tokens (smoke tests)")
    p.add_argument("--dynamic_eval", action="store_true", help="also score with dynamic evaluation")
    p.add_argument("--dynamic_lr", type=float, nargs="+", default=[1e-3])
    p.add_argument("--dynamic_method", default="sgd", choices=["sgd", "rms"])
    p.add_argument("--dynamic_decay", type=float, default=0.0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--output", default=None, help="write the results as JSON here")
    return p.parse_args(argv)


def main(argv=None) -> List[Dict[str, object]]:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    documents = read_documents(Path(args.data_dir) / f"{args.split}.txt")
    rows = []
    for path in args.model:
        model, tokenizer = load_model_and_tokenizer(path, args.tokenizer, args.mem_len)
        score = lambda docs, dynamic=None: score_split(  # noqa: E731
            model, tokenizer, docs, args.segment_length, args.per_document, dynamic, args.max_tokens
        )
        rows.append(row(path, "static", score(documents)))
        if args.dynamic_eval:
            lr = args.dynamic_lr[0]
            if len(args.dynamic_lr) > 1:  # choose the step size on the valid split
                valid = read_documents(Path(args.data_dir) / "valid.txt")
                tried = {
                    candidate: score(valid, DynamicEvaluation(candidate, args.dynamic_method, args.dynamic_decay)).perplexity
                    for candidate in args.dynamic_lr
                }
                lr = min(tried, key=tried.get)
                logger.info("dynamic evaluation step sizes on valid: %s -> %g", tried, lr)
            dynamic = DynamicEvaluation(lr, args.dynamic_method, args.dynamic_decay)
            rows.append(row(path, f"dynamic ({args.dynamic_method}, lr {lr:g})", score(documents, dynamic), dynamic_lr=lr))
        for r in rows[-(2 if args.dynamic_eval else 1) :]:
            logger.info("%s  %-28s ppl %9.2f  %8.1f tok/s  (%d tokens)", r["model"], r["mode"], r["perplexity"],
                        r["tokens_per_second"], r["tokens"])
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps({"args": vars(args), "results": rows}, indent=2) + "\n")
    return rows


if __name__ == "__main__":
    main()
