"""GPU figures, measured side by side in one run on one CUDA device (run on a lent H100 by benchmarks/gpu_check.sh):

1. ``kernel_errors``: our Triton chunk kernels and flash-linear-attention 0.6's chunk kernels, each against the float64
   step loop on the same GPU (relative error of o and of the final state), at a 1.3B Delta Net layer's heads (D 128).
2. ``kernel_times``: forward and forward + backward of the delta, sum and gated delta rules at B 4, H 16, T 4096,
   D 128 (and each of ``--head_sizes``; fp32 and bf16): our Triton kernel, our PyTorch chunk kernel on CUDA (mode
   "chunk" on CUDA runs the first below head width 64, the second from it: the H100 runs' figures,
   ``chunk.CUDA_TORCH_CHUNK_MIN_WIDTH``),
   fla's chunk kernel, and the forward of our step loop. (transformers' ``torch_chunk_gated_delta_rule``, the CPU
   benchmarks' baseline, is left out: with fla installed it runs fla's kernels.)
3. ``auto_crossover``: our step loop vs mode "chunk" (forward, bf16, B 1, H 16, D 128) for T = 1 .. 256:
   where ``mode="auto"`` should switch on CUDA (``fwp_kernels.chunk._RECURRENT_MAX_T``).
4. ``model_1p3b``: fla-hub/delta_net-1.3B-100B's configuration with random weights in bf16 (no Hub access), as fla's
   model and converted to ours (without fla, ``--no_fla``: ours alone, from ``config_from_fla``): bf16 logits of each
   against ours in float32 and against each other, prefill tokens/s at 2,048 tokens, a training step's tokens/s, and
   greedy decoding ms/token at 128 and 4,096 tokens of context, beside a Llama of the same width, depth and vocabulary
   with its KV cache (sdpa).

Times: the wall clock around each synchronised call, after warm-up calls (Triton compiles and fla autotunes there);
the median of --rounds calls, the best beside it. Each section is written to the result file as soon as it ends, so a
section that fails (its error is recorded) or a run cut short keeps what came before.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Callable, Dict, List

if "--smoke" in sys.argv:  # our Triton kernels on the CPU: set before torch imports triton
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from training.result_file import RunRecord, summarize  # noqa: E402

RULES = ("delta", "sum", "gated")
# fla-hub/delta_net-1.3B-100B (shared/HF5_NOTES.md), as fla's config takes it
FLA_1P3B = dict(hidden_size=2048, num_hidden_layers=24, num_heads=16, expand_k=1, expand_v=1, use_short_conv=True,
                conv_size=4, qk_activation="silu", qk_norm="l2", use_beta=True, use_gate=False, use_output_norm=True,
                hidden_ratio=4, norm_eps=1e-6, tie_word_embeddings=False, vocab_size=32000, bos_token_id=1,
                eos_token_id=2, pad_token_id=2)


# The shapes of each section; --smoke shrinks them for a run of the script's code on a CPU (flash-linear-attention
# under TRITON_INTERPRET=1 there: see tests/fixtures/fla_0_6/make_fixtures.py).
SHAPES = {"kernel": dict(B=4, H=16, T=4096, D=128), "errors_T": 2048, "crossover_T": (1, 2, 4, 8, 16, 32, 64, 128, 256),
          "model": FLA_1P3B, "llama": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=24,
                                           num_attention_heads=16), "tokens": 2048, "contexts": (128, 4096),
          "matmul": 8192, "copy_bytes": 2 * 1024**3}
SMOKE = {"kernel": dict(B=1, H=2, T=40, D=16), "errors_T": 40, "crossover_T": (1, 8),
         "model": {**FLA_1P3B, "hidden_size": 64, "num_hidden_layers": 2, "num_heads": 2, "vocab_size": 256,
                   "attn_mode": "fused_recurrent", "fuse_norm": False, "fuse_swiglu": False,
                   "fuse_cross_entropy": False},
         "llama": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2),
         "tokens": 32, "contexts": (8, 64), "matmul": 256, "copy_bytes": 1024**2}
DEVICE = torch.device("cuda")


def synchronize() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


COMPILE_ONLY = False  # --compile_only: each timed function is called once (Triton compiles), nothing is timed


def timed(fn: Callable[[], object], rounds: int, warmup: int = 2) -> Dict[str, object]:
    """``summarize`` of `rounds` calls of `fn` in seconds, each timed alone after `warmup` calls (wall clock around
    a synchronised call: on CUDA the launches' host time counts, as it does for a user)."""
    if COMPILE_ONLY:
        fn()
        synchronize()
        return {"median": float("nan"), "best": float("nan")}
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(rounds):
        synchronize()
        start = time.perf_counter()
        fn()
        synchronize()
        times.append(time.perf_counter() - start)
    return summarize(times)


def rule_inputs(rule: str, B: int, H: int, T: int, D: int, dtype: torch.dtype, grad: bool = False) -> Dict:
    """Model-like inputs on the device: l2-normalised q, k (delta rules), softmax-normalised (sum rule), sigmoid
    beta, decays exp(g) around 0.88 (gated)."""
    g = torch.Generator(device=DEVICE).manual_seed(T)
    randn = lambda *shape: torch.randn(*shape, generator=g, device=DEVICE)  # noqa: E731
    norm = (lambda x: F.normalize(x, dim=-1)) if rule != "sum" else (lambda x: F.softmax(x, dim=-1))
    x = {"q": norm(randn(B, H, T, D)), "k": norm(randn(B, H, T, D)), "v": randn(B, H, T, D)}
    if rule != "sum":
        x["beta"] = torch.sigmoid(randn(B, H, T))
    if rule == "gated":
        x["g"] = F.logsigmoid(randn(B, H, T) + 2)
    return {n: t.to(dtype).requires_grad_(grad) for n, t in x.items()}


def contenders(rule: str, with_fla: bool) -> Dict[str, Callable]:
    """name -> ``(q, k, v, *gates) -> (o, final)`` for the timings of section 2."""
    from test_kernels import RULE_FUNCTIONS, cuda_chunk_kernels

    chunk = cuda_chunk_kernels(rule)  # mode "chunk" on CUDA: Triton below head width 64, PyTorch from it
    out = {
        "ours_triton": lambda *a: chunk.triton_kernel(*a, None, True),
        "ours_torch_chunk": lambda *a: chunk.torch_kernel(*a, None, True),
        "step_loop": lambda *a: RULE_FUNCTIONS[rule](*a, output_final_state=True, mode="recurrent"),
    }
    if with_fla:
        from test_cuda import fla_kernels

        out["fla_chunk"] = fla_kernels()[rule]
    return out


def kernel_errors(args) -> Dict:
    """Section 1: {rule-dtype: relative errors of ours and fla's} at T errors_T, head size D."""
    from test_cuda import fla_and_our_errors

    T, D = SHAPES["errors_T"], SHAPES["kernel"]["D"]
    return {f"{rule}-{dtype}": fla_and_our_errors(rule, T, D, D, getattr(torch, dtype))
            for rule in RULES for dtype in ("float32", "bfloat16")}


def contender_times(rule: str, shape: Dict[str, int], dtype: str, args) -> Dict:
    """{contender_fwd_s / _fwd_bwd_s: timings, or contender_error} of every contender at `shape` (B, H, T, D)."""
    x = rule_inputs(rule, **shape, dtype=getattr(torch, dtype), grad=True)
    args_ = list(x.values())
    go = torch.randn_like(x["v"])
    row = {}
    for name, fn in contenders(rule, args.fla).items():
        try:
            with torch.no_grad():
                row[f"{name}_fwd_s"] = timed(lambda: fn(*args_), 3 if name == "step_loop" else args.rounds)
            if name != "step_loop":
                row[f"{name}_fwd_bwd_s"] = timed(lambda: torch.autograd.grad(
                    (fn(*args_)[0] * go).sum(), args_), args.rounds)
        except Exception as error:  # one contender failing (memory, a missing kernel) keeps the others
            row[f"{name}_error"] = repr(error)[:400]
    return row


def kernel_times(args) -> Dict:
    """Section 2: {rule-dtype (-D<head size> for sizes other than the kernel shape's): {contender_fwd_s /
    _fwd_bwd_s: timings}} at the kernel shape, for each of --head_sizes."""
    out = {"shape": SHAPES["kernel"]}
    for D in args.head_sizes or [SHAPES["kernel"]["D"]]:
        for rule in args.rules:
            for dtype in args.dtypes:
                key = f"{rule}-{dtype}" + ("" if D == SHAPES["kernel"]["D"] else f"-D{D}")
                out[key] = contender_times(rule, {**SHAPES["kernel"], "D": D}, dtype, args)
                print(key, {k: round(v["median"] * 1e3, 3) for k, v in out[key].items() if k.endswith("_s")},
                      flush=True)
    return out


def auto_crossover(args) -> Dict:
    """Section 3: {T: {mode: timing}} of our delta rule's step loop and chunk kernel."""
    from test_kernels import RULE_FUNCTIONS

    out = {}
    shape = SHAPES["kernel"]
    for T in SHAPES["crossover_T"]:
        x = list(rule_inputs("delta", 1, shape["H"], T, shape["D"], torch.bfloat16).values())
        with torch.no_grad():
            out[T] = {mode: timed(lambda: RULE_FUNCTIONS["delta"](*x, mode=mode), args.rounds)
                      for mode in ("recurrent", "chunk")}
    print("crossover (ms)", {T: {m: round(v["median"] * 1e3, 3) for m, v in r.items()} for T, r in out.items()})
    return out


def peaks(args) -> Dict:
    """The device's bf16 matmul rate (8192^3) and its device-to-device copy bandwidth (bytes read + written): the
    bounds the model figures are read against."""
    n = SHAPES["matmul"]
    a = torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16)
    matmul = timed(lambda: a @ a, args.rounds)
    x = torch.empty(SHAPES["copy_bytes"], dtype=torch.uint8, device=DEVICE)
    y = torch.empty_like(x)
    copy = timed(lambda: y.copy_(x), args.rounds)
    return {"bf16_matmul_tflops": 2 * n**3 / matmul["median"] / 1e12,
            "copy_bandwidth_gb_s": 2 * x.numel() / copy["median"] / 1e9}


