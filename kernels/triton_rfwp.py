"""Triton versions of the recurrent FWP scans (same math and op signatures as kernels/csrc/rfwp_scan.cpp).

Imported lazily by kernels/rfwp_scan.py for CUDA tensors; importing this module needs `triton`. On CPU
the kernels run under the Triton interpreter (``TRITON_INTERPRET=1``, set before this module is
imported), which the tests use at tiny shapes.

One program per (batch, head) walks the sequence; the fast weight matrices of that sequence stay in
fp32 registers (``[BG, BD, BD]`` tiles: gates x values x keys, padded to powers of two, so keep
``head_dim`` small - the paper uses 16 - and add heads instead). Backward programs start from the
final fast weights and undo one delta rule write per step, as the C++ kernel does.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

_MAX_HEAD_DIM = 64  # [4, 64, 64] fp32 tiles per program are already a lot of registers


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _tanh(x):
    return 2.0 * _sigmoid(2.0 * x) - 1.0


@triton.jit
def _softmax(x, valid):
    x = tl.where(valid, x, float("-inf"))
    e = tl.where(valid, tl.exp(x - tl.max(x, axis=0)), 0.0)
    return e / tl.sum(e, axis=0)


@triton.jit
def _softmax_backward(y, g):
    return y * (g - tl.sum(g * y, axis=0))


@triton.jit
def _row(x, gi, g: tl.constexpr):
    """Row g of a [BG, BD] tile, as a [BD] vector."""
    return tl.sum(tl.where(gi[:, None] == g, x, 0.0), axis=0)


@triton.jit
def _fast_rnn_layout(H, D, G: tl.constexpr, BG: tl.constexpr, BD: tl.constexpr):
    """This program's (batch * head) row bh, its batch b, gate and value indices gi [BG], di [BD], the masks of valid
    values dv [BD], gates x values gd [BG, BD] and fast weight entries gdd [BG, BD, BD], and the offsets r_off of
    the program's fast weights [G, D, D]."""
    bh = tl.program_id(0)
    b = bh // H
    gi = tl.arange(0, BG)
    di = tl.arange(0, BD)
    dv = di < D
    gd = (gi[:, None] < G) & dv[None, :]
    gdd = gd[:, :, None] & dv[None, None, :]
    r_off = bh * G * D * D + gi[:, None, None] * D * D + di[None, :, None] * D + di[None, None, :]
    return bh, b, gi, di, dv, gd, gdd, r_off


