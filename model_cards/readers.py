"""Readers for the JSON files the training and evaluation scripts write, normalised to the card's results layout.

The card layout (``model_cards.generator`` docstring) is what ``training/demo.py`` writes. The other scripts keep
their own layouts; each reader here turns one into the card layout, copying numbers, never computing new ones:

===================================== ==========================================================================
file                                  recognised by
===================================== ==========================================================================
``training/demo.py`` results.json     an ``evaluation`` key (the card layout itself)
``training/finetune_fwl.py``          ``base``, ``base_finetuned``, ``base_fwl`` stage metrics
results.json
``training/eval_lm.py --output``      ``args`` and a list of ``results`` rows (one per model and mode)
``training/train_transfo_xl.py``      a flat log with ``steps``, ``seconds``, ``final_train_loss``
train_log.json                        (training only: no evaluation)
===================================== ==========================================================================

Several files (a training log and an evaluation) merge into one: evaluation entries are concatenated, the other
sections come from the first file that has them.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union

ResultsSource = Union[str, os.PathLike, Mapping[str, Any]]
SECTIONS = ("model", "data", "training", "args", "environment", "base_model")


def _read(source: ResultsSource) -> Dict[str, Any]:
    if isinstance(source, Mapping):
        return dict(source)
    path = Path(source)
    if not path.is_file():
        raise FileNotFoundError(f"`results` must be a results JSON file or a dict, got the missing path {path}")
    loaded = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(loaded, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(loaded).__name__}")
    return loaded


def _scalars(mapping: Mapping[str, Any]) -> Dict[str, Any]:
    return {k: v for k, v in mapping.items() if isinstance(v, (str, int, float, bool)) and v is not None}


def from_finetune_fwl(raw: Mapping[str, Any]) -> Dict[str, Any]:
    """``training/finetune_fwl.py``: stage metrics (``nll``, ``ppl``, ``tokens`` and their ``_first`` /
    ``_repeated`` subsets) of the base model, the base fine-tuned without FWL, and base + FWL (this model)."""
    settings = raw.get("settings") or {}
    fwl, base, finetuned = raw["base_fwl"], raw["base"], raw["base_finetuned"]
    dataset = settings.get("dataset_name") or settings.get("dataset")  # transformers' option name, or ours before
    # The files as the run used them: training data in the card's data table, the validation file as the evaluation's.
    data: Dict[str, Any] = {k: settings[k] for k in ("train_file", "validation_file") if settings.get(k)}
    if dataset:
        config = settings.get("dataset_config_name") or settings.get("dataset_config")
        data = {"dataset": {"type": dataset, "name": dataset, "config": config}}
    subsets = {"_first": "first-occurrence tokens", "_repeated": "repeated tokens"}
    entry = {
        "name": "base + FWL, fine-tuned",
        "split": "validation",
        "source": None if dataset else settings.get("validation_file"),
        "loss": fwl["nll"],
        "perplexity": fwl["ppl"],
        "scored_tokens": fwl.get("tokens"),
        "segment_tokens": settings.get("block_size"),
        "references": {
            "base model, not fine-tuned: perplexity": base["ppl"],
            "base model fine-tuned without FWL (same steps and data): perplexity": finetuned["ppl"],
            **{f"base fine-tuned without FWL, {label}: perplexity": finetuned[f"ppl{s}"] for s, label in subsets.items()
               if f"ppl{s}" in finetuned},
        },
        "breakdown": {f"{label}: perplexity": fwl[f"ppl{s}"] for s, label in subsets.items() if f"ppl{s}" in fwl},
        "method": (
            "The three models are scored on the same validation blocks, each block read from an empty state; a "
            "target token is repeated when it already occurred earlier in its block (Clark et al. 2022, Fig. 2). "
            "Written by training/finetune_fwl.py."
        ),
    }
    training = {k: settings[k] for k in (
        "max_steps", "per_device_train_batch_size", "gradient_accumulation_steps", "learning_rate",
        "fwl_learning_rate", "warmup_steps", "weight_decay", "block_size", "freeze_base", "seed",
    ) if k in settings}
    # No base_model from the settings: the base's path there names a folder of the machine the run was on. The Hub id
    # is recorded in the model's config when the base is loaded (FWLConfig.base_model_id), or a run records it here.
    return {
        "evaluation": [entry], "data": data, "training": training, "args": _scalars(settings),
        "base_model": raw.get("base_model"),
    }


def _select_rows(rows: Sequence[Mapping[str, Any]],
                 model_dir: Optional[Union[str, os.PathLike]]) -> List[Mapping[str, Any]]:
    models = list(dict.fromkeys(str(r["model"]) for r in rows))
    if len(models) == 1:
        return list(rows)
    if model_dir is not None:
        wanted = Path(model_dir).resolve()
        for match in (lambda m: Path(m).resolve() == wanted, lambda m: Path(m).name == wanted.name):
            chosen = [m for m in models if match(m)]
            if len(chosen) == 1:
                return [r for r in rows if str(r["model"]) == chosen[0]]
    raise ValueError(
        f"the eval_lm results cover {len(models)} models {models}: choose one with `results_model` "
        "(CLI --results-model) or evaluate the model alone"
    )


def from_eval_lm(
    raw: Mapping[str, Any], model_dir: Optional[Union[str, os.PathLike]] = None
) -> Dict[str, Any]:
    """``training/eval_lm.py``: one row per model and mode ("static", or dynamic evaluation). The static row is
    this model's result; dynamic-evaluation rows are shown next to it."""
    args = raw.get("args") or {}
    rows = _select_rows(raw["results"], model_dir)
    static = [r for r in rows if r.get("mode") == "static"]
    if len(static) != 1:
        raise ValueError(f"expected one static eval_lm row for the model, got {len(static)}")
    row = static[0]
    protocol = (
        "each document read from an empty state" if args.get("per_document") else
        "the split read as one token stream (every document followed by the end-of-text token), each segment "
        "continuing from the previous segment's state (memories, fast weights, FWL running update)"
    )
    entry = {
        "split": args.get("split"),
        "loss": row["loss"],
        "perplexity": row["perplexity"],
        "scored_tokens": row.get("tokens"),
        "segment_tokens": args.get("block_size", args.get("segment_length")),  # segment_length: before the rename
        "source": f"{args['data_dir']}/{args['split']}.txt" if args.get("data_dir") and args.get("split") else None,
        "breakdown": {f"{r['mode']}: perplexity": r["perplexity"] for r in rows if r is not row},
        "method": f"Protocol of Dai et al. (2019) and Clark et al. (2022): batch 1, {protocol}; every token but the "
                  "first is scored once. Written by training/eval_lm.py.",
    }
    return {"evaluation": [entry], "args": _scalars(args)}  # the evaluated file is the entry's: no training data here


