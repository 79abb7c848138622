"""The translation table (Schlag et al. 2021 Table 1 at this machine's scale) from ``train_seq2seq`` result files.

    python -m training.mt_table docs/results/mt_gettext --output docs/results/mt_gettext/table.md

Each ``<name>.json`` of the folder is one ``train_seq2seq`` run; the rows are ordered as the paper's table (softmax,
Linear, FAVOR+, DPFP by d_dot, then the delta rule), each beside the paper's WMT14 En-De BLEU at the same multiple
of d_key (the paper's d_key is 64; d_dot 64 / 256 / 512 there is 1 / 4 / 8 d_key).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

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


def render(results: Sequence[Dict]) -> str:
    """A markdown table: one row per run, ours beside the paper's."""
    order = list(ROW_NAMES.values())

    def key(result):
        name, d_dot, _ = describe(result)
        return ("delta" in name, order.index(name.split(" +")[0]) if name.split(" +")[0] in order else 9, d_dot)

    lines = ["| model | d_dot (d_dot / d_key) | parameters | final training loss | valid BLEU | test BLEU | "
             "valid chrF | test chrF | test exact match | training min | paper valid / test BLEU |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for result in sorted(results, key=key):
        name, d_dot, multiple = describe(result)
        paper = PAPER_BLEU.get((name, multiple))
        curve = result.get("loss_curve") or [result["train_loss"]]
        dimension = "-" if not d_dot else f"{d_dot} ({multiple})"
        lines.append(
            f"| {name} | {dimension} | {result['parameters']:,} | {curve[-1]:.3f} | "
            f"{result['valid']['bleu']:.1f} | {result['test']['bleu']:.1f} | {result['valid']['chrf']:.1f} | "
            f"{result['test']['chrf']:.1f} | {result['test']['exact_match']:.3f} | "
            f"{(result.get('train_seconds') or 0) / 60:.1f} | {'-' if paper is None else f'{paper[0]} / {paper[1]}'} |")
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
