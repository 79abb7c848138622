"""Fast-weight layers: what distinguishes one model of the family from another.

Every layer has the same interface, called by the shared backbone (``modeling_fwp.FastWeightBlock``)::

    forward(hidden_states [B, T, D], state: dict | None, token_mask [B, T] | None) -> (output [B, T, D], state)

``state`` is the layer's recurrent state (a dict of batch-first tensors, see ``FastWeightCache``);
``token_mask`` is 1.0 for real tokens and 0.0 for padding: padded positions must never write the state.
New layers register themselves in ``FAST_WEIGHT_LAYERS`` under the name a config's ``fast_weight_layer``
attribute selects.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from fwp_kernels import cpu_ops_apply, delta_rule, dense_linear, dense_linears, gated_delta_rule, linear_attention
from fwp_kernels import normalize_rows, short_conv, short_conv_step
from fwp_kernels import TOKEN_STEP_FEATURE_MAPS, fast_weight_token_step, token_step_applies
from torch import nn
from transformers import initialization as init


from .feature_maps import FeatureMap

FAST_WEIGHT_LAYERS: Dict[str, type] = {}
State = Optional[Dict[str, torch.Tensor]]


def register_fast_weight_layer(name: str) -> Callable[[type], type]:
    """Class decorator: makes a fast-weight layer selectable with ``config.fast_weight_layer = name``."""

    def wrap(cls):
        FAST_WEIGHT_LAYERS[name] = cls
        return cls

    return wrap


def split_heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``[B, T, H * d] -> [B, H, T, d]``."""
    B, T, _ = x.shape
    return x.view(B, T, num_heads, -1).transpose(1, 2)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """``[B, H, T, d] -> [B, T, H * d]``."""
    B, H, T, d = x.shape
    return x.transpose(1, 2).reshape(B, T, H * d)


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, state dict, initialisation; PEFT and hooks see an ``nn.Linear``) whose forward
    outside autograd on CPU runs ``fwp_kernels.dense_linear``: a decode step's single row streams the weight once at
    the memory bandwidth, more rows take oneDNN's matmul (faster than MKL's sgemm on AMD CPUs). Training, other
    devices and dtypes run ``F.linear``. The backbone's and the fast-weight layers' projections are this class."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return dense_linear(input, self.weight, self.bias)


def unhooked(module: nn.Module, kind: type) -> bool:
    """Whether `module` is exactly a `kind` (no subclass, no wrapper such as PEFT's or accelerate's) whose forward
    nothing replaced or hooks: a fused op may then stand in for its call."""
    return (type(module) is kind and not (module._forward_hooks or module._forward_pre_hooks)
            and "forward" not in module.__dict__)


def weights_of(*modules: nn.Module) -> list:
    """``[m.weight for m in modules]``, read from their parameter dicts: a parameter's or a submodule's attribute lookup
    misses the instance first and ends in ``nn.Module.__getattr__`` (0.5-1.5 us each here, where a dict read takes 0.1
    us), and a decode step's fused path makes dozens of them per layer and token."""
    return [m._parameters["weight"] for m in modules]


def plain_linears(*layers: nn.Module) -> bool:
    """Whether all `layers` are this file's bias-free ``Linear``, ``unhooked``: their products may be fused."""
    for layer in layers:  # a plain loop: this runs several times per layer and token
        if not unhooked(layer, Linear) or layer._parameters["bias"] is not None:  # (a dict read, as weights_of)
            return False
    return True


def project(x: torch.Tensor, *layers: nn.Linear) -> Tuple[torch.Tensor, ...]:
    """``tuple(layer(x) for layer in layers)`` for projections of one input (a layer's q, k, v, beta). Outside
    autograd, where all are ``plain_linears`` (no hook or wrapper, such as PEFT's or accelerate's, touched them): one
    ``fwp_kernels.dense_linears`` call, which streams all their weights in one pass in a bfloat16 decode step."""
    weights = [layer.weight for layer in layers]
    tracked = torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in weights))
    if not tracked and plain_linears(*layers):
        return dense_linears(x, weights)
    return tuple(layer(x) for layer in layers)


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension, ``x / sqrt(mean(x^2) + eps) * w``, computed in float32 (weight
    only, no bias; Zhang and Sennrich 2019)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_ops_apply(x, self.weight):  # inference on CPU: the same arithmetic in one pass (9 torch ops)
            return normalize_rows(x, self.weight, self.eps, mean_square=True)
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight.float()).to(x.dtype)


