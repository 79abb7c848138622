"""Scans of the recurrent Fast Weight Programmers (Irie, Schlag, Csordas, Schmidhuber 2021, sec. 3.2, app. A.2).

Two sequential recurrences that no chunkwise trick parallelises, because a nonlinearity of the previous
output feeds the next step:

* :func:`fast_rnn_scan` - the recurrent part of the Delta RNN and the Delta LSTM. Per head, G fast
  weight matrices ``R_g [D, D]`` (G = 1 for the RNN, 3 for the LSTM's gates i, u, o) are written with
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

* :func:`recurrent_delta_rule` - the Recurrent Delta Net (eqs. 15-18): the slow net's keys, queries,
  values and betas also read ``tanh(y_{t-1})`` through per-head slow matrices::

      h = tanh(y_{t-1})
      q_t = softmax(q_t' + R_q h),  k_t = softmax(k_t' + R_k h),  v_t = v_t' + R_v h,
      beta_t = sigmoid(beta_t' + r_beta . h)
      W_t = W_{t-1} + beta_t (v_t - W_{t-1} k_t) k_t^T ;  y_t = W_t q_t

  Here the kernel applies the activations itself (they sit inside the recurrence); its q, k, v, beta
  inputs are the slow net's feedforward parts ``W_* x_t``.

Layout (head-first, as ``delta_rule``): ``[B, H, T, D]``, gates next to heads ``[B, H, G, T, D]``;
fast weights ``[B, H, (G,) D, D]`` read as ``y = R x``, kept in float32 (float64 for float64 inputs).
An optional ``mask [B, T]`` (1 = token, 0 = padding) makes padded positions leave every state
unchanged: fast weights, previous output and cell carry through, and the output there is ``y_{t-1}``.

Modes: "recurrent" is the PyTorch step loop (the ground truth, differentiated by autograd); "fused" is
the compiled kernel - C++ on CPU (built on first use with ``torch.utils.cpp_extension.load``, cached in
``$FWP_KERNELS_BUILD_DIR`` or ``~/.cache/fwp_kernels``), Triton on CUDA - whose custom backward
recomputes the fast weights by undoing the updates (``R_{t-1} = R_t - delta_t k_t^T``) instead of
storing one per step; "auto" takes "fused" when available and falls back to the step loop (silently when
``FWP_KERNELS_NO_BUILD=1`` or when no C++ compiler / ninja is installed, with one warning when a build fails;
:func:`cpu_kernel_status` says which path runs). A saved model folder carries the C++ source (as
``rfwp_scan.cpp`` and as the string of ``rfwp_scan_csrc.py``, written by ``modeling_fwp.remote_code``) and builds
it the same way, into the same cache. Equations and backward: kernels/README.md.
"""
from __future__ import annotations

from pathlib import Path
from typing import NamedTuple, Optional, Tuple

import torch

from .cpp_build import CompiledCpuKernel

CELLS = ("rnn_a", "rnn_b", "lstm_a", "lstm_b", "lstm_c", "lstm_d")
MODES = ("auto", "recurrent", "fused")
_CELL_ID = {name: i for i, name in enumerate(CELLS)}  # the C++ enum `Cell`
_SOURCE = Path(__file__).resolve().parent / "csrc" / "rfwp_scan.cpp"


class ScanState(NamedTuple):
    """Recurrent state of a scan (batch first).

    fast_weight: ``[B, H, G, D, D]`` (fast_rnn_scan) or ``[B, H, D, D]`` (recurrent_delta_rule).
    output: the last output ``y [B, H, D]``. cell: the LSTM cell ``c [B, H, D]`` (None otherwise).
    As an initial state, any field may be None (zeros).
    """

    fast_weight: Optional[torch.Tensor] = None
    output: Optional[torch.Tensor] = None
    cell: Optional[torch.Tensor] = None


# ---------------------------------------------------------------------------------------------------------------
# step-loop references (ground truth; autograd differentiates them)
# ---------------------------------------------------------------------------------------------------------------


def _keep(mask: Optional[torch.Tensor], t: int, like: torch.Tensor) -> Optional[torch.Tensor]:
    """``mask[:, t]`` as a boolean broadcastable against `like` ``[B, ...]`` (None when there is no mask)."""
    if mask is None:
        return None
    return (mask[:, t] != 0).view(-1, *([1] * (like.dim() - 1)))


