"""Parity of ``convert_transfo_xl_checkpoint`` with transformers 4.35's own Transformer-XL (not part of the test suite:
it needs a second environment with transformers 4).

Step 1, in an environment with ``transformers==4.35.2`` (e.g. ``python -m venv /tmp/hf4 && /tmp/hf4/bin/pip install
transformers==4.35.2`` plus torch): build random ``TransfoXLLMHeadModel`` checkpoints, save them as
``pytorch_model.bin`` and record their log-probabilities over two segments (the second continuing from the first's
memories, transformers 4 starting from zero memories)::

    /tmp/hf4/bin/python benchmarks/transfo_xl_transformers4_parity.py make --dir /tmp/hf4_ckpt

Step 2, here: convert each folder, load it with ``AutoModelForCausalLM`` and compare (``init_memories`` reproduces the
zero memories)::

    python benchmarks/transfo_xl_transformers4_parity.py check --dir /tmp/hf4_ckpt

Writes benchmarks/results/transfo_xl_transformers4_parity.json.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {
    # wt103's layout at toy size: 4 clusters, div_val 4, post-LN, per-layer position biases, same_length
    "wt103_small": dict(),
    # pre-LN, shared position biases, one embedding table with a projection (div_val 1), no same_length
    "preln_shared_div1": dict(pre_lnorm=True, untie_r=False, same_length=False, div_val=1, d_embed=24),
}
BASE = dict(vocab_size=100, cutoffs=[20, 40, 70], d_model=32, d_embed=128, n_head=4, d_head=8, d_inner=48, div_val=4,
            n_layer=2, mem_len=6, clamp_len=9, same_length=True, dropout=0.0)


def make(folder: Path) -> None:
    from transformers import TransfoXLConfig, TransfoXLLMHeadModel  # transformers 4.x only

    for name, overrides in VARIANTS.items():
        torch.manual_seed(0)
        model = TransfoXLLMHeadModel(TransfoXLConfig(**{**BASE, **overrides})).eval()
        with torch.no_grad():  # move every parameter off its initial value
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        model.save_pretrained(folder / name, safe_serialization=False)
        ids = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(1))
        ids2 = torch.randint(0, 100, (2, 5), generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            first = model(ids)
            second = model(ids2, mems=first.mems)
        torch.save({"ids": ids, "ids2": ids2, "scores1": first.prediction_scores, "scores2": second.prediction_scores},
                   folder / name / "expected.pt")
        print(f"wrote {folder / name}")


def check(folder: Path, output: Path) -> dict:
    sys.path.insert(0, str(ROOT))
    from transformers import AutoModelForCausalLM

    from modeling_fwp import convert_transfo_xl_checkpoint
    from modeling_fwp.cache_fwp import output_cache
    from training.result_file import RunRecord

    record = RunRecord.start("python benchmarks/transfo_xl_transformers4_parity.py")

    report = {}
    for name in VARIANTS:
        convert_transfo_xl_checkpoint(folder / name, folder / f"{name}_converted")
        model = AutoModelForCausalLM.from_pretrained(folder / f"{name}_converted").eval()
        expected = torch.load(folder / name / "expected.pt", weights_only=True)
        with torch.no_grad():
            first = model(expected["ids"], cache=model.init_memories(2))
            second = model(expected["ids2"], cache=output_cache(first))
        report[name] = {
            "max_abs_diff_segment_1": (first.logits - expected["scores1"]).abs().max().item(),
            "max_abs_diff_segment_2": (second.logits - expected["scores2"]).abs().max().item(),
        }
        print(name, report[name])
    config = json.loads((folder / next(iter(VARIANTS)) / "config.json").read_text())
    record.write(output, {"compared": "log-probabilities [B, T, V], transformers 4.35.2 vs converted",
                          "reference_transformers_version": config.get("transformers_version"), "results": report})
    return report


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("step", choices=["make", "check"])
    parser.add_argument("--dir", default="/tmp/hf4_ckpt")
    parser.add_argument("--output", default=str(ROOT / "benchmarks" / "results" / "transfo_xl_transformers4_parity.json"))
    args = parser.parse_args()
    make(Path(args.dir)) if args.step == "make" else check(Path(args.dir), Path(args.output))
