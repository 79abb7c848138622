"""``FWLForCausalLM``: a Fast Weight Layer head (Clark et al. 2022) on any causal LM.

The base model (Llama / SmolLM2, GPT-2, our DeltaNetForCausalLM, ...) runs up to its last hidden states; the FWL head
(``fwl.FWLHead``) turns them into logits with the base model's own output embedding E, updating its fast weights at
every position from the losses of the earlier ones. The base model's LM head matmul is skipped: E is applied by the
FWL head.
"""
from __future__ import annotations

import copy
from functools import partial
import os
from typing import Any, Dict, Optional, Tuple, Union

import torch
from torch import nn
from transformers import AutoModelForCausalLM, GenerationMixin, PreTrainedConfig, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_fwl import FWLConfig
from .fwl import DenseFWLSlowHead, FWLCache, FWLHead, decay_split_dependence, init_fwl_weights
from .cache_fwp import CACHE_ARGUMENT, output_cache, resolve_cache_argument
from .modeling_fwp import check_token_ids, padding_mask
from .pretrained import StatefulPreTrainedModel, take_loss_kwargs

# Config fields with which a causal LM transforms its logits after the output embedding. Soft-capping
# (``cap * tanh(z / cap)``: Gemma 2 and 3, ...) becomes part of the FWL's output layer; the others are refused, since
# the FWL head, which applies the output embedding itself, would silently drop them.
SOFTCAPPING_FIELD = "final_logit_softcapping"
UNSUPPORTED_LOGIT_TRANSFORMS = {
    "logit_scale": "multiplies the logits (Cohere)",
    "logits_scaling": "scales the logits (Granite, HyperCLOVA X)",
    "output_multiplier": "multiplies the logits",
    "lm_head_multiplier": "multiplies the logits (Falcon-H1)",
}


def logit_softcapping(text_config: PreTrainedConfig) -> Optional[float]:
    """The soft-capping of a base model's logits (None: none); a ValueError naming the field if the base transforms
    its logits in a way the FWL's output layer does not reproduce."""
    config = text_config.get_text_config()
    for field, effect in UNSUPPORTED_LOGIT_TRANSFORMS.items():
        value = getattr(config, field, None)
        if value is not None and value != 1:
            raise ValueError(
                f"The base model's `{field}` = {value} {effect} after the output embedding; the FWL head applies the "
                "output embedding itself and does not support this transform"
            )
    return getattr(config, SOFTCAPPING_FIELD, None)


def base_model_hub_id(base_config: Any, loaded_from: Any) -> Optional[str]:
    """The Hub id of a base model, decided when it is loaded (later, a relative folder name means nothing): the id
    its config records (``source_model_id``, e.g. written by a conversion), else the name it was loaded from when
    that is not a local folder (then it came from the Hub), else None."""
    recorded = getattr(base_config, "source_model_id", None)
    if recorded:
        return str(recorded)
    name = loaded_from if isinstance(loaded_from, (str, os.PathLike)) else getattr(base_config, "_name_or_path", None)
    if name and not os.path.isdir(name):
        return str(name)
    return None


# Where a decoder (``language_model.base_model``) keeps its final normalisation
# (Llama, Mistral, Qwen: norm; GPT-2: ln_f).
FINAL_NORM_NAMES = ("norm", "ln_f", "final_layernorm", "final_layer_norm")


