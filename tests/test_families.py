"""The family table (modeling_fwp.families) drives Auto registration, ``__all__``, the model cards and the training
scripts' maps: every row must reach each of them, and nothing may be registered or styled outside it."""
import pytest
from transformers import AutoModel, AutoModelForCausalLM, PreTrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

import model_cards
import modeling_fwp
from model_cards import generator, hub
from modeling_fwp import FAST_WEIGHT_LAYERS
from modeling_fwp.families import FAMILIES, FWL_CARD_SUFFIX, FamilySpec
from training import synthetic

from conftest import tiny_config

CARD_KEYS = {key: (spec, key.endswith(FWL_CARD_SUFFIX)) for spec in FAMILIES for key in spec.card_facts()}


def _tiny_family_config(spec: FamilySpec, use_fwl: bool) -> PreTrainedConfig:
    if spec.model_class is None:  # a head on another causal LM (the FWL): nest a tiny Delta Net
        return spec.config_class(text_config=tiny_config(modeling_fwp.DeltaNetConfig).to_dict())
    return tiny_config(spec.config_class, **({"use_fwl": True} if use_fwl else {}))


@pytest.mark.parametrize("spec", FAMILIES, ids=lambda spec: spec.name)
def test_family_is_registered_and_exported(spec):
    assert spec.model_type.startswith("fwp_") and spec.name
    assert CONFIG_MAPPING[spec.model_type] is spec.config_class
    assert AutoModelForCausalLM._model_mapping[spec.config_class] is spec.causal_lm_class
    if spec.model_class is None:
        assert spec.config_class not in AutoModel._model_mapping
    else:
        assert AutoModel._model_mapping[spec.config_class] is spec.model_class
        assert spec.model_class.config_class is spec.config_class
        assert getattr(spec.causal_lm_class, "base_model_class", spec.model_class) is spec.model_class
    assert spec.causal_lm_class.config_class is spec.config_class
    for cls in spec.classes():
        assert cls.__name__ in modeling_fwp.__all__
        assert getattr(modeling_fwp, cls.__name__) is cls
    if spec.fast_weight_layer is not None:
        assert spec.fast_weight_layer in FAST_WEIGHT_LAYERS


def test_table_lists_every_registered_family_once():
    model_types = [spec.model_type for spec in FAMILIES]
    assert len(set(model_types)) == len(model_types)
    assert len({spec.name for spec in FAMILIES}) == len(FAMILIES)
    assert set(hub.registered_families()) == set(model_types)  # no family registered outside the table


@pytest.mark.parametrize("key", sorted(CARD_KEYS))
def test_family_has_a_card(key):
    spec, use_fwl = CARD_KEYS[key]
    assert key in generator.CARD_STYLES, f"family {spec.name!r} has no card style for {key!r}"
    config = _tiny_family_config(spec, use_fwl)
    config.architectures = [spec.causal_lm_class.__name__]
    config_dict = config.to_dict()
    assert generator.family_key(config_dict) == key
    card = model_cards.build_card(config_dict)
    facts = spec.card_facts()[key]
    body = str(card)
    assert f"# {facts.title}" in body
    assert generator.NO_RESULTS_NOTE in body
    assert set(generator.CARD_STYLES[key].tags) <= set(card.data.tags)
    values = {**config_dict.get("text_config", {}), **config_dict}
    for description in (facts.slow_net, facts.update_rule, facts.fast_net):
        assert generator._format(description, values) in body


def test_card_styles_belong_to_the_table():
    assert set(generator.CARD_STYLES) == set(CARD_KEYS)
    assert set(generator.FAMILIES) == set(CARD_KEYS)


def test_synthetic_map_covers_the_table():
    fast_weight_families = [spec for spec in FAMILIES if spec.fast_weight_layer is not None]
    assert {name: t for name, t in synthetic.MODEL_TYPES.items() if name != "llama"} == {
        spec.name: spec.model_type for spec in fast_weight_families
    }
    for spec in fast_weight_families:
        model = synthetic.build_model(spec.name, vocab_size=11, hidden_size=8, num_layers=1, num_heads=2,
                                      max_length=16)
        assert type(model) is spec.causal_lm_class


def test_rfwp_benchmark_times_every_fast_weight_family():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_rfwp.py"
    spec = importlib.util.spec_from_file_location("bench_rfwp", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    fast_weight_families = [family for family in FAMILIES if family.fast_weight_layer is not None]
    assert list(bench.MODELS.values()) == [family.config_class for family in fast_weight_families]
    # the paper's figures and the targets are keyed by titles of the table (a renamed title would drop a row)
    assert set(bench.PAPER_WORDS_PER_S) | set(bench.TARGETS) | {"Delta Net"} <= set(bench.MODELS)
