"""Transformer-XL (Dai, Yang, Yang, Carbonell, Le, Salakhutdinov, ACL 2019) for transformers 5, with an optional
Fast Weight Layer head (Clark, Guu, Chang, Pasupat, Hinton, Norouzi, EMNLP 2022, sec. 3).

- Segment-level recurrence (Dai et al. sec. 3.2): every layer attends to ``[memory; segment]``, where the memory holds
  the inputs of that layer for the last ``mem_len`` tokens of earlier segments (gradients stopped). The memory lives in
  a ``TransfoXLCache`` (bounded by ``mem_len``), which is also what generation continues from.
- Relative positional attention (sec. 3.3): for query i and key j at distance ``d = i - j``,
  ``score = (q_i + u) . k_j + (q_i + v) . W_r R_d`` with R the sinusoid of d, u = ``r_w_bias``, v = ``r_r_bias``.
- Adaptive input (Baevski & Auli 2019) and projected adaptive log-softmax (Grave et al. 2017): clusters of decreasing
  frequency with embeddings of size ``d_embed // div_val**i``, projected to / from ``hidden_size``.

Logits are the full log-probabilities ``[B, T, V]`` (what generation samples from); the training loss goes through
the adaptive softmax and only evaluates the clusters the targets fall in.
"""
from __future__ import annotations

import math
from functools import partial
from typing import Dict, List, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from fwp_kernels import dense_linear
from torch import nn
from transformers import GenerationMixin
from transformers import initialization as init
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.conversion_mapping import register_checkpoint_conversion_mapping
from transformers.core_model_loading import WeightRenaming
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from .cache_fwp import CACHE_ARGUMENT, FastWeightCache, FastWeightCacheLayer, output_cache, resolve_cache_argument
from .configuration_transfo_xl import TransfoXLConfig
from .fwl import FWLHead, FWLSlowHead, decay_split_dependence, init_fwl_weights
from .modeling_fwp import FeedForward, check_token_ids, padding_mask, sinusoidal_position_embedding
from .pretrained import StatefulPreTrainedModel, logits_to_keep_index, take_loss_kwargs

# The FWL's segment decay is part of its head (``fwl_head.decay``); checkpoints keep its older name
# ``fwl_decay.raw_decay``: renamed on load, and back on save (transformers reverses the mapping), so saved folders keep
# their keys.
register_checkpoint_conversion_mapping(
    "fwp_transfo_xl", [WeightRenaming("fwl_decay.raw_decay", "fwl_head.decay.raw_decay")], overwrite=True
)


# ---------------------------------------------------------------------------------------------------------------
# Cache: per-layer memories
# ---------------------------------------------------------------------------------------------------------------


class TransfoXLCache(FastWeightCache):
    """Transformer-XL memories (Dai et al. sec. 3.2) as a transformers ``Cache``: bounded, constant size.

    Layer l holds ``memory [B, M, D]`` (the inputs of layer l for the last ``M <= mem_len`` tokens, detached) and
    ``memory_mask [B, M]`` (1 = a real token, 0 = left padding). ``get_seq_length`` counts the tokens seen, not the
    memory length. With an FWL head, one more layer (``fwl_layer``, index ``fwl_layer_idx``) holds the FWL state, which
    ``FWLHead`` reads and writes. Beam search reorders every row; crop is refused (memories cannot be rolled back past
    ``mem_len``).
    """

    def __init__(self, num_hidden_layers: int, use_fwl: bool = False) -> None:
        super().__init__(num_hidden_layers + int(use_fwl))
        self.num_memory_layers = num_hidden_layers
        self.fwl_layer_idx = num_hidden_layers if use_fwl else None

    @property
    def fwl_layer(self) -> Optional[FastWeightCacheLayer]:
        """The layer holding the FWL state, or None without an FWL head."""
        return None if self.fwl_layer_idx is None else self.layers[self.fwl_layer_idx]

    def get_memory(self, layer_idx: int) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """``(memory [B, M, D], memory_mask [B, M])`` of a layer, or ``(None, None)`` before the first segment."""
        states = self.layers[layer_idx].states
        return states.get("memory"), states.get("memory_mask")

    def memory_length(self) -> int:
        memory = self.get_memory(0)[0]
        return 0 if memory is None else memory.shape[1]

    def update_memory(
        self, layer_idx: int, hidden_states: torch.Tensor, token_mask: torch.Tensor, mem_len: int
    ) -> None:
        """Appends a segment's layer inputs ``[B, T, D]`` (and mask ``[B, T]``) and keeps the last ``mem_len``."""
        num_new_tokens = hidden_states.shape[1]
        memory, memory_mask = self.get_memory(layer_idx)
        if memory is not None:
            hidden_states = torch.cat([memory, hidden_states], dim=1)
            token_mask = torch.cat([memory_mask, token_mask], dim=1)
        start = max(0, hidden_states.shape[1] - mem_len)
        state = {"memory": hidden_states[:, start:].detach(), "memory_mask": token_mask[:, start:].detach()}
        self.set_state(layer_idx, state, num_new_tokens)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return super().get_seq_length(0)


# ---------------------------------------------------------------------------------------------------------------
# Adaptive input and projected adaptive log-softmax
# ---------------------------------------------------------------------------------------------------------------


