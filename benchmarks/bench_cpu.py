"""CPU speed of the chunkwise fast-weight kernels against this machine's limits, at 1 and 2 threads, in one run.

    python benchmarks/bench_cpu.py            # a few minutes on an idle 2-core CPU
    python benchmarks/bench_cpu.py --quick    # tiny sizes, a few seconds: checks that it runs

Prints, and writes to benchmarks/results/bench_cpu.json (``--out``; ``training.result_file.RunRecord``: command,
versions, machine, load average before and after), for each thread count side by side:

1. ``peaks``: fp32 and bf16 matmul 2048^3 (GFLOP/s; torch.matmul: MKL for fp32, oneDNN for bf16) and the memory read
   bandwidth (GB/s, ``x.sum()`` over 512 MB).
2. ``kernels``: B=1 H=8 T=4096 D=64, forward and forward + backward of the delta and sum rules (C = 16, 32, 64 and
   ``mode="auto"``; the products as shipped: the kernel's own micro-kernel where built, AVX-512 or AVX2), the same fp32 calls
   with the BLAS's products (``*_auto_blas``: the kernel before its micro-kernel), bf16 inputs (``*_auto_bf16``:
   as shipped, bfloat16 factors forward and backward where the build has AVX-512 BF16; ``*_auto_bf16_in_fp32``: the same
   inputs with float32 products throughout; ``*_auto_bf16_vdpbf16ps``, where the bfloat16 factors run in AMX tiles:
   the same inputs with AVX-512 BF16's vdpbf16ps instead),
   and transformers' ``torch_chunk_gated_delta_rule`` (g = 0, the same delta rule: ``bench_kernels.hf_delta_rule``);
   the gated delta rule (``gated_Cauto``; ``gated_auto_blas``; ``gated_auto_bf16`` and ``gated_auto_bf16_in_fp32`` as
   for the delta rule; transformers' with the same g):
   ms, achieved GFLOP/s over the matmul peak of the factors' dtype (``bench_kernels.chunk_flops``; forward + backward
   with ``chunk_backward_flops``, over the fp32 peak), ratios to transformers', to the BLAS products and of bf16 to
   fp32, and thread scaling (1-thread time / 2-thread time).
3. ``delta_net_1b3``: the 1.3B Delta Net shape (hidden 2048, 16 heads of 128, 24 layers), the fast-weight kernel only:
   prefill of 2048 tokens (tokens/s, 24 layers of ``delta_rule(mode="auto")``) against the matmul bound (its FLOPs at
   the fp32 peak; bf16 inputs beside it, at the bf16 peak where the kernel multiplies in bfloat16), and decode
   (ms/token: 24 layers of one-token ``delta_rule(mode="auto")``, each with its own state) against the bandwidth bound
   (each layer's fp32 state read and written once, at the read bandwidth). The bound of the
   whole model's decode (1.3e9 fp32 weights read per token, plus the states) is printed beside it.
4. ``linear_rows``: x W^T for one and two rows of x against eight 5632 x 2048 weights (the 1.3B shape's feed-forward,
   more than the cache), float32 and bfloat16: GB/s of the streaming kernel (``fwp_dense.linear_rows``,
   csrc/decode_linear.cpp), ``F.linear`` and oneDNN's matmul, beside ``x.sum()``'s read rate over the same weights.
5. ``auto_table``: the chunk size with the least forward + (forward + backward) time per head width (64, 128), B*H = 8,
   and the T = 1 decode step against the step loop: the rows of ``fwp_kernels.chunk._CPU_AUTO`` (``_CPU_AUTO_AVX2``
   on an AVX2-only build; printed as code);
   where the bfloat16 factors run in AMX tiles, the same for bf16 inputs (its ``bfloat16_tile_chunk_sizes``).
6. ``products_by_length``: the delta rule's forward from T = 2 to 1,024 (D = 64 and 128), the C++ kernel's products
   forced to each kind: fp32 inputs through the BLAS and the micro-kernel, bf16 inputs with float32 and bfloat16
   factors (vdpbf16ps, and AMX tiles where the machine has them).

Times are medians over the rounds (best beside them in the file); every function runs once per round. The kernel rows
(2.) are timed warm, each call right after an untimed one of the same row: its inputs in the cache as after the layer
that wrote them, the same for every row. (Before 2026-11-28 each row found the cache as the row before it left it: the
fp32 ``*_Cauto`` rows ran warm after the C = 64 rows on the same inputs, the bf16 rows cold after fp32 ones, which
lowered the bf16 / fp32 forward ratio by 5-15%: 1.72x / 1.60x at 1 / 2 threads in that order, 1.64-1.86x warm in
the runs of 2026-11-28.)
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from typing import Optional
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import chunk_backward_flops, chunk_flops, hf_delta_rule, make_inputs, timings  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from fwp_kernels import chunk, delta_rule, dense, gated_delta_rule, linear_attention  # noqa: E402
from fwp_kernels.delta_rule_kernels import delta_rule_recurrent  # noqa: E402
from training.result_file import RunRecord  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "bench_cpu.json"
THREADS = (1, 2)
CHUNKS = (16, 32, 64)
MODEL_1B3 = {"hidden": 2048, "heads": 16, "head_dim": 128, "layers": 24, "params": 1.3e9}


def sizes(quick: bool) -> dict:
    """Problem sizes: the real ones, or tiny ones for --quick."""
    if quick:
        return {"matmul": 256, "bandwidth_mb": 16, "T": 256, "prefill_T": 128, "table_T": 128, "repeats": 2,
                "linear": (64, 128), "lengths": (2, 16)}
    return {"matmul": 2048, "bandwidth_mb": 512, "T": 4096, "prefill_T": 2048, "table_T": 2048, "repeats": 9,
            "linear": (5632, 2048), "lengths": (2, 4, 8, 16, 64, 256, 1024)}


def median_ms(summary: dict) -> float:
    return summary["median"] * 1e3


def peaks(size: dict) -> dict:
    """fp32 / bf16 matmul GFLOP/s and read bandwidth GB/s at the current thread count."""
    n = size["matmul"]
    a32, b32 = torch.randn(n, n), torch.randn(n, n)
    a16, b16 = a32.bfloat16(), b32.bfloat16()
    x = torch.ones(size["bandwidth_mb"] * 2**20 // 4)
    t = timings({"fp32": lambda: a32 @ b32, "bf16": lambda: a16 @ b16, "read": lambda: x.sum()}, size["repeats"])
    flop = 2 * n**3
    return {
        "matmul_fp32_gflops": flop / t["fp32"]["median"] / 1e9,
        "matmul_bf16_gflops": flop / t["bf16"]["median"] / 1e9,
        "read_gbs": x.numel() * 4 / t["read"]["median"] / 1e9,
        "timings": t,
    }


def fwd_bwd(fn, leaves):
    """fn's forward and backward as a training step runs them: the leaves' gradients set to None first (zero_grad's
    default: accumulated into ``.grad`` over the timed calls, every call added and allocated the gradients again, and
    the spread swamped the kernels: fp32 delta rule 28.8 vs 39.5 ms, interleaved, by hand), and the gradients of the
    outputs (o, final state) ones in each output's own dtype (a loss on ``o.float()`` converted o and its gradient:
    work of the bfloat16 runs only)."""
    ones = {}

    def run():
        for x in leaves:
            if x is not None:
                x.grad = None
        outputs = fn()
        grads = [ones.setdefault((t.shape, t.dtype), torch.ones_like(t)) for t in outputs]
        torch.autograd.backward(outputs, grads)

    return run


def kernel_functions(T: int, hf) -> dict:
    """The timed calls at B=1 H=8 T D=64: name -> (forward fn, forward + backward fn, (forward FLOPs, backward
    FLOPs) or None)."""
    fp32 = make_inputs(1, 8, T, 64, requires_grad=True)
    bf16 = make_inputs(1, 8, T, 64, dtype=torch.bfloat16, requires_grad=True)
    fns = {}
    for C in CHUNKS + ("auto",):
        mode = dict(mode="auto") if C == "auto" else dict(mode="chunk", chunk_size=C)
        flops_C = chunk.cpu_auto_choice().chunk_sizes[0][1] if C == "auto" else C
        for rule in ("delta", "sum"):
            def call(x=fp32, rule=rule, mode=mode):
                if rule == "delta":
                    return delta_rule(*x, output_final_state=True, **mode)
                return linear_attention(*x[:3], output_final_state=True, **mode)

            flops = (chunk_flops(rule, 1, 8, T, 64, 64, flops_C), chunk_backward_flops(rule, 1, 8, T, 64, 64, flops_C))
            fns[f"{rule}_C{C}"] = (call, fwd_bwd(call, fp32), flops)
    fp32_products = chunk.FLOAT32_DEFAULT_PRODUCTS if chunk.FLOAT32_DEFAULT_PRODUCTS in chunk.cpu_product_kinds() \
        else chunk.BLAS_PRODUCTS
    for rule in ("delta", "sum"):
        flops = fns[f"{rule}_Cauto"][2]
        # the same mode="auto" call with the products forced: fp32 inputs through the BLAS (the kernel before its own
        # products), bf16 inputs as shipped (bfloat16 factors where built) and with float32 products
        for name, x, kind in ((f"{rule}_auto_blas", fp32, chunk.BLAS_PRODUCTS), (f"{rule}_auto_bf16", bf16, None),
                              (f"{rule}_auto_bf16_in_fp32", bf16, fp32_products)):
            call = functools.partial(auto_call, rule, x, kind)
            fns[name] = (call, with_products(kind, fwd_bwd(call, x)), flops)
    if chunk.TILE_BFLOAT16_PRODUCTS in chunk.cpu_product_kinds():  # the tiles' alternative: vdpbf16ps
        for rule in ("delta", "sum"):
            call = functools.partial(auto_call, rule, bf16, chunk.BFLOAT16_PRODUCTS)
            fns[f"{rule}_auto_bf16_vdpbf16ps"] = (call, with_products(chunk.BFLOAT16_PRODUCTS, fwd_bwd(call, bf16)),
                                                  fns[f"{rule}_Cauto"][2])
    # the gated delta rule (mode="auto": its C++ kernel) with decays a = exp(g) spread over (0.5, 1)
    gates = fp32 + [F.logsigmoid(torch.randn(1, 8, T, generator=torch.Generator().manual_seed(1)) + 2)
                    .requires_grad_()]
    gates_bf16 = [x.detach().bfloat16().requires_grad_() for x in gates]
    for name, x, kind in (("gated_Cauto", gates, None), ("gated_auto_blas", gates, chunk.BLAS_PRODUCTS),
                          ("gated_auto_bf16", gates_bf16, None),
                          ("gated_auto_bf16_in_fp32", gates_bf16, fp32_products)):
        call = functools.partial(auto_call, "gated", x, kind)
        fns[name] = (call, with_products(kind, fwd_bwd(call, x)), None)
    if hf is not None:
        for name, x in (("delta_hf", fp32), ("gated_hf", gates)):
            hf_call = functools.partial(hf, *x)
            fns[name] = (hf_call, fwd_bwd(hf_call, x), None)
    return fns


def auto_call(rule: str, x: list, products: Optional[int]):
    """`rule` (delta / sum / gated) in mode="auto" on the inputs `x` (q, k, v, beta, and g for the gated rule), the C++
    kernel's products forced to `products` (a ``chunk.*_PRODUCTS`` kind; None: as shipped, ``chunk.cpu_products``)."""
    def call():
        if rule == "delta":
            return delta_rule(*x, output_final_state=True)
        if rule == "gated":
            return gated_delta_rule(*x, output_final_state=True)
        return linear_attention(*x[:3], output_final_state=True)

    return with_products(products, call)()


