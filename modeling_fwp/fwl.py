"""Fast Weight Layers (Clark, Guu, Chang, Pasupat, Hinton, Norouzi, "Meta-Learning Fast Weight Language Models",
EMNLP 2022, sec. 2): the head, its slow net, and its cache.

The FWL is a small head on a language model's last hidden states ``h_t``. With slow parameters theta:

    f(h) = LayerNorm(ReLU(h U + a)^2 W + b),         logits = f(h) E^T + c                       (sec. 2, unnumbered)

At every position t the head runs with fast parameters, one gradient step on the losses of all earlier positions:

    theta_t = theta - alpha * sum_{j<t} grad_theta CE(logits_j(theta), x_{j+1})        (sec. 2; eq. 1 for one matrix)

gradients taken at the slow theta, one learned step size alpha > 0 per parameter tensor. The head is position-wise,
so the gradient of a weight matrix M used as ``y = M x`` is the outer product ``dy_j x_j^T`` of its upstream
gradient and its input, and

    M_t x_t = M x_t - alpha * sum_{j<t} (x_t . x_j) dy_j                                                 (eq. 2)

is causal linear attention with query x_t (fast pass input), key x_j (slow pass input) and value dy_j, strictly
over earlier positions. Bias, LayerNorm and output-bias vectors become cumulative sums. The parallel forward is one
slow pass, one analytic backward of all per-token losses at once, and one fast pass: linear in T. Nothing is
detached, so training backpropagates through the gradient computation (second order), as in the paper.

The output layer is explicit (``FWLSlowHead``'s output-layer interface): a dense ``o E^T + c`` on the base model's
output embedding, optionally followed by a logit transform (``DenseFWLSlowHead``, e.g. Gemma 2's soft-capping), or
Transformer-XL's projected adaptive softmax (``AdaptiveSoftmaxFWLSlowHead`` in ``modeling_transfo_xl``).

Generation uses the same code on one token at a time: a ``FastWeightCacheLayer`` keeps the running gradient sums (the
fast weight state of every linear attention) and the slow pass of the last position, whose loss becomes known only
when the next token arrives. Optionally (Clark et al. sec. 3) the carried sums decay at segment boundaries,
``Delta <- gamma Delta + stopgrad(sum of the segment's gradients)`` (``SegmentDecay``).

Not in the paper, optional (``fast_vocabulary="seen"``, ``SeenVocabulary``): the output layer's per-token gradient
dCE/dz kept on the rows of the tokens seen so far, so that the fast E differs from the slow one on those rows only
and its products (the largest cost of a fast E, two LM heads per token) shrink to them.

Not in the paper, optional (``gradient_point="segment_start"``, output-layer parameters only): the per-token
gradients taken at the fast weights as of the start of the token's segment instead of the slow weights, so that the
fast weights keep accumulating across segments as dynamic evaluation's do (``FWLHead._forward_by_segments``).
"""
from __future__ import annotations

import contextlib
import math
from typing import Dict, FrozenSet, Iterable, Iterator, Optional, Set, Tuple, Union

import torch
import torch.nn.functional as F
from fwp_kernels import dense_linear, linear_attention, linear_cross_entropy_input_gradient
from torch import nn
from transformers import initialization as init
from transformers.cache_utils import Cache

from .cache_fwp import FastWeightCacheLayer, RollbackMixin
from .pretrained import logits_to_keep_index
from .configuration_fwl import (DEFAULT_FAST_PARAMETERS, FAST_VOCABULARIES, GRADIENT_POINTS, HIDDEN_PARAMETERS,
                                 FWLHeadConfigMixin)

# For every parameter that can be fast: (its input in the slow pass = the linear attention key, or None for a vector;
# its upstream gradient = the value). Names are those of `FWLSlowHead.named_parameters()`.
GRADIENT_TERMS: Dict[str, Tuple[Optional[str], str]] = {
    "up_proj.weight": ("h", "z1"),  # U: dCE_j/dU = dz1_j h_j^T
    "up_proj.bias": (None, "z1"),  # a
    "down_proj.weight": ("s", "z2"),  # W: dCE_j/dW = dz2_j s_j^T, s = ReLU(z1)^2
    "down_proj.bias": (None, "z2"),  # b
    "norm.weight": (None, "gain"),  # LayerNorm gain: df_j * n_j
    "norm.bias": (None, "f"),  # LayerNorm bias: df_j
    "output_embedding.weight": ("o", "logits"),  # E: dz_j o_j^T (z = the logits before any transform)
    "output_embedding.bias": (None, "logits"),
    "output_bias": (None, "logits"),  # c
}
# The output-layer parameters whose per-token gradient is dCE/dz (the value "logits"): E (key o) and two biases.
OUTPUT_LAYER_TERMS = tuple(name for name, (_, value) in GRADIENT_TERMS.items() if value == "logits")
# Vocabulary rows per block when E's running sum is read and updated with bfloat16 products (a block of the sum stays in
# cache for both; by hand, 2 threads, SmolLM2's S of 49,152 x 576, 128 positions: 57 ms in blocks of 2,048 rows, 62
# in 4,096, 79 in 1,024, against 108 ms for the two float32 products; in the whole model the conversions of S and of
# the values take most of that back: benchmarks/bench_test_time_fwl.py).
_SUM_UPDATE_BLOCK_ROWS = 2048
# gradient_point="segment_start" outside autograd, a call of at least this many positions that begins a segment:
# the slow z and the read of E's carried sum S come from one product with the fast weights E - alpha_E S, written
# once (a pass over three [V, D] tensors) instead of a second product o S^T (by hand, 2 threads, SmolLM2, 128
# positions: the read was about 60 ms of the segment's 600; a call of one position reads S once either way)
_FOLD_CARRIED_SUM_MIN_POSITIONS = 32
# How deep the analytic backward must go for each upstream gradient.
_GRADIENT_DEPTH = {"logits": 0, "f": 1, "gain": 1, "z2": 2, "z1": 3}

Intermediates = Dict[str, torch.Tensor]
State = Optional[Dict[str, torch.Tensor]]


def _inverse_softplus(x: float) -> float:
    """raw with softplus(raw) = x (plain Python: also works while models are built on the meta device)."""
    return x + math.log(-math.expm1(-x))


def _inverse_sigmoid(x: float) -> float:
    """raw with sigmoid(raw) = x."""
    return math.log(x / (1 - x))


