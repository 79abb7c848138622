"""modeling_fwp: Fast Weight Programmers as Hugging Face causal LMs.

Importing the package registers every config and model with AutoConfig / AutoModel / AutoModelForCausalLM.
"""
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .cache_fwp import FastWeightCache
from .configuration_fwp import DeltaNetConfig, FastWeightConfig, LinearTransformerConfig
from .fast_weight_layers import FAST_WEIGHT_LAYERS, register_fast_weight_layer
from .feature_maps import dpfp_feature_map, elu_feature_map, favor_feature_map
from .modeling_fwp import (
    DeltaNetForCausalLM,
    DeltaNetModel,
    FastWeightForCausalLM,
    FastWeightModel,
    FastWeightPreTrainedModel,
    LinearTransformerForCausalLM,
    LinearTransformerModel,
)

_FAMILIES = [
    (LinearTransformerConfig, LinearTransformerModel, LinearTransformerForCausalLM),
    (DeltaNetConfig, DeltaNetModel, DeltaNetForCausalLM),
]


def _register_auto_classes() -> None:
    for config_cls, model_cls, lm_cls in _FAMILIES:
        AutoConfig.register(config_cls.model_type, config_cls, exist_ok=True)
        AutoModel.register(config_cls, model_cls, exist_ok=True)
        AutoModelForCausalLM.register(config_cls, lm_cls, exist_ok=True)


_register_auto_classes()

__all__ = [
    "FastWeightCache",
    "FastWeightConfig",
    "FastWeightModel",
    "FastWeightForCausalLM",
    "FastWeightPreTrainedModel",
    "LinearTransformerConfig",
    "LinearTransformerModel",
    "LinearTransformerForCausalLM",
    "DeltaNetConfig",
    "DeltaNetModel",
    "DeltaNetForCausalLM",
    "FAST_WEIGHT_LAYERS",
    "register_fast_weight_layer",
    "dpfp_feature_map",
    "elu_feature_map",
    "favor_feature_map",
]
