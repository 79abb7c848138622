"""The shared LM backbone of every fast-weight model, and the per-family Auto-registered classes.

All models are pre-LN stacks of ``FastWeightBlock``s (fast-weight layer + feed-forward, Schlag et al. 2021
sec. 6.3 / Irie et al. 2021 sec. 4.1); a family differs only in the fast-weight layer its config selects.
The recurrent state lives in a ``FastWeightCache``: it is what generation continues from and what the papers'
"full context" training carries across segments (gradients stopped at segment boundaries).
"""
from __future__ import annotations

import math
from functools import partial
from typing import Optional, Tuple, Union

import torch
from fwp_kernels import BlockDecodeCall, block_ops_apply, prepare_block_decode_step, reusing_cpu_buffers
from torch import nn
from transformers import GenerationMixin
from transformers.activations import ACT2FN, SiLUActivation
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from .cache_fwp import CACHE_ARGUMENT, FastWeightCache, output_cache, resolve_cache_argument
from .configuration_fwp import (
    DeltaDeltaNetConfig,
    DeltaLSTMConfig,
    DeltaMLPConfig,
    DeltaNetConfig,
    DeltaRNNConfig,
    FastWeightConfig,
    GatedDeltaNetConfig,
    LinearTransformerConfig,
    RecurrentDeltaNetConfig,
)
from .fast_weight_layers import (
    FAST_WEIGHT_LAYERS, Linear, RMSNorm, global_module_hooks, plain_linears, project, unhooked, weights_of,
)
from .feature_maps import FeatureMap
from .pretrained import StatefulPreTrainedModel, logits_to_keep_index
from .rfwp_layers import RecurrentFastWeightLayer  # noqa: F401  (registers the recurrent FWP layers)


SILU_ACTIVATIONS = (SiLUActivation, nn.SiLU)  # what ACT2FN["silu"] builds, and torch's own


class FeedForward(nn.Module):
    """Position-wise feed-forward: ``W_2 act(W_1 x + b_1) + b_2`` (``feed_forward_type="mlp"``), or SwiGLU without
    biases, ``W_d (act(W_g x) * W_u x)`` (``"swiglu"``; Shazeer 2020)."""

    def __init__(self, config: FastWeightConfig) -> None:
        super().__init__()
        swiglu = getattr(config, "feed_forward_type", "mlp") == "swiglu"
        self.gate_proj = Linear(config.hidden_size, config.intermediate_size, bias=False) if swiglu else None
        self.up_proj = Linear(config.hidden_size, config.intermediate_size, bias=not swiglu)
        self.act = ACT2FN[config.hidden_act]
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=not swiglu)
        self.dropout = nn.Dropout(config.hidden_dropout)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.gate_proj is not None:
            gate, up = project(hidden_states, self.gate_proj, self.up_proj)
            inner = self.act(gate) * up
        else:
            inner = self.act(self.up_proj(hidden_states))
        return self.down_proj(self.dropout(inner))


def block_norm(config: FastWeightConfig) -> nn.Module:
    """The norm of the blocks and the final norm: LayerNorm, or RMSNorm (``norm_type="rms_norm"``)."""
    if getattr(config, "norm_type", "layer_norm") == "rms_norm":
        return RMSNorm(config.hidden_size, eps=config.layer_norm_eps)
    return nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)


