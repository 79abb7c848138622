"""Page faults in a CPU training step: the process's allocator as glibc ships it against settings that keep freed memory.

    python benchmarks/bench_cpu_allocator.py [--steps 5] [--length 1024] [--threads 1] [--out PATH]

bench_training's 16-layer d = 128 Delta Net, batch 4, one training step (forward, backward, ``zero_grad``) timed per
call, in three child processes one after another (glibc reads its settings when a process starts, so the three
cannot be interleaved in one process), each timing its steps after two untimed ones:

- ``plain``: glibc as shipped (freed blocks above its mmap threshold, and the trimmed heap top, go back to the system,
  and the next tensor of that size is faulted in again page by page);
- ``keep_freed``: ``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_`` and ``MALLOC_TOP_PAD_`` set so that freed
  memory stays with the process;
- ``keep_freed_reuse``: the same, each step also inside the kernels' buffer reuse (``reuse_buffers_enter`` /
  ``reuse_buffers_exit``, the allocator behind ``fwp_kernels.reusing_cpu_buffers``);
- ``mallopt``: no environment; the process calls ``training.trainer_utils.keep_freed_cpu_memory`` before its first
  step (what the training scripts' Trainers do on CPU: ``KeepFreedCpuMemory``).

Prints the median and best step, the page faults per step (``ru_minflt``) and the process's peak resident memory
(``ru_maxrss``) of each, with the ratios to ``plain``; writes benchmarks/results/bench_cpu_allocator.json
(``training.result_file.RunRecord``). The package (modeling_fwp, fwp_kernels) sets none of these: the allocator's
settings are the process's, and the training scripts own theirs.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results" / "bench_cpu_allocator.json"
KEEP_FREED = {"MALLOC_MMAP_THRESHOLD_": str(1 << 32), "MALLOC_TRIM_THRESHOLD_": str(1 << 36),
              "MALLOC_TOP_PAD_": str(1 << 30)}
# name: (environment, worker mode: plain / reuse / mallopt)
SETTINGS = {"plain": ({}, "plain"), "keep_freed": (KEEP_FREED, "plain"), "keep_freed_reuse": (KEEP_FREED, "reuse"),
            "mallopt": ({}, "mallopt")}


def worker(steps: int, length: int, threads: int, mode: str) -> dict:
    """Times `steps` training steps in this process -> {"step_s": [...], "faults_per_step": float, "maxrss_mb": ...};
    mode "reuse": each step in the kernels' buffer reuse, "mallopt": keep_freed_cpu_memory() first."""
    import torch

    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_training import build_models
    from fwp_kernels import dense
    from training.trainer_utils import keep_freed_cpu_memory

    kept = keep_freed_cpu_memory() if mode == "mallopt" else False
    reuse = mode == "reuse"

    torch.set_num_threads(threads)
    model = build_models(8192, length)["delta_net"]
    ids = torch.randint(0, 8192, (4, length), generator=torch.Generator().manual_seed(0))
    ops = dense._CPU_KERNEL.ops if reuse and dense._CPU_KERNEL.available() else None

    def step() -> None:
        if ops is not None:
            ops.reuse_buffers_enter()
        try:
            model(ids, labels=ids).loss.backward()
            model.zero_grad(set_to_none=True)
        finally:
            if ops is not None:
                ops.reuse_buffers_exit()

    for _ in range(2):
        step()
    times, faults = [], 0
    for _ in range(steps):
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
        faults += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
    return {"step_s": times, "faults_per_step": faults / steps, "reuse_active": ops is not None, "mallopt": kept,
            "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        print(json.dumps(worker(args.steps, args.length, args.threads, args.worker)))
        return
    sys.path.insert(0, str(ROOT))
    from training.result_file import RunRecord, ratio, summarize

    record = RunRecord.start("python benchmarks/bench_cpu_allocator.py")
    results = {"steps": args.steps, "length": args.length, "threads": args.threads, "batch": 4, "settings": {}}
    # the children start from this environment without the allocator's settings (each setting adds its own)
    inherited = {k: v for k, v in os.environ.items() if k not in KEEP_FREED and k != "GLIBC_TUNABLES"}
    for name, (env, mode) in SETTINGS.items():
        out = subprocess.run([sys.executable, __file__, "--worker", mode, "--steps",
                              str(args.steps), "--length", str(args.length), "--threads", str(args.threads)],
                             env={**inherited, **env}, check=True, capture_output=True, text=True)
        run = json.loads(out.stdout.strip().splitlines()[-1])
        results["settings"][name] = {"environment": env, "step": summarize(run["step_s"]),
                                     "faults_per_step": run["faults_per_step"], "reuse_active": run["reuse_active"],
                                     "mallopt": run["mallopt"], "maxrss_mb": run["maxrss_mb"]}
    plain = results["settings"]["plain"]["step"]
    for name, row in results["settings"].items():
        row["plain_over_this"] = ratio(plain, row["step"])
        print(f"{name:18s} step {row['step']['median'] * 1e3:8.1f} ms median ({row['step']['best'] * 1e3:8.1f} best)"
              f"  faults/step {row['faults_per_step']:9.0f}  peak RSS {row['maxrss_mb']:7.0f} MB"
              f"  plain / this {row['plain_over_this']['of_medians']:.2f}x")
    path = record.write(args.out, results)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
