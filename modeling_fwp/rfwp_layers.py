"""Fast-weight layers of the recurrent Fast Weight Programmers (Irie, Schlag, Csordas, Schmidhuber, NeurIPS 2021).

Every model of the paper's Table 1 is the shared backbone (``modeling_fwp.FastWeightModel``) with one of these
layers in place of self-attention. They follow the interface of ``fast_weight_layers``::

    forward(hidden_states [B, T, D], state: dict | None, token_mask [B, T] | None) -> (output [B, T, D], state)

and register themselves under the name a config's ``fast_weight_layer`` class attribute selects:

==================== =================================== ==============================================
layer                slow net / fast net                 state (``FastWeightCache`` entries, batch first)
==================== =================================== ==============================================
delta_mlp            feedforward / MLP (eqs. 13-14)      fast_weight_{l}_up, fast_weight_{l}_down
delta_delta_net      feedforward / Delta Net (app. A.3)  fast_weight, fast_fast_weight
delta_rnn            feedforward / RNN (eqs. 12, 19)     fast_weight, recurrent_fast_weight, output
delta_lstm           feedforward / LSTM (eqs. 20-40)     fast_weight, recurrent_fast_weight, output, cell
recurrent_delta_net  recurrent / linear (eqs. 15-18)     fast_weight, output
==================== =================================== ==============================================

All fast weights are written with the delta rule ``W_t = W_{t-1} + beta_t (v_t - W_{t-1} k_t) k_t^T`` (eqs. 8-10;
Schlag et al. 2021 eq. 24) and read as ``W_t q``. Keys and queries of feedforward fast weights go through the
config's feature map and sum normalisation; the recurrences use the paper's activations (softmax, tanh, sigmoid).
Padded positions (``token_mask`` 0) change no state: their keys and betas are zeroed, and the scans carry R, y and c
through them. Dropout, scaling by 1/sqrt(d_head) and the output projection bias of the reference code are left out,
as in the Delta Net layer; every layer ends with the same output projection ``o_proj`` as the Delta Net.
"""
from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Dict, Mapping, Optional, Tuple

import torch
from fwp_kernels import ScanState, delta_rule, fast_rnn_scan, recurrent_delta_rule
from torch import nn
from transformers import PretrainedConfig

from .feature_maps import FeatureMap
from .fast_weight_layers import Linear, State, merge_heads, register_fast_weight_layer

# Delta MLP: the fast net's hidden layer is this many times head_dim (the reference code's 4 * d_model over heads).
FAST_NET_EXPANSION = 4


def feature_output_dim(config: PretrainedConfig, dim: int) -> int:
    """Size of phi(x) for an input of size `dim` under the config's feature map."""
    if config.feature_map == "dpfp":
        return 2 * dim * config.dpfp_nu
    if config.feature_map == "favor":
        return 2 * config.favor_features  # Schlag et al. 2021 eq. 32
    return dim


def make_feature_map(config: PretrainedConfig, num_heads: int, dim: int) -> FeatureMap:
    """The config's phi and sum normalisation for inputs ``[B, num_heads, T, dim]``."""
    return FeatureMap(
        SimpleNamespace(
            feature_map=config.feature_map, dpfp_nu=config.dpfp_nu, sum_normalization=config.sum_normalization,
            num_attention_heads=num_heads, favor_features=config.favor_features, head_dim=dim,
        )
    )


def recurrence_modes(config: PretrainedConfig) -> Tuple[str, str]:
    """``(delta_rule mode, scan mode)`` for the config's ``kernel_mode``: "auto" and "recurrent" go to both; "chunk"
    (the delta rule's parallel form) and "fused" (the scans') to their own recurrence, the other one running "auto".
    A mode the config's family does not list (``kernel_modes``, e.g. set after the config was built) raises."""
    mode, allowed = config.kernel_mode, getattr(type(config), "kernel_modes", (config.kernel_mode,))
    if mode not in allowed:
        raise ValueError(f"`kernel_mode` must be one of {allowed} for {type(config).__name__}, got {mode!r}")
    return ("auto" if mode == "fused" else mode), ("auto" if mode == "chunk" else mode)


