"""Assisted and prompt-lookup decoding: the cache rolls back rejected drafts, and the output is plain greedy decoding's.

``generate(assistant_model=...)`` / ``generate(prompt_lookup_num_tokens=...)`` verify several draft tokens in one
forward pass and crop the cache back to the accepted ones (``cache_fwp.RollbackMixin``: a checkpoint per forward pass,
restored and replayed). The tests check the tokens, that drafts were really rejected (so rollbacks ran), and that the
final cache equals plain greedy decoding's.
"""
from __future__ import annotations

import tempfile

import pytest
import torch

from modeling_fwp import DeltaLSTMConfig, DeltaNetConfig, FastWeightCache, convert_fla_checkpoint
from modeling_fwp.cache_fwp import RollbackMixin

from conftest import FIXTURES, tiny_model
from test_fwl import tiny_fwl
from test_transfo_xl import fwl_model



def converted_fla(name: str):
    """The tiny flash-linear-attention 0.6 checkpoint `name` of tests/fixtures/fla_0_6 (short convolutions, whose
    windows the rollback must restore; the Gated DeltaNet's decay), converted as test_fla.py converts it."""
    with tempfile.TemporaryDirectory() as folder:
        return convert_fla_checkpoint(FIXTURES / "fla_0_6" / name, folder)


# Larger initial weights than the default, so that the tiny models do not repeat one token forever.
MODELS = {
    "DeltaNet": lambda seed: tiny_model(DeltaNetConfig, seed=seed, initializer_range=0.5,
                                        position_embedding_type="sinusoidal"),  # positions continue from the cache
    "DeltaLSTM": lambda seed: tiny_model(DeltaLSTMConfig, seed=seed, initializer_range=0.5),
    "FWL(Llama)": lambda seed: tiny_fwl("llama", seed=seed),
    "TransfoXL+FWL": lambda seed: fwl_model(seed=seed, fwl_decay_init=None),  # a decay depends on the splitting
    "fla DeltaNet": lambda seed: converted_fla("delta_net"),  # fixed weights: the seed is not used
    "fla GatedDeltaNet": lambda seed: converted_fla("gated_deltanet"),
}
CASES = [
    ("DeltaNet", "prompt_lookup"), ("DeltaNet", "assistant"), ("DeltaLSTM", "assistant"),
    ("FWL(Llama)", "prompt_lookup"), ("FWL(Llama)", "assistant"), ("TransfoXL+FWL", "prompt_lookup"),
    ("fla DeltaNet", "prompt_lookup"), ("fla DeltaNet", "assistant"),
    ("fla GatedDeltaNet", "prompt_lookup"), ("fla GatedDeltaNet", "assistant"),
]


def perturbed_copy(family: str, scale: float = 1.0):
    """The model of `family` with noise on every weight: an assistant that agrees with it on some tokens only."""
    model = MODELS[family](0)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * p.std().nan_to_num(0.0) * torch.randn(p.shape, generator=generator))
    return model


def repetitive_prompt(vocab_size: int) -> torch.Tensor:
    """A prompt that repeats itself, so that prompt lookup finds drafts."""
    ids = torch.randint(3, vocab_size, (1, 8), generator=torch.Generator().manual_seed(7))
    return torch.cat([ids, ids, ids[:, :5]], dim=1)


def cache_tensors(cache) -> dict:
    """Every state tensor of a cache (an FWLCache's base cache included) and its per-row token counts, by name."""
    found = {}
    for i, layer in enumerate(cache.layers):
        found.update({f"{i}.{name}": t for name, t in getattr(layer, "states", {}).items()})
        for name in ("keys", "values"):
            if getattr(layer, name, None) is not None:
                found[f"{i}.{name}"] = getattr(layer, name)
    if getattr(cache, "token_counts", None) is not None:
        found["token_counts"] = cache.token_counts
    base = getattr(cache, "base_cache", None)
    if base is not None:
        found.update({f"base.{name}": t for name, t in cache_tensors(base).items()})
    return found


@pytest.fixture
def crops(monkeypatch):
    """The token counts passed to every recording cache's ``crop``."""
    seen = []
    crop = RollbackMixin.crop

    def recording_crop(self, tokens_to_remove):
        seen.append(tokens_to_remove)
        return crop(self, tokens_to_remove)

    monkeypatch.setattr(RollbackMixin, "crop", recording_crop)
    return seen