@triton.jit
def _fast_rnn_fwd_kernel(
    z_ptr, k_ptr, v_ptr, beta_ptr, R_ptr, y0_ptr, c0_ptr, mask_ptr, y_ptr, c_ptr, act_ptr, vold_ptr,
    H, L, D,
    CELL: tl.constexpr, G: tl.constexpr, BG: tl.constexpr, BD: tl.constexpr,
):
    LSTM: tl.constexpr = CELL >= 2
    SOFTMAX_INPUT: tl.constexpr = (CELL != 0) and (CELL != 2)
    bh, b, gi, di, dv, gd, gdd, r_off = _fast_rnn_layout(H, D, G, BG, BD)
    R = tl.load(R_ptr + r_off, mask=gdd, other=0.0).to(tl.float32)
    y_prev = tl.load(y0_ptr + bh * D + di, mask=dv, other=0.0).to(tl.float32)
    c_prev = tl.zeros([BD], dtype=tl.float32)
    if LSTM:
        c_prev = tl.load(c0_ptr + bh * D + di, mask=dv, other=0.0).to(tl.float32)
    for t in range(L):
        keep = tl.load(mask_ptr + b * L + t) != 0
        if SOFTMAX_INPUT:
            s = _softmax(y_prev, dv)
        else:
            s = y_prev
        off = bh * G * L * D + gi[:, None] * L * D + t * D + di[None, :]
        kt = tl.load(k_ptr + off, mask=gd, other=0.0).to(tl.float32)
        vt = tl.load(v_ptr + off, mask=gd, other=0.0).to(tl.float32)
        zt = tl.load(z_ptr + off, mask=gd, other=0.0).to(tl.float32)
        bt = tl.load(beta_ptr + bh * G * L + gi * L + t, mask=gi < G, other=0.0).to(tl.float32)
        # R_t = R_{t-1} + beta_t (v_t - R_{t-1} k_t) k_t^T ;  a_t = z_t + R_t s_{t-1}
        v_old = tl.sum(R * kt[:, None, :], axis=2)
        delta = bt[:, None] * (vt - v_old)
        R_new = R + delta[:, :, None] * kt[:, None, :]
        a = zt + tl.sum(R_new * s[None, None, :], axis=2)
        if CELL == 0:
            y_new = _softmax(_row(a, gi, 0), dv)
        elif CELL == 1:
            y_new = _row(a, gi, 0)
        else:
            ig = _sigmoid(_row(a, gi, 0))
            if CELL == 5:
                ug = _row(a, gi, 1)
            else:
                ug = _sigmoid(_row(a, gi, 1))
            og = _sigmoid(_row(a, gi, 2))
            c_new = c_prev + ig * (ug - c_prev)
            y_new = og * c_new
            if CELL == 2:
                y_new = _softmax(y_new, dv)
            elif CELL == 4:
                y_new = y_new + _row(zt, gi, 1)
            act_off = bh * 3 * L * D + t * D + di
            tl.store(act_ptr + act_off, ig, mask=tl.where(keep, dv, False))
            tl.store(act_ptr + act_off + L * D, ug, mask=tl.where(keep, dv, False))
            tl.store(act_ptr + act_off + 2 * L * D, og, mask=tl.where(keep, dv, False))
            c_prev = tl.where(keep, c_new, c_prev)
            tl.store(c_ptr + bh * L * D + t * D + di, c_prev, mask=dv)
        tl.store(vold_ptr + off, v_old, mask=tl.where(keep, gd, False))
        R = tl.where(keep, R_new, R)
        y_prev = tl.where(keep, y_new, y_prev)
        tl.store(y_ptr + bh * L * D + t * D + di, y_prev, mask=dv)
    tl.store(R_ptr + r_off, R, mask=gdd)


@triton.jit
def _cell_backward(
    act_ptr, c_ptr, c0_ptr, gyt, gct, dc, yt, bh, t, first, seq, gi, di, dv, L, D, CELL: tl.constexpr,
):
    """Backward of the fast RNN / LSTM cell at step t: from the gradients gyt, gct of y_t, c_t (and the cell's
    saved activations), the gradient dL/da [BG, BD] and that of c_{t-1} (dc for the RNN cells)."""
    dc_new = dc
    if CELL == 0:
        ga = tl.where(gi[:, None] == 0, _softmax_backward(yt, gyt)[None, :], 0.0)
    elif CELL == 1:
        ga = tl.where(gi[:, None] == 0, gyt[None, :], 0.0)
    else:
        act_off = bh * 3 * L * D + t * D + di
        ig = tl.load(act_ptr + act_off, mask=dv, other=0.0).to(tl.float32)
        ug = tl.load(act_ptr + act_off + L * D, mask=dv, other=0.0).to(tl.float32)
        og = tl.load(act_ptr + act_off + 2 * L * D, mask=dv, other=0.0).to(tl.float32)
        ct = tl.load(c_ptr + seq, mask=dv, other=0.0).to(tl.float32)
        cp = tl.load(c_ptr + seq - D, mask=tl.where(t > 0, dv, False), other=0.0).to(tl.float32)
        cp = tl.where(first, tl.load(c0_ptr + bh * D + di, mask=dv, other=0.0).to(tl.float32), cp)
        if CELL == 2:
            gh = _softmax_backward(yt, gyt)
        else:
            gh = gyt
        g_c = gct + gh * og
        ga_i = g_c * (ug - cp) * ig * (1.0 - ig)
        ga_u = g_c * ig
        if CELL != 5:
            ga_u = ga_u * ug * (1.0 - ug)
        ga_o = gh * ct * og * (1.0 - og)
        ga = tl.where(gi[:, None] == 0, ga_i[None, :], tl.where(gi[:, None] == 1, ga_u[None, :], ga_o[None, :]))
        ga = tl.where(gi[:, None] < 3, ga, 0.0)
        dc_new = g_c * (1.0 - ig)
    return ga, dc_new


