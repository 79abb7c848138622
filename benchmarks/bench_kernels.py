"""Speed and memory of the fwp_kernels chunkwise kernels, measured side by side in one run.

    OMP_NUM_THREADS=1 python benchmarks/bench_kernels.py --threads 1   # about 2 minutes on an idle 2-core CPU
    python benchmarks/bench_kernels.py --quick      # smaller repeat counts, no T = 16384 memory runs

Prints, and writes to benchmarks/results/bench_kernels.json (``--out``), with the run's command, versions and load
average before and after (``"run"``, ``training.result_file``):

1. fp32 matmul peak (2048^3) of this machine, timed in the same interleaved rounds as the forward.
2. Forward time at B=1, H=8, T=4096, Dk=Dv=64, fp32: step loop vs chunked kernel vs transformers'
   `torch_chunk_gated_delta_rule` (g = 0, q pre-scaled by Dk^0.5 to undo its Dk^-0.5, no l2norm:
   the same delta rule), as ratios, and the chunked kernel's achieved GFLOP/s (`chunk_flops`). The
   chunked kernel is what `mode="chunk"` runs on CPU: the C++ kernel when it builds (its status is
   recorded), else the PyTorch one; the PyTorch one is also timed on its own ("torch path").
3. Forward + backward time at the same shape.
4. Forward + backward peak memory at T = 1024, 4096, 16384 (see `_memory_worker` for the method).
5. Step loop vs chunked kernel at short T: where mode="auto" switches (fwp_kernels.chunk.auto_mode).

Every function runs once per round (the step loops included), over --repeats rounds. Each time is kept as the best
(``*_s``: the least disturbed run), the median (``*_median_s``) and all rounds (``timings``); ratios are printed and
quoted both ways, the ratio of medians first. The machine's load average is recorded with them, since other
processes share the cores.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fwp_kernels import chunk, delta_rule, linear_attention  # noqa: E402
from fwp_kernels.delta_rule_kernels import delta_rule_chunk, delta_rule_recurrent  # noqa: E402
from fwp_kernels.linear_attention_kernels import linear_attention_chunk, linear_attention_recurrent  # noqa: E402
from training.result_file import RunRecord, summarize  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "bench_kernels.json"


def hf_delta_rule():
    """transformers' torch fallback for the (gated) delta rule, or None if unavailable."""
    try:
        from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule
        from transformers.utils import logging

        logging.set_verbosity_error()  # it warns once that flash-linear-attention is missing
    except ImportError:
        return None

    def run(q, k, v, beta, g=None, output_final_state=True):
        # Its layout is [B, T, H, D] and it multiplies q by Dk^-0.5: undo that so both compute
        # W_t = a_t W_{t-1} + beta_t (v_t - a_t W_{t-1} k_t) k_t^T, o_t = W_t q_t (g = log a [B, H, T]; None: 0, the
        # delta rule).
        Dk = q.shape[-1]
        g = q.new_zeros(q.shape[0], q.shape[2], q.shape[1]) if g is None else g.transpose(1, 2)
        o, state = torch_chunk_gated_delta_rule(
            (q * Dk**0.5).transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), g, beta.transpose(1, 2),
            chunk_size=64, output_final_state=output_final_state, use_qk_l2norm_in_kernel=False,
        )
        return o.transpose(1, 2), state

    return run


def make_inputs(B, H, T, D, dtype=torch.float32, requires_grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=g)
    k = F.normalize(torch.randn(B, H, T, D, generator=g), dim=-1)
    v = torch.randn(B, H, T, D, generator=g)
    beta = torch.sigmoid(torch.randn(B, H, T, generator=g))
    return [x.to(dtype).requires_grad_(requires_grad) for x in (q, k, v, beta)]


