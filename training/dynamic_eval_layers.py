"""Where dynamic evaluation's gain lives in a pretrained causal LM: dynamic evaluation (Krause et al.; SGD after
every segment, ``training.dynamic_eval``) restricted to groups of parameters, each at the best step size of a grid.

Issue 17's first goal asks a trained FWL to gain at least half of what dynamic evaluation of every parameter gains.
An FWL's fast weights are computed in closed form from per-token gradients, which is cheap only for the layers whose
gradient needs no backpropagation through the network: the output side (final norm, output embedding, output bias:
what ``FWLForCausalLM(fwl_head_type="output")`` and ``training.test_time_fwl`` make fast) and, one step further, the
last block's output projections (their gradient is the final residual's, which the output side already has).
This script measures how much of the whole gain dynamic evaluation itself gets from those groups, against deeper
ones: an upper guide for what an FWL over the same parameters can reach (it makes the same kind of first-order
update, computed from the slow weights).

    python -m training.dynamic_eval_layers --model checkpoints/smollm2-135m --data_dir data/wiki --documents 2 \
        --max_length 2048 --results_file docs/results/dynamic_eval_layers_wiki_valid.json

Groups (``GROUPS``; "last" is the last decoder block of ``model.base_model.layers``): ``output`` (the final norm and an
untied copy of the output embedding, ``document_eval.output_side_parameter_names``), ``last_down`` (the last block's
MLP down projection), ``last_down_o`` (and its attention output projection), ``output_last_block`` (the output side and
the whole last block), ``last_4_blocks`` and ``all``. It scores the *valid* split only (documents scored in segments
of 128 with the cache carried, ``document_eval.score_document``): the step size of each group is chosen on the same
documents, which makes each row that group's best case, not a held-out figure.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch
from torch import nn

from .document_eval import encode_documents, output_side_parameter_names, score_document
from .dynamic_eval import DynamicEvaluation, untie_output_embedding
from .result_file import RunRecord

GROUPS = ("output", "last_down", "last_down_o", "output_last_block", "last_4_blocks", "all")
DEFAULT_STEP_SIZES = (3e-3, 1e-2, 3e-2)


def block_prefixes(model: nn.Module) -> List[str]:
    """The parameter-name prefixes of the decoder blocks of `model` (``model.layers.0.``, ...), in order."""
    decoder = getattr(model, "base_model", model)
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        raise ValueError(f"{type(decoder).__name__} has no `layers` ModuleList of decoder blocks")
    names = {id(module): name for name, module in model.named_modules()}
    return [names[id(block)] + "." for block in layers]


def group_parameters(model: nn.Module, group: str) -> Optional[List[str]]:
    """The names of the parameters of `group` (``GROUPS``; None for ``all``) of a model whose output embedding is
    untied (``untie_output_embedding``)."""
    if group == "all":
        return None
    blocks = block_prefixes(model)
    names = [n for n, _ in model.named_parameters()]

    def under(prefixes: Sequence[str]) -> List[str]:
        return [n for n in names if n.startswith(tuple(prefixes))]

    def projections(*suffixes: str) -> List[str]:
        found = [n for n in under(blocks[-1:]) if n.endswith(suffixes)]
        if len(found) != len(suffixes):
            raise ValueError(f"the last block has no parameters ending in {suffixes} (found {found})")
        return found

    groups = {"output": lambda: output_side_parameter_names(model),
              "last_down": lambda: projections("mlp.down_proj.weight"),
              "last_down_o": lambda: projections("mlp.down_proj.weight", "self_attn.o_proj.weight"),
              "output_last_block": lambda: output_side_parameter_names(model) + under(blocks[-1:]),
              "last_4_blocks": lambda: under(blocks[-4:])}
    if group not in groups:
        raise ValueError(f"unknown group {group!r}; known: {GROUPS}")
    return groups[group]()


def perplexity(model: nn.Module, documents: Sequence[torch.Tensor], dynamic: Optional[DynamicEvaluation]) -> float:
    """exp of the mean NLL of every scored token of `documents` (segments of 128, cache carried)."""
    return float(np.exp(np.concatenate([score_document(model, d, 128, dynamic) for d in documents]).mean()))


def measure(model: nn.Module, documents: Sequence[torch.Tensor], groups: Sequence[str],
            step_sizes: Sequence[float]) -> Dict[str, Dict]:
    """``{"base": {...}, group: {"perplexity": {step size: ppl}, "best": ..., "share_of_all": ...}}``; a group's
    share is its best gain over the base divided by ``all``'s best gain (when ``all`` is measured)."""
    started = time.perf_counter()
    results: Dict[str, Dict] = {"base": {"perplexity": perplexity(model, documents, None)}}
    print(f"base {results['base']['perplexity']:.3f} ({time.perf_counter() - started:.0f} s)", flush=True)
    base = results["base"]["perplexity"]
    for group in groups:
        names = group_parameters(model, group)
        row: Dict = {"parameters": names, "perplexity": {}, "seconds": {}}
        for lr in step_sizes:
            started = time.perf_counter()
            row["perplexity"][lr] = perplexity(model, documents, DynamicEvaluation(lr, parameters=names))
            row["seconds"][lr] = round(time.perf_counter() - started, 1)
            print(f"{group:<18} step size {lr:g}: {row['perplexity'][lr]:.3f} ({row['seconds'][lr]:.0f} s)",
                  flush=True)
        best = min(row["perplexity"], key=row["perplexity"].get)
        row.update(best_step_size=best, best=row["perplexity"][best], vs_base=row["perplexity"][best] / base)
        results[group] = row
    if "all" in results:
        gain_all = base - results["all"]["best"]
        for group in groups:
            results[group]["share_of_all"] = (base - results[group]["best"]) / gain_all if gain_all > 0 else None
    return results


