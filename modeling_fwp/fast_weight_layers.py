"""Fast-weight layers: what distinguishes one model of the family from another.

Every layer has the same interface, called by the shared backbone (``modeling_fwp.FastWeightBlock``)::

    forward(hidden_states [B, T, D], state: dict | None, token_mask [B, T] | None) -> (output [B, T, D], state)

``state`` is the layer's recurrent state (a dict of batch-first tensors, see ``FastWeightCache``);
``token_mask`` is 1.0 for real tokens and 0.0 for padding: padded positions must never write the state.
New layers register themselves in ``FAST_WEIGHT_LAYERS`` under the name a config's ``fast_weight_layer``
attribute selects.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from fwp_kernels import delta_rule, linear_attention
from torch import nn


from .feature_maps import FeatureMap

FAST_WEIGHT_LAYERS: Dict[str, type] = {}
State = Optional[Dict[str, torch.Tensor]]


def register_fast_weight_layer(name: str) -> Callable[[type], type]:
    """Class decorator: makes a fast-weight layer selectable with ``config.fast_weight_layer = name``."""

    def wrap(cls):
        FAST_WEIGHT_LAYERS[name] = cls
        return cls

    return wrap


def split_heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``[B, T, H * d] -> [B, H, T, d]``."""
    B, T, _ = x.shape
    return x.view(B, T, num_heads, -1).transpose(1, 2)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """``[B, H, T, d] -> [B, T, H * d]``."""
    B, H, T, d = x.shape
    return x.transpose(1, 2).reshape(B, T, H * d)


