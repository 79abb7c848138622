"""Pretrained-size Delta Nets on CPU: random-weight models of fla's 1.3B shapes, float32 and bfloat16.

Issue 20 item 5. Models (random weights, built from the configs the converter writes for fla's checkpoints):

- ``delta_net``: fla-hub/delta_net-1.3B-100B's config (hidden 2048, 24 layers, 16 heads of 128, short conv 4, SiLU,
  L2 norm, RMSNorm blocks, SwiGLU 5632, vocab 32000, untied) through ``modeling_fwp.convert_fla.config_from_fla``;
- ``llama``: transformers' ``LlamaForCausalLM`` of the same width and depth (fla's Transformer++ 1.3B shape: 32 heads
  of 64, SwiGLU 5632) with its KV cache;
- ``gated_deltanet``: fla's GatedDeltaNet defaults at hidden 2048 (21 layers, 6 heads of 256, expand_v 2);
- ``gdr_ours`` / ``gdr_qwen3_next``: the gated delta rule alone at one Gated DeltaNet layer's shapes (6 heads,
  d_k 256, d_v 512): ``fwp_kernels.gated_delta_rule`` against transformers' own torch path
  (``torch_chunk_gated_delta_rule`` for the prefill, ``torch_recurrent_gated_delta_rule`` for a decode step, from
  its Qwen3-Next code), times the 21 layers.

Per model and dtype: prefill tokens/s at ``--prefill`` tokens (2,048), decode ms/token (median of ``--steps``) after
``--contexts`` tokens (128 and 4,096), the cache bytes there, and the peak resident memory of the process (each
model and dtype runs in a fresh worker process, so ``ru_maxrss`` is its own).

    python benchmarks/bench_pretrained.py [--dtypes float32 bfloat16] [--threads 2] [--out PATH]
    python benchmarks/bench_pretrained.py --quick     # tiny shapes, seconds: checks that everything runs

Writes benchmarks/results/bench_pretrained.json (``--quick``: bench_pretrained_quick.json in the temporary folder), with
the command, versions and load average (``"run"``).
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODELS = ("delta_net", "llama", "gated_deltanet", "gdr_ours", "gdr_qwen3_next")
DELTA_NET_1_3B = dict(model_type="delta_net", hidden_size=2048, num_hidden_layers=24, num_heads=16, expand_k=1.0,
                      expand_v=1.0, use_short_conv=True, conv_size=4, qk_activation="silu", qk_norm="l2",
                      use_beta=True, use_gate=False, hidden_ratio=4, intermediate_size=None, norm_eps=1e-6,
                      tie_word_embeddings=False, vocab_size=32000, bos_token_id=1, eos_token_id=2, pad_token_id=2)
GATED_DELTANET_1_3B = dict(model_type="gated_deltanet", hidden_size=2048, num_hidden_layers=21, num_heads=6,
                           head_dim=256, expand_v=2.0, use_short_conv=True, conv_size=4, use_gate=True,
                           hidden_ratio=4, intermediate_size=None, norm_eps=1e-6, tie_word_embeddings=False,
                           vocab_size=32000, bos_token_id=1, eos_token_id=2, pad_token_id=2)
# --quick: the same structure at toy size
QUICK = dict(hidden_size=64, num_hidden_layers=2, vocab_size=256)
QUICK_HEADS = {"delta_net": dict(num_heads=4), "gated_deltanet": dict(num_heads=2, head_dim=16)}


def fla_config(name: str, quick: bool) -> dict:
    base = DELTA_NET_1_3B if name == "delta_net" else GATED_DELTANET_1_3B
    return {**base, **QUICK, **QUICK_HEADS[name]} if quick else dict(base)


def build_model(name: str, dtype: torch.dtype, quick: bool):
    """A random-weight causal LM (``delta_net``, ``gated_deltanet``, ``llama``) in `dtype`."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from modeling_fwp.convert_fla import config_from_fla, fla_intermediate_size

    torch.manual_seed(0)
    if name == "llama":
        fla = fla_config("delta_net", quick)
        heads = 4 if quick else 32  # fla's Transformer++ 1.3B: 32 heads of 64
        config = LlamaConfig(vocab_size=fla["vocab_size"], hidden_size=fla["hidden_size"],
                             num_hidden_layers=fla["num_hidden_layers"], num_attention_heads=heads,
                             num_key_value_heads=heads, intermediate_size=fla_intermediate_size(fla),
                             rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=8192)
    else:
        config = config_from_fla(fla_config(name, quick))
    return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def cache_nbytes(cache) -> int:
    from modeling_fwp import FastWeightCache

    if isinstance(cache, FastWeightCache):
        return cache.nbytes()
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)
               if t is not None)


@torch.inference_mode()
def measure_model(model, prefill: int, contexts: list, steps: int) -> dict:
    from modeling_fwp.cache_fwp import CACHE_ARGUMENT, output_cache
    from training.result_file import summarize

    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (1, max(prefill, *contexts)), generator=torch.Generator().manual_seed(0))
    rates = []
    for _ in range(2):
        t0 = time.perf_counter()
        model(ids[:, :prefill], use_cache=True)
        rates.append(prefill / (time.perf_counter() - t0))
    result = {"prefill_tokens_per_s": summarize(rates, best="max")}
    for context in contexts:
        cache = None
        for start in range(0, context, 2048):  # chunks bound Llama's attention memory
            out = model(ids[:, start:min(context, start + 2048)], use_cache=True, **{CACHE_ARGUMENT: cache})
            cache = output_cache(out)
        token, times = out.logits[:, -1:].argmax(-1), []
        for _ in range(steps + 2):
            t0 = time.perf_counter()
            out = model(token, use_cache=True, **{CACHE_ARGUMENT: cache})
            times.append(time.perf_counter() - t0)
            cache, token = output_cache(out), out.logits[:, -1:].argmax(-1)
        decode = summarize([t * 1e3 for t in times[2:]])
        result[f"decode_ms_per_token_at_{context}"] = decode
        result[f"cache_bytes_at_{context}"] = cache_nbytes(cache)
    return result


