"""The fast RNN / LSTM scan: the recurrent part of the Delta RNN and the Delta LSTM (Irie, Schlag, Csordas,
Schmidhuber 2021, sec. 3.2, app. A.2), every kernel of it.

Per head, G fast weight matrices ``R_g [D, D]`` (G = 1 for the RNN, 3 for the LSTM's gates i, u, o) are written with
the delta rule from slow keys/values/betas, and read with the previous output::

    R_t = R_{t-1} + beta_t (v_t - R_{t-1} k_t) k_t^T
    a_t = z_t + R_t s_{t-1},   s_{t-1} = y_{t-1} (versions A) or softmax(y_{t-1}) (versions B-D)

``z_t = W_t q_t`` is the feedforward fast net's output (computed beforehand with ``delta_rule``).
Cells (the output ``y_t`` from ``a_t``):

======== ===================================================================================
rnn_a    y = softmax(a)                                         (Delta RNN A, eq. 19)
rnn_b    y = a                                                  (Delta RNN B, eq. 12)
lstm_a   i, u, o = sigmoid(a);  c = i u + (1 - i) c_{t-1};  y = softmax(o c)   (Delta LSTM A)
lstm_b   i, u, o = sigmoid(a);  c = ...;  y = o c                            (Delta LSTM B)
lstm_c   as lstm_b with y = o c + z_u                                        (Delta LSTM C)
lstm_d   i, o = sigmoid(a_i), sigmoid(a_o);  u = a_u;  c = ...;  y = o c    (Delta LSTM D)
======== ===================================================================================

Modes (``dispatch.MODES``): "recurrent" (:func:`fast_rnn_scan_reference`), "fused" (the C++ / Triton kernels of
``rfwp_scan``, whose backward undoes the writes), "auto" (fused when available). Layout, padding and dtypes:
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

CELLS = ("rnn_a", "rnn_b", "lstm_a", "lstm_b", "lstm_c", "lstm_d")
_CELL_ID = {name: i for i, name in enumerate(CELLS)}  # the C++ enum `Cell`


def fast_rnn_scan_reference(
    z: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, cell: str,
    R: torch.Tensor, y: torch.Tensor, c: torch.Tensor, mask: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step loop of :func:`fast_rnn_scan` in the accumulation dtype (the ground truth; autograd differentiates it).

    Args:
        z, k, v: ``[B, H, G, T, D]``; beta: ``[B, H, G, T]`` (as in :func:`fast_rnn_scan`).
        cell: one of ``CELLS``.
        R: ``[B, H, G, D, D]`` initial fast weights; y: ``[B, H, D]`` initial output; c: ``[B, H, D]`` initial cell.
        mask: ``[B, T]``, 0 at padded positions (every state carries through them).
    Returns:
        ``(y [B, H, T, D], R_T [B, H, G, D, D], c_T [B, H, D])`` (``y_T`` is ``y[:, :, -1]``).
    """
    T = z.shape[3]
    softmax_input = cell not in ("rnn_a", "lstm_a")
    outputs = []
    for t in range(T):
        s = torch.softmax(y, -1) if softmax_input else y
        # R_t = R_{t-1} + beta_t (v_t - R_{t-1} k_t) k_t^T ;  a_t = z_t + R_t s_{t-1}
        R_new = delta_write(R, k[:, :, :, t], v[:, :, :, t], beta[:, :, :, t])
        a = z[:, :, :, t] + (R_new @ s[:, :, None, :, None]).squeeze(-1)  # [B, H, G, D]
        if cell == "rnn_a":
            y_new = torch.softmax(a[:, :, 0], -1)
        elif cell == "rnn_b":
            y_new = a[:, :, 0]
        else:
            i, o = torch.sigmoid(a[:, :, 0]), torch.sigmoid(a[:, :, 2])
            u = a[:, :, 1] if cell == "lstm_d" else torch.sigmoid(a[:, :, 1])
            c_new = c + i * (u - c)  # c_t = i u + (1 - i) c_{t-1}
            y_new = o * c_new
            if cell == "lstm_a":
                y_new = torch.softmax(y_new, -1)
            elif cell == "lstm_c":
                y_new = y_new + z[:, :, 1, t]
            c = carry(keep_mask(mask, t, c), c_new, c)
        R = carry(keep_mask(mask, t, R), R_new, R)
        y = carry(keep_mask(mask, t, y), y_new, y)
        outputs.append(y)
    return torch.stack(outputs, dim=2), R, c