def from_train_log(raw: Mapping[str, Any]) -> Dict[str, Any]:
    """``training/train_transfo_xl.py`` train_log.json: training only (no evaluation numbers)."""
    scalars = _scalars(raw)
    model = {"parameters": scalars.pop("parameters")} if "parameters" in scalars else {}
    return {"training": scalars, "model": model}


def normalise(raw: Mapping[str, Any], model_dir: Optional[Union[str, os.PathLike]] = None) -> Dict[str, Any]:
    """One results dict in the card layout, whichever script wrote ``raw``."""
    if "evaluation" in raw:
        return dict(raw)
    if {"base", "base_finetuned", "base_fwl"} <= raw.keys():
        return from_finetune_fwl(raw)
    if isinstance(raw.get("results"), list) and "args" in raw:
        return from_eval_lm(raw, model_dir)
    if {"steps", "seconds", "final_train_loss"} <= raw.keys():
        return from_train_log(raw)
    raise ValueError(
        f"Unrecognised results layout (top-level keys {sorted(raw)}): expected the card layout (an `evaluation` "
        "key) or the output of training/demo.py, finetune_fwl.py, eval_lm.py or train_transfo_xl.py"
    )


def read_results(
    results: Union[None, ResultsSource, Sequence[ResultsSource]], model_dir: Optional[Union[str, os.PathLike]] = None
) -> Optional[Dict[str, Any]]:
    """Reads one results source (a JSON path or a dict) or several, normalised and merged; None stays None."""
    if results is None:
        return None
    sources = [results] if isinstance(results, (str, os.PathLike, Mapping)) else list(results)
    if not sources:
        return None
    parts = [normalise(_read(source), model_dir) for source in sources]
    merged: Dict[str, Any] = {"evaluation": [e for p in parts for e in _entries(p.get("evaluation"))]}
    for section in SECTIONS:
        found = next((p[section] for p in parts if p.get(section)), None)
        if found is not None:
            merged[section] = found
    if not merged["evaluation"]:
        del merged["evaluation"]
    return merged


def _entries(evaluation: Any) -> List[Mapping[str, Any]]:
    if not evaluation:
        return []
    return [evaluation] if isinstance(evaluation, Mapping) else list(evaluation)