@triton.jit
def _fast_rnn_bwd_kernel(
    gy_ptr, gc_ptr, k_ptr, v_ptr, beta_ptr, R_ptr, dR_ptr, y0_ptr, c0_ptr, mask_ptr, y_ptr, c_ptr, act_ptr,
    vold_ptr, gz_ptr, gk_ptr, gv_ptr, gbeta_ptr, gy0_ptr, gc0_ptr,
    H, L, D,
    CELL: tl.constexpr, G: tl.constexpr, BG: tl.constexpr, BD: tl.constexpr, HAS_GC: tl.constexpr,
):
    LSTM: tl.constexpr = CELL >= 2
    SOFTMAX_INPUT: tl.constexpr = (CELL != 0) and (CELL != 2)
    bh, b, gi, di, dv, gd, gdd, r_off = _fast_rnn_layout(H, D, G, BG, BD)
    R = tl.load(R_ptr + r_off, mask=gdd, other=0.0).to(tl.float32)
    dR = tl.load(dR_ptr + r_off, mask=gdd, other=0.0).to(tl.float32)
    dy = tl.zeros([BD], dtype=tl.float32)
    dc = tl.zeros([BD], dtype=tl.float32)
    for tt in range(L):
        t = L - 1 - tt
        keep = tl.load(mask_ptr + b * L + t) != 0
        seq = bh * L * D + t * D + di
        gyt = tl.load(gy_ptr + seq, mask=dv, other=0.0).to(tl.float32) + dy
        gct = dc
        if HAS_GC:
            gct = gct + tl.load(gc_ptr + seq, mask=dv, other=0.0).to(tl.float32)
        first = t == 0
        yp = tl.load(y_ptr + seq - D, mask=tl.where(t > 0, dv, False), other=0.0).to(tl.float32)
        yp = tl.where(first, tl.load(y0_ptr + bh * D + di, mask=dv, other=0.0).to(tl.float32), yp)
        if SOFTMAX_INPUT:
            s = _softmax(yp, dv)
        else:
            s = yp
        yt = tl.load(y_ptr + seq, mask=dv, other=0.0).to(tl.float32)
        # cell backward: dL/da [BG, BD]
        ga, dc_new = _cell_backward(act_ptr, c_ptr, c0_ptr, gyt, gct, dc, yt, bh, t, first, seq, gi, di, dv, L, D, CELL)
        gz = ga
        if CELL == 4:
            gz = gz + tl.where(gi[:, None] == 1, gyt[None, :], 0.0)
        # a = z + R_t s
        ds = tl.sum(tl.sum(R * ga[:, :, None], axis=1), axis=0)
        dR_t = dR + ga[:, :, None] * s[None, None, :]
        # R_t = R_{t-1} + delta k^T,  delta = beta (v - v_old),  v_old = R_{t-1} k
        off = bh * G * L * D + gi[:, None] * L * D + t * D + di[None, :]
        kt = tl.load(k_ptr + off, mask=gd, other=0.0).to(tl.float32)
        vt = tl.load(v_ptr + off, mask=gd, other=0.0).to(tl.float32)
        vo = tl.load(vold_ptr + off, mask=gd, other=0.0).to(tl.float32)
        bt = tl.load(beta_ptr + bh * G * L + gi * L + t, mask=gi < G, other=0.0).to(tl.float32)
        diff = vt - vo
        delta = bt[:, None] * diff
        gdelta = tl.sum(dR_t * kt[:, None, :], axis=2)
        gv = bt[:, None] * gdelta
        gb = tl.sum(gdelta * diff, axis=1)
        R_prev = R - delta[:, :, None] * kt[:, None, :]
        g_vold = -bt[:, None] * gdelta
        gk = tl.sum(dR_t * delta[:, :, None], axis=1) + tl.sum(R_prev * g_vold[:, :, None], axis=1)
        dR_prev = dR_t + g_vold[:, :, None] * kt[:, None, :]
        if SOFTMAX_INPUT:
            dy_new = _softmax_backward(s, ds)
        else:
            dy_new = ds
        tl.store(gz_ptr + off, gz, mask=tl.where(keep, gd, False))
        tl.store(gk_ptr + off, gk, mask=tl.where(keep, gd, False))
        tl.store(gv_ptr + off, gv, mask=tl.where(keep, gd, False))
        tl.store(gbeta_ptr + bh * G * L + gi * L + t, gb, mask=tl.where(keep, gi < G, False))
        R = tl.where(keep, R_prev, R)
        dR = tl.where(keep, dR_prev, dR)
        dy = tl.where(keep, dy_new, gyt)
        dc = tl.where(keep, dc_new, gct)
    tl.store(R_ptr + r_off, R, mask=gdd)
    tl.store(dR_ptr + r_off, dR, mask=gdd)
    tl.store(gy0_ptr + bh * D + di, dy, mask=dv)
    if LSTM:
        tl.store(gc0_ptr + bh * D + di, dc, mask=dv)