def with_products(products: Optional[int], fn):
    """fn with the C++ kernel's products forced to `products` while it runs (None: fn itself). A forward + backward
    is wrapped whole: the backward chooses its products again (``chunk._backward_cpu``), and before 2026-12-03 the
    forced rows' backward ran with the shipped products (``*_auto_blas``, ``*_auto_bf16_in_fp32`` and
    ``*_auto_bf16_vdpbf16ps`` forward + backward: the forward forced, the backward as ``*_Cauto`` / ``*_auto_bf16``)."""
    if products is None:
        return fn

    def forced():
        choose = chunk.cpu_products
        chunk.cpu_products = lambda *args, **kwargs: products
        try:
            return fn()
        finally:
            chunk.cpu_products = choose

    return forced


def kernels(size: dict, hf, peak: dict) -> dict:
    """Forward and forward + backward times, GFLOP/s, share of the matmul peak of the factors' dtype (bfloat16 factors
    against the bf16 peak, every other against the fp32 one; forward + backward, with the backward's products counted
    by ``chunk_backward_flops``, against the fp32 one), ratios to transformers', to the BLAS products, and of bfloat16
    to float32."""
    fns = kernel_functions(size["T"], hf)
    with torch.no_grad():
        fwd = timings({name: f[0] for name, f in fns.items()}, size["repeats"], warm=True)
    both = timings({name: f[1] for name, f in fns.items()}, size["repeats"], warm=True)
    out = {}
    for name, (_, _, flops) in fns.items():
        row = {"forward_ms": median_ms(fwd[name]), "fwd_bwd_ms": median_ms(both[name]),
               "forward_timings": fwd[name], "fwd_bwd_timings": both[name]}
        if flops is not None:
            row["forward_gflops"] = flops[0] / fwd[name]["median"] / 1e9
            row["forward_of_fp32_peak"] = row["forward_gflops"] / peak["matmul_fp32_gflops"]
            row["fwd_bwd_gflops"] = sum(flops) / both[name]["median"] / 1e9
            row["fwd_bwd_of_fp32_peak"] = row["fwd_bwd_gflops"] / peak["matmul_fp32_gflops"]
            if name.endswith(("_bf16", "_vdpbf16ps")) and chunk.native_bf16_available():
                row["forward_of_bf16_peak"] = row["forward_gflops"] / peak["matmul_bf16_gflops"]
        compared = {"_bf16": {"fp32": name.replace("_auto_bf16", "_Cauto"), "bf16_in_fp32": f"{name}_in_fp32"},
                    "_Cauto": {"blas": name.replace("_Cauto", "_auto_blas")}}
        for key, other in next((v for k, v in compared.items() if name.endswith(k)), {}).items():
            row[f"forward_vs_{key}"] = median_ms(fwd[other]) / row["forward_ms"]
            row[f"fwd_bwd_vs_{key}"] = median_ms(both[other]) / row["fwd_bwd_ms"]
        hf_name = name.split("_")[0] + "_hf"  # transformers' fallback for the same rule
        if hf_name in fns and name.startswith(("delta", "gated")):
            row["forward_vs_hf"] = median_ms(fwd[hf_name]) / row["forward_ms"]
            row["fwd_bwd_vs_hf"] = median_ms(both[hf_name]) / row["fwd_bwd_ms"]
        out[name] = row
    return out