def output_side_slow_head(language_model: PreTrainedModel,
                          output_bias: bool) -> Tuple[DenseFWLSlowHead, Tuple[nn.Module, nn.Linear]]:
    """The slow head of ``fwl_head_type="output"``: the base's final norm (an ``nn.LayerNorm``, or an RMSNorm
    ``w * x / rms(x)`` with ``variance_epsilon`` or ``eps``) followed by a copy of its output embedding and an output
    bias. The decoder's final norm is replaced by ``nn.Identity`` (the head applies it now, so that its gain can be
    fast). Returns (the slow head, (the removed norm, the base's output embedding)) for ``copy_output_side``."""
    decoder = language_model.base_model
    name = next((n for n in FINAL_NORM_NAMES if isinstance(getattr(decoder, n, None), nn.Module)), None)
    if name is None:
        raise ValueError(
            f"fwl_head_type='output' needs the base decoder's final norm (one of {FINAL_NORM_NAMES} on "
            f"{type(decoder).__name__}); none found"
        )
    norm = getattr(decoder, name)
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    if getattr(norm, "weight", None) is None or eps is None:
        raise ValueError(f"the final norm {type(norm).__name__} has no `weight` or epsilon; fwl_head_type='output' "
                         "supports LayerNorm and RMSNorm")
    embedding = language_model.get_output_embeddings()
    weight = embedding.weight
    copy = nn.Linear(embedding.in_features, embedding.out_features, bias=embedding.bias is not None,
                     device=weight.device, dtype=weight.dtype)
    slow = DenseFWLSlowHead(
        embedding.in_features, None, copy, output_bias=output_bias, layer_norm_eps=float(eps),
        rms_norm=not isinstance(norm, nn.LayerNorm), logit_softcapping=logit_softcapping(language_model.config),
    )
    slow.to(device=weight.device, dtype=weight.dtype)
    setattr(decoder, name, nn.Identity())
    return slow, (norm, embedding)


@torch.no_grad()
def copy_output_side(slow: DenseFWLSlowHead, norm: nn.Module, embedding: nn.Linear) -> None:
    """Copies the base's final norm and output embedding into the output-side slow head (its output bias stays 0),
    and checks on a random input that the head's norm reproduces the base's (a ValueError for another form, e.g.
    Gemma's ``(1 + w)`` gain). Nothing to do on the meta device (``from_pretrained`` loads the saved values)."""
    if embedding.weight.is_meta or slow.output_embedding.weight.is_meta:
        return
    slow.output_embedding.weight.copy_(embedding.weight)
    if embedding.bias is not None:
        slow.output_embedding.bias.copy_(embedding.bias)
    slow.norm.weight.copy_(norm.weight)
    if getattr(norm, "bias", None) is not None:
        slow.norm.bias.copy_(norm.bias)
    x = torch.randn(2, slow.hidden_size, generator=torch.Generator().manual_seed(0))
    x = x.to(device=norm.weight.device, dtype=norm.weight.dtype)
    if not torch.allclose(slow.hidden_intermediates(x)["o"], norm(x), rtol=1e-4, atol=1e-5):
        raise ValueError(
            f"the base's final norm {type(norm).__name__} is not w * x / rms(x) (RMSNorm) nor a LayerNorm; "
            "fwl_head_type='output' cannot reproduce it"
        )


class FWLPreTrainedModel(StatefulPreTrainedModel):
    # FWLForCausalLM wraps the base model's cache (KV or recurrent) in an FWLCache itself.
    config_class = FWLConfig
    config: FWLConfig
    base_model_prefix = "language_model"

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)  # U, W ~ N(0, initializer_range); a, b = 0; LayerNorm gain 1, bias 0
        init_fwl_weights(module)


