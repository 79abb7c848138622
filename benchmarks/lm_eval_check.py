"""lm-evaluation-harness on an exported fast-weight model: the perplexity lm-eval computes equals ours.

What a user runs (no Hub access: the task is a YAML over a local JSON-lines file)::

    lm_eval --model hf --model_args pretrained=<exported folder>,trust_remote_code=True \
        --tasks fwp_local_text --include_path <task folder> --device cpu --batch_size 1 --log_samples --output_path <out>

This script builds a small model of each family asked for (random weights: the comparison is of the scoring, not of
the model), exports it with a byte-level BPE tokenizer trained on the offline fixture text, writes the task, runs the
``lm_eval`` command line above in a subprocess, and compares every document's log-likelihood with our scorer
(``training.dynamic_eval.score_stream``: the document's tokens after the end-of-text token lm-eval prefixes, in one
segment). Both are summed log-probabilities in nats; they must agree to 1e-4 relative.

    python benchmarks/lm_eval_check.py [--families fwp_delta_net fwp_delta_lstm] [--output_dir DIR]
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from training.dynamic_eval import score_stream  # noqa: E402
from training.tokenizer import train_bpe_tokenizer  # noqa: E402

TASK_NAME = "fwp_local_text"
TASK_YAML = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
should_decontaminate: false
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
"""

DOCUMENTS = [
    "Fast weights are programmed by a slow network and read with queries.",
    "The delta rule replaces the value stored under a key instead of adding to it, so the memory does not overflow "
    "as quickly as with the sum rule of linear attention.",
    "A recurrent state of constant size takes the place of the growing key-value cache of softmax attention.",
]


def build_export(model_type: str, tokenizer, folder: Path, seed: int = 0) -> AutoModelForCausalLM:
    """A small random model of `model_type`, saved with `tokenizer` into `folder` (remote code included)."""
    torch.manual_seed(seed)
    config = AutoConfig.for_model(
        model_type, vocab_size=len(tokenizer), hidden_size=32, num_attention_heads=4, num_hidden_layers=2,
        intermediate_size=64, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    model = AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model


def our_loglikelihoods(model, tokenizer, documents) -> list:
    """log p(document | end-of-text) summed over the document's tokens, by our scorer, in nats."""
    out = []
    for text in documents:
        ids = [tokenizer.eos_token_id] + tokenizer(text, add_special_tokens=False)["input_ids"]
        result = score_stream(model, torch.tensor([ids]), segment_length=len(ids))
        out.append(-result.nll_sum)
    return out


def run_lm_eval(folder: Path, task_dir: Path, out_dir: Path) -> list:
    """Runs the ``lm_eval`` command line on `folder` and returns each document's log-likelihood, in document order."""
    command = [
        str(Path(sys.executable).with_name("lm_eval")), "--model", "hf",
        "--model_args", f"pretrained={folder},trust_remote_code=True,dtype=float32",
        "--tasks", TASK_NAME, "--include_path", str(task_dir), "--device", "cpu", "--batch_size", "1",
        "--log_samples", "--output_path", str(out_dir),
    ]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"lm_eval failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    (samples_file,) = glob.glob(str(out_dir / "**" / f"samples_{TASK_NAME}_*.jsonl"), recursive=True)
    samples = sorted((json.loads(line) for line in open(samples_file)), key=lambda s: s["doc_id"])
    # loglikelihood_rolling: the response is the summed log-likelihood of the document's rolling windows
    return [float(s["filtered_resps"][0]) if not isinstance(s["filtered_resps"][0], list)
            else float(s["filtered_resps"][0][0]) for s in samples]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="+", default=["fwp_delta_net", "fwp_delta_lstm"],
                        help="model types to export and evaluate (default: %(default)s)")
    parser.add_argument("--output_dir", default=None, help="where exports, task and lm-eval outputs go (default: a temporary folder)")
    args = parser.parse_args(argv)
    root = Path(args.output_dir or tempfile.mkdtemp(prefix="lm_eval_check_"))
    root.mkdir(parents=True, exist_ok=True)
    corpus = root / "corpus.txt"
    corpus.write_text("\n".join(DOCUMENTS * 20))
    tokenizer = train_bpe_tokenizer(corpus, vocab_size=300, min_frequency=1)
    data = root / "documents.jsonl"
    data.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCUMENTS))
    task_dir = root / "tasks"
    task_dir.mkdir(exist_ok=True)
    (task_dir / f"{TASK_NAME}.yaml").write_text(TASK_YAML.format(name=TASK_NAME, data=data))
    report = {}
    for model_type in args.families:
        folder = root / model_type
        model = build_export(model_type, tokenizer, folder)
        ours = our_loglikelihoods(model, tokenizer, DOCUMENTS)
        theirs = run_lm_eval(folder, task_dir, root / f"lm_eval_{model_type}")
        worst = max(abs(a - b) / abs(b) for a, b in zip(ours, theirs))
        report[model_type] = {"ours": ours, "lm_eval": theirs, "max_relative_difference": worst}
        tokens = sum(len(tokenizer(d, add_special_tokens=False)["input_ids"]) for d in DOCUMENTS)
        print(f"{model_type}: per-token perplexity ours {math.exp(-sum(ours) / tokens):.4f}, "
              f"lm-eval {math.exp(-sum(theirs) / tokens):.4f}; worst document relative difference {worst:.2e}")
        if worst > 1e-4:
            raise SystemExit(f"{model_type}: lm-eval and our scorer disagree ({worst:.2e} relative)")
    (root / "report.json").write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