class SlowProjection(nn.Module):
    """The slow net's feedforward part: named per-head vectors ``W_* x_t`` and learning-rate logits.

    ``forward(x [B, T, D]) -> {name: [B, H, T, size]} | {beta name: [B, H, count, T]}``. All vectors come from one
    bias-free matmul, all beta logits from one matmul with bias (as the Delta Net's ``qkv_proj`` / ``beta_proj``),
    so parameter counts differ from the Delta Net's only by the extra vectors and betas a model needs.
    """

    def __init__(self, hidden_size: int, num_heads: int, sizes: Mapping[str, int], betas: Mapping[str, int]) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.sizes = dict(sizes)
        self.betas = dict(betas)
        self.proj = Linear(hidden_size, num_heads * sum(self.sizes.values()), bias=False)
        self.beta_proj = Linear(hidden_size, num_heads * sum(self.betas.values()), bias=True) if self.betas else None

    def forward(self, x: torch.Tensor) -> Dict[str, torch.Tensor]:
        B, T, _ = x.shape
        parts = self.proj(x).view(B, T, self.num_heads, -1).split(list(self.sizes.values()), dim=-1)
        out = {name: part.transpose(1, 2).contiguous() for name, part in zip(self.sizes, parts)}
        if self.beta_proj is not None:
            logits = self.beta_proj(x).view(B, T, self.num_heads, -1).permute(0, 2, 3, 1)  # [B, H, n, T]
            out.update(zip(self.betas, logits.split(list(self.betas.values()), dim=2)))
        return out


def split_gates(x: torch.Tensor, num_gates: int) -> torch.Tensor:
    """``[B, H, T, G * d] -> [B, H, G, T, d]`` (gates become sub-heads)."""
    B, H, T, _ = x.shape
    return x.view(B, H, T, num_gates, -1).transpose(2, 3)


def masked(x: torch.Tensor, token_mask: Optional[torch.Tensor], time_dim: int) -> torch.Tensor:
    """Zeroes `x` at padded positions (``token_mask [B, T]`` broadcast along `time_dim` of x)."""
    if token_mask is None:
        return x
    shape = [x.shape[0]] + [1] * (x.dim() - 1)
    shape[time_dim] = x.shape[time_dim]
    return x * token_mask.to(x.dtype).view(shape)


