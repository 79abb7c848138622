"""Transformer-XL parity with transformers 4.35 itself: committed fixtures (random checkpoints saved by transformers
4.35 and its outputs, see benchmarks/transfo_xl_transformers4_parity.py) converted with
``convert_transfo_xl_checkpoint``, loaded with ``AutoModelForCausalLM`` and run segment by segment from transformers 4's
zero memories, then token by token with the cache."""
import json

import pytest
import torch

from benchmarks.transfo_xl_transformers4_parity import (
    FIXTURES,
    TOLERANCE,
    VARIANTS,
    generation_differences,
    load_fixture,
    num_segments,
    segment_differences,
)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The models are tiny: one thread avoids waiting on the thread pool at every op (10-100x on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def converted(request, tmp_path_factory):
    """``(name, converted model, expected tensors)`` of one fixture variant, converted once per module."""
    model, expected = load_fixture(FIXTURES / request.param, tmp_path_factory.mktemp(request.param))
    return request.param, model, expected


def test_every_variant_has_a_fixture_recorded_with_transformers_4_35():
    assert sorted(path.name for path in FIXTURES.iterdir() if path.is_dir()) == sorted(VARIANTS)
    for name, (_, lengths) in VARIANTS.items():
        provenance = json.loads((FIXTURES / name / "provenance.json").read_text())
        assert provenance["transformers"].startswith("4.35.") and provenance["segment_lengths"] == lengths


def test_segments_carrying_memories_match_transformers_4_35(converted):
    name, model, expected = converted
    diffs = segment_differences(model, expected)
    assert len(diffs) == num_segments(expected) == len(VARIANTS[name][1]) >= 3
    assert max(diffs) <= TOLERANCE, f"{name}: max |log-prob difference| per segment {diffs}"


def test_cached_token_by_token_generation_matches_transformers_4_35(converted):
    name, model, expected = converted
    diff, same_ids = generation_differences(model, expected)
    assert diff <= TOLERANCE, f"{name}: max |log-prob difference| over the cached steps {diff}"
    assert same_ids, f"{name}: greedy generate differs from transformers 4.35's"
