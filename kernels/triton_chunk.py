"""Triton forward of the chunkwise-parallel fast weight kernels of the sum and delta rules (same math as chunk.py).

Imported lazily by the dispatcher (``chunk.chunk_kernel_finder``) for CUDA tensors; importing this module needs
`triton`. On CPU the kernels run under the Triton interpreter (``TRITON_INTERPRET=1``, set before this module is
imported), which the tests use at small shapes.

Two kernels, per (batch * head):

* ``_wy_kernel`` (delta rule only), one program per chunk: ``A = strictly_lower(diag(beta) K K^T)``,
  ``T = (I + A)^-1`` by forward substitution in registers, ``W = T diag(beta) K``,
  ``U = T diag(beta) V``; W and U go to global memory (fp32).
* ``_scan_kernel``, one program per block of value columns, looping over the chunks with the
  transposed state ``S^T [Dk, BV]`` in fp32 registers:
  ``U' = U - W S^T``, ``O = Q S^T + tril(Q K^T) U'``, ``S^T += K^T U'`` (sum rule: ``U' = V``).

The backward is the PyTorch one of chunk.py (it recomputes per-chunk quantities from the saved
inputs with batched matmuls, which run on the GPU as well).
"""
from __future__ import annotations

import functools
import inspect
import warnings
from typing import Any, Callable, Dict, Optional, Tuple

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from . import delta_rule_kernels, linear_attention_kernels
from .chunk import ChunkFastWeightFunction, ChunkRule
from .delta_rule_kernels import DELTA_RULE_CHUNKS
from .linear_attention_kernels import SUM_RULE_CHUNKS

# The [C, C] tiles live in registers: longer chunks are capped at this length (the chunk length
# changes only the rounding of the results, not their value).
_MAX_CHUNK = 64
# The software-pipelining depths (``num_stages``) a launch tries, in order: Triton's default, then fewer stages, until
# the kernel's buffers fit the device's shared memory. On an H100 the delta rule's scan at head size 128 (fla's 1.3B
# Delta Net) needs 262,144 bytes with the default depth and 180,224 with 2 (bf16, Triton 3.6); the H100 has 232,448
# per block (benchmarks/triton_shared_memory.py compiles the kernels for sm_90 / sm_80 offline and lists every size:
# benchmarks/results/triton_shared_memory.json).
STAGE_FALLBACK = (None, 2, 1)
# (kernel, device, dtypes, constexprs) -> the depth that launched, so that a fallback is found once; and the error of
# those that fit at no depth, raised again at once (their callers then run the PyTorch kernel on every call)
_LAUNCH_STAGES: Dict[tuple, Optional[int]] = {}
_FITS_AT_NO_DEPTH: Dict[tuple, OutOfResources] = {}
_WARNED_TORCH_FALLBACK: set = set()


@functools.lru_cache(maxsize=None)
def _constexpr_positions(fn: Callable) -> Tuple[int, ...]:
    """The positions of `fn`'s ``tl.constexpr`` parameters (read once per kernel: launches are on the hot path)."""
    parameters = inspect.signature(fn).parameters.values()
    return tuple(i for i, p in enumerate(parameters) if p.annotation in (tl.constexpr, "tl.constexpr"))