@register_fast_weight_layer("linear")
class FastWeightLinearAttention(nn.Module):
    """Linear Transformer / Delta Net layer: slow net feedforward, fast net linear (Schlag et al. 2021).

    Slow projections (eq. 4): ``k_t, v_t, q_t = W_k x_t, W_v x_t, W_q x_t`` per head; for the delta rule also
    ``beta_t = sigmoid(W_beta x_t)`` (eq. 21). The fast weight W [Dv, Dk] is written with the sum rule
    (eq. 17) or the delta rule (eqs. 20-24: ``W_t = W_{t-1} + beta_t (v_t - v_bar_t) phi(k_t)^T``,
    ``v_bar_t = W_{t-1} phi(k_t)``) and read with ``y_t = W_t phi(q_t)`` (eq. 25).

    Attention normalisation (sec. 3.2 eqs. 18-19 for the sum rule; sec. 4.2 eqs. 26-28 for the delta rule), with
    ``z_t = z_{t-1} + phi(k_t)``, ``z_0 = 0``: the output is ``y_t = W_t phi(q_t) / (z_t . phi(q_t))`` and, for the
    delta rule, the retrieved value is normalised as well, ``v_bar_t = W_{t-1} phi(k_t) / (z_{t-1} . phi(k_t))``
    with ``v_bar_1 = 0`` (eq. 27). A zero denominator gives 0 (``v_bar_t``, ``y_t``): its numerator is 0 too, since
    the feature map is non-negative and every column of W that ``phi(k_t)`` (or ``phi(q_t)``) reads is then zero.

    State: ``fast_weight [B, H, Dv, Dk]`` and, with attention normalisation, ``normalizer [B, H, 1, Dk]`` (z).
    """

    def __init__(self, config, layer_idx: int = 0) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.update_rule = config.update_rule
        self.attention_normalization = config.attention_normalization
        self.kernel_mode = config.kernel_mode
        self.chunk_size = config.chunk_size
        inner = self.num_heads * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, 3 * inner, bias=False)
        self.beta_proj = nn.Linear(config.hidden_size, self.num_heads, bias=True) if self.update_rule == "delta" else None
        self.o_proj = nn.Linear(inner, config.hidden_size, bias=False)
        self.feature_map = FeatureMap(config)

    def forward(
        self, hidden_states: torch.Tensor, state: State = None, token_mask: Optional[torch.Tensor] = None
    ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        q, k, v = (split_heads(x, self.num_heads) for x in self.qkv_proj(hidden_states).chunk(3, dim=-1))
        # eqs. 19 / 28 divide by z . phi(q): a positive factor of phi(q) cancels (FAVOR+ computes it without underflow)
        q, k = self.feature_map(q, rescale_dims=-1 if self.attention_normalization else None), self.feature_map(k)
        beta = torch.sigmoid(self.beta_proj(hidden_states)).transpose(1, 2) if self.beta_proj is not None else None
        if token_mask is not None:
            # Padded positions write nothing: phi(k) = 0 (and beta = 0) makes the update vanish.
            mask = token_mask.to(k.dtype)[:, None, :]
            k = k * mask[..., None]
            if beta is not None:
                beta = beta * mask
        state = state or {}
        kernel_kwargs = dict(output_final_state=True, mode=self.kernel_mode, chunk_size=self.chunk_size)
        if self.update_rule == "delta":
            if self.attention_normalization:
                v, beta = attention_normalized_delta_inputs(k, v, beta, state.get("normalizer"))
            out, fast_weight = delta_rule(q, k, v, beta, initial_state=state.get("fast_weight"), **kernel_kwargs)
        else:
            out, fast_weight = linear_attention(q, k, v, initial_state=state.get("fast_weight"), **kernel_kwargs)
        new_state = {"fast_weight": fast_weight}
        if self.attention_normalization:
            # z_t . phi(q_t) is linear attention with a constant value 1 (eqs. 18-19, 26, 28).
            ones = v.new_ones(v.shape[:-1] + (1,))
            denominator, normalizer = linear_attention(q, k, ones, initial_state=state.get("normalizer"), **kernel_kwargs)
            out = out / torch.where(denominator > 0, denominator, torch.ones_like(denominator))
            new_state["normalizer"] = normalizer
        return self.o_proj(merge_heads(out)), new_state


def attention_normalized_delta_inputs(
    k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, normalizer: Optional[torch.Tensor] = None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The delta rule's value and learning rate that make ``fwp_kernels.delta_rule`` compute eq. 27's update.

    With ``s_t = z_{t-1} . phi(k_t)`` (``z_{t-1}`` = the carried normalizer plus ``sum_{j<t} phi(k_j)``), Schlag et al.
    2021 eqs. 24 and 27 give ``W_t = W_{t-1} + beta_t (v_t - W_{t-1} phi(k_t) / s_t) phi(k_t)^T``, which is the plain
    delta rule with ``beta'_t = beta_t / s_t`` and ``v'_t = s_t v_t``. Where ``s_t = 0`` (the first token, keys so far
    all zero, a key that shares no non-zero feature with the earlier ones, a padded position) ``v_bar_t = 0`` as the
    paper defines it (``v_bar_1 = 0``); ``W_{t-1} phi(k_t)`` is 0 there too (non-negative features), so
    ``beta'_t = beta_t`` and ``v'_t = v_t`` give that update. An ``s_t`` below the smallest normal float (where
    ``1 / s_t`` could overflow) is treated the same; ``W_{t-1} phi(k_t)`` is then of that tiny size as well.

    Args:
        k: ``[B, H, T, Dk]`` feature-mapped keys (zero at padded positions).
        v: ``[B, H, T, Dv]``.
        beta: ``[B, H, T]``.
        normalizer: ``[B, H, 1, Dk]``, z after the tokens already seen, or None (``z_0 = 0``).
    Returns:
        ``(v' [B, H, T, Dv], beta' [B, H, T])`` in float32 (float64 for float64 keys), the kernels' accumulation
        dtype: ``1 / s_t`` and ``s_t v_t`` may leave float16's range.
    """
    acc = torch.promote_types(k.dtype, torch.float32)
    kf = k.to(acc)
    z_prev = F.pad(kf[:, :, :-1], (0, 0, 1, 0)).cumsum(2)  # sum_{j<t} phi(k_j)
    if normalizer is not None:
        z_prev = z_prev + normalizer.to(acc)
    s = (z_prev * kf).sum(-1)  # [B, H, T]
    s = torch.where(s >= torch.finfo(acc).tiny, s, torch.ones_like(s))
    return v.to(acc) * s[..., None], beta.to(acc) / s
