"""The language-modelling comparison of Irie et al. 2021, Table 1 ("small" setting), at this machine's scale.

Every fast-weight family of ``modeling_fwp.families`` (Linear Transformer, Delta Net, Delta MLP, Delta-Delta Net,
Delta RNN, Delta LSTM, Recurrent Delta Net; Gated DeltaNet on request) and transformers' Llama of the same size (the
softmax baseline) are trained by ``training.train_lm`` (its ``train_model``: same code path, same options) on the
same text (by default the offline Wikipedia corpus of ``training.data``, prepared into ``--data_dir`` when missing),
with one shared tokenizer and the same token budget, for every seed of ``--seeds``. Each run is evaluated on the
valid and test splits with

- sliding windows (the papers' protocol for the 256-token rows: ``training.eval_lm.score_split_sliding_window``,
  window ``--window_size`` = the training span by default, ``--stride``; the papers use stride 1), and
- the state carried through the whole split (the papers' "+ full context" protocol, batch 1,
  ``training.eval_lm.score_split``; not for the softmax baseline, whose cache grows with the text),

and written to ``<results_dir>/results/<family>_seed<seed>.json`` (``training.result_file.RunRecord``: command,
versions, machine, commit, load; parameter count, training tokens/s, perplexities), or into ``--results_files_dir``:
a committed folder lets a fresh clone continue the table (its shared tokenizer is trained again, identically, from
the same prepared corpus). A (family, seed) whose file exists is skipped, and a run with Trainer checkpoints under
``<results_dir>/runs/<family>_seed<seed>/checkpoints`` resumes from the newest one, so the same command continues an
interrupted table. After every run the markdown table (mean over seeds, the paper's numbers beside ours, the command)
is rendered into ``--table_file``.

    python -m training.lm_table --seeds 0 1 2 --threads 2          # or: fwp-lm-table ...
    python -m training.lm_table --quick --results_dir /tmp/lm_table --table_file /tmp/lm_table.md   # a smoke run

``--carry_state`` trains with the state carried across segments (``train_lm --carry_state``: the "+ full context"
rows of Irie et al. 2021, Table 1 and appendix A.1); such runs are kept apart (``<family>_full_context_seed<seed>``)
and get their own rows, beside the paper's "+ full context" numbers. The softmax baseline has no fixed-size state to
carry.

``--quick``: tiny models (2 layers, d 32), a few steps, two families (Delta Net, Llama), one seed, short
evaluation; every other default is the paper's small setting (16 layers, d 128, 8 heads, feed-forward 2048, span
256). ``--train_lm_args`` passes further options to ``training.train_lm`` (e.g. ``"--save_steps 200"``).
"""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import json  # noqa: E402
import logging  # noqa: E402
import math  # noqa: E402
import shlex  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Dict, List, Optional, Sequence, Tuple  # noqa: E402

import datasets  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from modeling_fwp.families import FAMILIES  # noqa: E402

from . import train_lm  # noqa: E402
from .arguments import ParsedArguments, parse_arguments, require_positive  # noqa: E402
from .eval_lm import score_split, score_split_sliding_window  # noqa: E402
from .result_file import RunRecord, mean_and_spread  # noqa: E402

logger = logging.getLogger("training.lm_table")

SOFTMAX_BASELINE = "llama"
# every fast-weight family of the table, by its short name (FamilySpec.name), in the paper's order
FAST_WEIGHT_FAMILIES = {spec.name: spec for spec in FAMILIES if spec.fast_weight_layer is not None}
TABLE_1_FAMILIES = ("linear_transformer", "delta_net", "delta_mlp", "delta_delta_net", "delta_rnn", "delta_lstm",
                    "recurrent_delta_net")
KNOWN_FAMILIES = (SOFTMAX_BASELINE, *TABLE_1_FAMILIES,
                  *(f for f in FAST_WEIGHT_FAMILIES if f not in TABLE_1_FAMILIES))  # the table's row order