class FastWeightBlock(GradientCheckpointingLayer):
    """Pre-LN block: ``h = x + FWL(LN(x))``, ``out = h + FF(LN(h))``.

    ``forward(hidden_states [B, T, D], state=None, token_mask=None) -> (hidden_states, new_state)``. The state
    is passed in and out explicitly (not through the cache), so gradient checkpointing can replay the block.
    """

    def __init__(self, config: FastWeightConfig, layer_idx: int) -> None:
        super().__init__()
        self.fast_weight_norm = block_norm(config)
        layer_name = getattr(config, "fast_weight_layer", "linear")
        if layer_name not in FAST_WEIGHT_LAYERS:
            raise ValueError(f"`fast_weight_layer` must be one of {sorted(FAST_WEIGHT_LAYERS)}, got {layer_name!r}")
        self.fast_weight = FAST_WEIGHT_LAYERS[layer_name](config, layer_idx)
        self.ff_norm = block_norm(config)
        self.feed_forward = FeedForward(config)
        self.dropout = nn.Dropout(config.hidden_dropout)

    def forward(self, hidden_states, state=None, token_mask=None):
        plan = self._decode_plan(hidden_states, state, token_mask)
        if plan is not None:
            return self._decode_step(hidden_states, state, *plan)
        update, new_state = self.fast_weight(self.fast_weight_norm(hidden_states), state=state, token_mask=token_mask)
        hidden_states = hidden_states + self.dropout(update)
        hidden_states = hidden_states + self.dropout(self.feed_forward(self.ff_norm(hidden_states)))
        return hidden_states, new_state

    def _decode_plan(self, hidden_states: torch.Tensor, state, token_mask) -> Optional[tuple]:
        """Where this call is a decode step that ``_decode_step`` computes, the arguments it takes after the state;
        else None. It is one where the norms are RMSNorms, the feed-forward SwiGLU, no dropout is at
        work, the fast-weight layer's token step applies (``_token_step_applies``: one position, no padding, CPU
        inference, no global hooks), none of the modules it stands in for is replaced or hooked, and the weights are
        as ``fwp_kernels.block_ops_apply`` takes them."""
        if hidden_states.shape[1] != 1 or token_mask is not None:
            return None
        modules = self._modules  # (dict reads, as weights_of: this runs once per layer and token)
        layer, ff, norm, ff_norm = (modules["fast_weight"], modules["feed_forward"], modules["fast_weight_norm"],
                                    modules["ff_norm"])
        ff_modules = ff._modules
        gate, act = ff_modules.get("gate_proj"), ff_modules["act"]
        if not hasattr(layer, "token_step_from") or gate is None or not isinstance(act, SILU_ACTIVATIONS):
            return None
        if self.training and (modules["dropout"].p > 0 or ff_modules["dropout"].p > 0):
            return None
        if not (unhooked(norm, RMSNorm) and unhooked(ff_norm, RMSNorm) and unhooked(ff, FeedForward)
                and unhooked(layer, type(layer)) and unhooked(act, type(act))):
            return None
        projections = layer.token_step_projections()
        linears = (*projections, layer._modules["o_proj"], gate, ff_modules["up_proj"], ff_modules["down_proj"])
        if not plain_linears(*linears) or not layer._token_step_applies(hidden_states, state or {}, token_mask):
            return None
        norm_weights, weights = weights_of(norm, ff_norm), weights_of(*linears)
        if not block_ops_apply(hidden_states, norm_weights, weights):
            return None
        return layer, (norm.eps, ff_norm.eps), norm_weights, weights

    def _decode_step(self, hidden_states: torch.Tensor, state, layer: nn.Module, eps: Tuple[float, float],
                     norm_weights: list, weights: list) -> Tuple[torch.Tensor, dict]:
        """``forward`` of a decode step (``_decode_plan``: the layer, the norms' eps and weights, the weights of the
        layer's projections, ``o_proj`` and the feed-forward) in one C++ call instead of a dozen ops and module calls
        (``fwp_kernels.block_decode_step``): the first norm with the layer's projections, its token step, then
        ``o_proj``, the residual, the second norm and the feed-forward with its residual; the same values as
        ``forward``'s unfused path."""
        call, out, layer = self._prepared_decode_step(hidden_states, state, layer, eps, norm_weights, weights)
        return out, layer.token_step_state(call.run(), call.new_conv_states)

    def prepare_decode_step(self, hidden_states: torch.Tensor, state=None, token_mask=None
                            ) -> Optional[Tuple[BlockDecodeCall, torch.Tensor, nn.Module]]:
        """Where ``forward(hidden_states, state, token_mask)`` is a decode step that ``_decode_step`` computes
        (``_decode_plan``), that step prepared and not run: ``(call, out [B, 1, D], fast-weight layer)``; ``out`` is
        computed by ``call.run()`` (``fwp_kernels.prepare_block_decode_step``), whose new state makes the block's with
        ``layer.token_step_state(new_state, call.new_conv_states)``. Else None. Nothing reads `hidden_states`' values
        before the call runs: it may be the ``out`` of the block before, not yet computed."""
        plan = self._decode_plan(hidden_states, state, token_mask)
        return None if plan is None else self._prepared_decode_step(hidden_states, state, *plan)

    @staticmethod
    def _prepared_decode_step(hidden_states: torch.Tensor, state, layer: nn.Module, eps: Tuple[float, float],
                              norm_weights: list, weights: list) -> Tuple[BlockDecodeCall, torch.Tensor, nn.Module]:
        """The call of ``_decode_step`` (its arguments as there), prepared: ``(call, out [B, 1, D], layer)``."""
        call = prepare_block_decode_step(hidden_states[:, 0], norm_weights, eps, weights,
                                         **layer.token_step_settings(state or {}))
        return call, call.out[:, None], layer