@pytest.mark.parametrize("family, mode", CASES)
def test_assisted_decoding_equals_greedy(family, mode, crops):
    model = MODELS[family](0)
    ids = repetitive_prompt(model.config.get_text_config().vocab_size)
    settings = dict(max_new_tokens=10, do_sample=False, return_dict_in_generate=True)
    greedy = model.generate(ids, **settings)
    drafts = {"prompt_lookup_num_tokens": 3} if mode == "prompt_lookup" else {"assistant_model": perturbed_copy(family)}
    assisted = model.generate(ids, **drafts, **settings)
    assert torch.equal(assisted.sequences, greedy.sequences)
    assert any(n < 0 for n in crops), "no draft was rejected: the rollback was not exercised"
    final, reference = cache_tensors(assisted.cache), cache_tensors(greedy.cache)
    assert final.keys() == reference.keys()
    if isinstance(assisted.cache, FastWeightCache):  # every token but the last generated one went through the model
        assert final["token_counts"].tolist() == [assisted.sequences.shape[1] - 1]
    for name, tensor in reference.items():
        torch.testing.assert_close(final[name], tensor, rtol=1e-5, atol=1e-6, msg=name)


def test_assisted_decoding_refuses_a_model_whose_outputs_depend_on_the_splitting():
    model = fwl_model(fwl_decay_init=0.7)  # the FWL update decays at every forward-pass boundary
    ids = repetitive_prompt(model.config.vocab_size)
    with pytest.raises(ValueError, match="fwl_decay_init"):
        model.generate(ids, max_new_tokens=4, do_sample=False, prompt_lookup_num_tokens=3)


class ToyStatefulModel:
    """Writes two kinds of state into a ``FastWeightCache`` layer, as a model would: a running sum and a short window
    of the last inputs (a short-convolution state); records a checkpoint per call, with its replay."""

    def __init__(self, cache: FastWeightCache) -> None:
        self.cache = cache

    def __call__(self, x: torch.Tensor) -> None:  # x [1, T]
        self.cache.checkpoint(x.shape[1], lambda k: self(x[:, :k]))
        state = self.cache.get_state(0) or {"sum": torch.zeros(1), "window": torch.zeros(1, 3)}
        window = torch.cat([state["window"], x], dim=1)[:, -3:]
        self.cache.set_state(0, {"sum": state["sum"] + x.sum(1), "window": window}, x.shape[1])


# transformers >= 5.25 passes the number of draft tokens (`recurrent_states_to_keep`); a replay rolls back any number
@pytest.mark.parametrize("recording", [{}, {"recurrent_states_to_keep": 1}, {"recurrent_states_to_keep": 3}])
@pytest.mark.parametrize("tokens_to_remove", [0, 1, 2, 3, 5, 6])
def test_crop_restores_any_state_across_forward_passes(tokens_to_remove, recording):
    x = torch.arange(1.0, 8.0)[None]  # 7 tokens in passes of 3, 1 and 3 (the crop may reach back over passes)
    cache = FastWeightCache(1)
    cache.activate_past_recording(**recording)
    model = ToyStatefulModel(cache)
    for part in (x[:, :3], x[:, 3:4], x[:, 4:]):
        model(part)
    cache.crop(-tokens_to_remove)
    kept = 7 - tokens_to_remove
    expected = FastWeightCache(1)
    ToyStatefulModel(expected)(x[:, :kept])
    assert cache.get_seq_length() == kept
    for name, tensor in expected.get_state(0).items():
        assert torch.equal(cache.get_state(0)[name], tensor), name


def test_crop_refuses_what_was_not_recorded():
    cache = FastWeightCache(1)
    model = ToyStatefulModel(cache)
    model(torch.ones(1, 2))
    assert not cache.is_croppable
    with pytest.raises(ValueError, match="activate_past_recording"):
        cache.crop(-1)
    cache.activate_past_recording()
    model(torch.ones(1, 2))
    assert cache.is_croppable
    with pytest.raises(ValueError, match="recorded only the last 2"):
        cache.crop(-3)
    with pytest.raises(ValueError, match="minus the number of tokens"):
        cache.crop(1)
    cache.crop(-2)
    assert cache.get_seq_length() == 2
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="recurrent_states_to_keep"):
            cache.activate_past_recording(recurrent_states_to_keep=bad)