@triton.jit
def _rdn_layout(Rq_ptr, Rk_ptr, Rv_ptr, rb_ptr, H, D, BD: tl.constexpr):
    """This program's (batch * head) row bh, its batch b, value indices di [BD], the masks dv [BD], dd [BD, BD], the
    offsets m_off of a [D, D] matrix, and the head's recurrent slow weights R_q, R_k, R_v [BD, BD], r_beta [BD]."""
    bh = tl.program_id(0)
    b = bh // H
    h = bh % H
    di = tl.arange(0, BD)
    dv = di < D
    dd = dv[:, None] & dv[None, :]
    m_off = di[:, None] * D + di[None, :]
    Rq = tl.load(Rq_ptr + h * D * D + m_off, mask=dd, other=0.0).to(tl.float32)
    Rk = tl.load(Rk_ptr + h * D * D + m_off, mask=dd, other=0.0).to(tl.float32)
    Rv = tl.load(Rv_ptr + h * D * D + m_off, mask=dd, other=0.0).to(tl.float32)
    rb = tl.load(rb_ptr + h * D + di, mask=dv, other=0.0).to(tl.float32)
    return bh, b, di, dv, dd, m_off, Rq, Rk, Rv, rb


@triton.jit
def _rdn_fwd_kernel(
    q_ptr, k_ptr, v_ptr, beta_ptr, Rq_ptr, Rk_ptr, Rv_ptr, rb_ptr, W_ptr, y0_ptr, mask_ptr,
    y_ptr, qs_ptr, ks_ptr, vs_ptr, bs_ptr, vold_ptr,
    H, L, D, BD: tl.constexpr,
):
    bh, b, di, dv, dd, m_off, Rq, Rk, Rv, rb = _rdn_layout(Rq_ptr, Rk_ptr, Rv_ptr, rb_ptr, H, D, BD)
    W = tl.load(W_ptr + bh * D * D + m_off, mask=dd, other=0.0).to(tl.float32)
    y_prev = tl.load(y0_ptr + bh * D + di, mask=dv, other=0.0).to(tl.float32)
    for t in range(L):
        keep = tl.load(mask_ptr + b * L + t) != 0
        seq = bh * L * D + t * D + di
        hh = _tanh(y_prev)
        # q, k = softmax(W_{q,k} x + R_{q,k} tanh(y_{t-1})), v = W_v x + R_v tanh(y_{t-1})
        qt = _softmax(tl.load(q_ptr + seq, mask=dv, other=0.0).to(tl.float32) + tl.sum(Rq * hh[None, :], axis=1), dv)
        kt = _softmax(tl.load(k_ptr + seq, mask=dv, other=0.0).to(tl.float32) + tl.sum(Rk * hh[None, :], axis=1), dv)
        vt = tl.load(v_ptr + seq, mask=dv, other=0.0).to(tl.float32) + tl.sum(Rv * hh[None, :], axis=1)
        bt = _sigmoid(tl.load(beta_ptr + bh * L + t).to(tl.float32) + tl.sum(rb * hh, axis=0))
        # W_t = W_{t-1} + beta (v - W_{t-1} k) k^T ;  y_t = W_t q_t
        v_old = tl.sum(W * kt[None, :], axis=1)
        W_new = W + (bt * (vt - v_old))[:, None] * kt[None, :]
        y_new = tl.sum(W_new * qt[None, :], axis=1)
        tl.store(qs_ptr + seq, qt, mask=tl.where(keep, dv, False))
        tl.store(ks_ptr + seq, kt, mask=tl.where(keep, dv, False))
        tl.store(vs_ptr + seq, vt, mask=tl.where(keep, dv, False))
        tl.store(vold_ptr + seq, v_old, mask=tl.where(keep, dv, False))
        tl.store(bs_ptr + bh * L + t, bt, mask=keep)
        W = tl.where(keep, W_new, W)
        y_prev = tl.where(keep, y_new, y_prev)
        tl.store(y_ptr + seq, y_prev, mask=dv)
    tl.store(W_ptr + bh * D * D + m_off, W, mask=dd)


