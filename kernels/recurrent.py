"""Step-loop reference kernels: the ground truth every other mode is tested against.

Layout (DESIGN.md kernel contract): q, k ``[B, H, T, Dk]``, v ``[B, H, T, Dv]``, beta ``[B, H, T]``,
fast weight state ``[B, H, Dv, Dk]`` (the paper's W, read as ``y = W q``), accumulated in float32
(float64 when an input is float64, which the tests use as an exact reference).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch


def _acc_dtype(*xs: Optional[torch.Tensor]) -> torch.dtype:
    """float32, or float64 when any input is float64: the state is never accumulated below fp32."""
    return torch.float64 if any(x is not None and x.dtype == torch.float64 for x in xs) else torch.float32


def _initial_state(
    q: torch.Tensor, v: torch.Tensor, initial_state: Optional[torch.Tensor], dtype: torch.dtype
) -> torch.Tensor:
    B, H, _, Dk = q.shape
    Dv = v.shape[-1]
    if initial_state is None:
        return q.new_zeros(B, H, Dv, Dk, dtype=dtype)
    return initial_state.to(dtype)


def delta_rule_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Delta rule, one step at a time (Schlag et al. 2021, sec. 4.2, eqs. 17-20).

    Args:
        q, k: ``[B, H, T, Dk]``; v: ``[B, H, T, Dv]``; beta: ``[B, H, T]``.
        initial_state: ``[B, H, Dv, Dk]`` or None (zeros).
    Returns:
        o ``[B, H, T, Dv]`` in q's dtype, and the final state ``[B, H, Dv, Dk]`` (float32; float64 for
        float64 inputs) or None.
    """
    acc = _acc_dtype(q, k, v, beta, initial_state)
    W = _initial_state(q, v, initial_state, acc)
    qf, kf, vf, bf = q.to(acc), k.to(acc), v.to(acc), beta.to(acc)
    outputs = []
    for t in range(q.shape[2]):
        k_t = kf[:, :, t]  # [B, H, Dk]
        # v_bar_t = W_{t-1} k_t : the value currently stored under key k_t (eq. 17)
        v_old = torch.einsum("bhvk,bhk->bhv", W, k_t)
        # W_t = W_{t-1} + beta_t (v_t - v_bar_t) k_t^T (eq. 19)
        delta = bf[:, :, t, None] * (vf[:, :, t] - v_old)
        W = W + delta[..., :, None] * k_t[..., None, :]
        # y_t = W_t q_t (eq. 20)
        outputs.append(torch.einsum("bhvk,bhk->bhv", W, qf[:, :, t]))
    o = torch.stack(outputs, dim=2) if outputs else vf.new_zeros(vf.shape)
    return o.to(q.dtype), (W if output_final_state else None)


def linear_attention_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Sum rule (linear attention), one step at a time (Schlag et al. 2021, sec. 3, eqs. 5-6).

    Args:
        q, k: ``[B, H, T, Dk]``; v: ``[B, H, T, Dv]``; initial_state: ``[B, H, Dv, Dk]`` or None.
    Returns:
        o ``[B, H, T, Dv]`` in q's dtype, and the final state (float32, float64 for float64 inputs) or None.
    """
    acc = _acc_dtype(q, k, v, initial_state)
    W = _initial_state(q, v, initial_state, acc)
    qf, kf, vf = q.to(acc), k.to(acc), v.to(acc)
    outputs = []
    for t in range(q.shape[2]):
        # W_t = W_{t-1} + v_t k_t^T (eq. 5);  y_t = W_t q_t (eq. 6)
        W = W + vf[:, :, t, :, None] * kf[:, :, t, None, :]
        outputs.append(torch.einsum("bhvk,bhk->bhv", W, qf[:, :, t]))
    o = torch.stack(outputs, dim=2) if outputs else vf.new_zeros(vf.shape)
    return o.to(q.dtype), (W if output_final_state else None)
