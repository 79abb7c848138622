"""The delta rule (Schlag, Irie, Schmidhuber 2021, sec. 4.2, eqs. 20-25), every kernel of it:

    W_t = W_{t-1} + beta_t (v_t - W_{t-1} k_t) k_t^T ;  o_t = W_t q_t

Modes (``dispatch.MODES``): "recurrent" (:func:`delta_rule_recurrent`, the step loop), "chunk"
(:func:`delta_rule_chunk`, the WY representation / UT transform of :class:`DeltaRuleChunks` run by ``chunk.py``: C++
on CPU, PyTorch elsewhere; ``triton_chunk.delta_rule_chunk`` on CUDA), "auto" (``chunk.auto_mode``).

Layout (DESIGN.md kernel contract): q, k ``[B, H, T, Dk]``, v ``[B, H, T, Dv]``, beta ``[B, H, T]``,
fast weight state ``[B, H, Dv, Dk]`` (the paper's W, read as ``y = W q``), accumulated in float32
(float64 when an input is float64, which the tests use as an exact reference).
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
    unit_lower_inverse,
)
from .dispatch import (
    Recurrence,
    acc_dtype,
    initial_fast_weight,
    register,
)


def delta_rule_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    chunk_size: Optional[int] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Delta rule, one step at a time (Schlag et al. 2021, sec. 4.2, eqs. 20-25): the reference of every other mode.

    Args:
        q, k: ``[B, H, T, Dk]``; v: ``[B, H, T, Dv]``; beta: ``[B, H, T]``.
        initial_state: ``[B, H, Dv, Dk]`` or None (zeros).
        chunk_size: ignored (every kernel of the delta rule takes the same arguments).
    Returns:
        o ``[B, H, T, Dv]`` in q's dtype, and the final state ``[B, H, Dv, Dk]`` (float32; float64 for
        float64 inputs) or None.
    """
    acc = acc_dtype(q, k, v, beta, initial_state)
    W = initial_fast_weight(q, v, initial_state, acc)
    qf, kf, vf, bf = q.to(acc), k.to(acc), v.to(acc), beta.to(acc)
    outputs = []
    for t in range(q.shape[2]):
        k_t = kf[:, :, t]  # [B, H, Dk]
        # v_bar_t = W_{t-1} k_t : the value currently stored under key k_t (eq. 20)
        v_old = torch.einsum("bhvk,bhk->bhv", W, k_t)
        # W_t = W_{t-1} + beta_t (v_t - v_bar_t) k_t^T (eq. 24)
        delta = bf[:, :, t, None] * (vf[:, :, t] - v_old)
        W = W + delta[..., :, None] * k_t[..., None, :]
        # y_t = W_t q_t (eq. 25)
        outputs.append(torch.einsum("bhvk,bhk->bhv", W, qf[:, :, t]))
    o = torch.stack(outputs, dim=2) if outputs else vf.new_zeros(vf.shape)
    return o.to(q.dtype), (W if output_final_state else None)


