"""Behaviour of the Linear Transformer / Delta Net / Gated DeltaNet causal LMs: cache, generation, padding, training."""
import copy
import itertools
import logging

import pytest
import torch

import modeling_fwp
from modeling_fwp import (
    DeltaNetConfig,
    DeltaNetForCausalLM,
    FastWeightCache,
    GatedDeltaNetConfig,
    LinearTransformerConfig,
)
from modeling_fwp.cache_fwp import CACHE_ARGUMENT, output_cache
from modeling_fwp.feature_maps import dpfp_feature_map

from conftest import check_bfloat16_forward, tiny_config, tiny_model

FEATURE_MAPS = ["elu", "dpfp", "favor", "relu", "identity"]
RULES = [LinearTransformerConfig, DeltaNetConfig]
# The Gated DeltaNet (Yang et al. 2025) has its own feature map (SiLU, L2-normalised), so it is not crossed with
# FEATURE_MAPS; grouped value heads (2 value heads per query/key head) and a value dimension other than the key's.
GATED = dict(num_v_heads=8, value_head_dim=12)
FAMILIES = [(LinearTransformerConfig, {}), (DeltaNetConfig, {}), (GatedDeltaNetConfig, GATED),
            (GatedDeltaNetConfig, dict(GATED, kernel_mode="chunk", chunk_size=4))]


def family_id(case) -> str:
    cls, options = case
    return cls.__name__.removesuffix("Config") + ("-chunk" if options.get("kernel_mode") == "chunk" else "")


def stepwise_logits(model, ids, **kwargs):
    cache, logits = None, []
    for t in range(ids.shape[1]):
        out = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True, **kwargs)
        cache = out.past_key_values
        logits.append(out.logits)
    return torch.cat(logits, dim=1), cache


