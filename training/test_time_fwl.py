"""Test-time-only Fast Weight Layer (Clark et al. 2022 sec. 3, Table 2's "Test-time only" row, footnote 3: "a global
step size that is tuned on the dev set"): the FWL's fast update applied at inference to a model that was never
trained with it, here an untouched pretrained causal LM.

``build_test_time_fwl`` wraps the model in ``FWLForCausalLM(fwl_head_type="output")``: its own output side (final
norm, an untied copy of the output embedding E, a zero output bias c) becomes the FWL's slow net, so that with the
fast update off the wrapped model computes exactly the base model's logits. At every position t the fast parameters
are

    theta_t = theta - alpha * sum_{j<t} grad_theta CE(logits_j(theta), x_{j+1})            (Clark et al. sec. 2, eq. 1)

with one alpha for every fast tensor: dynamic evaluation (Krause et al.) of the output side, one token at a time,
with gradients taken at the slow weights, and computed as the trained FWL computes it (``modeling_fwp.fwl``: one
parallel linear attention per matrix, cumulative sums for vectors; the same ``FWLCache`` in generation).

Which parameters are fast (``TEST_TIME_FAST_PARAMETERS``): E and c by default; the final norm's gain may be added
(``OUTPUT_SIDE_FAST_PARAMETERS``, the head type's default). On SmolLM2-135M and 3 held-out Wikipedia articles of
2,048 tokens, step size chosen on valid (3e-5 for both), the gain adds nothing (perplexity 19.9068 with it, 19.9065
without, base 20.0203: docs/RESULTS.md) but costs two more vocabulary-sized products per position: a fast gain changes
the output layer's input, so its fast logits need their own product with E and the gain's gradient another, where
without it the fast logits are the slow logits plus the corrections (``FWLHead``'s shared z).
"""
from __future__ import annotations

import math
from typing import Any, Dict, Optional, Sequence, Union

import torch
from transformers import PreTrainedModel

from modeling_fwp import FWLForCausalLM
from modeling_fwp.fwl import FWLHead

# Global step sizes tried on the valid split: alpha multiplies a sum of per-token gradients (no 1/T), so it is about
# dynamic evaluation's per-segment SGD step divided by the segment length.
DEFAULT_STEP_SIZES = (1e-5, 3e-5, 1e-4, 3e-4)
# The fast parameters by default: the untied output embedding copy E and the output bias c (see the module docstring
# for why not the final norm's gain).
TEST_TIME_FAST_PARAMETERS = ("output_embedding.weight", "output_bias")


@torch.no_grad()
def set_global_step_size(head: FWLHead, step_size: float) -> None:
    """Sets every fast parameter's step size alpha of `head` to `step_size` (> 0): alpha = softplus(raw)."""
    if not isinstance(head, FWLHead):
        raise TypeError(f"`head` must be an FWLHead, got {type(head).__name__}")
    if not step_size > 0:
        raise ValueError(f"`step_size` must be > 0, got {step_size}")
    raw = step_size + math.log(-math.expm1(-step_size))  # inverse softplus
    head.raw_step_size.fill_(raw)


def build_test_time_fwl(
    model: Union[str, PreTrainedModel],
    step_size: float = 1e-4,
    fast_parameters: Optional[Sequence[str]] = None,
    base_model_kwargs: Optional[Dict[str, Any]] = None,
    gradient_dtype: Optional[str] = None,
    fast_vocabulary: str = "full",
    gradient_point: str = "slow",
    segment_length: Optional[int] = None,
) -> FWLForCausalLM:
    """The test-time-only FWL on a pretrained causal LM (a folder or hub name, or a loaded model, which is then
    modified: its final norm moves into the head), in eval mode with every parameter frozen.

    Args:
        model: the untouched base model.
        step_size: the global step size alpha (choose it on a validation split).
        fast_parameters: which output-side parameters are fast (default ``TEST_TIME_FAST_PARAMETERS``: the output
            embedding copy and the output bias; ``norm.weight`` adds the final norm's gain).
        base_model_kwargs: passed to ``AutoModelForCausalLM.from_pretrained`` when `model` is a path.
        gradient_dtype: None (exact) or "bfloat16": the dtype of the per-token gradients' vocabulary-sized part
            (``FWLConfig.fwl_gradient_dtype``, an approximation of the fast update for CPUs with bf16 matrix units).
        fast_vocabulary: "full" (Clark et al.) or "seen": the fast update only on the rows of the tokens seen so far
            (``FWLConfig.fwl_fast_vocabulary``; its products then cost a few thousand rows, not the vocabulary).
        gradient_point, segment_length: "slow" (Clark et al.) or "segment_start": the per-token gradients at the
            fast weights as of the start of each segment of `segment_length` tokens (``FWLConfig.fwl_gradient_point``,
            ``fwl_segment_length``), so that the update accumulates across segments as dynamic evaluation's does.
    """
    names = list(fast_parameters) if fast_parameters is not None else list(TEST_TIME_FAST_PARAMETERS)
    wrapped = FWLForCausalLM.from_base_pretrained(
        model, base_model_kwargs=base_model_kwargs, fwl_head_type="output", fwl_fast_parameters=names,
        fwl_step_size_init=step_size, fwl_gradient_dtype=gradient_dtype, fwl_fast_vocabulary=fast_vocabulary,
        fwl_gradient_point=gradient_point, fwl_segment_length=segment_length,
    )
    set_global_step_size(wrapped.fwl_head, step_size)
    wrapped.requires_grad_(False)
    return wrapped.eval()
