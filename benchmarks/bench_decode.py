"""The whole 1.3B Delta Net on CPU against this machine's bounds: decode ms/token and prefill tokens/s, at 1 and 2
threads.

Issue 18 items 4-5. The model is fla-hub/delta_net-1.3B-100B's shape with random weights (``bench_pretrained``'s
``build_model``: hidden 2048, 24 layers, 16 heads of 128, SwiGLU 5632, vocab 32000, untied), in float32 and bfloat16.
For each dtype and thread count, measured side by side in one process (round-robin, a step of each in turn):

- ``ours``: the model as shipped: its projections are ``modeling_fwp.fast_weight_layers.Linear``, whose inference
  forward streams the weights once for a decode step (``fwp_kernels.dense_linear``: csrc/decode_linear.cpp) and
  takes oneDNN's matmul for a prefill;
- ``f_linear``: the same model with ``nn.Linear``'s own forward (``F.linear``, what transformers' models run) for
  every projection, the ones that share one streaming pass in ``ours`` (a layer's q, k, v, beta; gate and up) too, and
  so the blocks' decode step unfused (``unfused_block`` below: its fused calls stream the weights themselves);
- ``block_loop``, decode steps only: the model as shipped but block by block, each block's checks and allocations
  between the weight reads of the block before and its own (``FastWeightModel._decode_in_one_pass`` off: the model
  before 2026-12-04), instead of all blocks' prepared first and their calls run one after the other;
- ``three_call_block``, decode steps only: the model as shipped but for the blocks' decode step, which makes three
  calls, ``fwp_kernels.norm_linears``, the fast-weight layer's token step and ``fwp_kernels.swiglu_block``, and the
  tensor calls between them, instead of one ``fwp_kernels.block_decode_step`` (the model of 2026-12-01 morning);
- ``unfused_block``, decode steps only: the model as shipped but for the blocks' decode step, which calls their norms,
  projections, feed-forward and residuals one by one around the fast-weight layer's token step (the model before
  2026-12-01);
- ``unfused_step``, decode steps only: neither fused step: the dozen small ops between a fast-weight layer's
  projections one by one too, instead of one ``fwp_kernels.fast_weight_token_step`` call (the model before
  2026-11-29);
- with ``--compile``, also ``compiled``: the model as shipped under ``torch.compile`` (inductor, compiled once per
  thread count, not timed), decode steps only: the same C++ kernels without Python between them;
- with ``--batch_size 2`` (a decode step of two sequences: two rows per projection), also ``one_row_streaming``: the
  model as shipped with ``fwp_kernels.dense.STREAMING_MAX_ROWS = 1`` (oneDNN's matmul from two rows, the setting
  before 2026-11-26), against the shipped 2 (the weight-streaming kernel for one and two rows).

Bounds, from peaks measured in the same process: decode ms/token against "bytes read per token / read bandwidth"
(every weight but the input embedding, of which one row, plus the recurrent state read and written once; the read
bandwidth of ``x.sum()`` over 512 MB, the median of five reads just before or the best of the reads between the timed
steps, whichever is faster: the VM's bandwidth drifts from minute to minute, and one run on 2026-11-28 that had only
the reads before decoded at 0.90x its "bound"; beside it, ``decode_of_round_bound``: the median over the rounds of
each step against the bound of the read just before its round, which follows the drift), and prefill tokens/s
against "matmul FLOPs / matmul peak" (2 FLOPs per weight per token plus the chunkwise delta rule's,
``bench_kernels.chunk_flops``; the peak of a 2048^3 matmul in the model's dtype).

    python benchmarks/bench_decode.py                 # about 10 minutes on an idle 2-core CPU, 8 GB of memory
    python benchmarks/bench_decode.py --quick         # a toy model, seconds: checks that it runs
    python benchmarks/bench_decode.py --batch_size 2 --prefill 128   # -> bench_decode_batch2.json, a few minutes
    python benchmarks/bench_decode.py --compile       # and the compiled decode (+4 compiles of about a minute)

Writes benchmarks/results/bench_decode.json (``--out``) with the command, versions and load average.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import os
import sys
import time
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cpu import MODEL_1B3  # noqa: E402
from bench_kernels import chunk_flops, timings  # noqa: E402
from bench_pretrained import build_model  # noqa: E402
from fwp_kernels import chunk, dense  # noqa: E402
from modeling_fwp import fast_weight_layers, modeling_fwp  # noqa: E402
from modeling_fwp.cache_fwp import CACHE_ARGUMENT, output_cache  # noqa: E402
from training.result_file import RunRecord, summarize  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "bench_decode.json"
VARIANTS = ("ours", "f_linear")
BATCH_VARIANTS = VARIANTS + ("one_row_streaming",)  # --batch_size > 1
DECODE_ONLY_VARIANTS = ("block_loop", "three_call_block", "unfused_block", "unfused_step")  # their prefill is ours
PREFILL_ONLY_VARIANTS = ("no_buffer_reuse",)  # its decode steps are ours (they never enter the scope)


def three_call_decode_step(self, hidden_states, state, layer, eps, norm_weights, weights):
    """``FastWeightBlock._decode_step`` in three calls, as before ``fwp_kernels.block_decode_step``: the first norm with
    the layer's projections, the layer's token step from them, then the rest of the block."""
    *projections, o_weight, gate_weight, up_weight, down_weight = weights
    x = hidden_states[:, 0]
    mixed, new_state = layer.token_step_from(dense.norm_linears(x, norm_weights[0], eps[0], projections), state or {})
    out = dense.swiglu_block(x, mixed, o_weight, norm_weights[1], eps[1], gate_weight, up_weight, down_weight)
    return out[:, None], new_state


# What each variant changes in the shipped model: (object, attribute, stand-in) for the time it runs.
VARIANT_PATCHES = {
    "ours": (),
    # its projections run nn.Linear's own forward (F.linear), those that share one streaming pass
    # (fast_weight_layers.project) one by one too
    "f_linear": ((fast_weight_layers.Linear, "forward", torch.nn.Linear.forward),
                 (fast_weight_layers, "dense_linears",
                  lambda x, weights: tuple(torch.nn.functional.linear(x, w) for w in weights)),
                 (modeling_fwp.FastWeightBlock, "_decode_plan", lambda *args: None)),  # (its ops stream the weights)
    "block_loop": ((modeling_fwp.FastWeightModel, "_decode_in_one_pass", lambda *args: None),),
    "three_call_block": ((modeling_fwp.FastWeightBlock, "_decode_step", three_call_decode_step),
                         (modeling_fwp.FastWeightModel, "_decode_in_one_pass", lambda *args: None)),
    "unfused_block": ((modeling_fwp.FastWeightBlock, "_decode_plan", lambda *args: None),),
    "unfused_step": ((fast_weight_layers, "token_step_applies", lambda *tensors: False),),  # (the block's too)
    "one_row_streaming": ((dense, "STREAMING_MAX_ROWS", 1),),
    "no_buffer_reuse": ((dense, "_REUSE_BUFFERS", False),),  # as FWP_KERNELS_NO_BUFFER_REUSE=1
}


@contextlib.contextmanager
def variant(name: str):
    """``ours``: the model as shipped; ``f_linear``: its projections run nn.Linear's own forward (F.linear);
    ``block_loop``: as shipped, block by block (no one-pass decode); ``three_call_block``: as shipped, the blocks'
    decode step in three calls; ``unfused_block``: as shipped, the
    blocks' decode step op by op around the layers' token step; ``unfused_step``:
    as shipped, neither decode step fused; ``one_row_streaming``: as shipped, the
    weight-streaming kernel for one row of input only; ``no_buffer_reuse``: as shipped, without
    ``reusing_cpu_buffers``. Each swaps what ``VARIANT_PATCHES`` names and puts it back."""
    with contextlib.ExitStack() as patches:
        for owner, attribute, stand_in in VARIANT_PATCHES[name]:
            patches.enter_context(mock.patch.object(owner, attribute, stand_in))
        yield


def machine_peaks(dtype: torch.dtype, quick: bool) -> dict:
    """Matmul GFLOP/s in `dtype` (2048^3, through ``dense_linear``: oneDNN's matmul, or for bfloat16 on a CPU without a
    bfloat16 matmul the widened float32 one, the fastest product the CPU offers in that dtype; torch's own bfloat16
    matmul ran at 0.32 GFLOP/s on the AVX2-only EPYC) and read bandwidth GB/s (x.sum() over 512 MB), current threads."""
    n, mb = (256, 16) if quick else (2048, 512)
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    x = torch.ones(mb * 2**20 // 4)
    with torch.no_grad():
        t = timings({"matmul": lambda: dense.dense_linear(a, b), "read": lambda: x.sum()}, 3 if quick else 5)
    return {"matmul_gflops": 2 * n**3 / t["matmul"]["median"] / 1e9,
            "read_gbs": x.numel() * 4 / t["read"]["median"] / 1e9, "read_probe_mb": mb}


def bytes_per_token(model, cache) -> int:
    """Bytes a decode step must read: every weight but the input embedding (one row of it), the state read and
    written."""
    embed = model.get_input_embeddings().weight
    weights = sum(p.numel() * p.element_size() for p in model.parameters()) - embed.numel() * embed.element_size()
    return weights + embed.shape[1] * embed.element_size() + 2 * cache.nbytes()


def prefill_flops(model, T: int) -> float:
    """2 FLOPs per weight per token (all but the input embedding) plus the chunkwise delta rule's, all layers."""
    config = model.config
    embed = model.get_input_embeddings().weight.numel()
    weights = sum(p.numel() for p in model.parameters()) - embed
    D = config.hidden_size // config.num_attention_heads
    C = chunk.auto_chunk_size(torch.device("cpu"), D, 64)
    return 2 * weights * T + config.num_hidden_layers * chunk_flops("delta", 1, config.num_attention_heads, T, D, D, C)


