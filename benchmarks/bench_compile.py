"""Decode latency with torch.compile vs eager, per family: ms/token of a single-token step with the recurrent state.

For each model: prefill a random context eagerly, then time decode steps (batch 1, greedy) of the eager model and of
``torch.compile(model, fullgraph=True)`` (inductor by default), interleaved step by step so that load from elsewhere
affects both alike. The compiled and eager runs start from copies of the same cache and must choose the same tokens;
the largest logit difference and the compile time (the first compiled steps) are reported with the latencies.

    python benchmarks/bench_compile.py [--families delta_net delta_lstm] [--hidden 256] [--layers 6] [--context 128]
                                       [--steps 48] [--backend inductor] [--threads N] [--out PATH]
    python benchmarks/bench_compile.py --quick   # a tiny model and a few steps: checks that the script runs

Writes benchmarks/results/bench_compile.json (``--quick``: nothing unless ``--out`` is given).
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from modeling_fwp import DeltaLSTMConfig, DeltaNetConfig, LinearTransformerConfig  # noqa: E402
from modeling_fwp.cache_fwp import CACHE_ARGUMENT, output_cache  # noqa: E402
from training.result_file import RunRecord, ratio, scaled, summarize  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

FAMILIES = {"linear_transformer": LinearTransformerConfig, "delta_net": DeltaNetConfig, "delta_lstm": DeltaLSTMConfig}


def build(family: str, vocab: int, hidden: int, layers: int, heads: int):
    torch.manual_seed(0)
    config = FAMILIES[family](vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                              num_attention_heads=heads, intermediate_size=4 * hidden)
    return AutoModelForCausalLM.from_config(config).eval()


@torch.inference_mode()
def decode_eager_and_compiled(model, compiled, context: int, steps: int, warmup: int, vocab: int) -> dict:
    """Seconds per token of both (``summarize`` over the timed steps), compile seconds, whether the greedy tokens agree
    and the largest logit difference."""
    ids = torch.randint(0, vocab, (1, context), generator=torch.Generator().manual_seed(context))
    out = model(ids, use_cache=True)
    caches = {"eager": output_cache(out), "compiled": copy.deepcopy(output_cache(out))}
    tokens = {name: out.logits[:, -1:].argmax(-1) for name in caches}
    run = {"eager": model, "compiled": compiled}
    times = {name: [] for name in caches}
    same_tokens, max_diff, compile_s = True, 0.0, 0.0
    for step in range(warmup + steps):
        logits = {}
        for name in ("eager", "compiled"):
            t0 = time.perf_counter()
            step_out = run[name](tokens[name], use_cache=True, **{CACHE_ARGUMENT: caches[name]})
            elapsed = time.perf_counter() - t0
            if step >= warmup:
                times[name].append(elapsed)
            elif name == "compiled":
                compile_s += elapsed
            caches[name], logits[name] = output_cache(step_out), step_out.logits[:, -1]
            tokens[name] = logits[name].argmax(-1, keepdim=True)
        same_tokens &= bool(torch.equal(tokens["eager"], tokens["compiled"]))
        max_diff = max(max_diff, (logits["eager"] - logits["compiled"]).abs().max().item())
    return {"eager": summarize(times["eager"]), "compiled": summarize(times["compiled"]), "compile_s": compile_s,
            "same_tokens": same_tokens, "max_logit_difference": max_diff}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--families", nargs="+", choices=sorted(FAMILIES), default=["delta_net", "delta_lstm"])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--warmup", type=int, default=3, help="compiled steps not timed (they compile)")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--quick", action="store_true", help="tiny model, few steps (checks that the script runs)")
    parser.add_argument("--out", default=None, help="result file (default benchmarks/results/bench_compile.json)")
    args = parser.parse_args()
    if args.quick:
        args.hidden, args.layers, args.heads, args.vocab, args.context, args.steps = 16, 1, 2, 32, 4, 2
    out_path = args.out or (None if args.quick else str(Path(__file__).parent / "results" / "bench_compile.json"))
    torch.set_num_threads(args.threads)
    record = RunRecord.start("python benchmarks/bench_compile.py")
    results = {key: getattr(args, key) for key in ("hidden", "layers", "heads", "vocab", "context", "steps", "backend")}
    results.update(threads=torch.get_num_threads(), models={})
    print(f"batch 1, context {args.context}, {args.layers} layers, d_model {args.hidden}, {args.heads} heads, vocab "
          f"{args.vocab}, {torch.get_num_threads()} threads, backend {args.backend}; ms/token: median (best)")
    print(f"{'model':20s} {'eager':>17s} {'compiled':>17s} {'speed-up':>9s} {'compile s':>10s} {'tokens':>7s} "
          f"{'max |dlogit|':>12s}")
    for family in args.families:
        model = build(family, args.vocab, args.hidden, args.layers, args.heads)
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True, backend=args.backend)
        found = decode_eager_and_compiled(model, compiled, args.context, args.steps, args.warmup, args.vocab)
        eager, comp = scaled(found["eager"], 1e3), scaled(found["compiled"], 1e3)
        speedup = ratio(found["eager"], found["compiled"])
        results["models"][family] = dict(
            eager_ms_per_token=eager["median"], compiled_ms_per_token=comp["median"], speedup=speedup["of_medians"],
            ms_per_token={"eager": eager, "compiled": comp}, compile_s=found["compile_s"],
            same_tokens=found["same_tokens"], max_logit_difference=found["max_logit_difference"],
        )
        print(f"{family:20s} {eager['median']:8.3f} ({eager['best']:6.3f}) {comp['median']:8.3f} ({comp['best']:6.3f}) "
              f"{speedup['of_medians']:9.2f} {found['compile_s']:10.1f} {str(found['same_tokens']):>7s} "
              f"{found['max_logit_difference']:12.2e}")
    if out_path:
        print(f"wrote {record.write(out_path, results)}")


if __name__ == "__main__":
    main()