class _FastRNNScanFunction(torch.autograd.Function):
    """Fused fast RNN/LSTM scan; `ops` is the backend module (C++ ops or the Triton wrappers)."""

    @staticmethod
    def forward(ctx, z, k, v, beta, R0, y0, c0, mask, cell_id: int, ops):
        lstm = cell_id >= _CELL_ID["lstm_a"]
        B, H, G, T, D = z.shape
        R = R0.clone()
        y = z.new_empty(B, H, T, D)
        c = z.new_empty(B, H, T, D) if lstm else z.new_empty(0)
        act = z.new_zeros(B, H, 3, T, D) if lstm else z.new_empty(0)
        v_old = z.new_zeros(B, H, G, T, D)
        ops.fast_rnn_forward(z, k, v, beta, R, y0, c0, mask, cell_id, y, c, act, v_old)
        ctx.save_for_backward(k, v, beta, R, y0, c0, mask, y, c, act, v_old)
        ctx.cell_id, ctx.ops = cell_id, ops
        return y, c, R

    @staticmethod
    def backward(ctx, gy, gc, gR):
        k, v, beta, R_final, y0, c0, mask, y, c, act, v_old = ctx.saved_tensors
        lstm = ctx.cell_id >= _CELL_ID["lstm_a"]
        gy = gy.contiguous() if gy is not None else torch.zeros_like(y)
        gc = gc.contiguous() if (gc is not None and lstm) else None
        R = R_final.clone()  # undone step by step back to R_0
        dR = gR.clone() if gR is not None else torch.zeros_like(R)  # becomes dL/dR_0
        gz, gk, gv, gbeta = (torch.zeros_like(x) for x in (k, k, v, beta))
        gy0 = torch.empty_like(y0)
        gc0 = torch.empty_like(c0)
        ctx.ops.fast_rnn_backward(
            gy, gc, k, v, beta, R, dR, y0, c0, mask, y, c, act, v_old, ctx.cell_id, gz, gk, gv, gbeta, gy0, gc0
        )
        return gz, gk, gv, gbeta, dR, gy0, (gc0 if lstm else None), None, None, None


def _fused_fast_rnn_scan(ops, z, k, v, beta, cell: str, R0, y0, c0, mask):
    """The fused scan with backend `ops`; arguments and returns as :func:`fast_rnn_scan_reference` (c_T: None for the
    RNN cells)."""
    y, c_all, R_T = _FastRNNScanFunction.apply(z, k, v, beta, R0, y0, c0, mask, _CELL_ID[cell], ops)
    return y, R_T, (c_all[:, :, -1].clone() if cell.startswith("lstm") else None)


FAST_RNN_SCAN = register(
    Recurrence(
        "fast_rnn_scan",
        reference=fast_rnn_scan_reference,
        kernels={"fused": fused_kernel(_fused_fast_rnn_scan)},
        auto=auto_mode,
        description=DESCRIPTION,
    )
)


def fast_rnn_scan(
    z: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    *,
    cell: str = "rnn_b",
    initial_state: Optional[ScanState] = None,
    mask: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    mode: str = "auto",
) -> Tuple[torch.Tensor, Optional[ScanState]]:
    """The recurrent part of the Delta RNN / Delta LSTM (module docstring for the equations).

    Args:
        z: ``[B, H, G, T, D]`` feedforward fast net outputs ``W_t q_t`` (G = 1 for "rnn_*", 3 for "lstm_*",
            gates in the order i, u, o).
        k: ``[B, H, G, T, D]`` keys of the recurrent fast weights, already activated (the paper: softmax).
        v: ``[B, H, G, T, D]`` values; beta: ``[B, H, G, T]`` learning rates, already in (0, 1).
        cell: one of ``CELLS``.
        initial_state: ``ScanState(fast_weight [B, H, G, D, D], output [B, H, D], cell [B, H, D])``, fields None
            for zeros.
        mask: ``[B, T]``, 0 at padded positions (every state carries through them).
        output_final_state: return the final ``ScanState`` (float32, float64 for float64 inputs).
        mode: "auto", "recurrent" (step loop) or "fused".
    Returns:
        ``(y [B, H, T, D] in z's dtype, final ScanState or None)``.
    """
    if cell not in CELLS:
        raise ValueError(f"`cell` must be one of {CELLS}, got {cell!r}")
    if not isinstance(z, torch.Tensor) or z.dim() != 5:
        raise ValueError(f"`z` must be a 5-D tensor [B, H, G, T, D], got {getattr(z, 'shape', type(z))}")
    B, H, G, T, D = z.shape
    lstm = cell.startswith("lstm")
    if G != (3 if lstm else 1):
        raise ValueError(f"cell {cell!r} needs G = {3 if lstm else 1} gates in `z` [B, H, G, T, D], got G = {G}")
    for name, x, shape in (("k", k, z.shape), ("v", v, z.shape), ("beta", beta, (B, H, G, T))):
        check_tensor(name, x, shape)
    check_mode(FAST_RNN_SCAN, mode)
    if mask is not None:
        check_tensor("mask", mask, (B, T))
    state = initial_state or ScanState()
    check_initial_state(state, {"fast_weight": (B, H, G, D, D), "output": (B, H, D), "cell": (B, H, D)})

    acc = acc_dtype(z, k, v, beta, *state)
    R0 = state_or_zeros(state.fast_weight, (B, H, G, D, D), acc, z)
    y0 = state_or_zeros(state.output, (B, H, D), acc, z)
    c0 = state_or_zeros(state.cell, (B, H, D), acc, z) if lstm else z.new_empty(0, dtype=acc)
    if T == 0:
        y, R_T, y_T, c_T = z.new_zeros(B, H, 0, D), R0, y0, c0
    else:
        kernel = select_kernel(FAST_RNN_SCAN, mode, T, z.device)
        inputs = [x.to(acc).contiguous() for x in (z, k, v, beta)]
        m = mask.to(acc).contiguous() if mask is not None else None
        y, R_T, c_T = kernel(*inputs, cell, R0, y0, c0, m)
        y_T = y[:, :, -1].clone()  # (a view would keep the whole output alive in the caller's state)
    final = ScanState(R_T, y_T, c_T if lstm else None) if output_final_state else None
    return y.to(z.dtype), final