def carried_state(cache: Optional[FastWeightCache], layer_idx: int) -> Optional[dict]:
    """Block `layer_idx`'s state in `cache` (None without a cache or a state), detached: gradients stop at segment
    boundaries."""
    state = cache.get_state(layer_idx) if cache is not None else None
    return None if state is None else {name: t.detach() for name, t in state.items()}


def sinusoidal_position_embedding(positions: torch.Tensor, dim: int) -> torch.Tensor:
    """Vaswani et al. 2017 absolute encoding: ``positions [B, T] -> [B, T, dim]``."""
    inv_freq = torch.exp(-math.log(10000.0) * torch.arange(0, dim, 2, device=positions.device).float() / dim)
    angles = positions.float()[..., None] * inv_freq
    return torch.cat([angles.sin(), angles.cos()], dim=-1)[..., :dim]


def check_token_ids(ids: torch.Tensor, vocab_size: int, name: str, ignore_index: Optional[int] = None) -> None:
    """Raises a ValueError naming `name` unless ``ids`` is an integer ``[B, T]`` tensor with ``B, T >= 1`` and values
    in ``[0, vocab_size)`` (or ``ignore_index``).

    The range check reads the values on the host (a device sync, and a graph break under ``torch.compile``): it runs
    in eager mode only; a compiled forward checks dtype and shape alone.
    """
    if not torch.is_tensor(ids) or ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        kind = ids.dtype if torch.is_tensor(ids) else type(ids).__name__
        raise ValueError(f"`{name}` must be an integer tensor of token ids (torch.long), got {kind}")
    if ids.dim() != 2:
        raise ValueError(f"`{name}` must be [batch, seq_len], got shape {tuple(ids.shape)}")
    if ids.numel() == 0:
        raise ValueError(f"`{name}` must hold at least one token per row, got shape {tuple(ids.shape)}")
    if torch.compiler.is_compiling():
        return
    values = ids if ignore_index is None else ids[ids != ignore_index]
    if not values.numel():
        return
    low, high = torch.stack(torch.aminmax(values)).tolist()  # one read from the device (a decode step's one sync)
    if low < 0 or high >= vocab_size:
        raise ValueError(
            f"`{name}` must lie in [0, vocab_size={vocab_size})"
            + (f" or be {ignore_index}" if ignore_index is not None else "")
            + f", got values in [{low}, {high}]"
        )


def padding_mask(
    attention_mask: Optional[torch.Tensor], batch_size: int, seq_len: int, past_len: int
) -> Optional[torch.Tensor]:
    """Validates a 2-D padding mask ``[B, T]`` or ``[B, past + T]``; returns ``[B, T]`` floats, or None if all ones.

    Under ``torch.compile`` the mask is returned as is (even all ones, which gives the same result as None): testing
    its values would break the graph.
    """
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2 or attention_mask.shape[0] != batch_size or attention_mask.shape[1] not in (
        seq_len,
        past_len + seq_len,
    ):
        raise ValueError(
            f"`attention_mask` must be a 2-D padding mask of shape [batch, {seq_len}] or "
            f"[batch, past + new tokens = {past_len + seq_len}] with batch = {batch_size}, "
            f"got {tuple(attention_mask.shape)}"
        )
    mask = attention_mask[:, -seq_len:]
    if torch.compiler.is_compiling():
        return mask.to(torch.float32)
    if not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
        raise ValueError(
            f"`attention_mask` must hold only 0 (padding) and 1 (token), got values "
            f"{attention_mask.unique().tolist()[:8]}"
        )
    return None if bool(mask.all()) else mask.to(torch.float32)