def launch(kernel, grid: Tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    """``kernel[grid](*args, **kwargs)`` at the first pipelining depth of ``STAGE_FALLBACK`` whose shared memory the
    device has (Triton raises ``OutOfResources`` before launching a kernel that does not fit; that depth is then left
    for this kernel, device, dtypes and tile sizes). Raises the last ``OutOfResources`` when no depth fits, and from
    then on at once for that key."""
    constexprs = tuple(args[i] for i in _constexpr_positions(kernel.fn) if i < len(args))
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    key = (kernel.fn, tensors[0].device, tuple(t.dtype for t in tensors), constexprs, tuple(sorted(kwargs.items())))
    if key in _FITS_AT_NO_DEPTH:
        raise _FITS_AT_NO_DEPTH[key]
    depths = (_LAUNCH_STAGES[key],) if key in _LAUNCH_STAGES else STAGE_FALLBACK
    error = None
    for num_stages in depths:
        try:
            kernel[grid](*args, **kwargs, **({} if num_stages is None else {"num_stages": num_stages}))
        except OutOfResources as raised:
            error = raised
            continue
        _LAUNCH_STAGES[key] = num_stages
        return
    _FITS_AT_NO_DEPTH[key] = error
    raise error


@triton.jit
def _unit_lower_inverse(A, r, BC: tl.constexpr):
    """``T = (I + A)^-1`` of a strictly lower ``A [BC, BC]`` by forward substitution in registers: row i of T is
    ``e_i - A[i, :i] T[:i, :]`` (the UT transform of the WY representation; kernels/README.md)."""
    Tm = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    for i in range(1, BC):
        a_i = tl.sum(tl.where(r[:, None] == i, A, 0.0), axis=0)  # A[i, :], indexed by column
        row = -tl.sum(a_i[:, None] * Tm, axis=0)  # -sum_m A[i, m] T[m, :]
        Tm = tl.where(r[:, None] == i, row[None, :] + tl.where(r[None, :] == i, 1.0, 0.0), Tm)
    return Tm


@triton.jit
def _store_wy_values(Tm, beta, v_ptr, u_ptr, bh, t, row_ok, T, V: tl.constexpr, BV: tl.constexpr):
    """``U = T diag(beta) V`` of one chunk (rows ``t``), in blocks of BV value columns, stored in fp32."""
    for v0 in range(0, V, BV):
        cv = v0 + tl.arange(0, BV)
        vmask = row_ok[:, None] & (cv[None, :] < V)
        v = tl.load(v_ptr + bh * T * V + t[:, None] * V + cv[None, :], mask=vmask, other=0.0).to(tl.float32)
        u = tl.dot(Tm, v * beta[:, None], input_precision="ieee")
        tl.store(u_ptr + bh * T * V + t[:, None] * V + cv[None, :], u, mask=vmask)


@triton.jit
def _load_state(s0_ptr, state_off, state_mask, BK: tl.constexpr, BV: tl.constexpr, HAS_S0: tl.constexpr):
    """The transposed initial state ``S^T [BK, BV]`` in fp32 (zeros without one)."""
    if HAS_S0:
        h = tl.load(s0_ptr + state_off, mask=state_mask, other=0.0).to(tl.float32)
    else:
        h = tl.zeros([BK, BV], dtype=tl.float32)
    return h


@triton.jit
def _wy_kernel(
    k_ptr, v_ptr, beta_ptr, w_ptr, u_ptr,
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
    kb = k * beta[:, None]
    # A = strictly_lower(diag(beta) K K^T)
    A = tl.dot(kb, tl.trans(k), input_precision="ieee")
    A = tl.where(r[:, None] > r[None, :], A, 0.0)
    Tm = _unit_lower_inverse(A, r, BC)
    # W = T diag(beta) K
    w = tl.dot(Tm, kb, input_precision="ieee")
    tl.store(w_ptr + bh * T * K + t[:, None] * K + ck[None, :], w, mask=kmask)
    _store_wy_values(Tm, beta, v_ptr, u_ptr, bh, t, row_ok, T, V, BV)


@triton.jit
def _scan_kernel(
    q_ptr, k_ptr, u_ptr, w_ptr, o_ptr, s0_ptr, sN_ptr,
    T, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
    BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    IS_DELTA: tl.constexpr, HAS_S0: tl.constexpr,
):
    vb, bh = tl.program_id(0), tl.program_id(1)
    r = tl.arange(0, BC)
    ck = tl.arange(0, BK)
    cv = vb * BV + tl.arange(0, BV)
    # The transposed state S^T [Dk, BV] (state layout [Dv, Dk], y = S q).
    state_off = bh * V * K + cv[None, :] * K + ck[:, None]
    state_mask = (ck[:, None] < K) & (cv[None, :] < V)
    h = _load_state(s0_ptr, state_off, state_mask, BK, BV, HAS_S0)
    causal = r[:, None] >= r[None, :]
    for c in range(0, tl.cdiv(T, C)):
        t = c * C + r
        row_ok = (r < C) & (t < T)
        kmask = row_ok[:, None] & (ck[None, :] < K)
        vmask = row_ok[:, None] & (cv[None, :] < V)
        q = tl.load(q_ptr + bh * T * K + t[:, None] * K + ck[None, :], mask=kmask, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + bh * T * K + t[:, None] * K + ck[None, :], mask=kmask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + bh * T * V + t[:, None] * V + cv[None, :], mask=vmask, other=0.0).to(tl.float32)
        if IS_DELTA:  # U' = U - W S^T
            w = tl.load(w_ptr + bh * T * K + t[:, None] * K + ck[None, :], mask=kmask, other=0.0)
            u = u - tl.dot(w, h, input_precision="ieee")
        # O = Q S^T + tril(Q K^T) U'
        p = tl.where(causal, tl.dot(q, tl.trans(k), input_precision="ieee"), 0.0)
        o = tl.dot(q, h, input_precision="ieee") + tl.dot(p, u, input_precision="ieee")
        tl.store(o_ptr + bh * T * V + t[:, None] * V + cv[None, :], o.to(o_ptr.dtype.element_ty), mask=vmask)
        # S^T += K^T U'
        h += tl.dot(tl.trans(k), u, input_precision="ieee")
    tl.store(sN_ptr + state_off, h, mask=state_mask)


def _block(n: int, cap: int) -> int:
    """A power-of-two tile >= 16 (tl.dot's minimum) covering n, at most `cap`."""
    return min(max(16, triton.next_power_of_2(n)), max(cap, 16))


def _forward_buffers(
    q: torch.Tensor, v: torch.Tensor, initial_state: Optional[torch.Tensor], chunk_size: int
) -> Tuple[int, Tuple[int, int, int], torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """What both Triton forwards (this module's, triton_gated_chunk's) launch with: ``(C, (BC, BK, BV), o, final,
    s0)``, the chunk length (at most ``_MAX_CHUNK``), the tiles, the output ``o [B, H, T, Dv]`` in q's dtype (empty),
    the fp32 final state ``[B, H, Dv, Dk]`` (empty; for T = 0 already the result: the initial state, or zeros) and
    the state the scan starts from (``final`` itself when there is no initial state: the kernel does not read it;
    None for T = 0, where nothing is launched)."""
    B, H, T, K = q.shape
    V = v.shape[-1]
    acc = torch.float32
    C = min(chunk_size, _MAX_CHUNK)
    tiles = (_block(C, _MAX_CHUNK), _block(K, 256), _block(V, 64))
    o = torch.empty(B, H, T, V, dtype=q.dtype, device=q.device)
    if T == 0:
        final = torch.zeros(B, H, V, K, dtype=acc, device=q.device) if initial_state is None else initial_state
        return C, tiles, o, final.to(acc).clone(), None
    final = torch.empty(B, H, V, K, dtype=acc, device=q.device)
    s0 = final if initial_state is None else initial_state.to(acc).contiguous()
    return C, tiles, o, final, s0


def _triton_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, initial_state: Optional[torch.Tensor], chunk_size: int,
    beta: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Runs the kernels: the delta rule with `beta`, the sum rule without (``IS_DELTA``); returns o ``[B, H, T, Dv]``
    in q's dtype and the fp32 final state."""
    B, H, T, K = q.shape
    V = v.shape[-1]
    acc = torch.float32
    C, (BC, BK, BV), o, final, s0 = _forward_buffers(q, v, initial_state, chunk_size)
    if T == 0:
        return o, final
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    n_chunks = triton.cdiv(T, C)
    if beta is not None:
        w = torch.empty(B, H, T, K, dtype=acc, device=q.device)
        u = torch.empty(B, H, T, V, dtype=acc, device=q.device)
        launch(_wy_kernel, (n_chunks, B * H), k, v, beta.contiguous(), w, u, T, K, V, C, BC, BK, BV)
    else:
        w, u = k, v  # w is unused by the sum rule
    launch(
        _scan_kernel, (triton.cdiv(V, BV), B * H), q, k, u, w, o, s0, final, T, K, V, C, BC, BK, BV,
        IS_DELTA=beta is not None, HAS_S0=initial_state is not None,
    )
    return o, final


class TritonChunkFastWeightFunction(ChunkFastWeightFunction):
    """Forward in Triton; backward inherited from the PyTorch chunked kernel."""

    @staticmethod
    def forward(ctx, rule, chunk_size, q, k, v, initial_state, *gates):
        ChunkFastWeightFunction.save_inputs(ctx, rule, chunk_size, q, k, v, initial_state, gates)  # for the backward
        return _triton_forward(q, k, v, initial_state, chunk_size, *gates)


def run_chunk_kernel(
    function: type, rule: ChunkRule, torch_kernel: Callable[..., Tuple[torch.Tensor, Optional[torch.Tensor]]],
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gates: Tuple[torch.Tensor, ...],
    initial_state: Optional[torch.Tensor], output_final_state: bool, chunk_size: int,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The Triton chunk kernel of `rule` (``function``: an autograd Function, Triton forward, PyTorch backward), or the
    PyTorch chunk kernel ``torch_kernel`` (same arguments as the public kernels) for float64 inputs (the Triton kernels
    accumulate in float32) and where the Triton kernel fits the device's shared memory at no pipelining depth of
    ``STAGE_FALLBACK`` (e.g. head size 256 on a GPU with 99 KB per block; warned once per rule). Shapes: q, k
    ``[B, H, T, Dk]``, v ``[B, H, T, Dv]``, each gate ``[B, H, T]``, states ``[B, H, Dv, Dk]``; returns o
    ``[B, H, T, Dv]`` in q's dtype and the float32 final state (or None)."""
    if q.dtype != torch.float64:
        try:
            o, final = function.apply(rule, chunk_size, q, k, v, initial_state, *gates)
            return o, (final if output_final_state else None)
        except OutOfResources as error:
            if rule.name not in _WARNED_TORCH_FALLBACK:
                _WARNED_TORCH_FALLBACK.add(rule.name)
                warnings.warn(f"the Triton kernel of the {rule.name} does not fit this GPU's shared memory at head "
                              f"size {q.shape[-1]} ({error}); the PyTorch chunk kernel runs instead", RuntimeWarning)
    return torch_kernel(q, k, v, *gates, initial_state, output_final_state, chunk_size)


def delta_rule_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Delta rule, chunkwise, Triton forward (:func:`run_chunk_kernel`). Arguments and returns as
    :func:`fwp_kernels.delta_rule_kernels.delta_rule_chunk`."""
    return run_chunk_kernel(TritonChunkFastWeightFunction, DELTA_RULE_CHUNKS, delta_rule_kernels.delta_rule_chunk,
                            q, k, v, (beta,), initial_state, output_final_state, chunk_size)


def linear_attention_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Sum rule, chunkwise, Triton forward (:func:`run_chunk_kernel`). Arguments and returns as
    :func:`fwp_kernels.linear_attention_kernels.linear_attention_chunk`."""
    return run_chunk_kernel(TritonChunkFastWeightFunction, SUM_RULE_CHUNKS,
                            linear_attention_kernels.linear_attention_chunk, q, k, v, (), initial_state,
                            output_final_state, chunk_size)
