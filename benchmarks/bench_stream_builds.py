"""Two builds of csrc/decode_linear.cpp side by side in one process: the package's and the file at a git revision.

    python benchmarks/bench_stream_builds.py --base 3b09d45
    python benchmarks/bench_stream_builds.py --base HEAD --quick      # small weights, seconds: checks that it runs
    python benchmarks/bench_stream_builds.py --base HEAD --base_cflags "-O3 -fopenmp -march=native"   # flags only

For a change to the weight-streaming kernel (``linear_rows``: x W^T for the one or two rows of a decode step, which
every projection of a decode step runs, and the fused block ops' passes with it): float32 and bfloat16 weights of the
1.3B Delta Net's feed-forward shapes, 5632 x 2048 (rows of 2048, as q, k, v, o, gate and up) and 2048 x 5632 (rows of
5632, as down), about 180 MB of weights per case (more than the cache), one and two rows of x, 1 and 2 threads. Each
round reads the weights once with ``w.sum()`` (the read bound beside it), then once through each build
(``bench_kernels.timings``, round-robin: the machine's load and the VM's bandwidth drift hit all alike). Prints GB/s
of the weights read (medians) and the base / package ratio of median times; the builds' outputs are compared (their
largest difference relative to the base's largest entry: a change of the sums' order moves the last bits; over
``--tolerance`` the script stops). The base is built with the package's flags for the file unless ``--base_cflags``
says otherwise. Writes benchmarks/results/bench_stream_builds.json (``--out``; ``RunRecord``).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_chunk_builds import base_ops  # noqa: E402
from bench_kernels import timings  # noqa: E402
from fwp_kernels import dense  # noqa: E402
from training.result_file import RunRecord, ratio  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "bench_stream_builds.json"
SOURCE = "kernels/csrc/decode_linear.cpp"
SHAPES = ((5632, 2048), (2048, 5632))


def compare(dtype: torch.dtype, shape: tuple, rows: int, ops: dict, repeats: int, weight_bytes: float,
            tolerance: float) -> dict:
    """One case: the builds' outputs compared, then GB/s of x.sum() and of each build's linear_rows over the weights
    (``weight_bytes`` of them, as many ``shape`` weights as that takes)."""
    gen = torch.Generator().manual_seed(0)
    count = max(1, int(weight_bytes // (shape[0] * shape[1] * torch.finfo(dtype).bits // 8)))
    weights = [torch.randn(*shape, generator=gen).to(dtype) for _ in range(count)]
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    x = torch.randn(rows, shape[1], generator=gen).to(dtype)
    outs = {name: torch.empty(rows, shape[0], dtype=dtype) for name in ops}
    fns = {"sum": lambda: [w.sum() for w in weights]}
    for name, o in ops.items():
        fns[name] = lambda o=o, y=outs[name]: [o.linear_rows(x, w, None, y) for w in weights]
    for name in ops:
        fns[name]()
    base, package = outs["base"].double(), outs["package"].double()
    difference = ((base - package).abs().max() / base.abs().max()).item()
    if not difference <= tolerance:
        raise SystemExit(f"{dtype} {shape} rows={rows}: the builds differ by {difference:.2g} (relative), over the "
                         f"tolerance {tolerance:g}; no timing")
    t = timings(fns, repeats)
    return {"weights": count, "weight_mb": nbytes / 2**20, "relative_difference": difference,
            "gb_per_s": {name: nbytes / r["median"] / 1e9 for name, r in t.items()},
            "seconds": t,
            "base_over_package": ratio(t["base"], t["package"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="git revision whose csrc/decode_linear.cpp is the baseline")
    parser.add_argument("--quick", action="store_true", help="small weights, 2 rounds: checks that the script runs")
    parser.add_argument("--rounds", type=int, default=11, help="timed rounds per case")
    parser.add_argument("--tolerance", type=float, default=1e-2,
                        help="largest relative difference of the builds' outputs (default 1e-2: a bfloat16 output "
                             "rounded the other way is 1/128 of itself)")
    parser.add_argument("--base_cflags", default=None,
                        help="the base build's compiler flags, one string (default: the package's)")
    parser.add_argument("--out", default=str(RESULTS), help="default: benchmarks/results/bench_stream_builds.json")
    args = parser.parse_args()
    record = RunRecord.start("python benchmarks/bench_stream_builds.py")
    if not dense._CPU_KERNEL.available():
        raise SystemExit(f"the package's C++ streaming kernel is not available: {dense._CPU_KERNEL.describe()}")
    # the base is built with the package's flags unless told otherwise (before 2026-12-07 it took the chunk
    # kernel's, which add -mprefer-vector-width=512: a difference of flags, not of source, was measured with it)
    base_cflags = args.base_cflags.split() if args.base_cflags is not None else list(dense._CPU_KERNEL.extra_cflags)
    ops = {"base": base_ops(args.base, SOURCE, "fwp_dense", "linear_rows", base_cflags),
           "package": dense._CPU_KERNEL.ops}
    weight_bytes, repeats = (8e6, 2) if args.quick else (180e6, args.rounds)
    results = {"base": args.base, "base_cflags": base_cflags, "package_cflags": list(dense._CPU_KERNEL.extra_cflags),
               "tolerance": args.tolerance, "quick": args.quick, "cases": {}}
    threads_before = torch.get_num_threads()
    print(f"GB/s of the weights read (medians): x.sum(), base {args.base}, package; base / package time")
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for dtype in (torch.float32, torch.bfloat16):
            for shape in SHAPES:
                for rows in (1, 2):
                    name = f"{str(dtype)[6:]}_{shape[0]}x{shape[1]}_rows{rows}_threads{threads}"
                    r = results["cases"][name] = compare(dtype, shape, rows, ops, repeats, weight_bytes,
                                                         args.tolerance)
                    gb = r["gb_per_s"]
                    print(f"  {name:<36} sum {gb['sum']:5.1f}  base {gb['base']:5.1f}  package {gb['package']:5.1f}"
                          f"  ({r['base_over_package']['of_medians']:.2f}x; outputs within "
                          f"{r['relative_difference']:.1g})", flush=True)
    torch.set_num_threads(threads_before)
    print(f"wrote {record.write(args.out, results)}")


if __name__ == "__main__":
    main()
