"""The reinforcement-learning comparison (issue 22 item 3) from ``training.rl_popgym`` runs: one table per environment
and one plot of the seeds' learning curves per environment.

    python -m training.rl_table docs/results/rl_popgym --output docs/results/rl_popgym/table.md \
        --plot docs/figures/rl_popgym_{env}.png

Every ``curve.json`` under the folder is one run (its ``args`` name the core, the environment, the seed and the
learner). Runs of the same environment, core and learner (an LSTM matched to another core's size is its own row:
"LSTM (322 units, for recurrent_delta_net)"; another learner than PPO too: "Recurrent Delta Net, IMPALA") are seeds
of one row: the row gives the mean and the standard deviation over seeds of
the final return (the mean episodic return of the last ``--final_fraction`` of each run's frames) and of the mean
return over the whole run (the area under the learning curve, divided by its length), with the core's parameters and
frames/s. The plot draws each row's mean curve over seeds, with the seeds' range shaded.
"""
from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from .result_file import mean_and_spread

CORE_NAMES = {"lstm": "LSTM", "recurrent_delta_net": "Recurrent Delta Net", "delta_lstm": "Delta LSTM",
              "delta_net": "Delta Net", "delta_rnn": "Delta RNN"}


@dataclass
class Row:
    """The seeds of one (environment, core) pair."""

    env: str
    label: str
    core_parameters: int
    runs: List[Dict] = field(default_factory=list)

    def seeds(self) -> List[int]:
        return sorted(run["args"]["seed"] for run in self.runs)


def describe(run: Dict) -> Tuple[str, str, int]:
    """(environment, row label, the core's parameter count) of one ``rl_popgym`` result; runs of another learner than
    PPO (``--algorithm``, absent from runs before it existed) are their own rows: "Recurrent Delta Net, IMPALA"."""
    args, counts = run["args"], run["parameters"]
    core = args["core"]
    learner = "" if args.get("algorithm", "ppo") == "ppo" else f", {args['algorithm'].upper()}"
    if core != "lstm":
        return args["env"], CORE_NAMES.get(core, core) + learner, counts[core]
    units = counts["lstm_hidden_size"]
    matched = f", for {args['match_core']}" if args.get("match_core") and not args.get("lstm_hidden_size") else ""
    return args["env"], f"LSTM ({units} units{matched}){learner}", counts["lstm"]


def final_return(run: Dict, final_fraction: float) -> float:
    """The mean episodic return over the last `final_fraction` of the run's frames (at least its last point)."""
    curve = run["curve"]
    if not curve:
        raise ValueError(f"run of {run['args']['core']} seed {run['args']['seed']} has an empty curve")
    start = run["frames"] * (1 - final_fraction)
    tail = [point["mean_return"] for point in curve if point["frames"] > start] or [curve[-1]["mean_return"]]
    return sum(tail) / len(tail)


def mean_return(run: Dict) -> float:
    """The mean of the learning curve's points (each batch in which episodes ended weighs the same)."""
    return sum(point["mean_return"] for point in run["curve"]) / len(run["curve"])


def frames_to_return(run: Dict, threshold: float, window: int = 10) -> Optional[int]:
    """The frames at the first curve point where the mean of the last `window` points (the batches in which episodes
    ended) reaches `threshold`; None if it never does."""
    returns = [point["mean_return"] for point in run["curve"]]
    for i in range(window - 1, len(returns)):
        if statistics.mean(returns[i - window + 1:i + 1]) >= threshold:
            return run["curve"][i]["frames"]
    return None


def load(folder: str | Path) -> List[Row]:
    """Every ``curve.json`` under `folder`, grouped into rows (environment, then label order)."""
    rows: Dict[Tuple[str, str], Row] = {}
    for path in sorted(Path(folder).rglob("curve.json")):
        run = json.loads(path.read_text())
        if not isinstance(run, dict) or "curve" not in run or "args" not in run:
            continue
        env, label, count = describe(run)
        row = rows.setdefault((env, label), Row(env, label, count))
        if run["args"]["seed"] in row.seeds():
            raise ValueError(f"{path}: a second run of {label} on {env} with seed {run['args']['seed']}")
        row.runs.append(run)
    if not rows:
        raise ValueError(f"no rl_popgym curve.json under {folder}")
    return [rows[key] for key in sorted(rows)]


