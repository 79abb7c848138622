"""Parity of ``convert_transfo_xl_checkpoint`` with transformers 4.35's own Transformer-XL: fixture generator, shared
comparison, and a report.

transformers removed Transformer-XL after 4.35, so its outputs are recorded once, with transformers 4.35 itself, as
committed fixtures under ``tests/fixtures/transfo_xl_4_35/<variant>/``:

- ``config.json`` + ``pytorch_model.bin``: a small random ``TransfoXLLMHeadModel`` saved by transformers 4.35's
  ``save_pretrained`` (what ``convert_transfo_xl_checkpoint`` reads);
- ``expected.safetensors``: ``segment_<k>.ids [B, T_k]`` and ``segment_<k>.log_probs [B, T_k, V]`` for segments run one
  after the other carrying ``mems`` (the first from transformers 4's zero memories), and a greedy continuation run
  token by token with ``mems``: ``generation.prompt [B, P]``, ``generation.ids [B, P + N]`` (also what transformers
  4's ``generate`` returned) and ``generation.log_probs [B, P + N - 1, V]`` (prompt forward, then one per step);
- ``provenance.json``: the command, the seed, and the versions read at run time.

The variants cover the memory boundary: ``mem_len`` shorter than, equal to and longer than the segments, with
``same_length`` on and off, ``clamp_len`` off, inside and beyond the distances seen, three segments each (so memories
roll over), post-LN and pre-LN, per-layer and shared position biases, adaptive and single-table embeddings.

Step 1 (only to regenerate the fixtures), in an environment with transformers 4.35.2, e.g.
``python3 -m venv /tmp/hf4 && /tmp/hf4/bin/pip install torch==2.13.0 transformers==4.35.2``::

    /tmp/hf4/bin/python benchmarks/transfo_xl_transformers4_parity.py make

Step 2, here (transformers 5): convert every fixture, load it with ``AutoModelForCausalLM`` and compare (the test suite,
``tests/test_transfo_xl_transformers4.py``, runs the same comparison functions)::

    python benchmarks/transfo_xl_transformers4_parity.py check

Writes benchmarks/results/transfo_xl_transformers4_parity.json.
"""
from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Tuple

import torch

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "transfo_xl_4_35"
BATCH_SIZE = 2
PROMPT_LENGTH, NEW_TOKENS = 3, 7
# wt103's layout at toy size (V = 40): 4 clusters, div_val 4, post-LN, per-layer position biases, same_length
BASE = dict(vocab_size=40, cutoffs=[8, 16, 28], d_model=16, d_embed=64, n_head=2, d_head=8, d_inner=24, div_val=4,
            n_layer=2, mem_len=6, clamp_len=9, same_length=True, dropout=0.0, dropatt=0.0)
# name: (config overrides, segment lengths). Distances reach mem_len + T - 1 (transformers 4 always has mem_len
# memories, zeros at first); clamp_len 0 is off.
VARIANTS: Dict[str, Tuple[dict, List[int]]] = {
    "wt103_small": (dict(), [9, 5, 7]),
    # pre-LN, shared position biases, one embedding table with a projection (div_val 1), no same_length
    "preln_shared_div1": (dict(pre_lnorm=True, untie_r=False, same_length=False, div_val=1, d_embed=24), [9, 5, 7]),
    "mem_shorter_same_length": (dict(mem_len=3, clamp_len=0), [6, 6, 6]),
    "mem_shorter": (dict(mem_len=3, clamp_len=0, same_length=False), [6, 6, 6]),
    "mem_equal_same_length": (dict(mem_len=5, clamp_len=4), [5, 5, 5]),
    "mem_equal": (dict(mem_len=5, clamp_len=7, same_length=False), [5, 5, 5]),
    "mem_longer_same_length": (dict(mem_len=8, clamp_len=5), [3, 3, 3]),
    "mem_longer": (dict(mem_len=8, clamp_len=20, same_length=False, pre_lnorm=True), [3, 3, 3]),
}
PERTURBATION = 0.1  # every parameter moves off its initial value (zero biases, unit LayerNorm gains)
TOLERANCE = 1e-5  # max |log-prob difference|: float32 rounding only (measured <= 9.5e-7)
GREEDY_MARGIN = 1e-3  # the generated tokens must win by more than this, or parity could not decide them