@pytest.mark.parametrize("config_cls,feature_map", list(itertools.product(RULES, FEATURE_MAPS)))
def test_cached_steps_equal_full_forward(config_cls, feature_map):
    model = tiny_model(config_cls, feature_map=feature_map, dpfp_nu=2)
    ids = torch.randint(3, 61, (2, 12), generator=torch.Generator().manual_seed(1))
    full = model(ids).logits
    steps, _ = stepwise_logits(model, ids)
    torch.testing.assert_close(steps, full, rtol=1e-4, atol=1e-5)
    # prefill a prefix, then continue one token at a time
    out = model(ids[:, :7], use_cache=True)
    cont = model(ids[:, 7:], past_key_values=out.past_key_values, use_cache=True).logits
    torch.testing.assert_close(torch.cat([out.logits, cont], 1), full, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("config_cls", RULES)
def test_decode_steps_take_the_one_pass_decode_kernel(config_cls, monkeypatch):
    """On CPU with the C++ kernel, a one-token step is one ``decode_step`` call per layer (and per normaliser with
    attention normalisation): fwp_kernels.chunk.decode_cpu; the logits equal the full forward's."""
    from fwp_kernels import chunk

    if not chunk.cpu_kernel_available():
        pytest.skip(f"C++ chunk kernel: {chunk.cpu_kernel_status()}")
    calls = []
    decode = chunk.decode_cpu
    monkeypatch.setattr(chunk, "decode_cpu", lambda *args: calls.append(args[0].shape) or decode(*args))
    model = tiny_model(config_cls)
    ids = torch.randint(3, 61, (2, 6), generator=torch.Generator().manual_seed(2))
    steps, _ = stepwise_logits(model, ids)
    per_layer = 2 if model.config.attention_normalization else 1
    assert len(calls) == ids.shape[1] * model.config.num_hidden_layers * per_layer
    torch.testing.assert_close(steps, model(ids).logits, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kernel_mode", ["recurrent", "chunk", "auto"])
def test_gated_delta_net_cached_steps_equal_full_forward(kernel_mode):
    """Every kernel mode (chunks of 4: prefix and continuation end inside a chunk) gives the step loop's logits, in one
    pass, one token at a time from the cache, and as a prefix continued from its cache."""
    model = tiny_model(GatedDeltaNetConfig, kernel_mode=kernel_mode, chunk_size=4, **GATED)
    reference = tiny_model(GatedDeltaNetConfig, kernel_mode="recurrent", **GATED)  # the same seed: the same weights
    ids = torch.randint(3, 61, (2, 12), generator=torch.Generator().manual_seed(1))
    full = reference(ids).logits
    torch.testing.assert_close(model(ids).logits, full, rtol=1e-4, atol=1e-5)
    steps, cache = stepwise_logits(model, ids)
    torch.testing.assert_close(steps, full, rtol=1e-4, atol=1e-5)
    assert cache.token_counts.tolist() == [12, 12]
    out = model(ids[:, :7], use_cache=True)
    cont = model(ids[:, 7:], past_key_values=out.past_key_values, use_cache=True).logits
    torch.testing.assert_close(torch.cat([out.logits, cont], 1), full, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(attention_normalization=True, sum_normalization=True),
        dict(position_embedding_type="sinusoidal"),
        dict(position_embedding_type="learned", max_position_embeddings=64),
        dict(tie_word_embeddings=False),
    ],
)
def test_cached_steps_equal_full_forward_options(overrides):
    model = tiny_model(DeltaNetConfig, **overrides)
    ids = torch.randint(3, 61, (2, 9))
    steps, _ = stepwise_logits(model, ids)
    torch.testing.assert_close(steps, model(ids).logits, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("config_cls,options", FAMILIES, ids=map(family_id, FAMILIES))
def test_generate_with_and_without_cache(config_cls, options):
    model = tiny_model(config_cls, **options)
    ids = torch.randint(3, 61, (2, 5))
    with_cache = model.generate(ids, max_new_tokens=8, do_sample=False, use_cache=True)
    without = model.generate(ids, max_new_tokens=8, do_sample=False, use_cache=False)
    assert with_cache.shape == (2, 13)
    assert torch.equal(with_cache, without)


def test_beam_search_with_and_without_cache():
    model = tiny_model(DeltaNetConfig, feature_map="dpfp")
    ids = torch.randint(3, 61, (2, 5))
    kwargs = dict(max_new_tokens=8, num_beams=4, num_return_sequences=2, do_sample=False)
    with_cache = model.generate(ids, use_cache=True, **kwargs)
    without = model.generate(ids, use_cache=False, **kwargs)
    assert with_cache.shape[0] == 4
    assert torch.equal(with_cache, without)


def test_sampling_num_return_sequences_is_seeded():
    model = tiny_model(LinearTransformerConfig)
    ids = torch.randint(3, 61, (1, 4))
    torch.manual_seed(3)
    a = model.generate(ids, max_new_tokens=6, do_sample=True, num_return_sequences=3, top_k=20)
    torch.manual_seed(3)
    b = model.generate(ids, max_new_tokens=6, do_sample=True, num_return_sequences=3, top_k=20)
    assert a.shape == (3, 10) and torch.equal(a, b)


@pytest.mark.parametrize("position_embedding_type", ["none", "sinusoidal"])
def test_left_padded_batch_equals_each_prompt_alone(position_embedding_type):
    model = tiny_model(DeltaNetConfig, position_embedding_type=position_embedding_type)
    prompts = [torch.randint(3, 61, (n,)) for n in (7, 4, 2)]
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = p, 1
    batched = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    logits = model(ids, attention_mask=mask).logits[:, -1]
    for i, p in enumerate(prompts):
        alone = model.generate(p[None], max_new_tokens=6, do_sample=False, pad_token_id=0)
        new_tokens = alone[0, len(p) :]  # may stop early at EOS; the batch then pads that row
        assert torch.equal(batched[i, width : width + len(new_tokens)], new_tokens)
        torch.testing.assert_close(logits[i], model(p[None]).logits[0, -1], rtol=1e-4, atol=1e-5)


def test_padded_positions_do_not_write_state():
    model = tiny_model(DeltaNetConfig)
    ids = torch.randint(3, 61, (1, 6))
    padded = torch.cat([torch.randint(3, 61, (1, 3)), ids], 1)  # garbage where the mask is 0
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 6, dtype=torch.long)], 1)
    a = model(ids, use_cache=True).past_key_values
    b = model(padded, attention_mask=mask, use_cache=True).past_key_values
    for la, lb in zip(a.layers, b.layers):
        torch.testing.assert_close(la.states["fast_weight"], lb.states["fast_weight"], rtol=1e-5, atol=1e-6)


