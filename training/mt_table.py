"""The translation table (Schlag et al. 2021 Table 1 at this machine's scale) from ``train_seq2seq`` result files.

    python -m training.mt_table docs/results/mt_gettext --output docs/results/mt_gettext/table.md

Each ``<name>.json`` of the folder is one ``train_seq2seq`` run; runs of one configuration with different seeds
(``<name>_seed<S>.json``) make one row, their mean ± standard deviation. The rows are ordered as the paper's table
(softmax, Linear, FAVOR+, DPFP by d_dot, then the delta rule), each beside the paper's WMT14 En-De BLEU at the same
multiple of d_key (the paper's d_key is 64; d_dot 64 / 256 / 512 there is 1 / 4 / 8 d_key).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from .result_file import mean_and_spread

# Schlag et al. 2021 Table 1 (WMT14 En-De BLEU, valid / test), keyed by (row, d_dot / d_key)
PAPER_BLEU: Dict[Tuple[str, int], Tuple[float, float]] = {
    ("Standard", 0): (26.6, 27.7), ("Linear", 1): (25.5, 26.8),
    ("Performer", 1): (24.2, 24.4), ("Performer", 4): (24.9, 25.3), ("Performer", 8): (26.7, 27.7),
    ("DPFP", 4): (26.2, 26.9), ("DPFP", 8): (26.2, 27.1),
}
ROW_NAMES = {"softmax": "Standard", "elu": "Linear", "favor": "Performer", "dpfp": "DPFP"}


def describe(result: Dict) -> Tuple[str, int, int]:
    """(the paper's row name, our d_dot, d_dot / d_key) of one run (d_dot 0 for the softmax baseline)."""
    model = result["args"]["model"]
    if model["model"] == "softmax":
        return "Standard", 0, 0
    head_dim = model["hidden_size"] // model["num_attention_heads"]
    d_dot = model["d_dot"] or {"elu": head_dim, "dpfp": 2 * head_dim, "favor": 128}[model["feature_map"]]
    name = ROW_NAMES.get(model["feature_map"], model["feature_map"])
    if model["update_rule"] == "delta":
        name += " + delta rule"
    return name, d_dot, d_dot // head_dim


def seed_of(result: Dict) -> int:
    """The training seed of one run (0 where the file does not record it)."""
    return result["args"].get("training", {}).get("seed", 0)


def group_seeds(results: Sequence[Dict]) -> List[List[Dict]]:
    """The runs grouped by configuration (:func:`describe`), in the paper's row order; a ``ValueError`` where two
    runs of one row differ in anything but the seed (model, task or training arguments, corpus) or share a seed."""
    order = list(ROW_NAMES.values())

    def key(row):
        name, d_dot, _ = row
        base = name.split(" +")[0]
        return "delta" in name, order.index(base) if base in order else len(order), d_dot

    groups: Dict[Tuple[str, int, int], List[Dict]] = {}
    for result in results:
        groups.setdefault(describe(result), []).append(result)
    for row, runs in groups.items():
        settings = [({**r["args"], "training": {k: v for k, v in r["args"].get("training", {}).items() if k != "seed"}},
                     (r.get("corpus") or {}).get("sha256")) for r in runs]
        if any(s != settings[0] for s in settings[1:]):
            raise ValueError(f"the runs of row {row[0]} (d_dot {row[1]}) differ in more than the seed: "
                             "their arguments or corpus must match")
        seeds = [seed_of(r) for r in runs]
        if len(set(seeds)) != len(seeds):
            raise ValueError(f"row {row[0]} (d_dot {row[1]}) has two runs of one seed: {sorted(seeds)}")
    return [sorted(groups[row], key=seed_of) for row in sorted(groups, key=key)]


def render(results: Sequence[Dict]) -> str:
    """A markdown table: one row per configuration (mean ± standard deviation over its seeds), ours beside the
    paper's."""
    lines = ["| model | d_dot (d_dot / d_key) | seeds | parameters | final training loss | valid BLEU | test BLEU | "
             "valid chrF | test chrF | test exact match | training min | paper valid / test BLEU |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for runs in group_seeds(results):
        name, d_dot, multiple = describe(runs[0])
        paper = PAPER_BLEU.get((name, multiple))
        final_loss = [(r.get("loss_curve") or [r["train_loss"]])[-1] for r in runs]
        scores = [mean_and_spread([r[split][metric] for r in runs], digits)
                  for metric, digits in (("bleu", 1), ("chrf", 1)) for split in ("valid", "test")]
        dimension = "-" if not d_dot else f"{d_dot} ({multiple})"
        lines.append(
            f"| {name} | {dimension} | {', '.join(str(seed_of(r)) for r in runs)} | {runs[0]['parameters']:,} | "
            f"{mean_and_spread(final_loss, 3)} | {' | '.join(scores)} | "
            f"{mean_and_spread([r['test']['exact_match'] for r in runs], 3)} | "
            f"{mean_and_spread([(r.get('train_seconds') or 0) / 60 for r in runs])} | "
            f"{'-' if paper is None else f'{paper[0]} / {paper[1]}'} |")
    return "\n".join(lines) + "\n"


def load(folder: str | Path) -> List[Dict]:
    """Every ``train_seq2seq`` result file (``*.json`` with a ``valid`` score) of `folder`."""
    results = []
    for path in sorted(Path(folder).glob("*.json")):
        result = json.loads(path.read_text())
        if isinstance(result, dict) and "valid" in result and "args" in result:
            results.append(result)
    if not results:
        raise ValueError(f"no train_seq2seq result file (*.json) in {folder}")
    return results


def main(argv: Optional[List[str]] = None) -> str:
    """Renders the table of a folder of result files; prints it and writes it to ``--output`` if given."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", help="a folder of train_seq2seq results.json copies")
    parser.add_argument("--output", help="write the markdown table here too")
    args = parser.parse_args(argv)
    table = render(load(args.folder))
    if args.output:
        Path(args.output).write_text(table)
    print(table, end="")
    return table


if __name__ == "__main__":
    main()