# ---------------------------------------------------------------------------------------------------------------
# Step 1: fixtures, with transformers 4.35
# ---------------------------------------------------------------------------------------------------------------


def build_reference_model(overrides: dict, seed: int) -> torch.nn.Module:
    """A random transformers-4 ``TransfoXLLMHeadModel`` (eval mode), every parameter perturbed."""
    from transformers import TransfoXLConfig, TransfoXLLMHeadModel  # transformers 4.x only

    torch.manual_seed(seed)
    model = TransfoXLLMHeadModel(TransfoXLConfig(**{**BASE, **overrides})).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(PERTURBATION * torch.randn_like(p))
    return model


@torch.no_grad()
def reference_segments(
    model: torch.nn.Module, lengths: List[int], generator: torch.Generator
) -> Dict[str, torch.Tensor]:
    """Random segments run one after the other, each continuing from the previous one's ``mems``."""
    out, mems = {}, None
    for k, length in enumerate(lengths):
        ids = torch.randint(0, BASE["vocab_size"], (BATCH_SIZE, length), generator=generator)
        result = model(ids, mems=mems)
        mems = result.mems
        out[f"segment_{k}.ids"], out[f"segment_{k}.log_probs"] = ids, result.prediction_scores.contiguous()
    return out


@torch.no_grad()
def reference_generation(model: torch.nn.Module, generator: torch.Generator) -> Dict[str, torch.Tensor]:
    """Greedy continuation of a random prompt, token by token with ``mems``; checked against transformers 4's
    ``generate``. Raises if a greedy choice is closer than ``GREEDY_MARGIN`` to a tie or hits the eos token."""
    prompt = torch.randint(1, BASE["vocab_size"], (BATCH_SIZE, PROMPT_LENGTH), generator=generator)
    result = model(prompt)
    ids, log_probs = prompt, [result.prediction_scores]
    for step in range(NEW_TOKENS):
        top = log_probs[-1][:, -1].topk(2, dim=-1)
        if bool((top.values[:, 0] - top.values[:, 1] <= GREEDY_MARGIN).any()):
            raise RuntimeError(f"greedy step {step} is within {GREEDY_MARGIN} of a tie: pick another seed")
        ids = torch.cat([ids, top.indices[:, :1]], dim=1)
        if step < NEW_TOKENS - 1:
            result = model(ids[:, -1:], mems=result.mems)
            log_probs.append(result.prediction_scores)
    if bool((ids[:, PROMPT_LENGTH:] == model.config.eos_token_id).any()):
        raise RuntimeError("the greedy continuation hits the eos token (generate would stop): pick another seed")
    generated = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    if not torch.equal(generated, ids):
        raise RuntimeError(f"transformers 4's generate returned {generated.tolist()}, the step loop {ids.tolist()}")
    return {"generation.prompt": prompt, "generation.ids": ids, "generation.log_probs": torch.cat(log_probs, 1)}


def make(folder: Path, seed: int) -> None:
    """Writes one fixture folder per variant (see the module docstring) under `folder`."""
    import transformers
    from safetensors.torch import save_file

    for name, (overrides, lengths) in VARIANTS.items():
        model = build_reference_model(overrides, seed)
        model.save_pretrained(folder / name, safe_serialization=False)
        (folder / name / "generation_config.json").unlink(missing_ok=True)  # not read by the converter
        generator = torch.Generator().manual_seed(seed)
        expected = {**reference_segments(model, lengths, generator), **reference_generation(model, generator)}
        save_file(expected, str(folder / name / "expected.safetensors"))
        provenance = {
            "command": shlex.join([sys.executable] + sys.argv),
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "seed": seed,
            "config_arguments": {**BASE, **overrides},
            "segment_lengths": lengths,
            "batch_size": BATCH_SIZE,
            "generation": {"prompt_length": PROMPT_LENGTH, "new_tokens": NEW_TOKENS, "greedy_margin": GREEDY_MARGIN},
        }
        (folder / name / "provenance.json").write_text(json.dumps(provenance, indent=2) + "\n")
        print(f"wrote {folder / name}")


# ---------------------------------------------------------------------------------------------------------------
# Step 2: the comparison (shared with tests/test_transfo_xl_transformers4.py), with transformers 5
# ---------------------------------------------------------------------------------------------------------------


