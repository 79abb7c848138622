"""The RL learner's update: the core run once for both heads (``training.rl_popgym.learner_losses``) against
torchrl's loss modules given the whole actor and the whole critic (the core run once for each), on one batch.

For each core and learner, one whole ``policy_update`` (PPO: 4 epochs of GAE and 4 minibatch steps; IMPALA: the
V-trace targets and one step on the whole batch) is timed both ways, round-robin, on the same collected batch (32
envs x 50 steps, the paper's batch and span, by default); the advantage passes are the same in both, and one of them
is timed alone beside them. Time is the CPU time of the calling thread with one intra-op thread (as
``bench_rfwp.py``: robust to other jobs on the machine); wall-clock times are reported beside it. The loss terms of
both ways are checked equal before timing.

    python benchmarks/bench_rl_update.py [--cores recurrent_delta_net lstm] [--rounds 5] [--num_envs 32]

Writes benchmarks/results/bench_rl_update.json (``"run"``: command, versions, load average before and after).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, Tuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from training import rl_popgym as rl  # noqa: E402
from training.result_file import RunRecord, ratio, summarize  # noqa: E402


def update_variants(core: str, algorithm: str, num_envs: int,
                    rollout_length: int) -> Tuple[Dict[str, Callable], Callable]:
    """``({"core once", "core per head", "advantage pass"}, check)``: one whole ``policy_update`` on a collected batch
    (PPO: 4 epochs of GAE and 4 minibatch steps; IMPALA: V-trace targets and one step), with the learner's loss (the
    core run once) or with torchrl's loss on the whole actor and critic (the core run once per head), and one advantage
    pass alone (the same in both); `check` returns both ways' loss terms on the same batch before any update."""
    from torchrl.collectors import Collector
    from torchrl.modules import set_recurrent_mode

    args = rl.RLArguments(core=core, algorithm=algorithm, env="RepeatPreviousEasy", num_envs=num_envs,
                          rollout_length=rollout_length)
    torch.manual_seed(0)
    agent = rl.build_agent(args)
    collector = Collector(agent["env"], agent["actor"], frames_per_batch=num_envs * rollout_length,
                          total_frames=2 * num_envs * rollout_length)
    batch = [b.clone() for b in collector][-1]  # stored states carried over, an episode start in every row
    collector.shutdown()
    theirs = dict(agent, loss=rl.build_loss(args, agent["actor"], agent["critic"]), core=lambda minibatch: minibatch)

    def advantage_pass() -> None:
        with set_recurrent_mode(True), torch.no_grad():
            agent["advantage"](batch)

    def check() -> Tuple[Dict[str, torch.Tensor], Dict[str, torch.Tensor]]:
        advantage_pass()
        with set_recurrent_mode(True), torch.no_grad():
            return rl.learner_losses(batch, agent), rl.learner_losses(batch, theirs)

    return {"core once": lambda: rl.policy_update(batch, agent, args),
            "core per head": lambda: rl.policy_update(batch, theirs, args), "advantage pass": advantage_pass}, check


def time_pair(ways: Dict[str, Callable], check: Callable, rounds: int) -> Dict[str, Any]:
    """Round-robin CPU and wall times of the two ways (and of the advantage pass), after checking that the two ways'
    loss terms are equal."""
    expected, got = check()
    for k in expected:
        torch.testing.assert_close(got[k], expected[k], rtol=1e-5, atol=1e-6)
    times: Dict[str, list] = {name: [] for name in ways}
    for _ in range(rounds):
        for name, fn in ways.items():
            cpu, wall = time.thread_time(), time.perf_counter()
            fn()
            times[name].append((time.thread_time() - cpu, time.perf_counter() - wall))
    cpu = {name: summarize([c for c, _ in t]) for name, t in times.items()}
    wall = {name: summarize([w for _, w in t]) for name, t in times.items()}
    return {"cpu_s": cpu, "wall_s": wall, "speedup_cpu": ratio(cpu["core per head"], cpu["core once"]),
            "speedup_wall": ratio(wall["core per head"], wall["core once"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cores", nargs="+", default=["recurrent_delta_net", "lstm"], choices=rl.CORES)
    parser.add_argument("--algorithms", nargs="+", default=["ppo", "impala"], choices=rl.ALGORITHMS)
    parser.add_argument("--num_envs", type=int, default=32)
    parser.add_argument("--rollout_length", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="benchmarks/results/bench_rl_update.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    record = RunRecord.start("python benchmarks/bench_rl_update.py")
    results = {}
    for core in args.cores:
        for algorithm in args.algorithms:
            pair = time_pair(*update_variants(core, algorithm, args.num_envs, args.rollout_length), args.rounds)
            results[f"{core}/{algorithm}"] = pair
            print(f"{core:>20} {algorithm:>6}: core once {pair['cpu_s']['core once']['median']:.3f} s, core per head "
                  f"{pair['cpu_s']['core per head']['median']:.3f} s, advantage pass "
                  f"{pair['cpu_s']['advantage pass']['median']:.3f} s CPU (median): "
                  f"{pair['speedup_cpu']['of_medians']:.2f}x (wall {pair['speedup_wall']['of_medians']:.2f}x)",
                  flush=True)
    report = {"settings": {k: getattr(args, k) for k in ("num_envs", "rollout_length", "rounds", "threads")},
              "results": results}
    print(f"wrote {record.write(args.out, report)}")


if __name__ == "__main__":
    main()
