"""Fast Weight Layers (Clark et al. 2022): the head contract, causality, generation, wrapping, saving, bad input."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call
from transformers import (
    AutoModelForCausalLM,
    CohereConfig,
    Gemma2Config,
    Gemma2ForCausalLM,
    GPT2Config,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaModel,
    pipeline,
)

from modeling_fwp import FWLCache, FWLConfig, FWLForCausalLM, TransfoXLConfig
from modeling_fwp.configuration_fwl import FWLHeadConfigMixin
from modeling_fwp.fwl import DenseFWLSlowHead

from conftest import accelerate_launch_two_processes, tiny_config

VOCAB = 61
ALL_FAST = [
    "up_proj.weight", "up_proj.bias", "down_proj.weight", "down_proj.bias", "norm.weight", "norm.bias",
    "output_embedding.weight", "output_bias",
]


def tiny_llama_config(**overrides):
    kwargs = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True,
    )
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


def tiny_gemma2_config(**overrides):
    """Gemma 2 soft-caps its logits, ``cap * tanh(z / cap)``; a cap of 0.05 makes the transform far from linear here."""
    kwargs = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, pad_token_id=0, bos_token_id=1, eos_token_id=2, final_logit_softcapping=0.05,
    )
    kwargs.update(overrides)
    return Gemma2Config(**kwargs)


def tiny_fwl(base="llama", seed=0, **fwl):
    """An FWL model on a tiny random base; a large step size so that the fast weights matter."""
    torch.manual_seed(seed)
    text_config = {
        "llama": tiny_llama_config,
        "delta_net": tiny_config,
        "gemma2": tiny_gemma2_config,
        "gpt2": lambda: GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, bos_token_id=1, eos_token_id=2),
    }[base]()
    fwl.setdefault("fwl_step_size_init", 0.1)
    model = FWLForCausalLM(FWLConfig(text_config=text_config, **fwl)).eval()
    with torch.no_grad():  # a non-trivial LayerNorm, so every fast parameter's gradient is non-zero
        model.fwl_head.slow.norm.weight.normal_(1.0, 0.3)
        if getattr(model.fwl_head.slow.norm, "bias", None) is not None:  # (an output-side head's RMSNorm has none)
            model.fwl_head.slow.norm.bias.normal_(0.0, 0.3)
    return model


def random_ids(batch, length, seed=1):
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def assert_one_gradient_step_per_position(head, hidden, ids, fast, seen_rows=False):
    """Position t of `fast` == head.slow at theta - alpha * sum_{j<t} g_j, g_j = grad CE(head.slow(h_j), x_{j+1}) by
    plain autograd; with `seen_rows`, the output layer's rows (E's rows, c's entries) of tokens outside
    x_0 .. x_{j+1} set to zero in g_j, the hidden layer's gradients untouched."""
    params = dict(head.slow.named_parameters())
    names = head.fast_parameter_names
    B, T = ids.shape
    for b in range(B):
        grad_sum = {name: torch.zeros_like(params[name]) for name in names}
        for t in range(T):
            theta = {name: params[name] - head.step_size(name) * grad_sum[name] for name in names}
            expected = functional_call(head.slow, theta, (hidden[b, t][None, None],))[0, 0]
            torch.testing.assert_close(fast[b, t], expected, rtol=1e-10, atol=1e-10)
            if t + 1 == T:
                continue
            loss = F.cross_entropy(head.slow(hidden[b, t][None]), ids[b, t + 1][None])
            grads = torch.autograd.grad(loss, [params[name] for name in names])
            seen = torch.zeros(VOCAB, dtype=torch.float64)
            seen[ids[b, : t + 2]] = 1
            for name, g in zip(names, grads):
                if seen_rows and name in ("output_embedding.weight", "output_bias"):
                    g = g * (seen[:, None] if g.dim() == 2 else seen)
                grad_sum[name] = grad_sum[name] + g