def delta_net_1b3(size: dict, peak: dict) -> dict:
    """Prefill tokens/s and decode ms/token of the fast-weight kernel of the 1.3B Delta Net shape, with bounds."""
    H, D, layers, T = MODEL_1B3["heads"], MODEL_1B3["head_dim"], MODEL_1B3["layers"], size["prefill_T"]
    prefill = make_inputs(1, H, T, D)
    steps = [make_inputs(1, H, 1, D, seed=layer + 1) for layer in range(layers)]
    states = [0.1 * torch.randn(1, H, D, D) for _ in range(layers)]

    def decode_token():
        for layer in range(layers):
            states[layer] = delta_rule(*steps[layer], initial_state=states[layer], output_final_state=True)[1]

    prefill_bf16 = [x.bfloat16() for x in prefill]
    with torch.no_grad():
        t = timings({"prefill_layer": lambda: delta_rule(*prefill, output_final_state=True),
                     "prefill_layer_bf16": lambda: delta_rule(*prefill_bf16, output_final_state=True),
                     "decode_token": decode_token}, size["repeats"])
    C = chunk.auto_chunk_size(torch.device("cpu"), D, 64)
    flops = layers * chunk_flops("delta", 1, H, T, D, D, C)
    bf16_products = chunk.cpu_products(*prefill_bf16[:3], prefill_bf16[3:])
    C_bf16 = chunk.auto_chunk_size(torch.device("cpu"), D, 64, bf16_products)
    flops_bf16 = layers * chunk_flops("delta", 1, H, T, D, D, C_bf16)
    state_bytes = H * D * D * 4  # one layer's fp32 state
    decode_bound_s = layers * 2 * state_bytes / (peak["read_gbs"] * 1e9)  # read once, written once
    model_bound_s = (MODEL_1B3["params"] * 4 + layers * 2 * state_bytes) / (peak["read_gbs"] * 1e9)
    prefill_s = layers * t["prefill_layer"]["median"]
    bf16_factors = bf16_products in (chunk.BFLOAT16_PRODUCTS, chunk.TILE_BFLOAT16_PRODUCTS)
    bf16_peak = peak["matmul_bf16_gflops" if bf16_factors else "matmul_fp32_gflops"]
    return {
        "prefill_T": T, "chunk_size": C, "chunk_size_bf16": C_bf16,
        "prefill_tokens_per_s": T / prefill_s,
        "prefill_matmul_bound_tokens_per_s": T / (flops / (peak["matmul_fp32_gflops"] * 1e9)),
        "prefill_bf16_tokens_per_s": T / (layers * t["prefill_layer_bf16"]["median"]),
        "prefill_bf16_matmul_bound_tokens_per_s": T / (flops_bf16 / (bf16_peak * 1e9)),
        "decode_ms_per_token": median_ms(t["decode_token"]),
        "decode_bandwidth_bound_ms": decode_bound_s * 1e3,
        "whole_model_decode_bound_ms": model_bound_s * 1e3,
        "timings": t,
    }


