"""Where the test-time FWL takes its gradients: at the slow weights (Clark et al. 2022) or at the fast weights the
update has reached (like dynamic evaluation). Issue 17's question after session 32: "an FWL whose fast weights keep
accumulating like dynamic evaluation's" (docs/RESULTS.md, item 1's second table).

The output side of an untouched causal LM (its output embedding E, untied, and a zero output bias c) is made fast,
one global step size alpha for both, and every document is scored in segments of `--segment_length` tokens. At
position t of segment s, with g_j = dCE_j/dz_j = softmax(z_j) - onehot(x_{j+1}) the per-token gradient of the logits:

    z_t = o_t E_t^T + c_t,   (E_t, c_t) = (E, c) - alpha * sum_{j<t} (g_j o_j^T, g_j)         (Clark et al. sec. 2, eq. 1)

Three ways to take g_j, compared on the same documents and alpha grid:

- ``slow``: g_j at the slow weights, the paper's FWL and the package's test-time FWL (``training.test_time_fwl``).
  The script checks its own loop against ``build_test_time_fwl`` scored by ``document_eval.score_document`` at one
  alpha and stops if they differ by more than 1e-3 in perplexity (relative).
- ``segment_start``: g_j at the fast weights as of the start of j's segment (the carried sums folded in), then the
  paper's in-segment update from there: the fast weights keep accumulating across segments.
- ``segment_start_no_in_segment``: the same gradients, applied only at the end of each segment: SGD on the segment's
  summed loss after scoring it, dynamic evaluation (Krause et al.) of E and c with step size alpha.

The base's hidden states do not depend on the head, so they are computed once per document (one forward).

    python benchmarks/fwl_gradient_point.py --model checkpoints/smollm2-135m --documents 2 --max_length 2048 \
        --output benchmarks/results/fwl_gradient_point_base.json
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Dict, List

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from training.document_eval import encode_documents, score_document  # noqa: E402
from training.test_time_fwl import build_test_time_fwl  # noqa: E402
from training.train_transfo_xl import read_documents  # noqa: E402

GRADIENT_POINTS = ("slow", "segment_start", "segment_start_no_in_segment")


@torch.no_grad()
def output_side_nll(
    o: torch.Tensor, ids: torch.Tensor, E: torch.Tensor, alpha: float, gradient_point: str, segment_length: int
) -> torch.Tensor:
    """``[n - 1]`` NLL of ``ids [n]`` (targets ``ids[1:]``) from the base's final hidden states ``o [n, D]`` with the
    output side fast (E ``[V, D]`` and a zero bias c, one step size `alpha`), gradients taken at `gradient_point`."""
    T = ids.numel() - 1
    o, labels = o[:T].float(), ids[1:]
    S = torch.zeros_like(E, dtype=torch.float32)  # sum_j g_j o_j^T over earlier segments
    s = torch.zeros(E.shape[0])  # sum_j g_j
    nll = []
    for a in range(0, T, segment_length):
        q, y = o[a : a + segment_length], labels[a : a + segment_length]
        rows = torch.arange(q.shape[0])
        z_slow = q @ E.T
        z_start = z_slow - alpha * (q @ S.T + s)  # the fast weights at the segment's start, read by every position
        g = torch.softmax(z_slow if gradient_point == "slow" else z_start, -1)
        g[rows, y] -= 1
        z = z_start
        if gradient_point != "segment_start_no_in_segment":  # eq. 2: position t learns from j < t in the segment
            z = z_start - torch.tril(alpha * (q @ q.T + 1), -1) @ g
        nll.append(F.cross_entropy(z, y, reduction="none"))
        S += g.T @ q
        s += g.sum(0)
    return torch.cat(nll)


def perplexity(nll: List[torch.Tensor]) -> float:
    return math.exp(float(torch.cat(nll).double().mean()))


def main() -> Dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="checkpoints/smollm2-135m")
    p.add_argument("--data_dir", default="data/wiki")
    p.add_argument("--split", default="valid", help="the file <split>.txt of --data_dir (never tune on test)")
    p.add_argument("--documents", type=int, default=2)
    p.add_argument("--max_length", type=int, default=2048)
    p.add_argument("--segment_length", type=int, default=128)
    p.add_argument("--step_sizes", nargs="+", type=float, default=[1e-5, 3e-5, 1e-4, 3e-4])
    p.add_argument("--check_step_size", type=float, default=3e-5, help="alpha of the check against the package")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--output", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model).eval()
    docs = encode_documents(tokenizer, read_documents(Path(args.data_dir) / f"{args.split}.txt")[: args.documents],
                            args.max_length)
    E = model.get_output_embeddings().weight.detach().float()
    with torch.no_grad():
        hidden = [model.model(input_ids=ids[None]).last_hidden_state[0] for ids in docs]
    started = time.perf_counter()
    results: Dict[str, Dict[str, float]] = {"base": {"0": perplexity(
        [output_side_nll(h, ids, E, 0.0, "slow", args.segment_length) for h, ids in zip(hidden, docs)])}}
    for point in GRADIENT_POINTS:
        results[point] = {}
        for alpha in args.step_sizes:
            nll = [output_side_nll(h, ids, E, alpha, point, args.segment_length) for h, ids in zip(hidden, docs)]
            results[point][repr(alpha)] = round(perplexity(nll), 4)
            print(f"{point:<28} alpha {alpha:<7g} perplexity {results[point][repr(alpha)]:.4f}", flush=True)
    # the loop's "slow" against the package's test-time FWL (its own segments, cache carried)
    fwl = build_test_time_fwl(args.model, step_size=args.check_step_size)
    package = perplexity([torch.from_numpy(score_document(fwl, ids, args.segment_length)) for ids in docs])
    loop = perplexity([output_side_nll(h, ids, E, args.check_step_size, "slow", args.segment_length)
                       for h, ids in zip(hidden, docs)])
    check = {"step_size": args.check_step_size, "package": round(package, 4), "loop": round(loop, 4),
             "relative_difference": abs(package - loop) / package}
    print(f"check at alpha {args.check_step_size:g}: package {package:.4f}, this loop {loop:.4f}", flush=True)
    if check["relative_difference"] > 1e-3:
        raise SystemExit(f"the loop's 'slow' update does not match the package's test-time FWL: {check}")
    best = {point: min(results[point].items(), key=lambda kv: kv[1]) for point in GRADIENT_POINTS}
    record = {
        "command": "python " + " ".join(sys.argv), "args": vars(args), "tokens": sum(d.numel() - 1 for d in docs),
        "base_perplexity": round(results["base"]["0"], 4), "perplexity": {k: v for k, v in results.items() if k != "base"},
        "best": {k: {"step_size": float(a), "perplexity": v} for k, (a, v) in best.items()}, "check": check,
        "seconds": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(record["best"], indent=1))
    if args.output:
        Path(args.output).write_text(json.dumps(record, indent=1) + "\n")
    return record


if __name__ == "__main__":
    main()