def test_continue_generation_from_returned_cache():
    model = tiny_model(DeltaNetConfig)
    ids = torch.randint(3, 61, (1, 5))
    first = model.generate(ids, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    cache = output_cache(first)
    assert isinstance(cache, FastWeightCache)
    extra = torch.randint(3, 61, (1, 2))
    prompt2 = torch.cat([first.sequences, extra], 1)
    continued = model.generate(prompt2, **{CACHE_ARGUMENT: cache}, max_new_tokens=4, do_sample=False)
    fresh = model.generate(prompt2, max_new_tokens=4, do_sample=False)
    assert torch.equal(continued, fresh)


def test_cache_size_is_constant_in_tokens():
    model = tiny_model(LinearTransformerConfig)
    out = model(torch.randint(3, 61, (1, 8)), use_cache=True)
    cache = out.past_key_values
    size = cache.nbytes()
    for _ in range(30):
        cache = model(torch.randint(3, 61, (1, 1)), past_key_values=cache, use_cache=True).past_key_values
    assert cache.get_seq_length() == 38
    assert cache.nbytes() == size > 0


def test_cache_refuses_crop_and_reorders_for_beams():
    model = tiny_model(DeltaNetConfig)
    cache = model(torch.randint(3, 61, (3, 4)), use_cache=True).past_key_values
    with pytest.raises(ValueError, match="cannot be cropped"):
        cache.crop(1)
    before = cache.layers[0].states["fast_weight"].clone()
    cache.reorder_cache(torch.tensor([2, 2, 0]))
    assert torch.equal(cache.layers[0].states["fast_weight"], before[[2, 2, 0]])
    cache.batch_select_indices(torch.tensor([1, 2]))
    cache.batch_repeat_interleave(2)
    assert cache.batch_size == 4 and cache.layers[1].states["fast_weight"].shape[0] == 4


def test_segment_carry_over_equals_full_sequence_and_stops_gradients():
    model = tiny_model(DeltaNetConfig, tie_word_embeddings=False).train()  # untied: only inputs touch embeddings
    ids = torch.randint(3, 61, (2, 16))
    full = model(ids).logits
    seg1 = model(ids[:, :8], use_cache=True)
    seg2 = model(ids[:, 8:], past_key_values=seg1.past_key_values, use_cache=True)
    torch.testing.assert_close(seg2.logits, full[:, 8:], rtol=1e-4, atol=1e-5)
    # gradients stop at the boundary: tokens that occur only in segment 1 get no embedding gradient
    only_first = sorted(set(ids[:, :8].flatten().tolist()) - set(ids[:, 8:].flatten().tolist()))
    model.zero_grad()
    seg2.logits.sum().backward()
    grad = model.get_input_embeddings().weight.grad
    assert only_first and grad[only_first].abs().max() == 0
    assert grad[ids[:, 8:].flatten()].abs().sum() > 0


def test_favor_features_redrawn_in_training_fixed_in_eval_and_saved(tmp_path):
    model = tiny_model(LinearTransformerConfig, feature_map="favor", favor_features=12)
    proj = model.model.layers[0].fast_weight.feature_map.projection
    ids = torch.randint(3, 61, (1, 5))
    before = proj.clone()
    model(ids)
    assert torch.equal(proj, before)  # eval: fixed
    model.train()
    model(ids)
    assert not torch.equal(proj, before)  # training: a new draw per batch
    model.eval()
    model.save_pretrained(tmp_path)
    loaded = DeltaNetForCausalLM  # noqa: F841 (name check only)
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    torch.testing.assert_close(reloaded.model.layers[0].fast_weight.feature_map.projection, proj)
    torch.testing.assert_close(reloaded(ids).logits, model(ids).logits)


SAVED = [(cls, dict(feature_map="dpfp", dpfp_nu=3)) for cls in RULES] + [(GatedDeltaNetConfig, GATED)]


@pytest.mark.parametrize("config_cls,options", SAVED, ids=map(family_id, SAVED))
def test_save_load_round_trip_with_auto_classes(tmp_path, config_cls, options):
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    model = tiny_model(config_cls, **options)
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    assert type(AutoConfig.from_pretrained(tmp_path)) is config_cls
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(reloaded) is type(model)
    ids = torch.randint(3, 61, (2, 7))
    torch.testing.assert_close(reloaded(ids).logits, model(ids).logits)
    base = AutoModel.from_pretrained(tmp_path)
    assert base.config.model_type.startswith("fwp_")
    # tied embeddings stay tied after loading, untied ones (the Gated DeltaNet's default) untied
    tied = reloaded.lm_head.weight.data_ptr() == reloaded.model.embed_tokens.weight.data_ptr()
    assert tied == model.config.tie_word_embeddings
    if not tied:
        torch.testing.assert_close(reloaded.lm_head.weight, model.lm_head.weight, rtol=0, atol=0)


def test_logits_to_keep_and_hidden_states():
    model = tiny_model(DeltaNetConfig)
    ids = torch.randint(3, 61, (2, 6))
    full = model(ids, output_hidden_states=True)
    assert len(full.hidden_states) == model.config.num_hidden_layers + 1
    last = model(ids, logits_to_keep=1).logits
    assert last.shape == (2, 1, 61)
    torch.testing.assert_close(last, full.logits[:, -1:])


def test_gradient_checkpointing_gives_the_same_gradients():
    ids = torch.randint(3, 61, (2, 10))
    grads = []
    for checkpointing in (False, True):
        model = tiny_model(DeltaNetConfig).train()
        if checkpointing:
            model.activation_checkpointing_enable()
        model(ids, labels=ids).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-5, atol=1e-6)


