"""modeling_fwp: Fast Weight Programmers as Hugging Face causal LMs.

Importing the package registers every config and model with AutoConfig / AutoModel / AutoModelForCausalLM.
"""
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .cache_fwp import FastWeightCache
from .configuration_fwl import FWLConfig
from .configuration_fwp import (
    DeltaDeltaNetConfig,
    DeltaLSTMConfig,
    DeltaMLPConfig,
    DeltaNetConfig,
    DeltaRNNConfig,
    FastWeightConfig,
    LinearTransformerConfig,
    RecurrentDeltaNetConfig,
)
from .fast_weight_layers import FAST_WEIGHT_LAYERS, register_fast_weight_layer
from .feature_maps import dpfp_feature_map, elu_feature_map, favor_feature_map
from .fwl import FWLCache, FWLHead, FWLSlowHead
from .modeling_fwp import (
    DeltaDeltaNetForCausalLM,
    DeltaDeltaNetModel,
    DeltaLSTMForCausalLM,
    DeltaLSTMModel,
    DeltaMLPForCausalLM,
    DeltaMLPModel,
    DeltaNetForCausalLM,
    DeltaNetModel,
    DeltaRNNForCausalLM,
    DeltaRNNModel,
    FastWeightForCausalLM,
    FastWeightModel,
    FastWeightPreTrainedModel,
    LinearTransformerForCausalLM,
    LinearTransformerModel,
    RecurrentDeltaNetForCausalLM,
    RecurrentDeltaNetModel,
)
from .modeling_fwl import FWLForCausalLM, FWLPreTrainedModel
from .configuration_transfo_xl import TransfoXLConfig
from .modeling_transfo_xl import TransfoXLCache, TransfoXLForCausalLM, TransfoXLModel, TransfoXLPreTrainedModel
from .convert_transfo_xl import convert_transfo_xl_checkpoint

_FAMILIES = [
    (LinearTransformerConfig, LinearTransformerModel, LinearTransformerForCausalLM),
    (DeltaNetConfig, DeltaNetModel, DeltaNetForCausalLM),
    (DeltaMLPConfig, DeltaMLPModel, DeltaMLPForCausalLM),
    (DeltaDeltaNetConfig, DeltaDeltaNetModel, DeltaDeltaNetForCausalLM),
    (DeltaRNNConfig, DeltaRNNModel, DeltaRNNForCausalLM),
    (DeltaLSTMConfig, DeltaLSTMModel, DeltaLSTMForCausalLM),
    (RecurrentDeltaNetConfig, RecurrentDeltaNetModel, RecurrentDeltaNetForCausalLM),
    (TransfoXLConfig, TransfoXLModel, TransfoXLForCausalLM),
]


def _register_auto_classes() -> None:
    for config_cls, model_cls, lm_cls in _FAMILIES:
        AutoConfig.register(config_cls.model_type, config_cls, exist_ok=True)
        AutoModel.register(config_cls, model_cls, exist_ok=True)
        AutoModelForCausalLM.register(config_cls, lm_cls, exist_ok=True)
    # FWL head on any causal LM (Clark et al. 2022): a causal LM only, no bare model.
    AutoConfig.register(FWLConfig.model_type, FWLConfig, exist_ok=True)
    AutoModelForCausalLM.register(FWLConfig, FWLForCausalLM, exist_ok=True)


_register_auto_classes()

__all__ = [
    "TransfoXLConfig",
    "TransfoXLModel",
    "TransfoXLForCausalLM",
    "TransfoXLPreTrainedModel",
    "TransfoXLCache",
    "convert_transfo_xl_checkpoint",
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
    "DeltaMLPConfig",
    "DeltaMLPModel",
    "DeltaMLPForCausalLM",
    "DeltaDeltaNetConfig",
    "DeltaDeltaNetModel",
    "DeltaDeltaNetForCausalLM",
    "DeltaRNNConfig",
    "DeltaRNNModel",
    "DeltaRNNForCausalLM",
    "DeltaLSTMConfig",
    "DeltaLSTMModel",
    "DeltaLSTMForCausalLM",
    "RecurrentDeltaNetConfig",
    "RecurrentDeltaNetModel",
    "RecurrentDeltaNetForCausalLM",
    "FWLConfig",
    "FWLForCausalLM",
    "FWLPreTrainedModel",
    "FWLHead",
    "FWLSlowHead",
    "FWLCache",
    "FAST_WEIGHT_LAYERS",
    "register_fast_weight_layer",
    "dpfp_feature_map",
    "elu_feature_map",
    "favor_feature_map",
]