# Irie et al. 2021, Table 1 (WikiText-103, small setting): valid / test perplexity, parameters (M); 256-token spans,
# sliding-window evaluation; and the "+ full context" rows (trained and evaluated with the state carried).
PAPER_TABLE_1 = {
    "llama": (33.0, 34.1, 44.0), "linear_transformer": (37.1, 38.3, 44.0), "delta_net": (34.1, 35.2, 44.0),
    "delta_mlp": (35.8, 36.8, 44.3), "delta_delta_net": (34.0, 35.2, 44.6), "delta_rnn": (33.8, 35.0, 44.6),
    "delta_lstm": (32.6, 33.8, 47.3), "recurrent_delta_net": (34.1, 35.2, 44.1),
}
PAPER_FULL_CONTEXT = {"delta_rnn": (31.8, 32.8), "recurrent_delta_net": (32.5, 33.6)}
FULL_CONTEXT_SUFFIX = "_full_context"  # runs trained with the state carried (--carry_state)
SPLITS = ("valid", "test")
PROTOCOLS = ("sliding_window", "carried_state")

# --quick: parser defaults replaced (explicit options still win)
QUICK_DEFAULTS = dict(
    families=["delta_net", SOFTMAX_BASELINE], seeds=[0], num_hidden_layers=2, hidden_size=32,
    num_attention_heads=2, intermediate_size=64, block_size=32, train_tokens=3 * 2 * 32,
    per_device_train_batch_size=2, vocab_size=300, stride=8, max_eval_tokens=400, warmup_steps=1,
)


@dataclass
class LMTableArguments:
    """The families, the sizes (the paper's small setting), the budget, the evaluation and where results go."""

    families: List[str] = field(default_factory=lambda: [SOFTMAX_BASELINE, *TABLE_1_FAMILIES], metadata={
        "help": f"short names among {list(KNOWN_FAMILIES)} ({SOFTMAX_BASELINE}: the softmax baseline)"})
    seeds: List[int] = field(default_factory=lambda: [0, 1, 2], metadata={"help": "a run per family and seed"})
    data_dir: str = field(default="data/wiki", metadata={"help": "prepared corpus (train/valid/test.txt)"})
    results_dir: str = field(default="outputs/lm_table", metadata={
        "help": "results/<family>_seed<seed>.json, runs/ (models, checkpoints), the shared tokenizer"})
    table_file: str = field(default="docs/results/lm_table.md", metadata={"help": "the markdown table"})
    results_files_dir: Optional[str] = field(default=None, metadata={
        "help": "where each run's results file goes (its existence marks the run done) and the table reads them; "
                "unset: <results_dir>/results. A committed folder (docs/results/lm_table) lets a fresh clone continue "
                "the table"})
    num_hidden_layers: int = field(default=16, metadata={"help": "layers (the paper's small setting: 16)"})
    hidden_size: int = field(default=128, metadata={"help": "model dimension (paper: 128)"})
    num_attention_heads: int = field(default=8, metadata={"help": "heads (paper: 8)"})
    intermediate_size: int = field(default=2048, metadata={
        "help": "feed-forward dimension (paper: 2048); Llama's gated MLP gets 2/3 of it (same parameters)"})
    block_size: int = field(default=256, metadata={"help": "training span in tokens (paper: 256)"})
    train_tokens: int = field(default=2_000_000, metadata={
        "help": "training tokens per run (the budget; steps = ceil(tokens / (batch * span)))"})
    per_device_train_batch_size: int = field(default=8, metadata={"help": "segments per step"})
    learning_rate: float = field(default=1e-3, metadata={"help": "peak learning rate (cosine schedule)"})
    warmup_steps: int = field(default=100, metadata={"help": "warm-up steps"})
    carry_state: bool = field(default=False, metadata={
        "help": "train with the state carried across segments (the paper's '+ full context' rows)"})
    tokenizer_name: str = field(default="bpe", metadata={"help": "bpe (trained on the train split) or gpt2"})
    vocab_size: int = field(default=8192, metadata={"help": "BPE vocabulary size"})
    window_size: Optional[int] = field(default=None, metadata={
        "help": "sliding-window context (unset: --block_size)"})
    stride: int = field(default=32, metadata={"help": "sliding-window stride (the papers: 1)"})
    max_eval_tokens: Optional[int] = field(default=None, metadata={"help": "score only the first N tokens of a split"})
    per_device_eval_batch_size: int = field(default=8, metadata={"help": "sliding windows per forward"})
    threads: Optional[int] = field(default=None, metadata={"help": "torch threads; unset: torch's"})
    train_lm_args: str = field(default="", metadata={"help": "further training.train_lm options, one string"})
    quick: bool = field(default=False, metadata={"help": "a smoke run: tiny sizes, a few steps, 2 families"})