def test_gated_delta_net_gradients_reach_the_decay_parameters():
    """The decay's parameters (``a_proj``, ``A_log``, ``dt_bias``) get non-zero gradients, those of the chunkwise kernel
    equal the step loop's, and A_log's is the loss's derivative (central difference in float64)."""
    ids = torch.randint(3, 61, (2, 10), generator=torch.Generator().manual_seed(4))
    grads = []
    for mode in ("recurrent", "chunk"):
        model = tiny_model(GatedDeltaNetConfig, kernel_mode=mode, chunk_size=4, **GATED).train()
        model(ids, labels=ids).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    gates = [n for n in grads[0] if n.split(".fast_weight.")[-1] in ("a_proj.weight", "A_log", "dt_bias")]
    assert len(gates) == 3 * model.config.num_hidden_layers
    assert all(grads[0][n] is not None and grads[0][n].abs().min() > 0 for n in gates)
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-4, atol=1e-6, msg=name)

    model = tiny_model(GatedDeltaNetConfig, kernel_mode="recurrent", **GATED).double()
    A_log = model.model.layers[0].fast_weight.A_log
    generator = torch.Generator().manual_seed(5)
    direction = torch.randn(A_log.shape, generator=generator, dtype=torch.float64)
    weights = torch.randn(2, 10, 61, generator=generator, dtype=torch.float64)

    def objective():  # a float64 scalar of the logits (the loss function computes in float32)
        return (model(ids).logits * weights).sum()

    (grad,) = torch.autograd.grad(objective(), A_log)
    with torch.no_grad():  # the decay is computed in float32 whatever the weights' dtype, hence a step of 1e-2
        A_log += 1e-2 * direction  # (measured: 2.7e-4 relative off autograd; a step of 1e-4: 2.1e-2, float32 noise)
        up = objective()
        A_log -= 2e-2 * direction
        down = objective()
    torch.testing.assert_close((up - down) / 2e-2, (grad * direction).sum(), rtol=2e-3, atol=0)