@triton.jit
def _rdn_bwd_kernel(
    gy_ptr, W_ptr, dW_ptr, Rq_ptr, Rk_ptr, Rv_ptr, rb_ptr, y0_ptr, mask_ptr, y_ptr, qs_ptr, ks_ptr, vs_ptr,
    bs_ptr, vold_ptr, gq_ptr, gk_ptr, gv_ptr, gbeta_ptr, gRq_ptr, gRk_ptr, gRv_ptr, grb_ptr, gy0_ptr,
    H, L, D, BD: tl.constexpr,
):
    bh, b, di, dv, dd, m_off, Rq, Rk, Rv, rb = _rdn_layout(Rq_ptr, Rk_ptr, Rv_ptr, rb_ptr, H, D, BD)
    W = tl.load(W_ptr + bh * D * D + m_off, mask=dd, other=0.0).to(tl.float32)
    dW = tl.load(dW_ptr + bh * D * D + m_off, mask=dd, other=0.0).to(tl.float32)
    gRq = tl.zeros([BD, BD], dtype=tl.float32)
    gRk = tl.zeros([BD, BD], dtype=tl.float32)
    gRv = tl.zeros([BD, BD], dtype=tl.float32)
    grb = tl.zeros([BD], dtype=tl.float32)
    dy = tl.zeros([BD], dtype=tl.float32)
    for tt in range(L):
        t = L - 1 - tt
        keep = tl.load(mask_ptr + b * L + t) != 0
        seq = bh * L * D + t * D + di
        gyt = tl.load(gy_ptr + seq, mask=dv, other=0.0).to(tl.float32) + dy
        yp = tl.load(y_ptr + seq - D, mask=tl.where(t > 0, dv, False), other=0.0).to(tl.float32)
        yp = tl.where(t == 0, tl.load(y0_ptr + bh * D + di, mask=dv, other=0.0).to(tl.float32), yp)
        hh = _tanh(yp)
        qt = tl.load(qs_ptr + seq, mask=dv, other=0.0).to(tl.float32)
        kt = tl.load(ks_ptr + seq, mask=dv, other=0.0).to(tl.float32)
        vt = tl.load(vs_ptr + seq, mask=dv, other=0.0).to(tl.float32)
        vo = tl.load(vold_ptr + seq, mask=dv, other=0.0).to(tl.float32)
        bt = tl.load(bs_ptr + bh * L + t).to(tl.float32)
        # y_t = W_t q_t
        gq = tl.sum(W * gyt[:, None], axis=0)
        dW_t = dW + gyt[:, None] * qt[None, :]
        # W_t = W_{t-1} + delta k^T
        diff = vt - vo
        delta = bt * diff
        gdelta = tl.sum(dW_t * kt[None, :], axis=1)
        gv = bt * gdelta
        gb = tl.sum(gdelta * diff, axis=0)
        W_prev = W - delta[:, None] * kt[None, :]
        g_vold = -bt * gdelta
        gk = tl.sum(dW_t * delta[:, None], axis=0) + tl.sum(W_prev * g_vold[:, None], axis=0)
        dW_prev = dW_t + g_vold[:, None] * kt[None, :]
        # activations and the recurrent slow weights
        gqp = _softmax_backward(qt, gq)
        gkp = _softmax_backward(kt, gk)
        gbp = gb * bt * (1.0 - bt)
        gh = (
            tl.sum(Rq * gqp[:, None], axis=0) + tl.sum(Rk * gkp[:, None], axis=0)
            + tl.sum(Rv * gv[:, None], axis=0) + gbp * rb
        )
        dy_new = gh * (1.0 - hh * hh)
        tl.store(gq_ptr + seq, gqp, mask=tl.where(keep, dv, False))
        tl.store(gk_ptr + seq, gkp, mask=tl.where(keep, dv, False))
        tl.store(gv_ptr + seq, gv, mask=tl.where(keep, dv, False))
        tl.store(gbeta_ptr + bh * L + t, gbp, mask=keep)
        gRq = tl.where(keep, gRq + gqp[:, None] * hh[None, :], gRq)
        gRk = tl.where(keep, gRk + gkp[:, None] * hh[None, :], gRk)
        gRv = tl.where(keep, gRv + gv[:, None] * hh[None, :], gRv)
        grb = tl.where(keep, grb + gbp * hh, grb)
        W = tl.where(keep, W_prev, W)
        dW = tl.where(keep, dW_prev, dW)
        dy = tl.where(keep, dy_new, gyt)
    tl.store(W_ptr + bh * D * D + m_off, W, mask=dd)
    tl.store(dW_ptr + bh * D * D + m_off, dW, mask=dd)
    tl.store(gRq_ptr + bh * D * D + m_off, gRq, mask=dd)
    tl.store(gRk_ptr + bh * D * D + m_off, gRk, mask=dd)
    tl.store(gRv_ptr + bh * D * D + m_off, gRv, mask=dd)
    tl.store(grb_ptr + bh * D + di, grb, mask=dv)
    tl.store(gy0_ptr + bh * D + di, dy, mask=dv)