class CausalConv1d(nn.Conv1d):
    """Short causal depthwise convolution over time, without bias: ``y_t = sum_{i<K} w_i * x_{t-K+1+i}`` per channel.

    ``forward(x [B, T, C], cache [B, C, K-1] | None, token_mask [B, T] | None) -> (y [B, T, C], cache [B, C, K-1])``.
    ``cache`` holds the last ``K - 1`` real inputs of earlier calls (zeros before the first token), so a decode step
    continues a prefill exactly. Padded positions are skipped, not convolved: each row's real tokens are packed
    together before the convolution (as if the padding were not there, wherever it is) and the outputs unpacked to
    their positions; the outputs at padded positions are of no use.
    """

    def __init__(self, channels: int, kernel_size: int) -> None:
        super().__init__(channels, channels, kernel_size, groups=channels, bias=False)

    def forward(
        self, x: torch.Tensor, cache: Optional[torch.Tensor] = None, token_mask: Optional[torch.Tensor] = None
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        B, T, C = x.shape
        width = self.kernel_size[0] - 1
        cache = x.new_zeros(B, C, width) if cache is None else cache.to(x.dtype)
        if token_mask is None and cpu_ops_apply(x, cache, self.weight):  # CPU inference: one pass, channels last
            if T == 1:  # a decode step: one weighted sum per channel, not six ops
                y, cache = short_conv_step(x.reshape(B, C), cache, self.weight.view(C, -1))
                return y.view(B, 1, C), cache
            return short_conv(x, cache, self.weight.view(C, -1))
        x = x.transpose(1, 2)  # [B, C, T]
        if token_mask is None:
            window = torch.cat([cache, x], dim=-1)  # [B, C, K - 1 + T]
            if T == 1:  # a decode step: one weighted sum per channel (a conv1d call costs ~10x more here, measured)
                acc = torch.promote_types(x.dtype, torch.float32)  # float32 sums for bf16, float64 stays float64
                y = (window.to(acc) * self.weight[:, 0].to(acc)).sum(-1, keepdim=True).to(x.dtype)
            else:
                y = F.conv1d(window, self.weight, groups=self.groups)
            return y.transpose(1, 2), window[..., T:].clone()  # (a view would keep the whole window alive)
        real = token_mask > 0
        # slot of each real token among its row's real tokens; padded positions go to a slot T that is dropped
        slot = torch.where(real, real.long().cumsum(-1) - 1, torch.full_like(real, T, dtype=torch.long))
        packed = x.new_zeros(B, C, T + 1).scatter_(2, slot[:, None, :].expand(B, C, T), x)[..., :T]
        window = torch.cat([cache, packed], dim=-1)
        y = F.conv1d(window, self.weight, groups=self.groups).gather(
            2, slot.clamp_max(T - 1)[:, None, :].expand(B, C, T))
        # the new cache: the last K - 1 entries of [cache, the row's real tokens]
        last = real.sum(-1)[:, None] + torch.arange(width, device=x.device)
        return y.transpose(1, 2), window.gather(2, last[:, None, :].expand(B, C, width))


QK_L2_EPS = 1e-6  # the L2 normalisation of q and k: x / sqrt(|x|^2 + eps) (flash-linear-attention's)
CONV_STATE_NAMES = ("conv_q", "conv_k", "conv_v")  # the short convolutions' entries of a layer's state


def l2_normalize(x: torch.Tensor, eps: float = QK_L2_EPS) -> torch.Tensor:
    """``x / sqrt(|x|^2 + eps)`` over the last dimension, computed in float32."""
    if cpu_ops_apply(x):  # inference on CPU: the same arithmetic in one pass
        return normalize_rows(x, None, eps, mean_square=False)
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)


OUTPUT_GATES = {"silu": F.silu, "sigmoid": torch.sigmoid}


def global_module_hooks() -> bool:
    """Whether any global module hook is registered (``torch.nn.modules.module.register_module_forward_hook`` and
    its pre-hook): a fused decode step would skip the module calls it expects."""
    module = torch.nn.modules.module
    return bool(getattr(module, "_global_forward_hooks", None) or getattr(module, "_global_forward_pre_hooks", None))