def warm_up(compiled, tokens: torch.Tensor, cache) -> float:
    """Seconds to compile: three decode steps of `compiled` (the first step, then the one with a symbolic token count)
    on a copy of `cache`."""
    cache = copy.deepcopy(cache)
    t0 = time.perf_counter()
    for _ in range(3):
        out = compiled(tokens, use_cache=True, **{CACHE_ARGUMENT: cache})
        cache, tokens = output_cache(out), out.logits[:, -1:].argmax(-1)
    return time.perf_counter() - t0


def round_robin(decoders: dict, tokens: dict, caches: dict, steps: int, probe: torch.Tensor) -> tuple:
    """``steps`` timed rounds after two of warm-up, each a read of `probe` then a decode step of every decoder in turn:
    (step ms by decoder, each step's last logits by decoder, the reads' seconds, warm-up included)."""
    step_times = {name: [] for name in decoders}
    step_logits = {name: [] for name in decoders}
    read_times = []
    for step in range(steps + 2):
        t0 = time.perf_counter()
        probe.sum()  # the read bandwidth beside the steps, where it was while they ran
        read_times.append(time.perf_counter() - t0)
        for name, (decoder, setting) in decoders.items():
            with variant(setting):
                t0 = time.perf_counter()
                out = decoder(tokens[name], use_cache=True, **{CACHE_ARGUMENT: caches[name]})
                elapsed = time.perf_counter() - t0
            caches[name], tokens[name] = output_cache(out), out.logits[:, -1:].argmax(-1)
            step_logits[name].append(out.logits[:, -1].float())
            if step >= 2:
                step_times[name].append(elapsed * 1e3)
    return step_times, step_logits, read_times


