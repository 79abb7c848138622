"""Figures of the synthetic experiments (matplotlib is optional: ``pip install modeling_fwp[experiments]``).

Every function returns the written path, or None when matplotlib is not installed.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Dict, List, Optional

logger = logging.getLogger("training.plots")


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        logger.warning("matplotlib is not installed: no plot (pip install matplotlib)")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_capacity(rows: List[Dict[str, Any]], path: Path) -> Optional[Path]:
    """Final held-out loss against the number of unique keys S, one line per memory (Schlag et al. 2021, Fig. 2).

    Args:
        rows: results of ``training.associative_retrieval.train_memory`` (keys ``memory``, ``num_keys``,
            ``final_loss``, ``feature_dim``).
        path: the PNG to write.
    """
    plt = _pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for memory in dict.fromkeys(r["memory"] for r in rows):
        points = sorted((r["num_keys"], r["final_loss"]) for r in rows if r["memory"] == memory)
        dims = {r["feature_dim"] for r in rows if r["memory"] == memory}
        label = memory + (f" (d_dot={dims.pop()})" if len(dims) == 1 and 0 not in dims else "")
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", markersize=3, label=label)
    sizes = sorted({r["num_keys"] for r in rows})
    ax.plot(sizes, [0.5 * (1 - 1 / s) for s in sizes], "k--", linewidth=0.8, label="chance: 0.5 (1 - 1/S)")
    ax.set_xlabel("number of unique keys S")
    ax.set_ylabel("final held-out loss")
    ax.set_title(f"Capacity (setting 1), d_key = {rows[0]['d_key']}" if rows else "Capacity (setting 1)")
    return _save(plt, fig, ax, path)


def _save(plt: Any, fig: Any, ax: Any, path: Path) -> Path:
    """Legend (beside the axes when it has more than 6 entries), layout, write `path` (creating its folder), close
    the figure."""
    if len(ax.get_lines()) > 6:
        fig.set_figwidth(fig.get_figwidth() + 4)
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    else:
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_learning_curves(rows: List[Dict[str, Any]], path: Path) -> Optional[Path]:
    """Held-out loss against training steps, one line per memory (Schlag et al. 2021, Fig. 3).

    Args:
        rows: results of ``training.associative_retrieval.train_memory`` (keys ``memory``, ``curve``).
        path: the PNG to write.
    """
    plt = _pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for row in rows:
        steps = [c["step"] for c in row["curve"]]
        ax.plot(steps, [c["loss"] for c in row["curve"]], label=f"{row['memory']} (S={row['num_keys']})")
    ax.set_yscale("log")
    ax.set_xlabel("training step")
    ax.set_ylabel("held-out loss")
    ax.set_title("Update rules (setting 2)")
    return _save(plt, fig, ax, path)


def plot_final_loss(rows: List[Dict[str, Any]], x_key: str, path: Path) -> Optional[Path]:
    """Final held-out loss against the swept setting `x_key`, one line per model (``training.synthetic`` rows:
    keys ``model``, `x_key`, ``test_loss``)."""
    plt = _pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for model in dict.fromkeys(r["model"] for r in rows):
        points = sorted((r[x_key], r["test_loss"]) for r in rows if r["model"] == model)
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=model)
    ax.set_xlabel(x_key)
    ax.set_ylabel("final loss (held-out answers)")
    return _save(plt, fig, ax, path)


def run_labels(rows: List[Dict[str, Any]], x_key: str) -> List[str]:
    """One legend label per run: ``model (x_key=value)``, plus the seed and the step count where the runs differ."""
    varying = [key for key in ("seed", "steps") if len({row.get(key) for row in rows}) > 1]
    return [f"{row['model']} (" + ", ".join([f"{x_key}={row[x_key]}"] + [f"{key} {row.get(key)}" for key in varying])
            + ")" for row in rows]


def plot_training_loss(rows: List[Dict[str, Any]], x_key: str, path: Path, title: str) -> Optional[Path]:
    """Training loss on the answers against steps, one line per model and setting (``training.synthetic`` rows:
    keys ``model``, `x_key`, ``loss_curve``; ``seed`` and ``steps`` join the labels when the runs differ in them)."""
    plt = _pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for row, label in zip(rows, run_labels(rows, x_key)):
        curve = row["loss_curve"]
        ax.plot([c["step"] for c in curve], [c["loss"] for c in curve], label=label)
    ax.set_xlabel("training step")
    ax.set_ylabel("training loss (answers)")
    ax.set_title(title)
    return _save(plt, fig, ax, path)


def main(argv: Optional[List[str]] = None) -> Path:
    """Training-loss curves of several ``training.synthetic`` runs in one figure:

        python -m training.plots --x_key num_statements --title "code execution" --output docs/figures/code.png \\
            outputs/synthetic_code/*/code.json
    """
    import argparse
    import json

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("results", nargs="+", help="JSON files written by training.synthetic")
    p.add_argument("--x_key", required=True, help="the setting that labels each curve (e.g. num_statements, depth)")
    p.add_argument("--title", default="")
    p.add_argument("--output", required=True)
    args = p.parse_args(argv)
    rows = []
    for name in args.results:
        run = json.loads(Path(name).read_text())
        rows += [{"seed": run.get("args", {}).get("seed"), **row} for row in run["results"]]
    missing = [row["model"] for row in rows if args.x_key not in row]
    if missing:
        p.error(f"--x_key {args.x_key!r} is not a setting of the runs of {missing}")
    path = plot_training_loss(rows, args.x_key, Path(args.output), args.title)
    if path is None:
        p.error("matplotlib is not installed")
    return path


if __name__ == "__main__":
    print(main())


def plot_nll_change(changes: Dict[str, Dict[str, Dict[str, float]]], path: Path, title: str) -> Optional[Path]:
    """Clark et al. 2022 Fig. 2: the change of mean per-token NLL against the base model (negative = better) by
    position in the document, by prior occurrences of the target in the document and by its training-split
    frequency, one line per method.

    Args:
        changes: ``training.document_eval.nll_change_by_bucket``'s ``{method: {panel: {bucket: change}}}``.
        path: the PNG to write.
    """
    plt = _pyplot()
    if plt is None or not changes:
        return None
    panels = {"by_position": "position in document", "by_prior_occurrences": "earlier occurrences in document",
              "by_train_frequency": "occurrences in training split"}
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6), sharey=True)
    for ax, (panel, xlabel) in zip(axes, panels.items()):
        for method, by_panel in changes.items():
            buckets = list(by_panel[panel])
            ax.plot(range(len(buckets)), [by_panel[panel][b] for b in buckets], marker="o", markersize=3, label=method)
            ax.set_xticks(range(len(buckets)), buckets, rotation=30, fontsize=7)
        ax.axhline(0.0, color="k", linewidth=0.6)
        ax.set_xlabel(xlabel)
    axes[0].set_ylabel("NLL change vs base (nats)")
    fig.suptitle(title, fontsize=9)
    return _save(plt, fig, axes[-1], path)
