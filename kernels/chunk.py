"""Chunkwise-parallel fast weight kernels: plain PyTorch (any device), and a C++ kernel on CPU.

Per (batch, head), the sequence is cut into chunks of C positions. Inside a chunk, with the state
S ``[Dv, Dk]`` entering it (y = S q) and the chunk's rows Q, K ``[C, Dk]``, V ``[C, Dv]``, beta ``[C]``:

    sum rule   (Schlag et al. 2021, eqs. 5-6):   O = Q S^T + tril(Q K^T) V,    S' = S + V^T K
    delta rule (eqs. 17-20, WY form):            U' = U - W S^T
                                                 O  = Q S^T + tril(Q K^T) U',  S' = S + U'^T K
    with the UT transform  T = (I + A)^-1,  A = strictly_lower(diag(beta) K K^T),
                           W = T diag(beta) K,  U = T diag(beta) V.

Everything that does not depend on S (tril(Q K^T), T, W, U) is computed for all chunks at once in
batched matmuls. The sequential pass across chunks is two small matmuls per chunk (U' and S'), and
the outputs are again one batched matmul over all chunks, given the state entering each chunk.
The backward recomputes those states from the saved inputs and runs the transposed pass from the
last chunk; it holds one state per chunk while it runs, never one per step. Derivation: README.md.

On CPU the forward and the backward run in a C++ kernel instead (csrc/chunk_delta.cpp, built on first
use with ``torch.utils.cpp_extension.load`` and cached in ``$FWP_KERNELS_BUILD_DIR`` or
``~/.cache/fwp_kernels``): per sequence, chunk by chunk, it solves ``(I + A) U' = diag(beta) (V - K S^T)``
with one triangular solve and calls the BLAS for every product, so the sequential pass costs no Python
or dispatcher time and T, W, U are never formed; its backward recomputes the states entering the chunks
(one per chunk, per sequence) and runs the transposed pass in the same loop. float16 / bfloat16 inputs
go through it in float32. Without the build the PyTorch path above runs: silently when there is no
compiler or ninja or ``FWP_KERNELS_NO_BUILD=1``, with one warning when a build fails.
A saved model folder carries the C++ source (``chunk_delta.cpp`` and the string of ``chunk_delta_csrc.py``,
written by ``modeling_fwp.remote_code``) and builds it the same way.
"""
from __future__ import annotations

from pathlib import Path
from typing import NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F

from .cpp_build import CompiledCpuKernel
from .recurrent import _acc_dtype

# Diagonal blocks of this size are inverted by batched triangular solves (LAPACK / cuBLAS), then
# merged by doubling (see `_unit_lower_inverse`).
_SOLVE_BLOCK = 32