class RecurrentFastWeightLayer(nn.Module):
    """What every RFWP layer shares: sizes, kernel settings and the output projection.

    FAVOR+ features are redrawn by the caller (``FastWeightModel.forward``, once per training batch, outside any
    gradient-checkpointed block), never here: a replayed block must see the features of its first run.
    """

    def __init__(self, config, layer_idx: int = 0) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.kernel_mode, self.scan_mode = recurrence_modes(config)
        self.chunk_size = config.chunk_size
        self.o_proj = Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def delta_rule(self, q, k, v, beta, state: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
        """``delta_rule`` with the config's kernel settings, returning ``(o, final_state)``."""
        return delta_rule(q, k, v, beta, initial_state=state, output_final_state=True, mode=self.kernel_mode,
                          chunk_size=self.chunk_size)


@register_fast_weight_layer("delta_mlp")
class DeltaMLPLayer(RecurrentFastWeightLayer):
    """Delta MLP (sec. 3.1, eqs. 13-14): a feedforward slow net programs a residual fast MLP of K = ``fast_net_depth``
    blocks.

    Per head, with ``h^0 = q_t = W_q x_t`` and, for l = 1..K, fast matrices ``U^l [4d, F]``, ``V^l [d, F']``::

        h^l = h^{l-1} + V^l_t f(U^l_t f(LN^l(h^{l-1})))           (eq. 13, as a Transformer feed-forward block)
        U^l_t, V^l_t: delta rule with their own slow k, v, beta   (eqs. 8-10; keys through the config's phi)
        y_t = h^K                                                 (eq. 14)

    f is ``config.fast_net_activation``: softmax (the paper; F = d, F' = 4d) or the config's feature map with its sum
    normalisation (the official code: F = F(d), F' = F(4d)). Eq. 13 itself is ``h^l = W^l_t f(h^{l-1})``; appendix
    A.2 and the official code make each pair of fast layers a Transformer feed-forward block (head_dim -> 4 head_dim
    -> head_dim) with a slow LayerNorm LN^l (over head_dim, shared by the heads) and a residual connection.
    """

    def __init__(self, config, layer_idx: int = 0) -> None:
        super().__init__(config, layer_idx)
        d, H = self.head_dim, self.num_heads
        self.depth = config.fast_net_depth
        self.inner_dim = FAST_NET_EXPANSION * d
        self.activation = config.fast_net_activation
        sizes = {"q": d}
        for l in range(self.depth):
            sizes.update({f"k{l}_up": d, f"v{l}_up": self.inner_dim, f"k{l}_down": self.inner_dim, f"v{l}_down": d})
        self.slow = SlowProjection(config.hidden_size, H, sizes, {"beta": 2 * self.depth})
        self.norms = nn.ModuleList(nn.LayerNorm(d, eps=config.layer_norm_eps) for _ in range(self.depth))
        self.phi = make_feature_map(config, H, d)
        self.phi_inner = make_feature_map(config, H, self.inner_dim)

    def forward(
        self, hidden_states: torch.Tensor, state: State = None, token_mask: Optional[torch.Tensor] = None
    ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        p = self.slow(hidden_states)
        betas = masked(torch.sigmoid(p["beta"]), token_mask, 3)  # [B, H, 2K, T]
        state, new_state = state or {}, {}
        h = p["q"]  # h^0 = q_t
        for l in range(self.depth):
            x = self.norms[l](h)
            for j, (part, phi) in enumerate((("up", self.phi), ("down", self.phi_inner))):
                # eqs. 8-10: U^l_t, V^l_t written by the delta rule; eq. 13: x <- U^l_t f(x), then V^l_t f(x)
                name = f"fast_weight_{l}_{part}"
                key = masked(phi(p[f"k{l}_{part}"]), token_mask, 2)
                query = torch.softmax(x, dim=-1) if self.activation == "softmax" else phi(x)
                x, new_state[name] = self.delta_rule(query, key, p[f"v{l}_{part}"], betas[:, :, 2 * l + j],
                                                     state.get(name))
            h = h + x  # h^l = h^{l-1} + V^l_t f(U^l_t f(LN^l(h^{l-1})))
        return self.o_proj(merge_heads(h)), new_state


@register_fast_weight_layer("delta_delta_net")
class DeltaDeltaNetLayer(RecurrentFastWeightLayer):
    """Delta-Delta Net (appendix A.3): the slow net delta-programs a fast net whose output programs a Delta Net.

    Per head::

        q, k, v, beta = W x_t                      (v of size 3d + 1)
        W_t = delta rule(phi(k), v, sigmoid(beta));  [q', k', v', b'] = W_t phi(q)        (fast_weight [3d+1, F])
        W'_t = delta rule(phi(k'), v', sigmoid(b')); y_t = W'_t phi(q')                  (fast_fast_weight [d, F])
    """

    def __init__(self, config, layer_idx: int = 0) -> None:
        super().__init__(config, layer_idx)
        d = self.head_dim
        self.slow = SlowProjection(config.hidden_size, self.num_heads, {"q": d, "k": d, "v": 3 * d + 1}, {"beta": 1})
        self.phi = make_feature_map(config, self.num_heads, d)

    def forward(
        self, hidden_states: torch.Tensor, state: State = None, token_mask: Optional[torch.Tensor] = None
    ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        d = self.head_dim
        p = self.slow(hidden_states)
        state = state or {}
        k = masked(self.phi(p["k"]), token_mask, 2)
        beta = masked(torch.sigmoid(p["beta"][:, :, 0]), token_mask, 2)
        # A.3: the slow net writes W_t; its read W_t phi(q_t) is the fast net's own query, key, value and beta
        fast, fast_weight = self.delta_rule(self.phi(p["q"]), k, p["v"], beta, state.get("fast_weight"))
        q2, k2, v2, b2 = fast.split([d, d, d, 1], dim=-1)
        k2 = masked(self.phi(k2), token_mask, 2)
        b2 = masked(torch.sigmoid(b2[..., 0]), token_mask, 2)
        # A.3: which write W'_t, read as y_t = W'_t phi(q'_t)
        y, fast_fast_weight = self.delta_rule(self.phi(q2), k2, v2, b2, state.get("fast_fast_weight"))
        return self.o_proj(merge_heads(y)), {"fast_weight": fast_weight, "fast_fast_weight": fast_fast_weight}


class FastRecurrentNetLayer(RecurrentFastWeightLayer):
    """Shared by the Delta RNN (G = 1) and the Delta LSTM (G = 3 gates: input i, update u, output o).

    Per head and gate g, two delta-rule fast weights with their own slow keys/values/betas: the feedforward
    ``W_g [d, F]`` (keys/queries through the config's phi) and the recurrent ``R_g [d, d]`` (keys softmax)::

        z_g,t = W_g,t phi(q_g,t)                                   (fwp_kernels.delta_rule, chunkwise)
        a_g,t = z_g,t + R_g,t s_{t-1},  s = y or softmax(y)        (fwp_kernels.fast_rnn_scan, the cell)
    """

    num_gates = 1
    cell_prefix = "rnn"

    def __init__(self, config, layer_idx: int = 0) -> None:
        super().__init__(config, layer_idx)
        G, d = self.num_gates, self.head_dim
        self.cell = f"{self.cell_prefix}_{config.version.lower()}"
        self.slow = SlowProjection(
            config.hidden_size, self.num_heads,
            {name: G * d for name in ("q", "k", "v", "rec_k", "rec_v")}, {"beta": G, "rec_beta": G},
        )
        self.phi = make_feature_map(config, self.num_heads * G, d)

    def forward(
        self, hidden_states: torch.Tensor, state: State = None, token_mask: Optional[torch.Tensor] = None
    ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        G = self.num_gates
        p = self.slow(hidden_states)
        q, k, v, rec_k, rec_v = (split_gates(p[name], G) for name in ("q", "k", "v", "rec_k", "rec_v"))
        state = state or {}
        # z_t = W_t phi(q_t) (eqs. 12/19, A.2), W_t by the delta rule (eq. 8); gates folded into heads: [B, H * G, T, *]
        k = masked(self.phi(k.flatten(1, 2)), token_mask, 2)
        beta = masked(torch.sigmoid(p["beta"]).flatten(1, 2), token_mask, 2)
        z, fast_weight = self.delta_rule(self.phi(q.flatten(1, 2)), k, v.flatten(1, 2), beta, state.get("fast_weight"))
        # R_t by the delta rule from its own keys (softmaxes, like the f(y) they meet), then the cell:
        # eq. 12 y = z + R softmax(y_{t-1}) (B), eq. 19 y = softmax(z + R y_{t-1}) (A), A.2 the LSTM versions
        y, final = fast_rnn_scan(
            z.unflatten(1, (self.num_heads, G)), torch.softmax(rec_k, dim=-1), rec_v, torch.sigmoid(p["rec_beta"]),
            cell=self.cell, mask=token_mask, output_final_state=True, mode=self.scan_mode,
            initial_state=ScanState(state.get("recurrent_fast_weight"), state.get("output"), state.get("cell")),
        )
        new_state = {"fast_weight": fast_weight, "recurrent_fast_weight": final.fast_weight, "output": final.output}
        if final.cell is not None:
            new_state["cell"] = final.cell
        return self.o_proj(merge_heads(y)), new_state


@register_fast_weight_layer("delta_rnn")
class DeltaRNNLayer(FastRecurrentNetLayer):
    """Delta RNN. Version B (eq. 12, default): ``y_t = W_t q_t + R_t softmax(y_{t-1})``; version A (eq. 19):
    ``y_t = softmax(W_t q_t + R_t y_{t-1})``. State: W ``[B, H, d, F]``, R ``[B, H, 1, d, d]`` and y_{t-1}."""


@register_fast_weight_layer("delta_lstm")
class DeltaLSTMLayer(FastRecurrentNetLayer):
    """Delta LSTM (appendix A.2, eqs. 20-40) with tied input/forget gate: ``c_t = i c~ + (1 - i) c_{t-1}``.

    With ``a_g = W_g,t q_g + R_g,t s`` for g in (i, u, o) and ``s = y_{t-1}`` (A) or ``softmax(y_{t-1})`` (B-D):

    * A: ``i, u, o = sigmoid(a)``, ``y_t = softmax(o c_t)``
    * B: ``i, u, o = sigmoid(a)``, ``y_t = o c_t``
    * C: as B with ``y_t = o c_t + W_u,t q_u`` (residual from the feedforward update term)
    * D (default): as B without a sigmoid on the update, ``u = a_u``

    State: W ``[B, 3H, d, F]``, R ``[B, H, 3, d, d]``, y_{t-1} and c_{t-1}.
    """

    num_gates = 3
    cell_prefix = "lstm"


@register_fast_weight_layer("recurrent_delta_net")
class RecurrentDeltaNetLayer(RecurrentFastWeightLayer):
    """Recurrent Delta Net (sec. 3.2, eqs. 15-18): a recurrent slow net, ``h = tanh(y_{t-1})``::

        k_t = softmax(W_k x_t + R_k h),  v_t = W_v x_t + R_v h,  q_t = softmax(W_q x_t + R_q h)     (eqs. 15-17)
        beta_t = sigmoid(w_beta x_t + r_beta . h)                                                     (eq. 18)
        W_t = W_{t-1} + beta_t (v_t - W_{t-1} k_t) k_t^T,  y_t = W_t q_t                            (eqs. 8, 10, 7)

    The slow projections are the Delta Net's; ``r_q, r_k, r_v [H, d, d]`` and ``r_beta [H, d]`` are the only extra
    parameters. State: W ``[B, H, d, d]`` and y_{t-1}.
    """

    def __init__(self, config, layer_idx: int = 0) -> None:
        super().__init__(config, layer_idx)
        H, d = self.num_heads, self.head_dim
        self.slow = SlowProjection(config.hidden_size, H, {"q": d, "k": d, "v": d}, {"beta": 1})
        self.r_q = nn.Parameter(torch.empty(H, d, d))
        self.r_k = nn.Parameter(torch.empty(H, d, d))
        self.r_v = nn.Parameter(torch.empty(H, d, d))
        self.r_beta = nn.Parameter(torch.empty(H, d))
        self.reset_recurrent_parameters()

    @torch.no_grad()
    def reset_recurrent_parameters(self) -> None:
        """N(0, 1/d) as the reference implementation."""
        for weight in (self.r_q, self.r_k, self.r_v, self.r_beta):
            nn.init.normal_(weight, mean=0.0, std=1.0 / math.sqrt(self.head_dim))

    def forward(
        self, hidden_states: torch.Tensor, state: State = None, token_mask: Optional[torch.Tensor] = None
    ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        p = self.slow(hidden_states)
        state = state or {}
        # eqs. 15-18, all inside the scan: q, k, v, beta read tanh(y_{t-1}) through r_q, r_k, r_v, r_beta
        y, final = recurrent_delta_rule(
            p["q"], p["k"], p["v"], p["beta"][:, :, 0], self.r_q, self.r_k, self.r_v, self.r_beta,
            initial_state=ScanState(state.get("fast_weight"), state.get("output")), mask=token_mask,
            output_final_state=True, mode=self.scan_mode,
        )
        return self.o_proj(merge_heads(y)), {"fast_weight": final.fast_weight, "output": final.output}
