"""The fast-weight encoder-decoder (Schlag et al. 2021, sec. 6.2, appendix E): machine translation with linear
attention.

``FastWeightSeq2SeqForConditionalGeneration`` (``AutoModelForSeq2SeqLM``) is a pre-LN encoder-decoder Transformer
whose attentions are fast weights (``FastWeightSeq2SeqConfig`` states which and why):

- ``NonCausalLinearAttention``: the encoder's self-attention and the cross-attention. Every key/value of a sequence is
  written into one fast weight before any query reads it (eqs. 17-19 without causality).
- the decoder's self-attention: the package's causal ``FastWeightLinearAttention`` (sum or delta rule).

The decoder's recurrent state lives in a ``FastWeightSeq2SeqCache``: per decoder layer the self-attention's fast
weight (constant size) and the cross-attention's state, programmed once per source from the encoder output.
"""
from __future__ import annotations

import math
from typing import Dict, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutput, Seq2SeqLMOutput, Seq2SeqModelOutput

from .cache_fwp import CACHE_ARGUMENT, FastWeightCache, output_cache, resolve_cache_argument
from .configuration_fwp_seq2seq import FastWeightSeq2SeqConfig
from .fast_weight_layers import FastWeightLinearAttention, merge_heads, split_heads
from .feature_maps import FeatureMap
from .modeling_fwp import FeedForward, check_token_ids, padding_mask, sinusoidal_position_embedding
from .pretrained import StatefulPreTrainedModel

State = Dict[str, torch.Tensor]


class NonCausalLinearAttention(nn.Module):
    """Linear attention over a whole memory sequence: ``y_i = W phi(q_i) / (z . phi(q_i))`` with
    ``W = sum_j v_j phi(k_j)^T`` and ``z = sum_j phi(k_j)`` (Schlag et al. 2021 eqs. 17-19, all writes before reads).

    ``program(memory, memory_mask)`` writes the memory into the fast weight (state ``fast_weight [B, H, Dv, Dk]``,
    ``normalizer [B, H, 1, Dk]``, the names of the decoder's fast-weight state); ``read(hidden_states, state)``
    queries it. Encoder self-attention: ``read(x, program(x, mask))``; cross-attention: ``read(decoder states,
    program(encoder output, source mask))``, the program step done once per source.
    """

    def __init__(self, config: FastWeightSeq2SeqConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        inner = self.num_heads * config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, inner, bias=False)
        self.kv_proj = nn.Linear(config.hidden_size, 2 * inner, bias=False)
        self.o_proj = nn.Linear(inner, config.hidden_size, bias=False)
        self.feature_map = FeatureMap(config)

    def program(self, memory: torch.Tensor, memory_mask: Optional[torch.Tensor] = None) -> State:
        """``memory [B, S, D]``, ``memory_mask [B, S]`` (1 = token, 0 = padding; None: all tokens) -> the state."""
        k, v = (split_heads(x, self.num_heads) for x in self.kv_proj(memory).chunk(2, dim=-1))
        k = self.feature_map(k)
        if memory_mask is not None:
            k = k * memory_mask.to(k.dtype)[:, None, :, None]  # padded keys write nothing
        fast_weight = torch.einsum("bhsv,bhsk->bhvk", v, k)  # eq. 17 summed over every position
        return {"fast_weight": fast_weight, "normalizer": k.sum(2, keepdim=True)}  # z of eq. 18

    def read(self, hidden_states: torch.Tensor, state: State) -> torch.Tensor:
        """``hidden_states [B, T, D]`` -> ``[B, T, D]``, eq. 19 (a zero denominator gives 0: nothing was written)."""
        # a positive factor of phi(q) cancels in eq. 19 (FAVOR+ rescales it so that it cannot underflow)
        q = self.feature_map(split_heads(self.q_proj(hidden_states), self.num_heads), rescale_dims=-1)
        numerator = torch.einsum("bhvk,bhtk->bhtv", state["fast_weight"], q)
        denominator = torch.einsum("bhok,bhtk->bhto", state["normalizer"], q)
        out = numerator / torch.where(denominator > 0, denominator, torch.ones_like(denominator))
        return self.o_proj(merge_heads(out))


