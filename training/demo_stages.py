"""What ``make demo`` (``training.finetune_fwl``) prints around its stages, and its last stage: whole held-out
documents scored by issue 17 item 4's rows (``training.document_eval.ONE_TABLE``: (1) the base, (2) fine-tuned without
FWL, (2) + dynamic evaluation, (3) the fine-tuned FWL, (3') its slow head alone, the test-time-only FWL on (2) and on
(1)), where fast weights have something to learn from (the fine-tuning table above it is measured on short 256-token
blocks, where they have little), with the goals' check (``document_eval.goal_summary``); and the test-time FWL on (1)
with its update on the seen rows only (``test_time_fwl_seen``, ``fwl_fast_vocabulary="seen"``), the variant that
meets the cost goal.

The demo does not tune step sizes (that scores the valid split once per candidate): it uses those chosen on the
valid split for the base model by the measurement in ``docs/results/document_eval_wiki_2048.json``
(``DEMO_STEP_SIZES``), for (2) as well. ``python -m training.document_eval --one_table`` chooses them per model.
"""
from __future__ import annotations

import contextlib
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Callable, ContextManager, Dict, List, Optional, Tuple

import torch

# Chosen on data/wiki's valid split for SmolLM2-135M, never on test: 2 documents of up to 2,048 tokens
# (docs/results/document_eval_wiki_2048.json) for the first two; of up to 4,096 tokens for the seen-rows variant
# (docs/results/document_eval_wiki_4096_seen.json).
DEMO_STEP_SIZES = {"test_time_fwl": 3e-5, "dynamic": 1e-2, "test_time_fwl_seen": 3e-5}


class Banners:
    """Numbered stage banners with what a stage does and about how long it takes on a quiet 2-core CPU."""

    def __init__(self, total: int) -> None:
        self.total, self.index, self.started = total, 0, time.perf_counter()

    def __call__(self, title: str, what: str, minutes: float) -> None:
        self.index += 1
        elapsed = time.perf_counter() - self.started
        rule = "=" * 100
        print(f"\n{rule}\n[{self.index}/{self.total}] {title}  (about {minutes:g} min on a quiet 2-core CPU; "
              f"{elapsed / 60:.1f} min so far)\n    {what}\n{rule}", file=sys.stderr, flush=True)


def remove_intermediate_checkpoints(stage_directory: Path) -> List[Path]:
    """Deletes a finished stage's Trainer checkpoints (``checkpoint-*``: weights plus optimizer state, about 1.6 GB
    each for SmolLM2-135M), keeping ``final/``; returns what was removed."""
    removed = sorted(Path(stage_directory).glob("checkpoint-*"))
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def demo_runs(
    base_path: str, fwl_model: Optional[torch.nn.Module], finetuned_path: Optional[str]
) -> Dict[str, Tuple[torch.nn.Module, Any, Callable[[], ContextManager]]]:
    """``{method: (model, dynamic evaluation or None, context of its scoring)}``, in ``ONE_TABLE``'s order: the rows
    of the models given; without (2), dynamic evaluation runs on the base (``dynamic``) instead."""
    from transformers import AutoModelForCausalLM

    from .document_eval import ONE_TABLE
    from .dynamic_eval import DynamicEvaluation
    from .test_time_fwl import build_test_time_fwl

    none = contextlib.nullcontext
    base = AutoModelForCausalLM.from_pretrained(base_path).eval()
    runs: Dict[str, Tuple[torch.nn.Module, Any, Callable[[], ContextManager]]] = {
        "base": (base, None, none),
        "test_time_fwl": (build_test_time_fwl(base_path, DEMO_STEP_SIZES["test_time_fwl"]), None, none),
        "test_time_fwl_seen": (build_test_time_fwl(base_path, DEMO_STEP_SIZES["test_time_fwl_seen"],
                                                   fast_vocabulary="seen"), None, none),
    }
    if finetuned_path is not None:
        finetuned = AutoModelForCausalLM.from_pretrained(finetuned_path).eval()
        runs["finetuned"] = (finetuned, None, none)
        runs["finetuned_dynamic"] = (finetuned, DynamicEvaluation(DEMO_STEP_SIZES["dynamic"]), none)
        runs["finetuned_test_time_fwl"] = (
            build_test_time_fwl(finetuned_path, DEMO_STEP_SIZES["test_time_fwl"]), None, none)
    else:
        runs["dynamic"] = (base, DynamicEvaluation(DEMO_STEP_SIZES["dynamic"]), none)
    if fwl_model is not None:
        runs["fwl"] = (fwl_model, None, none)
        runs["fwl_slow_only"] = (fwl_model, None, fwl_model.fwl_head.slow_only)
    order = list(ONE_TABLE) + ["test_time_fwl_seen", "dynamic"]
    return {method: runs[method] for method in order if method in runs}