def build_1p3b(folder: Path, with_fla: bool) -> Dict[str, torch.nn.Module]:
    """{"ours", "fla", "llama"}: fla's 1.3B Delta Net with random weights (bf16, on the device) and ours converted from
    its saved checkpoint; without fla (`with_fla` False) ours alone, from ``config_from_fla`` of the same
    configuration, random weights; and a Llama of the same width, depth, MLP and vocabulary (bf16, sdpa, KV cache)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from modeling_fwp import convert_fla_checkpoint
    from modeling_fwp.convert_fla import config_from_fla

    torch.manual_seed(0)
    config = SHAPES["model"]
    models = {}
    with DEVICE:
        if with_fla:
            from fla.models import DeltaNetConfig as FlaDeltaNetConfig

            models["fla"] = AutoModelForCausalLM.from_config(FlaDeltaNetConfig(**config), dtype=torch.bfloat16).eval()
        else:
            models["ours"] = AutoModelForCausalLM.from_config(
                config_from_fla({**config, "model_type": "delta_net"}), dtype=torch.bfloat16).eval()
        models["llama"] = AutoModelForCausalLM.from_config(LlamaConfig(
            **SHAPES["llama"], vocab_size=config["vocab_size"], max_position_embeddings=8192, tie_word_embeddings=False,
        ), dtype=torch.bfloat16).eval()
    if with_fla:
        models["fla"].save_pretrained(folder / "fla")
        convert_fla_checkpoint(folder / "fla", folder / "ours")
        models["ours"] = AutoModelForCausalLM.from_pretrained(folder / "ours", dtype=torch.bfloat16).to(DEVICE).eval()
    return models


def logits_agreement(models: Dict[str, torch.nn.Module], ids: torch.Tensor) -> Dict:
    """Ours and fla's bf16 logits (where fla is there) over `ids`: against each other, and each against ours in
    float32 (fla 0.6 refuses its delta rule in float32; ours in float32 equals fla's float32 reference on the CPU,
    tests/test_fla_*), which tells which of the two bf16 runs is off where they disagree. The bf16 weights convert to
    float32 and back exactly."""
    def compare(x, reference):
        return {"relative_error": ((x - reference).norm() / reference.norm()).item(),
                "top1_agreement": (x.argmax(-1) == reference.argmax(-1)).float().mean().item()}

    ours = models["ours"]
    with torch.no_grad():
        bf16 = {f"{name}_bf16": models[name](ids).logits.float() for name in ("ours", "fla") if name in models}
        exact = ours.float()(ids).logits.float()
        ours.to(torch.bfloat16)
    out = {"against_ours_float32": {name: compare(x, exact) for name, x in bf16.items()}}
    if "fla_bf16" in bf16:
        out["ours_against_fla_bf16"] = compare(bf16["ours_bf16"], bf16["fla_bf16"])
    return out


def decode_ms_per_token(model, prompt: torch.Tensor, rounds: int, steps: int = 32) -> Dict:
    """Greedy ``generate``: (time for 1 + `steps` new tokens - time for 1) / `steps`, in ms (prefill excluded)."""
    def run(n):
        return lambda: model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False)

    long, short = timed(run(1 + steps), rounds, warmup=1), timed(run(1), rounds, warmup=1)
    return {"median": (long["median"] - short["median"]) / steps * 1e3,
            "best": (long["best"] - short["best"]) / steps * 1e3}


def model_1p3b(args) -> Dict:
    """Section 4: the 1.3B Delta Net's agreement with fla and its times beside fla's and a Llama's."""
    with tempfile.TemporaryDirectory() as tmp:
        models = build_1p3b(Path(tmp), args.fla)
    ours = models["ours"]
    out = {"parameters": {n: sum(p.numel() for p in m.parameters()) for n, m in models.items()}}
    T = SHAPES["tokens"]
    ids = torch.randint(3, ours.config.vocab_size, (2, T), device=DEVICE,
                        generator=torch.Generator(device=DEVICE).manual_seed(0))
    out["logits_half"] = logits_agreement(models, ids[:1, : T // 2])
    print("1.3B logits (first half of the tokens)", out["logits_half"], flush=True)
    with torch.no_grad():
        out["prefill_s"] = {n: timed(lambda: m(ids[:1], use_cache=False), args.rounds) for n, m in models.items()}
    print("1.3B prefill (ms)", {n: round(v["median"] * 1e3, 1) for n, v in out["prefill_s"].items()}, flush=True)
    out["train_step_2xT_s"] = {}
    for name, model in models.items():  # forward + backward of the loss, no optimizer step
        def step():
            model.zero_grad(set_to_none=True)
            model(ids, labels=ids).loss.backward()
        out["train_step_2xT_s"][name] = timed(step, 3, warmup=1)
        model.zero_grad(set_to_none=True)
    print("1.3B train step (ms)", {n: round(v["median"] * 1e3, 1) for n, v in out["train_step_2xT_s"].items()},
          flush=True)
    out["decode_ms_per_token"] = {
        n: {str(c): decode_ms_per_token(m, ids[:1].repeat(1, -(-c // T))[:, :c], 3) for c in SHAPES["contexts"]}
        for n, m in models.items()
    }
    print("1.3B decode (ms/token)", out["decode_ms_per_token"], flush=True)
    out["weight_bytes"] = {n: sum(p.numel() * p.element_size() for p in m.parameters()) for n, m in models.items()}
    return out


SECTIONS = {"peaks": peaks, "auto_crossover": auto_crossover, "kernel_times": kernel_times, "model_1p3b": model_1p3b,
            "kernel_errors": kernel_errors}


def main(argv: List[str] = None) -> int:
    """Runs the sections asked for, writing the result file after each; 0 (a failed section is recorded)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sections", nargs="*", default=list(SECTIONS), choices=list(SECTIONS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float32"],
                        help="the input dtypes of kernel_times")
    parser.add_argument("--rules", nargs="+", default=list(RULES), choices=RULES, help="the rules of kernel_times")
    parser.add_argument("--head_sizes", nargs="+", type=int, default=None,
                        help="the head sizes of kernel_times (default: the kernel shape's, 128)")
    parser.add_argument("--no_fla", dest="fla", action="store_false", help="leave flash-linear-attention out")
    parser.add_argument("--fla_configs", choices=["tuned", "first"], default="tuned",
                        help="fla's Triton autotuning: 'tuned' runs it (it compiles and times every config of every "
                        "kernel per shape: minutes per kernel on a GPU); 'first' keeps each kernel's first config")
    parser.add_argument("--compile_only", action="store_true",
                        help="call each timed function once and time nothing: fills Triton's caches (compiled "
                        "kernels on disk) for a later run, such as one started beside the GPU tests")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "bench_gpu.json"))
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes on the CPU: runs the script's code without a GPU (nothing to quote)")
    args = parser.parse_args(argv)
    global SHAPES, DEVICE, COMPILE_ONLY
    COMPILE_ONLY = args.compile_only
    if args.smoke:
        import test_cuda

        SHAPES, DEVICE = SMOKE, torch.device("cpu")
        test_cuda.CUDA = DEVICE
    elif not torch.cuda.is_available():
        raise SystemExit("bench_gpu needs a CUDA device (--smoke runs its code on the CPU)")
    if args.fla:
        import fla  # noqa: F401  (fails here, not in a section, when it is missing)
    if args.fla and args.fla_configs == "first":
        from triton.runtime.autotuner import Autotuner

        Autotuner.prune_configs = lambda self, kwargs, *rest: self.configs[:1]
    record = RunRecord.start("python benchmarks/bench_gpu.py", argv)
    results = {"device": torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu (--smoke)",
               "versions": versions(), "shapes": SHAPES, "sections": {},
               "fla_configs": args.fla_configs if args.fla else None, "compile_only": args.compile_only,
               # the commit of the working tree, where it was copied to the GPU machine without its .git
               "source_commit": os.environ.get("FWP_SOURCE_COMMIT")}
    for name in args.sections:
        started = time.perf_counter()
        try:
            results["sections"][name] = SECTIONS[name](args)
        except Exception:
            results["sections"][name] = {"error": traceback.format_exc()[-3000:]}
            print(results["sections"][name]["error"], flush=True)
        results["sections"][name]["section_wall_s"] = round(time.perf_counter() - started, 1)
        record.write(args.out, results)
        print(f"{name}: {results['sections'][name]['section_wall_s']} s; wrote {args.out}", flush=True)
    return 0


def versions() -> Dict[str, str]:
    """The versions of the packages the figures depend on (None where one is missing)."""
    import importlib.metadata as metadata

    found = {}
    for package in ("torch", "triton", "transformers", "fla-core", "flash-linear-attention"):
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = None
    return found


if __name__ == "__main__":
    sys.exit(main())