class FWLForCausalLM(FWLPreTrainedModel, GenerationMixin):
    r"""A causal LM whose output head is a Fast Weight Layer (Clark et al. 2022) reusing the base's output embedding.

    ``model.language_model`` is the wrapped causal LM, ``model.fwl_head`` the ``FWLHead`` (contract in DESIGN.md).
    Build one around a pretrained checkpoint with :meth:`from_base_pretrained`.
    """

    def __init__(self, config: FWLConfig, language_model: Optional[PreTrainedModel] = None) -> None:
        super().__init__(config)
        if language_model is None:
            language_model = AutoModelForCausalLM.from_config(config.text_config)
        self.language_model = language_model
        # One source of truth for the base model's settings (its attention implementation, special tokens...).
        self.config.text_config = language_model.config
        output_embedding = language_model.get_output_embeddings()
        if not isinstance(output_embedding, nn.Linear):
            raise ValueError(
                f"The base model {type(language_model).__name__} has no output embedding (`get_output_embeddings()` "
                f"returned {type(output_embedding).__name__}, expected an nn.Linear [vocab_size, hidden_size]): the "
                "FWL head computes its logits with it"
            )
        if language_model.base_model is language_model:
            raise ValueError(
                f"{type(language_model).__name__} exposes no inner decoder (`base_model_prefix`): the FWL head needs "
                "its last hidden states"
            )
        if config.fwl_head_type == "output":
            slow, base_output_side = output_side_slow_head(language_model, config.fwl_output_bias)
            self.fwl_head = FWLHead.on_slow_head(config, slow)
            self._tied_weights_keys = {}  # the head's E is its own (untied) copy
            self.post_init()
            copy_output_side(slow, *base_output_side)  # after post_init, which would draw the copy at random
            return
        self.fwl_head = FWLHead.from_config(
            config,
            DenseFWLSlowHead,
            config.text_config.hidden_size,
            output_embedding,
            logit_softcapping=logit_softcapping(config.text_config),
        )
        # E is one module reached from two places: declare the FWL's path tied to the name under which the base
        # model stores it (its input embedding's when the base model ties them).
        embedding_name = next(name for name, m in language_model.named_modules() if m is output_embedding)
        base_tied = getattr(language_model, "all_tied_weights_keys", None) or {}
        self._tied_weights_keys = {
            f"fwl_head.slow.output_embedding.{name}": "language_model."
            + base_tied.get(f"{embedding_name}.{name}", f"{embedding_name}.{name}")
            for name, _ in output_embedding.named_parameters()
        }
        self.post_init()

    @classmethod
    def from_base_pretrained(
        cls,
        pretrained_model_name_or_path: Union[str, PreTrainedModel],
        *,
        freeze_base: bool = False,
        base_model_kwargs: Optional[Dict[str, Any]] = None,
        **fwl_config,
    ) -> "FWLForCausalLM":
        """Puts a fresh FWL head on a pretrained causal LM.

        Args:
            pretrained_model_name_or_path: a hub name or folder for ``AutoModelForCausalLM.from_pretrained``, or an
                already loaded causal LM.
            freeze_base: train the FWL head only (the base model, E included, gets ``requires_grad = False``).
            base_model_kwargs: passed to ``AutoModelForCausalLM.from_pretrained`` (``dtype``, ``gguf_file``, ...).
            **fwl_config: ``FWLConfig`` fields (``fwl_intermediate_size``, ``fwl_fast_parameters``, ...).
        """
        fields = set(FWLConfig.__dataclass_fields__) - {"text_config"}
        unknown = sorted(set(fwl_config) - fields)
        if unknown:
            raise ValueError(f"Unknown FWLConfig fields {unknown}; FWL fields: "
                             f"{sorted(f for f in fields if f.startswith('fwl_'))}")
        if isinstance(pretrained_model_name_or_path, PreTrainedModel):
            base = pretrained_model_name_or_path
        else:
            base = AutoModelForCausalLM.from_pretrained(pretrained_model_name_or_path, **(base_model_kwargs or {}))
        fwl_config.setdefault("base_model_id", base_model_hub_id(base.config, pretrained_model_name_or_path))
        # A copy: building the composite config re-dispatches settings (the attention implementation) to its sub-config.
        config = FWLConfig(text_config=copy.deepcopy(base.config), **fwl_config)
        model = cls(config, language_model=base)
        model.fwl_head.to(device=base.device, dtype=base.dtype)
        if freeze_base:
            model.language_model.requires_grad_(False)
        return model

    def get_input_embeddings(self) -> nn.Module:
        return self.language_model.get_input_embeddings()

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.language_model.set_input_embeddings(value)

    def _split_dependent_outputs(self) -> Optional[str]:
        return decay_split_dependence(getattr(self, "fwl_head", None))

    def _empty_cache(self) -> FWLCache:
        """An empty ``FWLCache`` around an empty cache of the base model: ours (``_empty_cache``), or the
        ``DynamicCache`` a transformers model creates when given none."""
        language_model = self.language_model
        if hasattr(language_model, "_empty_cache"):
            return FWLCache(language_model._empty_cache())
        if language_model._supports_default_dynamic_cache():
            return FWLCache(DynamicCache(config=self.config.text_config))
        return FWLCache(None)

    def _replay_head(self, cache: FWLCache, hidden_states: torch.Tensor, input_ids: torch.LongTensor,
                     attention_mask: Optional[torch.Tensor], num_tokens: int) -> None:
        """Runs the FWL head over the first ``num_tokens`` of a recorded forward pass again, from its restored state
        (a rollback; the base cache rolls back by itself)."""
        dropped = input_ids.shape[1] - num_tokens
        self.fwl_head(
            hidden_states[:, :num_tokens],
            input_ids[:, :num_tokens],
            attention_mask=None if attention_mask is None else attention_mask[:, : attention_mask.shape[1] - dropped],
            cache_layer=cache.fwl_layer,
            logits_to_keep=1,
        )

    def get_output_embeddings(self) -> nn.Linear:
        return self.fwl_head.slow.output_embedding

    def _check_inputs(self, input_ids: Optional[torch.Tensor], attention_mask: Optional[torch.Tensor],
                      cache: Optional[FWLCache]) -> None:
        """``ValueError`` naming the argument for inputs the base model would reject late or not at all."""
        if input_ids is None:
            raise ValueError(
                "FWLForCausalLM needs `input_ids` (not only `inputs_embeds`): the FWL head learns from each position's "
                "next token"
            )
        if cache is not None and not isinstance(cache, FWLCache):
            raise ValueError(f"`cache` (`past_key_values`) must be an FWLCache (or None), got {type(cache).__name__}")
        check_token_ids(input_ids, self.config.vocab_size, "input_ids")  # before the base model sees them
        padding_mask(attention_mask, *input_ids.shape, cache.get_seq_length() if cache is not None else 0)

    def forward(
        self,
        input_ids: Optional[torch.LongTensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.LongTensor] = None,
        cache: Optional[FWLCache] = None,
        inputs_embeds: Optional[torch.Tensor] = None,
        labels: Optional[torch.LongTensor] = None,
        use_cache: Optional[bool] = None,
        output_hidden_states: Optional[bool] = None,
        return_dict: Optional[bool] = None,
        logits_to_keep: Union[int, torch.Tensor] = 0,
        past_key_values: Optional[FWLCache] = None,
        **kwargs,
    ) -> Union[CausalLMOutputWithPast, Tuple]:
        """
        Args:
            input_ids: ``[B, T]`` token ids. Required: the FWL learns from each position's next token.
            attention_mask: ``[B, T]`` or ``[B, past + T]`` padding mask; padded positions neither learn nor teach.
            cache: an ``FWLCache`` (base model cache + FWL state) to continue from, updated in place
                (``past_key_values``, its name before transformers 5.24, works too).
            labels: ``[B, T]`` ids (shifted inside; -100 ignored); with ``num_items_in_batch`` (Trainer) the loss is
                the token sum divided by that count.
            logits_to_keep: an int n keeps the last n positions' logits (0 keeps all), a tensor selects positions.
            Other arguments go to the base model.
        Returns:
            ``CausalLMOutputWithPast(loss, logits [B, T', V], cache, hidden_states)``.
        """
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        use_cache = use_cache if use_cache is not None else self.config.use_cache
        cache = resolve_cache_argument(cache, past_key_values)
        self._check_inputs(input_ids, attention_mask, cache)
        loss_kwargs = take_loss_kwargs(kwargs)
        base_kwargs = dict(kwargs)
        if output_hidden_states:
            base_kwargs["output_hidden_states"] = True
        base_kwargs[CACHE_ARGUMENT] = cache.base_cache if cache is not None else None
        outputs = self.language_model.base_model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **base_kwargs,
        )
        hidden_states = outputs[0]

        if use_cache and cache is None:
            cache = FWLCache(output_cache(outputs))
        elif cache is not None and cache.base_cache is None:
            cache.set_base_cache(output_cache(outputs))
        # assisted decoding may roll this pass back (cache_fwp.RollbackMixin)
        if cache is not None and cache.record_past:
            cache.checkpoint(input_ids.shape[1], partial(self._replay_head, cache, hidden_states, input_ids,
                                                         attention_mask))
        logits = self.fwl_head(
            hidden_states,
            input_ids,
            attention_mask=attention_mask,
            cache_layer=cache.fwl_layer if cache is not None else None,
            logits_to_keep=logits_to_keep,
        )

        loss = None
        if labels is not None:
            loss = self.loss_function(
                logits=logits, labels=labels, vocab_size=self.fwl_head.slow.vocab_size, **loss_kwargs
            )
        output = CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            hidden_states=getattr(outputs, "hidden_states", None),
            **{CACHE_ARGUMENT: cache},
        )
        return output if return_dict else output.to_tuple()
