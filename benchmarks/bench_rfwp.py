"""Training throughput of the recurrent FWPs against the Delta Net, and fused scans against the step loop (CPU).

Issue 4's measurements, all taken in one run so that the ratios share the machine's conditions:

1. Training throughput (tokens/s of forward + backward) at the paper's small configuration (Irie et al. 2021
   sec. 4.1: 16 layers, d_model 128, 8 heads of 16, d_ff 2048), T = 256, a small batch, for every model of
   Table 1 with its default version, reported as a ratio to the Delta Net. The vocabulary is kept small (2048,
   no adaptive softmax) so that the fast-weight layers, not the output layer, set the differences. Variants are
   timed round-robin, one step each per round; each model's steps are kept as best / median / all, and its ratio to
   the Delta Net is given both ways (the ratio of medians is the headline). The paper's GPU figures (words/s:
   Linear Transformer 66K, Delta Net 63K, Delta RNN 41K, RDN 35K, Delta LSTM 14K) give the targets
   RDN >= 0.55, Delta RNN >= 0.65, Delta LSTM >= 0.22 of the Delta Net.
2. Fused scan (C++ kernel) against the PyTorch step loop for the same cell, T = 1024, forward + backward, per
   scan of the paper's layers: the Delta RNN's and Delta LSTM's recurrent parts and the Recurrent Delta Net
   (target >= 10x). The fused scan runs 3 times (best / median / all); the step loop is slow and runs once per
   cell, so both speed-ups (over the fused median and over the fused best) divide by that one step-loop time.

Time is the CPU time of the calling thread with one intra-op thread (``--threads 1``, the default): on a machine
shared with other jobs, wall-clock steps of the same model were seen to vary 5x within a minute, while CPU time
stays within ~10%. With one thread all of the forward and backward (autograd's CPU engine included) runs on the
calling thread, so its CPU time is the work done. Wall-clock times of the same steps are reported as well.

    python benchmarks/bench_rfwp.py [--batch 2] [--seq-len 256] [--rounds 5] [--scan-len 1024] [--threads 1]

Writes benchmarks/results/bench_rfwp.json, with the run's command, versions and load average before and after
(``"run"``, ``training.result_file``).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fwp_kernels import rfwp_scan  # noqa: E402
from fwp_kernels import ScanState, fast_rnn_scan, recurrent_delta_rule  # noqa: E402
from training.result_file import RunRecord, ratio, summarize  # noqa: E402
from modeling_fwp.families import FAMILIES  # noqa: E402

# Every family of the table with a fast-weight layer (the Linear Transformer, the Delta Net and the recurrent FWPs of
# Irie et al. 2021 Table 1), by its title; a new family is timed without an edit here.
MODELS = {spec.facts.title: spec.config_class for spec in FAMILIES if spec.fast_weight_layer is not None}
PAPER_WORDS_PER_S = {"Linear Transformer": 66e3, "Delta Net": 63e3, "Delta RNN": 41e3, "Recurrent Delta Net": 35e3,
                     "Delta LSTM": 14e3}
TARGETS = {"Recurrent Delta Net": 0.55, "Delta RNN": 0.65, "Delta LSTM": 0.22}


def paper_small(cls, vocab_size: int):
    return cls(vocab_size=vocab_size, hidden_size=128, num_attention_heads=8, num_hidden_layers=16,
               intermediate_size=2048)


def training_throughput(batch: int, seq_len: int, rounds: int, vocab_size: int) -> dict:
    from transformers import AutoModelForCausalLM

    models = {}
    for name, cls in MODELS.items():
        torch.manual_seed(0)
        models[name] = AutoModelForCausalLM.from_config(paper_small(cls, vocab_size)).train()
    ids = torch.randint(0, vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(0))

    def step(model) -> tuple:
        cpu, wall = time.thread_time(), time.perf_counter()
        model(ids, labels=ids).loss.backward()
        cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
        model.zero_grad(set_to_none=True)
        return cpu, wall

    for model in models.values():  # warm-up: kernel builds, allocator, first-call costs
        step(model)
    times = {name: [] for name in models}
    for _ in range(rounds):
        for name, model in models.items():
            times[name].append(step(model))
    tokens = batch * seq_len
    cpu = {name: summarize([c for c, _ in steps]) for name, steps in times.items()}
    results = {}
    for name in models:
        to_delta_net = ratio(cpu["Delta Net"], cpu[name])  # step-time ratio = tokens/s ratio
        results[name] = {
            "tokens_per_s": tokens / cpu[name]["best"],
            "tokens_per_s_median": tokens / cpu[name]["median"],
            "step_cpu_s": cpu[name]["best"],
            "step_cpu_s_median": cpu[name]["median"],
            "steps_cpu_s": cpu[name]["all"],
            "steps_wall_s": [wall for _, wall in times[name]],
            "ratio_to_delta_net": to_delta_net["of_bests"],
            "ratio_to_delta_net_median": to_delta_net["of_medians"],
            "paper_gpu_ratio": (PAPER_WORDS_PER_S[name] / PAPER_WORDS_PER_S["Delta Net"]
                                if name in PAPER_WORDS_PER_S else None),
            "target_ratio": TARGETS.get(name),
            "parameters": sum(p.numel() for p in models[name].parameters()),
        }
    return results


def scan_speedups(seq_len: int, batch: int = 1, heads: int = 8, head_dim: int = 16, repeats: int = 3) -> dict:
    """Fused kernel vs step loop, forward + backward, for the recurrent part of each RFWP layer."""
    g = torch.Generator().manual_seed(0)
    B, H, T, D = batch, heads, seq_len, head_dim

    def leaf(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).requires_grad_()

    def make(kind):
        if kind == "rdn":
            x = [leaf(B, H, T, D), leaf(B, H, T, D), leaf(B, H, T, D), leaf(B, H, T)] + [
                leaf(H, D, D, scale=D**-0.5) for _ in range(3)] + [leaf(H, D, scale=D**-0.5)]
            return x, lambda mode: recurrent_delta_rule(*x, mode=mode)[0]
        G = 3 if kind.startswith("lstm") else 1
        x = [leaf(B, H, G, T, D) for _ in range(3)] + [leaf(B, H, G, T)]
        return x, lambda mode: fast_rnn_scan(x[0], torch.softmax(x[1], -1), x[2], torch.sigmoid(x[3]), cell=kind,
                                              initial_state=ScanState(), mode=mode)[0]

    def timed(fn, mode) -> float:
        start = time.thread_time()
        fn(mode).sum().backward()
        return time.thread_time() - start

    results = {}
    for kind, label in (("rnn_b", "Delta RNN (B) recurrent part"), ("lstm_d", "Delta LSTM (D) recurrent part"),
                        ("rdn", "Recurrent Delta Net")):
        _, fn = make(kind)
        timed(fn, "fused")  # warm-up
        fused = summarize([timed(fn, "fused") for _ in range(repeats)])
        loop = timed(fn, "recurrent")
        results[label] = {"cell": kind, "fused_cpu_s": fused["best"], "fused_cpu_s_median": fused["median"],
                          "fused_cpu_s_all": fused["all"], "step_loop_cpu_s": loop, "step_loop_runs": 1,
                          "speedup": loop / fused["best"], "speedup_over_fused_median": loop / fused["median"],
                          "target_speedup": 10.0}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--scan-len", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (CPU time is exact for 1)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "bench_rfwp.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    record = RunRecord.start("python benchmarks/bench_rfwp.py")
    if not rfwp_scan.cpu_kernel_available():
        print("warning: the C++ scans are unavailable; the recurrent models run their step loops", flush=True)

    print(f"training throughput: paper small config, B={args.batch}, T={args.seq_len}, vocab {args.vocab_size}, "
          f"{args.rounds} round-robin steps (forward + backward), {args.threads} thread(s), thread CPU time; "
          "median (best)", flush=True)
    train = training_throughput(args.batch, args.seq_len, args.rounds, args.vocab_size)
    for name, r in train.items():
        target = f"  target >= {r['target_ratio']:.2f}" if r["target_ratio"] else ""
        paper = f"  (paper GPU {r['paper_gpu_ratio']:.2f})" if r["paper_gpu_ratio"] else ""
        wall = f"[wall {min(r['steps_wall_s']):.2f}-{max(r['steps_wall_s']):.2f} s/step]"
        to_dn = f"{r['ratio_to_delta_net_median']:.2f} ({r['ratio_to_delta_net']:.2f}) x Delta Net"
        print(f"  {name:20s} {r['tokens_per_s_median']:6.0f} ({r['tokens_per_s']:4.0f}) tokens/s  {to_dn}{paper}"
              f"{target}  {wall}", flush=True)

    print(f"fused scan vs step loop: T={args.scan_len}, B=1, H=8, D=16, forward + backward, thread CPU time; "
          "fused: median (best) of 3, step loop: one run", flush=True)
    scans = scan_speedups(args.scan_len)
    for name, r in scans.items():
        print(f"  {name:32s} fused {r['fused_cpu_s_median'] * 1e3:8.1f} ({r['fused_cpu_s'] * 1e3:.1f}) ms  step loop "
              f"{r['step_loop_cpu_s']:7.2f} s  speedup {r['speedup_over_fused_median']:6.1f}x ({r['speedup']:.1f}x)  "
              "(target >= 10x)", flush=True)

    report = {
        "benchmark": "bench_rfwp",
        "machine": {"torch_threads": torch.get_num_threads(), "timer": "time.thread_time",
                    "cpp_scans": rfwp_scan.cpu_kernel_available()},
        "settings": vars(args) | {"out": str(args.out)},
        "training_throughput": train,
        "scan_vs_step_loop": scans,
    }
    print(f"wrote {record.write(args.out, report)}")


if __name__ == "__main__":
    main()