def _to_chunks(x: torch.Tensor, chunk_size: int, dtype: torch.dtype) -> torch.Tensor:
    """``[B, H, T, *D]`` -> ``[B*H, N, C, *D]`` in `dtype`, zero-padded to ``N*C >= T``.

    Padded positions have k = v = beta = 0, so they leave the state untouched.
    """
    B, H, T = x.shape[:3]
    x = x.reshape(B * H, T, *x.shape[3:]).to(dtype)
    pad = -T % chunk_size
    if pad:
        x = F.pad(x, (0, 0, 0, pad) if x.dim() == 3 else (0, pad))
    return x.unflatten(1, ((T + pad) // chunk_size, chunk_size))


def _from_chunks(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``[B*H, N, C, *D]`` -> ``[B, H, T, *D]`` with B, H, T and dtype of `like` (drops the padding)."""
    B, H, T = like.shape[:3]
    x = x.flatten(1, 2)[:, :T]
    return x.reshape(B, H, T, *x.shape[2:]).to(like.dtype)


def _diagonal_blocks(A: torch.Tensor, s: int) -> torch.Tensor:
    """The diagonal ``s x s`` blocks of ``A [..., C, C]`` as a view ``[..., C // s, s, s]``."""
    nb = A.shape[-1] // s
    blocks = A.unflatten(-1, (nb, s)).unflatten(-3, (nb, s)).diagonal(dim1=-4, dim2=-2)  # [..., s, s, nb]
    return blocks.movedim(-1, -3)


def _unit_lower_inverse(A: torch.Tensor) -> torch.Tensor:
    """``T = (I + A)^-1`` for strictly lower triangular ``A [..., C, C]`` (the UT transform).

    The diagonal blocks of size `_SOLVE_BLOCK` are inverted by batched triangular solves; then
    neighbouring diagonal blocks are merged, doubling their size, with
    ``[[I + A11, 0], [A21, I + A22]]^-1 = [[T1, 0], [-T2 A21 T1, T2]]``.
    """
    C = A.shape[-1]
    b = min(C, _SOLVE_BLOCK)
    size = b
    while size < C:
        size *= 2
    eye = torch.eye(b, dtype=A.dtype, device=A.device)
    if size == b:  # unitriangular: the solver reads neither the diagonal (zero in A) nor above it
        return torch.linalg.solve_triangular(A, eye.expand_as(A), upper=False, unitriangular=True)
    if size != C:  # zero rows/columns give identity blocks and leave the top-left inverse unchanged
        A = F.pad(A, (0, size - C, 0, size - C))
    T = torch.zeros_like(A)
    A_diag = _diagonal_blocks(A, b)
    T_diag = torch.linalg.solve_triangular(A_diag, eye.expand_as(A_diag), upper=False, unitriangular=True)
    _diagonal_blocks(T, b).copy_(T_diag)
    s = b
    while s < size:
        T2s, A2s = _diagonal_blocks(T, 2 * s), _diagonal_blocks(A, 2 * s)
        T2s[..., s:, :s] = -(T2s[..., s:, s:] @ (A2s[..., s:, :s] @ T2s[..., :s, :s]))
        s *= 2
    return T[..., :C, :C] if size != C else T


def _bmm(x: torch.Tensor, y: torch.Tensor, add: Optional[torch.Tensor] = None, alpha: float = 1.0) -> torch.Tensor:
    """``add + alpha * x @ y`` for ``[BH, N, ., .]`` operands, as one 3-D bmm.

    `add` (a temporary) is accumulated into in place, which saves a copy of it.
    """
    x3, y3 = x.flatten(0, 1), y.flatten(0, 1)
    out = torch.bmm(x3, y3) if add is None else add.flatten(0, 1).baddbmm_(x3, y3, alpha=alpha)
    return out.unflatten(0, x.shape[:2])


class _Intra(NamedTuple):
    """Per-chunk quantities that do not depend on the state, all ``[B*H, N, ...]``."""

    P: torch.Tensor  # tril(Q K^T), diagonal included        [C, C]
    U: torch.Tensor  # delta rule: T diag(beta) V; sum rule: V [C, Dv]
    W: Optional[torch.Tensor] = None  # T diag(beta) K         [C, Dk]
    T: Optional[torch.Tensor] = None  # (I + A)^-1             [C, C]


def _intra_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: Optional[torch.Tensor]) -> _Intra:
    P = _bmm(q, k.mT).tril_()
    if beta is None:
        return _Intra(P, v)
    A = _bmm(k, k.mT).tril_(-1).mul_(beta[..., :, None])  # A = strictly_lower(diag(beta) K K^T)
    T = _unit_lower_inverse(A)
    Tb = T * beta[..., None, :]  # T diag(beta): one pass over [C, C] instead of two over [C, D]
    return _Intra(P, _bmm(Tb, v), _bmm(Tb, k), T)


def _state_pass(s0: torch.Tensor, k: torch.Tensor, intra: _Intra) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sequential pass over the chunks.

    Returns the state entering each chunk ``[BH, N, Dv, Dk]``, the new values ``U' [BH, N, C, Dv]``
    written to the state (sum rule: V) and the final state ``[BH, Dv, Dk]``.
    """
    if intra.W is None:  # sum rule: S entering chunk c = S_0 + sum_{c' < c} V_c'^T K_c'
        G = _bmm(intra.U.mT, k)
        entering = torch.cat([s0[:, None], G[:, :-1]], dim=1).cumsum_(1)
        return entering, intra.U, entering[:, -1] + G[:, -1]
    entering = k.new_empty(k.shape[0], k.shape[1], *s0.shape[1:])
    # U' is updated in place chunk by chunk: keep it chunk-major so that each chunk is contiguous
    # (in-place batched matmuls into strided views fall back to one matmul per matrix).
    U_new = intra.U.transpose(0, 1).clone(memory_format=torch.contiguous_format)  # a copy: U stays
    S = s0.clone()
    for S_c, U_c, W_c, K_c in zip(entering.unbind(1), U_new.unbind(0), intra.W.unbind(1), k.unbind(1)):
        S_c.copy_(S)
        U_c.baddbmm_(W_c, S.mT, alpha=-1)  # U' = U - W S^T
        S.baddbmm_(U_c.mT, K_c)  # S' = S + U'^T K
    return entering, U_new.transpose(0, 1), S


def _state_pass_backward(
    d_final: torch.Tensor, q: torch.Tensor, k: torch.Tensor, do: torch.Tensor, intra: _Intra
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The transposed pass, from the last chunk: gradients w.r.t. the states and new values.

    With ``O = Q S^T + P U'``, ``U' = U - W S^T``, ``S' = S + U'^T K`` per chunk:
    ``dU' = K dS'^T + P^T dO`` and ``dS = dS' + dO^T Q - dU'^T W``.
    Returns dS' for each chunk (the gradient w.r.t. the state leaving it) ``[BH, N, Dv, Dk]``,
    dU' ``[BH, N, C, Dv]`` and the gradient w.r.t. the initial state.
    """
    dOQ = _bmm(do.mT, q)  # dO^T Q      [Dv, Dk]
    PdO = _bmm(intra.P.mT, do)  # P^T dO [C, Dv]
    if intra.W is None:  # sum rule: dS' of chunk c = dS_N + sum_{c' > c} dO_c'^T Q_c'
        rev = dOQ.flip(1)
        leaving = torch.cat([d_final[:, None], rev[:, :-1]], dim=1).cumsum_(1).flip(1)
        return leaving, _bmm(k, leaving.mT, add=PdO), leaving[:, 0] + dOQ[:, 0]
    leaving = torch.empty_like(dOQ)
    dU_new = PdO.transpose(0, 1).contiguous()  # chunk-major (may alias PdO), updated in place
    dS = d_final.clone()
    chunks = zip(leaving.unbind(1), dU_new.unbind(0), dOQ.unbind(1), intra.W.unbind(1), k.unbind(1))
    for dS_c, dU_c, dOQ_c, W_c, K_c in reversed(list(chunks)):
        dS_c.copy_(dS)
        dU_c.baddbmm_(K_c, dS.mT)  # dU' = P^T dO + K dS'^T
        dS.add_(dOQ_c).baddbmm_(dU_c.mT, W_c, alpha=-1)  # dS = dS' + dO^T Q - dU'^T W
    return leaving, dU_new.transpose(0, 1), dS


def _forward(q, k, v, beta, s0):
    """Chunked inputs ``[BH, N, C, D]`` -> chunked outputs ``[BH, N, C, Dv]`` and the final state."""
    if q.shape[1] == 0:  # T = 0
        return v.clone(), s0
    intra = _intra_chunk(q, k, v, beta)
    S, U_new, final = _state_pass(s0, k, intra)
    return _bmm(q, S.mT, add=_bmm(intra.P, U_new)), final  # O = Q S^T + P U'


def _backward(do, d_final, q, k, v, beta, s0):
    """Gradients of the chunked inputs and of s0, recomputing the forward's per-chunk quantities."""
    if q.shape[1] == 0:  # T = 0
        return q.clone(), k.clone(), v.clone(), None if beta is None else beta.clone(), d_final
    intra = _intra_chunk(q, k, v, beta)
    S, U_new, _ = _state_pass(s0, k, intra)
    dS_next, dU_new, ds0 = _state_pass_backward(d_final, q, k, do, intra)
    # O = Q S^T + P U', P = tril(Q K^T), S' = S + U'^T K
    dP = _bmm(do, U_new.mT).tril_()
    dq = _bmm(dP, k, add=_bmm(do, S))
    dk = _bmm(dP.mT, q, add=_bmm(U_new, dS_next))
    if intra.W is None:
        return dq, dk, dU_new, None, ds0
    # U' = U - W S^T;  [W, U] = T diag(beta) [K, V], T = (I + A)^-1:
    #   d(diag(beta) K) = T^T dW,  d(diag(beta) V) = T^T dU,
    #   dA = -strictly_lower(T^T dT T^T) = -strictly_lower(d(diag(beta) K) W^T + d(diag(beta) V) U^T)
    dKb = _bmm(intra.T.mT, _bmm(dU_new, S)).neg_()  # dW = -dU' S
    dVb = _bmm(intra.T.mT, dU_new)
    dA = _bmm(dVb, intra.U.mT, add=_bmm(dKb, intra.W.mT)).tril_(-1).neg_()
    # A = strictly_lower(diag(beta) K K^T):  dK += diag(beta) dA K + dA^T diag(beta) K,
    #                                         dbeta_i += (dA K)_i . k_i
    dAK_Kb = _bmm(dA, k).add_(dKb)
    dk = _bmm(dA.mT, k * beta[..., None], add=dk).addcmul_(beta[..., None], dAK_Kb)
    dbeta = (dAK_Kb * k).sum(-1) + (dVb * v).sum(-1)
    return dq, dk, beta[..., None] * dVb, dbeta, ds0


def _prepare(q, k, v, beta, initial_state, chunk_size):
    """Chunked fp32 (fp64) copies of the inputs and the ``[B*H, Dv, Dk]`` initial state."""
    acc = _acc_dtype(q, k, v, beta, initial_state)
    B, H, _, Dk = q.shape
    Dv = v.shape[-1]
    chunks = [None if x is None else _to_chunks(x, chunk_size, acc) for x in (q, k, v, beta)]
    if initial_state is None:
        return chunks, q.new_zeros(B * H, Dv, Dk, dtype=acc)
    return chunks, initial_state.reshape(B * H, Dv, Dk).to(acc)


# ---------------------------------------------------------------------------------------------------
# the compiled CPU kernel (csrc/chunk_delta.cpp)

_SOURCE = Path(__file__).resolve().parent / "csrc" / "chunk_delta.cpp"
try:  # inside a saved model folder the C++ source travels as a string (transformers copies only Python modules)
    from .chunk_delta_csrc import CPP_SOURCE as _EMBEDDED_SOURCE
except ImportError:  # the installed package: the source is csrc/chunk_delta.cpp
    _EMBEDDED_SOURCE = None
_CPU_KERNEL = CompiledCpuKernel(
    _SOURCE, _EMBEDDED_SOURCE, "fwp_chunk", "chunk_forward", ["-O3"], "the PyTorch chunked kernel (slower on CPU)"
)


def cpu_kernel_status() -> str:
    """Which CPU path the chunked kernels take: ``"built"`` (C++), ``"disabled (...)"``, ``"unavailable (...)"``
    or ``"failed (...)"`` (all three run the PyTorch path), or ``"not tried yet"``."""
    return _CPU_KERNEL.status


def cpu_kernel_available() -> bool:
    """Builds (once per source version, cached on disk; see ``cpp_build``) and loads the C++ chunk kernel; False
    when it cannot, and the PyTorch path runs."""
    return _CPU_KERNEL.available()


def _cpu_kernel_applies(x: torch.Tensor, acc: torch.dtype) -> bool:
    """Whether the C++ kernel runs for inputs like `x` accumulated in `acc` (CPU, float32 / float64)."""
    return x.device.type == "cpu" and acc in (torch.float32, torch.float64) and cpu_kernel_available()


def _flat(x: Optional[torch.Tensor], acc: torch.dtype) -> Optional[torch.Tensor]:
    """``[B, H, T, *D]`` -> contiguous ``[B*H, T, *D]`` in `acc` (a view when it already is)."""
    return None if x is None else x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]).to(acc).contiguous()


def _forward_cpu(q, k, v, beta, initial_state, chunk_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The C++ forward: ``[B, H, T, D]`` inputs -> o ``[B, H, T, Dv]`` (q's dtype), final state ``[B, H, Dv, Dk]``."""
    acc = _acc_dtype(q, k, v, beta, initial_state)
    B, H, T, Dk = q.shape
    Dv = v.shape[-1]
    state = q.new_zeros(B * H, Dv, Dk, dtype=acc)  # written in place: never the caller's tensor
    if initial_state is not None:
        state.copy_(initial_state.reshape(B * H, Dv, Dk))
    o = q.new_empty(B * H, T, Dv, dtype=acc)
    flat = [_flat(x, acc) for x in (q, k, v, beta)]
    torch.ops.fwp_chunk.chunk_forward(*flat, state, chunk_size, o, None, None)
    return o.view(B, H, T, Dv).to(q.dtype), state.view(B, H, Dv, Dk)


def _backward_cpu(do, d_final, q, k, v, beta, initial_state, chunk_size: int):
    """The C++ backward (recomputes the states entering the chunks): gradients of q, k, v, beta, initial_state."""
    acc = _acc_dtype(q, k, v, beta, initial_state)
    B, H, T, Dk = q.shape
    Dv = v.shape[-1]
    flat = [_flat(x, acc) for x in (q, k, v, beta)]
    s0 = q.new_zeros(B * H, Dv, Dk, dtype=acc) if initial_state is None else _flat(initial_state, acc)
    do = torch.zeros_like(flat[2]) if do is None else _flat(do, acc)
    dS = q.new_zeros(B * H, Dv, Dk, dtype=acc)  # in: the final state's gradient, out: the initial state's
    if d_final is not None:
        dS.copy_(d_final.reshape(B * H, Dv, Dk))
    dq, dk, dv = torch.empty_like(flat[0]), torch.empty_like(flat[1]), torch.empty_like(flat[2])
    dbeta = None if beta is None else torch.empty_like(flat[3])
    torch.ops.fwp_chunk.chunk_backward(*flat, s0, chunk_size, do, dS, dq, dk, dv, dbeta)
    grads = [None if g is None else g.view(x.shape).to(x.dtype) for g, x in ((dq, q), (dk, k), (dv, v), (dbeta, beta))]
    ds0 = None if initial_state is None else dS.view(initial_state.shape).to(initial_state.dtype)
    return (*grads, ds0)


class ChunkFastWeightFunction(torch.autograd.Function):
    """Chunkwise fast weights; the delta rule when `beta` is given, the sum rule when it is None.

    Saves only its inputs for backward, which recomputes everything else chunk by chunk.
    """

    @staticmethod
    def forward(ctx, q, k, v, beta, initial_state, chunk_size):
        # A sequence shorter than a chunk is one chunk of its own length (no padded work).
        chunk_size = max(1, min(chunk_size, q.shape[2]))
        ctx.save_for_backward(q, k, v, beta, initial_state)
        ctx.chunk_size = chunk_size
        ctx.set_materialize_grads(False)
        if _cpu_kernel_applies(q, _acc_dtype(q, k, v, beta, initial_state)):
            return _forward_cpu(q, k, v, beta, initial_state, chunk_size)
        chunks, s0 = _prepare(q, k, v, beta, initial_state, chunk_size)
        o, final = _forward(*chunks, s0)
        return _from_chunks(o, q), final.view(*q.shape[:2], *final.shape[1:])

    @staticmethod
    def backward(ctx, do, d_final):
        q, k, v, beta, initial_state = ctx.saved_tensors
        if _cpu_kernel_applies(q, _acc_dtype(q, k, v, beta, initial_state)):
            return (*_backward_cpu(do, d_final, q, k, v, beta, initial_state, ctx.chunk_size), None)
        chunks, s0 = _prepare(q, k, v, beta, initial_state, ctx.chunk_size)
        do = torch.zeros_like(v, dtype=s0.dtype) if do is None else do
        d_final = torch.zeros_like(s0) if d_final is None else d_final.reshape(s0.shape).to(s0.dtype)
        dq, dk, dv, dbeta, ds0 = _backward(_to_chunks(do, ctx.chunk_size, s0.dtype), d_final, *chunks, s0)
        grads = [None if g is None else _from_chunks(g, x) for g, x in ((dq, q), (dk, k), (dv, v), (dbeta, beta))]
        ds0 = None if initial_state is None else ds0.view(initial_state.shape).to(initial_state.dtype)
        return (*grads, ds0, None)


def delta_rule_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Delta rule, chunkwise-parallel (WY representation / UT transform).

    Args:
        q, k: ``[B, H, T, Dk]``; v: ``[B, H, T, Dv]``; beta: ``[B, H, T]``; any T.
        initial_state: ``[B, H, Dv, Dk]`` or None (zeros).
        output_final_state: also return the final state.
        chunk_size: positions per chunk.
    Returns:
        o ``[B, H, T, Dv]`` in q's dtype, and the final state ``[B, H, Dv, Dk]`` (float32; float64 for
        float64 inputs) or None.
    """
    o, final = ChunkFastWeightFunction.apply(q, k, v, beta, initial_state, chunk_size)
    return o, (final if output_final_state else None)


def linear_attention_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Sum rule (linear attention), chunkwise-parallel.

    Args and returns as in :func:`delta_rule_chunk`, without `beta`.
    """
    if q.shape[2] <= chunk_size:
        return linear_attention_one_chunk(q, k, v, initial_state, output_final_state)
    o, final = ChunkFastWeightFunction.apply(q, k, v, None, initial_state, chunk_size)
    return o, (final if output_final_state else None)


def linear_attention_one_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Sum rule over a sequence that fits in one chunk, in closed form: with ``S_0`` the initial state,

        o = tril(Q K^T) V + Q S_0^T,        S_T = S_0 + V^T K

    three batched matmuls (and autograd's for the backward), no chunk loop: what short segments (Transformer-XL
    segments, the FWL's fast pass over them) and decoding of a few tokens cost. Same args and returns as
    :func:`linear_attention_chunk`; accumulates in float32 (float64 for float64 inputs).
    """
    acc = _acc_dtype(q, k, v, None, initial_state)
    qa, ka, va = q.to(acc), k.to(acc), v.to(acc)
    o = torch.matmul(torch.matmul(qa, ka.transpose(-1, -2)).tril(), va)
    if initial_state is not None:
        o = o + torch.matmul(qa, initial_state.to(acc).transpose(-1, -2))
    final = None
    if output_final_state:
        final = torch.matmul(va.transpose(-1, -2), ka)
        if initial_state is not None:
            final = final + initial_state.to(acc)
    return o.to(q.dtype), final