# ---------------------------------------------------------------------------------------------------------------
# wrappers with the signatures of the C++ ops (`rfwp_scan._CPU_KERNEL.ops`): outputs are written in place
# ---------------------------------------------------------------------------------------------------------------


def _block(D: int) -> int:
    if D > _MAX_HEAD_DIM:
        raise ValueError(f"the Triton recurrent FWP scans support head dimensions up to {_MAX_HEAD_DIM}, got {D}")
    return max(triton.next_power_of_2(D), 2)


def _mask(mask: Optional[torch.Tensor], B: int, L: int, like: torch.Tensor) -> torch.Tensor:
    return mask if mask is not None else like.new_ones(B, L)


def fast_rnn_forward(
    z: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, R: torch.Tensor,
    y0: torch.Tensor, c0: torch.Tensor, mask: Optional[torch.Tensor], cell: int,
    y: torch.Tensor, c: torch.Tensor, act: torch.Tensor, v_old: torch.Tensor,
) -> None:
    """The C++ op ``fast_rnn_forward`` on CUDA (or the interpreter); outputs are written in place.

    Shapes: z, k, v ``[B, H, G, T, D]``, beta ``[B, H, G, T]``, R ``[B, H, G, D, D]`` (in: initial, out: final fast
    weights), y0, c0 ``[B, H, D]``, mask ``[B, T]`` or None, cell the index into ``CELLS``; out: y, c ``[B, H, T, D]``,
    act ``[B, H, 3, T, D]`` (the LSTM gates after their activation; c and act are empty for the RNN cells), v_old
    ``[B, H, G, T, D]`` (``R_{t-1} k_t``).
    """
    B, H, G, L, D = z.shape
    lstm = cell >= 2
    _fast_rnn_fwd_kernel[(B * H,)](
        z, k, v, beta, R, y0, c0 if lstm else y0, _mask(mask, B, L, z), y, c if lstm else y, act if lstm else y,
        v_old, H, L, D, CELL=cell, G=G, BG=triton.next_power_of_2(G), BD=_block(D), num_warps=4,
    )


