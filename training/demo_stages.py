"""What ``make demo`` (``training.finetune_fwl``) prints around its stages, and its last stage: whole held-out
documents scored by the base model, the test-time-only FWL on it, dynamic evaluation and the fine-tuned FWL
(``training.document_eval``), where fast weights have something to learn from (the fine-tuning table above it is
measured on short 256-token blocks, where they have little).

The demo does not tune step sizes (that scores the valid split once per candidate): it uses those chosen on the
valid split by the measurement in ``docs/results/document_eval_wiki_2048.json`` (``DEMO_STEP_SIZES``).
"""
from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

# Chosen on data/wiki's valid split (2 documents of up to 2,048 tokens) for SmolLM2-135M
# (docs/results/document_eval_wiki_2048.json; never on test).
DEMO_STEP_SIZES = {"test_time_fwl": 3e-5, "dynamic": 1e-2}


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
    the base model, the test-time-only FWL on it, dynamic evaluation of every parameter and, if given, the model
    fine-tuned without FWL (`finetuned_path`, the fair baseline) and the fine-tuned FWL model (`fwl_model`); returns
    ``{method: summary}`` (perplexities by kind of token, tokens/s)."""
    from transformers import AutoModelForCausalLM

    from .document_eval import encode_documents, score_documents
    from .dynamic_eval import DynamicEvaluation
    from .test_time_fwl import build_test_time_fwl
    from .train_transfo_xl import read_documents

    documents = encode_documents(tokenizer, read_documents(Path(data_dir) / "test.txt")[:num_documents], max_length)
    base = AutoModelForCausalLM.from_pretrained(base_path).eval()
    runs = {
        "base": (base, None),
        "test_time_fwl": (build_test_time_fwl(base_path, DEMO_STEP_SIZES["test_time_fwl"]), None),
        "dynamic": (base, DynamicEvaluation(DEMO_STEP_SIZES["dynamic"])),
    }
    if finetuned_path is not None:
        runs["finetuned"] = (AutoModelForCausalLM.from_pretrained(finetuned_path).eval(), None)
    if fwl_model is not None:
        runs["finetuned_fwl"] = (fwl_model, None)
    results = {}
    for method, (model, dynamic) in runs.items():
        # untimed warm-up (first-call allocations and kernel set-up would otherwise be charged to whichever runs first)
        score_documents(model, [documents[0][:segment_length + 1]], segment_length, dynamic, label=f"warm-up: {method}")
        results[method] = score_documents(model, documents, segment_length, dynamic, label=f"whole documents: {method}").summary()
    results["documents"] = len(documents)
    results["step_sizes"] = dict(DEMO_STEP_SIZES)
    return results


def document_report(results: Dict[str, Any]) -> str:
    """The whole-document table: perplexity (all, first, repeated), tokens/s, relative to the base model."""
    base = results["base"]
    lines = [
        f"Whole held-out documents ({results['documents']} documents, {base['tokens']} tokens, segments of 128 with "
        "the cache carried; step sizes chosen on valid beforehand; times of one pass each, on a shared machine only "
        "a rough guide: benchmarks/bench_test_time_fwl.py interleaves them):",
        f"  {'method':<22}{'ppl':>9}{'first':>9}{'repeated':>10}{'tok/s':>9}{'ppl/base':>10}{'time/base':>11}",
    ]
    for method, summary in results.items():
        if not isinstance(summary, dict) or "perplexity" not in summary:
            continue
        lines.append(
            f"  {method:<22}{summary['perplexity']:>9.3f}{summary['first']['perplexity']:>9.3f}"
            f"{summary['repeated']['perplexity']:>10.3f}{summary['tokens_per_second']:>9.1f}"
            f"{summary['perplexity'] / base['perplexity']:>10.4f}"
            f"{base['tokens_per_second'] / summary['tokens_per_second']:>10.2f}x"
        )
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