def linear_rows(size: dict) -> dict:
    """GB/s of the weight reads of x W^T with one and two rows of x: the streaming kernel, F.linear, oneDNN, and
    x.sum() over the same weights (the read bound), per dtype."""
    if not dense._CPU_KERNEL.available():
        return {"skipped": dense._CPU_KERNEL.describe()}
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        weights = [torch.randn(*size["linear"]).to(dtype) for _ in range(8)]
        nbytes = sum(w.numel() * w.element_size() for w in weights)
        fns = {"sum": lambda: [w.sum() for w in weights]}
        for rows in (1, 2):
            x = torch.randn(rows, size["linear"][1]).to(dtype)
            y = torch.empty(rows, size["linear"][0], dtype=dtype)
            fns[f"streaming_{rows}"] = lambda x=x, y=y: [
                dense._CPU_KERNEL.ops.linear_rows(x, w, None, y) for w in weights]
            fns[f"f_linear_{rows}"] = lambda x=x: [F.linear(x, w) for w in weights]
            if dense.onednn_matmul_supports(dtype):
                fns[f"onednn_{rows}"] = lambda x=x: [
                    torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "") for w in weights]
        t = timings(fns, size["repeats"])
        out[str(dtype).split(".")[1]] = {name: nbytes / v["median"] / 1e9 for name, v in t.items()}
    return out


