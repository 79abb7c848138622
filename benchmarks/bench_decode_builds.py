"""Two builds of csrc/decode_linear.cpp side by side in one process, decoding the 1.3B Delta Net shape: the package's
and the file at a git revision.

    python benchmarks/bench_decode_builds.py --base 17218a9

For a change to the weight-streaming kernels (``fwp_dense``: ``linear_rows``, the blocks' decode step) that should
only make decoding faster: ``bench_pretrained.build_model``'s random-weight Delta Net (hidden 2048, 24 layers), one
prompt of 16 tokens, then ``--steps`` greedy decode steps from a cache of its own per build, the two builds in turn
at every step (the first of each round alternating), two untimed steps first. Checks that both builds give the same
logits at every step bit for bit (a build that changes the arithmetic is not a speed change: the script stops;
``--tolerance`` admits a change of the sums' order, both builds then decoding the base's tokens),
prints ms per token (median and best), the base / package ratio of medians and the median of the per-step ratios;
writes benchmarks/results/bench_decode_builds.json (``--out``; ``training.result_file.RunRecord``). About 2 minutes
per dtype and thread count on an idle 2-core CPU, 3-6 GB of memory.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_chunk_builds import base_ops, with_ops  # noqa: E402
from bench_pretrained import build_model  # noqa: E402
from fwp_kernels import dense  # noqa: E402
from modeling_fwp.cache_fwp import CACHE_ARGUMENT, output_cache  # noqa: E402
from training.result_file import RunRecord, ratio, scaled, summarize  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "bench_decode_builds.json"
SOURCE = "kernels/csrc/decode_linear.cpp"


def decode_side_by_side(model, ops: dict, steps: int, tolerance: float = 0.0) -> dict:
    """ms per decode step of each build in `ops` (name -> ops), in turn at every step; SystemExit where their logits
    differ (by more than `tolerance` relative to the base's largest logit, where it is above 0; then both builds
    are fed the base's tokens, so that a flipped near-tie does not send them down different paths)."""
    with torch.no_grad():
        out = model(torch.arange(16)[None] % model.config.vocab_size, use_cache=True)
        state = {name: (out.logits[:, -1:].argmax(-1), copy.deepcopy(output_cache(out))) for name in ops}
        times = {name: [] for name in ops}
        largest = 0.0
        for step in range(steps + 2):
            logits = {}
            for name in (list(ops) if step % 2 else list(ops)[::-1]):
                token, cache = state[name]
                run = with_ops(ops[name], lambda: model(token, use_cache=True, **{CACHE_ARGUMENT: cache}),
                               dense._CPU_KERNEL)
                t0 = time.perf_counter()
                out = run()
                elapsed = time.perf_counter() - t0
                state[name] = (out.logits[:, -1:].argmax(-1), output_cache(out))
                logits[name] = out.logits[:, -1]
                if step >= 2:
                    times[name].append(elapsed)
            if tolerance > 0:
                state["package"] = (state["base"][0], state["package"][1])
                base, package = logits["base"].double(), logits["package"].double()
                difference = ((base - package).abs().max() / base.abs().max()).item()
                largest = max(largest, difference)
                if not difference <= tolerance:
                    raise SystemExit(f"step {step}: the builds' logits differ by {difference:.2g} (relative), over "
                                     f"the tolerance {tolerance:g}; no timing")
            elif not torch.equal(logits["base"], logits["package"]):
                raise SystemExit(f"step {step}: the builds' logits differ; no timing")
    ms = {name: scaled(summarize(t), 1e3) for name, t in times.items()}
    per_step = [b / p for b, p in zip(times["base"], times["package"])]
    return {"ms": ms, "base_over_package": ratio(ms["base"], ms["package"]),
            "per_step_ratio_median": statistics.median(per_step), "largest_relative_difference": largest}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="git revision whose csrc/decode_linear.cpp is the baseline")
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, nargs="+", default=[2])
    parser.add_argument("--steps", type=int, default=30, help="timed decode steps per build")
    parser.add_argument("--quick", action="store_true", help="a toy model and 2 steps: checks that the script runs")
    parser.add_argument("--out", default=str(RESULTS), help="default: benchmarks/results/bench_decode_builds.json")
    parser.add_argument("--tolerance", type=float, default=0.0,
                        help="largest relative difference of the builds' logits (default 0: bit for bit; above 0, "
                             "for a change of the sums' order, both builds decode the base's tokens)")
    parser.add_argument("--base_cflags", default=None,
                        help="the base build's compiler flags, one string (default: the package's)")
    args = parser.parse_args()
    record = RunRecord.start("python benchmarks/bench_decode_builds.py")
    if not dense._CPU_KERNEL.available():
        raise SystemExit(f"the package's C++ decode_linear kernel is not available: {dense._CPU_KERNEL.describe()}")
    base_cflags = args.base_cflags.split() if args.base_cflags is not None else list(dense._CPU_KERNEL.extra_cflags)
    ops = {"base": base_ops(args.base, SOURCE, "fwp_dense", "linear_rows", base_cflags),
           "package": dense._CPU_KERNEL.ops}
    steps = 2 if args.quick else args.steps
    results = {"base": args.base, "tolerance": args.tolerance, "base_cflags": base_cflags,
               "package_cflags": list(dense._CPU_KERNEL.extra_cflags), "quick": args.quick, "steps": steps, "cases": {}}
    threads_before = torch.get_num_threads()
    print(f"ms per token, median (best); base {args.base} / package: ratio of medians, median of per-step ratios")
    for dtype in args.dtypes:
        model = build_model("delta_net", getattr(torch, dtype), args.quick)
        for threads in args.threads:
            torch.set_num_threads(threads)
            r = results["cases"][f"{dtype}_threads{threads}"] = decode_side_by_side(model, ops, steps, args.tolerance)
            ms = r["ms"]
            print(f"  {dtype} {threads} thread(s): {ms['base']['median']:.1f} ({ms['base']['best']:.1f}) -> "
                  f"{ms['package']['median']:.1f} ({ms['package']['best']:.1f}), "
                  f"{r['base_over_package']['of_medians']:.3f}x, per step {r['per_step_ratio_median']:.3f}x")
        del model
    torch.set_num_threads(threads_before)
    print(f"wrote {record.write(args.out, results)}")


if __name__ == "__main__":
    main()