def report(results: Dict[str, Dict]) -> str:
    """A markdown table: each group's best step size, perplexity, ratio to the base, share of ``all``'s gain."""
    lines = ["| parameters adapted | step size (best of the grid) | perplexity | vs base | share of all's gain |",
             "|---|---|---|---|---|", f"| none (base) | | {results['base']['perplexity']:.3f} | 1.0000 | |"]
    for group, row in results.items():
        if group == "base":
            continue
        share = row.get("share_of_all")
        lines.append(f"| {group} | {row['best_step_size']:g} | {row['best']:.3f} | {row['vs_base']:.4f} | "
                     f"{'' if share is None else f'{share:.2f}'} |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> Dict:
    """Parses the arguments, measures every group, prints the table and writes ``--results_file``."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="checkpoints/smollm2-135m")
    parser.add_argument("--data_dir", default="data/wiki", help="a folder with valid.txt (documents)")
    parser.add_argument("--documents", type=int, default=2, help="the first N documents of valid.txt")
    parser.add_argument("--max_length", type=int, default=2048, help="tokens per document (cut)")
    parser.add_argument("--groups", nargs="+", default=list(GROUPS), choices=GROUPS)
    parser.add_argument("--step_sizes", nargs="+", type=float, default=list(DEFAULT_STEP_SIZES))
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--results_file", default=None)
    args = parser.parse_args(argv)
    if args.documents < 1 or args.max_length < 2:
        raise ValueError(f"--documents must be >= 1 and --max_length >= 2, got {args.documents}, {args.max_length}")
    if any(lr <= 0 for lr in args.step_sizes):
        raise ValueError(f"--step_sizes must be positive, got {args.step_sizes}")
    if args.threads:
        torch.set_num_threads(args.threads)
    record = RunRecord.start("python -m training.dynamic_eval_layers", argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .train_transfo_xl import read_documents

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    documents = encode_documents(tokenizer, read_documents(Path(args.data_dir) / "valid.txt")[: args.documents],
                                 args.max_length)
    model = AutoModelForCausalLM.from_pretrained(args.model).eval()
    untie_output_embedding(model)
    results = measure(model, documents, args.groups, args.step_sizes)
    tokens = sum(d.numel() - 1 for d in documents)
    print(f"\n{len(documents)} valid documents, {tokens} tokens scored\n{report(results)}")
    out = {"settings": vars(args), "documents": len(documents), "tokens": tokens, "results": results}
    if args.results_file:
        print(f"wrote {record.write(args.results_file, out)}")
    return out


if __name__ == "__main__":
    main()