def products_by_length(size: dict) -> dict:
    """Forward ms of the delta rule (mode="auto", B*H = 8 for D = 64, 16 for D = 128) from T = 2 up, the C++ kernel's
    products forced: fp32 inputs with the BLAS's and the micro-kernel's, bf16 inputs with float32 and bfloat16 factors
    (vdpbf16ps, and AMX tiles; kinds this build or machine lacks are skipped)."""
    kinds = chunk.cpu_product_kinds()
    variants = {"fp32_blas": (torch.float32, chunk.BLAS_PRODUCTS),
                "fp32_vector": (torch.float32, chunk.FLOAT32_PRODUCTS),
                "bf16_fp32_factors": (torch.bfloat16, chunk.FLOAT32_PRODUCTS),
                "bf16_bf16_factors": (torch.bfloat16, chunk.BFLOAT16_PRODUCTS),
                "bf16_tile_factors": (torch.bfloat16, chunk.TILE_BFLOAT16_PRODUCTS)}
    out = {}
    for D, H in ((64, 8), (128, 16)):
        for T in size["lengths"]:
            x = {dtype: make_inputs(1, H, T, D, dtype=dtype) for dtype in (torch.float32, torch.bfloat16)}
            fns = {name: functools.partial(auto_call, "delta", x[dtype], kind)
                   for name, (dtype, kind) in variants.items() if kind in kinds}
            with torch.no_grad():
                t = timings(fns, 4 * size["repeats"])
            out[f"D{D}_T{T}"] = {name: median_ms(v) for name, v in t.items()}
    return out