class Projection(nn.Module):
    """A bias-free projection ``weight [hidden_size, dim]`` used both ways: ``x W^T`` (dim -> hidden_size, adaptive
    input) and ``h W`` (hidden_size -> dim, adaptive softmax), so that the two can share one tensor (``tie_projs``)."""

    def __init__(self, hidden_size: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def reverse(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return dense_linear(hidden_states, self.weight.t())


class ClusterOutput(nn.Module):
    """One output layer of the adaptive softmax, ``weight [size, dim]`` and ``bias [size]`` (the names and shapes of an
    ``nn.Linear(dim, size)``). Not an ``nn.Linear`` on purpose: the adaptive softmax reads its tensors (slices for
    div_val 1) instead of calling it, and it is the model's output layer, which PEFT's ``target_modules="all-linear"``
    must leave alone (PEFT excludes only what ``get_output_embeddings`` returns, None here); an adapter on it would
    never run."""

    def __init__(self, dim: int, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, dim))
        self.bias = nn.Parameter(torch.empty(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def cluster_bounds(vocab_size: int, cutoffs: List[int]) -> List[Tuple[int, int]]:
    """``[(start, end)]`` of every cluster: ``[0, c_0), [c_0, c_1), ..., [c_last, V)``."""
    ends = list(cutoffs) + [vocab_size]
    return list(zip([0] + ends[:-1], ends))


def cluster_dims(config: TransfoXLConfig) -> List[int]:
    """Embedding size of every cluster: ``d_embed // div_val**i`` (all ``d_embed`` when div_val is 1)."""
    return [config.embedding_size // config.div_val**i for i in range(len(config.cutoffs) + 1)]


class AdaptiveEmbedding(nn.Module):
    """Adaptive input (Baevski & Auli 2019): token x of cluster i is ``sqrt(D) * P_i E_i[x - start_i]``.

    ``layers[i]``: ``nn.Embedding [size_i, d_i]``; ``projections[i]``: ``Projection [D, d_i]`` (div_val 1: one table
    for the whole vocabulary, projected only if ``d_embed != D``). ``forward(input_ids [B, T]) -> [B, T, D]``.
    """

    def __init__(self, config: TransfoXLConfig) -> None:
        super().__init__()
        self.hidden_size = config.hidden_size
        self.scale = config.hidden_size**0.5
        if config.div_val == 1:
            self.bounds = [(0, config.vocab_size)]
            dims = [config.embedding_size]
        else:
            self.bounds = cluster_bounds(config.vocab_size, config.cutoffs)
            dims = cluster_dims(config)
        self.layers = nn.ModuleList(nn.Embedding(end - start, d) for (start, end), d in zip(self.bounds, dims))
        needs_projection = config.div_val > 1 or config.embedding_size != config.hidden_size
        self.projections = nn.ModuleList(Projection(config.hidden_size, d) for d in dims) if needs_projection else None

    def forward(self, input_ids: torch.LongTensor) -> torch.Tensor:
        if len(self.layers) == 1:
            embeds = self.layers[0](input_ids)
            if self.projections is not None:
                embeds = self.projections[0](embeds)
            return embeds * self.scale
        flat = input_ids.reshape(-1)
        weight = self.projections[0].weight
        embeds = torch.zeros(flat.shape[0], self.hidden_size, dtype=weight.dtype, device=weight.device)
        for (start, end), table, projection in zip(self.bounds, self.layers, self.projections):
            in_cluster = (flat >= start) & (flat < end)
            if torch.compiler.is_compiling():
                # every token through every cluster, kept where it belongs (no data-dependent shapes in a graph)
                dense = projection(table((flat - start).clamp(0, end - start - 1))).to(embeds.dtype)
                embeds = torch.where(in_cluster[:, None], dense, embeds)
                continue
            index = in_cluster.nonzero().squeeze(-1)
            if index.numel():
                embeds = embeds.index_copy(0, index, projection(table(flat[index] - start)).to(embeds.dtype))
        return embeds.view(*input_ids.shape, self.hidden_size) * self.scale


class ProjectedAdaptiveLogSoftmax(nn.Module):
    r"""Projected adaptive log-softmax (Grave et al. 2017; Dai et al. 2019).

    The head cluster scores the ``c_0`` frequent tokens and one entry per tail cluster; a tail cluster i scores its own
    tokens. For a hidden state h (``[..., D]``) and token y in cluster i:

        log p(y | h) = log softmax(head(h))[y]                                   (i = 0)
        log p(y | h) = log softmax(head(h))[c_0 + i - 1] + log softmax(tail_i(h))[y - start_i]   (i > 0)

    with ``head(h) = (h P_0) [W_0; W_c]^T + [b_0; b_c]`` and ``tail_i(h) = (h P_i) W_i^T + b_i``. ``layers[i]`` holds
    W_i, b_i (div_val 1: one ``[V, d_embed]`` layer sliced per cluster), ``cluster_weight`` / ``cluster_bias`` W_c,
    b_c, ``projections[i]`` P_i (None when div_val is 1 and ``d_embed == D``). Its products go through
    ``fwp_kernels.dense_linear`` (oneDNN on CPU outside autograd), for the base model and the FWL alike.
    """

    def __init__(self, config: TransfoXLConfig) -> None:
        super().__init__()
        self.vocab_size = config.vocab_size
        self.bounds = cluster_bounds(config.vocab_size, config.cutoffs)
        self.shortlist_size = self.bounds[0][1]
        self.num_clusters = len(self.bounds) - 1
        if config.div_val == 1:
            dims = [config.embedding_size] * len(self.bounds)
            self.layers = nn.ModuleList([ClusterOutput(config.embedding_size, config.vocab_size)])
        else:
            dims = cluster_dims(config)
            self.layers = nn.ModuleList(ClusterOutput(d, end - start) for (start, end), d in zip(self.bounds, dims))
        needs_projection = config.div_val > 1 or config.embedding_size != config.hidden_size
        self.projections = nn.ModuleList(Projection(config.hidden_size, d) for d in dims) if needs_projection else None
        if self.num_clusters:
            self.cluster_weight = nn.Parameter(torch.zeros(self.num_clusters, config.embedding_size))
            self.cluster_bias = nn.Parameter(torch.zeros(self.num_clusters))

    def _cluster_weight(self, i: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(W_i [size_i, d_i], b_i [size_i])`` of cluster i's own tokens (div_val 1: slices of the single layer)."""
        if len(self.layers) == 1:
            start, end = self.bounds[i]
            return self.layers[0].weight[start:end], self.layers[0].bias[start:end]
        return self.layers[i].weight, self.layers[i].bias

    def _project(self, hidden_states: torch.Tensor, i: int) -> torch.Tensor:
        return self.projections[i].reverse(hidden_states) if self.projections is not None else hidden_states

    def _cluster_logits(self, hidden_states: torch.Tensor, i: int) -> torch.Tensor:
        """Logits of cluster i, the head followed by one entry per tail cluster: ``[..., D] -> [..., size_i (+ n)]``."""
        projected = self._project(hidden_states, i)
        weight, bias = self._cluster_weight(i)
        logits = dense_linear(projected, weight, bias)
        if i == 0 and self.num_clusters:  # concatenating the small logits, not the [size_0, d] weights
            logits = torch.cat([logits, dense_linear(projected, self.cluster_weight, self.cluster_bias)], dim=-1)
        return logits

    def log_prob(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Full log-probabilities ``[..., V]`` of every token (each cluster's own entries, correctly offset)."""
        head = torch.log_softmax(self._cluster_logits(hidden_states, 0).float(), dim=-1)
        parts = [head[..., : self.shortlist_size]]
        for i in range(1, len(self.bounds)):
            tail = torch.log_softmax(self._cluster_logits(hidden_states, i).float(), dim=-1)
            parts.append(head[..., self.shortlist_size + i - 1, None] + tail)
        return torch.cat(parts, dim=-1).to(hidden_states.dtype)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.log_prob(hidden_states)

    def nll(self, hidden_states: torch.Tensor, target: torch.LongTensor) -> torch.Tensor:
        """``-log p(target | h)`` for ``hidden_states [N, D]``, ``target [N]`` (valid ids): ``[N]`` in float32.

        Only the head and, for each tail cluster, the rows whose target lies in it are evaluated.
        """
        head = torch.log_softmax(self._cluster_logits(hidden_states, 0).float(), dim=-1)
        head_target = target.clone()
        logprob = torch.zeros(target.shape, dtype=head.dtype, device=head.device)
        for i in range(1, len(self.bounds)):
            start, end = self.bounds[i]
            rows = ((target >= start) & (target < end)).nonzero().squeeze(-1)
            if rows.numel() == 0:
                continue
            head_target[rows] = self.shortlist_size + i - 1
            tail = torch.log_softmax(self._cluster_logits(hidden_states[rows], i).float(), dim=-1)
            logprob = logprob.index_add(0, rows, tail.gather(-1, (target[rows] - start)[:, None]).squeeze(-1))
        return -(logprob + head.gather(-1, head_target[:, None]).squeeze(-1))

    def input_gradient(
        self, hidden_states: torch.Tensor, target: torch.LongTensor, weights: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """``d(-w log p(target | h)) / dh`` for ``hidden_states [..., D]``, ``target [...]`` (any value where the weight
        is 0), ``weights [...]`` (None: ones), computed analytically and differentiably (the FWL trains through it).

        ``dCE/dlogits = softmax - onehot`` in the head cluster and, for a tail target, in that target's cluster only:
        the other tail clusters do not enter log p(target) (Clark et al. 2022 sec. 3).
        """
        shape = hidden_states.shape
        h = hidden_states.reshape(-1, shape[-1])
        target = target.reshape(-1).clamp(0, self.vocab_size - 1)
        w = None if weights is None else weights.reshape(-1).to(h.dtype)
        head_target = target.clone()
        grad = self._logit_gradient(h, head_target, w, 0) if not self.num_clusters else None
        for i in range(1, len(self.bounds)):
            start, end = self.bounds[i]
            in_cluster = (target >= start) & (target < end)
            head_target = torch.where(in_cluster, self.shortlist_size + i - 1, head_target)
            if torch.compiler.is_compiling():
                # every row through cluster i, weighted by its membership (no data-dependent shapes in a graph)
                member = in_cluster.to(h.dtype) if w is None else w * in_cluster.to(h.dtype)
                tail = self._logit_gradient(h, (target - start).clamp(0, end - start - 1), member, i)
                grad = tail if grad is None else grad + tail
                continue
            rows = (in_cluster if w is None else in_cluster & (w != 0)).nonzero().squeeze(-1)
            if rows.numel():
                tail = self._logit_gradient(h[rows], target[rows] - start, None if w is None else w[rows], i)
                grad = (torch.zeros_like(h) if grad is None else grad).index_add(0, rows, tail)
        if self.num_clusters:
            head = self._logit_gradient(h, head_target, w, 0)
            grad = head if grad is None else grad + head
        return grad.view(shape)

    def _logit_gradient(self, h: torch.Tensor, target: torch.Tensor, w: Optional[torch.Tensor], i: int) -> torch.Tensor:
        """Back through cluster i: ``w (softmax(logits_i) - onehot(target)) [W_i; W_c]`` then the projection,
        ``[N, D]``."""
        dlogits = torch.softmax(self._cluster_logits(h, i).float(), dim=-1).to(h.dtype)
        minus = h.new_full((h.shape[0], 1), -1.0) if w is None else -w[:, None]
        if w is not None:
            dlogits = dlogits * w[:, None]
        elif torch.is_grad_enabled() and dlogits.requires_grad:
            dlogits = dlogits.clone()  # softmax's backward needs its own output unmodified
        dlogits = dlogits.scatter_add_(-1, target[:, None], minus)
        weight, _ = self._cluster_weight(i)
        size = weight.shape[0]
        dproj = dense_linear(dlogits[:, :size], weight.t())
        if i == 0 and self.num_clusters:
            dproj = dproj + dense_linear(dlogits[:, size:], self.cluster_weight.t())
        return dense_linear(dproj, self.projections[i].weight) if self.projections is not None else dproj


# ---------------------------------------------------------------------------------------------------------------
# Relative positional attention and the block
# ---------------------------------------------------------------------------------------------------------------


def relative_shift(x: torch.Tensor) -> torch.Tensor:
    """``[..., T, K]`` scores against relative positions ``K-1, ..., 0`` -> scores against keys: entry (i, j) becomes
    the score of distance ``K - T + i - j`` (Dai et al. appendix B; entries of future keys are garbage, masked
    later)."""
    *batch, T, K = x.shape
    padded = F.pad(x, (1, 0)).view(*batch, K + 1, T)
    return padded[..., 1:, :].reshape(*batch, T, K)


class RelativeMultiHeadAttention(nn.Module):
    r"""Relative multi-head attention (Dai et al. sec. 3.3, eq. in "the computational procedure"):

        A_ij = (q_i + u)^T k_j + (q_i + v)^T W_r R_{i-j},      out_i = softmax_j(A_ij / sqrt(d_head)) v_j

    Keys and values come from ``[memory; segment]``. ``u``, ``v`` are passed in (shared) or owned (``untie_r``).
    """

    def __init__(self, config: TransfoXLConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim = config.num_attention_heads, config.head_dim
        inner = self.num_heads * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, 3 * inner, bias=False)
        self.pos_proj = nn.Linear(config.hidden_size, inner, bias=False)  # W_r
        self.o_proj = nn.Linear(inner, config.hidden_size, bias=False)
        self.attention_dropout = config.attention_dropout
        if config.untie_r:
            self.r_w_bias = nn.Parameter(torch.zeros(self.num_heads, self.head_dim))  # u
            self.r_r_bias = nn.Parameter(torch.zeros(self.num_heads, self.head_dim))  # v

    def forward(
        self,
        hidden_states: torch.Tensor,
        keys_input: torch.Tensor,
        pos_emb: torch.Tensor,
        allowed: torch.Tensor,
        r_w_bias: Optional[torch.Tensor] = None,
        r_r_bias: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """
        Args:
            hidden_states: ``[B, T, D]`` queries' inputs (the last T rows of ``keys_input``).
            keys_input: ``[B, K, D]`` = ``[memory; segment]`` (normalised first in pre-LN blocks).
            pos_emb: ``[K, D]`` sinusoids of the distances ``K-1, ..., 0``.
            allowed: ``[B or 1, 1, T, K]`` bool, which keys each query may attend to.
        Returns:
            ``[B, T, D]``.
        """
        B, T = hidden_states.shape[:2]
        K = keys_input.shape[1]
        H, Dh = self.num_heads, self.head_dim
        u = self.r_w_bias if r_w_bias is None else r_w_bias
        v = self.r_r_bias if r_r_bias is None else r_r_bias
        q, k, value = self.qkv_proj(keys_input).view(B, K, 3, H, Dh).permute(2, 0, 3, 1, 4).unbind(0)
        q = q[:, :, -T:]  # [B, H, T, Dh]
        r = self.pos_proj(pos_emb).view(K, H, Dh)
        # position term (q_i + v)^T W_r R, shifted from relative positions to keys
        position_scores = relative_shift(torch.einsum("bhtd,khd->bhtk", q + v[None, :, None], r))
        scale = 1.0 / math.sqrt(Dh)
        bias = (position_scores * scale).masked_fill(~allowed, float("-inf"))
        out = F.scaled_dot_product_attention(
            q + u[None, :, None], k, value, attn_mask=bias, scale=scale,
            dropout_p=self.attention_dropout if self.training else 0.0,
        )
        return self.o_proj(out.transpose(1, 2).reshape(B, T, H * Dh))


class TransfoXLBlock(GradientCheckpointingLayer):
    """Post-LN (default): ``h = LN(x + Attn(x, [m; x]))``, ``out = LN(h + FF(h))``.
    Pre-LN (``pre_lnorm``): ``h = x + Attn(LN([m; x]))``, ``out = h + FF(LN(h))``."""

    def __init__(self, config: TransfoXLConfig) -> None:
        super().__init__()
        self.pre_lnorm = config.pre_lnorm
        self.attention = RelativeMultiHeadAttention(config)
        self.attention_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.feed_forward = FeedForward(config)
        self.ff_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout)

    def forward(self, hidden_states, memory, pos_emb, allowed, r_w_bias=None, r_r_bias=None) -> torch.Tensor:
        keys_input = hidden_states if memory is None else torch.cat([memory, hidden_states], dim=1)
        if self.pre_lnorm:
            keys_input = self.attention_norm(keys_input)
            attended = self.attention(keys_input[:, -hidden_states.shape[1] :], keys_input, pos_emb, allowed,
                                      r_w_bias, r_r_bias)
            hidden_states = hidden_states + self.dropout(attended)
            return hidden_states + self.dropout(self.feed_forward(self.ff_norm(hidden_states)))
        attended = self.attention(hidden_states, keys_input, pos_emb, allowed, r_w_bias, r_r_bias)
        hidden_states = self.attention_norm(hidden_states + self.dropout(attended))
        return self.ff_norm(hidden_states + self.dropout(self.feed_forward(hidden_states)))


# ---------------------------------------------------------------------------------------------------------------
# Fast Weight Layer on the adaptive softmax, with segment recurrence (Clark et al. 2022 sec. 3)
# ---------------------------------------------------------------------------------------------------------------


class AdaptiveSoftmaxFWLSlowHead(FWLSlowHead):
    r"""The FWL's slow net (Clark et al. eq. 1) with the projected adaptive softmax as its output layer:
    ``f(h) = LayerNorm(ReLU(h U + a)^2 W + b)``, ``log p(. | h) = AdaptiveLogSoftmax(f(h))`` (``lm_head``, shared).

    ``forward(h)`` gives the log-probabilities (the slow head of the FWL contract; they are this output layer's
    logits, with no transform). ``TransfoXLForCausalLM`` asks ``FWLHead`` for the fast ``f(h)`` instead
    (``return_hidden``) and applies the adaptive softmax itself, so that its loss evaluates only the head cluster and
    each target's cluster. The per-token gradients need dCE/df only, which the adaptive softmax gives without any
    ``[T, V]`` softmax (``ProjectedAdaptiveLogSoftmax.input_gradient``, Clark et al. sec. 3); its parameters stay slow.
    With ``residual`` the output layer reads ``h + f(h)`` (dCE/df is unchanged: it is dCE/d(h + f(h))).
    """

    # The intermediates are [B, T, D]-sized: the previous segment's last position joins the new ones in one backward.
    merge_previous_position = True

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        adaptive_softmax: ProjectedAdaptiveLogSoftmax,
        *,
        output_bias: bool = False,
        residual: bool = False,
        layer_norm_eps: float = 1e-5,
    ) -> None:
        super().__init__(hidden_size, intermediate_size, residual, layer_norm_eps)
        if not isinstance(adaptive_softmax, ProjectedAdaptiveLogSoftmax):
            raise TypeError(
                f"`adaptive_softmax` must be a ProjectedAdaptiveLogSoftmax, got {type(adaptive_softmax).__name__}"
            )
        if output_bias:
            raise ValueError("`output_bias` must be False: the adaptive softmax output layer has its own biases")
        self.vocab_size = adaptive_softmax.vocab_size
        self.output_embedding = adaptive_softmax  # lm_head: slow log-probabilities and dCE/df
        self.reset_parameters()

    def output_preactivation(self, o: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """``log p(. | o) [..., V]``."""
        return self.output_embedding.log_prob(o if dtype is None else o.to(dtype))

    def output_gradients(
        self,
        inter: Dict[str, torch.Tensor],
        labels: torch.Tensor,
        weights: Optional[torch.Tensor],
        input_gradient: bool,
        logits_gradient: bool,
        overwrite_logits: bool,
        compute_dtype: Optional[torch.dtype],
    ) -> Dict[str, torch.Tensor]:
        """dCE/df from the adaptive softmax (the target's clusters only); no ``[T, V]`` logits exist here."""
        return {"f": self.output_embedding.input_gradient(inter["o"], labels, weights)}


# ---------------------------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------------------------


class TransfoXLPreTrainedModel(StatefulPreTrainedModel):
    config_class = TransfoXLConfig
    config: TransfoXLConfig
    base_model_prefix = "model"
    _no_split_modules = ["TransfoXLBlock"]

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        std = self.config.initializer_range
        if isinstance(module, Projection):
            init.normal_(module.weight, mean=0.0, std=self.config.proj_init_std)
        elif isinstance(module, ClusterOutput):  # as transformers initialises an nn.Linear
            init.normal_(module.weight, mean=0.0, std=std)
            init.zeros_(module.bias)
        elif isinstance(module, RelativeMultiHeadAttention) and hasattr(module, "r_w_bias"):
            init.normal_(module.r_w_bias, mean=0.0, std=std)
            init.normal_(module.r_r_bias, mean=0.0, std=std)
        elif isinstance(module, TransfoXLModel) and hasattr(module, "r_w_bias"):
            init.normal_(module.r_w_bias, mean=0.0, std=std)
            init.normal_(module.r_r_bias, mean=0.0, std=std)
        elif isinstance(module, ProjectedAdaptiveLogSoftmax) and module.num_clusters:
            init.normal_(module.cluster_weight, mean=0.0, std=std)
            init.zeros_(module.cluster_bias)
        init_fwl_weights(module)


class TransfoXLModel(TransfoXLPreTrainedModel):
    """Adaptive input embedding and a stack of ``TransfoXLBlock``s with memories; returns the last hidden states."""

    def __init__(self, config: TransfoXLConfig) -> None:
        super().__init__(config)
        self.word_embeddings = AdaptiveEmbedding(config)
        self.layers = nn.ModuleList(TransfoXLBlock(config) for _ in range(config.num_hidden_layers))
        if not config.untie_r:
            self.r_w_bias = nn.Parameter(torch.zeros(config.num_attention_heads, config.head_dim))
            self.r_r_bias = nn.Parameter(torch.zeros(config.num_attention_heads, config.head_dim))
        self.dropout = nn.Dropout(config.hidden_dropout)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self) -> AdaptiveEmbedding:
        return self.word_embeddings

    def set_input_embeddings(self, value: AdaptiveEmbedding) -> None:
        self.word_embeddings = value

    def init_memories(self, batch_size: int) -> TransfoXLCache:
        """A cache holding ``mem_len`` all-zero memories: transformers-4's ``init_mems``, whose first segment attends to
        zero states. Pass it as ``cache`` to reproduce a transformers-4 run exactly; by default (no cache) the
        first segment has no memory, as in the original implementation (kimiyoung/transformer-xl)."""
        param = self.word_embeddings.layers[0].weight
        cache = TransfoXLCache(self.config.num_hidden_layers, use_fwl=self.config.use_fwl)
        for layer_idx in range(self.config.num_hidden_layers):
            zeros = torch.zeros(batch_size, self.config.mem_len, self.config.hidden_size, dtype=param.dtype,
                                device=param.device)
            cache.layers[layer_idx].states = {"memory": zeros,
                                              "memory_mask": zeros.new_ones(batch_size, self.config.mem_len)}
        return cache

    def _attention_pattern(
        self, token_mask: Optional[torch.Tensor], memory_mask: Optional[torch.Tensor], T: int, M: int, device
    ) -> torch.Tensor:
        """``allowed [B or 1, 1, T, M + T]``: causal over ``[memory; segment]`` (query i is key ``M + i``); with
        ``same_length`` only distances < mem_len; padded keys hidden, except a query's own key (no empty rows)."""
        distance = M + torch.arange(T, device=device)[:, None] - torch.arange(M + T, device=device)[None, :]
        allowed = distance >= 0
        if self.config.same_length:
            allowed = allowed & (distance < self.config.mem_len)
        allowed = allowed[None, None]
        if token_mask is not None:
            key_mask = token_mask if memory_mask is None else torch.cat([memory_mask, token_mask], dim=1)
            allowed = (allowed & key_mask.bool()[:, None, None, :]) | (distance == 0)[None, None]
        return allowed

    def _checked_cache(
        self, cache: Optional[TransfoXLCache], batch_size: int, use_cache: bool
    ) -> Optional[TransfoXLCache]:
        """The cache to continue from and update: the caller's (validated), a new one if `use_cache`, or None."""
        if cache is not None and not isinstance(cache, TransfoXLCache):
            raise ValueError(
                f"`cache` (`past_key_values`) must be a TransfoXLCache (or None), got {type(cache).__name__}"
            )
        if cache is not None and cache.batch_size not in (-1, batch_size):
            raise ValueError(
                f"`cache` (`past_key_values`) holds memories for batch size {cache.batch_size}, but the input has "
                f"batch size {batch_size}"
            )
        if cache is None and use_cache:
            cache = TransfoXLCache(self.config.num_hidden_layers, use_fwl=self.config.use_fwl)
        return cache

    def forward(
        self,
        input_ids: Optional[torch.LongTensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        cache: Optional[TransfoXLCache] = None,
        inputs_embeds: Optional[torch.Tensor] = None,
        use_cache: Optional[bool] = None,
        output_hidden_states: Optional[bool] = None,
        return_dict: Optional[bool] = None,
        past_key_values: Optional[TransfoXLCache] = None,
        **kwargs,
    ) -> Union[BaseModelOutputWithPast, Tuple]:
        """
        Args:
            input_ids: ``[B, T]`` token ids in ``[0, vocab_size)`` (or ``inputs_embeds [B, T, D]``, as returned by
                ``get_input_embeddings()``, i.e. already scaled by sqrt(D)).
            attention_mask: ``[B, T]`` or ``[B, past + T]`` padding mask (1 = token, 0 = left padding).
            cache: a ``TransfoXLCache`` of memories to continue from (updated in place and returned);
                ``past_key_values``, its name before transformers 5.24, works too.
            use_cache: return a cache (a new one when ``cache`` is None); training with memories across
                segments passes the returned cache to the next segment (gradients stop at the boundary).
        Returns:
            ``BaseModelOutputWithPast(last_hidden_state [B, T, D], cache, hidden_states)``; hidden_states are
            the inputs of every layer and the final output.
        """
        config = self.config
        output_hidden_states = output_hidden_states if output_hidden_states is not None else config.output_hidden_states
        use_cache = use_cache if use_cache is not None else config.use_cache
        return_dict = return_dict if return_dict is not None else config.return_dict
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Specify exactly one of `input_ids` and `inputs_embeds`")
        if input_ids is not None:
            check_token_ids(input_ids, config.vocab_size, "input_ids")
            inputs_embeds = self.word_embeddings(input_ids)
        B, T = inputs_embeds.shape[:2]
        cache = self._checked_cache(resolve_cache_argument(cache, past_key_values), B, use_cache)
        past_len = cache.get_seq_length() if cache is not None else 0
        M = cache.memory_length() if cache is not None else 0
        token_mask = padding_mask(attention_mask, B, T, past_len)
        memory_mask = cache.get_memory(0)[1] if M else None
        if token_mask is None and memory_mask is not None and not bool(memory_mask.all()):
            token_mask = inputs_embeds.new_ones(B, T)
        allowed = self._attention_pattern(token_mask, memory_mask, T, M, inputs_embeds.device)

        # Sinusoids of the distances K-1 .. 0, clamped at clamp_len (Dai et al. sec. 3.3)
        distances = torch.arange(M + T - 1, -1, -1, device=inputs_embeds.device)
        if config.clamp_len > 0:
            distances = distances.clamp(max=config.clamp_len)
        pos_emb = self.dropout(sinusoidal_position_embedding(distances, config.hidden_size).to(inputs_embeds.dtype))

        hidden_states = self.dropout(inputs_embeds)
        layer_inputs = []
        shared = (self.r_w_bias, self.r_r_bias) if not config.untie_r else (None, None)
        for layer_idx, block in enumerate(self.layers):
            layer_inputs.append(hidden_states)
            memory = cache.get_memory(layer_idx)[0] if M else None
            hidden_states = block(hidden_states, memory, pos_emb, allowed, *shared)
        hidden_states = self.dropout(hidden_states)

        if cache is not None:
            mask = token_mask if token_mask is not None else inputs_embeds.new_ones(B, T)
            for layer_idx, layer_input in enumerate(layer_inputs):
                cache.update_memory(layer_idx, layer_input, mask, config.mem_len)
            cache.count_tokens(token_mask, B, T, inputs_embeds.device)

        all_hidden_states = tuple(layer_inputs) + (hidden_states,) if output_hidden_states else None
        output = BaseModelOutputWithPast(
            last_hidden_state=hidden_states, hidden_states=all_hidden_states, **{CACHE_ARGUMENT: cache}
        )
        return output if return_dict else output.to_tuple()


class TransfoXLForCausalLM(TransfoXLPreTrainedModel, GenerationMixin):
    """Transformer-XL with its projected adaptive softmax (``lm_head``), optionally with a Fast Weight Layer head.

    ``logits`` are log-probabilities over the whole vocabulary (softmax of them is the model's distribution, so
    generation, sampling and beam search work unchanged); the loss is computed through the adaptive softmax.

    With ``config.use_fwl`` (Clark et al. 2022 sec. 3) the adaptive softmax reads ``f_t(h_t)``, the FWL
    (``fwl_head``, the shared ``FWLHead``) with every position's fast weights: within a segment the parallel fast pass,
    across segments the running update carried in the cache, decayed by the learned ``fwl_head.decay`` (gamma per
    fast parameter) at segment boundaries. The memories and the FWL state live in one ``TransfoXLCache``.
    """

    def __init__(self, config: TransfoXLConfig) -> None:
        super().__init__(config)
        self.model = TransfoXLModel(config)
        self.lm_head = ProjectedAdaptiveLogSoftmax(config)
        if config.use_fwl:
            self.fwl_head = FWLHead.from_config(config, AdaptiveSoftmaxFWLSlowHead, config.hidden_size, self.lm_head)
        self._tied_weights_keys = self._tie_mapping()
        self.post_init()

    def _tie_mapping(self) -> Dict[str, str]:
        """``{target: source}`` of the shared tensors: cluster weights (``tie_word_embeddings``) and projections
        (``tie_projs``; div_val 1 shares the single input projection)."""
        config, mapping = self.config, {}
        if config.tie_word_embeddings:
            for i in range(len(self.lm_head.layers)):
                mapping[f"lm_head.layers.{i}.weight"] = f"model.word_embeddings.layers.{i}.weight"
        if self.lm_head.projections is not None:
            for i, tie in enumerate(config.tie_projs):
                if tie:
                    source = 0 if config.div_val == 1 else i
                    mapping[f"lm_head.projections.{i}.weight"] = f"model.word_embeddings.projections.{source}.weight"
        if config.use_fwl:  # the FWL's output layer is lm_head itself, reached from a second path
            for name, _ in self.lm_head.named_parameters():
                mapping[f"fwl_head.slow.output_embedding.{name}"] = mapping.get(f"lm_head.{name}", f"lm_head.{name}")
        return mapping

    def get_expanded_tied_weights_keys(self, all_submodels: bool = False) -> dict:
        # Projections are tied by `tie_projs` even when `tie_word_embeddings` is False: not transformers' default rule.
        return self._tie_mapping()

    def get_input_embeddings(self) -> AdaptiveEmbedding:
        return self.model.word_embeddings

    def set_input_embeddings(self, value: AdaptiveEmbedding) -> None:
        self.model.word_embeddings = value

    def get_output_embeddings(self) -> None:
        return None  # an adaptive softmax, not one [V, D] matrix: resizing is unsupported

    def init_memories(self, batch_size: int) -> TransfoXLCache:
        return self.model.init_memories(batch_size)

    def causal_lm_loss(
        self,
        labels: Optional[torch.LongTensor],
        hidden_states: torch.Tensor,
        num_items_in_batch: Optional[Union[int, torch.Tensor]] = None,
        ignore_index: int = -100,
        shift_labels: Optional[torch.LongTensor] = None,
    ) -> torch.Tensor:
        """Causal LM loss with transformers' ``ForCausalLMLoss`` semantics: position t predicts ``labels[:, t + 1]`` (or
        ``shift_labels[:, t]``); the NLL sum over non-ignored targets divided by ``num_items_in_batch`` (their count
        when None). The NLL of ``hidden_states [B, T, D]`` goes through the adaptive softmax, which evaluates the head
        cluster and each target's own cluster only."""
        if shift_labels is None:
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[:, 1:]
        check_token_ids(shift_labels, self.config.vocab_size, "labels", ignore_index=ignore_index)
        valid = shift_labels != ignore_index
        nll = self.lm_head.nll(hidden_states[valid], shift_labels[valid])
        if num_items_in_batch is None:
            num_items_in_batch = valid.sum()
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(nll.device)
        return (nll.sum() / num_items_in_batch).to(hidden_states.dtype)

    def _fwl_hidden_states(
        self,
        hidden_states: torch.Tensor,
        input_ids: Optional[torch.LongTensor],
        attention_mask: Optional[torch.Tensor],
        cache: Optional[TransfoXLCache],
    ) -> torch.Tensor:
        """FWL fast pass of one segment (Clark et al. 2022 sec. 3), continuing the decayed carried update in the cache:
        ``[B, T, D] -> f_t(h_t) [B, T, D]`` with every position's own fast weights."""
        if input_ids is None:
            raise ValueError("`use_fwl=True` needs `input_ids`: the next token of each position is its fast-update "
                             "label")
        cache_layer = cache.fwl_layer if cache is not None else None
        return self.fwl_head(hidden_states, input_ids, attention_mask, cache_layer=cache_layer, return_hidden=True)

    def _split_dependent_outputs(self) -> Optional[str]:
        return decay_split_dependence(getattr(self, "fwl_head", None))

    def _empty_cache(self) -> TransfoXLCache:
        return TransfoXLCache(self.config.num_hidden_layers, use_fwl=self.config.use_fwl)

    def _replay(self, cache: TransfoXLCache, input_ids: Optional[torch.LongTensor],
                inputs_embeds: Optional[torch.Tensor], attention_mask: Optional[torch.Tensor], num_tokens: int) -> None:
        """Runs the first ``num_tokens`` of a recorded forward pass again from its restored memories and FWL state
        (a rollback, ``cache_fwp.RollbackMixin``)."""
        dropped = (input_ids if input_ids is not None else inputs_embeds).shape[1] - num_tokens
        self(
            input_ids=None if input_ids is None else input_ids[:, :num_tokens],
            inputs_embeds=None if inputs_embeds is None else inputs_embeds[:, :num_tokens],
            attention_mask=None if attention_mask is None else attention_mask[:, : attention_mask.shape[1] - dropped],
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )

    def forward(
        self,
        input_ids: Optional[torch.LongTensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        cache: Optional[TransfoXLCache] = None,
        inputs_embeds: Optional[torch.Tensor] = None,
        labels: Optional[torch.LongTensor] = None,
        use_cache: Optional[bool] = None,
        output_hidden_states: Optional[bool] = None,
        return_dict: Optional[bool] = None,
        logits_to_keep: Union[int, torch.Tensor] = 0,
        past_key_values: Optional[TransfoXLCache] = None,
        **kwargs,
    ) -> Union[CausalLMOutputWithPast, Tuple]:
        """
        Args:
            labels: ``[B, T]`` ids (shifted inside; -100 ignored). With ``num_items_in_batch`` (passed by Trainer) the
                loss is the token sum divided by that count, so gradient accumulation is exact. The loss always covers
                every position, whatever ``logits_to_keep`` says.
            logits_to_keep: an int n keeps the last n positions' log-probabilities (0 keeps all), a tensor selects
                positions. ``logits_to_keep=1`` with ``labels`` scores a segment without materialising ``[B, T, V]``.
            Other arguments as in ``TransfoXLModel.forward``.
        Returns:
            ``CausalLMOutputWithPast(loss, logits [B, T', V] (log-probabilities), cache, hidden_states)``.
        """
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        cache = resolve_cache_argument(cache, past_key_values)
        if isinstance(cache, TransfoXLCache) and cache.record_past:  # assisted decoding may roll this pass back
            num_tokens = (input_ids if input_ids is not None else inputs_embeds).shape[1]
            cache.checkpoint(num_tokens, partial(self._replay, cache, input_ids, inputs_embeds, attention_mask))
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_hidden_states=output_hidden_states,
            return_dict=True,
        )
        hidden_states = outputs.last_hidden_state
        keep = logits_to_keep_index(logits_to_keep)
        loss_kwargs = take_loss_kwargs(kwargs)
        if self.config.use_fwl:  # the adaptive softmax reads the FWL's fast f(h) instead of h
            hidden_states = self._fwl_hidden_states(hidden_states, input_ids, attention_mask, output_cache(outputs))
        logits = self.lm_head.log_prob(hidden_states[:, keep])
        loss = None
        if labels is not None:
            loss = self.causal_lm_loss(labels, hidden_states=hidden_states, **loss_kwargs)
        output = CausalLMOutputWithPast(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, **{CACHE_ARGUMENT: output_cache(outputs)}
        )
        return output if return_dict else output.to_tuple()