@torch.inference_mode()
def measure_recurrence(name: str, dtype: torch.dtype, prefill: int, steps: int, quick: bool) -> dict:
    """The gated delta rule alone at a Gated DeltaNet layer's shapes, for all its layers: ours or Qwen3-Next's."""
    from transformers.models.qwen3_next.modeling_qwen3_next import (
        torch_chunk_gated_delta_rule,
        torch_recurrent_gated_delta_rule,
    )

    from fwp_kernels import gated_delta_rule
    from training.result_file import summarize

    fla = fla_config("gated_deltanet", quick)
    H, Dk, layers = fla["num_heads"], fla["head_dim"], fla["num_hidden_layers"]
    Dv = int(Dk * fla["expand_v"])
    g = torch.Generator().manual_seed(0)

    def inputs(T):
        q, k = (torch.nn.functional.normalize(torch.randn(1, H, T, Dk, generator=g), dim=-1) for _ in range(2))
        v = torch.randn(1, H, T, Dv, generator=g)
        beta, decay = torch.rand(1, H, T, generator=g), -torch.rand(1, H, T, generator=g) * 0.1
        return [t.to(dtype) for t in (q, k, v)] + [beta.to(dtype), decay.float()]

    def run(x, state):
        q, k, v, beta, decay = x
        T = q.shape[2]
        if name == "gdr_ours":
            return gated_delta_rule(q, k, v, beta, decay, initial_state=state, output_final_state=True)
        fn = torch_chunk_gated_delta_rule if T > 1 else torch_recurrent_gated_delta_rule
        o, s = fn(*(t.transpose(1, 2) for t in (q, k, v, decay, beta)), initial_state=state, output_final_state=True)
        return o.transpose(1, 2), s  # Qwen3-Next's state [B, H, Dk, Dv]; ours [B, H, Dv, Dk]: only timed here

    # the inputs made before each timer starts (their random draws had been timed with the rule until session 53: about
    # 60% of our prefill call and 20% of Qwen3-Next's, float32, in bench_pretrained_zen5.json before and after)
    rates = []
    for _ in range(2):
        x = inputs(prefill)
        t0 = time.perf_counter()
        _, state = run(x, None)
        rates.append(prefill / ((time.perf_counter() - t0) * layers))
    times = []
    for _ in range(steps + 2):
        x = inputs(1)
        t0 = time.perf_counter()
        _, state = run(x, state)
        times.append((time.perf_counter() - t0) * layers * 1e3)
    return {"prefill_tokens_per_s": summarize(rates, best="max"), "decode_ms_per_token": summarize(times[2:]),
            "layers": layers, "shape": {"heads": H, "d_k": Dk, "d_v": Dv}}


def worker(args) -> None:
    """One model in one dtype, in this process: prints its JSON line."""
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    if args.worker.startswith("gdr_"):
        result = measure_recurrence(args.worker, dtype, args.prefill, args.steps, args.quick)
    else:
        model = build_model(args.worker, dtype, args.quick)
        result = {"parameters": sum(p.numel() for p in model.parameters()),
                  **measure_model(model, args.prefill, args.contexts, args.steps)}
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("RESULT " + json.dumps(result))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny shapes and contexts: checks that everything runs")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--prefill", type=int, default=2048, help="prefill length (tokens)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 4096], help="decode after these contexts")
    parser.add_argument("--steps", type=int, default=16, help="timed decode steps per context")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", default=None)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.prefill, args.contexts, args.steps = 16, [8, 24], 2
    if args.worker:
        return worker(args)
    from training.result_file import RunRecord

    record = RunRecord.start("python benchmarks/bench_pretrained.py", argv)
    results = {"prefill": args.prefill, "contexts": args.contexts, "steps": args.steps, "threads": args.threads,
               "quick": args.quick, "models": {}}
    for name in args.models:
        for dtype in args.dtypes:
            command = [sys.executable, __file__, "--worker", name, "--dtype", dtype, "--threads", str(args.threads),
                       "--prefill", str(args.prefill), "--steps", str(args.steps), "--contexts",
                       *map(str, args.contexts)] + (["--quick"] if args.quick else [])
            done = subprocess.run(command, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
            line = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
            if done.returncode or not line:
                raise RuntimeError(f"{name} {dtype} failed:\n{done.stderr[-3000:]}")
            result = json.loads(line[-1][len("RESULT "):])
            results["models"][f"{name}/{dtype}"] = result
            decode = "  ".join(f"{k.rsplit('_', 1)[-1]}: {v['median']:.2f} ms" for k, v in result.items()
                               if k.startswith("decode_ms_per_token_at_")) or \
                f"decode: {result['decode_ms_per_token']['median']:.2f} ms"
            print(f"{name:16s} {dtype:9s} prefill {result['prefill_tokens_per_s']['best']:9.1f} tok/s  {decode}  "
                  f"peak RSS {result['peak_rss_mb']:.0f} MB")
    default = (Path(tempfile.gettempdir()) / "bench_pretrained_quick.json" if args.quick
               else Path(__file__).parent / "results" / "bench_pretrained.json")
    print(f"wrote {record.write(args.out or default, results)}")


if __name__ == "__main__":
    main()