def render(rows: Sequence[Row], final_fraction: float = 0.1, learned_return: Optional[float] = None) -> str:
    """A markdown table per environment: one row per core, statistics over its seeds; with `learned_return`, a column
    of each seed's frames until the return reached it (:func:`frames_to_return`; "-": never)."""
    lines: List[str] = []
    learned = "" if learned_return is None else f" frames to a return of {learned_return:+.2f} (per seed) |"
    for env in sorted({row.env for row in rows}):
        lines += [f"**{env}**", "",
                  f"| core | parameters (core) | seeds | frames per run | final return (last {final_fraction:.0%}) | "
                  f"mean return over the run |{learned} frames/s |", "|---" * (7 + bool(learned)) + "|"]
        for row in (r for r in rows if r.env == env):
            frames = sorted({run["frames"] for run in row.runs})
            rate = statistics.mean(run["frames_per_s"] for run in row.runs)
            reached = "" if learned_return is None else " " + ", ".join(
                "-" if f is None else f"{f:,}"
                for f in (frames_to_return(run, learned_return) for run in row.runs)) + " |"
            lines.append(
                f"| {row.label} | {row.core_parameters:,} | {', '.join(map(str, row.seeds()))} | "
                f"{', '.join(f'{f:,}' for f in frames)} | "
                f"{mean_and_spread([final_return(run, final_fraction) for run in row.runs], 3, signed=True)} | "
                f"{mean_and_spread([mean_return(run) for run in row.runs], 3, signed=True)} |{reached} {rate:.1f} |")
        lines.append("")
    return "\n".join(lines)


def plot(rows: Sequence[Row], pattern: str) -> List[Path]:
    """One PNG per environment (`pattern` with ``{env}``): each row's mean curve over seeds on the frames all its
    seeds share, the seeds' range shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for env in sorted({row.env for row in rows}):
        fig, ax = plt.subplots(figsize=(6, 4))
        for row in (r for r in rows if r.env == env):
            curves = [{p["frames"]: p["mean_return"] for p in run["curve"]} for run in row.runs]
            frames = sorted(set.intersection(*(set(c) for c in curves)))
            values = [[c[f] for c in curves] for f in frames]
            (line,) = ax.plot(frames, [statistics.mean(v) for v in values], label=f"{row.label} ({len(curves)} seeds)")
            if len(curves) > 1:
                ax.fill_between(frames, [min(v) for v in values], [max(v) for v in values], alpha=0.2,
                                color=line.get_color())
        ax.set_xlabel("frames")
        ax.set_ylabel("mean episodic return")
        learners = sorted({run["args"].get("algorithm", "ppo").upper() for r in rows if r.env == env for run in r.runs})
        ax.set_title(f"POPGym {env}: {' and '.join(learners)}, recurrent cores")
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = Path(pattern.format(env=env))
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths


def main(argv: Optional[List[str]] = None) -> str:
    """Renders the tables (and plots) of a folder of ``rl_popgym`` runs; prints them, writes ``--output``."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", help="a folder with rl_popgym output folders (curve.json) below it")
    parser.add_argument("--output", help="write the markdown tables here too")
    parser.add_argument("--plot", help="PNG path per environment, with {env} in it")
    parser.add_argument("--final_fraction", type=float, default=0.1, help="the share of frames the final return "
                        "averages over (0 < f <= 1)")
    parser.add_argument("--learned_return", type=float, help="add a column: the frames until the mean return of 10 "
                        "consecutive points reached this (e.g. -0.4 on RepeatPreviousEasy, whose uniform policy gets "
                        "-0.5)")
    args = parser.parse_args(argv)
    if not 0 < args.final_fraction <= 1:
        raise ValueError(f"--final_fraction must be in (0, 1], got {args.final_fraction}")
    if args.plot and "{env}" not in args.plot:
        raise ValueError(f"--plot must contain {{env}} (one figure per environment), got {args.plot!r}")
    rows = load(args.folder)
    table = render(rows, args.final_fraction, args.learned_return)
    print(table)
    if args.output:
        Path(args.output).write_text(table)
    if args.plot:
        for path in plot(rows, args.plot):
            print(f"figure: {path}")
    return table


if __name__ == "__main__":
    main()