def parse_args(argv: Optional[Sequence[str]] = None) -> ParsedArguments:
    """The command line (``--help``: every default); ValueError names a bad option."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_arguments((LMTableArguments,), argv, description=__doc__,
                           defaults=QUICK_DEFAULTS if "--quick" in argv else None)
    require_positive(args, ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size",
                            "train_tokens", "per_device_train_batch_size", "learning_rate", "vocab_size",
                            "window_size", "stride", "max_eval_tokens", "per_device_eval_batch_size", "threads"))
    require_positive(args, ("block_size",), minimum={"block_size": 2})
    unknown = [f for f in args.families if f not in KNOWN_FAMILIES]
    if unknown or not args.families:
        raise ValueError(f"--families: {unknown or 'none given'}; choose among {list(KNOWN_FAMILIES)}")
    if args.hidden_size % args.num_attention_heads:
        raise ValueError(f"--hidden_size {args.hidden_size} is not a multiple of --num_attention_heads "
                         f"{args.num_attention_heads}")
    args.window_size = args.window_size or args.block_size
    if args.carry_state and SOFTMAX_BASELINE in args.families:
        raise ValueError(f"--carry_state: the softmax baseline ({SOFTMAX_BASELINE}) has no fixed-size state to carry "
                         "(its key/value cache grows with the text); leave it out of --families")
    if args.stride > args.window_size:
        raise ValueError(f"--stride ({args.stride}) must not exceed --window_size ({args.window_size})")
    return args


def model_type_and_overrides(args: ParsedArguments, family: str) -> Tuple[str, Dict[str, Any]]:
    """``(model_type, config overrides)`` of a family at the chosen size; Llama: tied embeddings as ours, and a
    gated MLP of 2/3 the feed-forward width, which matches our two-matrix feed-forward's parameter count."""
    sizes = dict(hidden_size=args.hidden_size, num_hidden_layers=args.num_hidden_layers,
                 num_attention_heads=args.num_attention_heads, intermediate_size=args.intermediate_size)
    if family == SOFTMAX_BASELINE:
        return "llama", {**sizes, "intermediate_size": 2 * args.intermediate_size // 3,
                         "num_key_value_heads": args.num_attention_heads, "tie_word_embeddings": True}
    return FAST_WEIGHT_FAMILIES[family].model_type, sizes


def train_lm_argv(args: ParsedArguments, family: str, seed: int, tokenizer_dir: Path) -> List[str]:
    """The ``training.train_lm`` command line of one run (resuming from its newest checkpoint when it has one)."""
    run_dir = Path(args.results_dir) / "runs" / run_name(args, family, seed)
    model_type, overrides = model_type_and_overrides(args, family)
    steps = math.ceil(args.train_tokens / (args.per_device_train_batch_size * args.block_size))
    argv = ["--model_type", model_type, "--config_overrides", json.dumps(overrides), "--data_dir", args.data_dir,
            "--tokenizer_name", str(tokenizer_dir), "--block_size", str(args.block_size), "--output_dir",
            str(run_dir), "--seed", str(seed), "--max_steps", str(steps), "--per_device_train_batch_size",
            str(args.per_device_train_batch_size), "--learning_rate", str(args.learning_rate),
            "--warmup_steps", str(args.warmup_steps), "--report_to", "none"]
    if args.carry_state:
        argv.append("--carry_state")
    if any((run_dir / "checkpoints").glob("checkpoint-*")):
        argv += ["--resume_from_checkpoint", "latest"]
    return argv + shlex.split(args.train_lm_args)