@pytest.mark.parametrize(
    "fast_parameters,residual,base",
    [
        (None, False, "llama"), (ALL_FAST, False, "llama"), (ALL_FAST, True, "llama"),
        (["output_bias"], False, "llama"),
        (["output_embedding.weight"], True, "llama"), (ALL_FAST, False, "gemma2"), (["output_bias"], True, "gemma2"),
    ],
)
@pytest.mark.parametrize("mode", ["recurrent", "chunk"])
def test_contract_fast_logits_are_one_gradient_step_on_earlier_losses(fast_parameters, residual, base, mode):
    """Position t == head.slow at theta - alpha * sum_{j<t} grad CE(head.slow(h_j), x_{j+1}), plain autograd; with
    Gemma 2's soft-capping inside head.slow, so that the fast E and c act before the cap."""
    model = tiny_fwl(
        base, fwl_fast_parameters=fast_parameters, fwl_residual=residual, fwl_kernel_mode=mode, fwl_chunk_size=4
    )
    head = model.fwl_head.double()
    B, T = 2, 11
    ids = random_ids(B, T)
    hidden = torch.randn(B, T, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    fast = head(hidden, ids)
    assert fast.shape == (B, T, VOCAB)
    assert_one_gradient_step_per_position(head, hidden, ids, fast)
    # the fast weights do change the output
    assert not torch.allclose(fast[:, 1:], head.slow(hidden)[:, 1:])
    # outside autograd (in-place buffers) and with a padding mask of ones: the same logits
    with torch.no_grad():
        torch.testing.assert_close(head(hidden, ids), fast, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(head(hidden, ids, torch.ones_like(ids)), fast, rtol=1e-12, atol=1e-12)


OUTPUT_LAYER_FAST = ["output_embedding.weight", "output_bias"]


@pytest.mark.parametrize("base,fast_parameters", [("llama", OUTPUT_LAYER_FAST), ("llama", ALL_FAST),
                                                  ("gemma2", OUTPUT_LAYER_FAST)])
def test_seen_vocabulary_is_the_gradient_step_on_the_rows_of_the_tokens_so_far(base, fast_parameters):
    """``fwl_fast_vocabulary="seen"``: one gradient step per position with the output layer's gradient kept on the
    rows of x_0 .. x_{j+1} (``assert_one_gradient_step_per_position``); and not the full-vocabulary head. Outside
    autograd with only output-layer parameters fast, dCE/dz is computed on the seen rows alone (gemma2: through the
    logit soft-capping's slope)."""
    model = tiny_fwl(base, fwl_fast_parameters=fast_parameters, fwl_fast_vocabulary="seen")
    head = model.fwl_head.double()
    ids = random_ids(2, 11)
    hidden = torch.randn(2, 11, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    fast = head(hidden, ids)
    assert_one_gradient_step_per_position(head, hidden, ids, fast, seen_rows=True)
    head.fast_vocabulary = "full"
    assert not torch.allclose(head(hidden, ids), fast)
    with torch.no_grad():  # outside autograd (the products on the seen rows only): the same logits
        head.fast_vocabulary = "seen"
        torch.testing.assert_close(head(hidden, ids), fast, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("base", ["llama", "gemma2"])
def test_logits_gradient_on_columns_is_the_full_gradient_there(base):
    """``logits_gradient_columns``: w (softmax - onehot) * T'(z) on a subset of the vocabulary rows equals autograd's
    per-token gradient of w CE on those rows (gemma2: through the soft-capping); a label outside the rows with
    weight 0 adds nothing."""
    slow = tiny_fwl(base).fwl_head.slow.double()
    z = torch.randn(2, 5, VOCAB, dtype=torch.float64, generator=torch.Generator().manual_seed(3), requires_grad=True)
    labels = random_ids(2, 5)
    weights = torch.tensor([[1.0, 0.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0, 1.0]], dtype=torch.float64)
    columns = torch.unique(torch.cat([labels[weights > 0], torch.tensor([0, 7])]))
    labels[1, 3] = next(i for i in range(VOCAB) if i not in columns.tolist())  # weight 0, outside the rows
    logits = slow.transform_logits(z)
    losses = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), reduction="none") * weights.reshape(-1)
    (full,) = torch.autograd.grad(losses.sum(), z)  # row j of the sum only depends on position j
    with torch.no_grad():
        got = slow.logits_gradient_columns(logits.detach(), labels, weights, columns)
    torch.testing.assert_close(got, full[..., columns], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("base,fwl", [("llama", {"fwl_head_type": "output"}),
                                      ("gemma2", {"fwl_fast_parameters": OUTPUT_LAYER_FAST})])
def test_seen_vocabulary_in_cached_steps_padded_batches_and_its_state(base, fwl):
    """``fwl_fast_vocabulary="seen"``: cached one-token steps give the parallel forward's logits; a left-padded row
    gives its logits alone (padding is no token); the state carries the tokens seen, [B, V]; a head without a fast
    output-layer parameter refuses the option. Both paths: the gain fast too (dCE/dz over the whole vocabulary, then
    kept on the seen rows) and the output layer alone (dCE/dz on the seen rows only)."""
    model = tiny_fwl(base, fwl_fast_vocabulary="seen", fwl_step_size_init=0.05, **fwl)
    ids = random_ids(2, 13)
    with torch.no_grad():
        full = model(ids).logits
        logits, states, _ = segments_with_cache(model, ids, [6] + [1] * 7)
        torch.testing.assert_close(torch.cat(logits, 1), full, rtol=1e-5, atol=1e-5)
        seen = states[-1]["seen.tokens"]
        expected = torch.zeros(2, VOCAB, dtype=torch.bool).scatter_(1, ids, True)
        assert seen.dtype == torch.bool and torch.equal(seen, expected)
        short = random_ids(1, 5, seed=4)
        batch = torch.cat([ids[:1, :8], torch.cat([torch.zeros(1, 3, dtype=torch.long), short], 1)])
        mask = torch.ones_like(batch)
        mask[1, :3] = 0
        together = model(batch, attention_mask=mask).logits
        torch.testing.assert_close(together[1, 3:], model(short).logits[0], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="fast_vocabulary"):
        tiny_fwl(fwl_fast_parameters=["up_proj.weight"], fwl_fast_vocabulary="seen")
    with pytest.raises(ValueError, match="fwl_fast_vocabulary"):
        tiny_fwl(fwl_fast_vocabulary="document")


@pytest.mark.parametrize("fast_parameters", [None, ALL_FAST])
def test_float32_scoring_outside_autograd_equals_the_differentiable_forward(monkeypatch, fast_parameters):
    """Outside autograd the per-token gradients run in row blocks through oneDNN (fwp_kernels.dense) with no slow
    [B, T, V] logits; with autograd, whole and differentiable: the same fast logits to float32 rounding."""
    from fwp_kernels import dense

    monkeypatch.setattr(dense, "BLOCK_BYTES", VOCAB * 3 * 4)  # several row blocks
    model = tiny_fwl(fwl_fast_parameters=fast_parameters)
    head = model.fwl_head
    ids = random_ids(2, 17)
    hidden = torch.randn(2, 17, 32, generator=torch.Generator().manual_seed(2))
    tracked = head(hidden.requires_grad_(True), ids)
    assert tracked.requires_grad
    with torch.no_grad():
        scored = head(hidden, ids)
    torch.testing.assert_close(scored, tracked.detach(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("base", ["llama", "delta_net", "gpt2"])
def test_no_leakage_of_future_tokens(base):
    model = tiny_fwl(base, fwl_fast_parameters=ALL_FAST)
    ids = random_ids(2, 12)
    logits = model(ids).logits
    for t in (0, 4, 10):
        changed = ids.clone()
        changed[:, t + 1] = (changed[:, t + 1] - 3 + 1) % (VOCAB - 3) + 3
        other = model(changed).logits
        torch.testing.assert_close(other[:, : t + 1], logits[:, : t + 1], rtol=0, atol=0)
        assert not torch.allclose(other[:, t + 1 :], logits[:, t + 1 :])


@pytest.mark.parametrize("base", ["llama", "delta_net", "gemma2"])
@pytest.mark.parametrize("mode", ["recurrent", "chunk"])
def test_cached_steps_equal_parallel_forward(base, mode):
    model = tiny_fwl(base, fwl_fast_parameters=ALL_FAST, fwl_kernel_mode=mode, fwl_chunk_size=4)
    ids = random_ids(2, 13)
    full = model(ids).logits
    out = model(ids[:, :6], use_cache=True)
    cache = out.past_key_values
    assert isinstance(cache, FWLCache)
    pieces = [out.logits]
    for t in range(6, 13):
        out = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
        pieces.append(out.logits)
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=1e-4, atol=1e-5)
    assert cache.get_seq_length() == 13
    # the FWL state has a constant size: running sums + one position
    size = sum(t.numel() for t in cache.fwl_layer.states.values())
    model(ids[:, :1], past_key_values=cache, use_cache=True)
    assert sum(t.numel() for t in cache.fwl_layer.states.values()) == size


OUTPUT_SUM = "sum.output_embedding.weight"


def segments_with_cache(model, ids, lengths, mask=None, logits_to_keep=0):
    """Logits and FWL states after each of several cached calls over `ids` split into `lengths`."""
    cache, logits, states, start = None, [], [], 0
    for length in lengths:
        part = slice(start, start + length)
        kwargs = {} if mask is None else {"attention_mask": mask[:, : start + length]}
        out = model(ids[:, part], past_key_values=cache, use_cache=True, logits_to_keep=logits_to_keep, **kwargs)
        cache = out.past_key_values
        logits.append(out.logits)
        states.append({k: t.clone() for k, t in cache.fwl_layer.producer_states()[0].items()})
        start += length
    return logits, states, cache


@pytest.mark.parametrize(
    "fast_parameters,head_type,padded,vocabulary",
    [
        (ALL_FAST, "mlp", False, "full"), (ALL_FAST, "mlp", True, "full"),
        (["output_embedding.weight"], "mlp", False, "full"),
        (["output_bias"], "mlp", False, "full"), (["output_embedding.weight", "output_bias"], "mlp", True, "full"),
        (None, "output", False, "full"), (None, "output", True, "full"),
        (ALL_FAST, "mlp", True, "seen"), (None, "output", False, "seen"), (None, "output", True, "seen"),
    ],
)
def test_output_layer_outside_autograd_equals_the_differentiable_path(fast_parameters, head_type, padded, vocabulary):
    """Outside autograd the fast E and output biases take one fused pass (``subtract_output_layer_``: a T' x T mixing
    matrix, the carried sum read once, the sums updated in place; with ``fwl_fast_vocabulary="seen"`` on the seen
    rows only); with autograd, the linear attention and cumulative sums of ``subtract``. Segments with a cache
    (lengths 5, 1, 4, 1), a left-padded batch, logits of every position and of the last only: the same logits and
    the same running sums."""
    model = tiny_fwl(fwl_fast_parameters=fast_parameters, fwl_head_type=head_type, fwl_kernel_mode="chunk",
                     fwl_chunk_size=4, fwl_fast_vocabulary=vocabulary,
                     **({"fwl_step_size_init": 0.05} if head_type == "output" else {}))
    ids = random_ids(2, 11)
    mask = None
    if padded:
        mask = torch.ones_like(ids)
        mask[1, :3] = 0
    lengths = [5, 1, 4, 1]
    reference, reference_states, _ = segments_with_cache(model, ids, lengths, mask)  # parameters require grad
    assert reference[0].requires_grad
    with torch.no_grad():
        fused, fused_states, _ = segments_with_cache(model, ids, lengths, mask)
        last, _, _ = segments_with_cache(model, ids, lengths, mask, logits_to_keep=1)
    for got, want, got_last in zip(fused, reference, last):
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_last, want.detach()[:, -1:], rtol=1e-5, atol=1e-5)
    for got, want in zip(fused_states, reference_states):
        assert got.keys() == want.keys()
        for key in got:
            torch.testing.assert_close(got[key], want[key].detach(), rtol=1e-5, atol=1e-5, msg=key)
    # the fast weights do act (the slow head alone gives other logits)
    with torch.no_grad(), model.fwl_head.slow_only():
        slow, _, _ = segments_with_cache(model, ids, lengths, mask)
    assert not torch.allclose(torch.cat(slow, 1)[:, 2:], torch.cat(fused, 1)[:, 2:], atol=1e-4)


def test_bf16_output_layer_reads_and_updates_the_running_sum_in_blocks(monkeypatch):
    """With ``fwl_gradient_dtype="bfloat16"`` E's running sum stays float32 and is read and updated with bf16
    products in blocks of vocabulary rows: blocks of 16 rows (4 blocks of the tiny vocabulary) give what one block
    gives, and both stay within a few percent of the exact fast-weight correction over cached segments."""
    from modeling_fwp import fwl

    exact = tiny_fwl(fwl_fast_parameters=["output_embedding.weight", "output_bias"], fwl_head_type="mlp")
    approx = tiny_fwl(fwl_fast_parameters=["output_embedding.weight", "output_bias"], fwl_gradient_dtype="bfloat16")
    approx.load_state_dict(exact.state_dict())
    ids, lengths = random_ids(2, 11), [5, 1, 4, 1]
    with torch.no_grad():
        reference, reference_states, _ = segments_with_cache(exact, ids, lengths)
        one_block, _, _ = segments_with_cache(approx, ids, lengths)
        monkeypatch.setattr(fwl, "_SUM_UPDATE_BLOCK_ROWS", 16)
        blocks, states, _ = segments_with_cache(approx, ids, lengths)
        with exact.fwl_head.slow_only():
            slow, _, _ = segments_with_cache(exact, ids, lengths)
    torch.testing.assert_close(torch.cat(blocks, 1), torch.cat(one_block, 1), rtol=1e-5, atol=1e-5)
    reference, slow, blocks = torch.cat(reference, 1), torch.cat(slow, 1), torch.cat(blocks, 1)
    error = (blocks - reference).abs().max() / (reference - slow).abs().max()
    assert error < 0.05, error
    assert states[-1][OUTPUT_SUM].dtype == torch.float32
    sum_error = (states[-1][OUTPUT_SUM] - reference_states[-1][OUTPUT_SUM]).abs().max()
    assert sum_error < 0.02 * reference_states[-1][OUTPUT_SUM].abs().max(), sum_error


def test_output_layer_running_sum_is_updated_in_place_only_when_nothing_else_holds_it():
    """Outside autograd E's running sum is written in place from the second call on, unless its tensor was handed out
    (``FastWeightCacheLayer.states``, a rollback checkpoint) since the last write: what was read stays as it was."""
    model = tiny_fwl(fwl_fast_parameters=ALL_FAST)
    ids = random_ids(1, 12)
    with torch.no_grad():
        out = model(ids[:, :4], use_cache=True)
        cache = out.past_key_values
        first = cache.fwl_layer.producer_states()[0][OUTPUT_SUM]
        assert OUTPUT_SUM in cache.fwl_layer.writable
        model(ids[:, 4:6], past_key_values=cache, use_cache=True)
        second = cache.fwl_layer.producer_states()[0][OUTPUT_SUM]
        assert second is first  # updated in place
        snapshot = dict(cache.fwl_layer.states)  # a reader keeps references: no more in-place writes to them
        assert cache.fwl_layer.writable == frozenset()
        kept = snapshot[OUTPUT_SUM].clone()
        model(ids[:, 6:8], past_key_values=cache, use_cache=True)
        third = cache.fwl_layer.producer_states()[0][OUTPUT_SUM]
        assert third is not second and torch.equal(snapshot[OUTPUT_SUM], kept)
        assert not torch.equal(third, kept)
        cache.activate_past_recording()  # a checkpoint before each forward keeps references too
        model(ids[:, 8:10], past_key_values=cache, use_cache=True)
        fourth = cache.fwl_layer.producer_states()[0][OUTPUT_SUM]
        assert fourth is not third
        before_crop = fourth.clone()
        model(ids[:, 10:12], past_key_values=cache, use_cache=True)
        cache.crop(-2)  # rolls back to the state after 10 tokens, which nothing overwrote
        torch.testing.assert_close(cache.fwl_layer.producer_states()[0][OUTPUT_SUM], before_crop, rtol=0, atol=0)


@pytest.mark.parametrize("base", ["llama", "delta_net", "gpt2"])
def test_greedy_generation_equals_parallel_forward(base):
    model = tiny_fwl(base)
    prompt = random_ids(2, 5)
    out = model.generate(
        prompt, max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True,
        pad_token_id=0, eos_token_id=None,
    )
    steps = torch.stack(out.logits, dim=1)  # [B, 8, V]: the logits that chose tokens 5..12
    full = model(out.sequences).logits[:, 4:-1]
    torch.testing.assert_close(steps, full, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("base", ["llama", "delta_net"])
def test_beam_search_scores_match_parallel_forward(base):
    model = tiny_fwl(base)
    prompt = random_ids(2, 4)
    out = model.generate(
        prompt, max_new_tokens=5, num_beams=3, num_return_sequences=3, do_sample=False, length_penalty=0.0,
        output_scores=True, return_dict_in_generate=True, pad_token_id=0, eos_token_id=None,
    )
    seqs = out.sequences  # [B * 3, 9]
    logprobs = model(seqs).logits.log_softmax(-1)[:, 3:-1]
    rescored = logprobs.gather(-1, seqs[:, 4:, None])[..., 0].sum(-1)
    torch.testing.assert_close(out.sequences_scores, rescored, rtol=1e-4, atol=1e-4)
    assert len({tuple(s.tolist()) for s in seqs[:3]}) == 3  # the beams differ


@pytest.mark.parametrize("base", ["llama", "delta_net"])
def test_left_padded_batch_generates_as_unpadded(base):
    model = tiny_fwl(base, fwl_fast_parameters=ALL_FAST)
    long, short = random_ids(1, 7, seed=3), random_ids(1, 4, seed=4)
    batch = torch.cat([long, torch.cat([torch.zeros(1, 3, dtype=torch.long), short], 1)])
    mask = torch.ones_like(batch)
    mask[1, :3] = 0
    kwargs = dict(max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0,
                  eos_token_id=None)
    together = model.generate(batch, attention_mask=mask, **kwargs)
    for row, prompt in enumerate((long, short)):
        alone = model.generate(prompt, **kwargs)
        assert together.sequences[row, -6:].tolist() == alone.sequences[0, -6:].tolist()
        torch.testing.assert_close(
            torch.stack(together.logits, 1)[row], torch.stack(alone.logits, 1)[0], rtol=1e-4, atol=1e-4
        )


def test_save_load_round_trip_and_auto_classes(tmp_path):
    model = tiny_fwl("llama", fwl_fast_parameters=ALL_FAST, fwl_residual=True)
    with torch.no_grad():
        model.fwl_head.raw_step_size.add_(torch.arange(len(ALL_FAST), dtype=torch.float32) / 10)
    ids = random_ids(2, 9)
    expected = model(ids).logits
    model.config.use_cache = False  # as Trainer saves it; generation must still work
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert isinstance(loaded, FWLForCausalLM)
    assert loaded.fwl_head.slow.output_embedding is loaded.language_model.get_output_embeddings()
    torch.testing.assert_close(loaded(ids).logits, expected, rtol=0, atol=0)
    for name in ALL_FAST:
        torch.testing.assert_close(loaded.fwl_head.step_size(name), model.fwl_head.step_size(name))
    out = loaded.generate(ids[:, :3], max_new_tokens=3, do_sample=False, use_cache=True, pad_token_id=0)
    assert out.shape == (2, 6)
    uncached = loaded.generate(ids[:, :3], max_new_tokens=3, do_sample=False, use_cache=False, pad_token_id=0)
    assert torch.equal(out, uncached)


def greedy_by_forward(model, ids, new_tokens, eos_token_id):
    """Greedy decoding by full forward passes (no generate, no cache): argmax of the last logits, up to eos."""
    for _ in range(new_tokens):
        with torch.no_grad():
            next_id = model(ids).logits[0, -1].argmax()
        ids = torch.cat([ids, next_id.view(1, 1)], 1)
        if next_id == eos_token_id:
            break
    return ids


@pytest.mark.parametrize("batch_size", [1, 2])
def test_pipeline_text_generation_is_greedy_decoding(word_tokenizer, batch_size):
    """pipeline("text-generation") returns the prompt and the decoded greedy continuation of full forward passes,
    prompt by prompt and with both prompts (of different lengths) left-padded into one batch by the pipeline."""
    model = tiny_fwl("delta_net")
    generator = pipeline("text-generation", model=model, tokenizer=word_tokenizer)
    prompts = ["the cat sat on", "fast weights"]
    out = generator(prompts, max_new_tokens=4, do_sample=False, batch_size=batch_size)
    for prompt, (got,) in zip(prompts, out):
        ids = word_tokenizer(prompt, return_tensors="pt")["input_ids"]
        expected = greedy_by_forward(model, ids, 4, word_tokenizer.eos_token_id)
        assert expected.shape[1] > ids.shape[1]
        new_text = word_tokenizer.decode(expected[0, ids.shape[1]:], skip_special_tokens=True)
        assert got["generated_text"] == prompt + new_text  # the pipeline decodes the new tokens alone


def test_from_base_pretrained_keeps_base_and_freezes(tmp_path):
    torch.manual_seed(0)
    base = LlamaForCausalLM(tiny_llama_config()).eval()
    base.save_pretrained(tmp_path)
    ids = random_ids(2, 8)
    base_logits = base(ids).logits
    model = FWLForCausalLM.from_base_pretrained(str(tmp_path), freeze_base=True, fwl_residual=True).eval()
    for (name, p), (_, q) in zip(base.named_parameters(), model.language_model.named_parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)
    # residual head with zero LayerNorm gain: its slow net is exactly the base model's LM head at the start, and so is
    # the first position (no earlier loss); later positions add the fast weight update
    hidden = model.language_model.model(ids).last_hidden_state
    torch.testing.assert_close(model.fwl_head.slow(hidden), base_logits, rtol=1e-5, atol=1e-5)
    logits = model(ids).logits
    torch.testing.assert_close(logits[:, 0], base_logits[:, 0], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(logits[:, 1:], base_logits[:, 1:])
    assert not any(p.requires_grad for p in model.language_model.parameters())
    assert all(p.requires_grad for n, p in model.fwl_head.named_parameters() if "output_embedding" not in n)
    # the paper's form (no residual): the head is trained from scratch and the logits differ
    plain = FWLForCausalLM.from_base_pretrained(base, fwl_intermediate_size=48)
    assert plain.fwl_head.slow.up_proj.weight.shape == (48, 32)
    assert any(p.requires_grad for p in plain.language_model.parameters())


def test_training_backpropagates_through_the_gradient_computation():
    """Second order: d loss / d theta goes through the per-token gradients; checked against finite differences."""
    model = tiny_fwl("llama", fwl_fast_parameters=ALL_FAST, fwl_kernel_mode="chunk", fwl_chunk_size=4).double()
    ids = random_ids(2, 10)
    head = model.fwl_head
    hidden = torch.randn(2, 10, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    params = [head.slow.up_proj.weight, head.slow.norm.weight, head.raw_step_size]

    def loss_fn():
        logits = head(hidden, ids)
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))

    grads = torch.autograd.grad(loss_fn(), params)
    assert all(g.abs().sum() > 0 for g in grads)
    torch.manual_seed(6)
    directions = [torch.randn_like(p) for p in params]
    eps = 1e-6
    with torch.no_grad():
        for p, d in zip(params, directions):
            p.add_(eps * d)
        plus = loss_fn()
        for p, d in zip(params, directions):
            p.sub_(2 * eps * d)
        minus = loss_fn()
        for p, d in zip(params, directions):
            p.add_(eps * d)
    numeric = (plus - minus) / (2 * eps)
    analytic = sum((g * d).sum() for g, d in zip(grads, directions))
    torch.testing.assert_close(analytic, numeric, rtol=1e-6, atol=1e-9)
    # and a full model step: labels loss reaches the base model and every FWL parameter
    out = model(ids, labels=ids)
    out.loss.backward()
    assert model.language_model.model.layers[0].mlp.up_proj.weight.grad.abs().sum() > 0
    for name, p in model.fwl_head.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_bad_input():
    torch.manual_seed(0)
    with pytest.raises(ValueError, match="output embedding"):
        FWLForCausalLM(FWLConfig(text_config=tiny_llama_config()), language_model=LlamaModel(tiny_llama_config()))
    with pytest.raises(ValueError, match="not a parameter of the FWL head"):  # no c when fwl_output_bias=False
        FWLForCausalLM(FWLConfig(text_config=tiny_llama_config(), fwl_output_bias=False,
                                 fwl_fast_parameters=["output_bias"]))
    with pytest.raises(ValueError, match="Unknown FWLConfig fields"):
        FWLForCausalLM.from_base_pretrained(LlamaForCausalLM(tiny_llama_config()), fwl_step_size=0.1)
    model = tiny_fwl("llama")
    ids = random_ids(1, 5)
    with pytest.raises(ValueError, match="input_ids"):
        model(inputs_embeds=torch.randn(1, 5, 32))
    with pytest.raises(ValueError, match="FWLCache"):
        model(ids, past_key_values=model.language_model(ids, use_cache=True).past_key_values)
    with pytest.raises(ValueError, match="hidden_states"):
        model.fwl_head(torch.randn(1, 5, 31), ids)
    with pytest.raises(ValueError, match="input_ids"):
        model.fwl_head(torch.randn(1, 5, 32), ids[:, :4])
    with pytest.raises(ValueError, match="not a fast parameter"):
        model.fwl_head.step_size("output_bias")
    cache = model(ids, use_cache=True).past_key_values
    with pytest.raises(ValueError, match="cannot be cropped"):
        cache.crop(1)
    with pytest.raises(ValueError, match="nn.Linear"):
        DenseFWLSlowHead(32, 32, torch.nn.Embedding(VOCAB, 32))


def tiny_finetune_setup(tmp_path, word_tokenizer, batch_size=2):
    """A tiny Llama checkpoint and word-level text files; the finetune_fwl argv that uses them."""
    torch.manual_seed(0)
    model_dir = tmp_path / "tiny"
    LlamaForCausalLM(tiny_llama_config(vocab_size=len(word_tokenizer))).save_pretrained(model_dir)
    word_tokenizer.save_pretrained(model_dir)
    words = "the a cat dog sat on mat fast weights are programmed by slow nets and read with queries".split()
    gen = torch.Generator().manual_seed(0)
    docs = [" ".join(words[i] for i in torch.randint(0, len(words), (40,), generator=gen).tolist()) for _ in range(24)]
    (tmp_path / "train.txt").write_text("\n\n".join(docs[:20]) + "\n")
    (tmp_path / "valid.txt").write_text("\n\n".join(docs[20:]) + "\n")
    (tmp_path / "test.txt").write_text("\n\n".join(docs[20:]) + "\n")  # whole-document stage
    return [
        "--model_name_or_path", str(model_dir), "--output_dir", str(tmp_path / "out"),
        "--train_file", str(tmp_path / "train.txt"), "--validation_file", str(tmp_path / "valid.txt"),
        "--block_size", "16", "--max_steps", "3", "--save_steps", "2", "--per_device_train_batch_size", str(batch_size),
        "--fwl_intermediate_size", "16", "--logging_steps", "1", "--prompt_tokens", "6", "--max_new_tokens", "5",
        "--document_eval_data", str(tmp_path), "--document_eval_documents", "2",
    ]


def test_finetune_script_passes_the_head_options_to_the_new_fwl_model(tmp_path, word_tokenizer):
    """--fwl_decay_init / --fwl_segment_length (and the other --fwl_* options) reach stage (3)'s fresh FWL head."""
    from training import finetune_fwl

    argv = tiny_finetune_setup(tmp_path, word_tokenizer)
    args = finetune_fwl.parse_args(argv + ["--fwl_decay_init", "0.5", "--fwl_segment_length", "8",
                                           "--fwl_step_size_init", "0.02"])
    head = finetune_fwl.new_fwl_model(args).fwl_head
    assert head.decay is not None and head.decay.segment_length == 8
    assert all(head.decay.gamma(n).item() == pytest.approx(0.5) for n in head.fast_parameter_names)
    assert all(head.step_size(n).item() == pytest.approx(0.02) for n in head.fast_parameter_names)
    assert finetune_fwl.new_fwl_model(finetune_fwl.parse_args(argv)).fwl_head.decay is None
    with pytest.raises(ValueError, match="fwl_decay_init"):
        finetune_fwl.new_fwl_model(finetune_fwl.parse_args(argv + ["--fwl_decay_init", "1.5"]))
    output_side = argv + ["--fwl_head_type", "output", "--fwl_fast_parameters", "output_embedding.weight",
                          "output_bias", "--fwl_gradient_point", "segment_start", "--fwl_segment_length", "8"]
    head = finetune_fwl.new_fwl_model(finetune_fwl.parse_args(output_side)).fwl_head
    assert (head.gradient_point, head.segment_length, head.decay) == ("segment_start", 8, None)
    assert head.fast_vocabulary == "full"
    head = finetune_fwl.new_fwl_model(finetune_fwl.parse_args(output_side + ["--fwl_fast_vocabulary", "seen"])).fwl_head
    assert (head.gradient_point, head.fast_vocabulary) == ("segment_start", "seen")
    with pytest.raises(ValueError, match="fast_vocabulary"):  # no fast output-layer parameter to restrict
        finetune_fwl.new_fwl_model(finetune_fwl.parse_args(argv + ["--fwl_fast_parameters", "norm.weight",
                                                                   "--fwl_fast_vocabulary", "seen"]))
    with pytest.raises(ValueError, match="fast_parameters"):  # the MLP head's parameters cannot use it
        finetune_fwl.new_fwl_model(finetune_fwl.parse_args(
            argv + ["--fwl_gradient_point", "segment_start", "--fwl_segment_length", "8"]))


def test_finetune_script_smoke_and_resume(tmp_path, word_tokenizer):
    """training/finetune_fwl.py end to end on a tiny Llama: three stages, the breakdown, then a resumed rerun."""
    import json

    from training import finetune_fwl

    argv = tiny_finetune_setup(tmp_path, word_tokenizer)
    results = finetune_fwl.main(argv + ["--hub_dry_run", "--hub_model_id", "me/tiny-fwl"])
    # --hub_dry_run: the FWL model exported with its code and our card, which names the base and the measured ppl
    from huggingface_hub import ModelCard

    card = ModelCard.load(tmp_path / "out" / "hub_export" / "README.md")
    assert card.data.base_model is None  # the base is a local folder: no Hub id was recorded when it was loaded
    assert f"huggingface.co/{tmp_path}" not in card.text and "(its Hub id was not recorded)" in card.text
    assert "| `train_file` | train.txt |" in card.text  # the training file as used (the card shows the file name)
    assert (tmp_path / "out" / "hub_export" / "model.safetensors").is_file()
    assert f"{results['base_fwl']['ppl']:.2f}" in card.text or f"{results['base_fwl']['ppl']:.3f}" in card.text
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    for stage in ("base", "base_finetuned", "base_fwl"):
        assert saved[stage]["tokens_first"] + saved[stage]["tokens_repeated"] == saved[stage]["tokens"]
        assert saved[stage]["tokens_repeated"] > 0 and math.isfinite(saved[stage]["ppl"])
    assert set(saved["fwl_vs_finetuned"]) == {"ppl_ratio", "ppl_first_ratio", "ppl_repeated_ratio"}
    assert set(saved["fwl_fast_weight_gain"]) == {"ppl_ratio", "ppl_first_ratio", "ppl_repeated_ratio"}
    assert saved["sample"]["cached_equals_uncached"] is True and saved["world_size"] == 1
    assert "(3) fine-tuned + FWL" in finetune_fwl.report(saved)
    # the slow-head ablation of (3): same tokens, and the fast weights' share of the gain is reported
    assert saved["base_fwl_slow_only"]["tokens"] == saved["base_fwl"]["tokens"]
    assert saved["fwl_fast_weight_gain"]["ppl_ratio"] == pytest.approx(
        saved["base_fwl"]["ppl"] / saved["base_fwl_slow_only"]["ppl"])
    assert "fast updates off" in finetune_fwl.report(saved)
    # whole documents: every method scores the same tokens; the checkpoints are gone, the final models are kept
    whole = saved["whole_documents"]
    from training.demo_stages import document_report
    from training.document_eval import ONE_TABLE

    methods = [m for m in whole if isinstance(whole[m], dict) and "perplexity" in whole[m]]
    assert methods == list(ONE_TABLE) + ["test_time_fwl_seen"]  # issue 17 item 4's rows, in its order; the variant
    assert {m: whole[m]["tokens"] for m in methods} == dict.fromkeys(methods, 2 * 40)
    assert whole["fwl_slow_only"]["perplexity"] != whole["fwl"]["perplexity"]
    assert set(whole["goals"]) == {"trained_fwl", "test_time_fwl_on_base", "test_time_fwl_seen_on_base"}
    assert "(3') its slow head alone" in document_report(whole) and "MET" in document_report(whole)
    from training.demo_stages import DEMO_STEP_SIZES

    assert whole["step_sizes"] == DEMO_STEP_SIZES and whole["documents"] == 2
    assert not list((tmp_path / "out").glob("*/checkpoint-*"))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "base_fwl" / "final")
    assert isinstance(loaded, FWLForCausalLM)
    # rerunning resumes: the finished stages are loaded, not retrained, and give the same numbers
    again = finetune_fwl.main(argv + ["--results_file", str(tmp_path / "committed" / "finetune_fwl.json")])
    assert again["base_fwl"]["ppl"] == pytest.approx(results["base_fwl"]["ppl"], rel=1e-5)
    # the copy meant to be committed (the README's demo table): the same file, with the run's record
    committed = json.loads((tmp_path / "committed" / "finetune_fwl.json").read_text())
    assert committed == json.loads((tmp_path / "out" / "results.json").read_text())
    assert committed["run"]["command"].startswith("python -m training.finetune_fwl --model")
    assert committed["base_fwl"]["ppl"] == pytest.approx(again["base_fwl"]["ppl"])


def test_bf16_gradient_option_approximates_the_exact_head():
    """fwl_gradient_dtype="bfloat16": the per-token gradients' vocabulary part in bf16, outputs close to exact."""
    exact = tiny_fwl("llama", fwl_fast_parameters=ALL_FAST)
    approx = tiny_fwl("llama", fwl_fast_parameters=ALL_FAST, fwl_gradient_dtype="bfloat16")
    approx.load_state_dict(exact.state_dict())
    ids = random_ids(2, 12)
    with torch.no_grad():
        reference, slow = exact(ids).logits, exact.fwl_head.slow(exact.language_model.model(ids).last_hidden_state)
        fast = approx(ids).logits
        prefix = approx(ids[:, :6]).logits
    torch.testing.assert_close(fast[:, 0], reference[:, 0])  # no update at the first position
    error = (fast - reference).abs().max() / (reference - slow).abs().max()
    assert error < 0.05, error  # the fast weight update is approximated to a few percent
    torch.testing.assert_close(prefix, fast[:, :6])  # still causal: a prefix gives the same logits
    with pytest.raises(ValueError, match="fwl_gradient_dtype"):
        FWLConfig(text_config=tiny_llama_config(), fwl_gradient_dtype="bf16")


def test_slow_only_runs_the_slow_head_and_restores_the_fast_weights():
    """``FWLHead.slow_only()``: the logits become exactly ``head.slow`` of the base's hidden states (the ablation the
    fine-tuning report uses); on leaving, the fast forward is back."""
    model = tiny_fwl("llama", fwl_fast_parameters=ALL_FAST)
    ids = random_ids(2, 10)
    with torch.no_grad():
        fast = model(ids).logits
        slow = model.fwl_head.slow(model.language_model.model(ids).last_hidden_state)
        with model.fwl_head.slow_only():
            torch.testing.assert_close(model(ids).logits, slow, rtol=0, atol=0)
        torch.testing.assert_close(model(ids).logits, fast, rtol=0, atol=0)
    assert (fast - slow).abs().max() > 1e-3  # the fast weights do change the logits here


@pytest.mark.parametrize("use_cache", [False, True])
def test_labels_loss_matches_the_returned_logits_when_scoring(use_cache):
    """Scoring with labels (no_grad, with or without a returned cache) gives the loss of the returned logits."""
    model = tiny_fwl("llama", fwl_fast_parameters=ALL_FAST).eval()
    ids = random_ids(2, 10)
    with torch.no_grad():
        out = model(ids, labels=ids, use_cache=use_cache)
    expected = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, out.logits.shape[-1]),
                                                 ids[:, 1:].reshape(-1))
    torch.testing.assert_close(out.loss, expected)
    assert (out.past_key_values is not None) == use_cache


def test_fresh_residual_head_starts_at_the_base_model():
    """from_base_pretrained with the residual head: LayerNorm gain 0, so h + f(h) = h and the logits are the base's."""
    torch.manual_seed(0)
    base = LlamaForCausalLM(tiny_llama_config()).eval()
    model = FWLForCausalLM.from_base_pretrained(base, fwl_residual=True, fwl_fast_parameters=ALL_FAST).eval()
    assert torch.count_nonzero(model.fwl_head.slow.norm.weight) == 0
    ids = random_ids(2, 12)
    with torch.no_grad():
        expected = base(ids).logits
        fresh = model(ids).logits
    # the fast weights of the LayerNorm gain/bias and of c already move the logits after the first position
    torch.testing.assert_close(fresh[:, 0], expected[:, 0])
    with torch.no_grad():
        model.fwl_head.raw_step_size.fill_(-30.0)  # alpha = softplus(-30) ~ 1e-13: no fast update
        torch.testing.assert_close(model(ids).logits, expected)
    paper = FWLForCausalLM.from_base_pretrained(base, fwl_residual=False)
    assert torch.equal(paper.fwl_head.slow.norm.weight, torch.ones_like(paper.fwl_head.slow.norm.weight))


def test_finetune_script_under_accelerate_launch_two_processes(tmp_path, word_tokenizer):
    """`accelerate launch --multi_gpu --num_processes 2` on CPU (gloo): two processes with batch 1 each take the same
    optimizer steps as one process with batch 2 (the mean over the same 2 blocks), so the perplexities agree."""
    import json

    fast_learning = ["--learning_rate", "1e-2", "--fwl_learning_rate", "1e-2"]  # so that the 3 steps move the models
    single = tiny_finetune_setup(tmp_path, word_tokenizer, batch_size=2) + fast_learning
    from training import finetune_fwl

    alone = finetune_fwl.main(single)
    argv = tiny_finetune_setup(tmp_path, word_tokenizer, batch_size=1) + fast_learning
    argv[argv.index("--output_dir") + 1] = str(tmp_path / "out_ddp")
    done = accelerate_launch_two_processes("training.finetune_fwl", argv, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    ddp = json.loads((tmp_path / "out_ddp" / "results.json").read_text())
    assert ddp["world_size"] == 2
    for stage in ("base_finetuned", "base_fwl"):  # training moved the model: the comparison below can fail
        assert abs(alone[stage]["ppl"] / alone["base"]["ppl"] - 1) > 0.01
    for stage in ("base", "base_finetuned", "base_fwl"):
        assert ddp[stage]["tokens"] == alone[stage]["tokens"]  # every validation block scored once
        assert ddp[stage]["ppl"] == pytest.approx(alone[stage]["ppl"], rel=1e-4), stage


def test_softcapped_base_is_the_slow_output_layer_and_other_logit_transforms_are_refused():
    """Gemma 2 soft-caps its logits: the FWL's output layer does too, so that a fresh residual head with its fast
    update switched off gives exactly the base model's logits (the uncapped ones differ by far more); a base that
    scales its logits (Cohere's ``logit_scale``) is refused by name."""
    torch.manual_seed(0)
    base = Gemma2ForCausalLM(tiny_gemma2_config()).eval()
    model = FWLForCausalLM.from_base_pretrained(base, fwl_residual=True, fwl_fast_parameters=ALL_FAST).eval()
    assert model.fwl_head.slow.logit_softcapping == 0.05
    ids = random_ids(2, 12)
    with torch.no_grad():
        expected = base(ids).logits
        uncapped = base.lm_head(base.model(ids).last_hidden_state)
        assert (uncapped - expected).abs().max() > 0.1
        with model.fwl_head.slow_only():
            torch.testing.assert_close(model(ids).logits, expected, rtol=0, atol=0)
        fast = model(ids).logits
        torch.testing.assert_close(fast[:, 0], expected[:, 0], rtol=0, atol=0)  # no earlier loss yet
        assert (fast[:, 1:] - expected[:, 1:]).abs().max() > 1e-3
        assert fast.abs().max() <= 0.05  # the fast logits are capped too
        model.fwl_head.raw_step_size.fill_(-30.0)  # alpha = softplus(-30) ~ 1e-13: no fast update
        torch.testing.assert_close(model(ids).logits, expected, rtol=1e-6, atol=1e-9)
    cohere = CohereConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    with pytest.raises(ValueError, match="logit_scale"):
        FWLForCausalLM(FWLConfig(text_config=cohere))


def tiny_fwl_transfo_xl_config(**fwl):
    return TransfoXLConfig(
        vocab_size=VOCAB, cutoffs=[20, 40], hidden_size=32, num_attention_heads=4, head_dim=8, intermediate_size=48,
        num_hidden_layers=1, div_val=2, mem_len=4, use_fwl=True, **fwl,
    )


CONFIGS_WITH_AN_FWL = {
    "fwl": lambda **fwl: FWLConfig(text_config=tiny_llama_config(), **fwl),
    "transfo_xl": tiny_fwl_transfo_xl_config,
}


@pytest.mark.parametrize("family", sorted(CONFIGS_WITH_AN_FWL))
@pytest.mark.parametrize(
    "field,value",
    [
        ("fwl_intermediate_size", 0), ("fwl_fast_parameters", ["up_proj.wieght"]),
        ("fwl_fast_parameters", ["norm.bias", "norm.bias"]), ("fwl_step_size_init", 0.0), ("fwl_decay_init", 1.0),
        ("fwl_segment_length", 0), ("fwl_layer_norm_eps", 0.0), ("fwl_kernel_mode", "fast"), ("fwl_chunk_size", 0),
        ("fwl_gradient_dtype", "bf16"),
    ],
)
def test_one_fwl_config_block_validates_both_configs(family, field, value):
    """FWLConfig and TransfoXLConfig share FWLHeadConfigMixin's fields: a bad value raises naming the field in both."""
    make = CONFIGS_WITH_AN_FWL[family]
    make()  # the defaults are valid
    with pytest.raises(ValueError, match=field):
        make(**{field: value})


def test_one_fwl_config_block_has_one_set_of_names_and_defaults():
    """The same FWL fields and defaults in both configs, but the two Transformer-XL keeps for its output layer and its
    paper's recurrence (no output bias c next to the adaptive softmax; the segment decay on)."""
    shared = FWLHeadConfigMixin.__dataclass_fields__
    own_defaults = {"fwl_output_bias": False, "fwl_decay_init": 0.9}
    # FWLConfig alone chooses which output side is made fast (Transformer-XL's is its adaptive softmax)
    own_fields = {FWLConfig: {"fwl_head_type"}, TransfoXLConfig: set()}
    for config_class in (FWLConfig, TransfoXLConfig):
        fields = config_class.__dataclass_fields__
        names = sorted(name for name in fields if name.startswith("fwl_") and name not in own_fields[config_class])
        assert names == sorted(shared)
        for name, field in shared.items():
            expected = own_defaults.get(name, field.default) if config_class is TransfoXLConfig else field.default
            assert fields[name].default == expected, (config_class.__name__, name)
    with pytest.raises(ValueError, match="fwl_segment_length"):  # a segment length means nothing without a decay
        FWLConfig(text_config=tiny_llama_config(), fwl_segment_length=4)


@pytest.mark.parametrize(
    "family,residual,output_bias",
    [("fwl", False, True), ("fwl", True, True), ("fwl", True, False), ("transfo_xl", False, False),
     ("transfo_xl", True, False)],
)
def test_one_init_path_gives_the_documented_initial_head(family, residual, output_bias, tmp_path):
    """A fresh head, built with its model or initialised by from_pretrained as the part a checkpoint lacks: U, W ~
    N(0, 0.02), a = b = c = 0, LayerNorm bias 0 and gain 1 (0 when residual: the head starts as the identity), every
    step size alpha and decay gamma at its initial value. (The residual head without c started with gain 1 before:
    transformers skipped its initialisation.)"""
    from safetensors.torch import load_file, save_file

    fwl = dict(fwl_residual=residual, fwl_intermediate_size=256, fwl_step_size_init=0.05, fwl_decay_init=0.6)
    if family == "fwl":
        fwl.update(fwl_output_bias=output_bias)
    torch.manual_seed(0)
    fresh = AutoModelForCausalLM.from_config(CONFIGS_WITH_AN_FWL[family](**fwl))
    fresh.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    save_file({k: v for k, v in weights.items() if not k.startswith("fwl_")}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    completed = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert not torch.equal(completed.fwl_head.slow.up_proj.weight, fresh.fwl_head.slow.up_proj.weight)  # new draws
    for model in (fresh, completed):
        head = model.fwl_head
        slow = head.slow
        for weight in (slow.up_proj.weight, slow.down_proj.weight):
            assert abs(weight.std().item() / 0.02 - 1) < 0.05 and abs(weight.mean().item()) < 1e-3
        zeros = [slow.up_proj.bias, slow.down_proj.bias, slow.norm.bias] + ([slow.output_bias] if output_bias else [])
        assert all(torch.equal(t, torch.zeros_like(t)) for t in zeros)
        assert torch.equal(slow.norm.weight, torch.full_like(slow.norm.weight, 0.0 if residual else 1.0))
        for name in head.fast_parameter_names:
            assert head.step_size(name).item() == pytest.approx(0.05, rel=1e-6)
            assert head.decay.gamma(name).item() == pytest.approx(0.6, rel=1e-6)


def test_segment_decay_is_an_optional_part_of_the_head_on_any_base():
    """``fwl_decay_init`` on FWLForCausalLM (Clark et al. sec. 3): at every segment boundary (4 tokens) the carried
    sums become gamma * Delta + the new segment's gradients, which are taken at the slow weights and so equal those of
    the same head without decay; one token at a time decays where segments of 4 do; one uncached call has no
    boundary."""
    model = tiny_fwl("llama", fwl_fast_parameters=ALL_FAST, fwl_decay_init=0.5, fwl_segment_length=4)
    plain = tiny_fwl("llama", fwl_fast_parameters=ALL_FAST)
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if "decay" not in k})
    ids = random_ids(2, 12)

    def run(m, length):
        cache, logits, states = None, [], []
        for start in range(0, 12, length):
            out = m(ids[:, start : start + length], cache=cache, use_cache=True)
            cache = out.cache
            logits.append(out.logits)
            states.append(dict(cache.fwl_layer.states))
        return torch.cat(logits, 1), states

    with torch.no_grad():
        segments, decayed = run(model, 4)
        steps, _ = run(model, 1)
        _, sums = run(plain, 4)
        torch.testing.assert_close(steps, segments, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(model(ids).logits, plain(ids).logits, rtol=0, atol=0)
    assert decayed[1]["segment.tokens"].tolist() == [4, 4]
    for name in ALL_FAST:
        key, gamma = f"sum.{name}", model.fwl_head.decay.gamma(name)
        torch.testing.assert_close(decayed[0][key], sums[0][key], rtol=0, atol=0)
        new = sums[1][key] - sums[0][key]  # the second segment's gradients
        torch.testing.assert_close(decayed[1][key], gamma * decayed[0][key] + new, rtol=1e-5, atol=1e-6, msg=name)
        assert (decayed[1][key] - sums[1][key]).abs().max() > 1e-4, name  # the decay does change the state
