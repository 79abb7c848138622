"""The kernels against themselves at an earlier commit: bench_kernels' shapes timed in both, in alternating processes.

    python benchmarks/bench_versions.py --base d13a944 --rounds 7

Issue 18 asks that nothing be slower than on the day it was filed "at any shape in bench_kernels' table (short T
included)"; d13a944 is the commit before its first change (6f55f54). bench_chunk_builds.py compares two builds of the
C++ file in one process, which needs the same op signatures; across many commits the Python side changed too, so
here each version runs whole in its own process: `fwp_kernels` of the revision (``git archive`` of its kernels/ into
a temporary folder) or of this checkout, put first on PYTHONPATH. Per round, each version's process times every case
(round-robin over the cases, ``--repeats`` calls each, the median kept); the rounds alternate which version runs
first, and the figure of a case is the median over the rounds. Cases (B*H = 8, D = 64, float32 unless named):

- T = 4096 forward and forward + backward: the delta rule at chunk_size 32 and 64 and in mode="auto", the sum rule
  (linear_attention) in mode="auto", the delta rule in mode="auto" on bfloat16 inputs;
- short T (1, 2, 3, 4, 8, 16), B*H = 8 and 32, forward: both rules in mode="recurrent" (the step loop), "chunk" and
  "auto" (bench_kernels.auto_crossover's table).

Prints base / this checkout per case (above 1: this checkout faster), of the medians and of the best calls, at 1 and
2 threads; writes
benchmarks/results/bench_versions.json (``--out``; ``training.result_file.RunRecord``).
"""
from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results" / "bench_versions.json"
SHORT_T = (1, 2, 3, 4, 8, 16)


def make_inputs(BH: int, T: int, D: int, dtype, requires_grad: bool = False) -> list:
    """q, k (unit rows), v [1, BH, T, D] and beta [1, BH, T] in (0, 1), seeded: bench_kernels.make_inputs' recipe,
    written here because the worker imports nothing of this checkout but the `fwp_kernels` on its PYTHONPATH
    (bench_kernels and bench_cpu import this checkout's fwp_kernels and training)."""
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, BH, T, D, generator=g)
    k = F.normalize(torch.randn(1, BH, T, D, generator=g), dim=-1)
    v = torch.randn(1, BH, T, D, generator=g)
    beta = torch.sigmoid(torch.randn(1, BH, T, generator=g))
    return [x.to(dtype).requires_grad_(requires_grad) for x in (q, k, v, beta)]


def worker_cases(quick: bool) -> Dict[str, Callable]:
    """name -> a call of the `fwp_kernels` on sys.path (imported here, in the worker process)."""
    import torch
    from fwp_kernels import delta_rule, linear_attention

    def rule(x, name, **mode):
        if name == "delta":
            return lambda: delta_rule(*x, output_final_state=True, **mode)
        return lambda: linear_attention(*x[:3], output_final_state=True, **mode)

    def fwd_bwd(fn, x):  # as bench_cpu.fwd_bwd: the output gradients made once, not in the timed calls
        ones = {}

        def run():
            for t in x:
                t.grad = None
            outputs = fn()
            grads = [ones.setdefault((t.shape, t.dtype), torch.ones_like(t)) for t in outputs]
            torch.autograd.backward(outputs, grads)
        return run

    def no_grad(fn):
        def run():
            with torch.no_grad():
                return fn()
        return run

    T = 256 if quick else 4096
    fp32, bf16 = make_inputs(8, T, 64, torch.float32, True), make_inputs(8, T, 64, torch.bfloat16, True)
    long = {"delta_C32": rule(fp32, "delta", mode="chunk", chunk_size=32),
            "delta_C64": rule(fp32, "delta", mode="chunk", chunk_size=64),
            "delta_auto": rule(fp32, "delta"), "sum_auto": rule(fp32, "sum"), "delta_auto_bf16": rule(bf16, "delta")}
    cases = {}
    for name, fn in long.items():
        x = bf16 if name.endswith("bf16") else fp32
        cases[f"T{T}_{name}_forward"] = no_grad(fn)
        cases[f"T{T}_{name}_fwd_bwd"] = fwd_bwd(fn, x)
    for BH in (8, 32):
        for t in SHORT_T[:2] if quick else SHORT_T:
            x = make_inputs(BH, t, 64, torch.float32)
            for name in ("delta", "sum"):
                for mode in ("recurrent", "chunk", "auto"):
                    cases[f"BH{BH}_T{t}_{name}_{mode}"] = no_grad(rule(x, name, mode=mode))
    return cases