def shared_tokenizer(args: ParsedArguments) -> Path:
    """Trains (once) the tokenizer every run uses, with ``train_lm.build_tokenizer``; returns its folder."""
    folder = Path(args.results_dir) / "shared"
    options = train_lm.parse_args(["--output_dir", str(folder), "--data_dir", args.data_dir, "--tokenizer_name",
                                   args.tokenizer_name, "--vocab_size", str(args.vocab_size)])
    if not (folder / "tokenizer" / "tokenizer.json").is_file():
        folder.mkdir(parents=True, exist_ok=True)
        train_lm.build_tokenizer(options, train_lm.load_documents(options)["train"])
    return folder / "tokenizer"


def evaluate_run(args: ParsedArguments, family: str, seed: int, run: train_lm.TrainedModel) -> List[Dict[str, Any]]:
    """Sliding-window and (fast-weight families) carried-state perplexity on the valid and test splits."""
    model, tokenizer = run.model.eval(), run.tokenizer
    entries = []
    for split in SPLITS:
        documents = run.documents[split]
        if not documents:
            continue
        sliding = score_split_sliding_window(model, tokenizer, documents, args.window_size, args.stride,
                                             max_tokens=args.max_eval_tokens,
                                             batch_size=args.per_device_eval_batch_size)
        scores = {"sliding_window": sliding}
        if family != SOFTMAX_BASELINE:
            scores["carried_state"] = score_split(model, tokenizer, documents, args.block_size,
                                                  max_tokens=args.max_eval_tokens)
        for protocol, result in scores.items():
            entries.append({"split": split, "protocol": protocol, "perplexity": result.perplexity,
                            "loss": result.loss, "scored_tokens": result.num_tokens,
                            "tokens_per_second": result.tokens_per_second})
            logger.info("%s seed %d %s %s: perplexity %.2f", family, seed, split, protocol, result.perplexity)
    return entries


def run_one(args: ParsedArguments, family: str, seed: int, tokenizer_dir: Path, argv: Sequence[str]) -> Path:
    """Trains and evaluates one (family, seed) and writes its results file; returns the file."""
    record = RunRecord.start("python -m training.lm_table", argv)
    options = train_lm.parse_args(train_lm_argv(args, family, seed, tokenizer_dir))
    run = train_lm.train_model(options)
    run.trainer.save_model(str(Path(options.output_dir) / "model"))
    run.tokenizer.save_pretrained(Path(options.output_dir) / "model")
    training = {k: v for k, v in run.training.items() if k != "loss_curve"}
    results = {
        "family": family, "seed": seed, "model_type": run.model.config.model_type,
        "parameters": run.parameters, "training": training, "data": run.data,
        "evaluation": evaluate_run(args, family, seed, run),
        "window_size": args.window_size, "stride": args.stride, "args": args.record(),
        "train_lm_args": options.record(), "loss_curve": run.training["loss_curve"],
    }
    return record.write(results_file(args, family, seed), results)


def results_files_dir(args: ParsedArguments) -> Path:
    """The folder of the runs' results files: ``--results_files_dir``, or ``<results_dir>/results``."""
    return Path(args.results_files_dir) if args.results_files_dir else Path(args.results_dir) / "results"


def run_name(args: ParsedArguments, family: str, seed: int) -> str:
    """``<family>_seed<seed>``, or ``<family>_full_context_seed<seed>`` for a run trained with the state carried."""
    return f"{family}{FULL_CONTEXT_SUFFIX if args.carry_state else ''}_seed{seed}"