def document_stage(
    base_path: str,
    fwl_model: Optional[torch.nn.Module],
    tokenizer: Any,
    data_dir: str,
    num_documents: int,
    max_length: int,
    segment_length: int = 128,
    finetuned_path: Optional[str] = None,
) -> Dict[str, Any]:
    """Scores the first `num_documents` documents of ``<data_dir>/test.txt`` (each up to `max_length` tokens) with
    the rows of issue 17 item 4's table that the models given allow (``demo_runs``: (1) the base and the test-time
    FWL on it (both variants) always; with `finetuned_path` (2), (2) + dynamic evaluation and the test-time FWL on (2);
    with `fwl_model` (3) and (3')); returns ``{method: summary}`` (perplexities by kind of token, tokens/s), the
    documents, the step sizes and ``goals`` (``document_eval.goal_summary``)."""
    from .document_eval import encode_documents, goal_summary, score_documents
    from .train_transfo_xl import read_documents

    documents = encode_documents(tokenizer, read_documents(Path(data_dir) / "test.txt")[:num_documents], max_length)
    results: Dict[str, Any] = {}
    for method, (model, dynamic, context) in demo_runs(base_path, fwl_model, finetuned_path).items():
        with context():
            # untimed warm-up (first-call allocations and kernel set-up would otherwise be charged to whichever runs
            # first)
            score_documents(model, [documents[0][:segment_length + 1]], segment_length, dynamic,
                            label=f"warm-up: {method}")
            scores = score_documents(model, documents, segment_length, dynamic, label=f"whole documents: {method}")
        results[method] = scores.summary()
    results["goals"] = goal_summary(results)
    results["documents"] = len(documents)
    results["step_sizes"] = dict(DEMO_STEP_SIZES)
    return results


def document_report(results: Dict[str, Any]) -> str:
    """The whole-document table: perplexity (all, first, repeated), tokens/s, relative to the base model, and the
    goals' check."""
    from .document_eval import ROW_LABELS, goal_report

    base = results["base"]
    lines = [
        f"Whole held-out documents ({results['documents']} documents, {base['tokens']} tokens, segments of 128 with "
        "the cache carried; step sizes chosen on valid for (1) beforehand, used for (2) too; times of one pass each, "
        "on a shared machine only a rough guide: benchmarks/bench_test_time_fwl.py interleaves them):",
        f"  {'method':<27}{'ppl':>9}{'first':>9}{'repeated':>10}{'tok/s':>9}{'ppl/base':>10}{'time/base':>11}",
    ]
    for method, summary in results.items():
        if not isinstance(summary, dict) or "perplexity" not in summary:
            continue
        lines.append(
            f"  {ROW_LABELS.get(method, method):<27}{summary['perplexity']:>9.3f}{summary['first']['perplexity']:>9.3f}"
            f"{summary['repeated']['perplexity']:>10.3f}{summary['tokens_per_second']:>9.1f}"
            f"{summary['perplexity'] / base['perplexity']:>10.4f}"
            f"{base['tokens_per_second'] / summary['tokens_per_second']:>10.2f}x"
        )
    if results.get("goals"):
        lines += ["Issue 17's goals on these documents (a 30-step demo is not expected to meet the first):",
                  goal_report(results["goals"])]
    return "\n".join(lines)


def label_progress_bars(trainer: Any, label: str) -> None:
    """Replaces a Trainer's unlabelled progress bars by bars named after the stage ("(2) fine-tuning: 12/30")."""
    from transformers.trainer_callback import ProgressCallback

    class LabelledProgressCallback(ProgressCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            super().on_train_begin(args, state, control, **kwargs)
            if self.training_bar is not None:
                self.training_bar.set_description(f"{label}: training steps")

        def on_prediction_step(self, args, state, control, eval_dataloader=None, **kwargs):
            super().on_prediction_step(args, state, control, eval_dataloader=eval_dataloader, **kwargs)
            if self.prediction_bar is not None:
                self.prediction_bar.set_description(f"{label}: evaluation batches", refresh=False)

    if trainer.pop_callback(ProgressCallback) is not None:
        trainer.add_callback(LabelledProgressCallback())
