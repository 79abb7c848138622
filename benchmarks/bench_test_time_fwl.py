"""Scoring cost of the test-time-only FWL (``training.test_time_fwl``) and of dynamic evaluation against the untouched
base model, measured side by side: the same document (the first of ``data/wiki/valid.txt``, cut to ``--tokens``;
random ids where that file is missing) is scored in segments of 128 with the cache carried (``training.document_eval``)
by each method in turn, ``--repeats`` rounds, so that load from elsewhere on a shared machine hits all alike. Reports
every method's seconds (best / median / all) and its ratio to the base model (of medians: the headline).

``test_time_fwl_off`` is the same wrapped model with its fast update off (``FWLHead.slow_only``): the base model's
computation with the FWL's output-layer matmul (``fwp_kernels.dense_linear``, oneDNN), which on this AMD CPU is faster
than the MKL sgemm transformers' LM head runs; ``test_time_fwl`` over it is the fast update's own cost.
``test_time_fwl_bf16`` is the test-time FWL with ``fwl_gradient_dtype="bfloat16"`` (the per-token gradients'
vocabulary-sized part in bf16: an approximation, faster on CPUs with bf16 matrix units). The test-time FWL makes the
output embedding and the output bias fast (``training.test_time_fwl.TEST_TIME_FAST_PARAMETERS``, or
``--fwl_fast_parameters``); ``test_time_fwl_with_gain`` (and its ``_bf16``) makes the final norm's gain fast too,
which costs two more vocabulary-sized products per position (the fast pass then reads another o than the slow one).
``test_time_fwl_seen`` restricts the fast update to the rows of the document's tokens so far
(``fwl_fast_vocabulary="seen"``): its products cover those rows only. ``test_time_fwl_segment_start`` takes its
per-token gradients at the fast weights of each segment's start (``fwl_gradient_point="segment_start"``, segments
of the scoring's 128 tokens; each call begins a segment, so its fast pass shares the segment start's read of the
carried sum); ``test_time_fwl_segment_start_seen`` the same on the seen rows only. ``dynamic_output`` is dynamic
evaluation of the test-time FWL's fast part (final norm and an untied copy of the output embedding,
``training.document_eval.output_side_parameter_names``; SGD after every segment): its nearest, cheaper rival.
With ``--fwl_model`` (a model ``training.finetune_fwl`` trained, ``<output_dir>/base_fwl/final``), ``trained_fwl``
times that trained FWL (issue 17's row (3), its learned step sizes as they are) and ``trained_fwl_slow_only`` the same
model with its fast update off (row (3')), ``trained_fwl_seen`` the trained FWL with its update on the seen rows
(``training.document_eval.load_fwl_model``; for a model trained with ``fwl_gradient_point="segment_start"``, the
seen rows at that gradient point); all three are added to the default methods when the option is given.

    python benchmarks/bench_test_time_fwl.py [--tokens 1024] [--repeats 3] [--methods base test_time_fwl dynamic]
    python benchmarks/bench_test_time_fwl.py --quick      # a tiny check that it runs

Writes benchmarks/results/bench_test_time_fwl.json (``--output``) with the run record (``training.result_file``).
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path
from typing import Callable, Dict, Optional, Tuple

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from training.document_eval import score_document  # noqa: E402
from training.dynamic_eval import DynamicEvaluation  # noqa: E402
from training.result_file import RunRecord, ratio, summarize  # noqa: E402


METHODS = (
    "base", "test_time_fwl_off", "test_time_fwl", "test_time_fwl_bf16", "test_time_fwl_with_gain",
    "test_time_fwl_with_gain_bf16", "test_time_fwl_seen", "test_time_fwl_segment_start",
    "test_time_fwl_segment_start_seen", "dynamic_output", "dynamic",
)
# Timed only with ``--fwl_model``: the trained FWL (3), its slow head alone (3'), (3) with its update on the seen rows.
TRAINED_METHODS = ("trained_fwl", "trained_fwl_slow_only", "trained_fwl_seen")
# The test-time FWL's own methods (each compared with the update off and with dynamic_output).
FWL_METHODS = tuple(m for m in METHODS if m.startswith("test_time_fwl") and m != "test_time_fwl_off")
# Tokens per scored segment (the cache carried across), and the segments of ``test_time_fwl_segment_start``.
SEGMENT_LENGTH = 128
# The fast parameters of the ``test_time_fwl_with_gain`` methods.
WITH_GAIN_FAST_PARAMETERS = ("norm.weight", "output_embedding.weight", "output_bias")


def build_runs(args: argparse.Namespace) -> Dict[str, Tuple[torch.nn.Module, Optional[DynamicEvaluation], Callable]]:
    """``{method: (model, dynamic evaluation or None, context factory of its scoring)}`` for ``args.methods``, in
    that order; each model is built only if a method needs it."""
    from transformers import AutoModelForCausalLM

    from training.document_eval import load_fwl_model, output_side_parameter_names
    from training.dynamic_eval import untie_output_embedding
    from training.test_time_fwl import build_test_time_fwl

    none = contextlib.nullcontext
    methods = set(args.methods)
    base = AutoModelForCausalLM.from_pretrained(args.model).eval() if methods & {"base", "dynamic"} else None
    fwl = None
    if methods & {"test_time_fwl", "test_time_fwl_off"}:
        fwl = build_test_time_fwl(args.model, args.fwl_step_size, args.fwl_fast_parameters)
    runs = {"base": lambda: (base, None, none), "dynamic": lambda: (base, DynamicEvaluation(args.dynamic_lr), none),
            "test_time_fwl": lambda: (fwl, None, none),
            "test_time_fwl_off": lambda: (fwl, None, fwl.fwl_head.slow_only)}
    trained = None
    if methods & set(TRAINED_METHODS):
        if not args.fwl_model:
            raise ValueError(f"methods {sorted(methods & set(TRAINED_METHODS))} need `--fwl_model` (a folder "
                             "training.finetune_fwl wrote: <output_dir>/base_fwl/final), which is unset")
        trained = load_fwl_model(args.fwl_model, "--fwl_model")
    runs.update(trained_fwl=lambda: (trained, None, none),
                trained_fwl_slow_only=lambda: (trained, None, trained.fwl_head.slow_only),
                trained_fwl_seen=lambda: (load_fwl_model(args.fwl_model, "--fwl_model", "seen"), None, none))

    def variant(fast_parameters, gradient_dtype, fast_vocabulary="full", gradient_point="slow"):
        def build():
            segment_length = SEGMENT_LENGTH if gradient_point == "segment_start" else None
            model = build_test_time_fwl(args.model, args.fwl_step_size, fast_parameters, gradient_dtype=gradient_dtype,
                                        fast_vocabulary=fast_vocabulary, gradient_point=gradient_point,
                                        segment_length=segment_length)
            return model, None, none
        return build

    def dynamic_output():
        model = AutoModelForCausalLM.from_pretrained(args.model).eval()
        untie_output_embedding(model)
        parameters = output_side_parameter_names(model)
        return model, DynamicEvaluation(args.dynamic_output_lr, parameters=parameters), none

    runs.update(
        test_time_fwl_bf16=variant(args.fwl_fast_parameters, "bfloat16"),
        test_time_fwl_with_gain=variant(WITH_GAIN_FAST_PARAMETERS, None),
        test_time_fwl_with_gain_bf16=variant(WITH_GAIN_FAST_PARAMETERS, "bfloat16"),
        test_time_fwl_seen=variant(args.fwl_fast_parameters, None, "seen"),
        test_time_fwl_segment_start=variant(args.fwl_fast_parameters, None, gradient_point="segment_start"),
        test_time_fwl_segment_start_seen=variant(args.fwl_fast_parameters, None, "seen", "segment_start"),
        dynamic_output=dynamic_output,
    )
    return {method: runs[method]() for method in args.methods}


def trained_head_settings(runs: Dict[str, Tuple[torch.nn.Module, Optional[DynamicEvaluation], Callable]]) -> Dict:
    """``{"trained_fwl_head": {gradient_point, fast_vocabulary, fast_parameters}}`` of the trained FWL (3) as loaded
    (what its row in the results table says it was), or {} when no trained method is timed."""
    head = next((runs[m][0].fwl_head for m in ("trained_fwl", "trained_fwl_slow_only") if m in runs), None)
    if head is None:
        return {}
    return {"trained_fwl_head": {"gradient_point": head.gradient_point, "fast_vocabulary": head.fast_vocabulary,
                                 "fast_parameters": list(head.fast_parameter_names)}}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="checkpoints/smollm2-135m")
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--methods", nargs="+", default=None, choices=METHODS + TRAINED_METHODS,
                   help="default: all of them (the trained ones with --fwl_model)")
    p.add_argument("--fwl_model", default=None, help="a trained FWL (finetune_fwl's <output_dir>/base_fwl/final)")
    p.add_argument("--fwl_step_size", type=float, default=1e-5)
    p.add_argument("--fwl_fast_parameters", nargs="+", default=None, help="default: output embedding, output bias")
    p.add_argument("--dynamic_lr", type=float, default=3e-3)
    p.add_argument("--dynamic_output_lr", type=float, default=1e-2, help="chosen on valid in "
                   "docs/results/document_eval_wiki_2048.json")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--quick", action="store_true", help="64 tokens, 1 round: checks that it runs")
    p.add_argument("--output", default=str(ROOT / "benchmarks" / "results" / "bench_test_time_fwl.json"))
    args = p.parse_args(argv)
    if args.methods is None:
        args.methods = list(METHODS) + (list(TRAINED_METHODS) if args.fwl_model else [])
    if args.quick:
        args.tokens, args.repeats = 64, 1
    if args.threads:
        torch.set_num_threads(args.threads)
    record = RunRecord.start("python benchmarks/bench_test_time_fwl.py", argv)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    valid = ROOT / "data" / "wiki" / "valid.txt"
    if valid.is_file():
        text = valid.read_text(encoding="utf-8").split("\n\n")[0]
        ids = torch.tensor(tokenizer(text, add_special_tokens=False).input_ids[: args.tokens])
    else:
        ids = torch.randint(0, len(tokenizer), (args.tokens,), generator=torch.Generator().manual_seed(0))
    runs = build_runs(args)
    seconds = {m: [] for m in runs}
    for _ in range(args.repeats):
        for method, (model, dynamic, context) in runs.items():
            started = time.perf_counter()
            with context():
                score_document(model, ids, SEGMENT_LENGTH, dynamic)
            seconds[method].append(time.perf_counter() - started)
    timings = {m: summarize(s) for m, s in seconds.items()}
    ratios = {m: ratio(timings[m], timings["base"]) for m in timings if "base" in timings and m != "base"}
    for fwl_method in FWL_METHODS:  # the fast update's own cost: against the wrapped model with it off
        if fwl_method in timings and "test_time_fwl_off" in timings:
            ratios[f"{fwl_method}_vs_off"] = ratio(timings[fwl_method], timings["test_time_fwl_off"])
    if "trained_fwl" in timings and "trained_fwl_slow_only" in timings:  # the trained fast update's own cost
        ratios["trained_fwl_vs_slow_only"] = ratio(timings["trained_fwl"], timings["trained_fwl_slow_only"])
    for fwl_method in FWL_METHODS:  # against its nearest, cheaper-or-not rival
        if fwl_method in timings and "dynamic_output" in timings:
            ratios[f"{fwl_method}_vs_dynamic_output"] = ratio(timings[fwl_method], timings["dynamic_output"])
    for method, summary in timings.items():
        extra = f"  {ratios[method]['of_medians']:.2f}x base (of medians)" if method in ratios else ""
        print(f"{method:<20} median {summary['median']:.2f} s for {ids.numel() - 1} tokens{extra}")
    for name in [f"{m}_vs_dynamic_output" for m in FWL_METHODS] + ["trained_fwl_vs_slow_only"]:
        if name in ratios:
            print(f"{name}: {ratios[name]['of_medians']:.2f}x (of medians)")
    if not args.quick:
        record.write(args.output, {"settings": vars(args), "tokens": ids.numel() - 1, "seconds": timings,
                                   "time_vs_base": ratios, **trained_head_settings(runs)})
        print(f"results: {args.output}")


if __name__ == "__main__":
    main()
