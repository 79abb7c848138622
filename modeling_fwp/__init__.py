"""modeling_fwp: Fast Weight Programmers as Hugging Face causal LMs.

Importing the package registers every config and model with AutoConfig / AutoModel / AutoModelForCausalLM.
"""
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForSeq2SeqLM

from .cache_fwp import FastWeightCache
from .configuration_fwl import FWLConfig
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
    GatedDeltaNetForCausalLM,
    GatedDeltaNetModel,
    LinearTransformerForCausalLM,
    LinearTransformerModel,
    RecurrentDeltaNetForCausalLM,
    RecurrentDeltaNetModel,
)
from .modeling_fwl import FWLForCausalLM, FWLPreTrainedModel
from .configuration_transfo_xl import TransfoXLConfig
from .modeling_transfo_xl import TransfoXLCache, TransfoXLForCausalLM, TransfoXLModel, TransfoXLPreTrainedModel
from .convert_transfo_xl import convert_transfo_xl_checkpoint
from .convert_fla import convert_fla_checkpoint
from .recurrent_core import FastWeightRecurrentCore
from .configuration_fwp_seq2seq import FastWeightSeq2SeqConfig
from .modeling_fwp_seq2seq import (
    FastWeightSeq2SeqCache,
    FastWeightSeq2SeqForConditionalGeneration,
    FastWeightSeq2SeqModel,
    FastWeightSeq2SeqPreTrainedModel,
)
from .tokenization import gpt2_tokenizer

from .families import FAMILIES


def _register_auto_classes() -> None:
    """Registers every family of ``families.FAMILIES`` with AutoConfig / AutoModel (when it has a bare model) /
    AutoModelForCausalLM."""
    for spec in FAMILIES:
        AutoConfig.register(spec.model_type, spec.config_class, exist_ok=True)
        if spec.model_class is not None:
            AutoModel.register(spec.config_class, spec.model_class, exist_ok=True)
        AutoModelForCausalLM.register(spec.config_class, spec.causal_lm_class, exist_ok=True)


_register_auto_classes()
# The encoder-decoder (Schlag et al. 2021 sec. 6.2) is not a causal-LM family of families.FAMILIES.
AutoConfig.register(FastWeightSeq2SeqConfig.model_type, FastWeightSeq2SeqConfig, exist_ok=True)
AutoModel.register(FastWeightSeq2SeqConfig, FastWeightSeq2SeqModel, exist_ok=True)
AutoModelForSeq2SeqLM.register(FastWeightSeq2SeqConfig, FastWeightSeq2SeqForConditionalGeneration, exist_ok=True)

# Each family's classes (families.FAMILIES), then the shared classes and helpers.
__all__ = [cls.__name__ for spec in FAMILIES for cls in spec.classes()] + [
    "TransfoXLPreTrainedModel",
    "TransfoXLCache",
    "convert_transfo_xl_checkpoint",
    "convert_fla_checkpoint",
    "FastWeightCache",
    "FastWeightConfig",
    "FastWeightModel",
    "FastWeightForCausalLM",
    "FastWeightPreTrainedModel",
    "FastWeightRecurrentCore",
    "FastWeightSeq2SeqConfig",
    "FastWeightSeq2SeqModel",
    "FastWeightSeq2SeqForConditionalGeneration",
    "FastWeightSeq2SeqPreTrainedModel",
    "FastWeightSeq2SeqCache",
    "FWLPreTrainedModel",
    "FWLHead",
    "FWLSlowHead",
    "FWLCache",
    "FAST_WEIGHT_LAYERS",
    "register_fast_weight_layer",
    "dpfp_feature_map",
    "elu_feature_map",
    "favor_feature_map",
    "gpt2_tokenizer",
]