class SoftmaxCrossAttention(nn.Module):
    """Vaswani et al.'s softmax cross-attention with the same ``program`` / ``read`` interface; its state holds the
    memory's keys and values ``[B, H, S, d]`` and ``key_mask [B, S]`` (grows with the source, not the target)."""

    def __init__(self, config: FastWeightSeq2SeqConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        inner = self.num_heads * config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, inner, bias=False)
        self.kv_proj = nn.Linear(config.hidden_size, 2 * inner, bias=False)
        self.o_proj = nn.Linear(inner, config.hidden_size, bias=False)

    def program(self, memory: torch.Tensor, memory_mask: Optional[torch.Tensor] = None) -> State:
        key, value = (split_heads(x, self.num_heads) for x in self.kv_proj(memory).chunk(2, dim=-1))
        if memory_mask is None:
            memory_mask = torch.ones(memory.shape[:2], device=memory.device)
        return {"key": key, "value": value, "key_mask": memory_mask.bool()}

    def read(self, hidden_states: torch.Tensor, state: State) -> torch.Tensor:
        q = split_heads(self.q_proj(hidden_states), self.num_heads)
        out = F.scaled_dot_product_attention(q, state["key"], state["value"],
                                             attn_mask=state["key_mask"][:, None, None])
        return self.o_proj(merge_heads(out))


CROSS_ATTENTION_CLASSES = {"linear": NonCausalLinearAttention, "softmax": SoftmaxCrossAttention}


