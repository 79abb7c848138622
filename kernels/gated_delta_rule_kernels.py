"""The gated delta rule (Yang, Kautz, Hatamizadeh 2025, "Gated Delta Networks", sec. 3.1), every kernel of it:

    W_t = a_t W_{t-1} + beta_t (v_t - a_t W_{t-1} k_t) k_t^T ;  a_t = exp(g_t) ;  o_t = W_t q_t

that is the delta rule (Schlag et al. 2021, eq. 24) applied to the decayed state ``a_t W_{t-1}`` (Mamba2's scalar
gate); ``g = 0`` is the delta rule.

Modes (``dispatch.MODES``): "recurrent" (:func:`gated_delta_rule_recurrent`, the step loop), "chunk"
(:func:`gated_delta_rule_chunk`, the decayed WY representation / UT transform of :class:`GatedDeltaRuleChunks`: the
C++ kernel ``csrc/chunk_delta.cpp`` (its ``gated_*`` ops) on CPU, PyTorch elsewhere;
``triton_gated_chunk.gated_delta_rule_chunk`` on CUDA), "auto".

Layout (DESIGN.md kernel contract): q, k ``[B, H, T, Dk]``, v ``[B, H, T, Dv]``, beta and g ``[B, H, T]`` (g the log
of the decay, normally <= 0), fast weight state ``[B, H, Dv, Dk]`` (the paper's W, read as ``y = W q``), accumulated
in float32 (float64 when an input is float64).
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch

from . import chunk
from .chunk import (
    ChunkRule,
    _flat,
    bmm,
    chunk_fast_weights,
    chunk_kernel_finder,
    run_outer_product_rule,
    compiled_forward_buffers,
    unit_lower_inverse,
)
from .dispatch import (
    Recurrence,
    acc_dtype,
    initial_fast_weight,
    register,
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


# The delta rule's C++ kernel (csrc/chunk_delta.cpp) has this rule's ops too (gated_forward, gated_backward: the same
# products and substitutions). Whether it runs (built on first use); module attributes, so that tests can switch it
# off for this rule alone.
_CPU_KERNEL = chunk._CPU_KERNEL
cpu_kernel_status = _CPU_KERNEL.describe
cpu_kernel_available = _CPU_KERNEL.available


def _products(flat) -> int:
    """The C++ kernel's products for the tensors it is handed: the delta rule's choice for its q, k, v, beta
    (``chunk._flat_products``), for this rule runs the delta rule's chunk loops with its decays applied to their
    products. bfloat16 factors (AVX-512 BF16) for bfloat16 inputs since those loops carry the decays (before, this
    rule's own loops with bfloat16 factors gained nothing over float32 ones, and it took float32 factors). g is no
    factor of a product: its dtype (bfloat16, or float32 beside bfloat16 inputs: ``_io_dtypes``) does not choose."""
    return chunk._flat_products(flat[:4])


def _io_dtypes(q, k, v, gates, acc: torch.dtype) -> Tuple[torch.dtype, torch.dtype]:
    """The dtypes in which the C++ gated ops take q, k, v, beta (the output gradient; write o and those gradients) and
    g (and write dg): bfloat16 inputs go in as they are with g in bfloat16 or in float32, as a bfloat16 model computes
    its log-decays (``GatedDeltaNetLayer.log_decay``: before, float32 g made the kernel take float32 copies of
    everything and float32 factors); else ``chunk.io_dtype``'s choice for all."""
    beta, g = gates
    if chunk.io_dtype(q, k, v, (beta,), acc) == torch.bfloat16 and g.dtype in (torch.bfloat16, torch.float32):
        return torch.bfloat16, g.dtype
    io = chunk.io_dtype(q, k, v, gates, acc)
    return io, io


def _flat_inputs(q, k, v, gates, io: torch.dtype, g_io: torch.dtype) -> list:
    """q, k, v, beta, g as the gated ops take them: ``[B*H, T, ...]`` in `io` (g in `g_io`)."""
    beta, g = gates
    return [_flat(x, io) for x in (q, k, v, beta)] + [_flat(g, g_io)]


class GatedIntra(NamedTuple):
    """Per-chunk quantities of the gated rule that do not depend on the state, all ``[BH, N, ...]``."""

    P: torch.Tensor  # tril(Q K^T) * D                    [C, C]
    U: torch.Tensor  # T diag(beta) V                     [C, Dv]
    W: torch.Tensor  # T diag(beta Gamma) K               [C, Dk]
    T: torch.Tensor  # (I + A)^-1                         [C, C]
    D: torch.Tensor  # exp(gamma_i - gamma_j), i >= j; 0 above the diagonal   [C, C]
    KD: torch.Tensor  # strictly_lower(K K^T * D); A = diag(beta) KD           [C, C]
    gamma: torch.Tensor  # cumulative log-decay within the chunk               [C]


class GatedDeltaRuleChunks(ChunkRule):
    """The gated delta rule's chunkwise form (derivation: README.md, "Gated delta rule"). Per chunk, with the
    cumulative log-decay gamma_i = g_1 + ... + g_i, Gamma = exp(gamma), D_ij = exp(gamma_i - gamma_j) (i >= j) and
    lambda_j = exp(gamma_C - gamma_j):

        (I + A) U' = diag(beta) (V - diag(Gamma) K S^T),   A = strictly_lower(diag(beta) (K K^T * D)),
        O = diag(Gamma) Q S^T + (tril(Q K^T) * D) U',        S' = Gamma_C S + U'^T diag(lambda) K,

    in the WY form U' = U - W S^T, U = T diag(beta) V, W = T diag(beta Gamma) K, T = (I + A)^-1.
    """

    name = "gated delta rule"
    gates = ("beta", "g")

    def compiled(self, x: torch.Tensor, acc: torch.dtype) -> bool:
        """csrc/chunk_delta.cpp's gated ops on CPU for float32 / float64 accumulation, when it is built."""
        return x.device.type == "cpu" and acc in (torch.float32, torch.float64) and cpu_kernel_available()

    def compiled_forward(self, q, k, v, gates, initial_state, chunk_size: int):
        if q.shape[2] == 1 and chunk.cpu_kernel_available():  # a decode step: the delta rule's one-pass kernel, gated
            return chunk.decode_cpu(q, k, v, gates, initial_state)
        acc = acc_dtype(q, k, v, initial_state, *gates)
        io, g_io = _io_dtypes(q, k, v, gates, acc)
        state, o = compiled_forward_buffers(q, v, initial_state, acc, io)
        flat = _flat_inputs(q, k, v, gates, io, g_io)
        _CPU_KERNEL.ops.gated_forward(*flat, state, chunk_size, o, _products(flat))
        return o.view_as(v).to(q.dtype), state.view(*q.shape[:2], v.shape[-1], q.shape[-1])

    def compiled_backward(self, do, d_final, q, k, v, gates, initial_state, chunk_size: int):
        acc = acc_dtype(q, k, v, initial_state, *gates)
        B, H, T, Dk = q.shape
        Dv = v.shape[-1]
        io, g_io = _io_dtypes(q, k, v, gates, acc)
        flat = _flat_inputs(q, k, v, gates, io, g_io)
        s0 = q.new_zeros(B * H, Dv, Dk, dtype=acc) if initial_state is None else _flat(initial_state, acc)
        do = torch.zeros_like(flat[2]) if do is None else _flat(do, io)
        dS = q.new_zeros(B * H, Dv, Dk, dtype=acc)  # in: the final state's gradient, out: the initial state's
        if d_final is not None:
            dS.copy_(d_final.reshape(B * H, Dv, Dk))
        grads = [torch.empty_like(x) for x in flat]  # dq, dk, dv, dbeta, dg
        _CPU_KERNEL.ops.gated_backward(*flat, s0, chunk_size, do, dS, *grads, _products(flat))
        dq, dk, dv, dbeta, dg = (d.view(x.shape).to(x.dtype) for d, x in zip(grads, (q, k, v, *gates)))
        ds0 = None if initial_state is None else dS.view(initial_state.shape).to(initial_state.dtype)
        return dq, dk, dv, (dbeta, dg), ds0

    def intra(self, q, k, v, beta, g) -> GatedIntra:
        gamma = g.cumsum(-1)
        C = g.shape[-1]
        upper = torch.ones(C, C, dtype=torch.bool, device=g.device).triu_(1)
        # D = exp(gamma_i - gamma_j) below and on the diagonal; masked before exp (no overflow above it)
        D = (gamma[..., :, None] - gamma[..., None, :]).masked_fill_(upper, float("-inf")).exp_()
        P = bmm(q, k.mT).mul_(D)
        KD = bmm(k, k.mT).mul_(D).tril_(-1)
        T = unit_lower_inverse(KD * beta[..., :, None])  # (I + A)^-1
        Tb = T * beta[..., None, :]
        W = bmm(Tb, k * gamma.exp()[..., None])
        return GatedIntra(P, bmm(Tb, v), W, T, D, KD, gamma)

    def state_pass(self, s0, k, intra):
        decay = intra.gamma[..., -1].exp()  # Gamma_C per chunk [BH, N]
        k_decayed = k * (intra.gamma[..., -1:] - intra.gamma).exp()[..., None]  # diag(lambda) K
        entering = k.new_empty(k.shape[0], k.shape[1], *s0.shape[1:])
        U_new = intra.U.transpose(0, 1).clone(memory_format=torch.contiguous_format)  # chunk-major, a copy
        S = s0.clone()
        chunks = zip(entering.unbind(1), U_new.unbind(0), intra.W.unbind(1), k_decayed.unbind(1), decay.unbind(1))
        for S_c, U_c, W_c, K_c, a_c in chunks:
            S_c.copy_(S)
            U_c.baddbmm_(W_c, S.mT, alpha=-1)  # U' = U - W S^T
            S.mul_(a_c[:, None, None]).baddbmm_(U_c.mT, K_c)  # S' = Gamma_C S + U'^T diag(lambda) K
        return entering, U_new.transpose(0, 1), S

    def forward_chunks(self, q, k, v, gates, s0):
        if q.shape[1] == 0:  # T = 0
            return v.clone(), s0
        intra = self.intra(q, k, v, *gates)
        S, U_new, final = self.state_pass(s0, k, intra)
        q_decayed = q * intra.gamma.exp()[..., None]
        return bmm(q_decayed, S.mT, add=bmm(intra.P, U_new)), final  # O = diag(Gamma) Q S^T + P U'

    def state_pass_backward(self, d_final, q, k, do, intra):
        # O = diag(Gamma) Q S^T + P U', U' = U - W S^T, S' = Gamma_C S + U'^T diag(lambda) K per chunk:
        # dU' = diag(lambda) K dS'^T + P^T dO,  dS = Gamma_C dS' + dO^T diag(Gamma) Q - dU'^T W.
        decay = intra.gamma[..., -1].exp()
        k_decayed = k * (intra.gamma[..., -1:] - intra.gamma).exp()[..., None]
        dOQ = bmm(do.mT, q * intra.gamma.exp()[..., None])
        leaving = torch.empty_like(dOQ)
        dU_new = bmm(intra.P.mT, do).transpose(0, 1).contiguous()
        dS = d_final.clone()
        chunks = zip(leaving.unbind(1), dU_new.unbind(0), dOQ.unbind(1), intra.W.unbind(1), k_decayed.unbind(1),
                     decay.unbind(1))
        for dS_c, dU_c, dOQ_c, W_c, K_c, a_c in reversed(list(chunks)):
            dS_c.copy_(dS)
            dU_c.baddbmm_(K_c, dS.mT)
            dS.mul_(a_c[:, None, None]).add_(dOQ_c).baddbmm_(dU_c.mT, W_c, alpha=-1)
        return leaving, dU_new.transpose(0, 1), dS

    def backward_chunks(self, do, d_final, q, k, v, gates, s0):
        beta, g = gates
        if q.shape[1] == 0:  # T = 0
            return q.clone(), k.clone(), v.clone(), (beta.clone(), g.clone()), d_final
        intra = self.intra(q, k, v, beta, g)
        S, U_new, _ = self.state_pass(s0, k, intra)
        dS_next, dU_new, ds0 = self.state_pass_backward(d_final, q, k, do, intra)
        Gamma, lam = intra.gamma.exp(), (intra.gamma[..., -1:] - intra.gamma).exp()
        # O = diag(Gamma) Q S^T + P U', P = tril(Q K^T) * D;  S' = Gamma_C S + U'^T diag(lambda) K
        dP = bmm(do, U_new.mT)
        dPD = dP * intra.D
        dOS = bmm(do, S)
        UdS = bmm(U_new, dS_next)
        dq = bmm(dPD, k, add=dOS * Gamma[..., None])
        dk = bmm(dPD.mT, q, add=UdS * lam[..., None])
        # U' = U - W S^T; [W, U] = T [diag(beta Gamma) K, diag(beta) V]; T = (I + A)^-1
        dKb = bmm(intra.T.mT, bmm(dU_new, S)).neg_()  # d(diag(beta Gamma) K) = T^T dW, dW = -dU' S
        dVb = bmm(intra.T.mT, dU_new)  # d(diag(beta) V)
        dA = bmm(dVb, intra.U.mT, add=bmm(dKb, intra.W.mT)).tril_(-1).neg_()
        # A = diag(beta) KD, KD = strictly_lower(E * D), E = K K^T: dKD = diag(beta) dA, dE = dKD * D
        dKD = dA * beta[..., :, None]
        dE = dKD * intra.D
        dk = bmm(dE, k, add=bmm(dE.mT, k, add=dk)).addcmul_((beta * Gamma)[..., None], dKb)
        dKb_k = (dKb * k).sum(-1)
        dbeta = (dA * intra.KD).sum(-1) + (dVb * v).sum(-1) + Gamma * dKb_k
        dgamma = self._gamma_grad(intra, dP, dKD, (dOS * q).sum(-1) + beta * dKb_k, (UdS * k).sum(-1), S, dS_next)
        dg = dgamma.flip(-1).cumsum(-1).flip(-1)  # gamma = cumsum(g)
        return dq, dk, beta[..., None] * dVb, (dbeta, dg), ds0

    @staticmethod
    def _gamma_grad(intra, dP, dKD, dGamma, dlam, S, dS_next):
        """d gamma from D (through P and KD), Gamma (output and W), lambda and Gamma_C (the state leaving)."""
        H = dP * intra.P + dKD * intra.KD  # dD * D, D_ij = exp(gamma_i - gamma_j): P = QK^T * D, KD = KK^T * D
        Gamma, lam = intra.gamma.exp(), (intra.gamma[..., -1:] - intra.gamma).exp()
        dgamma = H.sum(-1) - H.sum(-2) + dGamma * Gamma - dlam * lam
        dlast = (dlam * lam).sum(-1) + (S * dS_next).sum((-2, -1)) * Gamma[..., -1]
        dgamma[..., -1] += dlast
        return dgamma


GATED_DELTA_RULE_CHUNKS = GatedDeltaRuleChunks()


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
    """Gated delta rule, chunkwise-parallel (decayed WY representation / UT transform).

    Args:
        q, k: ``[B, H, T, Dk]``; v: ``[B, H, T, Dv]``; beta, g: ``[B, H, T]``; any T.
        initial_state: ``[B, H, Dv, Dk]`` or None (zeros).
        output_final_state: also return the final state.
        chunk_size: positions per chunk.
    Returns:
        o ``[B, H, T, Dv]`` in q's dtype, and the final state ``[B, H, Dv, Dk]`` (float32; float64 for
        float64 inputs) or None.
    """
    o, final = chunk_fast_weights(GATED_DELTA_RULE_CHUNKS, chunk_size, q, k, v, initial_state, beta, g)
    return o, (final if output_final_state else None)


def gated_auto_mode(T: int, device: torch.device) -> str:
    """mode="auto": the delta rule's crossovers (``chunk.auto_mode``), with this rule's own C++ kernel deciding the
    CPU one. Measured (fp32, B*H = 8, D = 64, one thread, a busy machine): the C++ chunk kernel ties with the step loop
    at T = 1 (46 vs 55 us) and is faster from T = 2 on (49 vs 303 us), as for the delta rule. A decode step (T = 1)
    takes the delta rule's one-pass ``decode_step`` with the decay (csrc/chunk_delta.cpp) when both C++ kernels are
    built: the 1.3B Gated DeltaNet layer shape (6 heads, 256 x 512), 21 layers, ``benchmarks/bench_pretrained.py``."""
    if device.type == "cpu":
        if not cpu_kernel_available():
            return "recurrent" if T <= chunk._RECURRENT_MAX_T_CPU_PYTORCH else "chunk"
        return "recurrent" if T == 1 and not chunk.cpu_kernel_available() else "chunk"
    return chunk.auto_mode(T, device)


GATED_DELTA_RULE = register(
    Recurrence(
        "gated_delta_rule",
        reference=gated_delta_rule_recurrent,
        kernels={"chunk": chunk_kernel_finder(gated_delta_rule_chunk, "triton_gated_chunk.gated_delta_rule_chunk")},
        auto=gated_auto_mode,
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
        mode: "recurrent" (step loop), "chunk" (chunkwise-parallel) or "auto" (on CPU with the C++ kernels a
            decode step is the one-pass ``decode_step``, longer inputs chunkwise).
        chunk_size: chunk length for mode "chunk" (any T works), and for mode "auto" where no measured size applies
            (on CPU with the C++ kernel, heads up to 128 wide take the delta rule's table, ``chunk.auto_chunk_size``).
        mask: ``[B, T]`` or None; 0 marks padding, where k, beta and g are zeroed, so that the state neither
            decays nor is written (the outputs there are of no use).
    Returns:
        ``(o [B, H, T, Dv] in q's dtype, final_state or None)``.
    """
    return run_outer_product_rule(
        GATED_DELTA_RULE, q, k, v, {"beta": beta, "g": g}, initial_state, output_final_state, mode, chunk_size, mask,
    )