def test_gated_delta_net_decay_missing_from_a_checkpoint_gets_its_initial_values(tmp_path):
    """from_pretrained builds the model on the meta device and initialises only what the checkpoint lacks, through
    ``_init_weights``: a layer's ``init_fast_weight_parameters`` hook must run there (else A_log, dt_bias are
    garbage)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    model = tiny_model(GatedDeltaNetConfig, **GATED)
    model.save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    save_file({k: v for k, v in state.items() if not k.endswith(("A_log", "dt_bias"))}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    for layer, fresh in zip(loaded.model.layers, model.model.layers):
        assert torch.equal(layer.fast_weight.A_log, fresh.fast_weight.A_log)
        assert torch.equal(layer.fast_weight.dt_bias, fresh.fast_weight.dt_bias)


def test_loss_is_token_sum_over_num_items_in_batch():
    model = tiny_model(DeltaNetConfig)
    ids = torch.randint(3, 61, (2, 6))
    labels = ids.clone()
    labels[1, 3:] = -100
    mean_loss = model(ids, labels=labels).loss
    n = int((labels[:, 1:] != -100).sum())
    summed = model(ids, labels=labels, num_items_in_batch=torch.tensor(2 * n)).loss
    torch.testing.assert_close(summed, mean_loss / 2)


# ---------------------------------------------------------------------------------------------------------------
# feature maps
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("nu", [1, 2, 3])
def test_dpfp_matches_its_definition(nu):
    x = torch.randn(3, 5)
    d = x.shape[-1]
    phi = dpfp_feature_map(x, nu)
    assert phi.shape == (3, 2 * d * nu)
    r = torch.cat([x.clamp_min(0), (-x).clamp_min(0)], -1)
    expected = torch.empty(3, 2 * d * nu)
    for i in range(1, nu + 1):  # Schlag et al. 2021 eq. 37: phi_{i,j} = r_j r_{j+i mod 2d}
        for j in range(2 * d):
            expected[:, (i - 1) * 2 * d + j] = r[:, j] * r[:, (j + i) % (2 * d)]
    torch.testing.assert_close(phi, expected)


@pytest.mark.parametrize("feature_map", ["elu", "dpfp", "favor", "relu"])
def test_sum_normalised_features_sum_to_one(feature_map):
    config = tiny_config(DeltaNetConfig, feature_map=feature_map, sum_normalization=True)
    fmap = modeling_fwp.feature_maps.FeatureMap(config)
    phi = fmap(torch.randn(2, 4, 5, config.head_dim))
    assert phi.shape[-1] == config.feature_dim
    assert (phi >= 0).all()
    nonzero = phi.amax(-1) > 0  # an all-negative input has an all-zero ReLU vector, left at zero
    assert nonzero.float().mean() > 0.9
    torch.testing.assert_close(phi.sum(-1)[nonzero], torch.ones(2, 4, 5)[nonzero])


# ---------------------------------------------------------------------------------------------------------------
# stability over a long stream
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_delta_rule_layer_is_stable_over_100k_tokens(dtype):
    from modeling_fwp.fast_weight_layers import FastWeightLinearAttention

    config = tiny_config(DeltaNetConfig, hidden_size=64, num_attention_heads=4, feature_map="dpfp", dpfp_nu=1)
    torch.manual_seed(0)
    layer = FastWeightLinearAttention(config).to(dtype).eval()
    state, norms, segment = None, [], 2000
    with torch.no_grad():
        for i in range(100_000 // segment):
            x = torch.randn(1, segment, 64, generator=torch.Generator().manual_seed(i)).to(dtype) * 3
            out, state = layer(x, state=state)
            assert torch.isfinite(out).all()
            norms.append(state["fast_weight"].norm(dim=(-2, -1)).max().item())
            # the bound that sum normalisation and beta in (0, 1) give: every row w of W moves towards
            # v / |k| along k only, and |k|_2 >= 1 / sqrt(Dk) for a sum-normalised non-negative k
            v = layer.v_proj(x.float() if dtype == torch.float32 else x).float()
            v_max = v.abs().max().item()
    Dk, Dv = config.feature_dim, config.head_dim
    assert all(n == n and n < float("inf") for n in norms)
    bound = (Dk * Dv) ** 0.5 * v_max
    assert max(norms) <= bound, (max(norms), bound)
    # no drift: the second half of the stream stays at the level of the first
    half = len(norms) // 2
    assert max(norms[half:]) <= 1.5 * max(norms[:half])


BF16 = [(cls, dict(feature_map=fmap, dpfp_nu=2)) for cls, fmap in itertools.product(RULES, ["elu", "dpfp"])] + [
    (GatedDeltaNetConfig, GATED), (GatedDeltaNetConfig, dict(GATED, kernel_mode="chunk", chunk_size=4))]


@pytest.mark.parametrize("config_cls,options", BF16,
                         ids=[family_id(c) + "-" + c[1].get("feature_map", "") for c in BF16])
def test_bfloat16_model_runs_with_float32_states(config_cls, options):
    check_bfloat16_forward(tiny_model(config_cls, **options))


# ---------------------------------------------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,argument",
    [
        (dict(feature_map="softmax"), "feature_map"),
        (dict(feature_map="dpfp", dpfp_nu=0), "dpfp_nu"),
        (dict(feature_map="dpfp", dpfp_nu=4), "dpfp_nu"),  # head_dim 8 -> nu <= 3
        (dict(hidden_size=30), "hidden_size"),
        (dict(update_rule="hebb"), "update_rule"),
        (dict(feature_map="identity", sum_normalization=True), "sum_normalization"),
    ],
)
def test_bad_config_raises_naming_the_argument(kwargs, argument):
    with pytest.raises(ValueError, match=argument):
        tiny_config(DeltaNetConfig, **kwargs)


@pytest.mark.parametrize("config_cls,rule", [(DeltaNetConfig, "sum"), (LinearTransformerConfig, "delta")])
def test_the_family_decides_the_update_rule(config_cls, rule):
    """A Delta Net with the sum rule would be a Linear Transformer under the wrong name (and card): refused."""
    with pytest.raises(ValueError, match="update_rule"):
        tiny_config(config_cls, update_rule=rule)


def test_feature_map_changed_after_the_config_is_refused():
    """An unknown feature_map set on a built config must not run as the identity map."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(DeltaNetConfig)
    config.feature_map = "softmax"
    with pytest.raises(ValueError, match="feature_map"):
        AutoModelForCausalLM.from_config(config)