class FastWeightEncoderBlock(GradientCheckpointingLayer):
    """Pre-LN: ``h = x + Attn(LN(x))`` (non-causal linear attention), ``out = h + FF(LN(h))``."""

    def __init__(self, config: FastWeightSeq2SeqConfig) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attention = NonCausalLinearAttention(config)
        self.ff_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.feed_forward = FeedForward(config)
        self.dropout = nn.Dropout(config.hidden_dropout)

    def forward(self, hidden_states: torch.Tensor, token_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        normed = self.attention_norm(hidden_states)
        update = self.self_attention.read(normed, self.self_attention.program(normed, token_mask))
        hidden_states = hidden_states + self.dropout(update)
        return hidden_states + self.dropout(self.feed_forward(self.ff_norm(hidden_states)))


class FastWeightDecoderBlock(GradientCheckpointingLayer):
    """Pre-LN: causal fast weights, then cross-attention, then feed-forward, each ``h + f(LN(h))``.

    ``forward(hidden_states [B, T, D], cross_state, state=None, token_mask=None) -> (hidden_states, new_state)``.
    """

    def __init__(self, config: FastWeightSeq2SeqConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attention_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attention = FastWeightLinearAttention(config, layer_idx)
        self.cross_attention_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.cross_attention = CROSS_ATTENTION_CLASSES[config.cross_attention](config)
        self.ff_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.feed_forward = FeedForward(config)
        self.dropout = nn.Dropout(config.hidden_dropout)

    def forward(self, hidden_states, cross_state, state=None, token_mask=None):
        update, new_state = self.self_attention(self.self_attention_norm(hidden_states), state=state,
                                                token_mask=token_mask)
        hidden_states = hidden_states + self.dropout(update)
        cross = self.cross_attention.read(self.cross_attention_norm(hidden_states), cross_state)
        hidden_states = hidden_states + self.dropout(cross)
        hidden_states = hidden_states + self.dropout(self.feed_forward(self.ff_norm(hidden_states)))
        return hidden_states, new_state


class FastWeightSeq2SeqCache(FastWeightCache):
    """The decoder's state: ``FastWeightCache`` layers ``0 .. L-1`` hold the self-attention fast weights (constant in
    the tokens generated), layers ``L .. 2L-1`` the cross-attention states (programmed once per source: they count no
    tokens). Beam search reorders / selects / repeats both (``FastWeightCache``)."""

    def __init__(self, num_decoder_layers: int) -> None:
        super().__init__(2 * num_decoder_layers)
        self.num_decoder_layers = num_decoder_layers

    def get_cross_state(self, layer_idx: int) -> Optional[State]:
        return self.get_state(self.num_decoder_layers + layer_idx)

    def set_cross_state(self, layer_idx: int, state: State) -> None:
        self.set_state(self.num_decoder_layers + layer_idx, state, 0)


class FastWeightSeq2SeqPreTrainedModel(StatefulPreTrainedModel):
    config_class = FastWeightSeq2SeqConfig
    config: FastWeightSeq2SeqConfig
    base_model_prefix = "model"
    _no_split_modules = ["FastWeightEncoderBlock", "FastWeightDecoderBlock"]


def _embed(module: nn.Module, embeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``embeds [B, T, D]`` scaled (``scale_embedding``) plus the configured absolute positions ``[B, T]``."""
    config = module.config
    if config.scale_embedding:
        embeds = embeds * math.sqrt(config.hidden_size)
    if config.position_embedding_type == "sinusoidal":
        embeds = embeds + sinusoidal_position_embedding(positions, config.hidden_size).to(embeds.dtype)
    elif config.position_embedding_type == "learned":
        if int(positions.max()) >= config.max_position_embeddings:
            raise ValueError(f"positions reach {int(positions.max())}, beyond max_position_embeddings="
                             f"{config.max_position_embeddings}")
        embeds = embeds + module.embed_positions(positions)
    return module.dropout(embeds)


def _token_positions(token_mask: Optional[torch.Tensor], batch_size: int, seq_len: int, device, offsets=None):
    """Absolute positions ``[B, T]`` counting real tokens only, from ``offsets [B]`` (tokens seen before) or 0."""
    mask = token_mask if token_mask is not None else torch.ones(batch_size, seq_len, device=device)
    positions = (mask.long().cumsum(-1) - 1).clamp_min(0)
    return positions + (offsets[:, None] if offsets is not None else 0)


class FastWeightSeq2SeqEncoder(nn.Module):
    """Token embedding (shared with the decoder and the LM head), positions, encoder blocks, final LayerNorm."""

    def __init__(self, config: FastWeightSeq2SeqConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        if config.position_embedding_type == "learned":
            self.embed_positions = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.layers = nn.ModuleList(FastWeightEncoderBlock(config) for _ in range(config.encoder_layers))
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout)

    def forward(
        self,
        input_ids: Optional[torch.LongTensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        inputs_embeds: Optional[torch.Tensor] = None,
        output_hidden_states: Optional[bool] = None,
        return_dict: Optional[bool] = None,
        **kwargs,
    ) -> BaseModelOutput:
        """``input_ids [B, S]`` (or ``inputs_embeds [B, S, D]``), ``attention_mask [B, S]`` (0 = padding) ->
        ``BaseModelOutput(last_hidden_state [B, S, D], hidden_states)``. Padded positions are neither read nor
        written by real ones (their own outputs are meaningless)."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Specify exactly one of `input_ids` and `inputs_embeds`")
        if input_ids is not None:
            check_token_ids(input_ids, self.config.vocab_size, "input_ids")
            inputs_embeds = self.embed_tokens(input_ids)
        batch_size, seq_len = inputs_embeds.shape[:2]
        token_mask = padding_mask(attention_mask, batch_size, seq_len, 0)
        positions = _token_positions(token_mask, batch_size, seq_len, inputs_embeds.device)
        hidden_states = _embed(self, inputs_embeds, positions)
        all_hidden_states = (hidden_states,) if output_hidden_states else None
        for block in self.layers:
            hidden_states = block(hidden_states, token_mask)
            if output_hidden_states:
                all_hidden_states += (hidden_states,)
        return BaseModelOutput(last_hidden_state=self.norm(hidden_states), hidden_states=all_hidden_states)


class FastWeightSeq2SeqDecoder(nn.Module):
    """Positions, decoder blocks, final LayerNorm (token embeddings come from the encoder's table)."""

    def __init__(self, config: FastWeightSeq2SeqConfig) -> None:
        super().__init__()
        self.config = config
        if config.position_embedding_type == "learned":
            self.embed_positions = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.layers = nn.ModuleList(FastWeightDecoderBlock(config, i) for i in range(config.decoder_layers))
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout)

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        encoder_hidden_states: Optional[torch.Tensor],
        encoder_attention_mask: Optional[torch.Tensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        cache: Optional[FastWeightSeq2SeqCache] = None,
        output_hidden_states: bool = False,
    ) -> Tuple[torch.Tensor, Optional[tuple]]:
        """``inputs_embeds [B, T, D]`` (unscaled token embeddings), the encoder output ``[B, S, D]`` and its mask
        ``[B, S]`` (only read while ``cache`` holds no cross-attention state), ``attention_mask [B, T]`` or
        ``[B, past + T]`` -> ``(hidden_states [B, T, D], all hidden states or None)``; ``cache`` updated in place."""
        batch_size, seq_len = inputs_embeds.shape[:2]
        past_len = cache.get_seq_length() if cache is not None else 0
        token_mask = padding_mask(attention_mask, batch_size, seq_len, past_len)
        offsets = cache.token_counts if cache is not None else None
        hidden_states = _embed(self, inputs_embeds, _token_positions(token_mask, batch_size, seq_len,
                                                                     inputs_embeds.device, offsets))
        source_mask = None
        if encoder_attention_mask is not None:
            source_mask = padding_mask(encoder_attention_mask, batch_size, encoder_attention_mask.shape[1], 0)
        all_hidden_states = (hidden_states,) if output_hidden_states else None
        for layer_idx, block in enumerate(self.layers):
            cross_state = cache.get_cross_state(layer_idx) if cache is not None else None
            if cross_state is None:
                if encoder_hidden_states is None:
                    raise ValueError("The decoder needs `encoder_outputs` (or `input_ids`) until its cache holds them")
                cross_state = block.cross_attention.program(encoder_hidden_states, source_mask)
                if cache is not None:
                    cache.set_cross_state(layer_idx, cross_state)
            state = cache.get_state(layer_idx) if cache is not None else None
            if state is not None:
                state = {name: t.detach() for name, t in state.items()}
            hidden_states, new_state = block(hidden_states, cross_state, state=state, token_mask=token_mask)
            if cache is not None:
                cache.set_state(layer_idx, new_state, seq_len)
            if output_hidden_states:
                all_hidden_states += (hidden_states,)
        if cache is not None:
            cache.count_tokens(token_mask, batch_size, seq_len, hidden_states.device)
        return self.norm(hidden_states), all_hidden_states


def shift_tokens_right(labels: torch.Tensor, pad_token_id: int, decoder_start_token_id: int) -> torch.Tensor:
    """Decoder inputs from ``labels [B, T]``: the start token, then the labels but the last (-100 -> padding)."""
    shifted = labels.new_full(labels.shape, decoder_start_token_id)
    shifted[:, 1:] = labels[:, :-1]
    return shifted.masked_fill(shifted == -100, pad_token_id)


class FastWeightSeq2SeqModel(FastWeightSeq2SeqPreTrainedModel):
    """The encoder and the decoder; returns the decoder's last hidden states, the cache and the encoder output."""

    def __init__(self, config: FastWeightSeq2SeqConfig) -> None:
        super().__init__(config)
        self.encoder = FastWeightSeq2SeqEncoder(config)
        self.decoder = FastWeightSeq2SeqDecoder(config)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.encoder.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.encoder.embed_tokens = value

    def get_encoder(self, modality=None) -> FastWeightSeq2SeqEncoder:
        return self.encoder

    def _cache_for(self, cache, use_cache: bool, batch_size: int) -> Optional[FastWeightSeq2SeqCache]:
        if cache is not None and not isinstance(cache, FastWeightSeq2SeqCache):
            raise ValueError(
                f"`cache` (`past_key_values`) must be a FastWeightSeq2SeqCache (or None), got {type(cache).__name__}"
            )
        if cache is not None and cache.batch_size not in (-1, batch_size):
            raise ValueError(f"`cache` (`past_key_values`) holds a state for batch size {cache.batch_size}, but the "
                             f"decoder input has batch size {batch_size}")
        if cache is None and use_cache:
            cache = FastWeightSeq2SeqCache(self.config.decoder_layers)
        return cache

    def forward(
        self,
        input_ids: Optional[torch.LongTensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        decoder_input_ids: Optional[torch.LongTensor] = None,
        decoder_attention_mask: Optional[torch.Tensor] = None,
        encoder_outputs: Optional[Union[BaseModelOutput, tuple]] = None,
        cache: Optional[FastWeightSeq2SeqCache] = None,
        inputs_embeds: Optional[torch.Tensor] = None,
        decoder_inputs_embeds: Optional[torch.Tensor] = None,
        use_cache: Optional[bool] = None,
        output_hidden_states: Optional[bool] = None,
        return_dict: Optional[bool] = None,
        past_key_values: Optional[FastWeightSeq2SeqCache] = None,
        **kwargs,
    ) -> Union[Seq2SeqModelOutput, Tuple]:
        """
        Args:
            input_ids: ``[B, S]`` source ids (or ``inputs_embeds``, or a precomputed ``encoder_outputs``).
            attention_mask: ``[B, S]`` source padding mask (1 = token, 0 = padding).
            decoder_input_ids: ``[B, T]`` target-side inputs (or ``decoder_inputs_embeds [B, T, D]``).
            decoder_attention_mask: ``[B, T]`` or ``[B, past + T]`` target padding mask.
            cache: a ``FastWeightSeq2SeqCache`` to continue from (also as ``past_key_values``); updated in place.
        Returns:
            ``Seq2SeqModelOutput(last_hidden_state [B, T, D], cache, decoder_hidden_states,
            encoder_last_hidden_state [B, S, D], encoder_hidden_states)``.
        """
        config = self.config
        use_cache = use_cache if use_cache is not None else config.use_cache
        output_hidden_states = output_hidden_states if output_hidden_states is not None else config.output_hidden_states
        return_dict = return_dict if return_dict is not None else config.return_dict
        if (decoder_input_ids is None) == (decoder_inputs_embeds is None):
            raise ValueError("Specify exactly one of `decoder_input_ids` and `decoder_inputs_embeds`")
        if decoder_input_ids is not None:
            check_token_ids(decoder_input_ids, config.vocab_size, "decoder_input_ids")
            decoder_inputs_embeds = self.encoder.embed_tokens(decoder_input_ids)
        cache = self._cache_for(resolve_cache_argument(cache, past_key_values), use_cache,
                                decoder_inputs_embeds.shape[0])
        if encoder_outputs is None and (cache is None or cache.get_cross_state(0) is None):
            if self.training:  # FAVOR+ draws new random features for every training batch (sec. 5.3)
                for module in self.modules():
                    if isinstance(module, FeatureMap):
                        module.redraw()
            encoder_outputs = self.encoder(input_ids=input_ids, attention_mask=attention_mask,
                                           inputs_embeds=inputs_embeds, output_hidden_states=output_hidden_states)
        elif isinstance(encoder_outputs, (tuple, list)):
            encoder_outputs = BaseModelOutput(*encoder_outputs)
        encoder_hidden = encoder_outputs.last_hidden_state if encoder_outputs is not None else None
        hidden_states, decoder_hidden_states = self.decoder(
            decoder_inputs_embeds, encoder_hidden, encoder_attention_mask=attention_mask,
            attention_mask=decoder_attention_mask, cache=cache, output_hidden_states=output_hidden_states,
        )
        output = Seq2SeqModelOutput(
            last_hidden_state=hidden_states, decoder_hidden_states=decoder_hidden_states,
            encoder_last_hidden_state=encoder_hidden,
            encoder_hidden_states=encoder_outputs.hidden_states if encoder_outputs is not None else None,
            **{CACHE_ARGUMENT: cache},
        )
        return output if return_dict else output.to_tuple()


class FastWeightSeq2SeqForConditionalGeneration(FastWeightSeq2SeqPreTrainedModel, GenerationMixin):
    """The encoder-decoder with a language modelling head (tied to the shared token embedding by default).
    ``generate`` runs the encoder once, then the decoder one token at a time from its recurrent cache (greedy,
    sampling or beam search, whose beams reorder the cache)."""

    _tied_weights_keys = {"lm_head.weight": "model.encoder.embed_tokens.weight"}

    def __init__(self, config: FastWeightSeq2SeqConfig) -> None:
        super().__init__(config)
        self.model = FastWeightSeq2SeqModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.encoder.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.encoder.embed_tokens = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, new_embeddings: nn.Linear) -> None:
        self.lm_head = new_embeddings

    def get_encoder(self, modality=None) -> FastWeightSeq2SeqEncoder:
        return self.model.encoder

    def prepare_decoder_input_ids_from_labels(self, labels: torch.Tensor) -> torch.Tensor:
        return shift_tokens_right(labels, self.config.pad_token_id, self.config.decoder_start_token_id)

    def forward(
        self,
        input_ids: Optional[torch.LongTensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        decoder_input_ids: Optional[torch.LongTensor] = None,
        decoder_attention_mask: Optional[torch.Tensor] = None,
        encoder_outputs: Optional[Union[BaseModelOutput, tuple]] = None,
        cache: Optional[FastWeightSeq2SeqCache] = None,
        inputs_embeds: Optional[torch.Tensor] = None,
        decoder_inputs_embeds: Optional[torch.Tensor] = None,
        labels: Optional[torch.LongTensor] = None,
        use_cache: Optional[bool] = None,
        output_hidden_states: Optional[bool] = None,
        return_dict: Optional[bool] = None,
        past_key_values: Optional[FastWeightSeq2SeqCache] = None,
        num_items_in_batch: Optional[Union[int, torch.Tensor]] = None,
        **kwargs,
    ) -> Union[Seq2SeqLMOutput, Tuple]:
        """
        Args:
            labels: ``[B, T]`` target ids (-100 ignored). Without decoder inputs, ``decoder_input_ids`` are the labels
                shifted right behind ``decoder_start_token_id``; no cache is built then. The loss is the mean
                cross-entropy over labelled tokens, or their sum divided by ``num_items_in_batch`` (Trainer's
                gradient accumulation).
            Other arguments as in ``FastWeightSeq2SeqModel.forward``.
        Returns:
            ``Seq2SeqLMOutput(loss, logits [B, T, V], cache, decoder_hidden_states, encoder_last_hidden_state, ...)``.
        """
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        if labels is not None:
            check_token_ids(labels, self.config.vocab_size, "labels", ignore_index=-100)
            use_cache = False if use_cache is None else use_cache
            if decoder_input_ids is None and decoder_inputs_embeds is None:
                decoder_input_ids = self.prepare_decoder_input_ids_from_labels(labels)
        outputs = self.model(
            input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids,
            decoder_attention_mask=decoder_attention_mask, encoder_outputs=encoder_outputs,
            cache=resolve_cache_argument(cache, past_key_values), inputs_embeds=inputs_embeds,
            decoder_inputs_embeds=decoder_inputs_embeds, use_cache=use_cache,
            output_hidden_states=output_hidden_states, return_dict=True,
        )
        logits = self.lm_head(outputs.last_hidden_state)
        loss = None
        if labels is not None:
            reduction = "mean" if num_items_in_batch is None else "sum"
            loss = F.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)).flatten(0, 1),
                                   labels.flatten().to(logits.device), ignore_index=-100, reduction=reduction)
            if num_items_in_batch is not None:
                loss = loss / (num_items_in_batch.to(loss.device) if torch.is_tensor(num_items_in_batch)
                               else num_items_in_batch)
        output = Seq2SeqLMOutput(
            loss=loss, logits=logits, decoder_hidden_states=outputs.decoder_hidden_states,
            encoder_last_hidden_state=outputs.encoder_last_hidden_state,
            encoder_hidden_states=outputs.encoder_hidden_states, **{CACHE_ARGUMENT: output_cache(outputs)},
        )
        return output if return_dict else output.to_tuple()
