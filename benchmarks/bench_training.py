"""Training throughput of the papers' small Delta Net vs a softmax-attention Transformer of the same size.

Issue 3's measurement: a 16-layer, d_model=128, 8-head Delta Net LM (Schlag et al. 2021 / Irie et al. 2021 small
config, d_ff 2048) against transformers' LlamaForCausalLM with sdpa attention and the same width, depth, heads and
feed-forward size, forward + backward, at T=256 and T=1024. Steps of the two models are interleaved, one each per
round (the machine may be shared); tokens/s are printed side by side from the median step and from the best one,
with both ratios: the ratio of medians is the headline. The JSON records every step time, the run (command,
versions, load average before and after, ``training.result_file``), the load average after each length, and which
CPU path the Delta Net's chunk kernel took (fwp_kernels.chunk.cpu_kernel_status()).

    python benchmarks/bench_training.py [--batch 4] [--rounds 3] [--threads 1] [--out PATH]

Writes benchmarks/results/bench_training.json.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fwp_kernels import chunk  # noqa: E402
from modeling_fwp import DeltaNetConfig, DeltaNetForCausalLM  # noqa: E402
from training.result_file import RunRecord, load_average, ratio, summarize  # noqa: E402


def build_models(vocab: int, max_len: int) -> dict:
    width, depth, heads, d_ff = 128, 16, 8, 2048
    torch.manual_seed(0)
    return {
        "delta_net": DeltaNetForCausalLM(
            DeltaNetConfig(vocab_size=vocab, hidden_size=width, num_hidden_layers=depth, num_attention_heads=heads,
                           intermediate_size=d_ff, feature_map="elu")
        ),
        "llama_sdpa": LlamaForCausalLM(
            LlamaConfig(vocab_size=vocab, hidden_size=width, num_hidden_layers=depth, num_attention_heads=heads,
                        intermediate_size=d_ff, max_position_embeddings=max_len, attn_implementation="sdpa")
        ),
    }


def train_step_seconds(model, ids: torch.Tensor) -> float:
    t0 = time.perf_counter()
    model(ids, labels=ids).loss.backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "bench_training.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    record = RunRecord.start("python benchmarks/bench_training.py")
    models = build_models(args.vocab, max(args.lengths))
    for model in models.values():
        model.train()
    results = {"batch": args.batch, "threads": args.threads, "vocab": args.vocab, "rounds": args.rounds, "lengths": {}}
    print(f"16 layers, d_model 128, 8 heads, d_ff 2048, vocab {args.vocab}, batch {args.batch}, "
          f"{args.threads} threads; forward + backward, {args.rounds} interleaved rounds")
    print(f"{'T':>6s} {'Delta Net tok/s':>16s} {'Llama sdpa tok/s':>17s} {'ratio of medians':>17s} {'of bests':>9s}"
          "   (tok/s: median step (best step))")
    for T in args.lengths:
        results["lengths"][T] = row = measure_length(models, args.batch, T, args.vocab, args.rounds)
        tps, best = row["tokens_per_s_median"], row["tokens_per_s"]
        print(f"{T:6d} {tps['delta_net']:7.0f} ({best['delta_net']:6.0f}) {tps['llama_sdpa']:8.0f} "
              f"({best['llama_sdpa']:6.0f}) {row['delta_net_over_llama_medians']:17.2f} "
              f"{row['delta_net_over_llama']:9.2f}")
    results["chunk_kernel"] = chunk.cpu_kernel_status()
    print(f"Delta Net chunk kernel on CPU: {results['chunk_kernel']}")
    path = record.write(args.out, results)
    print(f"wrote {path}; load average {record.fields['load_average_start'][0]:.1f} -> {load_average()[0]:.1f} "
          f"on {os.cpu_count()} CPUs")


def measure_length(models: dict, batch: int, T: int, vocab: int, rounds: int) -> dict:
    """One warm-up step each, then `rounds` rounds of one step per model; step times as best / median / all, tokens/s
    from the best and the median step, the Delta Net's speed over Llama's both ways, and the load average after."""
    ids = torch.randint(0, vocab, (batch, T), generator=torch.Generator().manual_seed(T))
    for model in models.values():  # warm-up
        train_step_seconds(model, ids)
    steps = {name: [] for name in models}
    for _ in range(rounds):
        for name, model in models.items():
            steps[name].append(train_step_seconds(model, ids))
    summary = {name: summarize(times) for name, times in steps.items()}
    speedup = ratio(summary["llama_sdpa"], summary["delta_net"])  # step-time ratio = tokens/s ratio
    return {
        "tokens_per_s": {name: batch * T / s["best"] for name, s in summary.items()},
        "tokens_per_s_median": {name: batch * T / s["median"] for name, s in summary.items()},
        "step_s": {name: s["best"] for name, s in summary.items()},
        "step_s_summary": summary,
        "delta_net_over_llama": speedup["of_bests"],
        "delta_net_over_llama_medians": speedup["of_medians"],
        "all_step_s": steps,
        "loadavg": load_average(),
    }


if __name__ == "__main__":
    main()
