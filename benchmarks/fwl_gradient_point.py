"""Where the test-time FWL takes its gradients: at the slow weights (Clark et al. 2022) or at the fast weights the
update has reached (like dynamic evaluation). Issue 17's question after session 32: "an FWL whose fast weights keep
accumulating like dynamic evaluation's" (docs/RESULTS.md, item 1's second table).

The output side of an untouched causal LM (its output embedding E, untied, and a zero output bias c) is made fast,
one global step size alpha for both, and every document is scored in segments of `--segment_length` tokens. At
position t of segment s, with g_j = dCE_j/dz_j = softmax(z_j) - onehot(x_{j+1}) the per-token gradient of the logits:

    z_t = o_t E_t^T + c_t,   (E_t, c_t) = (E, c) - alpha * sum_{j<t} (g_j o_j^T, g_j)     (Clark et al. sec. 2, eq. 1)

Three ways to take g_j, compared on the same documents and alpha grid:

- ``slow``: g_j at the slow weights, the paper's FWL and the package's test-time FWL (``training.test_time_fwl``).
- ``segment_start``: g_j at the fast weights as of the start of j's segment (the carried sums folded in), then the
  paper's in-segment update from there: the fast weights keep accumulating across segments (the package's
  ``fwl_gradient_point="segment_start"``, since session 34).
- ``segment_start_no_in_segment``: the same gradients, applied only at the end of each segment: SGD on the segment's
  summed loss after scoring it, dynamic evaluation (Krause et al.) of E and c with step size alpha.

The script checks its loop against the package (``build_test_time_fwl`` scored by ``document_eval.score_document``,
"slow" and "segment_start") at one alpha and stops if they differ by more than 1e-3 in perplexity (relative).

With ``--fwl_model`` the same three updates run on a trained output-side FWL (``training.finetune_fwl``'s stage
(3) with E and c fast): its slow output side (its final norm gain, E, c) and its learned step sizes (times the
factors of ``--step_sizes``), the check then against the trained model as the package scores it. ``base_perplexity``
in the result: the slow weights alone (the base, or the trained FWL's slow head (3')).

The hidden states do not depend on the fast weights, so they are computed once per document (one forward).

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
from typing import Any, Dict, List, Optional

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from training.document_eval import encode_documents, score_document  # noqa: E402
from training.test_time_fwl import build_test_time_fwl  # noqa: E402
from training.train_transfo_xl import read_documents  # noqa: E402

GRADIENT_POINTS = ("slow", "segment_start", "segment_start_no_in_segment")


@torch.no_grad()
def output_side_nll(
    o: torch.Tensor, ids: torch.Tensor, E: torch.Tensor, alpha: float, gradient_point: str, segment_length: int,
    bias: Optional[torch.Tensor] = None, bias_alpha: Optional[float] = None,
) -> torch.Tensor:
    """``[n - 1]`` NLL of ``ids [n]`` (targets ``ids[1:]``) from the output layer's inputs ``o [n, D]`` with the
    output side fast: E ``[V, D]`` with step size `alpha` and the output bias c (`bias` ``[V]``, zero when None) with
    `bias_alpha` (`alpha` when None), gradients taken at `gradient_point`."""
    T = ids.numel() - 1
    o, labels = o[:T].float(), ids[1:]
    bias_alpha = alpha if bias_alpha is None else bias_alpha
    S = torch.zeros_like(E, dtype=torch.float32)  # sum_j g_j o_j^T over earlier segments
    s = torch.zeros(E.shape[0])  # sum_j g_j
    nll = []
    for a in range(0, T, segment_length):
        q, y = o[a : a + segment_length], labels[a : a + segment_length]
        rows = torch.arange(q.shape[0])
        z_slow = q @ E.T if bias is None else q @ E.T + bias
        # the fast weights at the segment's start, read by every position of the segment
        z_start = z_slow - alpha * (q @ S.T) - bias_alpha * s
        g = torch.softmax(z_slow if gradient_point == "slow" else z_start, -1)
        g[rows, y] -= 1
        z = z_start
        if gradient_point != "segment_start_no_in_segment":  # eq. 2: position t learns from j < t in the segment
            z = z_start - torch.tril(alpha * (q @ q.T) + bias_alpha, -1) @ g
        nll.append(F.cross_entropy(z, y, reduction="none"))
        S += g.T @ q
        s += g.sum(0)
    return torch.cat(nll)


def perplexity(nll: List[torch.Tensor]) -> float:
    return math.exp(float(torch.cat(nll).double().mean()))


class OutputSide:
    """What the loop needs of a model, per document: the output layer's inputs o, its E and c, the step sizes and
    the model the package scores (for the check of the "slow" update)."""

    def __init__(self, args: argparse.Namespace, docs: List[torch.Tensor]) -> None:
        from transformers import AutoModelForCausalLM

        if args.fwl_model:  # a trained FWL: its own slow output side (final norm gain, E, c) and learned alphas
            from modeling_fwp.fwl import linear_weight
            from training.document_eval import load_fwl_model

            self.scored = load_fwl_model(args.fwl_model, "--fwl_model")
            head = self.scored.fwl_head
            if set(head.fast_parameter_names) != {"output_embedding.weight", "output_bias"}:
                raise ValueError(f"--fwl_model: its fast parameters must be output_embedding.weight and output_bias "
                                 f"(an output-side FWL), got {list(head.fast_parameter_names)}")
            slow, decoder = head.slow, self.scored.language_model.base_model
            self.E, self.bias = linear_weight(slow.output_embedding).detach().float(), slow.output_bias.detach().float()
            self.alphas = tuple(head.step_size(name).item() for name in ("output_embedding.weight", "output_bias"))
            with torch.no_grad():
                self.o = [slow.hidden_intermediates(decoder(input_ids=ids[None]).last_hidden_state)["o"][0]
                          for ids in docs]
            return
        model = AutoModelForCausalLM.from_pretrained(args.model).eval()
        self.E, self.bias, self.alphas = model.get_output_embeddings().weight.detach().float(), None, None
        with torch.no_grad():
            self.o = [model.model(input_ids=ids[None]).last_hidden_state[0] for ids in docs]
        self.scored = build_test_time_fwl(args.model, step_size=args.check_step_size)

    def perplexity(self, docs: List[torch.Tensor], point: str, alpha: float, bias_alpha: Optional[float] = None,
                   segment_length: int = 128) -> float:
        return perplexity([output_side_nll(o, ids, self.E, alpha, point, segment_length, self.bias, bias_alpha)
                           for o, ids in zip(self.o, docs)])


def check_against_package(side: OutputSide, docs: List[torch.Tensor], args: argparse.Namespace) -> Dict[str, Any]:
    """The loop against the package (its own segments, cache carried): "slow" against the test-time FWL at
    ``--check_step_size`` or the trained FWL as it is; for the test-time FWL also "segment_start" against
    ``fwl_gradient_point="segment_start"``. SystemExit if a pair differs by more than 1e-3 (relative)."""
    alpha, bias_alpha = side.alphas or (args.check_step_size, None)
    models = {"slow": side.scored}
    if side.alphas is None:
        models["segment_start"] = build_test_time_fwl(args.model, step_size=alpha, gradient_point="segment_start",
                                                      segment_length=args.segment_length)
    checks: Dict[str, Any] = {}
    for point, model in models.items():
        package = perplexity([torch.from_numpy(score_document(model, ids, args.segment_length)) for ids in docs])
        loop = side.perplexity(docs, point, alpha, bias_alpha, args.segment_length)
        checks[point] = {"step_size": alpha, "package": round(package, 4), "loop": round(loop, 4),
                         "relative_difference": abs(package - loop) / package}
        print(f"check {point} at alpha {alpha:g}: package {package:.4f}, this loop {loop:.4f}", flush=True)
        if checks[point]["relative_difference"] > 1e-3:
            raise SystemExit(f"the loop's {point!r} update does not match the package's FWL: {checks[point]}")
    return checks


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="checkpoints/smollm2-135m", help="the untouched base (tokenizer too)")
    p.add_argument("--fwl_model", default=None, help="instead: a trained output-side FWL (finetune_fwl's "
                   "base_fwl/final, E and c fast), scored with its learned step sizes times --step_sizes")
    p.add_argument("--data_dir", default="data/wiki")
    p.add_argument("--split", default="valid", help="the file <split>.txt of --data_dir (never tune on test)")
    p.add_argument("--documents", type=int, default=2)
    p.add_argument("--max_length", type=int, default=2048)
    p.add_argument("--segment_length", type=int, default=128)
    p.add_argument("--step_sizes", nargs="+", type=float, default=None, help="alphas (with --fwl_model: factors "
                   "on its learned ones); default 1e-5 3e-5 1e-4 3e-4 (with --fwl_model: 1)")
    p.add_argument("--check_step_size", type=float, default=3e-5, help="alpha of the check against the package")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--output", default=None)
    args = p.parse_args(argv)
    if args.step_sizes is None:
        args.step_sizes = [1.0] if args.fwl_model else [1e-5, 3e-5, 1e-4, 3e-4]
    return args


def main(argv: Optional[List[str]] = None) -> Dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    docs = encode_documents(tokenizer, read_documents(Path(args.data_dir) / f"{args.split}.txt")[: args.documents],
                            args.max_length)
    side = OutputSide(args, docs)
    started = time.perf_counter()
    results: Dict[str, Dict[str, float]] = {"slow_weights_only": {"0": side.perplexity(docs, "slow", 0.0, 0.0)}}
    for point in GRADIENT_POINTS:
        results[point] = {}
        for step in args.step_sizes:
            alpha, bias_alpha = (side.alphas[0] * step, side.alphas[1] * step) if side.alphas else (step, None)
            results[point][repr(step)] = round(side.perplexity(docs, point, alpha, bias_alpha, args.segment_length), 4)
            print(f"{point:<28} step {step:<7g} perplexity {results[point][repr(step)]:.4f}", flush=True)
    check = check_against_package(side, docs, args)
    best = {point: min(results[point].items(), key=lambda kv: kv[1]) for point in GRADIENT_POINTS}
    record = {
        "command": "python " + " ".join(sys.argv if argv is None else [__file__, *argv]), "args": vars(args),
        "tokens": sum(d.numel() - 1 for d in docs),
        "learned_step_sizes": side.alphas, "base_perplexity": round(results.pop("slow_weights_only")["0"], 4),
        "perplexity": results, "best": {k: {"step_size": float(a), "perplexity": v} for k, (a, v) in best.items()},
        "check": check, "seconds": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(record["best"], indent=1))
    if args.output:
        Path(args.output).write_text(json.dumps(record, indent=1) + "\n")
    return record


if __name__ == "__main__":
    main()
