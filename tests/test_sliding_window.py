"""Sliding-window evaluation (training.eval_lm, ``--eval_mode sliding_window``) against references written here.

The papers' protocol (Schlag et al. 2021 sec. 6.3; Irie et al. 2021 app. A.1): no state carried between windows,
every token predicted from at most the previous ``window`` tokens, each window after the first scoring its last
``stride`` positions, every token scored exactly once.
"""
from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from modeling_fwp import DeltaLSTMConfig, DeltaNetConfig
from tests.conftest import tiny_model
from training import eval_lm


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128)
    return LlamaForCausalLM(config).eval()


MODELS = {
    "delta_net": lambda: tiny_model(DeltaNetConfig),
    "delta_lstm": lambda: tiny_model(DeltaLSTMConfig),
    "llama": tiny_llama,
}


def stream(n: int) -> torch.Tensor:
    return torch.randint(3, 61, (n,), generator=torch.Generator().manual_seed(n))


@torch.no_grad()
def log_prob(model, context: torch.Tensor, target: int) -> float:
    """log p(target | context) from one plain forward over `context` alone."""
    logits = model(input_ids=context[None], use_cache=False).logits[0, -1]
    return float(torch.log_softmax(logits.double(), -1)[target])


def per_token_reference(model, ids: torch.Tensor, window: int) -> float:
    """Stride 1, token by token: position i is predicted from ids[max(0, i + 1 - window) : i + 1]."""
    return -sum(log_prob(model, ids[max(0, i + 1 - window) : i + 1], int(ids[i + 1])) for i in range(len(ids) - 1))


@torch.no_grad()
def window_loop_reference(model, ids: torch.Tensor, window: int, stride: int) -> tuple:
    """Windows ending at window, window + stride, ... (the last at len - 1), each a plain forward of batch 1; the
    first scores all its positions, each later one the positions after the previous window's end."""
    nll, count, prev_end, end = 0.0, 0, 0, min(window, len(ids) - 1)
    while True:
        start = max(0, end - window)
        logits = model(input_ids=ids[None, start:end], use_cache=False).logits[0].double()
        log_probs = torch.log_softmax(logits, -1)
        for pos in range(prev_end, end):
            nll -= float(log_probs[pos - start, ids[pos + 1]])
            count += 1
        if end == len(ids) - 1:
            return nll, count
        prev_end, end = end, min(end + stride, len(ids) - 1)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_stride_one_equals_per_token_context_of_window_tokens(name):
    model, ids = MODELS[name](), stream(23)
    result = eval_lm.score_sliding_window(model, ids, window_size=6, stride=1, batch_size=4)
    assert result.num_tokens == 22
    assert result.nll_sum == pytest.approx(per_token_reference(model, ids, 6), rel=1e-5)


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("n, window, stride", [(30, 8, 3), (31, 8, 8), (12, 8, 5), (6, 8, 2)])
def test_strided_windows_equal_the_window_loop(name, n, window, stride):
    """stride < window with a last partial window (30 tokens: 7 + 3 * 7 + 1), non-overlapping windows, and a stream
    shorter than one window."""
    model, ids = MODELS[name](), stream(n)
    nll, count = window_loop_reference(model, ids, window, stride)
    for batch_size in (1, 3):
        result = eval_lm.score_sliding_window(model, ids, window, stride, batch_size=batch_size)
        assert result.num_tokens == count == n - 1
        assert result.nll_sum == pytest.approx(nll, rel=1e-5)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_one_window_over_the_whole_sequence_is_the_plain_loss(name):
    model, ids = MODELS[name](), stream(17)
    result = eval_lm.score_sliding_window(model, ids, window_size=16, stride=16)
    with torch.no_grad():
        loss = model(input_ids=ids[None], labels=ids[None], use_cache=False).loss
    assert result.num_tokens == 16
    assert result.loss == pytest.approx(float(loss), rel=1e-5)


def test_context_is_limited_to_the_window():
    """A Delta Net's sliding-window score differs from its carried-state score (the state is not carried), and a
    longer window changes it."""
    model, ids = MODELS["delta_net"](), stream(40)
    short = eval_lm.score_sliding_window(model, ids, 4, 1).nll_sum
    assert eval_lm.score_sliding_window(model, ids, 39, 39).nll_sum != pytest.approx(short, rel=1e-4)
    assert eval_lm.score_stream(model, ids[None], 4).nll_sum != pytest.approx(short, rel=1e-4)


def test_windows_cover_every_position_once():
    for n, window, stride in [(2, 1, 1), (100, 16, 5), (100, 16, 16), (17, 16, 3), (5, 16, 2)]:
        positions = [p for _, end, first in eval_lm.sliding_windows(n, window, stride) for p in range(first, end)]
        assert positions == list(range(n - 1))
        assert all(end - start <= window for start, end, _ in eval_lm.sliding_windows(n, window, stride))


@pytest.mark.parametrize("argv, message", [
    (["--eval_mode", "sliding_window", "--window_size", "4", "--stride", "5"], "--stride"),
    (["--eval_mode", "sliding_window", "--stride", "0"], "--stride"),
    (["--eval_mode", "sliding_window", "--dynamic_eval"], "--dynamic_eval"),
    (["--window_size", "8"], "--window_size"),
])
def test_bad_options_name_the_option(argv, message):
    with pytest.raises(ValueError, match=message):
        eval_lm.parse_args(["--model_name_or_path", "m"] + argv)
    with pytest.raises(ValueError, match="stride"):
        list(eval_lm.sliding_windows(10, 4, 5))


def test_eval_lm_command_scores_a_saved_model_with_sliding_windows(tmp_path, word_tokenizer):
    model = tiny_model(DeltaNetConfig, vocab_size=len(word_tokenizer))
    model.save_pretrained(tmp_path / "model")
    word_tokenizer.save_pretrained(tmp_path / "model")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "test.txt").write_text("the cat sat on the mat\n\na dog sat fast\n\n" * 3)
    argv = ["--model_name_or_path", str(tmp_path / "model"), "--data_dir", str(tmp_path / "data"),
            "--eval_mode", "sliding_window", "--window_size", "6", "--stride", "2"]
    (result,) = eval_lm.main(argv)
    ids = eval_lm.encode_stream(word_tokenizer, eval_lm.read_documents(tmp_path / "data" / "test.txt"))
    nll, count = window_loop_reference(model, ids, 6, 2)
    assert result["tokens"] == count and result["window_size"] == 6 and result["stride"] == 2
    assert result["perplexity"] == pytest.approx(math.exp(nll / count), rel=1e-3)