def load_fixture(folder: Path, work_dir: Path) -> Tuple[torch.nn.Module, Dict[str, torch.Tensor]]:
    """Converts a fixture's transformers-4 checkpoint into `work_dir` and loads it with ``AutoModelForCausalLM``.
    Returns ``(model in eval mode, expected tensors)``."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from modeling_fwp import convert_transfo_xl_checkpoint

    convert_transfo_xl_checkpoint(folder, work_dir)
    model = AutoModelForCausalLM.from_pretrained(work_dir).eval()
    return model, load_file(str(folder / "expected.safetensors"))


def num_segments(expected: Dict[str, torch.Tensor]) -> int:
    return sum(1 for key in expected if key.startswith("segment_") and key.endswith(".ids"))


@torch.no_grad()
def segment_differences(model: torch.nn.Module, expected: Dict[str, torch.Tensor]) -> List[float]:
    """max |log-prob difference| of every segment, run one after the other from ``init_memories`` (transformers 4's
    zero memories), each continuing from the previous segment's cache."""
    from modeling_fwp.cache_fwp import output_cache

    cache, diffs = model.init_memories(BATCH_SIZE), []
    for k in range(num_segments(expected)):
        out = model(expected[f"segment_{k}.ids"], cache=cache)
        cache = output_cache(out)
        diffs.append((out.logits - expected[f"segment_{k}.log_probs"]).abs().max().item())
    return diffs


@torch.no_grad()
def generation_differences(model: torch.nn.Module, expected: Dict[str, torch.Tensor]) -> Tuple[float, bool]:
    """``(max |log-prob difference| of the prompt forward and the cached token-by-token steps over the fixture's
    greedy continuation, whether greedy ``generate`` from ``init_memories`` returns the fixture's ids)``."""
    from modeling_fwp.cache_fwp import output_cache

    prompt, ids = expected["generation.prompt"], expected["generation.ids"]
    out = model(prompt, cache=model.init_memories(BATCH_SIZE))
    log_probs = [out.logits]
    for t in range(prompt.shape[1], ids.shape[1] - 1):
        out = model(ids[:, t : t + 1], cache=output_cache(out))
        log_probs.append(out.logits)
    diff = (torch.cat(log_probs, 1) - expected["generation.log_probs"]).abs().max().item()
    generated = model.generate(
        prompt, attention_mask=torch.ones_like(prompt), cache=model.init_memories(BATCH_SIZE),
        max_new_tokens=ids.shape[1] - prompt.shape[1], do_sample=False, pad_token_id=0,
    )
    return diff, bool(torch.equal(generated, ids))


def check(folder: Path, output: Path) -> dict:
    """Runs the comparison on every fixture and writes `output` (JSON) with the versions read at run time."""
    sys.path.insert(0, str(ROOT))
    import transformers

    from training.result_file import RunRecord

    record, report = RunRecord.start("python benchmarks/transfo_xl_transformers4_parity.py"), {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in VARIANTS:
            provenance = json.loads((folder / name / "provenance.json").read_text())
            model, expected = load_fixture(folder / name, Path(tmp) / name)
            segment_diffs = segment_differences(model, expected)
            step_diff, same_ids = generation_differences(model, expected)
            report[name] = {
                "recorded_with": {key: provenance[key] for key in ("transformers", "torch")},
                "max_abs_diff_per_segment": segment_diffs,
                "max_abs_diff_cached_steps": step_diff,
                "greedy_generate_equal": same_ids,
                "within_tolerance": max(segment_diffs + [step_diff]) <= TOLERANCE and same_ids,
            }
            print(name, report[name])
    record.write(output, {
        "compared": "log-probabilities [B, T, V] recorded by transformers 4 (fixtures) vs the converted checkpoints",
        "checked_with": {"transformers": transformers.__version__, "torch": torch.__version__},
        "fixtures": str(folder.relative_to(ROOT)) if folder.is_relative_to(ROOT) else str(folder),
        "tolerance": TOLERANCE,
        "results": report,
    })
    return report


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("step", choices=["make", "check"])
    parser.add_argument("--dir", default=str(FIXTURES), help="fixture folder (one subfolder per variant)")
    parser.add_argument("--seed", type=int, default=0, help="make: seed of the weights and the token ids")
    parser.add_argument(
        "--output", default=str(ROOT / "benchmarks" / "results" / "transfo_xl_transformers4_parity.json")
    )
    args = parser.parse_args()
    make(Path(args.dir), args.seed) if args.step == "make" else check(Path(args.dir), Path(args.output))