def worker(threads: int, repeats: int, quick: bool) -> None:
    """Times worker_cases round-robin (one untimed call before each timed one) and prints {case: [median ms, best
    ms]} as JSON."""
    import torch
    import fwp_kernels

    torch.set_num_threads(threads)
    cases = worker_cases(quick)
    times: Dict[str, List[float]] = {name: [] for name in cases}
    for fn in cases.values():
        fn()
    for _ in range(repeats):
        for name, fn in cases.items():
            fn()
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) * 1e3)
    print(json.dumps({"package": str(Path(fwp_kernels.__file__).parent),
                      "ms": {name: [statistics.median(t), min(t)] for name, t in times.items()}}))


def version_site(revision: str, work: Path) -> Path:
    """A folder whose `fwp_kernels` is kernels/ at `revision` (".": this checkout's working tree)."""
    site = work / f"site_{revision.replace('/', '_')}"
    site.mkdir()
    if revision == ".":
        (site / "fwp_kernels").symlink_to(ROOT / "kernels")
        return site
    tree = work / f"tree_{revision.replace('/', '_')}"
    tree.mkdir()
    archive = subprocess.run(["git", "archive", revision, "kernels"], cwd=ROOT, capture_output=True, check=True).stdout
    tarfile.open(fileobj=io.BytesIO(archive)).extractall(tree, filter="data")
    (site / "fwp_kernels").symlink_to(tree / "kernels")
    return site


def run_worker(site: Path, threads: int, repeats: int, quick: bool) -> dict:
    """One worker process on the `fwp_kernels` of `site`; its JSON."""
    env = dict(os.environ, PYTHONPATH=str(site), OMP_NUM_THREADS=str(threads))
    command = [sys.executable, __file__, "--worker", "--threads", str(threads), "--repeats", str(repeats)]
    out = subprocess.run(command + (["--quick"] if quick else []), env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"the worker on {site} failed:\n{out.stderr[-3000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if Path(result["package"]).resolve() != (site / "fwp_kernels").resolve():
        raise SystemExit(f"the worker imported fwp_kernels from {result['package']}, not from {site}")
    return result["ms"]


def compare(sites: Dict[str, Path], threads: int, rounds: int, repeats: int, quick: bool) -> dict:
    """Rounds of one process per version (the order alternating); per case each version's median over the rounds of
    its processes' medians, its best call of all rounds, and base / this checkout of both. (The VM this was written on
    runs some processes in a slower state than others: the medians of short calls then swing by 20-30% between runs,
    the best calls by a few percent.)"""
    names = list(sites)
    for site in sites.values():  # untimed: builds each version's C++ kernels (once per source and flags)
        run_worker(site, threads, 1, True)
    runs: Dict[str, List[dict]] = {name: [] for name in names}
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            runs[name].append(run_worker(sites[name], threads, repeats, quick))
    out = {}
    for case in runs[names[0]][0]:
        ms = {name: statistics.median(run[case][0] for run in runs[name]) for name in names}
        best = {name: min(run[case][1] for run in runs[name]) for name in names}
        out[case] = {"ms": ms, "base_over_this": ms["base"] / ms["this"], "best_ms": best,
                     "best_base_over_this": best["base"] / best["this"],
                     "rounds_ms": {name: [run[case][0] for run in runs[name]] for name in names}}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="d13a944", help="the revision compared with this checkout")
    parser.add_argument("--rounds", type=int, default=7, help="processes per version and thread count")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per case in each process")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks that the script runs")
    parser.add_argument("--out", default=str(RESULTS), help="default: benchmarks/results/bench_versions.json")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.threads[0], args.repeats, args.quick)
    sys.path.insert(0, str(ROOT))
    from training.result_file import RunRecord

    record = RunRecord.start("python benchmarks/bench_versions.py")
    results = {"base": args.base, "quick": args.quick, "rounds": args.rounds, "repeats": args.repeats, "threads": {}}
    with tempfile.TemporaryDirectory() as tmp:
        sites = {"base": version_site(args.base, Path(tmp)), "this": version_site(".", Path(tmp))}
        for threads in args.threads:
            r = results["threads"][str(threads)] = compare(sites, threads, args.rounds, args.repeats, args.quick)
            print(f"{threads} thread(s): ms, median over {args.rounds} processes each (best call), base {args.base} "
                  f"-> this checkout, base / this")
            for case, row in r.items():
                print(f"  {case:<30} {row['ms']['base']:8.3f} ({row['best_ms']['base']:7.3f}) -> "
                      f"{row['ms']['this']:8.3f} ({row['best_ms']['this']:7.3f})  {row['base_over_this']:5.2f}x "
                      f"({row['best_base_over_this']:.2f}x)")
    print(f"wrote {record.write(args.out, results)}")


if __name__ == "__main__":
    main()