class FastWeightPreTrainedModel(StatefulPreTrainedModel):
    config_class = FastWeightConfig
    config: FastWeightConfig
    base_model_prefix = "model"
    _no_split_modules = ["FastWeightBlock"]

    def _init_weights(self, module: nn.Module) -> None:
        """transformers' generic rules, then the module's own ``init_fast_weight_parameters()`` where it defines one:
        the hook through which a layer sets the parameters those rules do not know (the Gated DeltaNet's ``A_log`` and
        ``dt_bias``), so that a new family's layer needs no edit here."""
        super()._init_weights(module)
        init_own_parameters = getattr(module, "init_fast_weight_parameters", None)
        if init_own_parameters is not None:
            init_own_parameters()


class FastWeightModel(FastWeightPreTrainedModel):
    """Embeddings, a stack of ``FastWeightBlock``s and a final LayerNorm; returns hidden states and the cache."""

    def __init__(self, config: FastWeightConfig) -> None:
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        if config.position_embedding_type == "learned":
            self.embed_positions = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.layers = nn.ModuleList(FastWeightBlock(config, i) for i in range(config.num_hidden_layers))
        self.norm = block_norm(config)
        self.dropout = nn.Dropout(config.hidden_dropout)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    def _positions(self, token_mask, cache, batch_size, seq_len, device) -> torch.Tensor:
        mask = token_mask if token_mask is not None else torch.ones(batch_size, seq_len, device=device)
        offsets = cache.token_counts if cache is not None and cache.token_counts is not None else 0
        positions = (mask.long().cumsum(-1) - 1).clamp_min(0)
        return positions + (offsets[:, None] if torch.is_tensor(offsets) else offsets)

    def _add_positions(self, embeds, position_ids, token_mask, cache) -> torch.Tensor:
        """``embeds [B, T, D]`` plus the configured absolute position embedding (positions count real tokens only,
        continuing from the cache's per-row token counts, unless ``position_ids`` are given)."""
        config = self.config
        if config.position_embedding_type == "none":
            return embeds
        if position_ids is None:
            position_ids = self._positions(token_mask, cache, embeds.shape[0], embeds.shape[1], embeds.device)
        if config.position_embedding_type == "sinusoidal":
            return embeds + sinusoidal_position_embedding(position_ids, config.hidden_size).to(embeds.dtype)
        if not torch.compiler.is_compiling() and int(position_ids.max()) >= config.max_position_embeddings:
            raise ValueError(
                f"`position_ids` reach {int(position_ids.max())}, beyond max_position_embeddings="
                f"{config.max_position_embeddings}"
            )
        return embeds + self.embed_positions(position_ids)

    def _replay(self, cache: FastWeightCache, inputs_embeds: torch.Tensor, attention_mask: Optional[torch.Tensor],
                position_ids: Optional[torch.LongTensor], num_tokens: int) -> None:
        """Runs the first ``num_tokens`` of a recorded forward pass again from its restored state (a rollback)."""
        dropped = inputs_embeds.shape[1] - num_tokens
        self(
            inputs_embeds=inputs_embeds[:, :num_tokens],
            attention_mask=None if attention_mask is None else attention_mask[:, : attention_mask.shape[1] - dropped],
            position_ids=None if position_ids is None else position_ids[:, :num_tokens],
            cache=cache,
            use_cache=True,
        )

    def _blocks(self, hidden_states: torch.Tensor, cache: Optional[FastWeightCache], token_mask: Optional[torch.Tensor],
                seq_len: int, output_hidden_states: bool) -> Tuple[torch.Tensor, Optional[Tuple[torch.Tensor, ...]]]:
        """The blocks, each continuing from its cache state (detached) and writing back the new one, then the final
        norm: ``(hidden_states [B, T, D], every block's input and the normed output, or None)``. A decode step whose
        blocks all allow it runs in one pass (``_decode_in_one_pass``), with the block loop's values."""
        all_hidden_states = () if output_hidden_states else None
        with reusing_cpu_buffers(hidden_states):  # a CPU forward over many positions: no fresh pages per layer
            decoded = self._decode_in_one_pass(hidden_states, cache, token_mask, seq_len)
            if decoded is not None:
                block_inputs, hidden_states = decoded
                all_hidden_states = block_inputs if output_hidden_states else None
            else:
                for layer_idx, block in enumerate(self.layers):
                    if output_hidden_states:
                        all_hidden_states += (hidden_states,)
                    state = carried_state(cache, layer_idx)
                    hidden_states, new_state = block(hidden_states, state=state, token_mask=token_mask)
                    if cache is not None:
                        cache.set_state(layer_idx, new_state, seq_len)
            hidden_states = self.norm(hidden_states)
        if output_hidden_states:
            all_hidden_states += (hidden_states,)
        return hidden_states, all_hidden_states

    def _decode_in_one_pass(self, hidden_states: torch.Tensor, cache: Optional[FastWeightCache],
                            token_mask: Optional[torch.Tensor], seq_len: int
                            ) -> Optional[Tuple[Tuple[torch.Tensor, ...], torch.Tensor]]:
        """A decode step through the blocks where every block is a plain ``FastWeightBlock`` whose step
        ``prepare_decode_step`` prepares: all of them prepared first (their checks and allocations; each block's input
        the output of the one before, not yet computed), then their C++ calls one after the other, each new state into
        `cache` after its call (and its memory allocated as the call runs, the old state before it gone:
        ``BlockDecodeCall.run``). The same calls and values as the block loop, but the Python between two blocks'
        weight reads ran 2-3 times slower than alone (the weights streamed through the caches push its code and data
        out: the norm_linear_rows comment in csrc/decode_linear.cpp), and here it runs before them. Returns ``(every
        block's input, the last block's output)``, or None (nothing run, the cache untouched) where a block takes its
        own path."""
        if hidden_states.shape[1] != 1 or token_mask is not None or global_module_hooks():
            return None
        prepared, block_inputs = [], []
        for layer_idx, block in enumerate(self.layers):
            if not unhooked(block, FastWeightBlock):  # its hooks and forward run in the block loop
                return None
            step = block.prepare_decode_step(hidden_states, carried_state(cache, layer_idx), token_mask)
            if step is None:
                return None
            block_inputs.append(hidden_states)
            prepared.append(step)
            hidden_states = step[1]
        for layer_idx, (call, _, layer) in enumerate(prepared):
            new_state = layer.token_step_state(call.run(), call.new_conv_states)
            prepared[layer_idx] = None  # its arguments, the old state among them, go with the cache's reference
            if cache is not None:
                cache.set_state(layer_idx, new_state, seq_len)
        return tuple(block_inputs), hidden_states

    def forward(
        self,
        input_ids: Optional[torch.LongTensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.LongTensor] = None,
        cache: Optional[FastWeightCache] = None,
        inputs_embeds: Optional[torch.Tensor] = None,
        use_cache: Optional[bool] = None,
        output_hidden_states: Optional[bool] = None,
        return_dict: Optional[bool] = None,
        past_key_values: Optional[FastWeightCache] = None,
        **kwargs,
    ) -> Union[BaseModelOutputWithPast, Tuple]:
        """
        Args:
            input_ids: ``[B, T]`` token ids in ``[0, vocab_size)`` (or ``inputs_embeds [B, T, D]``).
            attention_mask: ``[B, T]`` or ``[B, past + T]`` padding mask (1 = token, 0 = padding).
            cache: a ``FastWeightCache`` to continue from (``past_key_values``, its name before transformers 5.24,
                works too); it is updated in place and returned. Its state is detached: gradients stop at segment
                boundaries.
            use_cache: return a cache (a new one when ``cache`` is None).
        Returns:
            ``BaseModelOutputWithPast(last_hidden_state [B, T, D], cache, hidden_states)``.
        """
        config = self.config
        output_hidden_states = output_hidden_states if output_hidden_states is not None else config.output_hidden_states
        use_cache = use_cache if use_cache is not None else config.use_cache
        return_dict = return_dict if return_dict is not None else config.return_dict
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Specify exactly one of `input_ids` and `inputs_embeds`")
        if input_ids is not None:
            check_token_ids(input_ids, config.vocab_size, "input_ids")
            inputs_embeds = self.embed_tokens(input_ids)
        batch_size, seq_len = inputs_embeds.shape[:2]
        cache = resolve_cache_argument(cache, past_key_values)

        if cache is not None and not isinstance(cache, FastWeightCache):
            raise ValueError(f"`cache` (`past_key_values`) must be a FastWeightCache (or None), "
                             f"got {type(cache).__name__}")
        if cache is not None and cache.batch_size not in (-1, batch_size):
            raise ValueError(
                f"`cache` (`past_key_values`) holds a state for batch size {cache.batch_size}, but the input has "
                f"batch size {batch_size}"
            )
        if cache is None and use_cache:
            cache = FastWeightCache(config.num_hidden_layers)
        past_len = cache.get_seq_length() if cache is not None else 0
        token_mask = padding_mask(attention_mask, batch_size, seq_len, past_len)
        # assisted decoding may roll this pass back (cache_fwp.RollbackMixin)
        if cache is not None and cache.record_past:
            cache.checkpoint(seq_len, partial(self._replay, cache, inputs_embeds, attention_mask, position_ids))

        if self.training and past_len == 0:
            # FAVOR+ draws new random features for every training batch (not mid-stream: a carried state
            # is only meaningful in the feature space it was written in); fixed in evaluation.
            for module in self.modules():
                if isinstance(module, FeatureMap):
                    module.redraw()

        hidden_states = self.dropout(self._add_positions(inputs_embeds, position_ids, token_mask, cache))

        hidden_states, all_hidden_states = self._blocks(hidden_states, cache, token_mask, seq_len, output_hidden_states)

        if cache is not None:
            cache.count_tokens(token_mask, batch_size, seq_len, hidden_states.device)

        output = BaseModelOutputWithPast(
            last_hidden_state=hidden_states, hidden_states=all_hidden_states, **{CACHE_ARGUMENT: cache}
        )
        return output if return_dict else output.to_tuple()


