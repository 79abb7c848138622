"""The Recurrent Delta Net's recurrence (Irie, Schlag, Csordas, Schmidhuber 2021, eqs. 15-18), every kernel of it.

The slow net's keys, queries, values and betas also read ``tanh(y_{t-1})`` through per-head slow matrices::

    h = tanh(y_{t-1})
    q_t = softmax(q_t' + R_q h),  k_t = softmax(k_t' + R_k h),  v_t = v_t' + R_v h,
    beta_t = sigmoid(beta_t' + r_beta . h)
    W_t = W_{t-1} + beta_t (v_t - W_{t-1} k_t) k_t^T ;  y_t = W_t q_t

Here the kernel applies the activations itself (they sit inside the recurrence); its q, k, v, beta inputs are the
slow net's feedforward parts ``W_* x_t``.

Modes (``dispatch.MODES``): "recurrent" (:func:`recurrent_delta_rule_reference`), "fused" (the C++ / Triton kernels
of ``rfwp_scan``, whose backward undoes the writes), "auto" (fused when available). Layout, padding and dtypes:
``rfwp_scan``.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .dispatch import Recurrence, acc_dtype, check_mode, check_tensor, register, select_kernel
from .rfwp_scan import (
    DESCRIPTION,
    ScanState,
    auto_mode,
    carry,
    check_initial_state,
    delta_write,
    fused_kernel,
    keep_mask,
    state_or_zeros,
)


def recurrent_delta_rule_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
    r_q: torch.Tensor, r_k: torch.Tensor, r_v: torch.Tensor, r_beta: torch.Tensor,
    W: torch.Tensor, y: torch.Tensor, mask: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Step loop of :func:`recurrent_delta_rule` in the accumulation dtype (the ground truth; autograd
    differentiates it).

    Args:
        q, k, v: ``[B, H, T, D]``; beta: ``[B, H, T]``; r_q, r_k, r_v: ``[H, D, D]``; r_beta: ``[H, D]``
            (as in :func:`recurrent_delta_rule`).
        W: ``[B, H, D, D]`` initial fast weights; y: ``[B, H, D]`` initial output.
        mask: ``[B, T]``, 0 at padded positions.
    Returns:
        ``(y [B, H, T, D], W_T [B, H, D, D])``.
    """
    outputs = []
    for t in range(q.shape[2]):
        h = torch.tanh(y)  # [B, H, D]
        rec = lambda R: torch.einsum("hij,bhj->bhi", R, h)  # noqa: E731  (R_x tanh(y_{t-1}), per head)
        q_t = torch.softmax(q[:, :, t] + rec(r_q), -1)
        k_t = torch.softmax(k[:, :, t] + rec(r_k), -1)
        v_t = v[:, :, t] + rec(r_v)
        beta_t = torch.sigmoid(beta[:, :, t] + (r_beta * h).sum(-1))
        W_new = delta_write(W, k_t, v_t, beta_t)
        y_new = (W_new @ q_t.unsqueeze(-1)).squeeze(-1)
        W = carry(keep_mask(mask, t, W), W_new, W)
        y = carry(keep_mask(mask, t, y), y_new, y)
        outputs.append(y)
    return torch.stack(outputs, dim=2), W


class _RecurrentDeltaRuleFunction(torch.autograd.Function):
    """Fused Recurrent Delta Net scan; `ops` is the backend module (C++ ops or the Triton wrappers)."""

    @staticmethod
    def forward(ctx, q, k, v, beta, r_q, r_k, r_v, r_beta, W0, y0, mask, ops):
        B, H, T, D = q.shape
        W = W0.clone()
        y = q.new_empty(B, H, T, D)
        qs, ks, vs, v_old = (q.new_zeros(B, H, T, D) for _ in range(4))
        bs = q.new_zeros(B, H, T)
        ops.rdn_forward(q, k, v, beta, r_q, r_k, r_v, r_beta, W, y0, mask, y, qs, ks, vs, bs, v_old)
        ctx.save_for_backward(r_q, r_k, r_v, r_beta, W, y0, mask, y, qs, ks, vs, bs, v_old)
        ctx.ops = ops
        return y, W

    @staticmethod
    def backward(ctx, gy, gW):
        r_q, r_k, r_v, r_beta, W_final, y0, mask, y, qs, ks, vs, bs, v_old = ctx.saved_tensors
        B, H, T, D = y.shape
        gy = gy.contiguous() if gy is not None else torch.zeros_like(y)
        W = W_final.clone()
        dW = gW.clone() if gW is not None else torch.zeros_like(W)
        gq, gk, gv = (torch.zeros_like(y) for _ in range(3))
        gbeta = torch.zeros_like(bs)
        gRq, gRk, gRv = (y.new_zeros(B, H, D, D) for _ in range(3))  # per-sequence sums
        grb = y.new_zeros(B, H, D)
        gy0 = torch.empty_like(y0)
        ctx.ops.rdn_backward(
            gy, W, dW, r_q, r_k, r_v, r_beta, y0, mask, y, qs, ks, vs, bs, v_old,
            gq, gk, gv, gbeta, gRq, gRk, gRv, grb, gy0,
        )
        return gq, gk, gv, gbeta, gRq.sum(0), gRk.sum(0), gRv.sum(0), grb.sum(0), dW, gy0, None, None


