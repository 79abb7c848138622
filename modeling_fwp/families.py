"""The model families of this package, in one table.

Each :class:`FamilySpec` names a family's config class, its bare model class (None for a head-only family such as
the FWL), its causal-LM class and the facts a model card states about it (:class:`ModelFacts`: the paper's names
for the slow net, update rule and fast net, and the BibTeX keys of ``model_cards/templates/citations.bib``).
Everything else is read from the classes: the model type, the short name scripts use (the model type without its
``fwp_`` prefix), the fast-weight layer (the config's ``fast_weight_layer``) and the card key (the causal-LM
class name without ``ForCausalLM``, as ``config.json``'s ``architectures`` records it).

The package ``__init__`` registers every family with ``AutoConfig`` / ``AutoModel`` / ``AutoModelForCausalLM``
and exports its classes from this table; ``model_cards`` adds the presentation (template, tags) per card key and
``training.synthetic`` its map of short names. A new family is one row here (and its classes).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

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
from .configuration_transfo_xl import TransfoXLConfig
from .modeling_fwl import FWLForCausalLM
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
    GatedDeltaNetForCausalLM,
    GatedDeltaNetModel,
    LinearTransformerForCausalLM,
    LinearTransformerModel,
    RecurrentDeltaNetForCausalLM,
    RecurrentDeltaNetModel,
)
from .modeling_transfo_xl import TransfoXLForCausalLM, TransfoXLModel

MODEL_TYPE_PREFIX = "fwp_"
FWL_CARD_SUFFIX = "+FWL"  # the card key of a Transformer-XL with ``use_fwl=True``


@dataclass(frozen=True)
class ModelFacts:
    """What a model card says a family is. ``slow_net``, ``update_rule`` and ``fast_net`` are format strings over
    the config's fields (``{version}``, ``{fast_net_depth}``); ``citations`` are keys of ``citations.bib``."""

    title: str
    slow_net: str
    update_rule: str
    fast_net: str
    citations: Tuple[str, ...]


@dataclass(frozen=True)
class FamilySpec:
    """One model family: its classes and card facts. ``facts_with_fwl``: the facts of a config with ``use_fwl``
    set (Transformer-XL with a Fast Weight Layer head), a card of its own."""

    config_class: type
    model_class: Optional[type]
    causal_lm_class: type
    facts: ModelFacts
    facts_with_fwl: Optional[ModelFacts] = None

    @property
    def model_type(self) -> str:
        return self.config_class.model_type

    @property
    def name(self) -> str:
        """The short name scripts use (``training.synthetic --model delta_net``)."""
        return self.model_type[len(MODEL_TYPE_PREFIX):]

    @property
    def fast_weight_layer(self) -> Optional[str]:
        """The ``FAST_WEIGHT_LAYERS`` name the family's layers use; None for a family without one."""
        if not issubclass(self.config_class, FastWeightConfig):
            return None
        return getattr(self.config_class, "fast_weight_layer", "linear")

    @property
    def card_key(self) -> str:
        """The architecture name without its head suffix (``DeltaNetForCausalLM`` -> ``DeltaNet``)."""
        return self.causal_lm_class.__name__[: -len("ForCausalLM")]

    def card_facts(self) -> Dict[str, ModelFacts]:
        """Card key -> facts, for every card this family has."""
        facts = {self.card_key: self.facts}
        if self.facts_with_fwl is not None:
            facts[self.card_key + FWL_CARD_SUFFIX] = self.facts_with_fwl
        return facts

    def classes(self) -> List[type]:
        """The public classes of the family: config, bare model (when there is one), causal LM."""
        return [cls for cls in (self.config_class, self.model_class, self.causal_lm_class) if cls is not None]


_DELTA = "delta rule (W += beta (v - W phi(k)) phi(k)^T)"
_RFWP_CITATIONS = ("irie2021going", "schlag2021linear")
_FWL_UPDATE = "one gradient step on the losses of all earlier tokens, learned step sizes"
_FWL_HEAD = "FWL head (MLP + LayerNorm, {fwl_intermediate_size} hidden units)"
_TRANSFO_XL = "Transformer-XL (softmax attention over segment and memory)"


def _rfwp(title: str, fast_net: str, slow_net: str = "feedforward") -> ModelFacts:
    return ModelFacts(title, slow_net, _DELTA, fast_net, _RFWP_CITATIONS)


FAMILIES: Tuple[FamilySpec, ...] = (
    FamilySpec(
        LinearTransformerConfig, LinearTransformerModel, LinearTransformerForCausalLM,
        ModelFacts("Linear Transformer", "feedforward", "sum rule (W += v phi(k)^T)", "linear",
                   ("katharopoulos2020transformers", "schlag2021linear")),
    ),
    FamilySpec(
        DeltaNetConfig, DeltaNetModel, DeltaNetForCausalLM,
        ModelFacts("Delta Net", "feedforward", _DELTA, "linear", ("schlag2021linear",)),
    ),
    FamilySpec(
        GatedDeltaNetConfig, GatedDeltaNetModel, GatedDeltaNetForCausalLM,
        ModelFacts("Gated DeltaNet", "feedforward", "gated delta rule (W = a W + beta (v - a W k) k^T, a = exp(g))",
                   "linear", ("yang2025gated", "schlag2021linear")),
    ),
    FamilySpec(DeltaMLPConfig, DeltaMLPModel, DeltaMLPForCausalLM, _rfwp("Delta MLP", "MLP ({fast_net_depth} layers)")),
    FamilySpec(
        DeltaDeltaNetConfig, DeltaDeltaNetModel, DeltaDeltaNetForCausalLM, _rfwp("Delta-Delta Net", "Delta Net"),
    ),
    FamilySpec(DeltaRNNConfig, DeltaRNNModel, DeltaRNNForCausalLM, _rfwp("Delta RNN", "RNN (version {version})")),
    FamilySpec(DeltaLSTMConfig, DeltaLSTMModel, DeltaLSTMForCausalLM, _rfwp("Delta LSTM", "LSTM (version {version})")),
    FamilySpec(
        RecurrentDeltaNetConfig, RecurrentDeltaNetModel, RecurrentDeltaNetForCausalLM,
        _rfwp("Recurrent Delta Net", "linear", slow_net="recurrent"),
    ),
    FamilySpec(
        TransfoXLConfig, TransfoXLModel, TransfoXLForCausalLM,
        ModelFacts("Transformer-XL", _TRANSFO_XL, "none", "none", ("dai2019transformer",)),
        facts_with_fwl=ModelFacts("Transformer-XL with a Fast Weight Layer", _TRANSFO_XL, _FWL_UPDATE, _FWL_HEAD,
                                  ("dai2019transformer", "clark2022meta")),
    ),
    # FWL head on any causal LM (Clark et al. 2022): a causal LM only, no bare model.
    FamilySpec(
        FWLConfig, None, FWLForCausalLM,
        ModelFacts("Fast Weight Layer on a pretrained language model", "the pretrained base language model",
                   _FWL_UPDATE, _FWL_HEAD, ("clark2022meta",)),
    ),
)