def layer_normalize(x: torch.Tensor, eps: float, rms: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(x - mean) / sqrt(var + eps)`` over the last dim (biased variance, as ``nn.LayerNorm``), or with `rms`
    ``x / sqrt(mean(x^2) + eps)`` (RMSNorm: Llama's final norm); returns (n, rstd)."""
    centered = x if rms else x - x.mean(-1, keepdim=True)
    rstd = torch.rsqrt(centered.pow(2).mean(-1, keepdim=True) + eps)
    return centered * rstd, rstd


class RMSNormParameters(nn.Module):
    """The gain of an RMSNorm (``norm.weight``) and its epsilon: the normalisation of an output-side FWL whose slow
    net is a base model's final RMSNorm (``layer_normalize(rms=True)`` computes it)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps


class FWLSlowHead(nn.Module):
    r"""The FWL with slow weights (Clark et al. 2022 sec. 2, unnumbered): the hidden layer
    ``f(h) = LayerNorm(ReLU(h U + a)^2 W + b)`` (``up_proj`` U, a; ``down_proj`` W, b; ``norm``), read by an output
    layer that each subclass implements. ``forward(h [B, T, D]) -> logits [B, T, V]`` uses only the module's own
    parameters (the slow head of the FWL contract).

    The output-layer interface (what ``FWLHead`` uses), with ``o = f(h)`` (or ``h + f(h)`` when ``residual``):

    - ``vocab_size``; ``output_parameter_names``: the output layer's parameters that may get fast weights.
    - ``output_preactivation(o, dtype) -> z [..., V]``: the part of the output layer that is linear in its parameters;
      ``transform_logits(z) -> logits``: what follows (identity by default).
    - ``output_gradients(inter, labels, weights, ...) -> {"f": dCE/do, "logits": dCE/dz}``: the output layer's share
      of the per-token backward.
    - ``merge_previous_position``: whether ``FWLHead`` computes the gradient of the previous call's last position in
      the same ``per_token_gradients`` call as the new positions (concatenating the slow-pass intermediates): only
      worth it when they hold no vocabulary-sized tensor, which would have to be copied.

    Subclasses build their output layer after ``super().__init__`` and end their ``__init__`` with
    ``self.reset_parameters()``.

    ``intermediate_size=None`` drops the MLP: ``f(h) = Norm(h)``, the normalisation alone (with ``rms_norm`` an
    RMSNorm without bias): the slow net of an FWL made of a pretrained model's own output side
    (``OutputSideFWLSlowHead``).
    """

    merge_previous_position: bool = False
    output_parameter_names: Tuple[str, ...] = ()

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: Optional[int],
        residual: bool = False,
        layer_norm_eps: float = 1e-5,
        rms_norm: bool = False,
    ) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.has_mlp = intermediate_size is not None
        if self.has_mlp:
            self.up_proj = nn.Linear(hidden_size, intermediate_size)  # h U + a
            self.down_proj = nn.Linear(intermediate_size, hidden_size)  # s W + b
        self.rms_norm = rms_norm
        self.norm = (RMSNormParameters(hidden_size, layer_norm_eps) if rms_norm
                     else nn.LayerNorm(hidden_size, eps=layer_norm_eps))
        self.residual = residual

    @property
    def fast_parameter_candidates(self) -> Tuple[str, ...]:
        """The names of this head's parameters that may get fast weights (``GRADIENT_TERMS`` keys it has)."""
        own = {name for name, _ in self.named_parameters()}
        return tuple(name for name in HIDDEN_PARAMETERS if name in own) + tuple(self.output_parameter_names)

    def _norm_bias(self) -> Optional[torch.Tensor]:
        return getattr(self.norm, "bias", None)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The FWL's own initial values: a, b = 0, LayerNorm bias 0 and gain 1, or gain 0 when `residual` so that
        ``h + f(h) = h`` and the wrapped model starts exactly at its base model. U and W keep the initialisation of
        their ``nn.Linear`` (in a model: transformers' N(0, initializer_range)); the output layer's own values come
        from ``reset_output_parameters``. Honours transformers' "already initialised" flags (loaded weights)."""
        if self.has_mlp:
            init.zeros_(self.up_proj.bias)
            init.zeros_(self.down_proj.bias)
        init.constant_(self.norm.weight, 0.0 if self.residual else 1.0)
        if self._norm_bias() is not None:
            init.zeros_(self.norm.bias)
        self.reset_output_parameters()

    def reset_output_parameters(self) -> None:
        """Initial values of the output layer's own parameters (not of a shared base-model module)."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.output_logits(self.hidden_intermediates(hidden_states)["o"])

    def hidden_intermediates(self, hidden_states: torch.Tensor) -> Intermediates:
        """Slow pass up to the input of the output layer; returns what the analytic backward and the fast pass need,
        ``[B, T, *]``: h (input), r = ReLU(z1), s = r^2, n (normalised z2), rstd (1 / std of z2, ``[B, T, 1]``),
        o (input of the output layer)."""
        h = hidden_states
        inter = {"h": h}
        z2 = h
        if self.has_mlp:
            inter["r"] = r = F.relu(self.up_proj(h))  # z1 = h U + a
            inter["s"] = s = r * r
            z2 = self.down_proj(s)  # z2 = s W + b
        n, rstd = layer_normalize(z2, self.norm.eps, self.rms_norm)
        o = n * self.norm.weight  # f(h)
        if self._norm_bias() is not None:
            o = o + self.norm.bias
        if self.residual:
            o = o + h
        inter.update(n=n, rstd=rstd, o=o)
        return inter

    def output_logits(self, o: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The slow output layer: ``o [..., D] -> logits [..., V]``, computed in `dtype` when given."""
        return self.transform_logits(self.output_preactivation(o, dtype))

    def output_preactivation(self, o: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        raise NotImplementedError

    def transform_logits(self, z: torch.Tensor) -> torch.Tensor:
        return z

    def output_gradients(
        self,
        inter: Intermediates,
        labels: torch.Tensor,
        weights: Optional[torch.Tensor],
        input_gradient: bool,
        logits_gradient: bool,
        overwrite_logits: bool,
        compute_dtype: Optional[torch.dtype],
    ) -> Dict[str, torch.Tensor]:
        raise NotImplementedError

    def per_token_gradients(
        self,
        inter: Intermediates,
        labels: torch.Tensor,
        weights: Optional[torch.Tensor],
        depth: int,
        logits_gradient: bool = True,
        overwrite_logits: bool = False,
        compute_dtype: Optional[torch.dtype] = None,
    ) -> Dict[str, torch.Tensor]:
        """Upstream gradients of every per-token loss ``w_j CE(logits_j, labels_j)`` at once (one analytic backward).

        Args:
            inter: slow-pass intermediates of T positions (``hidden_intermediates``, with or without the logits).
            labels: ``[B, T]`` ids (any value where the weight is 0).
            weights: ``[B, T]`` 0/1 loss weights, or None for all ones.
            depth: how far back to go (0: logits only ... 3: down to z1, see ``_GRADIENT_DEPTH``).
            logits_gradient: also return dCE/dz ``[B, T, V]`` (a fast output-layer parameter needs it).
            overwrite_logits: outside autograd, the output layer may turn the slow logits it computes itself into
                their gradient in place (no second ``[B, T, V]`` tensor).
            compute_dtype: dtype of the vocabulary-sized part (logits, softmax, ``dz E``); None: that of the
                intermediates. ``torch.bfloat16`` is an approximation that runs on CPU matrix units.
        Returns:
            a dict of ``[B, T, *]`` tensors: logits (dCE/dz, if asked for), f (dCE/df), gain (df * n), z2, z1. Each
            row only depends on its own position, so the per-token gradient of a parameter is read off without a sum.
        """
        grads = self.output_gradients(
            inter, labels, weights, depth >= 1, logits_gradient, overwrite_logits, compute_dtype
        )
        if depth >= 1:
            # o = f (+ h): dCE/df = dCE/do
            grads["gain"] = grads["f"] * inter["n"]
        if depth >= 2:
            # LayerNorm backward: dz2 = rstd (dn - mean(dn) - n mean(dn n)), dn = df * gain (RMSNorm: no mean(dn))
            dn = grads["f"] * self.norm.weight
            n = inter["n"]
            centred = dn if self.rms_norm else dn - dn.mean(-1, keepdim=True)
            grads["z2"] = inter["rstd"] * (centred - n * (dn * n).mean(-1, keepdim=True))
        if depth >= 3:
            # s = ReLU(z1)^2: dz1 = (dz2 W) * 2 ReLU(z1)
            grads["z1"] = (grads["z2"] @ linear_weight(self.down_proj)) * (2 * inter["r"])
        return grads


def linear_weight(module: nn.Module) -> torch.Tensor:
    """The weight ``[out, in]`` a linear module applies: ``weight`` of an ``nn.Linear``; for a wrapper whose
    ``weight`` is not all it applies (a PEFT LoRA layer: the frozen base weight, its adapter beside it) the map it
    computes, read off its outputs on the unit vectors. The analytic gradients use it, so they stay those of the
    function the forward pass computes."""
    if type(module) is nn.Linear:
        return module.weight
    weight = module.weight
    eye = torch.eye(weight.shape[1], dtype=weight.dtype, device=weight.device)
    return (module(eye) - module(eye[:1] * 0)).t()


class DenseFWLSlowHead(FWLSlowHead):
    r"""The slow FWL with a dense output layer: ``logits = T(o E^T + c)``, where E is the base model's output embedding
    (the same ``nn.Linear`` module, shared, with its bias if it has one), c the head's own ``output_bias`` and T the
    base model's logit transform: the identity, or soft-capping ``T(z) = cap * tanh(z / cap)`` (Gemma 2's
    ``final_logit_softcapping``). The fast weights of E and c act on z, before T.

    Args:
        hidden_size, intermediate_size, residual, layer_norm_eps, rms_norm: as in ``FWLSlowHead``.
        output_embedding: E, ``nn.Linear [V, hidden_size]``.
        output_bias: give the head its own output bias c.
        logit_softcapping: None, or the cap of the soft-capping transform.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: Optional[int],
        output_embedding: nn.Linear,
        *,
        output_bias: bool = True,
        residual: bool = False,
        layer_norm_eps: float = 1e-5,
        logit_softcapping: Optional[float] = None,
        rms_norm: bool = False,
    ) -> None:
        super().__init__(hidden_size, intermediate_size, residual, layer_norm_eps, rms_norm)
        if not isinstance(output_embedding, nn.Linear):
            raise ValueError(
                "The FWL head needs the base model's output embedding as an `nn.Linear` [vocab_size, hidden_size] "
                f"(from `get_output_embeddings()`), got {type(output_embedding).__name__}"
            )
        if output_embedding.in_features != hidden_size:
            raise ValueError(
                f"The output embedding takes inputs of size {output_embedding.in_features}, but the hidden states have "
                f"size {hidden_size}"
            )
        if logit_softcapping is not None and not logit_softcapping > 0:
            raise ValueError(f"`logit_softcapping` must be None or > 0, got {logit_softcapping}")
        self.vocab_size = output_embedding.out_features
        self.output_embedding = output_embedding  # E, shared with the base model
        self.output_bias = nn.Parameter(torch.empty(self.vocab_size)) if output_bias else None  # c
        self.logit_softcapping = logit_softcapping
        self.output_parameter_names = tuple(
            name for name, _ in self.named_parameters() if name.startswith("output_")
        )
        self.reset_parameters()

    def reset_output_parameters(self) -> None:
        if self.output_bias is not None:
            init.zeros_(self.output_bias)

    def _output_layer(self, dtype: Optional[torch.dtype] = None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(E [V, D], the total output bias [V] or None), cast to `dtype` when given."""
        weight, bias = linear_weight(self.output_embedding), self.output_embedding.bias
        if self.output_bias is not None:
            bias = self.output_bias if bias is None else bias + self.output_bias
        if dtype is not None and dtype != weight.dtype:
            weight, bias = weight.to(dtype), None if bias is None else bias.to(dtype)
        return weight, bias

    def output_preactivation(self, o: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """``z = o E^T + c`` (plus E's own bias) in one fused matmul (``fwp_kernels.dense_linear``: oneDNN on CPU
        outside autograd), computed in `dtype` when given."""
        weight, bias = self._output_layer(dtype)
        return dense_linear(o if dtype is None else o.to(dtype), weight, bias)

    def transform_logits(self, z: torch.Tensor) -> torch.Tensor:
        if self.logit_softcapping is None:
            return z
        return torch.tanh(z / self.logit_softcapping) * self.logit_softcapping

    def output_gradients(
        self,
        inter: Intermediates,
        labels: torch.Tensor,
        weights: Optional[torch.Tensor],
        input_gradient: bool,
        logits_gradient: bool,
        overwrite_logits: bool,
        compute_dtype: Optional[torch.dtype],
    ) -> Dict[str, torch.Tensor]:
        """dCE/dz ``[B, T, V]`` (``grads["logits"]``, when asked for or when ``inter`` holds the logits) and dCE/do
        (``grads["f"]``, when `input_gradient`). Without a transform and without logits, dCE/do comes from
        ``fwp_kernels.linear_cross_entropy_input_gradient``: outside autograd in row blocks, no ``[B, T, V]`` tensor."""
        dtype = compute_dtype or inter["o"].dtype
        grads: Dict[str, torch.Tensor] = {}
        fused = self.logit_softcapping is None and not logits_gradient and "logits" not in inter
        if fused and input_gradient:
            # dCE/do = w (softmax(o E^T + c) - onehot(label)) E, without materialising dlogits
            o = inter["o"]
            weight, bias = self._output_layer(dtype)
            rows = o.reshape(-1, o.shape[-1]).to(dtype)
            scale = None if weights is None else weights.reshape(-1)
            df = linear_cross_entropy_input_gradient(rows, weight, bias, labels.reshape(-1), scale).view(o.shape)
        else:
            grads["logits"] = grad = self._logits_gradient(inter, labels, weights, overwrite_logits, dtype)
            if input_gradient:
                # dCE/do = dz E
                df = dense_linear(grad, linear_weight(self.output_embedding).to(dtype).t())
        if input_gradient:
            grads["f"] = df.to(inter["o"].dtype)
        return grads

    def logits_gradient_columns(
        self, logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, columns: torch.Tensor
    ) -> torch.Tensor:
        """dCE/dz on the vocabulary rows `columns` only: ``w (softmax(logits)[cols] - onehot(label)[cols]) *
        T'(z)[cols]`` ``[B, T, n]``, from the slow ``logits [B, T, V]`` (after the transform), ``labels [B, T]``,
        ``weights [B, T]`` and ``columns [n]``: no ``[B, T, V]`` gradient, shift or mask. A label outside `columns`
        must have weight 0 (fast_vocabulary="seen" keeps every label's row)."""
        # torch's fused softmax, then the columns: on CPU 5-10x faster than exp(logits[cols] - logsumexp(logits)),
        # whose logsumexp is not fused (a rough profile by hand, SmolLM2's 49,152 rows, 128 positions: about 2 ms
        # against 19)
        if columns.numel() == 0:  # nothing seen yet (a call of padding alone): no row may change
            return logits.new_zeros(*logits.shape[:-1], 0)
        grad = torch.softmax(logits, -1).index_select(-1, columns)
        where = torch.full((logits.shape[-1],), -1, dtype=torch.long, device=logits.device)
        where[columns] = torch.arange(columns.numel(), device=logits.device)
        label_columns = where[labels.clamp(0, logits.shape[-1] - 1)]  # -1: not among the columns (weight 0)
        grad.scatter_add_(-1, label_columns.clamp(min=0)[..., None], -(label_columns >= 0).to(grad.dtype)[..., None])
        grad.mul_(weights[..., None].to(grad.dtype))
        slope = self._logit_transform_slope(logits.index_select(-1, columns))
        return grad if slope is None else grad.mul_(slope)

    def _logit_transform_slope(self, logits: torch.Tensor) -> Optional[torch.Tensor]:
        """T'(z) of the logit transform, from its output: ``1 - tanh(z / cap)^2 = 1 - (logits / cap)^2`` with
        soft-capping, None (a slope of 1) without."""
        if self.logit_softcapping is None:
            return None
        return 1 - (logits / self.logit_softcapping).square()

    def _logits_gradient(self, inter, labels, weights, overwrite_logits: bool, dtype: torch.dtype) -> torch.Tensor:
        """dCE/dz ``= w (softmax(logits) - onehot(label)) * T'(z)`` ``[B, T, V]`` in `dtype`."""
        logits = inter["logits"].to(dtype) if "logits" in inter else self.output_logits(inter["o"], dtype=dtype)
        slope = self._logit_transform_slope(logits)  # before the softmax below may overwrite the logits
        # dCE/dlogits = softmax(logits) - onehot(label)
        if overwrite_logits:  # nothing else reads these logits: softmax in place
            grad = logits.sub_(logits.amax(-1, keepdim=True)).exp_()
            grad = grad.div_(grad.sum(-1, keepdim=True))
        else:
            grad = torch.softmax(logits, dim=-1)
            if torch.is_grad_enabled() and grad.requires_grad:
                grad = grad.clone()  # softmax's backward needs its own output unmodified
        if weights is not None:
            row_weights = weights[..., None].to(dtype)
            grad, minus_one = grad.mul_(row_weights), -row_weights
        else:
            minus_one = grad.new_full((*labels.shape, 1), -1.0)
        index = labels.clamp(0, logits.shape[-1] - 1)[..., None]
        grad = grad.scatter_add_(-1, index, minus_one)
        return grad if slope is None else grad * slope


class SegmentDecay(nn.Module):
    r"""Learned decay of the FWL's carried update across segments (Clark et al. 2022 sec. 3):

        Delta_s = gamma * Delta_{s-1} + stopgrad(sum of segment s's per-token gradients),   gamma = sigmoid(raw) per
        fast parameter tensor.

    Within a segment the FWL runs in parallel from ``gamma * Delta_{s-1}``; the carried sums are detached, so gradients
    reach gamma (through the current segment) but never earlier segments. A boundary: every call that continues from
    a state (``segment_length`` None), or once ``segment_length`` tokens were seen since the last one.
    """

    def __init__(self, fast_parameter_names: Iterable[str], decay_init: float, segment_length: Optional[int]) -> None:
        super().__init__()
        self.names = tuple(fast_parameter_names)
        self.decay_init = decay_init
        self.segment_length = segment_length
        self.raw_decay = nn.Parameter(torch.empty(len(self.names)))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        init.constant_(self.raw_decay, _inverse_sigmoid(self.decay_init))

    def gamma(self, name: str) -> torch.Tensor:
        return torch.sigmoid(self.raw_decay[self.names.index(name)])

    def forward(self, state: State) -> Tuple[State, Optional[torch.Tensor]]:
        """Decays the carried sums ``sum.<name>`` if a segment boundary was passed. Returns ``(state for this call,
        tokens of the current segment seen before it [B] or None)``."""
        if state is None:
            return None, None
        count = state.get("segment.tokens")
        if self.segment_length is None or count is None or int(count.max()) >= self.segment_length:
            state = {
                key: self.gamma(key[len("sum.") :]).to(t.dtype) * t if key.startswith("sum.") else t
                for key, t in state.items()
            }
            count = None
        return state, count


SEEN_TOKENS = "seen.tokens"  # state key of fast_vocabulary="seen": [B, V] bool, the tokens of the text so far


class SeenVocabulary:
    """``fast_vocabulary="seen"`` for one forward call: which vocabulary rows each per-token gradient may change.

    Entry t of the gradient values (position t - 1, label ``input_ids[:, t]``; ``_FastUpdates``' layout) keeps the
    rows of the tokens seen before this call (``state["seen.tokens"]``) and of ``input_ids[:, :t + 1]``, padded
    positions (mask 0) excluded. Every row such an entry keeps is a token that position t's own input or an earlier
    one was, so the restriction is causal and the same with and without padding.

    Args:
        state: the FWL state this call continues from (None: the start of a text).
        input_ids: ``[B, T]``; mask: ``[B, T]`` (1 = token) or None; vocab_size: V.
    """

    def __init__(self, state: State, input_ids: torch.Tensor, mask: Optional[torch.Tensor], vocab_size: int) -> None:
        B, T = input_ids.shape
        before = (state or {}).get(SEEN_TOKENS)
        self.before = before if before is not None else input_ids.new_zeros(B, vocab_size, dtype=torch.bool)
        positions = torch.arange(T, device=input_ids.device).expand(B, T)
        if mask is not None:
            positions = positions.masked_fill(mask == 0, T)  # padding: never seen
        # first[b, r]: the first position of this call where token r occurs (T: nowhere)
        self.first = torch.full((B, vocab_size), T, dtype=torch.long, device=input_ids.device)
        self.first.scatter_reduce_(1, input_ids.clamp(0, vocab_size - 1).long(), positions, "amin")
        self.seen_after = self.before | (self.first < T)  # [B, V]: the state after this call
        self.columns = self.seen_after.any(0).nonzero().squeeze(1)  # rows any sequence of the batch may change
        self.T = T

    def _dropped(self, first: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
        """``[B, T, n]`` from ``first``, ``before`` ``[B, n]`` (of some vocabulary rows): the rows entry t may not
        change, those not seen before this call and first seen after entry t (or never)."""
        steps = torch.arange(self.T, device=first.device)
        return (first[:, None, :] > steps[None, :, None]) & ~before[:, None, :]

    def restrict_columns(self, used: torch.Tensor) -> torch.Tensor:
        """``restrict`` for values held on ``columns`` only, ``used [B, T, n]``: in place (outside autograd)."""
        first, before = self.first.index_select(1, self.columns), self.before.index_select(1, self.columns)
        return used.masked_fill_(self._dropped(first, before), 0)

    def restrict(self, values: torch.Tensor) -> torch.Tensor:
        """``values [B, T, V]`` (dCE/dz) with the rows each entry may not change set to zero: in place outside
        autograd, else a new tensor."""
        dropped = self._dropped(self.first, self.before)
        if torch.is_grad_enabled() and values.requires_grad:
            return values.masked_fill(dropped, 0)
        return values.masked_fill_(dropped, 0)


class _FastUpdates:
    """The fast weight corrections ``alpha * sum_{j<t} grad_j`` of one forward call, for every fast parameter.

    Built from the per-token gradients of the positions ``[previous, new_0, ..., new_{T-2}]`` (the shift that makes
    the sums exclusive: position t sees the gradients of positions < t only) and the sums carried in from the cache.
    """

    def __init__(
        self, head: "FWLHead", keys: Dict[str, torch.Tensor], values: Dict[str, torch.Tensor], state: State,
        output_final_state: bool, writable: FrozenSet[str] = frozenset(), columns: Optional[torch.Tensor] = None,
        carried_read_done: bool = False,
    ):
        self.head = head
        # fast_vocabulary="seen" outside autograd: the only vocabulary rows whose values and carried sums may be
        # nonzero (the output layer's products skip the others), or None; values["logits"] then holds those rows only
        self.columns = columns
        self.keys, self.values, self.state = keys, values, state or {}
        self.output_final_state = output_final_state
        self.final_state: Dict[str, torch.Tensor] = {}
        self.writable = writable  # carried sums that only the cache layer references (may be updated in place)
        self.final_writable: Set[str] = set()
        # gradient_point="segment_start" at a segment boundary: z already holds the read of E's carried sum
        # (``FWLHead._segment_start_logits``), so ``subtract_output_layer_`` only updates the sum
        self.carried_read_done = carried_read_done

    def subtract(
        self, x: torch.Tensor, name: str, query: Optional[torch.Tensor] = None,
        keep: Union[slice, torch.Tensor] = slice(None)
    ) -> torch.Tensor:
        """Turns a slow output into the fast one, at the positions `keep`: for a fast matrix (``y = M q``, query
        ``[B, T, Dk]``) ``x - alpha * sum_{j<t} (q_t . k_j) v_j``, for a fast vector ``x - alpha * sum_{j<t} g_j``;
        x itself for a slow parameter."""
        if name not in self.head._active:
            return x
        return x - self._correction(name, query)[:, keep]

    def _correction(self, name: str, query: Optional[torch.Tensor]) -> torch.Tensor:
        key_name, value_name = GRADIENT_TERMS[name]
        value = self.values[value_name]
        initial = self.state.get(f"sum.{name}")
        if key_name is None:
            # a_t = a - alpha * sum_{j<t} g_j : a cumulative sum
            total = value.cumsum(1, dtype=torch.promote_types(value.dtype, torch.float32))
            if initial is not None:
                total = total + initial[:, None]
            if self.output_final_state:
                self.final_state[f"sum.{name}"] = total[:, -1].detach()
            correction = total.to(value.dtype)
        else:
            # M_t q_t = M q_t - alpha * sum_{j<t} (q_t . k_j) v_j : causal linear attention
            out, final = linear_attention(
                query[:, None],
                self.keys[key_name][:, None],
                value[:, None],
                initial_state=initial[:, None] if initial is not None else None,
                output_final_state=self.output_final_state,
                mode=self.head.kernel_mode,
                chunk_size=self.head.chunk_size,
            )
            if self.output_final_state:
                self.final_state[f"sum.{name}"] = final[:, 0].detach()
            correction = out[:, 0]
        return self.head.step_size(name).to(correction.dtype) * correction

    def subtract_output_layer_(self, z: torch.Tensor, query: torch.Tensor,
                               keep: Union[slice, torch.Tensor]) -> torch.Tensor:
        """Outside autograd: the fast output layer in one pass. ``z [B, T', V]``, the slow preactivation of the kept
        positions (a tensor the caller owns), minus the corrections of the fast E and output biases c, in place:

            z_t -= alpha_E q_t S^T + sum_c alpha_c s_c + sum_{i <= t} (alpha_E q_t . k_i + sum_c alpha_c) v_i    (eq. 2)

        with query q = o (fast pass), keys k = o and values v = dCE/dz of this call (entry i holds position i - 1), S
        ``[B, V, D]`` and s_c ``[B, V]`` the carried sums: one ``T' x T`` mixing matrix times the values and one
        product with S, where ``subtract`` runs a linear attention and cumulative sums over ``[B, T, V]`` tensors. The
        running sums are then updated in place where the cache layer allows it (``FastWeightCacheLayer.writable``):
        SmolLM2's S is 113 MB, whose fresh allocation costs more in page faults than its update. Equal to ``subtract``
        up to float32 summation order (tests/test_fwl.py). With ``columns`` (``fast_vocabulary="seen"``) the values are
        ``[B, T, n]`` on those vocabulary rows and the products read and write only them, the others' values and sums
        being zero."""
        names = [name for name in OUTPUT_LAYER_TERMS if name in self.head._active]
        if not names:
            return z
        value = self.values["logits"]  # [B, T, V], or [B, T, n] on the rows `columns` that may change
        cols = self.columns
        B, T, V = value.shape[0], value.shape[1], z.shape[-1]
        work = torch.promote_types(query.dtype, torch.float32)  # of the small T' x T products
        alpha = {name: self.head.step_size(name).to(work) for name in names}
        biases = [name for name in names if name != "output_embedding.weight"]
        steps = torch.arange(T, device=z.device)
        causal = (steps <= steps[keep][:, None]).to(work)  # [T', T]: entry i (position i - 1) teaches t if i <= t
        mixing = causal * sum(alpha[name] for name in biases) if biases else torch.zeros_like(causal)
        mixing = mixing.expand(value.shape[0], -1, -1)
        matrix = "output_embedding.weight" in names
        if matrix:  # alpha_E (q_t . k_i) for i <= t
            keys = self.keys["o"]
            scores = torch.bmm(query.to(work), keys.to(work).transpose(1, 2))
            mixing = mixing + alpha["output_embedding.weight"] * scores * causal
        if cols is not None:
            z.index_add_(2, cols, torch.bmm(mixing.to(value.dtype), value).to(z.dtype), alpha=-1)
        elif value.dtype == z.dtype:
            z.baddbmm_(mixing.to(z.dtype), value, alpha=-1)
        else:
            z.sub_(torch.bmm(mixing.to(value.dtype), value))
        carried = [alpha[name] * self.state[f"sum.{name}"] for name in biases if f"sum.{name}" in self.state]
        if carried:
            z.sub_(sum(carried)[:, None].to(z.dtype))
        if self.output_final_state and biases:
            total = value.sum(1, dtype=torch.promote_types(value.dtype, torch.float32))
            if cols is not None:  # back to [B, V]: zero on the rows no entry may change
                total = total.new_zeros(B, V).index_copy_(1, cols, total)
            for name in biases:
                carried_sum = self.state.get(f"sum.{name}")
                self.final_state[f"sum.{name}"] = total if carried_sum is None else carried_sum + total
        if matrix:
            scaled = alpha["output_embedding.weight"] * query
            carried_S = self.state.get("sum.output_embedding.weight")
            if cols is None:
                S = self._read_and_accumulate_sum(z, scaled, carried_S, value, keys)
            else:
                S = self._read_and_accumulate_rows(z, scaled, carried_S, value, keys, cols)
            if S is not None:
                self.final_state["sum.output_embedding.weight"] = S
                self.final_writable.add("sum.output_embedding.weight")
        return z

    def _sum_writable(self, S: Optional[torch.Tensor]) -> bool:
        """Whether E's carried running sum `S` may be updated in place: only the cache layer references it."""
        return S is not None and "sum.output_embedding.weight" in self.writable

    def _read_and_accumulate_sum(
        self, z: torch.Tensor, scaled_query: torch.Tensor, S: Optional[torch.Tensor], value: torch.Tensor,
        keys: torch.Tensor
    ) -> Optional[torch.Tensor]:
        """``z -= (alpha q) S^T`` in place, then (when the final state is wanted) ``S + sum_i v_i k_i^T`` ``[B, V, D]``:
        into S itself when the cache layer allows it, else into a fresh tensor. S stays float32 (float64 for float64
        values). Values in a lower precision (``gradient_dtype``) take both products in that precision, in blocks of
        vocabulary rows, each block of S converted once while in cache."""
        B, _, V = value.shape
        dtype = torch.promote_types(value.dtype, torch.float32)
        lower_precision = value.dtype != dtype
        target = None
        if self.output_final_state:
            target = S if self._sum_writable(S) else torch.empty(B, V, keys.shape[-1], dtype=dtype, device=value.device)
        step = _SUM_UPDATE_BLOCK_ROWS if lower_precision else V
        for b in range(B):
            q, k = scaled_query[b].to(value.dtype), keys[b].to(value.dtype)
            for start in range(0, V, step):
                rows = slice(start, start + step)
                if S is not None and not self.carried_read_done:  # one row: streaming kernel; more: oneDNN
                    z[b, :, rows].sub_(dense_linear(q, S[b, rows].to(value.dtype)))
                if target is None:
                    continue
                block, out = value[b, :, rows].t(), target[b, rows]  # sum_i v_i k_i^T = block @ k, [rows, D]
                if lower_precision:  # the block's product, added in float32 (out may be S itself)
                    product = block @ k
                    if S is None:
                        out.copy_(product)
                    else:
                        torch.add(S[b, rows], product, out=out)
                elif S is None:
                    torch.mm(block, k, out=out)
                else:
                    torch.addmm(S[b, rows], block, k, out=out)
        return target

    def _read_and_accumulate_rows(
        self, z: torch.Tensor, scaled_query: torch.Tensor, S: Optional[torch.Tensor], used: torch.Tensor,
        keys: torch.Tensor, cols: torch.Tensor,
    ) -> Optional[torch.Tensor]:
        """``_read_and_accumulate_sum`` on the vocabulary rows `cols` only (``fast_vocabulary="seen"``: S and the
        values are zero on every other row): ``z[..., cols] -= (alpha q) S[cols]^T``, then ``S[cols] += used^T k``
        with ``used [B, T, n]`` the values of those rows; S in place when the cache layer allows it."""
        B, V, D = z.shape[0], z.shape[-1], keys.shape[-1]
        dtype = torch.promote_types(used.dtype, torch.float32)
        target = None
        if self.output_final_state:
            if self._sum_writable(S):
                target = S
            elif S is not None:
                target = S.clone()
            else:
                target = torch.zeros(B, V, D, dtype=dtype, device=used.device)
        for b in range(B):
            rows = None if S is None else S[b].index_select(0, cols)  # [n, D]
            if rows is not None and not self.carried_read_done:
                q = scaled_query[b].to(used.dtype)
                z[b].index_add_(1, cols, dense_linear(q, rows.to(used.dtype)).to(z.dtype), alpha=-1)
            if target is not None:
                update = (used[b].t() @ keys[b].to(used.dtype)).to(dtype)  # sum_i v_i k_i^T on those rows
                target[b].index_copy_(0, cols, update if rows is None else rows + update)
        return target


class FWLHead(nn.Module):
    r"""Fast Weight Layer head (Clark et al. 2022): the FWL contract of DESIGN.md.

    - ``head(hidden_states [B, T, D], input_ids [B, T]) -> logits [B, T, V]``: the parallel fast forward; the label of
      position j is ``input_ids[:, j + 1]``, and position t only uses the labels of positions j < t.
    - ``head.slow``: the head with slow weights (an ``FWLSlowHead``), a plain module ``forward(h) -> logits``.
    - ``head.fast_parameter_names``: names (as in ``head.slow.named_parameters()``) that get fast weights.
    - ``head.step_size(name)``: the learned step size alpha of that parameter, ``softplus(raw) > 0``.
    - ``head.decay``: None, or the ``SegmentDecay`` of the carried update (Clark et al. sec. 3).

    Its state lives in one ``FastWeightCacheLayer`` of the model's cache (``forward(..., cache_layer=...)``).

    Args:
        slow: the slow head, which fixes the output layer (``DenseFWLSlowHead``, ``AdaptiveSoftmaxFWLSlowHead``).
        fast_parameters: names of the fast parameters (see ``GRADIENT_TERMS``).
        step_size_init: initial alpha of every fast parameter.
        decay_init, segment_length: None (no decay), or the initial gamma in (0, 1) and the segment length of a
            ``SegmentDecay``.
        kernel_mode, chunk_size: ``fwp_kernels.linear_attention`` options.
        gradient_dtype: dtype of the per-token gradients' vocabulary-sized part (slow logits, softmax, ``dz E``):
            None (exact, the hidden states' dtype) or e.g. ``torch.bfloat16`` (approximate; fast on CPU matrix units).
        fast_vocabulary: "full" (the paper) or "seen": the output layer's per-token gradient dCE/dz kept on the rows
            of the tokens seen so far (``FWLHeadConfigMixin.fwl_fast_vocabulary``; needs a fast output-layer
            parameter); the state then carries the seen tokens (``seen.tokens`` ``[B, V]``).
        gradient_point: "slow" (the paper) or "segment_start": the gradient of position j taken at the fast weights
            as of the start of j's segment of `segment_length` positions (``FWLHeadConfigMixin.fwl_gradient_point``;
            output-layer parameters only); the state then carries those sums (``start.<name>``) while a segment is
            unfinished, and the positions of the current segment (``segment.tokens``).
    """

    def __init__(
        self,
        slow: FWLSlowHead,
        *,
        fast_parameters: Iterable[str] = DEFAULT_FAST_PARAMETERS,
        step_size_init: float = 1e-3,
        decay_init: Optional[float] = None,
        segment_length: Optional[int] = None,
        kernel_mode: str = "auto",
        chunk_size: int = 256,
        gradient_dtype: Optional[Union[torch.dtype, str]] = None,
        fast_vocabulary: str = "full",
        gradient_point: str = "slow",
    ) -> None:
        super().__init__()
        if not isinstance(slow, FWLSlowHead):
            raise TypeError(f"`slow` must be an FWLSlowHead, got {type(slow).__name__}")
        self.slow = slow
        available = list(slow.fast_parameter_candidates)
        fast_parameters = list(fast_parameters)
        for name in fast_parameters:
            if name not in available:
                raise ValueError(
                    f"`fast_parameters` contains {name!r}, which is not a parameter of the FWL head that can be fast; "
                    f"available: {available}"
                )
        if len(set(fast_parameters)) != len(fast_parameters):
            raise ValueError(f"`fast_parameters` lists a name twice: {fast_parameters}")
        if not step_size_init > 0:
            raise ValueError(f"`step_size_init` must be > 0, got {step_size_init}")
        self.fast_parameter_names: Tuple[str, ...] = tuple(fast_parameters)
        self.step_size_init = step_size_init
        self.kernel_mode = kernel_mode
        self.chunk_size = chunk_size
        dtype = getattr(torch, gradient_dtype, None) if isinstance(gradient_dtype, str) else gradient_dtype
        if gradient_dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"`gradient_dtype` must be None or a floating point dtype, got {gradient_dtype!r}")
        self.gradient_dtype = dtype
        if fast_vocabulary not in FAST_VOCABULARIES:
            raise ValueError(f"`fast_vocabulary` must be one of {FAST_VOCABULARIES}, got {fast_vocabulary!r}")
        if fast_vocabulary == "seen" and not set(OUTPUT_LAYER_TERMS) & set(fast_parameters):
            raise ValueError(
                f"`fast_vocabulary='seen'` restricts the fast output layer's update, but none of "
                f"{list(OUTPUT_LAYER_TERMS)} is fast (`fast_parameters` = {fast_parameters})"
            )
        self.fast_vocabulary = fast_vocabulary
        self._check_gradient_point(gradient_point, segment_length, decay_init)
        self.gradient_point = gradient_point
        self.segment_length = segment_length
        self._fold_scratch: Optional[torch.Tensor] = None  # E - alpha_E S outside autograd (_folded_preactivation)
        # alpha = softplus(raw), one per fast parameter tensor
        self.raw_step_size = nn.Parameter(torch.empty(len(fast_parameters)))
        self.decay = None
        if decay_init is not None:
            self.decay = SegmentDecay(self.fast_parameter_names, decay_init, segment_length)
        self.reset_parameters()
        self._set_active(self.fast_parameter_names)

    @classmethod
    def from_config(
        cls, config: FWLHeadConfigMixin, slow_head_class: type, hidden_size: int, output_layer: nn.Module,
        **output_options
    ) -> "FWLHead":
        """The head a config with the ``FWLHeadConfigMixin`` fields describes, on `output_layer` (the base model's
        output embedding or adaptive softmax, shared) through `slow_head_class`; `output_options` go to that class."""
        slow = slow_head_class(
            hidden_size,
            config.fwl_intermediate_size,
            output_layer,
            output_bias=config.fwl_output_bias,
            residual=config.fwl_residual,
            layer_norm_eps=config.fwl_layer_norm_eps,
            **output_options,
        )
        return cls.on_slow_head(config, slow)

    @classmethod
    def on_slow_head(cls, config: FWLHeadConfigMixin, slow: FWLSlowHead) -> "FWLHead":
        """The head around an already built slow head, with the config's fast-weight fields."""
        return cls(
            slow,
            fast_parameters=config.fwl_fast_parameters,
            step_size_init=config.fwl_step_size_init,
            decay_init=config.fwl_decay_init,
            segment_length=config.fwl_segment_length,
            kernel_mode=config.fwl_kernel_mode,
            chunk_size=config.fwl_chunk_size,
            gradient_dtype=config.fwl_gradient_dtype,
            fast_vocabulary=config.fwl_fast_vocabulary,
            gradient_point=config.fwl_gradient_point,
        )

    def _check_gradient_point(self, gradient_point: str, segment_length: Optional[int], decay_init) -> None:
        """ValueError naming the argument for a `gradient_point` this head cannot use."""
        if gradient_point not in GRADIENT_POINTS:
            raise ValueError(f"`gradient_point` must be one of {GRADIENT_POINTS}, got {gradient_point!r}")
        if gradient_point == "slow":
            return
        hidden = [name for name in self.fast_parameter_names if name not in OUTPUT_LAYER_TERMS]
        problems = {
            "segment_length": (segment_length is None or segment_length < 1, "an int >= 1 (tokens per segment)"),
            "fast_parameters": (bool(hidden), f"output-layer parameters only {list(OUTPUT_LAYER_TERMS)}, not {hidden}"),
            "decay_init": (decay_init is not None, "None (a decay is not supported with it)"),
            "gradient_dtype": (self.gradient_dtype is not None, "None (exact gradients)"),
            "slow": (self.slow.merge_previous_position, "a slow head with a dense output layer"),
        }
        for argument, (bad, expected) in problems.items():
            if bad:
                raise ValueError(f"`gradient_point='segment_start'` needs `{argument}` = {expected}")

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The head's initial values: alpha = ``step_size_init`` for every fast parameter, the slow head's and the
        decay's own ``reset_parameters``."""
        init.constant_(self.raw_step_size, _inverse_softplus(self.step_size_init))
        self.slow.reset_parameters()
        if self.decay is not None:
            self.decay.reset_parameters()

    def _set_active(self, names: Tuple[str, ...]) -> None:
        """The parameters whose fast values the forward computes (all fast ones, or none inside ``slow_only``)."""
        self._active = names
        self._value_names = {GRADIENT_TERMS[name][1] for name in names}
        self._gradient_depth = max((_GRADIENT_DEPTH[v] for v in self._value_names), default=-1)
        self._fast_hidden = any(name in HIDDEN_PARAMETERS for name in names)

    @contextlib.contextmanager
    def slow_only(self) -> Iterator["FWLHead"]:
        """Inside this context the head runs with its slow weights only (no per-token gradients, no fast pass): the
        ablation that tells the fast weights' share of a trained FWL's gain from its slow head's."""
        self._set_active(())
        try:
            yield self
        finally:
            self._set_active(self.fast_parameter_names)

    def step_size(self, name: str) -> torch.Tensor:
        """The learned step size alpha (a positive scalar tensor) of fast parameter `name`."""
        if name not in self.fast_parameter_names:
            raise ValueError(f"{name!r} is not a fast parameter of this head; fast parameters: "
                             f"{list(self.fast_parameter_names)}")
        return F.softplus(self.raw_step_size[self.fast_parameter_names.index(name)])

    def forward(
        self,
        hidden_states: torch.Tensor,
        input_ids: torch.LongTensor,
        attention_mask: Optional[torch.Tensor] = None,
        cache_layer: Optional[FastWeightCacheLayer] = None,
        logits_to_keep: Union[int, torch.Tensor] = 0,
        return_hidden: bool = False,
    ) -> torch.Tensor:
        """Parallel fast forward, continuing the state in `cache_layer`.

        Args:
            hidden_states: ``[B, T, D]``; input_ids: ``[B, T]``, the tokens at those positions.
            attention_mask: ``[B, T]`` (or ``[B, past + T]``) padding mask, 0 = padding: padded positions neither
                learn nor teach; or None.
            cache_layer: where the FWL state lives (running gradient sums ``sum.<name>``, the previous position's slow
                pass ``prev.<key>``, with a decay the tokens of the current segment ``segment.tokens``): read (decayed
                at a segment boundary), then replaced by the state after these positions (constant in size). None:
                start fresh, keep nothing.
            logits_to_keep: an int n keeps the last n positions (0 keeps all), a tensor selects positions.
            return_hidden: return the fast output layer input ``o [B, T', D]`` instead of logits (the caller applies
                the slow output layer; only when no output-layer parameter is fast).
        Returns:
            ``logits [B, T', V]`` (or ``o [B, T', D]``).
        """
        if self.gradient_point == "segment_start":
            return self._forward_by_segments(
                hidden_states, input_ids, attention_mask, cache_layer, logits_to_keep, return_hidden
            )
        state, count, writable = self._read_state(cache_layer)
        out, new_state, new_writable = self._forward(
            hidden_states, input_ids, attention_mask, state, logits_to_keep, cache_layer is not None, return_hidden,
            writable,
        )
        if cache_layer is not None:
            T = hidden_states.shape[1]
            if self.decay is not None:
                new_state["segment.tokens"] = (count + T) if count is not None else torch.full(
                    (hidden_states.shape[0],), T, dtype=torch.long, device=hidden_states.device
                )
            cache_layer.set_states(new_state, T, new_writable)
        return out

    def _read_state(
        self, cache_layer: Optional[FastWeightCacheLayer]
    ) -> Tuple[State, Optional[torch.Tensor], FrozenSet[str]]:
        """(the state to continue from, decayed if a segment boundary was passed; the tokens of the current segment
        seen so far [B] or None; the names of its tensors that nothing else references, which may be updated in
        place: none once decayed, the decay makes copies)."""
        if cache_layer is None:
            return None, None, frozenset()
        state, writable = cache_layer.producer_states()
        state = state or None
        if self.decay is None:
            return state, None, writable
        return (*self.decay(state), frozenset())

    def _forward(
        self, hidden_states, input_ids, attention_mask, state: State, logits_to_keep, output_state: bool,
        return_hidden: bool, writable: FrozenSet[str] = frozenset(), start: Optional[Dict[str, torch.Tensor]] = None,
        prev_gradient: Optional[torch.Tensor] = None,
    ) -> Tuple[torch.Tensor, State, Set[str]]:
        """``(logits or o, state after these positions or None, the names of its tensors that nothing else
        references)``: slow pass, per-token gradients, fast pass. With `start` (``gradient_point="segment_start"``,
        the positions within one segment) the per-token gradients are taken at the fast weights of the segment's
        start, ``{name: sum of the gradients of earlier segments}`` ({}: the slow weights); `prev_gradient`: None, or
        where E's entry of `start` is the carried sum (``_segment_start_sums`` without its matrix), the previous
        position's dCE/dz ``[B, 1, V]`` whose rank-1 term completes it; outside autograd the fast pass then takes its
        read of the carried sum from that same product."""
        B, T = self._check_inputs(hidden_states, input_ids, attention_mask)
        active_output = [name for name in self._active if name not in HIDDEN_PARAMETERS]
        if return_hidden and active_output:
            raise ValueError(f"`return_hidden` needs a slow output layer, but {active_output} are fast")
        mask = None if attention_mask is None else attention_mask[:, -T:].to(hidden_states.dtype)
        slow = self.slow
        inter = slow.hidden_intermediates(hidden_states)  # slow pass (f_theta with the slow weights, sec. 2)
        fast_output = self._fast_hidden or "output_embedding.weight" in self._active
        keep = logits_to_keep_index(logits_to_keep)
        compute_dtype = self.gradient_dtype if self.gradient_dtype not in (None, hidden_states.dtype) else None
        # The slow logits of every position exist only where they are needed as such: as the output when only
        # output-side parameters are fast, or as the value of a fast output bias / embedding (dCE/dz; outside
        # autograd computed in place). Otherwise the per-token gradients go straight to dCE/df in row blocks.
        # Outside autograd with a slow hidden layer the fast pass reads the same o as the slow one: its z is the slow
        # z plus the output layer's corrections, so one product with E serves both (``subtract_output_layer_``).
        shared_z = fast_output and not self._fast_hidden and not return_hidden and not torch.is_grad_enabled()
        in_place = (
            fast_output and not shared_z and not torch.is_grad_enabled()
            and (compute_dtype or hidden_states.dtype) in (torch.float32, torch.float64)
        )
        preactivation = None
        folded = shared_z and prev_gradient is not None and T >= _FOLD_CARRIED_SUM_MIN_POSITIONS
        if (not fast_output or shared_z) and not return_hidden:  # every position's slow z (or, folded, E's read too)
            preactivation = (self._folded_preactivation(inter["o"], start) if folded
                             else slow.output_preactivation(inter["o"]))
            inter["logits"] = slow.transform_logits(preactivation)
        # (with a shared z, dCE/dz comes from the exact slow logits; only its products run in `gradient_dtype`)
        gradient_inter, last_gradient_logits, carried_read_done = inter, None, False
        if start is not None and self._active:  # the logits at the segment start's fast weights, for dCE/dz
            if preactivation is None:  # (autograd) one slow z for them and for the fast pass
                preactivation = slow.output_preactivation(inter["o"])
                inter["logits"] = slow.transform_logits(preactivation)
            gradient_inter, last_gradient_logits, carried_read_done = self._segment_start_logits(
                inter, preactivation, state, start, prev_gradient, shared_z, folded)
        seen = SeenVocabulary(state, input_ids, mask, slow.vocab_size) if self.fast_vocabulary == "seen" else None
        # fast_vocabulary="seen" outside autograd: dCE/dz is held on the seen rows only ([B, T, n], `columns`)
        columns = seen.columns if seen is not None and not torch.is_grad_enabled() else None
        if columns is not None and self._gradient_depth == 0 and "logits" in inter:
            keys, values = self._seen_output_gradient_terms(gradient_inter, input_ids, mask, state, seen)
        else:
            keys, values = self._gradient_terms(  # (the segment-start logits are this call's own: in place)
                gradient_inter, input_ids, mask, state, None if shared_z else compute_dtype,
                in_place or carried_read_done
            )
            if seen is not None and "logits" in values:
                full = values["logits"]
                values["logits"] = seen.restrict(full) if columns is None else seen.restrict_columns(
                    full.index_select(2, columns))
        if shared_z and compute_dtype is not None and "logits" in values:
            values["logits"] = values["logits"].to(compute_dtype)
        updates = _FastUpdates(self, keys, values, state, output_state, writable, columns, carried_read_done)

        # Fast pass: every parameter replaced by its fast value.
        o = self._fast_hidden_layer(hidden_states, updates) if self._fast_hidden else inter["o"]
        if return_hidden:
            out, last_slow_logits = o[:, keep], None
        else:
            out, last_slow_logits = self._fast_logits(o, inter, preactivation, updates, keep, output_state)
        new_state = None
        if output_state:
            new_state = dict(updates.final_state)  # every fast parameter's running sum, through position T - 2
            for key, t in inter.items():
                new_state[f"prev.{key}"] = t[:, -1:].detach()
            if last_gradient_logits is not None or last_slow_logits is not None:
                last = last_gradient_logits if last_gradient_logits is not None else last_slow_logits
                new_state["prev.logits"] = last.detach()  # the last position's logits at its gradient point
            new_state["prev.mask"] = mask[:, -1:].detach() if mask is not None else hidden_states.new_ones(B, 1)
            if seen is not None:
                new_state[SEEN_TOKENS] = seen.seen_after
        return out, new_state, updates.final_writable

    def _segment_start_logits(self, inter, preactivation, state, start, prev_gradient, shared_z, folded=False):
        """(``inter`` with the logits at the segment start's fast weights, for dCE/dz; its last position's, kept;
        whether the slow z `preactivation` now holds the fast pass's read of E's carried sum): ``_forward``'s
        segment-start step, `start` and `prev_gradient` as there; `folded`: `preactivation` holds that read already
        (``_folded_preactivation``).

        The logits at ``theta - alpha * start`` (eq. 1): ``z - alpha_E o S^T`` (E's read, `read`) minus the low-rank
        rest, the previous position's term ``alpha_E (o . o_prev) g_prev`` (with `prev_gradient`) and the output
        biases' ``alpha_c s_c``, in one batched product. Outside autograd at a boundary (`prev_gradient` with a
        shared z), E's read is that of the carried sum, which the fast pass would make again: it is subtracted from z
        in place for the fast pass to take, and the logits are written into the read's memory."""
        slow, z, o = self.slow, preactivation, inter["o"]
        read = None if folded else self._read_sum(o, start)
        carried_read_done = prev_gradient is not None and shared_z
        out = None
        if carried_read_done:
            if read is not None:
                z.sub_(read.to(z.dtype))
                out = read if read.dtype == z.dtype else None
        elif read is not None:
            z = z - read.to(z.dtype)
        columns, rows = [], []
        if prev_gradient is not None:  # E's start is the carried sum: the previous position's rank-1 term
            overlap = torch.bmm(o, state["prev.o"].transpose(1, 2).to(o.dtype))  # [B, T, 1]
            columns.append(self.step_size("output_embedding.weight").to(z.dtype) * overlap.to(z.dtype))
            rows.append(prev_gradient.to(z.dtype))  # [B, 1, V]
        for name, total in start.items():
            if name != "output_embedding.weight":  # a bias c: every position's logits move by alpha_c s_c
                columns.append(z.new_ones(*z.shape[:2], 1))
                rows.append(self.step_size(name).to(z.dtype) * total[:, None].to(z.dtype))
        at_start = torch.baddbmm(z, torch.cat(columns, 2), torch.cat(rows, 1), alpha=-1, out=out) if rows else z
        gradient_inter = {**inter, "logits": slow.transform_logits(at_start)}
        last_gradient_logits = gradient_inter["logits"][:, -1:].clone()  # before the gradient is taken in place
        return gradient_inter, last_gradient_logits, carried_read_done

    def _folded_preactivation(self, o: torch.Tensor, start: Dict[str, torch.Tensor]) -> torch.Tensor:
        """Outside autograd: ``z = o (E - alpha_E S)^T + c`` ``[B, T, V]`` (eq. 1), the slow z minus E's read of its
        carried sum ``S = start[E] [B, V, D]``, in one product per batch row with the fast weights written out into a
        scratch matrix kept between calls (a fresh ``[V, D]`` tensor would cost more in page faults than the product
        it saves: SmolLM2's, by hand, 78 ms fresh against 15 ms into the scratch; the head holds one more copy of
        E). In float32 (or float64) only: E - alpha_E S in a 16-bit dtype would round the update away, so there the
        slow z and the read stay two products."""
        weight, bias = self.slow._output_layer()
        S = start["output_embedding.weight"]
        if weight.dtype != S.dtype or weight.dtype not in (torch.float32, torch.float64):
            return self.slow.output_preactivation(o)
        scratch = self._fold_scratch
        if (scratch is None or scratch.shape != weight.shape or scratch.dtype != weight.dtype
                or scratch.device != weight.device):
            scratch = self._fold_scratch = torch.empty_like(weight)
        alpha = float(self.step_size("output_embedding.weight"))
        rows = []
        for b in range(o.shape[0]):
            torch.add(weight, S[b], alpha=-alpha, out=scratch)
            rows.append(dense_linear(o[b].to(weight.dtype), scratch, bias))
        return rows[0][None] if len(rows) == 1 else torch.stack(rows)

    def _forward_by_segments(self, hidden_states, input_ids, attention_mask, cache_layer, logits_to_keep,
                             return_hidden):
        """``forward`` with ``gradient_point="segment_start"``: the call cut where segments of ``segment_length``
        positions (counted from the start of the text) begin, each piece one ``_forward`` whose per-token gradients
        are taken at its segment start's fast weights. The result does not depend on how a text is split into
        calls: the state carries the segment start's sums while a segment is unfinished."""
        B, T = self._check_inputs(hidden_states, input_ids, attention_mask)
        state, writable = cache_layer.producer_states() if cache_layer is not None else ({}, frozenset())
        state = dict(state or {})
        mask = None if attention_mask is None else attention_mask[:, -T:]
        done = int(state["segment.tokens"][0]) if "segment.tokens" in state else 0  # positions of the segment so far
        outs, p = [], 0
        while p < T:
            piece = slice(p, p + min(T - p, self.segment_length - done))
            piece_mask = None if mask is None else mask[:, piece]
            prev_gradient, start = None, {}  # inside slow_only() (nothing active): the slow head, no sums
            if self._active and done == 0:  # a segment begins: the carried sums and the last position's gradient
                keep = (piece.stop - piece.start) % self.segment_length != 0  # the segment goes on after the piece
                start, prev_gradient = self._segment_start_sums(state, input_ids[:, piece], piece_mask,
                                                                hidden_states.dtype, with_matrix=keep)
            elif self._active:
                start = {key[len("start.") :]: t for key, t in state.items() if key.startswith("start.")}
            out, state, writable = self._forward(
                hidden_states[:, piece], input_ids[:, piece], piece_mask, state or None, 0, True, return_hidden,
                frozenset(writable), start=start, prev_gradient=prev_gradient,
            )
            done = (done + piece.stop - piece.start) % self.segment_length
            if done:  # the segment goes on: keep its start for the next call
                state.update({f"start.{name}": t for name, t in start.items()})
            state["segment.tokens"] = torch.full((B,), done, dtype=torch.long, device=hidden_states.device)
            outs.append(out)
            p = piece.stop
        if cache_layer is not None:
            cache_layer.set_states(state, T, writable)
        return torch.cat(outs, 1)[:, logits_to_keep_index(logits_to_keep)]

    def _segment_start_sums(
        self, state: Dict[str, torch.Tensor], input_ids, mask, dtype, with_matrix: bool = True
    ) -> Tuple[Dict[str, torch.Tensor], Optional[torch.Tensor]]:
        """The sums of the per-token gradients of every segment before the one that begins with `input_ids` ``[B, t]``
        (``{name: [B, V, D] or [B, V]}``, detached): the carried sums plus the gradient of the previous call's last
        position (the last of the segment that ended, its label ``input_ids[:, 0]``) at its own gradient point, whose
        logits the state keeps; and that gradient dCE/dz ``[B, 1, V]``. ({}, None) at the start of a text. Without
        `with_matrix`, E's entry is the carried sum itself, its rank-1 term ``g_prev^T o_prev`` left to the reader
        (``_forward``'s `prev_gradient`): no new ``[B, V, D]`` tensor where the segment's start need not be kept."""
        if "prev.o" not in state:
            return {}, None
        prev_weights, _ = _teaching_weights(state, mask, dtype)
        prev = {"o": state["prev.o"], "logits": state["prev.logits"]}
        g = self.slow.per_token_gradients(prev, input_ids[:, :1], prev_weights, 0)["logits"]  # dCE/dz, [B, 1, V]
        if self.fast_vocabulary == "seen":  # the rows its entry (0 of this call's values) may change, as there
            first_mask = None if mask is None else mask[:, :1]
            g = SeenVocabulary(state, input_ids[:, :1], first_mask, self.slow.vocab_size).restrict(g)
        sums = {}
        for name in self.fast_parameter_names:
            carried = state.get(f"sum.{name}")
            if name == "output_embedding.weight" and not with_matrix and carried is not None:
                sums[name] = carried
                continue
            update = g.transpose(1, 2) @ state["prev.o"].to(g.dtype) if name == "output_embedding.weight" else g[:, 0]
            sums[name] = (update if carried is None else carried + update.to(carried.dtype)).detach()
        return sums, (None if with_matrix or "sum.output_embedding.weight" not in state else g.detach())

    def _read_sum(self, o: torch.Tensor, sums: Dict[str, torch.Tensor]) -> Optional[torch.Tensor]:
        """``alpha_E o S^T`` ``[B, T, V]`` for E's sum `S` in `sums` (``o [B, T, D]``), or None without one."""
        total = sums.get("output_embedding.weight")
        if total is None:
            return None
        alpha = self.step_size("output_embedding.weight").to(total.dtype)
        if torch.is_grad_enabled():
            return alpha * torch.bmm(o.to(total.dtype), total.transpose(1, 2))
        # outside autograd oneDNN's matmul (fwp_kernels.dense_linear), about twice MKL's speed on this AMD CPU
        return torch.stack([dense_linear(o[b].to(total.dtype), total[b]) for b in range(o.shape[0])]).mul_(alpha)

    def _gradient_terms(self, inter, input_ids, mask, state: State, compute_dtype, in_place: bool):
        """Per-token gradients (the grad L_i of eqs. 1-2) of the positions whose label is known: the previous call's
        last position (label ``input_ids[:, 0]``) and the new ones but the last (label ``input_ids[:, j + 1]``).
        Returns (keys, values) of the linear attentions, ``[B, T, *]``, entry t holding position t - 1."""
        keys: Dict[str, torch.Tensor] = {}
        values: Dict[str, torch.Tensor] = {}
        depth, slow = self._gradient_depth, self.slow
        if depth < 0:
            return keys, values
        dtype = inter["h"].dtype
        logits_gradient = "logits" in self._value_names
        prev = None
        prev_weights, weights = _teaching_weights(state, mask, dtype)
        if prev_weights is not None:
            prev = {key[len("prev.") :]: t for key, t in state.items()
                    if key.startswith("prev.") and key != "prev.mask"}
        if prev is not None and slow.merge_previous_position:
            # One backward for the positions [previous, 0, ..., T-2], whose labels are exactly input_ids: entry t of
            # every key and value then holds position t - 1 (the shift of `_shift_in`) without a second call.
            B, T = input_ids.shape
            new_weights = weights if weights is not None else prev_weights.new_ones(B, T - 1)
            weights = torch.cat([prev_weights, new_weights], 1)
            shifted = {key: _shift_in(t[:, :-1], prev[key]) for key, t in inter.items() if key in prev}
            grads = slow.per_token_gradients(
                shifted, input_ids, weights, depth, logits_gradient=logits_gradient, compute_dtype=compute_dtype
            )
            for name in self.fast_parameter_names:
                key_name, value_name = GRADIENT_TERMS[name]
                values.setdefault(value_name, _as_value(value_name, grads[value_name], dtype))
                if key_name is not None:
                    keys.setdefault(key_name, shifted[key_name])
            return keys, values
        grads = slow.per_token_gradients(
            _slice(inter, slice(None, -1)), input_ids[:, 1:], weights, depth, logits_gradient=logits_gradient,
            overwrite_logits=in_place, compute_dtype=compute_dtype,
        )
        prev_grads = None
        if prev is not None:
            prev_grads = slow.per_token_gradients(
                prev, input_ids[:, :1], prev_weights, depth, logits_gradient=logits_gradient,
                compute_dtype=compute_dtype
            )
        for name in self.fast_parameter_names:
            key_name, value_name = GRADIENT_TERMS[name]
            if value_name not in values:
                values[value_name] = _shift_in(
                    _as_value(value_name, grads[value_name], dtype),
                    prev_grads and _as_value(value_name, prev_grads[value_name], dtype),
                )
            if key_name is not None and key_name not in keys:
                keys[key_name] = _shift_in(inter[key_name][:, :-1], prev and prev[key_name])
        return keys, values

    def _seen_output_gradient_terms(self, inter, input_ids, mask, state: State, seen: SeenVocabulary):
        """``_gradient_terms`` where only output-layer parameters are fast and fast_vocabulary="seen", outside
        autograd: dCE/dz of the positions [previous, 0, ..., T-2] computed on ``seen.columns`` only (``[B, T, n]``,
        restricted), from the slow logits, with no ``[B, T, V]`` tensor; the key of E is o, shifted the same way."""
        slow, columns = self.slow, seen.columns
        B, T = input_ids.shape
        prev_weights, new_weights = _teaching_weights(state, mask, inter["o"].dtype)
        if new_weights is None:
            new_weights = inter["o"].new_ones(B, T - 1)
        new = slow.logits_gradient_columns(inter["logits"][:, :-1], input_ids[:, 1:], new_weights, columns)
        first = first_key = None
        if prev_weights is not None:
            prev_logits = state["prev.logits"] if "prev.logits" in state else slow.output_logits(state["prev.o"])
            first = slow.logits_gradient_columns(prev_logits, input_ids[:, :1], prev_weights, columns)
            first_key = state["prev.o"]
        values = {"logits": seen.restrict_columns(_shift_in(new, first))}
        keys = {"o": _shift_in(inter["o"][:, :-1], first_key)} if "output_embedding.weight" in self._active else {}
        return keys, values

    def _fast_hidden_layer(self, hidden_states: torch.Tensor, updates: _FastUpdates) -> torch.Tensor:
        """The hidden layer with fast U, a, W, b and LayerNorm: ``o_t [B, T, D]``."""
        slow = self.slow
        h = z2 = hidden_states
        if slow.has_mlp:
            z1 = updates.subtract(updates.subtract(slow.up_proj(h), "up_proj.weight", h), "up_proj.bias")
            r = F.relu(z1)
            s = r * r
            z2 = updates.subtract(updates.subtract(slow.down_proj(s), "down_proj.weight", s), "down_proj.bias")
        n, _ = layer_normalize(z2, slow.norm.eps, slow.rms_norm)
        o = n * updates.subtract(slow.norm.weight, "norm.weight")
        if slow._norm_bias() is not None:
            o = o + updates.subtract(slow.norm.bias, "norm.bias")
        if slow.residual:
            o = o + h
        return o

    def _fast_logits(self, o, inter, preactivation, updates: _FastUpdates, keep, output_state: bool):
        """(the fast logits of the kept positions, the last position's slow logits or None): the output layer with
        fast E and output biases, applied to z before the logit transform."""
        slow = self.slow
        last_slow_logits = None
        if preactivation is None:  # the hidden layer or E is fast
            o_keep = o[:, keep]
            if output_state and o_keep.shape[1] == 1:
                # A decode step: the fast z and the last position's slow one (for its gradient in the next call) in
                # one matmul, so that E is read from memory once for both.
                both = slow.output_preactivation(torch.cat([o_keep, inter["o"][:, -1:]], 1))
                z, last_slow_logits = both[:, :1].contiguous(), slow.transform_logits(both[:, 1:])
            else:
                z = slow.output_preactivation(o_keep)
                if output_state:  # the last position's slow logits, for its gradient in the next call
                    last_slow_logits = slow.output_logits(inter["o"][:, -1:])
        else:
            z = preactivation[:, keep]
            last_slow_logits = inter["logits"][:, -1:]
            if not torch.is_grad_enabled():  # z is written in place below: keep the last slow logits as they are
                last_slow_logits = last_slow_logits.clone()
        if not torch.is_grad_enabled():  # every output-layer correction in one pass, running sums in place
            return slow.transform_logits(updates.subtract_output_layer_(z, o[:, keep], keep)), last_slow_logits
        z = updates.subtract(z, "output_embedding.weight", o, keep)
        z = updates.subtract(updates.subtract(z, "output_embedding.bias", keep=keep), "output_bias", keep=keep)
        return slow.transform_logits(z), last_slow_logits

    def _check_inputs(self, hidden_states, input_ids, attention_mask) -> Tuple[int, int]:
        if (not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 3
                or hidden_states.shape[-1] != self.slow.hidden_size):
            raise ValueError(
                f"`hidden_states` must be [batch, seq_len, {self.slow.hidden_size}], "
                f"got {getattr(hidden_states, 'shape', type(hidden_states))}"
            )
        B, T = hidden_states.shape[:2]
        if T == 0:
            raise ValueError("`hidden_states` must hold at least one position")
        if input_ids is None:
            raise ValueError("The FWL head needs `input_ids`: the next token of each position is its training label")
        if input_ids.dim() != 2 or tuple(input_ids.shape) != (B, T):
            raise ValueError(f"`input_ids` must be [batch, seq_len] = {(B, T)}, got {tuple(input_ids.shape)}")
        if input_ids.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"`input_ids` must be an integer tensor, got {input_ids.dtype}")
        if attention_mask is not None and (
            attention_mask.dim() != 2 or attention_mask.shape[0] != B or attention_mask.shape[1] < T
        ):
            raise ValueError(
                f"`attention_mask` must be a 2-D padding mask [batch, >= seq_len] with batch = {B}, seq_len = {T}, "
                f"got {tuple(attention_mask.shape)}"
            )
        return B, T


def decay_split_dependence(head: Optional["FWLHead"]) -> Optional[str]:
    """Why a model with FWL head `head` gives outputs that depend on how tokens are split into forward passes, or None:
    a decaying head (``fwl_decay_init``) decays its carried update at every pass (segment) boundary."""
    if head is not None and head.decay is not None:
        return ("its FWL head decays the carried fast-weight update at forward-pass (segment) boundaries "
                "(`fwl_decay_init`); a model without decay supports it")
    return None


def init_fwl_weights(module: nn.Module) -> None:
    """The FWL's share of a model's ``_init_weights``, after transformers' generic rules (which draw U and W from
    N(0, initializer_range)): the FWL modules' ``reset_parameters``, the one definition of their initial values. They
    draw nothing at random and skip loaded tensors, so that applying them more than once is harmless; ``FWLHead``'s
    covers the whole head because transformers skips custom modules without a parameter of their own (a slow head
    whose output layer is shared), which would leave a residual head's LayerNorm gain at 1."""
    if isinstance(module, (FWLSlowHead, FWLHead, SegmentDecay)):
        module.reset_parameters()


def _as_value(value_name: str, grad: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A per-token gradient as a value of the linear attentions: in `dtype` (the hidden states'), except dCE/dz outside
    autograd, which stays in the dtype it was computed in (``gradient_dtype``) for ``subtract_output_layer_``."""
    return grad if value_name == "logits" and not torch.is_grad_enabled() else grad.to(dtype)


def _teaching_weights(
    state: State, mask: Optional[torch.Tensor], dtype: torch.dtype
) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """The loss weights of the positions whose per-token gradient a call computes: the previous call's last position
    ``[B, 1]`` (None at the start of a text) and this call's positions 0..T-2 ``[B, T - 1]`` (None without a
    mask: all 1). A position teaches only if it and the next position, its label, are tokens."""
    prev_weights = None
    if state is not None and "prev.h" in state:
        prev_weights = state["prev.mask"].to(dtype)
        if mask is not None:
            prev_weights = prev_weights * mask[:, :1]
    return prev_weights, (None if mask is None else mask[:, :-1] * mask[:, 1:])


def _shift_in(new: torch.Tensor, first: Optional[torch.Tensor]) -> torch.Tensor:
    """``[B, T - 1, *]`` rows of positions 0..T-2, preceded by the previous call's last position (zeros at the
    start) -> ``[B, T, *]``: entry t holds position t - 1, so a sum over entries <= t is a sum over positions < t."""
    if first is None:
        first = new.new_zeros(new.shape[0], 1, *new.shape[2:])
    return torch.cat([first.to(new.dtype), new], dim=1)


def _slice(inter: Intermediates, index: slice) -> Intermediates:
    return {key: t[:, index] for key, t in inter.items()}


class FWLCache(RollbackMixin, Cache):
    """Cache of ``FWLForCausalLM``: the base model's cache plus the FWL state, both constant per token for the FWL.

    ``base_cache`` is whatever the base model uses (a ``DynamicCache`` of keys and values, a ``FastWeightCache``...);
    the FWL state lives in one ``FastWeightCacheLayer``, ``fwl_layer``, which ``FWLHead`` reads and writes: the running
    gradient sums ``sum.<parameter>`` (``[B, Dv, Dk]`` for matrices, ``[B, Dv]`` for vectors) and the last position's
    slow pass ``prev.<key>`` (``[B, 1, *]``), whose gradient is added once its label (the next token) arrives. Beam
    search reorders both. While recording (assisted decoding), ``crop(-n)`` rolls back both: the base cache by its
    own ``crop`` (a KV cache drops positions; a ``FastWeightCache`` replays), the FWL state as ``RollbackMixin``.
    """

    def __init__(self, base_cache: Optional[Cache] = None) -> None:
        super().__init__(layers=[FastWeightCacheLayer()])
        self.base_cache = base_cache
        self._init_recording()

    def set_base_cache(self, base_cache: Cache) -> None:
        """The base model's cache, once its first forward pass has made one (recording too if this cache records)."""
        self.base_cache = base_cache
        if self.record_past and hasattr(base_cache, "activate_past_recording"):
            self._activate_base_recording()

    def activate_past_recording(self, recurrent_states_to_keep: Optional[int] = None) -> None:
        super().activate_past_recording(recurrent_states_to_keep)
        if self.base_cache is not None:
            self._activate_base_recording()

    def _activate_base_recording(self) -> None:
        # transformers' caches of 5.25 take the count as a keyword; earlier ones take no argument
        if self.recurrent_states_to_keep is None:
            self.base_cache.activate_past_recording()
        else:
            self.base_cache.activate_past_recording(recurrent_states_to_keep=self.recurrent_states_to_keep)

    @property
    def is_croppable(self) -> bool:
        return self.record_past and (self.base_cache is None or self.base_cache.is_croppable)

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)  # the FWL state first: it checks the request
        if self.base_cache is not None:
            self.base_cache.crop(tokens_to_remove)

    @property
    def fwl_layer(self) -> FastWeightCacheLayer:
        return self.layers[0]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        if self.base_cache is not None:
            return self.base_cache.get_seq_length(layer_idx)
        return self.fwl_layer.get_seq_length()

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def batch_size(self) -> int:
        size = self.fwl_layer.batch_size
        return size if size != -1 or self.base_cache is None else self.base_cache.batch_size

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.base_cache is not None:
            self.base_cache.reorder_cache(beam_idx)
        super().reorder_cache(beam_idx)
        self._drop_checkpoints()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.base_cache is not None:
            self.base_cache.batch_select_indices(indices)
        super().batch_select_indices(indices)
        self._drop_checkpoints()

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.base_cache is not None:
            self.base_cache.batch_repeat_interleave(repeats)
        super().batch_repeat_interleave(repeats)
        self._drop_checkpoints()

    def reset(self) -> None:
        if self.base_cache is not None:
            self.base_cache.reset()
        super().reset()
        self._drop_checkpoints()
