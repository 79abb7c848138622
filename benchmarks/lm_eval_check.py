"""lm-evaluation-harness on an exported fast-weight model: the perplexity lm-eval computes equals ours.

What a user runs (no Hub access: the task is a YAML over a local JSON-lines file)::

    lm_eval --model hf --model_args pretrained=<exported folder>,trust_remote_code=True \
        --tasks fwp_local_text --include_path <task folder> --device cpu --batch_size 1 --log_samples \
        --output_path <out>

This script builds a small model of each family asked for (random weights: the comparison is of the scoring, not of
the model), exports it with a byte-level BPE tokenizer trained on the offline fixture text, writes the task, runs the
``lm_eval`` command line above in a subprocess, and compares every document's log-likelihood with our scorer
(``training.dynamic_eval.score_stream``: the document's tokens after the end-of-text token lm-eval prefixes, in one
segment). Both are summed log-probabilities in nats; they must agree to 1e-4 relative. The result file
(``--out``, default ``benchmarks/results/lm_eval_check.json``) starts with the run record of
``training/result_file.py`` (command, versions, machine, commit, load), like every benchmark's; lm-eval's version is
recorded beside it. It is written before a disagreement ends the script with an error.

    pip install -e .[eval]
    python benchmarks/lm_eval_check.py [--families fwp_delta_net fwp_delta_lstm] [--output_dir DIR] [--out FILE]
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
from typing import Any, Dict, List, Optional, Tuple

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast  # noqa: E402

from training.dynamic_eval import score_stream  # noqa: E402
from training.result_file import RunRecord, package_versions  # noqa: E402
from training.tokenizer import train_bpe_tokenizer  # noqa: E402

TASK_NAME = "fwp_local_text"
TOLERANCE = 1e-4  # relative difference of a document's summed log-likelihood, ours against lm-eval's
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "lm_eval_check.json"
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


def write_task(root: Path) -> Tuple[PreTrainedTokenizerFast, Path]:
    """Trains the byte-level BPE on the documents and writes the local task (``root/tasks``, over
    ``root/documents.jsonl``); returns the tokenizer and the task folder."""
    corpus = root / "corpus.txt"
    corpus.write_text("\n".join(DOCUMENTS * 20))
    tokenizer = train_bpe_tokenizer(corpus, vocab_size=300, min_frequency=1)
    data = root / "documents.jsonl"
    data.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCUMENTS))
    task_dir = root / "tasks"
    task_dir.mkdir(exist_ok=True)
    (task_dir / f"{TASK_NAME}.yaml").write_text(TASK_YAML.format(name=TASK_NAME, data=data))
    return tokenizer, task_dir


def compare_family(model_type: str, tokenizer, root: Path, task_dir: Path) -> Dict[str, Any]:
    """Exports a small `model_type` model, scores the documents with our scorer and with lm-eval: the comparison."""
    folder = root / model_type
    model = build_export(model_type, tokenizer, folder)
    ours = our_loglikelihoods(model, tokenizer, DOCUMENTS)
    theirs = run_lm_eval(folder, task_dir, root / f"lm_eval_{model_type}")
    if len(theirs) != len(ours):
        raise RuntimeError(f"{model_type}: lm-eval scored {len(theirs)} documents, expected {len(ours)}")
    worst = max(abs(a - b) / abs(b) for a, b in zip(ours, theirs))
    tokens = sum(len(tokenizer(d, add_special_tokens=False)["input_ids"]) for d in DOCUMENTS)
    result = {"ours": ours, "lm_eval": theirs, "max_relative_difference": worst, "tokens": tokens,
              "perplexity_ours": math.exp(-sum(ours) / tokens), "perplexity_lm_eval": math.exp(-sum(theirs) / tokens),
              "agree": worst <= TOLERANCE}
    print(f"{model_type}: per-token perplexity ours {result['perplexity_ours']:.4f}, lm-eval "
          f"{result['perplexity_lm_eval']:.4f}; worst document relative difference {worst:.2e}")
    return result


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    """Runs the comparison for every family asked for and writes the result file (with its run record) to ``--out``
    (and ``<output_dir>/report.json``); exits with an error when a family's scores disagree."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="+", default=["fwp_delta_net", "fwp_delta_lstm"],
                        help="model types to export and evaluate (default: %(default)s)")
    parser.add_argument("--output_dir", default=None,
                        help="where exports, task and lm-eval outputs go (default: a temporary folder)")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="the result file (default: %(default)s)")
    args = parser.parse_args(argv)
    record = RunRecord.start("python benchmarks/lm_eval_check.py", argv)
    root = Path(args.output_dir or tempfile.mkdtemp(prefix="lm_eval_check_"))
    root.mkdir(parents=True, exist_ok=True)
    tokenizer, task_dir = write_task(root)
    models = {model_type: compare_family(model_type, tokenizer, root, task_dir) for model_type in args.families}
    results = {"task": TASK_NAME, "documents": len(DOCUMENTS), "tolerance": TOLERANCE,
               "lm_eval_version": package_versions(("lm_eval",))["lm_eval"], "models": models}
    print(f"wrote {record.write(args.out, results, copies=[root / 'report.json'])}")
    disagree = [name for name, result in models.items() if not result["agree"]]
    if disagree:
        raise SystemExit(f"lm-eval and our scorer disagree (> {TOLERANCE:g} relative) for {disagree}: see {args.out}")
    return results


if __name__ == "__main__":
    main()