def test_bad_forward_inputs_raise_naming_the_argument():
    model = tiny_model(DeltaNetConfig)
    ids = torch.randint(3, 61, (2, 5))
    with pytest.raises(ValueError, match="input_ids"):
        model(torch.tensor([[3, 61]]))
    with pytest.raises(ValueError, match="input_ids"):
        model(torch.tensor([[-1, 4]]))
    with pytest.raises(ValueError, match="attention_mask"):
        model(ids, attention_mask=torch.ones(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="attention_mask"):
        model(ids, attention_mask=torch.ones(3, 5, dtype=torch.long))
    cache = model(torch.randint(3, 61, (3, 4)), use_cache=True).past_key_values
    with pytest.raises(ValueError, match="past_key_values"):
        model(ids, past_key_values=cache)


@pytest.mark.parametrize("family", ["delta_net", "transfo_xl", "fwl"])
def test_cache_argument_under_both_names(family):
    """transformers 5.24 calls the cache `cache` (the output field too); `past_key_values`, its older name, still works:
    both continue a segment identically, and giving two different caches is an error naming both."""
    if family == "delta_net":
        model = tiny_model(DeltaNetConfig)
    elif family == "transfo_xl":
        model = modeling_fwp.TransfoXLForCausalLM(modeling_fwp.TransfoXLConfig(
            vocab_size=61, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, head_dim=8, intermediate_size=64,
            cutoffs=[20], div_val=2, mem_len=8)).eval()
    else:
        model = modeling_fwp.FWLForCausalLM(modeling_fwp.FWLConfig(text_config=tiny_config(DeltaNetConfig))).eval()
    ids = torch.randint(3, 61, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        first = model(ids[:, :5], use_cache=True)
        assert CACHE_ARGUMENT in first and output_cache(first) is first[CACHE_ARGUMENT]
        new_name = model(ids[:, 5:], cache=copy.deepcopy(output_cache(first)), use_cache=True).logits
        old_name = model(ids[:, 5:], past_key_values=copy.deepcopy(output_cache(first)), use_cache=True).logits
        torch.testing.assert_close(new_name, old_name, rtol=0, atol=0)
        torch.testing.assert_close(torch.cat([first.logits, new_name], 1), model(ids).logits, rtol=1e-4, atol=1e-5)
        other = model(ids[:, :5], use_cache=True)
        with pytest.raises(ValueError, match="`cache` or as `past_key_values`"):
            model(ids[:, 5:], cache=output_cache(first), past_key_values=output_cache(other))


# ---------------------------------------------------------------------------------------------------------------
# transformers integration: pipeline and Trainer
# ---------------------------------------------------------------------------------------------------------------


def test_text_generation_pipeline_without_warnings(word_tokenizer, caplog):
    from transformers import pipeline

    model = tiny_model(DeltaNetConfig, vocab_size=len(word_tokenizer))
    with caplog.at_level(logging.WARNING):
        pipe = pipeline("text-generation", model=model, tokenizer=word_tokenizer)
        outs = pipe(["the cat sat on", "fast weights"], max_new_tokens=5, do_sample=False)
    assert not [r for r in caplog.records if "not supported" in r.getMessage()]
    assert outs[0][0]["generated_text"].startswith("the cat sat on")
    # batched (left-padded by the pipeline) generation equals running each prompt alone
    alone = pipe("fast weights", max_new_tokens=5, do_sample=False)
    assert outs[1][0]["generated_text"] == alone[0]["generated_text"]


def test_trainer_gradient_accumulation_uses_the_token_mean_of_the_whole_batch(tmp_path):
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    torch.manual_seed(0)
    ids = torch.randint(3, 61, (4, 8))
    labels = ids.clone()
    labels[0, 2:] = -100  # unequal token counts: a per-micro-batch mean would weight them differently
    labels[3, 5:] = -100
    data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": labels.tolist()})

    model = tiny_model(DeltaNetConfig).train()
    reference = copy.deepcopy(model)
    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=1,
        learning_rate=1.0, optim="sgd", lr_scheduler_type="constant", max_grad_norm=0.0, weight_decay=0.0,
        report_to=[], save_strategy="no", logging_steps=1, use_cpu=True, dataloader_drop_last=False,
    )
    Trainer(model=model, args=args, train_dataset=data).train()

    reference.zero_grad()
    logits = reference(ids).logits[:, :-1]
    target = labels[:, 1:]
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 61), target.reshape(-1), ignore_index=-100)
    loss.backward()  # mean over every label token of the 4 sequences
    for (name, p), (_, p_ref) in zip(model.named_parameters(), reference.named_parameters()):
        if p_ref.grad is None:
            continue
        torch.testing.assert_close(p.detach(), p_ref.detach() - p_ref.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_gradient_checkpointing_replays_the_same_favor_features():
    ids = torch.randint(3, 61, (2, 10))
    grads = []
    for checkpointing in (False, True):
        model = tiny_model(LinearTransformerConfig, feature_map="favor", favor_features=16).train()
        if checkpointing:
            model.activation_checkpointing_enable()
        torch.manual_seed(5)  # the same redraw in both runs
        model(ids, labels=ids).loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-6)