def decode_result(times: list, bound_ms: float, round_bounds_ms: list) -> dict:
    """A decoder's step ms (summarized), the median against the run's bound and the median over the rounds of each
    step against its round's own bound."""
    decode = summarize(times)
    return {"decode_ms_per_token": decode, "decode_of_bound": decode["median"] / bound_ms,
            "decode_of_round_bound": summarize([t / b for t, b in zip(times, round_bounds_ms)])["median"]}


def prefill_rates(model, variants: tuple, ids: torch.Tensor, prefill: int, quick: bool) -> dict:
    """Prefill seconds (``timings``) of `prefill` tokens of `ids` under each of `variants`."""
    fns = {}
    for name in variants:
        def run(name=name):
            with variant(name):
                model(ids[:, :prefill], use_cache=True)
        fns[name] = run
    return timings(fns, 1 if not quick else 2)


@torch.inference_mode()
def measure(model, prefill: int, context: int, steps: int, quick: bool, batch_size: int = 1,
            compiled=None) -> dict:
    """The variants at the current thread count, `batch_size` sequences: prefill tokens/s, decode ms/token (per step
    of the batch) after `context`, their bounds; with `compiled` (the model under ``torch.compile``) its decode too."""
    dtype = next(model.parameters()).dtype
    peak = machine_peaks(dtype, quick)
    variants = VARIANTS if batch_size == 1 else BATCH_VARIANTS
    decoders = {name: (model, name) for name in variants + DECODE_ONLY_VARIANTS}  # what decodes, under which variant
    if compiled is not None:
        decoders["compiled"] = (compiled, "ours")
    ids = torch.randint(3, model.config.vocab_size, (batch_size, max(prefill, context)),
                        generator=torch.Generator().manual_seed(0))
    prefill_t = prefill_rates(model, variants + PREFILL_ONLY_VARIANTS, ids, prefill, quick)
    caches, tokens, logits = {}, {}, {}
    for name, (_, setting) in decoders.items():
        with variant(setting):  # (the compiled model's context: the shipped model's prefill)
            out = model(ids[:, :context], use_cache=True)
        caches[name], tokens[name] = output_cache(out), out.logits[:, -1:].argmax(-1)
        logits[name] = out.logits[:, -1].float()
    if compiled is not None:
        compile_s = warm_up(compiled, tokens["compiled"], caches["compiled"])
    probe = torch.ones(peak["read_probe_mb"] * 2**20 // 4)
    step_times, step_logits, read_times = round_robin(decoders, tokens, caches, steps, probe)
    # the bound: the best read rate of the run (before the steps or between them): the machine's bandwidth drifts
    between = summarize(read_times[2:])  # seconds: "best" is the fastest read
    peak["read_gbs_between_steps"] = {k: probe.numel() * 4 / between[k] / 1e9 for k in ("best", "median")}
    peak["read_gbs"] = max(peak["read_gbs"], peak["read_gbs_between_steps"]["best"])
    nbytes = bytes_per_token(model, caches["ours"])
    bound_ms = nbytes / (peak["read_gbs"] * 1e9) * 1e3  # a step reads the weights once
    round_bounds_ms = [nbytes / (probe.numel() * 4 / t) * 1e3 for t in read_times[2:]]  # each round's own read
    bound_tokens_per_s = prefill / (prefill_flops(model, prefill) / (peak["matmul_gflops"] * 1e9))
    assert fast_weight_layers.Linear.forward is not torch.nn.Linear.forward, "the variants got mixed up"
    assert dense.STREAMING_MAX_ROWS >= batch_size or batch_size == 1, "the shipped setting streams this batch's rows"
    result = {"peaks": peak, "decode_bound_ms": bound_ms, "prefill_bound_tokens_per_s": bound_tokens_per_s,
              "prefill_logits_max_abs_difference": (logits["ours"] - logits["f_linear"]).abs().max().item()}
    for name in variants + PREFILL_ONLY_VARIANTS:
        rate = batch_size * prefill / prefill_t[name]["median"]
        result[name] = {"prefill_tokens_per_s": rate, "prefill_of_bound": rate / bound_tokens_per_s}
        if name in variants:
            result[name].update(decode_result(step_times[name], bound_ms, round_bounds_ms))
        else:
            result[f"prefill_speedup_vs_{name}"] = result["ours"]["prefill_tokens_per_s"] / rate
    result["decode_speedup"] = (result["f_linear"]["decode_ms_per_token"]["median"]
                                / result["ours"]["decode_ms_per_token"]["median"])
    result["prefill_speedup"] = result["ours"]["prefill_tokens_per_s"] / result["f_linear"]["prefill_tokens_per_s"]
    for name in [n for n in decoders if n not in variants]:  # decode only: against ours' steps
        pairs = list(zip(step_logits["ours"], step_logits[name]))
        result[name] = {**decode_result(step_times[name], bound_ms, round_bounds_ms),
                        "same_tokens_as_ours": all(torch.equal(a.argmax(-1), b.argmax(-1)) for a, b in pairs),
                        "logits_max_abs_difference": max((a - b).abs().max().item() for a, b in pairs)}
    for name in DECODE_ONLY_VARIANTS:
        result[f"decode_speedup_vs_{name}"] = (result[name]["decode_ms_per_token"]["median"]
                                               / result["ours"]["decode_ms_per_token"]["median"])
    if compiled is not None:
        result["compiled"]["compile_s"] = compile_s
    if "one_row_streaming" in variants:
        result["decode_speedup_vs_one_row_streaming"] = (result["one_row_streaming"]["decode_ms_per_token"]["median"]
                                                         / result["ours"]["decode_ms_per_token"]["median"])
    return result


def print_table(results: dict) -> None:
    for dtype, by_threads in results["models"].items():
        print(f"\n1.3B Delta Net, {dtype}")
        for th, r in by_threads.items():
            o, f = r["ours"], r["f_linear"]
            read = r["peaks"]["read_gbs_between_steps"]
            print(f"  {th} thread(s): read {r['peaks']['read_gbs']:.1f} GB/s (between the steps {read['median']:.1f} "
                  f"median, {read['best']:.1f} best), matmul {r['peaks']['matmul_gflops']:.0f} GFLOP/s")
            if "one_row_streaming" in r:
                print(f"    decode ms/step of {results['batch_size']} sequences: streaming up to "
                      f"{results['streaming_max_rows']} rows {o['decode_ms_per_token']['median']:.1f}, one row "
                      f"{r['one_row_streaming']['decode_ms_per_token']['median']:.1f}: "
                      f"{r['decode_speedup_vs_one_row_streaming']:.2f}x faster")
            print(f"    decode ms/token: ours {o['decode_ms_per_token']['median']:.1f} ({o['decode_of_bound']:.2f}x "
                  f"the bound {r['decode_bound_ms']:.1f}; {o['decode_of_round_bound']:.2f}x each round's), "
                  f"F.linear {f['decode_ms_per_token']['median']:.1f} ({f['decode_of_bound']:.2f}x); "
                  f"ours {r['decode_speedup']:.2f}x faster")
            for name, what in (("block_loop", "the blocks' steps block by block (no one-pass decode)"),
                               ("three_call_block", "the blocks' step in three calls"),
                               ("unfused_block", "the blocks' ops one by one"),
                               ("unfused_step", "the blocks' and the layers' small ops one by one")):
                u = r[name]
                print(f"    decode ms/token with {what}: {u['decode_ms_per_token']['median']:.1f} "
                      f"({u['decode_of_bound']:.2f}x the bound); ours {r[f'decode_speedup_vs_{name}']:.2f}x faster "
                      f"(same tokens: {u['same_tokens_as_ours']}, logits within {u['logits_max_abs_difference']:.2g})")
            if "compiled" in r:
                c = r["compiled"]
                print(f"    decode ms/token compiled: {c['decode_ms_per_token']['median']:.1f} "
                      f"({c['decode_of_bound']:.2f}x the bound; compiled in {c['compile_s']:.0f} s; same tokens as "
                      f"ours: {c['same_tokens_as_ours']}, logits within {c['logits_max_abs_difference']:.2g})")
            print(f"    prefill tokens/s: ours {o['prefill_tokens_per_s']:.0f} ({o['prefill_of_bound']:.2f} of the "
                  f"bound {r['prefill_bound_tokens_per_s']:.0f}), F.linear {f['prefill_tokens_per_s']:.0f} "
                  f"({f['prefill_of_bound']:.2f}); ours {r['prefill_speedup']:.2f}x faster")
            n = r["no_buffer_reuse"]
            print(f"    prefill tokens/s without reusing_cpu_buffers: {n['prefill_tokens_per_s']:.0f} "
                  f"({n['prefill_of_bound']:.2f} of the bound); ours {r['prefill_speedup_vs_no_buffer_reuse']:.2f}x "
                  f"faster")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a toy model: checks that the script runs")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--prefill", type=int, default=2048, help="prefill length (tokens)")
    parser.add_argument("--context", type=int, default=64, help="tokens before the timed decode steps")
    parser.add_argument("--steps", type=int, default=8, help="timed decode steps per variant")
    parser.add_argument("--batch_size", type=int, default=1, choices=[1, 2],
                        help="sequences decoded together (2: also the one-row streaming variant)")
    parser.add_argument("--compile", action="store_true", help="also the decode of the model under torch.compile")
    parser.add_argument("--out", default=None, help="default: results/bench_decode.json (batch 2: _batch2.json)")
    args = parser.parse_args()
    if args.quick:
        args.prefill, args.context, args.steps = 64, 16, 4
    default_out = RESULTS if args.batch_size == 1 else RESULTS.with_name(f"bench_decode_batch{args.batch_size}.json")
    args.out = args.out or str(default_out)
    record = RunRecord.start("python benchmarks/bench_decode.py")  # (with the arguments given)
    results = {"quick": args.quick, "prefill": args.prefill, "context": args.context, "steps": args.steps,
               "batch_size": args.batch_size, "streaming_max_rows": dense.STREAMING_MAX_ROWS,
               "shape": MODEL_1B3, "models": {}}
    threads_before = torch.get_num_threads()
    for dtype in args.dtypes:
        model = build_model("delta_net", getattr(torch, dtype), args.quick)
        results["models"][dtype] = {}
        for th in args.threads:
            torch.set_num_threads(th)
            compiled = None
            if args.compile:
                torch._dynamo.reset()  # inductor's kernels keep the thread count they were compiled with
                compiled = torch.compile(model)
            results["models"][dtype][th] = {**measure(model, args.prefill, args.context, args.steps, args.quick,
                                                      args.batch_size, compiled),
                                            "load_average": os.getloadavg()}
        del model
    torch.set_num_threads(threads_before)
    print_table(results)
    path = record.write(args.out if not args.quick or args.out != str(default_out) else
                        str(Path(os.environ.get("TMPDIR", "/tmp")) / "bench_decode_quick.json"), results)
    print(f"\nwrote {path} (load average {os.getloadavg()[0]:.2f})")


if __name__ == "__main__":
    main()
