"""Per-token generation latency vs context length: Delta Net (FastWeightCache) vs Llama (KV cache).

Issue 2's measurement: a 6-layer d_model=256 Delta Net, batch 1, CPU. For a context of 128 and of 8,192
tokens we prefill the context, then time single-token decode steps with the cache; the ratio of the median
per-token latency at 8,192 over 128 should be at most 1.1 (constant-size state). A transformers
LlamaForCausalLM of equal width and depth with its KV cache is measured in the same run for comparison,
and the cache bytes of both at both lengths are reported. Per-token times are kept as best / median / all
(``training.result_file``); the ratio of medians is the headline, the ratio of bests is given beside it.

    python benchmarks/bench_generation.py [--contexts 128 8192] [--steps 48] [--threads 1] [--out PATH]

Writes benchmarks/results/bench_generation.json (with the command, versions and load average: ``"run"``).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import modeling_fwp  # noqa: E402
from modeling_fwp import DeltaNetConfig, DeltaNetForCausalLM  # noqa: E402
from modeling_fwp.cache_fwp import CACHE_ARGUMENT, output_cache  # noqa: E402
from training.result_file import RunRecord, ratio, scaled, summarize  # noqa: E402


def cache_nbytes(cache) -> int:
    if isinstance(cache, modeling_fwp.FastWeightCache):
        return cache.nbytes()
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)
               if t is not None)


@torch.inference_mode()
def prefill(model, context: int, vocab: int, chunk: int = 2048):
    """Feeds ``context`` random tokens (in chunks, which keeps Llama's attention memory bounded); returns
    (cache, next token)."""
    ids = torch.randint(0, vocab, (1, context), generator=torch.Generator().manual_seed(context))
    cache = None
    for start in range(0, context, chunk):
        out = model(ids[:, start : start + chunk], use_cache=True, **{CACHE_ARGUMENT: cache})
        cache = output_cache(out)
    return cache, out.logits[:, -1:].argmax(-1)


@torch.inference_mode()
def decode_latencies(model, contexts: list[int], steps: int, vocab: int) -> list[tuple[dict, int]]:
    """Seconds per decoded token (``{"best", "median", "all"}`` over the `steps` timed steps) and cache bytes, for
    each context length.

    The decode steps of the different contexts are interleaved (one step each, in turn), so that any load
    from elsewhere on the machine affects all of them alike.
    """
    caches, tokens = zip(*(prefill(model, c, vocab) for c in contexts))
    caches, tokens = list(caches), list(tokens)
    times = [[] for _ in contexts]
    for step in range(steps + 4):
        for i in range(len(contexts)):
            t0 = time.perf_counter()
            out = model(tokens[i], use_cache=True, **{CACHE_ARGUMENT: caches[i]})
            times[i].append(time.perf_counter() - t0)
            caches[i], tokens[i] = output_cache(out), out.logits[:, -1:].argmax(-1)
    return [(summarize(t[4:]), cache_nbytes(c)) for t, c in zip(times, caches)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--contexts", type=int, nargs=2, default=[128, 8192])
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "bench_generation.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    record = RunRecord.start("python benchmarks/bench_generation.py")
    vocab, width, depth, heads = 8192, 256, 6, 8
    torch.manual_seed(0)
    models = {
        "delta_net": DeltaNetForCausalLM(
            DeltaNetConfig(vocab_size=vocab, hidden_size=width, num_hidden_layers=depth, num_attention_heads=heads,
                           intermediate_size=4 * width, feature_map="elu")
        ).eval(),
        "llama_kv_cache": LlamaForCausalLM(
            LlamaConfig(vocab_size=vocab, hidden_size=width, num_hidden_layers=depth, num_attention_heads=heads,
                        intermediate_size=4 * width, max_position_embeddings=2 * max(args.contexts))
        ).eval(),
    }
    short, long = args.contexts
    results = {"contexts": args.contexts, "steps": args.steps, "threads": torch.get_num_threads(), "models": {}}
    print(f"batch 1, {depth} layers, d_model {width}, {heads} heads, vocab {vocab}, {torch.get_num_threads()} threads; "
          f"ms/token: median (best) of {args.steps} steps")
    print(f"{'model':16s} {'ms/token @' + str(short):>18s} {'ms/token @' + str(long):>18s} {'ratio':>15s} "
          f"{'cache B @' + str(short):>14s} {'cache B @' + str(long):>14s}")
    for name, model in models.items():
        (lat_s, bytes_s), (lat_l, bytes_l) = decode_latencies(model, [short, long], args.steps, vocab)
        ms_s, ms_l, r = scaled(lat_s, 1e3), scaled(lat_l, 1e3), ratio(lat_l, lat_s)
        results["models"][name] = dict(
            ms_per_token_short=ms_s["median"], ms_per_token_long=ms_l["median"], latency_ratio=r["of_medians"],
            latency_ratio_of_bests=r["of_bests"], ms_per_token={"short": ms_s, "long": ms_l},
            cache_bytes_short=bytes_s, cache_bytes_long=bytes_l,
        )
        print(f"{name:16s} {ms_s['median']:9.3f} ({ms_s['best']:6.3f}) {ms_l['median']:9.3f} ({ms_l['best']:6.3f}) "
              f"{r['of_medians']:7.3f} ({r['of_bests']:5.3f}) {bytes_s:14d} {bytes_l:14d}")
    dn = results["models"]["delta_net"]
    print(f"Delta Net latency ratio {dn['latency_ratio']:.3f} (of medians; target <= 1.1); cache bytes equal: "
          f"{dn['cache_bytes_short'] == dn['cache_bytes_long']}")
    print(f"wrote {record.write(args.out, results)}")


if __name__ == "__main__":
    main()