def auto_table(size: dict) -> dict:
    """Per head width: forward and fwd + bwd ms per chunk size (delta rule, B*H = 8), the best size, for fp32 inputs
    and, where the kernel multiplies bfloat16 in AMX tiles, for bf16 inputs (``*_bf16``: the table's
    ``bfloat16_tile_chunk_sizes``); T = 1."""
    out = {}
    tiles = chunk.TILE_BFLOAT16_PRODUCTS in chunk.cpu_product_kinds()
    for D in (64, 128):
        out[f"D{D}"] = {}
        for dtype, suffix in ((torch.float32, ""), (torch.bfloat16, "_bf16")) if tiles else ((torch.float32, ""),):
            x = make_inputs(1, 8, size["table_T"], D, dtype=dtype, requires_grad=True)
            fns = {f"C{C}": (lambda C=C, x=x: delta_rule(*x, output_final_state=True, mode="chunk", chunk_size=C))
                   for C in CHUNKS}
            with torch.no_grad():
                fwd = timings(fns, size["repeats"])
            both = timings({n: fwd_bwd(f, x) for n, f in fns.items()}, max(2, size["repeats"] - 2))
            cost = {n: fwd[n]["median"] + both[n]["median"] for n in fns}
            out[f"D{D}"].update({f"forward_ms{suffix}": {n: median_ms(fwd[n]) for n in fns},
                                 f"fwd_bwd_ms{suffix}": {n: median_ms(both[n]) for n in fns},
                                 f"best_chunk_size{suffix}": int(min(cost, key=cost.get)[1:])})
        step = make_inputs(1, 8, 1, D)
        state = 0.1 * torch.randn(1, 8, D, D)
        with torch.no_grad():
            t1 = timings({"step_loop": lambda: delta_rule_recurrent(*step, state, True),
                          "decode_step": lambda: delta_rule(*step, initial_state=state, output_final_state=True)},
                         10 * size["repeats"])
        out[f"D{D}"]["T1_ms"] = {n: median_ms(t) for n, t in t1.items()}
    return out


