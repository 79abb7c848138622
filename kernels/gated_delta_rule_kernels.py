"""The gated delta rule (Yang, Kautz, Hatamizadeh 2025, "Gated Delta Networks", sec. 3.1), every kernel of it:

    W_t = a_t W_{t-1} + beta_t (v_t - a_t W_{t-1} k_t) k_t^T ;  a_t = exp(g_t) ;  o_t = W_t q_t

that is the delta rule (Schlag et al. 2021, eq. 24) applied to the decayed state ``a_t W_{t-1}`` (Mamba2's scalar
gate); ``g = 0`` is the delta rule.

Modes (``dispatch.MODES``): "recurrent" (:func:`gated_delta_rule_recurrent`, the step loop), "auto".

Layout (DESIGN.md kernel contract): q, k ``[B, H, T, Dk]``, v ``[B, H, T, Dv]``, beta and g ``[B, H, T]`` (g the log
of the decay, normally <= 0), fast weight state ``[B, H, Dv, Dk]`` (the paper's W, read as ``y = W q``), accumulated
in float32 (float64 when an input is float64).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .dispatch import (
    Recurrence,
    acc_dtype,
    check_fast_weight_inputs,
    initial_fast_weight,
    mask_positions,
    register,
    select_kernel,
)


def gated_delta_rule_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    chunk_size: Optional[int] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Gated delta rule, one step at a time (Yang et al. 2025, sec. 3.1): the reference of every other mode.

    Args:
        q, k: ``[B, H, T, Dk]``; v: ``[B, H, T, Dv]``; beta, g: ``[B, H, T]`` (g: log-decay).
        initial_state: ``[B, H, Dv, Dk]`` or None (zeros).
        chunk_size: ignored (every kernel of the gated delta rule takes the same arguments).
    Returns:
        o ``[B, H, T, Dv]`` in q's dtype, and the final state ``[B, H, Dv, Dk]`` (float32; float64 for
        float64 inputs) or None.
    """
    acc = acc_dtype(q, k, v, beta, g, initial_state)
    W = initial_fast_weight(q, v, initial_state, acc)
    qf, kf, vf, bf, af = q.to(acc), k.to(acc), v.to(acc), beta.to(acc), g.to(acc).exp()
    outputs = []
    for t in range(q.shape[2]):
        k_t = kf[:, :, t]  # [B, H, Dk]
        # the decayed state a_t W_{t-1}, then the delta rule on it (sec. 3.1)
        W = af[:, :, t, None, None] * W
        v_old = torch.einsum("bhvk,bhk->bhv", W, k_t)  # a_t W_{t-1} k_t
        delta = bf[:, :, t, None] * (vf[:, :, t] - v_old)
        W = W + delta[..., :, None] * k_t[..., None, :]
        outputs.append(torch.einsum("bhvk,bhk->bhv", W, qf[:, :, t]))  # o_t = W_t q_t
    o = torch.stack(outputs, dim=2) if outputs else vf.new_zeros(vf.shape)
    return o.to(q.dtype), (W if output_final_state else None)


GATED_DELTA_RULE = register(
    Recurrence(
        "gated_delta_rule",
        reference=gated_delta_rule_recurrent,
        auto=lambda T, device: "recurrent",
    )
)


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor,
    *,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    mode: str = "auto",
    chunk_size: int = 64,
    mask: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Gated delta rule fast weights: ``W_t = a_t W_{t-1} + beta_t (v_t - a_t W_{t-1} k_t) k_t^T``,
    ``a_t = exp(g_t)``, ``o_t = W_t q_t``.

    Args:
        q, k: ``[B, H, T, Dk]``; v: ``[B, H, T, Dv]``; beta: ``[B, H, T]``.
        g: ``[B, H, T]``, the log of the decay (normally <= 0; Gated DeltaNet: ``-exp(A_log) softplus(.)``).
        initial_state: ``[B, H, Dv, Dk]`` or None (zeros).
        output_final_state: return the final ``[B, H, Dv, Dk]`` float32 state.
        mode: "recurrent" (step loop) or "auto".
        chunk_size: chunk length for the chunkwise modes (any T works).
        mask: ``[B, T]`` or None; 0 marks padding, where k, beta and g are zeroed, so that the state neither
            decays nor is written (the outputs there are of no use).
    Returns:
        ``(o [B, H, T, Dv] in q's dtype, final_state or None)``.
    """
    check_fast_weight_inputs(q, k, v, initial_state, chunk_size, mask, beta=beta, g=g)
    kernel = select_kernel(GATED_DELTA_RULE, mode, q.shape[2], q.device)
    if mask is not None:
        k, beta, g = mask_positions(mask, k, beta, g)
    return kernel(q, k, v, beta, g, initial_state, output_final_state, chunk_size)