def _cache_configs():
    from modeling_fwp.families import FAMILIES

    configs = [(spec.name, spec.config_class, {}) for spec in FAMILIES if spec.model_class is not None]
    return configs + [("delta_net_short_conv", modeling_fwp.DeltaNetConfig, {"short_conv_size": 4}),
                      ("gated_delta_net_short_conv", GatedDeltaNetConfig, {"short_conv_size": 4})]


@pytest.mark.parametrize("name, config_class, overrides", _cache_configs(), ids=lambda x: x if isinstance(x, str) else "")
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
def test_cache_holds_only_its_states(name, config_class, overrides, padded):
    """After a prefill every cache tensor owns just its own bytes: none is a view that keeps a prefill-sized tensor
    alive (the short convolutions' last inputs were slices of their whole [B, C, K - 1 + T] window: 48 MB per layer
    of the 1.3B Delta Net at 2,048 tokens in float32)."""
    model = tiny_model(config_class, **overrides)
    ids = torch.randint(3, 61, (2, 40))
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :7] = 0
    with torch.no_grad():
        cache = output_cache(model(ids, attention_mask=mask, use_cache=True))
    states = [(i, key, t) for i, layer in enumerate(cache.layers) for key, t in layer._states.items()]
    assert states
    for i, key, t in states:
        held, own = t.untyped_storage().nbytes(), t.numel() * t.element_size()
        assert held == own, f"layer {i}, {key} {tuple(t.shape)}: keeps {held} bytes alive for its {own}"