def fast_rnn_backward(
    gy: torch.Tensor, gc: Optional[torch.Tensor], k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
    R: torch.Tensor, dR: torch.Tensor, y0: torch.Tensor, c0: torch.Tensor, mask: Optional[torch.Tensor],
    y: torch.Tensor, c: torch.Tensor, act: torch.Tensor, v_old: torch.Tensor, cell: int,
    gz: torch.Tensor, gk: torch.Tensor, gv: torch.Tensor, gbeta: torch.Tensor, gy0: torch.Tensor, gc0: torch.Tensor,
) -> None:
    """The C++ op ``fast_rnn_backward``: the gradients of :func:`fast_rnn_forward`, written in place.

    In: gy, gc ``[B, H, T, D]`` the gradients of y and c (gc None for the RNN cells), the forward's inputs and saved
    outputs, R the final fast weights (undone to the initial ones), dR ``[B, H, G, D, D]`` the final fast weights'
    gradient (out: the initial ones'). Out: gz, gk, gv like z, gbeta like beta, gy0, gc0 ``[B, H, D]``.
    """
    B, H, G, L, D = k.shape
    lstm = cell >= 2
    _fast_rnn_bwd_kernel[(B * H,)](
        gy, gc if gc is not None else gy, k, v, beta, R, dR, y0, c0 if lstm else y0, _mask(mask, B, L, k), y,
        c if lstm else y, act if lstm else y, v_old, gz, gk, gv, gbeta, gy0, gc0 if lstm else gy0,
        H, L, D, CELL=cell, G=G, BG=triton.next_power_of_2(G), BD=_block(D), HAS_GC=gc is not None and lstm,
        num_warps=4,
    )


def rdn_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
    Rq: torch.Tensor, Rk: torch.Tensor, Rv: torch.Tensor, rb: torch.Tensor,
    W: torch.Tensor, y0: torch.Tensor, mask: Optional[torch.Tensor],
    y: torch.Tensor, qs: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor, bs: torch.Tensor, v_old: torch.Tensor,
) -> None:
    """The C++ op ``rdn_forward`` (the Recurrent Delta Net scan); outputs are written in place.

    Shapes: q, k, v ``[B, H, T, D]``, beta ``[B, H, T]``, Rq, Rk, Rv ``[H, D, D]``, rb ``[H, D]``, W ``[B, H, D, D]``
    (in: initial, out: final fast weights), y0 ``[B, H, D]``, mask ``[B, T]`` or None; out: y, and the activated
    qs, ks, vs ``[B, H, T, D]``, bs ``[B, H, T]``, v_old ``[B, H, T, D]`` (``W_{t-1} k_t``) saved for the backward.
    """
    B, H, L, D = q.shape
    _rdn_fwd_kernel[(B * H,)](
        q, k, v, beta, Rq, Rk, Rv, rb, W, y0, _mask(mask, B, L, q), y, qs, ks, vs, bs, v_old,
        H, L, D, BD=_block(D), num_warps=4,
    )


def rdn_backward(
    gy: torch.Tensor, W: torch.Tensor, dW: torch.Tensor,
    Rq: torch.Tensor, Rk: torch.Tensor, Rv: torch.Tensor, rb: torch.Tensor,
    y0: torch.Tensor, mask: Optional[torch.Tensor],
    y: torch.Tensor, qs: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor, bs: torch.Tensor, v_old: torch.Tensor,
    gq: torch.Tensor, gk: torch.Tensor, gv: torch.Tensor, gbeta: torch.Tensor,
    gRq: torch.Tensor, gRk: torch.Tensor, gRv: torch.Tensor, grb: torch.Tensor, gy0: torch.Tensor,
) -> None:
    """The C++ op ``rdn_backward``: the gradients of :func:`rdn_forward`, written in place.

    In: gy ``[B, H, T, D]``, W the final fast weights (undone to the initial ones), dW ``[B, H, D, D]`` their
    gradient (out: the initial ones'), the forward's inputs and saved outputs. Out: gq, gk, gv ``[B, H, T, D]``,
    gbeta ``[B, H, T]``, gRq, gRk, gRv ``[B, H, D, D]`` and grb ``[B, H, D]`` (per sequence; the caller sums over B),
    gy0 ``[B, H, D]``.
    """
    B, H, L, D = gy.shape
    _rdn_bwd_kernel[(B * H,)](
        gy, W, dW, Rq, Rk, Rv, rb, y0, _mask(mask, B, L, gy), y, qs, ks, vs, bs, v_old, gq, gk, gv, gbeta,
        gRq, gRk, gRv, grb, gy0, H, L, D, BD=_block(D), num_warps=4,
    )
