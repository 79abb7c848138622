"""The sum rule, i.e. linear attention (Schlag, Irie, Schmidhuber 2021, eqs. 10-11 and 17), every kernel of it:

    W_t = W_{t-1} + v_t k_t^T ;  o_t = W_t q_t

Modes (``dispatch.MODES``): "recurrent" (:func:`linear_attention_recurrent`, the step loop), "chunk"
(:func:`linear_attention_chunk`: :class:`SumRuleChunks` run by ``chunk.py``, C++ on CPU, PyTorch elsewhere, and the
closed form :func:`linear_attention_one_chunk` for a sequence that fits in one chunk; ``triton_chunk`` on CUDA),
"auto" (``chunk.auto_mode``). Layout and dtypes as in ``delta_rule_kernels.py``.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .chunk import (
    ChunkRule,
    Intra,
    auto_mode,
    bmm,
    chunk_fast_weights,
    chunk_kernel_finder,
    run_outer_product_rule,
)
from .dispatch import (
    Recurrence,
    acc_dtype,
    as_dtype,
    initial_fast_weight,
    register,
)


def linear_attention_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    chunk_size: Optional[int] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Sum rule (linear attention), one step at a time (Schlag et al. 2021, sec. 3, eqs. 10-11): the reference.

    Args:
        q, k: ``[B, H, T, Dk]``; v: ``[B, H, T, Dv]``; initial_state: ``[B, H, Dv, Dk]`` or None.
        chunk_size: ignored (every kernel of the sum rule takes the same arguments).
    Returns:
        o ``[B, H, T, Dv]`` in q's dtype, and the final state (float32, float64 for float64 inputs) or None.
    """
    acc = acc_dtype(q, k, v, initial_state)
    W = initial_fast_weight(q, v, initial_state, acc)
    qf, kf, vf = q.to(acc), k.to(acc), v.to(acc)
    outputs = []
    for t in range(q.shape[2]):
        # W_t = W_{t-1} + v_t k_t^T (eq. 10);  y_t = W_t q_t (eq. 11)
        W = W + vf[:, :, t, :, None] * kf[:, :, t, None, :]
        outputs.append(torch.einsum("bhvk,bhk->bhv", W, qf[:, :, t]))
    o = torch.stack(outputs, dim=2) if outputs else vf.new_zeros(vf.shape)
    return o.to(q.dtype), (W if output_final_state else None)


class SumRuleChunks(ChunkRule):
    """The sum rule's half of the chunkwise algorithm (chunk.py): ``O = Q S^T + tril(Q K^T) V``, ``S' = S + V^T K``.

    No gates and no correction of the values (``U' = U = V``): both passes over the chunks are cumulative sums.
    """

    name = "sum rule"
    gates = ()
    cpp = True  # csrc/chunk_delta.cpp

    def intra(self, q, k, v) -> Intra:
        return Intra(bmm(q, k.mT).tril_(), v)

    def state_pass(self, s0, k, intra):
        # S entering chunk c = S_0 + sum_{c' < c} V_c'^T K_c'
        G = bmm(intra.U.mT, k)
        entering = torch.cat([s0[:, None], G[:, :-1]], dim=1).cumsum_(1)
        return entering, intra.U, entering[:, -1] + G[:, -1]

    def state_pass_backward(self, d_final, q, k, do, intra):
        # dS' of chunk c = dS_N + sum_{c' > c} dO_c'^T Q_c';  dU' = K dS'^T + P^T dO
        dOQ = bmm(do.mT, q)  # dO^T Q      [Dv, Dk]
        PdO = bmm(intra.P.mT, do)  # P^T dO [C, Dv]
        rev = dOQ.flip(1)
        leaving = torch.cat([d_final[:, None], rev[:, :-1]], dim=1).cumsum_(1).flip(1)
        return leaving, bmm(k, leaving.mT, add=PdO), leaving[:, 0] + dOQ[:, 0]

    def value_grads(self, dk, dU_new, S, intra, k, v):
        return dk, dU_new, ()


SUM_RULE_CHUNKS = SumRuleChunks()


def linear_attention_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Sum rule (linear attention), chunkwise-parallel.

    Args and returns as in :func:`fwp_kernels.delta_rule_kernels.delta_rule_chunk`, without `beta`.
    """
    # A decode step (T = 1) on CPU takes the C++ one-pass decode_step (faster than the closed form, e.g. 0.022 vs
    # 0.031 ms at B*H = 8, D = 64 and 0.086 vs 0.81 ms at B*H = 16, D = 128; process time, one thread, s24-cpu).
    decode = q.shape[2] == 1 and SUM_RULE_CHUNKS.compiled(q, acc_dtype(q, k, v, initial_state))
    if q.shape[2] <= chunk_size and not decode:
        return linear_attention_one_chunk(q, k, v, initial_state, output_final_state)
    o, final = chunk_fast_weights(SUM_RULE_CHUNKS, chunk_size, q, k, v, initial_state)
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
    acc = acc_dtype(q, k, v, None, initial_state)
    qa, ka, va = as_dtype(q, acc), as_dtype(k, acc), as_dtype(v, acc)
    o = torch.matmul(torch.matmul(qa, ka.transpose(-1, -2)).tril(), va)
    if initial_state is not None:
        o = o + torch.matmul(qa, as_dtype(initial_state, acc).transpose(-1, -2))
    final = None
    if output_final_state:
        final = torch.matmul(va.transpose(-1, -2), ka)
        if initial_state is not None:
            final = final + as_dtype(initial_state, acc)
    return as_dtype(o, q.dtype), final


LINEAR_ATTENTION = register(
    Recurrence(
        "linear_attention",
        reference=linear_attention_recurrent,
        kernels={"chunk": chunk_kernel_finder(linear_attention_chunk, "triton_chunk.linear_attention_chunk")},
        auto=auto_mode,
    )
)


def linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    mode: str = "auto",
    chunk_size: int = 64,
    mask: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Sum-rule fast weights (linear attention): ``W_t = W_{t-1} + v_t k_t^T``, ``o_t = W_t q_t``.

    Args:
        q, k: ``[B, H, T, Dk]``; v: ``[B, H, T, Dv]``; initial_state ``[B, H, Dv, Dk]`` or None.
        output_final_state, mode, chunk_size: as in :func:`fwp_kernels.delta_rule`.
        mask: ``[B, T]`` or None; 0 marks padding, where k is zeroed, so that nothing is written (the outputs there
            are of no use).
    Returns:
        ``(o [B, H, T, Dv] in q's dtype, final_state or None)``.
    """
    return run_outer_product_rule(
        LINEAR_ATTENTION, q, k, v, {}, initial_state, output_final_state, mode, chunk_size, mask
    )