class DeltaRuleChunks(ChunkRule):
    """The delta rule's half of the chunkwise algorithm (chunk.py), in the WY form:

        U' = U - W S^T,  O = Q S^T + tril(Q K^T) U',  S' = S + U'^T K,
        T = (I + A)^-1,  A = strictly_lower(diag(beta) K K^T),  W = T diag(beta) K,  U = T diag(beta) V.
    """

    name = "delta rule"
    gates = ("beta",)
    cpp = True  # csrc/chunk_delta.cpp

    def intra(self, q, k, v, beta) -> Intra:
        P = bmm(q, k.mT).tril_()
        A = bmm(k, k.mT).tril_(-1).mul_(beta[..., :, None])  # A = strictly_lower(diag(beta) K K^T)
        T = unit_lower_inverse(A)
        Tb = T * beta[..., None, :]  # T diag(beta): one pass over [C, C] instead of two over [C, D]
        return Intra(P, bmm(Tb, v), bmm(Tb, k), T)

    def state_pass(self, s0, k, intra):
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

    def state_pass_backward(self, d_final, q, k, do, intra):
        # With O = Q S^T + P U', U' = U - W S^T, S' = S + U'^T K per chunk:
        # dU' = K dS'^T + P^T dO and dS = dS' + dO^T Q - dU'^T W.
        dOQ = bmm(do.mT, q)  # dO^T Q      [Dv, Dk]
        PdO = bmm(intra.P.mT, do)  # P^T dO [C, Dv]
        leaving = torch.empty_like(dOQ)
        dU_new = PdO.transpose(0, 1).contiguous()  # chunk-major (may alias PdO), updated in place
        dS = d_final.clone()
        chunks = zip(leaving.unbind(1), dU_new.unbind(0), dOQ.unbind(1), intra.W.unbind(1), k.unbind(1))
        for dS_c, dU_c, dOQ_c, W_c, K_c in reversed(list(chunks)):
            dS_c.copy_(dS)
            dU_c.baddbmm_(K_c, dS.mT)  # dU' = P^T dO + K dS'^T
            dS.add_(dOQ_c).baddbmm_(dU_c.mT, W_c, alpha=-1)  # dS = dS' + dO^T Q - dU'^T W
        return leaving, dU_new.transpose(0, 1), dS

    def value_grads(self, dk, dU_new, S, intra, k, v, beta):
        # U' = U - W S^T;  [W, U] = T diag(beta) [K, V], T = (I + A)^-1:
        #   d(diag(beta) K) = T^T dW,  d(diag(beta) V) = T^T dU,
        #   dA = -strictly_lower(T^T dT T^T) = -strictly_lower(d(diag(beta) K) W^T + d(diag(beta) V) U^T)
        dKb = bmm(intra.T.mT, bmm(dU_new, S)).neg_()  # dW = -dU' S
        dVb = bmm(intra.T.mT, dU_new)
        dA = bmm(dVb, intra.U.mT, add=bmm(dKb, intra.W.mT)).tril_(-1).neg_()
        # A = strictly_lower(diag(beta) K K^T):  dK += diag(beta) dA K + dA^T diag(beta) K,
        #                                         dbeta_i += (dA K)_i . k_i
        dAK_Kb = bmm(dA, k).add_(dKb)
        dk = bmm(dA.mT, k * beta[..., None], add=dk).addcmul_(beta[..., None], dAK_Kb)
        dbeta = (dAK_Kb * k).sum(-1) + (dVb * v).sum(-1)
        return dk, beta[..., None] * dVb, (dbeta,)


DELTA_RULE_CHUNKS = DeltaRuleChunks()


def delta_rule_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Delta rule, chunkwise-parallel (WY representation / UT transform; the C++ kernel on CPU).

    Args:
        q, k: ``[B, H, T, Dk]``; v: ``[B, H, T, Dv]``; beta: ``[B, H, T]``; any T.
        initial_state: ``[B, H, Dv, Dk]`` or None (zeros).
        output_final_state: also return the final state.
        chunk_size: positions per chunk.
    Returns:
        o ``[B, H, T, Dv]`` in q's dtype, and the final state ``[B, H, Dv, Dk]`` (float32; float64 for
        float64 inputs) or None.
    """
    o, final = chunk_fast_weights(DELTA_RULE_CHUNKS, chunk_size, q, k, v, initial_state, beta)
    return o, (final if output_final_state else None)


DELTA_RULE = register(
    Recurrence(
        "delta_rule",
        reference=delta_rule_recurrent,
        kernels={"chunk": chunk_kernel_finder(delta_rule_chunk, "triton_chunk.delta_rule_chunk")},
        auto=auto_mode,
    )
)


def delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    *,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    mode: str = "auto",
    chunk_size: int = 64,
    mask: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Delta rule fast weights: ``W_t = W_{t-1} + beta_t (v_t - W_{t-1} k_t) k_t^T``, ``o_t = W_t q_t``.

    Args:
        q, k: ``[B, H, T, Dk]``; v: ``[B, H, T, Dv]``; beta: ``[B, H, T]``.
        initial_state: ``[B, H, Dv, Dk]`` or None (zeros).
        output_final_state: return the final ``[B, H, Dv, Dk]`` float32 state.
        mode: "recurrent" (step loop), "chunk" (chunkwise-parallel) or "auto".
        chunk_size: chunk length for mode "chunk" (any T works; the last chunk is padded internally); mode "auto" on
            CPU with the C++ kernel takes the measured one for heads up to 128 wide (`chunk.auto_chunk_size`).
        mask: ``[B, T]`` or None; 0 marks padding, where k and beta are zeroed, so that nothing is written (the
            outputs there are of no use).
    Returns:
        ``(o [B, H, T, Dv] in q's dtype, final_state or None)``.
    """
    return run_outer_product_rule(
        DELTA_RULE, q, k, v, {"beta": beta}, initial_state, output_final_state, mode, chunk_size, mask
    )