def results_file(args: ParsedArguments, family: str, seed: int) -> Path:
    """Where the results of one (family, seed) go; its existence marks the run done."""
    return results_files_dir(args) / f"{run_name(args, family, seed)}.json"


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """Runs every missing (family, seed), rendering the table after each; returns ``{"runs", "skipped", "table"}``."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    transformers.utils.logging.disable_progress_bar()
    datasets.disable_progress_bars()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    done: Dict[str, List[Path]] = {"runs": [], "skipped": []}
    tokenizer_dir = shared_tokenizer(args)
    for seed in args.seeds:
        for family in args.families:
            path = results_file(args, family, seed)
            if path.is_file():
                logger.info("%s seed %d: %s exists, skipped", family, seed, path)
                done["skipped"].append(path)
                continue
            done["runs"].append(run_one(args, family, seed, tokenizer_dir, argv))
            write_table(args)
    return {**done, "table": write_table(args)}


# --------------------------------------------------------------------------------------------------
# The table
# --------------------------------------------------------------------------------------------------


def load_results(folder: Path) -> Dict[Tuple[str, bool], List[Dict[str, Any]]]:
    """The results files in `folder` (``results_files_dir``), grouped by (family, trained with the state carried)."""
    grouped: Dict[Tuple[str, bool], List[Dict[str, Any]]] = {}
    for path in sorted(Path(folder).glob("*.json")):
        result = json.loads(path.read_text(encoding="utf-8"))
        full_context = bool(result["training"].get("carry_state", False))
        grouped.setdefault((result["family"], full_context), []).append(result)
    return grouped


def perplexities(runs: List[Dict[str, Any]], split: str, protocol: str) -> List[float]:
    """The perplexities of `runs` (one per seed) on `split` under `protocol` (none for a protocol not run)."""
    return [e["perplexity"] for r in runs for e in r["evaluation"] if (e["split"], e["protocol"]) == (split, protocol)]


def family_title(family: str) -> str:
    """The row's model name: the family's title, "Transformer (Llama)" for the softmax baseline."""
    return "Transformer (Llama)" if family == SOFTMAX_BASELINE else FAST_WEIGHT_FAMILIES[family].facts.title


def table_row(family: str, runs: List[Dict[str, Any]], full_context: bool = False) -> str:
    """One markdown row: ours (mean over seeds) and the paper's Table 1 numbers. A row of runs trained with the
    state carried (`full_context`) is compared with the paper's "+ full context" number only."""
    title = family_title(family) + (" + full context" if full_context else "")
    if not full_context and runs[0]["training"].get("in_order"):
        title += " (data in order, state reset)"  # train_lm --in_order: the ablation of full-context training
    ours = [mean_and_spread(perplexities(runs, s, p)) for p in PROTOCOLS for s in SPLITS]
    paper = None if full_context else PAPER_TABLE_1.get(family)
    full = PAPER_FULL_CONTEXT.get(family)
    cells = [
        title, ", ".join(str(r["seed"]) for r in runs), f"{runs[0]['parameters'] / 1e6:.2f}",
        mean_and_spread([r["training"]["tokens_per_second"] for r in runs], 0), *ours,
        f"{paper[0]} / {paper[1]}" if paper else "-", f"{full[0]} / {full[1]}" if full else "-",
        f"{PAPER_TABLE_1[family][2]}" if family in PAPER_TABLE_1 else "-",
    ]
    return "| " + " | ".join(cells) + " |"


def rank_correlation(ours: Sequence[float], paper: Sequence[float]) -> float:
    """Spearman's rank correlation of two equally long sequences: Pearson's correlation of their ranks, tied values
    given the mean of their ranks (the paper's Table 1 has ties)."""
    import pandas as pd

    if len(ours) != len(paper) or len(ours) < 2:
        raise ValueError(f"need two sequences of the same length >= 2, got {len(ours)} and {len(paper)}")
    return float(pd.Series(list(ours)).rank().corr(pd.Series(list(paper)).rank()))


