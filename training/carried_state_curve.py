"""Does a language model's carried state help or hurt as it absorbs more text?

A split (one stream: every document followed by eos) is cut into consecutive segments of ``--segment_length`` tokens.
Each segment is scored twice by every model of ``--models``: with the state carried from the start of the split
(batch 1, the "+ full context" protocol of Irie et al. 2021, sec. 4.1 and appendix A.1) and from an empty state (the
segment alone). The difference per segment, averaged over buckets of segments that double in length (segment 0,
1, 2-3, 4-7, ...), is the loss the carried state adds (positive) or saves (negative) after that many tokens.
Segment 0 is the same text read the same way in both, so its difference is 0.

    python -m training.carried_state_curve --models outputs/lm_table/runs/recurrent_delta_net_seed0/model \\
        outputs/lm_table/runs/recurrent_delta_net_full_context_seed0/model --output docs/results/curve.json
"""
from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from .arguments import parse_arguments, require_positive
from .dynamic_eval import score_segments
from .result_file import RunRecord
from .train_transfo_xl import encode_stream, read_documents

logger = logging.getLogger("training.carried_state_curve")


@dataclass
class CurveArguments:
    """The models, the split, the segments."""

    models: List[str] = field(metadata={"help": "saved models (folders with their tokenizer), one curve each"})
    data_dir: str = field(default="data/wiki", metadata={"help": "prepared corpus (training.data layout)"})
    split: str = field(default="valid", metadata={"help": "valid or test"})
    segment_length: int = field(default=256, metadata={"help": "tokens per segment (the training span)"})
    max_tokens: Optional[int] = field(default=None, metadata={"help": "score only the first N tokens of the split"})
    output: Optional[str] = field(default=None, metadata={"help": "a JSON results file (RunRecord)"})


def segment_losses(model: PreTrainedModel, ids: torch.Tensor, segment_length: int) -> Dict[str, List[float]]:
    """Mean loss of every segment of the stream ``ids [N]``, ``{"carried": [S], "empty": [S]}``: segment i is
    ``ids[i*L : (i+1)*L]`` predicting the token after each position (the last segment may be shorter), scored by
    ``dynamic_eval.score_segments`` over the whole stream (carried) and over the segment alone (empty)."""
    carried = [nll / n for nll, n, _ in score_segments(model, ids[None], segment_length)]
    empty = []
    for start in range(0, ids.numel() - 1, segment_length):
        nll, n, _ = next(score_segments(model, ids[None, start : start + segment_length + 1], segment_length))
        empty.append(nll / n)
    return {"carried": carried, "empty": empty}


def doubling_buckets(losses: Dict[str, List[float]]) -> List[Dict[str, Any]]:
    """Mean carried and empty-state loss over segments 0, 1, 2-3, 4-7, ... (the last bucket: what remains)."""
    buckets, first = [], 0
    while first < len(losses["carried"]):
        last = min(2 * first - 1 if first else 0, len(losses["carried"]) - 1)
        carried = losses["carried"][first : last + 1]
        empty = losses["empty"][first : last + 1]
        mean_carried, mean_empty = sum(carried) / len(carried), sum(empty) / len(empty)
        buckets.append({"segments": [first, last], "carried": mean_carried, "empty": mean_empty,
                        "difference": mean_carried - mean_empty})
        first = last + 1
    return buckets


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """Scores every model; returns (and writes to ``--output``) ``{"models": {path: {"buckets", "segments"}}}``."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_arguments((CurveArguments,), argv, description=__doc__)
    require_positive(args, ("segment_length", "max_tokens"))
    if args.split not in ("valid", "test"):
        raise ValueError(f"--split must be valid or test, got {args.split!r}")
    record = RunRecord.start("python -m training.carried_state_curve", argv)
    documents = read_documents(Path(args.data_dir) / f"{args.split}.txt")
    results: Dict[str, Any] = {}
    for path in args.models:
        tokenizer = AutoTokenizer.from_pretrained(path)
        ids = encode_stream(tokenizer, documents)[: args.max_tokens]
        losses = segment_losses(AutoModelForCausalLM.from_pretrained(path), ids, args.segment_length)
        results[path] = {"tokens": int(ids.numel()), "buckets": doubling_buckets(losses), "segments": losses}
        for b in results[path]["buckets"]:
            logger.info("%s segments %d-%d: carried %.3f, empty state %.3f, difference %+.3f", path,
                        *b["segments"], b["carried"], b["empty"], b["difference"])
    output = {"split": args.split, "segment_length": args.segment_length, "models": results}
    if args.output:
        record.write(Path(args.output), output)
    return output


if __name__ == "__main__":
    main()
