"""Two builds of csrc/chunk_delta.cpp side by side in one process: the package's and the file at a git revision.

    python benchmarks/bench_chunk_builds.py --base 3fcc71f
    python benchmarks/bench_chunk_builds.py --base HEAD --base_cflags "-O3 -fopenmp -march=native"   # flags only

For a change to the C++ chunk kernels that should only make them faster: the delta rule and the gated delta rule,
float32 and bfloat16 inputs, forward and forward + backward, 1 and 2 threads, at B1 H8 T4096 D64 and at T = 16
(``--heads 1``: B1 H1, where 2 threads split each sequence's values in blocks, value_blocks). Each
case first checks that the two builds return the same outputs and gradients bit for bit (a build that changes the
arithmetic is not a speed change: the script stops), then times the two in alternation, every round once each
(``bench_kernels.timings``, round-robin: the machine's load hits both alike). And the decode step of the 1.3B Delta
Net shape's 24 layers (B1 H16 D128 states), 200 MB read before each token, the states checked bit for bit (with
``--base_cflags``, a change of compiler flags, within 1e-5 relative: vectorised sums may add in another order).
Prints ms (median and best) and the base / package ratio of medians; writes benchmarks/results/bench_chunk_builds.json
(``--out``; ``training.result_file.RunRecord``: command, versions, machine, commit, load average before and after).
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cpu import fwd_bwd  # noqa: E402
from bench_kernels import make_inputs, timings  # noqa: E402
from fwp_kernels import chunk, cpp_build, delta_rule, gated_delta_rule  # noqa: E402
from training.result_file import RunRecord, ratio, scaled, summarize  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "bench_chunk_builds.json"
SOURCE = "kernels/csrc/chunk_delta.cpp"
RULES = {"delta": delta_rule, "gated": gated_delta_rule}


def base_ops(revision: str, source: str = SOURCE, namespace: str = "fwp_chunk", op: str = "chunk_forward",
             cflags: Optional[Sequence[str]] = None):
    """The torch ops of `source` (default csrc/chunk_delta.cpp; its ops' `namespace` and one `op` it registers) as it
    was at `revision` (built once per source and flags, like the package's), compiled with `cflags` (default: the
    package's chunk kernel's, ``chunk.CHUNK_KERNEL_CFLAGS``; other flags measure a change of flags on the same
    source)."""
    text = subprocess.run(["git", "show", f"{revision}:{source}"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout
    kernel = cpp_build.CompiledCpuKernel(Path(f"/nonexistent/{revision}/{Path(source).name}"), text, namespace, op,
                                         chunk.CHUNK_KERNEL_CFLAGS if cflags is None else tuple(cflags))
    if not kernel.available():
        raise RuntimeError(f"the C++ kernel {source} at {revision} did not build: {kernel.status}")
    return kernel.ops


def with_ops(ops, fn: Callable, kernel=None) -> Callable:
    """`fn` run on the kernel build `ops` (swapped into `kernel`, default fwp_kernels' chunk kernel, for the call)."""
    kernel = chunk._CPU_KERNEL if kernel is None else kernel

    def call():
        package = kernel.ops
        object.__setattr__(kernel, "ops", ops)
        try:
            return fn()
        finally:
            object.__setattr__(kernel, "ops", package)
    return call


def case_inputs(rule: str, T: int, dtype: torch.dtype, heads: int = 8) -> List[torch.Tensor]:
    """q, k, v, beta (and g, log-decays in (log 0.5, 0)) at B1 `heads` D64, leaves of autograd."""
    x = make_inputs(1, heads, T, 64, dtype=dtype)
    if rule == "gated":
        x.append(F.logsigmoid(torch.randn(1, heads, T, generator=torch.Generator().manual_seed(1)) + 2).to(dtype))
    return [t.requires_grad_() for t in x]


def outputs_and_grads(fn: Callable, x: List[torch.Tensor]) -> List[torch.Tensor]:
    for t in x:
        t.grad = None
    o, state = fn()
    (o.float().square().sum() + state.square().sum()).backward()
    return [o.detach(), state.detach()] + [t.grad.clone() for t in x]


def largest_difference(base: List[torch.Tensor], package: List[torch.Tensor]) -> float:
    """The largest difference of the two builds' tensors, each relative to the base's largest entry of that tensor."""
    return max(((a.double() - b.double()).abs().max() / a.double().abs().max().clamp_min(1e-30)).item()
               for a, b in zip(base, package))


def compare(rule: str, T: int, dtype: torch.dtype, ops: Dict[str, object], repeats: int, calls: int,
            tolerance: Optional[float] = None, heads: int = 8) -> dict:
    """One case: the bit-for-bit check (or, with `tolerance`, for a change of the sums' rounding: every output and
    gradient within `tolerance` of the base's, relative to its largest entry), then forward and forward + backward
    times of each build (ms per call)."""
    x = case_inputs(rule, T, dtype, heads)
    fn = lambda: RULES[rule](*x, output_final_state=True)  # noqa: E731
    # (the backward inside the swap too: each build's gradients from its own backward, not the package's)
    results = {name: with_ops(o, lambda: outputs_and_grads(fn, x))() for name, o in ops.items()}
    difference = largest_difference(results["base"], results["package"])
    if tolerance is None and not all(torch.equal(a, b) for a, b in zip(*results.values())):
        raise SystemExit(f"{rule} T={T} {dtype}: the builds' outputs or gradients differ; no timing")
    if tolerance is not None and not difference <= tolerance:
        raise SystemExit(f"{rule} T={T} {dtype}: the builds differ by {difference:.2g} (relative), over the "
                         f"tolerance {tolerance:g}; no timing")

    def repeated(f: Callable) -> Callable:
        return lambda: [f() for _ in range(calls)]

    with torch.no_grad():
        forward = timings({name: repeated(with_ops(o, fn)) for name, o in ops.items()}, repeats, warm=True)
    step = timings({name: repeated(with_ops(o, fwd_bwd(fn, x))) for name, o in ops.items()}, repeats, warm=True)
    out = {}
    for kind, t in (("forward", forward), ("fwd_bwd", step)):
        ms = {name: scaled(t[name], 1e3 / calls) for name in ops}
        out[kind] = {"ms": ms, "base_over_package": ratio(ms["base"], ms["package"])}
    out["relative_difference"] = difference
    return out


def compare_decode(ops: Dict[str, object], repeats: int, layers: int = 24, heads: int = 16, width: int = 128,
                   flush_mb: int = 200, exact: bool = True) -> dict:
    """The decode step (T = 1: csrc decode_step) of `layers` layers of B1 `heads` x `width` states, one token per timed
    call, `flush_mb` MB read before each (a model's weights between tokens, so that the states are not in the cache);
    the builds alternate which goes first, each with states of its own, checked bit for bit after every round
    (`exact`), or where the builds' flags differ (their vectorised sums may add in another order) within 1e-5 of each
    other relative to the states' largest entry, the largest difference reported."""
    g = torch.Generator().manual_seed(0)
    inputs = [(torch.randn(1, heads, 1, width, generator=g),
               F.normalize(torch.randn(1, heads, 1, width, generator=g), dim=-1),
               torch.randn(1, heads, 1, width, generator=g), torch.sigmoid(torch.randn(1, heads, 1, generator=g)))
              for _ in range(layers)]
    start = [0.1 * torch.randn(1, heads, width, width, generator=g) for _ in range(layers)]
    states = {name: [s.clone() for s in start] for name in ops}
    flush = torch.randn(flush_mb * 2**20 // 4)

    def token(name: str) -> Callable:
        def run():
            for layer in range(layers):
                states[name][layer] = delta_rule(*inputs[layer], initial_state=states[name][layer],
                                                 output_final_state=True)[1]
        return with_ops(ops[name], run)

    fns = {name: token(name) for name in ops}
    times = {name: [] for name in ops}
    with torch.no_grad():
        for r in range(repeats + 1):  # the first round untimed
            for name in (list(ops) if r % 2 else list(ops)[::-1]):
                flush.sum()
                t0 = time.perf_counter()
                fns[name]()
                if r > 0:
                    times[name].append(time.perf_counter() - t0)
            pairs = list(zip(*states.values()))
            if exact and not all(torch.equal(a, b) for a, b in pairs):
                raise SystemExit("decode: the builds' states differ; no timing")
            difference = max(((a - b).abs().max() / a.abs().max()).item() for a, b in pairs)
            if difference > 1e-5:
                raise SystemExit(f"decode: the builds' states differ by {difference:.2g} (relative); no timing")
    ms = {name: scaled(summarize(t), 1e3) for name, t in times.items()}
    return {"ms": ms, "base_over_package": ratio(ms["base"], ms["package"]), "layers": layers, "heads": heads,
            "width": width, "flush_mb": flush_mb, "states_relative_difference": difference}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="git revision whose csrc/chunk_delta.cpp is the baseline")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks that the script runs")
    parser.add_argument("--rounds", type=int, default=None,
                        help="timed rounds per case (default: 9 at T = 4096, 15 at T = 16)")
    parser.add_argument("--out", default=str(RESULTS), help="default: benchmarks/results/bench_chunk_builds.json")
    parser.add_argument("--base_cflags", default=None,
                        help="the base build's compiler flags, one string (default: the package's CHUNK_KERNEL_CFLAGS)")
    parser.add_argument("--tolerance", type=float, default=None,
                        help="for a change that rounds the sums otherwise: the builds' outputs and gradients compared "
                             "within this relative difference instead of bit for bit (the decode states within 1e-5, "
                             "as with --base_cflags)")
    parser.add_argument("--heads", type=int, default=8, help="heads of the chunk cases (B = 1)")
    args = parser.parse_args()
    record = RunRecord.start("python benchmarks/bench_chunk_builds.py")
    if not chunk.cpu_kernel_available():
        raise SystemExit(f"the package's C++ chunk kernel is not available: {chunk.cpu_kernel_status()}")
    base_cflags = None if args.base_cflags is None else args.base_cflags.split()
    ops = {"base": base_ops(args.base, cflags=base_cflags), "package": chunk._CPU_KERNEL.ops}
    # (T, rounds, calls per timed round)
    lengths = {"long": (4096, 9, 1), "short": (16, 15, 50)}
    if args.quick:
        lengths = {"long": (256, 2, 1), "short": (16, 2, 5)}
    if args.rounds is not None:
        lengths = {label: (T, args.rounds, calls) for label, (T, _, calls) in lengths.items()}
    results = {"base": args.base, "tolerance": args.tolerance,
               "base_cflags": base_cflags or list(chunk.CHUNK_KERNEL_CFLAGS),
               "package_cflags": list(chunk._CPU_KERNEL.extra_cflags), "quick": args.quick, "heads": args.heads,
               "cases": {}}
    threads_before = torch.get_num_threads()
    print(f"ms per call, median (best); base {args.base} / package, ratio of medians")
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for label, (T, repeats, calls) in lengths.items():
            for rule in RULES:
                for dtype in (torch.float32, torch.bfloat16):
                    name = f"{rule}_{str(dtype)[6:]}_T{T}_threads{threads}"
                    r = results["cases"][name] = compare(rule, T, dtype, ops, repeats, calls, args.tolerance,
                                                         args.heads)
                    cells = [f"{kind} {r[kind]['ms']['base']['median']:.3f} -> {r[kind]['ms']['package']['median']:.3f}"
                             f" ({r[kind]['base_over_package']['of_medians']:.2f}x)" for kind in ("forward", "fwd_bwd")]
                    print(f"  {name:<32}" + "   ".join(cells))
        name = f"decode_24_layers_H16_D128_threads{threads}"
        r = results["cases"][name] = compare_decode(ops, 5 if args.quick else 30, layers=2 if args.quick else 24,
                                                    exact=base_cflags is None and args.tolerance is None)
        print(f"  {name:<40} token {r['ms']['base']['median']:.3f} -> {r['ms']['package']['median']:.3f}"
              f" ({r['base_over_package']['of_medians']:.2f}x; states within {r['states_relative_difference']:.2g})")
    torch.set_num_threads(threads_before)
    print(f"wrote {record.write(args.out, results)}")


if __name__ == "__main__":
    main()