class FastWeightForCausalLM(FastWeightPreTrainedModel, GenerationMixin):
    """A fast-weight model with a language modelling head (tied to the input embedding by default)."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    base_model_class = FastWeightModel

    def __init__(self, config: FastWeightConfig) -> None:
        super().__init__(config)
        self.model = self.base_model_class(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def _empty_cache(self) -> FastWeightCache:
        return FastWeightCache(self.config.num_hidden_layers)

    def set_output_embeddings(self, new_embeddings: nn.Linear) -> None:
        self.lm_head = new_embeddings

    def forward(
        self,
        input_ids: Optional[torch.LongTensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.LongTensor] = None,
        cache: Optional[FastWeightCache] = None,
        inputs_embeds: Optional[torch.Tensor] = None,
        labels: Optional[torch.LongTensor] = None,
        use_cache: Optional[bool] = None,
        output_hidden_states: Optional[bool] = None,
        return_dict: Optional[bool] = None,
        logits_to_keep: Union[int, torch.Tensor] = 0,
        past_key_values: Optional[FastWeightCache] = None,
        **kwargs,
    ) -> Union[CausalLMOutputWithPast, Tuple]:
        """
        Args:
            labels: ``[B, T]`` ids (shifted inside; -100 ignored). With ``num_items_in_batch`` (passed by Trainer)
                the loss is the token sum divided by that count, so gradient accumulation is exact.
            logits_to_keep: an int n keeps the last n positions' logits (0 keeps all), a tensor selects positions.
            Other arguments as in ``FastWeightModel.forward``.
        Returns:
            ``CausalLMOutputWithPast(loss, logits [B, T', V], cache, hidden_states)``.
        """
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=resolve_cache_argument(cache, past_key_values),
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_hidden_states=output_hidden_states,
            return_dict=True,
        )
        logits = self.lm_head(outputs.last_hidden_state[:, logits_to_keep_index(logits_to_keep)])

        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)

        output = CausalLMOutputWithPast(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, **{CACHE_ARGUMENT: output_cache(outputs)}
        )
        return output if return_dict else output.to_tuple()


# ---------------------------------------------------------------------------------------------------------------
# Model families: the same backbone, a different config (and so a different fast-weight layer).
# ---------------------------------------------------------------------------------------------------------------


class LinearTransformerModel(FastWeightModel):
    config_class = LinearTransformerConfig


class LinearTransformerForCausalLM(FastWeightForCausalLM):
    config_class = LinearTransformerConfig
    base_model_class = LinearTransformerModel


class DeltaNetModel(FastWeightModel):
    config_class = DeltaNetConfig


class DeltaNetForCausalLM(FastWeightForCausalLM):
    config_class = DeltaNetConfig
    base_model_class = DeltaNetModel


class GatedDeltaNetModel(FastWeightModel):
    config_class = GatedDeltaNetConfig


class GatedDeltaNetForCausalLM(FastWeightForCausalLM):
    config_class = GatedDeltaNetConfig
    base_model_class = GatedDeltaNetModel


def _register_fused_qkv_conversion() -> None:
    """``from_pretrained`` of folders saved before ``q_proj`` / ``k_proj`` / ``v_proj`` existed (one fused
    ``qkv_proj``, rows W_q, W_k, W_v): transformers' loader splits it (``load_state_dict`` has the layer's own
    hook). The split is never undone: the reverse of the conversion, which transformers applies on save, renames
    nothing, so saved folders always have the current layout."""
    try:
        from transformers.conversion_mapping import register_checkpoint_conversion_mapping
        from transformers.core_model_loading import Chunk, WeightConverter, WeightRenaming
    except ImportError:  # a transformers without conversion mappings: old folders need load_state_dict
        return

    class SplitFusedQKV(WeightConverter):
        def reverse_transform(self):
            keep = WeightRenaming(source_patterns=r"fast_weight\.qkv_proj\.weight",
                                  target_patterns="fast_weight.qkv_proj.weight")  # matches no saved key
            keep.scope_prefix, keep.base_model_prefix = self.scope_prefix, self.base_model_prefix
            return keep

    for config_class in (LinearTransformerConfig, DeltaNetConfig):
        split = SplitFusedQKV(
            source_patterns=r"fast_weight.qkv_proj.weight",
            target_patterns=[f"fast_weight.{name}.weight" for name in ("q_proj", "k_proj", "v_proj")],
            operations=[Chunk(dim=0)],
        )
        register_checkpoint_conversion_mapping(config_class.model_type, [split], overwrite=True)


_register_fused_qkv_conversion()


# Recurrent Fast Weight Programmers (Irie et al. 2021, Table 1): the same backbone, a recurrent FWP layer.


class DeltaMLPModel(FastWeightModel):
    config_class = DeltaMLPConfig


class DeltaMLPForCausalLM(FastWeightForCausalLM):
    config_class = DeltaMLPConfig
    base_model_class = DeltaMLPModel


class DeltaDeltaNetModel(FastWeightModel):
    config_class = DeltaDeltaNetConfig


class DeltaDeltaNetForCausalLM(FastWeightForCausalLM):
    config_class = DeltaDeltaNetConfig
    base_model_class = DeltaDeltaNetModel


class DeltaRNNModel(FastWeightModel):
    config_class = DeltaRNNConfig


class DeltaRNNForCausalLM(FastWeightForCausalLM):
    config_class = DeltaRNNConfig
    base_model_class = DeltaRNNModel


class DeltaLSTMModel(FastWeightModel):
    config_class = DeltaLSTMConfig


class DeltaLSTMForCausalLM(FastWeightForCausalLM):
    config_class = DeltaLSTMConfig
    base_model_class = DeltaLSTMModel


class RecurrentDeltaNetModel(FastWeightModel):
    config_class = RecurrentDeltaNetConfig


class RecurrentDeltaNetForCausalLM(FastWeightForCausalLM):
    config_class = RecurrentDeltaNetConfig
    base_model_class = RecurrentDeltaNetModel
