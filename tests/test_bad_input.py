"""Bad input raises a ValueError naming the argument, for every family of the table (issue 21, item 9): empty or
float ``input_ids``, an attention mask holding values other than 0/1, and non-positive sizes in a config."""
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import modeling_fwp
from modeling_fwp.families import FAMILIES, FamilySpec

from conftest import tiny_config

TINY_LLAMA = dict(
    vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
    num_key_value_heads=4, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)


def _config(spec: FamilySpec, **sizes):
    """A tiny config of `spec`'s family with `sizes` overridden (for the FWL head: in its base model's config)."""
    if spec.model_class is None:  # the FWL head on a causal LM: a tiny Llama, which checks no sizes of its own
        return spec.config_class(text_config=LlamaConfig(**{**TINY_LLAMA, **sizes}).to_dict())
    return tiny_config(spec.config_class, **sizes)


@pytest.fixture(scope="module", params=FAMILIES, ids=lambda spec: spec.name)
def family_model(request):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(_config(request.param)).eval()


IDS = torch.tensor([[5, 6, 7]])
BAD_INPUTS = {
    "empty input_ids": (dict(input_ids=torch.zeros(1, 0, dtype=torch.long)), "input_ids"),
    "empty rows": (dict(input_ids=torch.zeros(0, 3, dtype=torch.long)), "input_ids"),
    "float input_ids": (dict(input_ids=IDS.float()), "input_ids"),
    "bool input_ids": (dict(input_ids=IDS > 5), "input_ids"),
    "input_ids past the vocabulary (61)": (dict(input_ids=torch.tensor([[5, 61, 7]])), "input_ids"),
    "negative input_ids": (dict(input_ids=torch.tensor([[5, -1, 7]])), "input_ids"),
    "mask holding 2": (dict(input_ids=IDS, attention_mask=torch.tensor([[1, 2, 1]])), "attention_mask"),
    "mask holding -1": (dict(input_ids=IDS, attention_mask=torch.tensor([[0, 1, -1]])), "attention_mask"),
    "mask holding 0.5": (dict(input_ids=IDS, attention_mask=torch.tensor([[0.5, 1.0, 1.0]])), "attention_mask"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_raises_value_error_naming_the_argument(family_model, case):
    inputs, argument = BAD_INPUTS[case]
    with torch.no_grad(), pytest.raises(ValueError, match=f"`{argument}`"):
        family_model(**inputs)


def test_good_input_still_runs(family_model):
    """The checks refuse only bad input: 0/1 masks (long, bool, float) give the logits of the same real tokens."""
    with torch.no_grad():
        reference = family_model(input_ids=IDS).logits
        for mask in (torch.ones(1, 3, dtype=torch.long), torch.ones(1, 3, dtype=torch.bool), torch.ones(1, 3)):
            torch.testing.assert_close(family_model(input_ids=IDS, attention_mask=mask).logits, reference)
        padded = family_model(input_ids=torch.tensor([[0, 5, 6, 7]]), attention_mask=torch.tensor([[0, 1, 1, 1]]))
        assert torch.isfinite(padded.logits).all()


SIZES = {"vocab_size": 0, "hidden_size": 0, "num_hidden_layers": 0, "intermediate_size": -4, "num_attention_heads": 0}


@pytest.mark.parametrize("spec", FAMILIES, ids=lambda spec: spec.name)
@pytest.mark.parametrize("field", sorted(SIZES))
def test_non_positive_size_is_refused(spec, field):
    if spec.model_class is None and field not in ("vocab_size", "hidden_size"):
        pytest.skip("the FWL head checks the two sizes of its base model that it uses")
    with pytest.raises(ValueError, match=f"{field}` must be an int >= 1"):
        _config(spec, **{field: SIZES[field]})


def test_fast_weight_config_refuses_zero_sizes_of_its_own():
    for field in ("max_position_embeddings", "head_dim"):
        with pytest.raises(ValueError, match=f"`{field}`"):
            tiny_config(modeling_fwp.DeltaNetConfig, **{field: 0})