@register_fast_weight_layer("linear")
class FastWeightLinearAttention(nn.Module):
    """Linear Transformer / Delta Net layer: slow net feedforward, fast net linear (Schlag et al. 2021).

    Slow projections (eq. 4): ``k_t, v_t, q_t = W_k x_t, W_v x_t, W_q x_t`` per head; for the delta rule also
    ``beta_t = sigmoid(W_beta x_t)`` (eq. 21). The fast weight W [Dv, Dk] is written with the sum rule
    (eq. 17) or the delta rule (eqs. 20-24: ``W_t = W_{t-1} + beta_t (v_t - v_bar_t) phi(k_t)^T``,
    ``v_bar_t = W_{t-1} phi(k_t)``) and read with ``y_t = W_t phi(q_t)`` (eq. 25).

    Attention normalisation (sec. 3.2 eqs. 18-19 for the sum rule; sec. 4.2 eqs. 26-28 for the delta rule), with
    ``z_t = z_{t-1} + phi(k_t)``, ``z_0 = 0``: the output is ``y_t = W_t phi(q_t) / (z_t . phi(q_t))`` and, for the
    delta rule, the retrieved value is normalised as well, ``v_bar_t = W_{t-1} phi(k_t) / (z_{t-1} . phi(k_t))``
    with ``v_bar_1 = 0`` (eq. 27). A zero denominator gives 0 (``v_bar_t``, ``y_t``): its numerator is 0 too, since
    the feature map is non-negative and every column of W that ``phi(k_t)`` (or ``phi(q_t)``) reads is then zero.

    Later Delta Nets' options (``FastWeightConfig``): a short causal convolution on q, k, v (``q_conv1d``, ...), a
    value activation, L2-normalised and scaled queries and keys, beta without bias or doubled, an output RMSNorm per
    head (``o_norm``), gated by ``act(W_g x)`` (``g_proj``).

    State: ``fast_weight [B, H, Dv, Dk]``, with attention normalisation ``normalizer [B, H, 1, Dk]`` (z), with the
    convolution ``conv_q``, ``conv_k`` ``[B, H * head_dim, K - 1]`` and ``conv_v`` ``[B, H * Dv, K - 1]``.
    """

    def __init__(self, config, layer_idx: int = 0) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_value_heads = getattr(config, "num_v_heads", None) or self.num_heads
        self.head_dim = config.head_dim
        self.value_head_dim = config.value_head_dim
        self.update_rule = config.update_rule
        self.attention_normalization = config.attention_normalization
        self.kernel_mode = config.kernel_mode
        self.chunk_size = config.chunk_size
        self.value_activation = config.value_activation
        self.qk_l2_normalization = config.qk_l2_normalization
        self.query_scale = config.feature_dim ** -0.5 if config.query_scaling else None
        self.allow_neg_eigval = config.allow_neg_eigval
        key_dim, value_dim = self.num_heads * self.head_dim, self.num_value_heads * self.value_head_dim
        self.q_proj = Linear(config.hidden_size, key_dim, bias=False)
        self.k_proj = Linear(config.hidden_size, key_dim, bias=False)
        self.v_proj = Linear(config.hidden_size, value_dim, bias=False)
        self.beta_proj = (
            Linear(config.hidden_size, self.num_value_heads, bias=config.beta_bias)
            if self.update_rule == "delta" else None
        )
        self.short_conv_size = config.short_conv_size
        if self.short_conv_size:
            self.q_conv1d = CausalConv1d(key_dim, self.short_conv_size)
            self.k_conv1d = CausalConv1d(key_dim, self.short_conv_size)
            self.v_conv1d = CausalConv1d(value_dim, self.short_conv_size)
        self.o_norm = RMSNorm(self.value_head_dim, eps=config.layer_norm_eps) if config.output_norm else None
        self.g_proj = Linear(config.hidden_size, value_dim, bias=False) if config.output_gate else None
        self.output_gate_activation_name = config.output_gate_activation
        self.output_gate_activation = OUTPUT_GATES[config.output_gate_activation]
        self.o_proj = Linear(value_dim, config.hidden_size, bias=False)
        self.feature_map = FeatureMap(config)
        self._register_load_state_dict_pre_hook(split_fused_qkv_projection)

    def _project(
        self, hidden_states: torch.Tensor, state: Dict[str, torch.Tensor], token_mask: Optional[torch.Tensor]
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor], Dict[str, torch.Tensor]]:
        """q, k ``[B, H, T, head_dim]`` and v ``[B, Hv, T, Dv]`` (eq. 4), through the short convolution when there
        is one, and ``W_beta x [B, T, Hv]`` (None for the sum rule); returns the convolution's new cache entries as
        well."""
        beta_proj = () if self.beta_proj is None else (self.beta_proj,)
        q, k, v, *beta_logits = project(hidden_states, self.q_proj, self.k_proj, self.v_proj, *beta_proj)
        conv_states = {}
        if self.short_conv_size:
            q, conv_states["conv_q"] = self.q_conv1d(q, state.get("conv_q"), token_mask)
            k, conv_states["conv_k"] = self.k_conv1d(k, state.get("conv_k"), token_mask)
            v, conv_states["conv_v"] = self.v_conv1d(v, state.get("conv_v"), token_mask)
        if self.value_activation == "silu":
            v = F.silu(v)
        return (split_heads(q, self.num_heads), split_heads(k, self.num_heads), split_heads(v, self.num_value_heads),
                beta_logits[0] if beta_logits else None, conv_states)

    def _query_key_features(self, q: torch.Tensor, k: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """phi(q), phi(k), then the optional L2 normalisation and query scaling; q and k repeated for grouped value
        heads (value head j reads query/key head ``j // (Hv / H)``)."""
        # eqs. 19 / 28 divide by z . phi(q): a positive factor of phi(q) cancels (FAVOR+ computes it without underflow)
        q, k = self.feature_map(q, rescale_dims=-1 if self.attention_normalization else None), self.feature_map(k)
        if self.qk_l2_normalization:
            q, k = l2_normalize(q), l2_normalize(k)
        if self.query_scale is not None:
            q = q * self.query_scale
        if self.num_value_heads != self.num_heads:
            group = self.num_value_heads // self.num_heads
            q, k = q.repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1)
        return q, k

    def _beta(self, beta_logits: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """``beta [B, Hv, T] = sigmoid(W_beta x)`` (eq. 21) from ``W_beta x [B, T, Hv]``, doubled with
        ``allow_neg_eigval``; None for the sum rule."""
        if beta_logits is None:
            return None
        beta = torch.sigmoid(beta_logits).transpose(1, 2)
        return beta * 2.0 if self.allow_neg_eigval else beta

    def _recurrence(
        self, q, k, v, beta, hidden_states, state, token_mask
    ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        """The fast weight update and read-out: ``(out [B, Hv, T, Dv], new state)``."""
        kernel_kwargs = dict(output_final_state=True, mode=self.kernel_mode, chunk_size=self.chunk_size)
        if self.update_rule == "delta":
            if self.attention_normalization:
                v, beta = attention_normalized_delta_inputs(k, v, beta, state.get("normalizer"))
            out, fast_weight = delta_rule(q, k, v, beta, initial_state=state.get("fast_weight"), **kernel_kwargs)
        else:
            out, fast_weight = linear_attention(q, k, v, initial_state=state.get("fast_weight"), **kernel_kwargs)
        new_state = {"fast_weight": fast_weight}
        if self.attention_normalization:
            # z_t . phi(q_t) is linear attention with a constant value 1 (eqs. 18-19, 26, 28).
            ones = v.new_ones(v.shape[:-1] + (1,))
            denominator, normalizer = linear_attention(q, k, ones, initial_state=state.get("normalizer"),
                                                       **kernel_kwargs)
            out = out / torch.where(denominator > 0, denominator, torch.ones_like(denominator))
            new_state["normalizer"] = normalizer
        return out, new_state

    def _output(self, out: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """``o_proj`` of the heads' outputs ``[B, Hv, T, Dv]``, after the optional (gated) output RMSNorm."""
        out = out.transpose(1, 2)  # [B, T, Hv, Dv]
        if self.o_norm is not None:
            out = self.o_norm(out)
        if self.g_proj is not None:
            gate = self.g_proj(hidden_states).view(out.shape)
            out = out * self.output_gate_activation(gate)
        return self.o_proj(out.reshape(out.shape[0], out.shape[1], -1))

    def _short_convs(self) -> Tuple[CausalConv1d, ...]:
        """The short convolutions of q, k, v, in that order (none without ``short_conv_size``)."""
        modules = self._modules  # (dict reads, as weights_of: this runs on every decode step)
        return (modules["q_conv1d"], modules["k_conv1d"], modules["v_conv1d"]) if self.short_conv_size else ()

    def _token_decay(self) -> Optional[Tuple[nn.Linear, torch.Tensor, torch.Tensor]]:
        """The gated delta rule's decay inputs ``(a_proj, A_log, dt_bias)`` for ``fast_weight_token_step``; None here
        (no decay)."""
        return None

    def _token_step_applies(self, hidden_states: torch.Tensor, state: Dict[str, torch.Tensor],
                            token_mask: Optional[torch.Tensor]) -> bool:
        """Whether this call is a decode step that ``fwp_kernels.fast_weight_token_step`` computes in one C++ call:
        one position, no padding mask, CPU inference (``token_step_applies``), a chunked mode, the options the op
        has (no attention normalisation, a feature map of its own), a float32 state, and no hook or replaced module
        among those it stands in for (convolutions, feature map, output norm)."""
        if hidden_states.shape[1] != 1 or token_mask is not None or self.attention_normalization:
            return False
        modules = self._modules  # (dict reads, as weights_of)
        feature_map, o_norm = modules["feature_map"], modules.get("o_norm")
        if self.kernel_mode not in ("auto", "chunk") or feature_map.kind not in TOKEN_STEP_FEATURE_MAPS:
            return False
        fast_weight = state.get("fast_weight")
        if fast_weight is not None and (fast_weight.dtype != torch.float32 or not fast_weight.is_cpu):
            return False
        convs = self._short_convs()
        if (not unhooked(feature_map, FeatureMap) or (o_norm is not None and not unhooked(o_norm, RMSNorm))
                or global_module_hooks()):
            return False
        for conv in convs:
            if not unhooked(conv, CausalConv1d):
                return False
        return token_step_applies(hidden_states, *weights_of(*convs))

    def token_step_projections(self) -> Tuple[nn.Linear, ...]:
        """The projections of a decode step's input, in the order ``token_step_from`` takes their outputs: q, k, v,
        then beta's, the output gate's and the decay's where the layer has them."""
        modules = self._modules  # (dict reads, as weights_of)
        decay = self._token_decay()
        layers = (modules["q_proj"], modules["k_proj"], modules["v_proj"], modules.get("beta_proj"),
                  modules.get("g_proj"), decay and decay[0])
        return tuple(m for m in layers if m is not None)

    def _token_step(self, hidden_states: torch.Tensor, state: Dict[str, torch.Tensor]
                    ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        """``forward`` of a decode step (``_token_step_applies``): one pass over the projections (``project``), the
        rest up to ``o_proj`` in one ``fwp_kernels.fast_weight_token_step`` call (``token_step_from``), the same
        arithmetic as the unfused ops (rounded where they round)."""
        mixed, new_state = self.token_step_from(project(hidden_states[:, 0], *self.token_step_projections()), state)
        return self.o_proj(mixed[:, None]), new_state

    def token_step_settings(self, state: Dict[str, torch.Tensor]) -> Dict[str, Any]:
        """The arguments of ``fwp_kernels.block_decode_step`` after the block's weights for a decode step of this layer
        from `state`: its head counts, which of beta's, the output gate's and the decay's projections it has (their
        outputs follow q, k, v in ``token_step_projections``' order), its decay parameters, states and options."""
        modules = self._modules  # (dict reads, as weights_of)
        decay, convs, o_norm = self._token_decay(), self._short_convs(), modules.get("o_norm")
        feature_map = modules["feature_map"]
        return {
            "num_heads": self.num_heads, "num_value_heads": self.num_value_heads,
            "has_beta": modules.get("beta_proj") is not None, "has_gate": modules.get("g_proj") is not None,
            "decay_parameters": decay and decay[1:], "beta_scale": 2.0 if self.allow_neg_eigval else 1.0,
            "state": state.get("fast_weight"), "conv_weights": weights_of(*convs),
            "conv_states": [state.get(name) for name in CONV_STATE_NAMES[: len(convs)]],
            "feature_map": feature_map.kind, "sum_normalization": feature_map.sum_normalization,
            "value_silu": self.value_activation == "silu", "l2_eps": QK_L2_EPS if self.qk_l2_normalization else None,
            "query_scale": self.query_scale, "norm_weight": None if o_norm is None else weights_of(o_norm)[0],
            "norm_eps": 1e-6 if o_norm is None else o_norm.eps, "gate_activation": self.output_gate_activation_name,
        }

    @staticmethod
    def token_step_state(fast_weight: torch.Tensor, conv_states: Sequence[torch.Tensor]) -> Dict[str, torch.Tensor]:
        """The layer's state after a token step: the fast weight and the convolutions' states (q's, k's, v's)."""
        return {"fast_weight": fast_weight, **dict(zip(CONV_STATE_NAMES, conv_states))}

    def token_step_from(self, projected: Tuple[torch.Tensor, ...], state: Dict[str, torch.Tensor]
                        ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        """A decode step (``_token_step_applies``) from the outputs of ``token_step_projections`` (``[B, N_g]``
        each) up to the input of ``o_proj``, in one ``fwp_kernels.fast_weight_token_step`` call: ``(out [B, Hv *
        Dv], new state)``."""
        settings = self.token_step_settings(state)
        q, k, v, *rest = projected
        beta_logits = rest.pop(0) if settings.pop("has_beta") else None
        gate = rest.pop(0) if settings.pop("has_gate") else None
        decay = settings.pop("decay_parameters")
        conv_weights = [w.view(w.shape[0], -1) for w in settings.pop("conv_weights")]
        out, fast_weight, conv_states = fast_weight_token_step(
            q, k, v, beta_logits=beta_logits, gate=gate, decay=decay and (rest[0], *decay),
            conv_weights=conv_weights, **settings,
        )
        return out, self.token_step_state(fast_weight, conv_states)

    def forward(
        self, hidden_states: torch.Tensor, state: State = None, token_mask: Optional[torch.Tensor] = None
    ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        state = state or {}
        if self._token_step_applies(hidden_states, state, token_mask):
            return self._token_step(hidden_states, state)
        q, k, v, beta_logits, conv_states = self._project(hidden_states, state, token_mask)
        q, k = self._query_key_features(q, k)
        beta = self._beta(beta_logits)
        if token_mask is not None:
            # Padded positions write nothing: phi(k) = 0 (and beta = 0) makes the update vanish.
            mask = token_mask.to(k.dtype)[:, None, :]
            k = k * mask[..., None]
            if beta is not None:
                beta = beta * mask
        out, new_state = self._recurrence(q, k, v, beta, hidden_states, state, token_mask)
        new_state.update(conv_states)
        return self._output(out, hidden_states), new_state


@register_fast_weight_layer("gated_delta")
class GatedDeltaNetLayer(FastWeightLinearAttention):
    """Gated DeltaNet layer (Yang, Kautz, Hatamizadeh 2025, "Gated Delta Networks", sec. 3): the Delta Net layer with a
    decay of the fast weight before each update, ``W_t = a_t W_{t-1} + beta_t (v_t - a_t W_{t-1} k_t) k_t^T``,
    ``a_t = exp(g_t)``, ``g_t = -exp(A_log) * softplus(W_a x_t + dt_bias)`` per value head (as in Mamba-2's
    discretisation; ``a_proj``, ``A_log``, ``dt_bias`` as flash-linear-attention names them). Value heads may be
    grouped: ``num_v_heads`` a multiple of the query/key heads. State as the Delta Net layer's (``fast_weight [B, Hv,
    Dv, Dk]`` and the convolution's entries).
    """

    def __init__(self, config, layer_idx: int = 0) -> None:
        super().__init__(config, layer_idx)
        self.a_proj = Linear(config.hidden_size, self.num_value_heads, bias=False)
        self.A_log = nn.Parameter(torch.empty(self.num_value_heads, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.empty(self.num_value_heads, dtype=torch.float32))
        self.init_fast_weight_parameters()

    @torch.no_grad()
    def init_fast_weight_parameters(self) -> None:
        """Deterministic initial decays spread over the heads: ``A`` from 1 to 16 and the step ``softplus(dt_bias)``
        from 0.001 to 0.1, log-spaced (the ranges of Mamba-2 / fla's random draws); loaded tensors are kept. Called
        here and by ``FastWeightPreTrainedModel._init_weights`` (its hook for parameters the generic rules miss)."""
        n = self.num_value_heads
        A = torch.linspace(1.0, 16.0, n)
        dt = torch.exp(torch.linspace(math.log(1e-3), math.log(0.1), n))
        init.copy_(self.A_log, torch.log(A).to(self.A_log))
        init.copy_(self.dt_bias, (dt + torch.log(-torch.expm1(-dt))).to(self.dt_bias))  # softplus^-1(dt)

    def _token_decay(self) -> Tuple[nn.Linear, torch.Tensor, torch.Tensor]:
        parameters = self._parameters  # (dict reads, as weights_of)
        return self._modules["a_proj"], parameters["A_log"], parameters["dt_bias"]

    def log_decay(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``g [B, Hv, T] = -exp(A_log) * softplus(W_a x + dt_bias)`` in float32 (``a_t = exp(g_t)`` in (0, 1])."""
        pre = self.a_proj(hidden_states).float() + self.dt_bias.float()
        return (-torch.exp(self.A_log.float()) * F.softplus(pre)).transpose(1, 2)

    def _recurrence(
        self, q, k, v, beta, hidden_states, state, token_mask
    ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        out, fast_weight = gated_delta_rule(
            q, k, v, beta, self.log_decay(hidden_states), initial_state=state.get("fast_weight"),
            output_final_state=True, mode=self.kernel_mode, chunk_size=self.chunk_size, mask=token_mask,
        )  # padded positions neither decay nor write the state (mask: g = 0, beta = 0)
        return out, {"fast_weight": fast_weight}


def split_fused_qkv_projection(state_dict: Dict[str, torch.Tensor], prefix: str, *args: Any) -> None:
    """``load_state_dict`` pre-hook: a state dict of the older layout, one fused ``qkv_proj.weight [3 H d, D]`` (rows:
    W_q, W_k, W_v), is split into ``q_proj``, ``k_proj`` and ``v_proj`` in place."""
    fused = state_dict.pop(prefix + "qkv_proj.weight", None)
    if fused is not None:
        for name, weight in zip(("q_proj", "k_proj", "v_proj"), fused.chunk(3, dim=0)):
            state_dict[f"{prefix}{name}.weight"] = weight


def attention_normalized_delta_inputs(
    k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, normalizer: Optional[torch.Tensor] = None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The delta rule's value and learning rate that make ``fwp_kernels.delta_rule`` compute eq. 27's update.

    With ``s_t = z_{t-1} . phi(k_t)`` (``z_{t-1}`` = the carried normalizer plus ``sum_{j<t} phi(k_j)``), Schlag et al.
    2021 eqs. 24 and 27 give ``W_t = W_{t-1} + beta_t (v_t - W_{t-1} phi(k_t) / s_t) phi(k_t)^T``, which is the plain
    delta rule with ``beta'_t = beta_t / s_t`` and ``v'_t = s_t v_t``. Where ``s_t = 0`` (the first token, keys so far
    all zero, a key that shares no non-zero feature with the earlier ones, a padded position) ``v_bar_t = 0`` as the
    paper defines it (``v_bar_1 = 0``); ``W_{t-1} phi(k_t)`` is 0 there too (non-negative features), so
    ``beta'_t = beta_t`` and ``v'_t = v_t`` give that update. An ``s_t`` below the smallest normal float (where
    ``1 / s_t`` could overflow) is treated the same; ``W_{t-1} phi(k_t)`` is then of that tiny size as well.

    Args:
        k: ``[B, H, T, Dk]`` feature-mapped keys (zero at padded positions).
        v: ``[B, H, T, Dv]``.
        beta: ``[B, H, T]``.
        normalizer: ``[B, H, 1, Dk]``, z after the tokens already seen, or None (``z_0 = 0``).
    Returns:
        ``(v' [B, H, T, Dv], beta' [B, H, T])`` in float32 (float64 for float64 keys), the kernels' accumulation
        dtype: ``1 / s_t`` and ``s_t v_t`` may leave float16's range.
    """
    acc = torch.promote_types(k.dtype, torch.float32)
    kf = k.to(acc)
    z_prev = F.pad(kf[:, :, :-1], (0, 0, 1, 0)).cumsum(2)  # sum_{j<t} phi(k_j)
    if normalizer is not None:
        z_prev = z_prev + normalizer.to(acc)
    s = (z_prev * kf).sum(-1)  # [B, H, T]
    s = torch.where(s >= torch.finfo(acc).tiny, s, torch.ones_like(s))
    return v.to(acc) * s[..., None], beta.to(acc) / s
