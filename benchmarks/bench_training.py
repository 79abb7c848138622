"""Training throughput of the papers' small Delta Net vs a softmax-attention Transformer of the same size.

Issue 3's measurement: a 16-layer, d_model=128, 8-head Delta Net LM (Schlag et al. 2021 / Irie et al. 2021 small
config, d_ff 2048) against transformers' LlamaForCausalLM with sdpa attention and the same width, depth, heads and
feed-forward size, forward + backward, at T=256 and T=1024. Steps of the two models are interleaved and the best
of the rounds is kept (the machine may be shared); tokens/s are printed side by side with their ratio, and the
ratio of the medians as well. The JSON records every step time, the load average and which CPU path the Delta
Net's chunk kernel took (fwp_kernels.chunk.cpu_kernel_status()).

    python benchmarks/bench_training.py [--batch 4] [--rounds 3] [--threads 1]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fwp_kernels import chunk  # noqa: E402
from modeling_fwp import DeltaNetConfig, DeltaNetForCausalLM  # noqa: E402


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
    models = build_models(args.vocab, max(args.lengths))
    for model in models.values():
        model.train()
    results = {"batch": args.batch, "threads": args.threads, "vocab": args.vocab, "lengths": {},
               "torch": torch.__version__, "cpus": os.cpu_count(), "loadavg_start": list(os.getloadavg())}
    print(f"16 layers, d_model 128, 8 heads, d_ff 2048, vocab {args.vocab}, batch {args.batch}, "
          f"{args.threads} threads; forward + backward, best of {args.rounds} interleaved rounds")
    print(f"{'T':>6s} {'Delta Net tok/s':>16s} {'Llama sdpa tok/s':>17s} {'ratio':>7s} {'ratio of medians':>17s}")
    for T in args.lengths:
        ids = torch.randint(0, args.vocab, (args.batch, T), generator=torch.Generator().manual_seed(T))
        for model in models.values():  # warm-up
            train_step_seconds(model, ids)
        steps = {name: [] for name in models}
        for _ in range(args.rounds):
            for name, model in models.items():
                steps[name].append(train_step_seconds(model, ids))
        best = {name: min(times) for name, times in steps.items()}
        tps = {name: args.batch * T / s for name, s in best.items()}
        ratio = tps["delta_net"] / tps["llama_sdpa"]
        median_ratio = statistics.median(steps["llama_sdpa"]) / statistics.median(steps["delta_net"])
        results["lengths"][T] = {"tokens_per_s": tps, "step_s": best, "delta_net_over_llama": ratio,
                                 "all_step_s": steps, "delta_net_over_llama_medians": median_ratio,
                                 "loadavg": list(os.getloadavg())}
        print(f"{T:6d} {tps['delta_net']:16.0f} {tps['llama_sdpa']:17.0f} {ratio:7.2f} {median_ratio:17.2f}")
    results["chunk_kernel"] = chunk.cpu_kernel_status()
    print(f"Delta Net chunk kernel on CPU: {results['chunk_kernel']}")
    results["loadavg_end"] = list(os.getloadavg())
    print(f"load average {results['loadavg_start'][0]:.1f} -> {results['loadavg_end'][0]:.1f} on {os.cpu_count()} CPUs")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
