"""Triton forward of the chunkwise gated delta rule (same math as ``GatedDeltaRuleChunks`` in
gated_delta_rule_kernels.py; derivation: README.md, "Gated delta rule").

Imported lazily by the dispatcher (``chunk.chunk_kernel_finder``) for CUDA tensors; importing this module needs
`triton`. The tests run it on CPU under the Triton interpreter (``TRITON_INTERPRET=1``) at small shapes.

Two kernels, per (batch * head), as in triton_chunk.py:

* ``_gated_wy_kernel``, one program per chunk: the cumulative log-decay ``gamma`` (``tl.cumsum``),
  ``D_ij = exp(gamma_i - gamma_j)`` (i >= j), ``A = strictly_lower(diag(beta) (K K^T * D))``, ``T = (I + A)^-1`` by
  forward substitution in registers, ``W = T diag(beta Gamma) K``, ``U = T diag(beta) V``; W, U and gamma go to
  global memory (fp32).
* ``_gated_scan_kernel``, one program per block of value columns, looping over the chunks with the transposed state
  ``S^T [Dk, BV]`` in fp32 registers: ``U' = U - W S^T``, ``O = diag(Gamma) Q S^T + (tril(Q K^T) * D) U'``,
  ``S^T <- Gamma_C S^T + (diag(lambda) K)^T U'``.

The backward is the PyTorch one of ``GatedDeltaRuleChunks`` (batched matmuls, on the GPU as well).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from . import gated_delta_rule_kernels
from .chunk import ChunkFastWeightFunction
from .gated_delta_rule_kernels import GATED_DELTA_RULE_CHUNKS
from .triton_chunk import _forward_buffers, _load_state, _store_wy_values, _unit_lower_inverse, launch, run_chunk_kernel


@triton.jit
def _decay_matrix(gamma, r):
    """D_ij = exp(gamma_i - gamma_j) on and below the diagonal, 0 above (masked before exp)."""
    diff = gamma[:, None] - gamma[None, :]
    return tl.exp(tl.where(r[:, None] >= r[None, :], diff, float("-inf")))


@triton.jit
def _gated_wy_kernel(
    k_ptr, v_ptr, beta_ptr, g_ptr, w_ptr, u_ptr, gamma_ptr,
    T, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
    BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):
    c, bh = tl.program_id(0), tl.program_id(1)
    r = tl.arange(0, BC)
    t = c * C + r
    row_ok = (r < C) & (t < T)
    ck = tl.arange(0, BK)
    kmask = row_ok[:, None] & (ck[None, :] < K)
    k = tl.load(k_ptr + bh * T * K + t[:, None] * K + ck[None, :], mask=kmask, other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + bh * T + t, mask=row_ok, other=0.0).to(tl.float32)
    # padded rows have g = 0: gamma stays at the chunk's last position after them
    gamma = tl.cumsum(tl.load(g_ptr + bh * T + t, mask=row_ok, other=0.0).to(tl.float32), axis=0)
    tl.store(gamma_ptr + bh * T + t, gamma, mask=row_ok)
    D = _decay_matrix(gamma, r)
    # A = strictly_lower(diag(beta) (K K^T * D))
    A = tl.dot(k, tl.trans(k), input_precision="ieee") * D * beta[:, None]
    A = tl.where(r[:, None] > r[None, :], A, 0.0)
    Tm = _unit_lower_inverse(A, r, BC)
    # W = T diag(beta Gamma) K
    w = tl.dot(Tm, k * (beta * tl.exp(gamma))[:, None], input_precision="ieee")
    tl.store(w_ptr + bh * T * K + t[:, None] * K + ck[None, :], w, mask=kmask)
    _store_wy_values(Tm, beta, v_ptr, u_ptr, bh, t, row_ok, T, V, BV)  # U = T diag(beta) V


@triton.jit
def _gated_scan_kernel(
    q_ptr, k_ptr, u_ptr, w_ptr, gamma_ptr, o_ptr, s0_ptr, sN_ptr,
    T, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
    BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_S0: tl.constexpr,
):
    vb, bh = tl.program_id(0), tl.program_id(1)
    r = tl.arange(0, BC)
    ck = tl.arange(0, BK)
    cv = vb * BV + tl.arange(0, BV)
    state_off = bh * V * K + cv[None, :] * K + ck[:, None]  # S^T [Dk, BV] of the [Dv, Dk] state
    state_mask = (ck[:, None] < K) & (cv[None, :] < V)
    h = _load_state(s0_ptr, state_off, state_mask, BK, BV, HAS_S0)
    for c in range(0, tl.cdiv(T, C)):
        t = c * C + r
        row_ok = (r < C) & (t < T)
        kmask = row_ok[:, None] & (ck[None, :] < K)
        vmask = row_ok[:, None] & (cv[None, :] < V)
        q = tl.load(q_ptr + bh * T * K + t[:, None] * K + ck[None, :], mask=kmask, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + bh * T * K + t[:, None] * K + ck[None, :], mask=kmask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + bh * T * V + t[:, None] * V + cv[None, :], mask=vmask, other=0.0)
        w = tl.load(w_ptr + bh * T * K + t[:, None] * K + ck[None, :], mask=kmask, other=0.0)
        # gamma of padded rows: that of the chunk's last position (g = 0 there)
        last = tl.minimum(c * C + C, T) - 1
        gamma_last = tl.load(gamma_ptr + bh * T + last)
        gamma = tl.load(gamma_ptr + bh * T + t, mask=row_ok, other=0.0)
        gamma = tl.where(row_ok, gamma, gamma_last)
        u = u - tl.dot(w, h, input_precision="ieee")  # U' = U - W S^T
        # O = diag(Gamma) Q S^T + (tril(Q K^T) * D) U'
        p = tl.dot(q, tl.trans(k), input_precision="ieee") * _decay_matrix(gamma, r)
        o = tl.dot(q, h, input_precision="ieee") * tl.exp(gamma)[:, None] + tl.dot(p, u, input_precision="ieee")
        tl.store(o_ptr + bh * T * V + t[:, None] * V + cv[None, :], o.to(o_ptr.dtype.element_ty), mask=vmask)
        # S^T <- Gamma_C S^T + (diag(lambda) K)^T U'
        k_decayed = k * tl.exp(gamma_last - gamma)[:, None]
        h = h * tl.exp(gamma_last) + tl.dot(tl.trans(k_decayed), u, input_precision="ieee")
    tl.store(sN_ptr + state_off, h, mask=state_mask)


def _triton_forward(q, k, v, beta, g, initial_state, chunk_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Runs the two kernels: o ``[B, H, T, Dv]`` in q's dtype and the fp32 final state ``[B, H, Dv, Dk]``."""
    B, H, T, K = q.shape
    V = v.shape[-1]
    acc = torch.float32
    C, (BC, BK, BV), o, final, s0 = _forward_buffers(q, v, initial_state, chunk_size)
    if T == 0:
        return o, final
    q, k, v, beta, g = (x.contiguous() for x in (q, k, v, beta, g))
    w = torch.empty(B, H, T, K, dtype=acc, device=q.device)
    u = torch.empty(B, H, T, V, dtype=acc, device=q.device)
    gamma = torch.empty(B, H, T, dtype=acc, device=q.device)
    launch(_gated_wy_kernel, (triton.cdiv(T, C), B * H), k, v, beta, g, w, u, gamma, T, K, V, C, BC, BK, BV)
    launch(
        _gated_scan_kernel, (triton.cdiv(V, BV), B * H), q, k, u, w, gamma, o, s0, final, T, K, V, C, BC, BK, BV,
        HAS_S0=initial_state is not None,
    )
    return o, final


class TritonGatedChunkFunction(ChunkFastWeightFunction):
    """Forward in Triton; backward inherited (the PyTorch one of ``GatedDeltaRuleChunks``)."""

    @staticmethod
    def forward(ctx, rule, chunk_size, q, k, v, initial_state, beta, g):
        ChunkFastWeightFunction.save_inputs(ctx, rule, chunk_size, q, k, v, initial_state, (beta, g))
        return _triton_forward(q, k, v, beta, g, initial_state, chunk_size)


def gated_delta_rule_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Gated delta rule, chunkwise, Triton forward (``triton_chunk.run_chunk_kernel``). Arguments and returns as
    :func:`fwp_kernels.gated_delta_rule_kernels.gated_delta_rule_chunk`."""
    return run_chunk_kernel(TritonGatedChunkFunction, GATED_DELTA_RULE_CHUNKS,
                            gated_delta_rule_kernels.gated_delta_rule_chunk, q, k, v, (beta, g), initial_state,
                            output_final_state, chunk_size)