def relative_to_baseline(grouped: Dict[Tuple[str, bool], List[Dict[str, Any]]]) -> List[str]:
    """Markdown lines: each row's mean sliding-window perplexity relative to the softmax baseline's (the rows trained
    on shuffled independent segments that the paper's Table 1 has), beside the paper's relative to its Transformer,
    and the rank correlation of the rows with the paper's on each split. No lines without the baseline or with fewer
    than three such rows."""
    rows = [f for f in KNOWN_FAMILIES if f in PAPER_TABLE_1 and (f, False) in grouped
            and not grouped[(f, False)][0]["training"].get("in_order")]
    if SOFTMAX_BASELINE not in rows or len(rows) < 3:
        return []
    ours = {f: [statistics.mean(perplexities(grouped[(f, False)], s, "sliding_window")) for s in SPLITS] for f in rows}
    base, paper_base = ours[SOFTMAX_BASELINE], PAPER_TABLE_1[SOFTMAX_BASELINE]

    def percent(value: float, reference: float) -> str:
        return f"{100 * (value / reference - 1):+.1f}%"

    lines = ["Sliding window, each row's mean relative to the softmax baseline's (ours: the Llama; the paper: its "
             "Transformer):", "", "| model | valid, ours | test, ours | valid, paper | test, paper |",
             "|---|---|---|---|---|"]
    for f in sorted(rows, key=lambda f: ours[f][0]):
        lines.append(f"| {family_title(f)} | " + " | ".join([percent(ours[f][i], base[i]) for i in range(2)]
                                                  + [percent(PAPER_TABLE_1[f][i], paper_base[i]) for i in range(2)])
                     + " |")
    correlation = [rank_correlation([ours[f][i] for f in rows], [PAPER_TABLE_1[f][i] for f in rows]) for i in range(2)]
    return lines + ["", f"Spearman rank correlation of these {len(rows)} rows with the paper's: "
                    f"{correlation[0]:.2f} valid, {correlation[1]:.2f} test.", ""]


def carried_state_streams(grouped: Dict[Tuple[str, bool], List[Dict[str, Any]]]) -> str:
    """The number(s) of parallel streams of the runs trained with the state carried, e.g. ``"8"``."""
    streams = sorted({r["training"].get("num_streams", "?") for (_, full), runs in grouped.items() if full
                      for r in runs}, key=str)
    return " or ".join(str(s) for s in streams)


def write_table(args: ParsedArguments) -> Path:
    """Renders the results found in ``results_files_dir`` into ``--table_file``; returns the file."""
    grouped = load_results(results_files_dir(args))
    order = [(f, full) for f in KNOWN_FAMILIES for full in (False, True) if (f, full) in grouped]
    first = grouped[order[0]][0] if order else None
    full_context_note = (" Rows \"+ full context\": trained with the state carried from segment to segment (in "
                         f"{carried_state_streams(grouped)} parallel streams, detached at every boundary, reset every "
                         "epoch)." if any(full for _, full in order) else "")
    lines = [
        "# Language-modelling table (Irie et al. 2021, Table 1, at this machine's scale)", "",
        "Perplexity per token of our tokenizer (mean ± standard deviation over seeds), on the valid / test splits; "
        "the paper's numbers are word-level WikiText-103 perplexities of 40M-parameter models trained for about "
        "120 epochs: compare the ranking, not the values.", "",
        f"Command of the first row's run (each results file records its own): `{first['run']['command']}`"
        if first else "No run yet.", "",
    ]
    if first:
        lines += [f"Data: `{first['data']['source']}` ({first['data']['train_tokens']} training tokens, "
                  f"vocabulary {first['data']['vocab_size']}); {first['training']['tokens_seen']} tokens seen per run "
                  f"(span {first['training']['block_size']}); sliding window {first['window_size']}, stride "
                  f"{first['stride']}; carried state: segments of {first['training']['block_size']}, batch 1."
                  + full_context_note, ""]
    lines += [
        "| model | seeds | params (M) | train tokens/s | valid, sliding | test, sliding | valid, carried | "
        "test, carried | paper valid / test | paper + full context | paper params (M) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *[table_row(f, grouped[(f, full)], full) for f, full in order], "",
        *relative_to_baseline(grouped),
        "Results files: `" + str(results_files_dir(args)) + "/<family>_seed<seed>.json` (trained with the state "
        f"carried: `<family>{FULL_CONTEXT_SUFFIX}_seed<seed>.json`).", "",
    ]
    path = Path(args.table_file)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


if __name__ == "__main__":
    main()