def _carry(keep: Optional[torch.Tensor], new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    return new if keep is None else torch.where(keep, new, old)


def _delta_write(R: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """``R + beta (v - R k) k^T`` for ``R [..., D, D]``, k, v ``[..., D]``, beta ``[...]``."""
    v_old = (R @ k.unsqueeze(-1)).squeeze(-1)
    return R + (beta.unsqueeze(-1) * (v - v_old)).unsqueeze(-1) * k.unsqueeze(-2)


def fast_rnn_scan_reference(
    z: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, cell: str,
    R: torch.Tensor, y: torch.Tensor, c: torch.Tensor, mask: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step loop of :func:`fast_rnn_scan` in the accumulation dtype.

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
        R_new = _delta_write(R, k[:, :, :, t], v[:, :, :, t], beta[:, :, :, t])
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
            c = _carry(_keep(mask, t, c), c_new, c)
        R = _carry(_keep(mask, t, R), R_new, R)
        y = _carry(_keep(mask, t, y), y_new, y)
        outputs.append(y)
    return torch.stack(outputs, dim=2), R, c


def recurrent_delta_rule_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
    r_q: torch.Tensor, r_k: torch.Tensor, r_v: torch.Tensor, r_beta: torch.Tensor,
    W: torch.Tensor, y: torch.Tensor, mask: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Step loop of :func:`recurrent_delta_rule` in the accumulation dtype.

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
        W_new = _delta_write(W, k_t, v_t, beta_t)
        y_new = (W_new @ q_t.unsqueeze(-1)).squeeze(-1)
        W = _carry(_keep(mask, t, W), W_new, W)
        y = _carry(_keep(mask, t, y), y_new, y)
        outputs.append(y)
    return torch.stack(outputs, dim=2), W


# ---------------------------------------------------------------------------------------------------------------
# the compiled CPU kernel
# ---------------------------------------------------------------------------------------------------------------

try:  # inside a saved model folder the C++ source travels as a string (transformers copies only Python modules)
    from .rfwp_scan_csrc import CPP_SOURCE as _EMBEDDED_SOURCE
except ImportError:  # the installed package: the source is csrc/rfwp_scan.cpp
    _EMBEDDED_SOURCE = None
_CPU_KERNEL = CompiledCpuKernel(
    _SOURCE, _EMBEDDED_SOURCE, "fwp_rfwp", "fast_rnn_forward", ["-O3", "-fopenmp-simd"],
    "the PyTorch step loop (much slower)",
)


def cpu_kernel_status() -> str:
    """Which CPU path the scans take, for reports: ``"built"`` (the C++ ops), ``"disabled (...)"``,
    ``"unavailable (...)"`` (no toolchain or no source), ``"failed (...)"`` (the build failed) - all three run the
    step loop - or ``"not tried yet"`` (no scan has run on CPU in this process)."""
    return _CPU_KERNEL.status


def cpu_kernel_available() -> bool:
    """Builds (once per source version, cached on disk; see ``cpp_build``) and loads the C++ scans; False when it
    cannot, and the step loop runs (silently when disabled or without a toolchain, with a warning on a failed build).
    """
    return _CPU_KERNEL.available()


def _cpu_ops():
    return torch.ops.fwp_rfwp


def _triton_ops():
    from . import triton_rfwp  # needs triton; imported lazily (CUDA, or TRITON_INTERPRET=1 in tests)

    return triton_rfwp


def _triton_available() -> bool:
    try:
        _triton_ops()
    except ImportError:
        return False
    return True


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


# ---------------------------------------------------------------------------------------------------------------
# public API
# ---------------------------------------------------------------------------------------------------------------


def _acc_dtype(*xs: Optional[torch.Tensor]) -> torch.dtype:
    return torch.float64 if any(x is not None and x.dtype == torch.float64 for x in xs) else torch.float32


def _check_tensor(name: str, x, shape: tuple) -> None:
    if not isinstance(x, torch.Tensor) or tuple(x.shape) != tuple(shape):
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"`{name}` must have shape {tuple(shape)}, got {got}")


def _check_mode_and_mask(mode: str, mask, B: int, T: int) -> None:
    if mode not in MODES:
        raise ValueError(f"`mode` must be one of {MODES}, got {mode!r}")
    if mask is not None:
        _check_tensor("mask", mask, (B, T))


def _backend(mode: str, device: torch.device):
    """The fused backend for `device` (C++ ops on CPU, Triton on CUDA), or None for the step loop."""
    if mode == "recurrent":
        return None
    if device.type == "cpu" and cpu_kernel_available():
        return _cpu_ops()
    if device.type == "cuda" and _triton_available():
        return _triton_ops()
    if mode == "fused":
        raise NotImplementedError(f"no fused recurrent FWP scan is available for device {device.type!r}")
    return None


def _prepare(x: Optional[torch.Tensor], shape: tuple, dtype: torch.dtype, like: torch.Tensor) -> torch.Tensor:
    return like.new_zeros(shape, dtype=dtype) if x is None else x.to(dtype).contiguous()


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
    _check_tensor("k", k, z.shape)
    _check_tensor("v", v, z.shape)
    _check_tensor("beta", beta, (B, H, G, T))
    _check_mode_and_mask(mode, mask, B, T)
    state = initial_state or ScanState()
    if state.fast_weight is not None:
        _check_tensor("initial_state.fast_weight", state.fast_weight, (B, H, G, D, D))
    for name in ("output", "cell"):
        if getattr(state, name) is not None:
            _check_tensor(f"initial_state.{name}", getattr(state, name), (B, H, D))

    acc = _acc_dtype(z, k, v, beta, *state)
    R0 = _prepare(state.fast_weight, (B, H, G, D, D), acc, z)
    y0 = _prepare(state.output, (B, H, D), acc, z)
    c0 = _prepare(state.cell, (B, H, D), acc, z) if lstm else z.new_empty(0, dtype=acc)
    if T == 0:
        y, c_T = z.new_zeros(B, H, 0, D), c0
        R_T, y_T = R0, y0
    else:
        ops = _backend(mode, z.device)
        inputs = [x.to(acc).contiguous() for x in (z, k, v, beta)]
        m = mask.to(acc).contiguous() if mask is not None else None
        if ops is None:
            y, R_T, c_T = fast_rnn_scan_reference(*inputs, cell, R0, y0, c0, m)
        else:
            y, c_all, R_T = _FastRNNScanFunction.apply(*inputs, R0, y0, c0, m, _CELL_ID[cell], ops)
            c_T = c_all[:, :, -1] if lstm else None
        y_T = y[:, :, -1]
    final = ScanState(R_T, y_T, c_T if lstm else None) if output_final_state else None
    return y.to(z.dtype), final


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
        mask, output_final_state, mode: as in :func:`fast_rnn_scan`.
    Returns:
        ``(y [B, H, T, D] in q's dtype, final ScanState(fast_weight, output) or None)``.
    """
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise ValueError(f"`q` must be a 4-D tensor [B, H, T, D], got {getattr(q, 'shape', type(q))}")
    B, H, T, D = q.shape
    _check_tensor("k", k, q.shape)
    _check_tensor("v", v, q.shape)
    _check_tensor("beta", beta, (B, H, T))
    for name, x in (("r_q", r_q), ("r_k", r_k), ("r_v", r_v)):
        _check_tensor(name, x, (H, D, D))
    _check_tensor("r_beta", r_beta, (H, D))
    _check_mode_and_mask(mode, mask, B, T)
    state = initial_state or ScanState()
    if state.fast_weight is not None:
        _check_tensor("initial_state.fast_weight", state.fast_weight, (B, H, D, D))
    if state.output is not None:
        _check_tensor("initial_state.output", state.output, (B, H, D))

    acc = _acc_dtype(q, k, v, beta, r_q, state.fast_weight, state.output)
    W0 = _prepare(state.fast_weight, (B, H, D, D), acc, q)
    y0 = _prepare(state.output, (B, H, D), acc, q)
    if T == 0:
        y, W_T, y_T = q.new_zeros(B, H, 0, D), W0, y0
    else:
        ops = _backend(mode, q.device)
        inputs = [x.to(acc).contiguous() for x in (q, k, v, beta, r_q, r_k, r_v, r_beta)]
        m = mask.to(acc).contiguous() if mask is not None else None
        if ops is None:
            y, W_T = recurrent_delta_rule_reference(*inputs, W0, y0, m)
        else:
            y, W_T = _RecurrentDeltaRuleFunction.apply(*inputs, W0, y0, m, ops)
        y_T = y[:, :, -1]
    final = ScanState(W_T, y_T, None) if output_final_state else None
    return y.to(q.dtype), final