def print_side_by_side(results: dict) -> None:
    """One table per section, a column per thread count."""
    runs = {th: results[f"threads_{th}"] for th in THREADS}
    head = "".join(f"{f'{th} thread(s)':>24}" for th in THREADS)
    print(f"\n{'peaks':<44}{head}")
    for key in ("matmul_fp32_gflops", "matmul_bf16_gflops", "read_gbs"):
        print(f"  {key:<42}" + "".join(f"{r['peaks'][key]:>24.1f}" for r in runs.values()))
    wide_head = "".join(f"{f'{th} thread(s)':>32}" for th in THREADS)
    print(f"\n{'kernels, B=1 H=8 D=64 (median ms)':<24}{wide_head}")
    for name in runs[THREADS[0]]["kernels"]:
        cells = []
        for r in runs.values():
            k = r["kernels"][name]
            of_peak = k.get("forward_of_bf16_peak", k.get("forward_of_fp32_peak"))
            share = f" {100 * of_peak:.0f}%" if of_peak is not None else ""
            vs = f" {k['forward_vs_hf']:.1f}x" if "forward_vs_hf" in k else ""
            both_share = f" {100 * k['fwd_bwd_of_fp32_peak']:.0f}%" if "fwd_bwd_of_fp32_peak" in k else ""
            cells.append(f"{k['forward_ms']:.2f}{share}{vs} | {k['fwd_bwd_ms']:.1f}{both_share}")
        print(f"  {name:<22}" + "".join(f"{c:>32}" for c in cells))
    print("  (forward ms, share of the matmul peak (bf16's for the native bf16 forward), x transformers' | forward +"
          " backward ms, share of the fp32 matmul peak)")
    one, two = runs[THREADS[0]]["kernels"], runs[THREADS[-1]]["kernels"]
    ratios = {"fp32": "the fp32 kernel", "bf16_in_fp32": "bf16 inputs with fp32 products", "blas": "BLAS products"}
    for name in (n for n in one if "forward_vs_blas" in one[n] or "forward_vs_fp32" in one[n]):
        print(f"  {name} faster than " + "; ".join(
            f"{ratios[key]}: forward " + ", ".join(f"{r['kernels'][name][f'forward_vs_{key}']:.2f}x" for r in
                                                   runs.values())
            + " / fwd+bwd " + ", ".join(f"{r['kernels'][name][f'fwd_bwd_vs_{key}']:.2f}x" for r in runs.values())
            for key in ratios if f"forward_vs_{key}" in one[name]) + " (1 / 2 threads)")
    print("  thread scaling, forward (1 / 2 threads): " + ", ".join(
        f"{n} {one[n]['forward_ms'] / two[n]['forward_ms']:.2f}x" for n in one))
    print(f"\n{'1.3B Delta Net shape, kernel only':<44}{head}")
    for key in ("prefill_tokens_per_s", "prefill_matmul_bound_tokens_per_s", "prefill_bf16_tokens_per_s",
                "prefill_bf16_matmul_bound_tokens_per_s", "decode_ms_per_token",
                "decode_bandwidth_bound_ms", "whole_model_decode_bound_ms"):
        print(f"  {key:<42}" + "".join(f"{r['delta_net_1b3'][key]:>24.3f}" for r in runs.values()))
    print(f"\n{'x W^T, 8 weights, GB/s of weight reads (median)':<44}{head}")
    for dtype, rates in runs[THREADS[0]]["linear_rows"].items():
        if not isinstance(rates, dict):  # {"skipped": why}
            print(f"  skipped: {rates}")
            continue
        for name in rates:
            print(f"  {dtype + ' ' + name:<42}"
                  + "".join(f"{r['linear_rows'][dtype][name]:>24.1f}" for r in runs.values()))
    print(f"\n{'delta rule fwd ms by length, products forced':<44}{head}")
    for shape, row in runs[THREADS[0]]["products_by_length"].items():
        for name in row:
            print(f"  {shape + ' ' + name:<42}"
                  + "".join(f"{r['products_by_length'][shape][name]:>24.3f}" for r in runs.values()))
    table = "_CPU_AUTO_AVX2" if chunk.avx2_only_build() else "_CPU_AUTO"
    print(f"\nmode='auto' table (fwp_kernels/chunk.py {table}), from this run:")
    for th, r in runs.items():
        widths = tuple((int(D[1:]), row["best_chunk_size"]) for D, row in r["auto_table"].items())
        tiles = tuple((int(D[1:]), row["best_chunk_size_bf16"]) for D, row in r["auto_table"].items()
                      if "best_chunk_size_bf16" in row)
        t1 = "; ".join(f"{D} step loop {row['T1_ms']['step_loop']:.3f}, decode_step {row['T1_ms']['decode_step']:.3f}"
                       for D, row in r["auto_table"].items())
        tile_rows = f", bfloat16_tile_chunk_sizes={tiles}" if tiles else ""
        print(f"    {th}: CpuAutoChoice(recurrent_max_t=0, chunk_sizes={widths}{tile_rows}),  # T = 1 ms: {t1}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks that the script runs")
    parser.add_argument("--out", default=str(RESULTS), help="default: benchmarks/results/bench_cpu.json")
    args = parser.parse_args()
    record = RunRecord.start("python benchmarks/bench_cpu.py")
    size = sizes(args.quick)
    hf = hf_delta_rule()
    results = {"quick": args.quick, "sizes": size, "chunk_kernel": chunk.cpu_kernel_status() if
               chunk.cpu_kernel_available() else f"PyTorch ({chunk.cpu_kernel_status()})",
               "forced_products": "forward and backward"}  # (with_products: files without it forced the forward only)
    threads_before = torch.get_num_threads()
    for th in THREADS:
        torch.set_num_threads(th)
        start = time.perf_counter()
        peak = peaks(size)
        results[f"threads_{th}"] = {"peaks": peak, "kernels": kernels(size, hf, peak),
                                    "delta_net_1b3": delta_net_1b3(size, peak), "linear_rows": linear_rows(size),
                                    "auto_table": auto_table(size), "products_by_length": products_by_length(size),
                                    "wall_s": time.perf_counter() - start, "load_average": os.getloadavg()}
    torch.set_num_threads(threads_before)
    print_side_by_side(results)
    path = record.write(args.out, results)
    print(f"\nwrote {path} (load average {os.getloadavg()[0]:.2f})")


if __name__ == "__main__":
    main()