def chunk_flops(rule: str, B: int, H: int, T: int, Dk: int, Dv: int, C: int, algorithm: str = "cpp") -> int:
    """Multiply-add FLOPs (2 per MAC) of the chunked algorithm's matmuls, forward; N = ceil(T / C).
    Triangular factors are counted as the full matmuls the code calls.

    delta rule, C++ kernel (csrc/chunk_delta.cpp), per chunk: [Q; K] K^T (4 C^2 Dk),
        [Q; K] S^T (4 C Dk Dv), the solve (I + A) U' = diag(beta) (V - K S^T) (C^2 Dv),
        O += tril(Q K^T) U' (2 C^2 Dv), S' = S + U'^T K (2 C Dk Dv)
        -> C^2 (4 Dk + 3 Dv) + 6 C Dk Dv
    delta rule, PyTorch path (WY form): P = Q K^T (2 C^2 Dk), A = diag(beta) K K^T (2 C^2 Dk),
        T = (I + A)^-1 (~C^3 / 3), W = T diag(beta) K (2 C^2 Dk), U = T diag(beta) V (2 C^2 Dv),
        U' = U - W S^T (2 C Dk Dv), S' = S + U'^T K (2 C Dk Dv), O = Q S^T + P U' (2 C Dk Dv + 2 C^2 Dv)
        -> C^2 (6 Dk + 4 Dv) + 6 C Dk Dv + C^3 / 3
    sum rule, both:         P (2 C^2 Dk), O = Q S^T + P V (2 C Dk Dv + 2 C^2 Dv), S' = S + V^T K (2 C Dk Dv)
        -> C^2 (2 Dk + 2 Dv) + 4 C Dk Dv
    Elementwise work (masks, beta scaling, copies) is not counted.
    """
    N = -(-T // C)
    if rule == "delta" and algorithm == "cpp":
        per_chunk = C * C * (4 * Dk + 3 * Dv) + 6 * C * Dk * Dv
    elif rule == "delta":
        per_chunk = C * C * (6 * Dk + 4 * Dv) + 6 * C * Dk * Dv + C**3 // 3
    else:
        per_chunk = C * C * (2 * Dk + 2 * Dv) + 4 * C * Dk * Dv
    return B * H * N * per_chunk


def chunk_backward_flops(rule: str, B: int, H: int, T: int, Dk: int, Dv: int, C: int) -> int:
    """Multiply-add FLOPs (2 per MAC) of the C++ kernel's backward products (csrc/chunk_delta.cpp,
    ``chunk_backward_seq``), N = ceil(T / C); its recomputation of the forward (the states entering the chunks and U')
    is not counted, so that forward + backward is counted as the forward's FLOPs plus these. Per chunk, both rules:
    P = tril(Q K^T) (2 C^2 Dk), dU' = K dS'^T + P^T dO (2 C Dk Dv + 2 C^2 Dv), dK = U' dS' (2 C Dk Dv),
    dP = tril(dO U'^T) (2 C^2 Dv), dQ = dO S + dP K (2 C Dk Dv + 2 C^2 Dk), dK += dP^T Q (2 C^2 Dk),
    dS += dO^T Q (2 C Dk Dv) -> 8 C Dk Dv + C^2 (6 Dk + 4 Dv);
    delta rule besides: X = V - K S^T, dK -= dV S, dS -= dV^T K (6 C Dk Dv), K K^T, M = dA K, dK += dA^T diag(beta) K
    (6 C^2 Dk), dA = -strictly_lower(dR U'^T) (2 C^2 Dv), the transposed solve (C^2 Dv)
        -> 14 C Dk Dv + C^2 (12 Dk + 7 Dv).
    Triangular factors count as full products; elementwise work is not counted."""
    N = -(-T // C)
    if rule == "delta":
        per_chunk = 14 * C * Dk * Dv + C * C * (12 * Dk + 7 * Dv)
    else:
        per_chunk = 8 * C * Dk * Dv + C * C * (6 * Dk + 4 * Dv)
    return B * H * N * per_chunk


def torch_path(fn):
    """`fn` run with the PyTorch chunked kernel, whether or not the C++ one is built."""

    def run():
        available = chunk.cpu_kernel_available
        chunk.cpu_kernel_available = lambda: False
        try:
            return fn()
        finally:
            chunk.cpu_kernel_available = available

    return run


def timings(fns: dict, repeats: int, warm: bool = False) -> dict:
    """Wall time of each function over `repeats` rounds as ``{"best", "median", "all"}``, measured round-robin (every
    function once per round, after one warm-up call each) so that changes in the machine's load hit every kernel
    alike. `warm`: each timed call right after an untimed call of the same function, so that every function starts
    with its own inputs in the cache (else a call finds them where the calls before it in the round left them)."""
    for fn in fns.values():
        fn()  # warm-up
    times = {name: [] for name in fns}
    for r in range(repeats):
        for name, fn in fns.items():
            if warm:
                fn()
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: summarize(t) for name, t in times.items()}


def flatten(summaries: dict, suffix: str = "_s", scale: float = 1.0) -> dict:
    """``{name}{suffix}`` (best) and ``{name}_median{suffix}`` (median) of each summary, times `scale`."""
    out = {}
    for name, t in summaries.items():
        out[f"{name}{suffix}"] = t["best"] * scale
        out[f"{name}_median{suffix}"] = t["median"] * scale
    return out


def forward_times(args, hf) -> dict:
    B, H, T, D = 1, 8, 4096, 64
    q, k, v, beta = make_inputs(B, H, T, D)
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    fns = {
        "matmul_2048": lambda: a @ b,  # the peak, measured in the same rounds as the kernels
        "delta_step_loop": lambda: delta_rule_recurrent(q, k, v, beta, None, True),
        "delta_chunk32": lambda: delta_rule_chunk(q, k, v, beta, None, True, 32),
        "delta_chunk64": lambda: delta_rule_chunk(q, k, v, beta, None, True, 64),
        "sum_step_loop": lambda: linear_attention_recurrent(q, k, v, None, True),
        "sum_chunk32": lambda: linear_attention_chunk(q, k, v, None, True, 32),
        "sum_chunk64": lambda: linear_attention_chunk(q, k, v, None, True, 64),
        "delta_chunk64_torch_path": torch_path(lambda: delta_rule_chunk(q, k, v, beta, None, True, 64)),
    }
    if hf is not None:
        fns["delta_hf"] = lambda: hf(q, k, v, beta)
    with torch.no_grad():
        times = timings(fns, args.repeats)
    out = {"shape": {"B": B, "H": H, "T": T, "Dk": D, "Dv": D, "dtype": "float32"}, "repeats": args.repeats}
    matmul = times.pop("matmul_2048")
    out["matmul_2048_gflops"] = 2 * 2048**3 / matmul["best"] / 1e9
    out["matmul_2048_gflops_median"] = 2 * 2048**3 / matmul["median"] / 1e9
    if hf is not None:  # both compute the same delta rule
        with torch.no_grad():
            o_ref, o_hf = delta_rule_chunk(q, k, v, beta, None, False, 64)[0], hf(q, k, v, beta)[0]
        out["hf_vs_chunk_rel_diff"] = ((o_hf - o_ref).norm() / o_ref.norm()).item()
    out.update(flatten(times))
    out["timings"] = times
    algorithm = "cpp" if chunk.cpu_kernel_available() else "torch"
    out["chunk_kernel"] = ("C++ (csrc/chunk_delta.cpp)" if algorithm == "cpp"
                           else f"PyTorch ({chunk.cpu_kernel_status()})")
    for rule in ("delta", "sum"):
        for C in (32, 64):
            flops = chunk_flops(rule, B, H, T, D, D, C, algorithm)
            out[f"{rule}_chunk{C}_gflop"] = flops / 1e9
            out[f"{rule}_chunk{C}_gflops"] = flops / out[f"{rule}_chunk{C}_s"] / 1e9
            out[f"{rule}_chunk{C}_gflops_median"] = flops / out[f"{rule}_chunk{C}_median_s"] / 1e9
    torch_flops = chunk_flops("delta", B, H, T, D, D, 64, "torch")
    out["delta_chunk64_torch_path_gflops"] = torch_flops / out["delta_chunk64_torch_path_s"] / 1e9
    out["delta_chunk64_torch_path_gflops_median"] = torch_flops / out["delta_chunk64_torch_path_median_s"] / 1e9
    return out


def backward_times(args, hf) -> dict:
    q, k, v, beta = make_inputs(1, 8, 4096, 64, requires_grad=True)

    def fwd_bwd(fn):
        def run():
            o, s = fn()
            (o.sum() + s.sum()).backward()

        return run

    fns = {
        "delta_chunk32": fwd_bwd(lambda: delta_rule_chunk(q, k, v, beta, None, True, 32)),
        "delta_chunk64": fwd_bwd(lambda: delta_rule_chunk(q, k, v, beta, None, True, 64)),
        "sum_chunk64": fwd_bwd(lambda: linear_attention_chunk(q, k, v, None, True, 64)),
        "delta_chunk64_torch_path": torch_path(fwd_bwd(lambda: delta_rule_chunk(q, k, v, beta, None, True, 64))),
    }
    if hf is not None:
        fns["delta_hf"] = fwd_bwd(lambda: hf(q, k, v, beta))
    times = {f"{name}_fwd_bwd": t for name, t in timings(fns, max(3, args.repeats - 2)).items()}
    return {**flatten(times), "timings": times}


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _memory_worker(kind: str, T: int) -> dict:
    """Runs one forward + backward in this (fresh) process and reports its memory.

    * ``peak_mb``: the rise of the process's resident-set high-water mark over the forward and
      backward, inputs already allocated: the mark (VmHWM) is reset through /proc/self/clear_refs
      just before. Torch has no CPU allocator statistics; large CPU tensors are mmap-ed and given
      back on free, so the resident peak follows the peak of live tensors, temporaries included
      (plus a few MB of one-off library buffers on the first call).
    * ``saved_for_backward_mb``: bytes autograd keeps between forward and backward, counted with
      ``torch.autograd.graph.saved_tensors_hooks`` (what a long sequence costs during training).
    """
    q, k, v, beta = make_inputs(1, 8, T, 64, requires_grad=True)
    hf = hf_delta_rule() if kind == "delta_hf" else None
    fn = {
        "delta_chunk64": lambda: delta_rule_chunk(q, k, v, beta, None, True, 64),
        "sum_chunk64": lambda: linear_attention_chunk(q, k, v, None, True, 64),
        "delta_step_loop": lambda: delta_rule_recurrent(q, k, v, beta, None, True),
        "delta_hf": lambda: hf(q, k, v, beta),
    }[kind]
    chunk.cpu_kernel_available()  # loads the C++ kernel (a one-off library mapping) before the measurement
    saved = [0]

    def pack(x):
        saved[0] += x.numel() * x.element_size()
        return x

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident set
    rss_before = _status_kb("VmRSS")
    t0 = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        o, s = fn()
    (o.sum() + s.sum()).backward()
    seconds = time.perf_counter() - t0
    return {
        "peak_mb": (_status_kb("VmHWM") - rss_before) / 1024,
        "saved_for_backward_mb": saved[0] / 2**20,
        "fwd_bwd_s": seconds,
    }


def memory(args) -> dict:
    # The step loop keeps ~T * Dk * Dv floats per head for backward; measured at T = 1024 only (its
    # backward takes minutes at T = 16384).
    runs = {1024: ["delta_chunk64", "sum_chunk64", "delta_hf", "delta_step_loop"],
            4096: ["delta_chunk64", "sum_chunk64", "delta_hf"],
            16384: ["delta_chunk64", "sum_chunk64", "delta_hf"]}
    if args.quick:
        runs.pop(16384)
    out = {}
    for T, kinds in runs.items():
        for kind in kinds:
            if kind == "delta_hf" and hf_delta_rule() is None:
                continue
            proc = subprocess.run(
                [sys.executable, __file__, "--memory-worker", kind, str(T), "--threads", str(torch.get_num_threads())],
                capture_output=True, text=True, check=True,
            )
            out[f"{kind}_T{T}"] = json.loads(proc.stdout.splitlines()[-1])
    return out


def auto_crossover(args) -> dict:
    """Step loop vs chunked forward (public API, default chunk_size) at short T, B*H = 8 and 32."""
    out = {}
    with torch.no_grad():
        for BH in (8, 32):
            for T in (1, 2, 3, 4, 8, 16):
                q, k, v, beta = make_inputs(1, BH, T, 64)
                times = timings({
                    "delta_step_loop": lambda: delta_rule(q, k, v, beta, mode="recurrent"),
                    "delta_chunk": lambda: delta_rule(q, k, v, beta, mode="chunk"),
                    "sum_step_loop": lambda: linear_attention(q, k, v, mode="recurrent"),
                    "sum_chunk": lambda: linear_attention(q, k, v, mode="chunk"),
                }, 5 * args.repeats)
                out[f"BH{BH}_T{T}"] = flatten(times, "_ms", 1e3)
    return out


def print_forward(fw: dict) -> None:
    """The forward table: time, speed-up over the step loop and over transformers', GFLOP/s and share of the matmul
    peak, each as median (best)."""
    peak, peak_median = fw["matmul_2048_gflops"], fw["matmul_2048_gflops_median"]
    print(f"fp32 matmul 2048^3: {peak_median:.1f} GFLOP/s median, {peak:.1f} best, in the same rounds as the forward "
          f"times  (torch threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.2f} on "
          f"{os.cpu_count()} CPUs)")
    print(f"\nforward, B=1 H=8 T=4096 Dk=Dv=64 fp32, {fw['repeats']} rounds, median (best); chunked kernel: "
          f"{fw['chunk_kernel']}")
    print(f"  {'kernel':<38}{'time ms':>17}{'vs step loop':>16}{'vs HF':>14}{'of matmul peak':>17}")
    has_hf = "delta_hf_s" in fw

    def row(label: str, name: str, rule: str, gflops: str = "") -> None:
        t, tm = fw[f"{name}_s"], fw[f"{name}_median_s"]
        loop, loopm = fw[f"{rule}_step_loop_s"], fw[f"{rule}_step_loop_median_s"]
        vs_hf = (f"{fw['delta_hf_median_s'] / tm:7.1f}x ({fw['delta_hf_s'] / t:4.1f})" if rule == "delta" and has_hf
                 else " " * 14)
        share = (f"{100 * fw[gflops + '_median'] / peak_median:8.0f}% ({100 * fw[gflops] / peak:3.0f})"
                 if gflops else "")
        print(f"  {label:<38}{tm * 1e3:9.1f} ({t * 1e3:5.1f}){loopm / tm:9.1f}x ({loop / t:4.1f}){vs_hf}{share}")

    for rule in ("delta", "sum"):
        row(f"{rule} rule, step loop", f"{rule}_step_loop", rule)
        if rule == "delta" and has_hf:
            row("delta rule, torch_chunk_gated_delta_rule", "delta_hf", rule)
            print(f"  (transformers' outputs differ from ours by {fw['hf_vs_chunk_rel_diff']:.1e}, relative)")
        for C in (32, 64):
            row(f"{rule} rule, chunk C={C}", f"{rule}_chunk{C}", rule, f"{rule}_chunk{C}_gflops")
        if rule == "delta":
            row("delta rule, chunk C=64, torch path", "delta_chunk64_torch_path", rule,
                "delta_chunk64_torch_path_gflops")


def print_rest(results: dict) -> None:
    """Forward + backward times, memory and the short-T crossover table."""
    bw = results["forward_backward"]
    print("\nforward + backward, same shape, median (best)")
    for name in bw["timings"]:
        t, tm = bw[f"{name}_s"], bw[f"{name}_median_s"]
        extra = ""
        if name.startswith("delta_chunk") and "delta_hf_fwd_bwd_s" in bw:
            extra = (f"   {bw['delta_hf_fwd_bwd_median_s'] / tm:.1f}x ({bw['delta_hf_fwd_bwd_s'] / t:.1f}x) "
                     "faster than HF")
        print(f"  {name[:-len('_fwd_bwd')]:<38}{tm * 1e3:>9.1f} ms ({t * 1e3:.1f}){extra}")
    print("\nforward + backward memory, B=1 H=8 Dk=Dv=64 fp32 (fresh process each)")
    print(f"  {'kernel':<20}{'T':>7}{'peak MB':>10}{'saved for bwd MB':>18}")
    for name, m in results["memory"].items():
        kind, T = name.rsplit("_T", 1)
        print(f"  {kind:<20}{T:>7}{m['peak_mb']:>10.1f}{m['saved_for_backward_mb']:>18.1f}")
    print("\nstep loop vs chunk forward at short T, median ms (mode='auto' thresholds: fwp_kernels/dispatch.py)")
    print(f"  {'':<12}{'delta loop':>11}{'delta chunk':>12}{'sum loop':>10}{'sum chunk':>10}")
    for name, m in results["auto_crossover"].items():
        print(f"  {name:<12}{m['delta_step_loop_median_ms']:>11.3f}{m['delta_chunk_median_ms']:>12.3f}"
              f"{m['sum_step_loop_median_ms']:>10.3f}{m['sum_chunk_median_ms']:>10.3f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats, no T=16384 memory runs")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--out", default=str(RESULTS), help="default: benchmarks/results/bench_kernels.json")
    parser.add_argument("--memory-worker", nargs=2, metavar=("KIND", "T"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_worker:
        print(json.dumps(_memory_worker(args.memory_worker[0], int(args.memory_worker[1]))))
        return
    record = RunRecord.start("python benchmarks/bench_kernels.py")
    args.repeats = args.repeats or (3 if args.quick else 5)
    hf = hf_delta_rule()
    results = {"threads": torch.get_num_threads(), "quick": args.quick}
    results["forward"] = forward_times(args, hf)
    results["matmul_2048_gflops"] = results["forward"]["matmul_2048_gflops"]
    print_forward(results["forward"])
    results["forward_backward"] = backward_times(args, hf)
    results["memory"] = memory(args)
    results["auto_crossover"] = auto_crossover(args)
    print_rest(results)
    path = record.write(args.out, results)
    print(f"\nwrote {path} (load average {os.getloadavg()[0]:.2f})")


if __name__ == "__main__":
    main()