def _fused_recurrent_delta_rule(ops, q, k, v, beta, r_q, r_k, r_v, r_beta, W0, y0, mask):
    """The fused scan with backend `ops`; arguments and returns as :func:`recurrent_delta_rule_reference`."""
    return _RecurrentDeltaRuleFunction.apply(q, k, v, beta, r_q, r_k, r_v, r_beta, W0, y0, mask, ops)


RECURRENT_DELTA_RULE = register(
    Recurrence(
        "recurrent_delta_rule",
        reference=recurrent_delta_rule_reference,
        kernels={"fused": fused_kernel(_fused_recurrent_delta_rule)},
        auto=auto_mode,
        description=DESCRIPTION,
    )
)


def recurrent_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    r_q: torch.Tensor,
    r_k: torch.Tensor,
    r_v: torch.Tensor,
    r_beta: torch.Tensor,
    *,
    initial_state: Optional[ScanState] = None,
    mask: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    mode: str = "auto",
) -> Tuple[torch.Tensor, Optional[ScanState]]:
    """The Recurrent Delta Net layer's recurrence (module docstring for the equations).

    Args:
        q, k, v: ``[B, H, T, D]`` the slow net's feedforward parts ``W_q x_t``, ``W_k x_t``, ``W_v x_t``
            (before any activation); beta: ``[B, H, T]`` the feedforward part of beta's logit.
        r_q, r_k, r_v: ``[H, D, D]`` recurrent slow weights; r_beta: ``[H, D]``.
        initial_state: ``ScanState(fast_weight [B, H, D, D], output [B, H, D])``, fields None for zeros.
        mask, output_final_state, mode: as in :func:`fwp_kernels.fast_rnn_scan`.
    Returns:
        ``(y [B, H, T, D] in q's dtype, final ScanState(fast_weight, output) or None)``.
    """
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise ValueError(f"`q` must be a 4-D tensor [B, H, T, D], got {getattr(q, 'shape', type(q))}")
    B, H, T, D = q.shape
    for name, x, shape in (("k", k, q.shape), ("v", v, q.shape), ("beta", beta, (B, H, T)), ("r_q", r_q, (H, D, D)),
                           ("r_k", r_k, (H, D, D)), ("r_v", r_v, (H, D, D)), ("r_beta", r_beta, (H, D))):
        check_tensor(name, x, shape)
    check_mode(RECURRENT_DELTA_RULE, mode)
    if mask is not None:
        check_tensor("mask", mask, (B, T))
    state = initial_state or ScanState()
    check_initial_state(state, {"fast_weight": (B, H, D, D), "output": (B, H, D)})

    acc = acc_dtype(q, k, v, beta, r_q, state.fast_weight, state.output)
    W0 = state_or_zeros(state.fast_weight, (B, H, D, D), acc, q)
    y0 = state_or_zeros(state.output, (B, H, D), acc, q)
    if T == 0:
        y, W_T, y_T = q.new_zeros(B, H, 0, D), W0, y0
    else:
        kernel = select_kernel(RECURRENT_DELTA_RULE, mode, T, q.device)
        inputs = [x.to(acc).contiguous() for x in (q, k, v, beta, r_q, r_k, r_v, r_beta)]
        m = mask.to(acc).contiguous() if mask is not None else None
        y, W_T = kernel(*inputs, W0, y0, m)
        y_T = y[:, :, -1].clone()  # (a view would keep the whole output alive in the caller's state)
    final = ScanState(W_T, y_T, None) if output_final_state else None
    return y.to(q.dtype), final
