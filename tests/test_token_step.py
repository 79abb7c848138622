"""A fast-weight layer's decode step in one C++ call (``fwp_kernels.fast_weight_token_step``, csrc/chunk_delta.cpp's
``token_step``) against the unfused ops it stands in for: outputs, the state and the convolutions' states, for every
option the op computes, both dtypes; the cases that keep the unfused ops; a whole model's greedy decoding."""
import pytest
import torch

from fwp_kernels import chunk
from modeling_fwp import fast_weight_layers
from modeling_fwp.configuration_fwp import DeltaNetConfig, GatedDeltaNetConfig, LinearTransformerConfig

SIZES = dict(hidden_size=32, num_attention_heads=2, head_dim=8, num_hidden_layers=2, vocab_size=64,
             intermediate_size=48)
FLA_DELTA_NET = dict(feature_map="silu", short_conv_size=4, value_activation="silu", qk_l2_normalization=True,
                     query_scaling=True, beta_bias=False, output_norm=True, sum_normalization=False,
                     norm_type="rms_norm", feed_forward_type="swiglu", hidden_act="silu")
LAYERS = {
    "fla_delta_net_gated": (DeltaNetConfig, dict(FLA_DELTA_NET, output_gate=True)),
    "identity_conv3_neg_eigval_sigmoid_gate": (DeltaNetConfig, dict(
        feature_map="identity", short_conv_size=3, allow_neg_eigval=True, output_norm=True, output_gate=True,
        output_gate_activation="sigmoid", sum_normalization=False, value_head_dim=12)),
    "elu_delta_no_conv": (DeltaNetConfig, dict(feature_map="elu", sum_normalization=False)),
    "papers_delta_net": (DeltaNetConfig, dict(feature_map="elu")),  # eq. 29's sum normalisation
    "relu_sum_normalized_gated_output": (DeltaNetConfig, dict(feature_map="relu", output_norm=True,
                                                              output_gate=True, short_conv_size=2)),
    "relu_sum_rule": (LinearTransformerConfig, dict(feature_map="relu", attention_normalization=False,
                                                     qk_l2_normalization=True)),
    "gated_grouped_values": (GatedDeltaNetConfig, dict(num_v_heads=4, value_head_dim=12)),
}


def _kernel():
    if not chunk.cpu_kernel_available():
        pytest.skip(f"the C++ chunk kernel is {chunk.cpu_kernel_status()}")


def perturbed(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """`module` in `dtype` for evaluation, every parameter moved away from its initial value (norm weights of 1, zero
    biases), so that a fused op that skipped one would show."""
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return module.to(dtype).eval()


def _layer(name: str, dtype: torch.dtype, seed: int = 0):
    config_class, options = LAYERS[name]
    config = config_class(**SIZES, **options)
    torch.manual_seed(seed)
    return perturbed(fast_weight_layers.FAST_WEIGHT_LAYERS[getattr(config, "fast_weight_layer", "linear")](config),
                     dtype)


def _counted(monkeypatch):
    """The fused token steps, as a layer makes them (``fast_weight_token_step``) or an RMSNorm / SwiGLU block around
    it (``BlockDecodeCall.run``: ``block_decode_step``, whose C++ calls the token step's op)."""
    import modeling_fwp.modeling_fwp as modeling

    calls = []
    for module, name in ((fast_weight_layers, "fast_weight_token_step"), (modeling.BlockDecodeCall, "run")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *args, _real=real, **kwargs: calls.append(1) or _real(*args, **kwargs))
    return calls


def _unfused(layer, *args, **kwargs):
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fast_weight_layers, "token_step_applies", lambda *tensors: False)
        return layer(*args, **kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(LAYERS))
@pytest.mark.parametrize("carried", [True, False])
def test_token_step_equals_the_unfused_ops(monkeypatch, name, dtype, carried):
    """Two sequences, one position, after a prefill of 5 (carried) or from no state: the fused call gives the unfused
    ops' output and states (float32 to rounding; bfloat16 rounds where they round: equal but for the few values
    whose exp differs by an ulp), the convolutions' states exactly."""
    _kernel()
    layer = _layer(name, dtype)
    calls = _counted(monkeypatch)
    gen = torch.Generator().manual_seed(1)
    prefill, x = (torch.randn(2, T, SIZES["hidden_size"], generator=gen).to(dtype) for T in (5, 1))
    with torch.no_grad():
        state = layer(prefill)[1] if carried else {}
        want, want_state = _unfused(layer, x, state=state)
        assert not calls
        got, got_state = layer(x, state=state)
    assert calls == [1] and sorted(got_state) == sorted(want_state)
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(got, want, **tol)
    for key, value in want_state.items():
        if key.startswith("conv_"):
            assert torch.equal(got_state[key], value), key
        else:
            torch.testing.assert_close(got_state[key], value, **tol)
    if dtype == torch.bfloat16:  # bit for bit but for rare ulps
        assert (got != want).float().mean() < 0.05


def test_token_step_keeps_the_unfused_ops_where_it_cannot_stand_in(monkeypatch):
    """A padding mask, autograd, a float64 model, the step-loop mode, a hook on a convolution or a global module hook:
    the unfused ops run (the hook fires), with the fused call's results where both run."""
    _kernel()
    layer = _layer("fla_delta_net_gated", torch.float32)
    calls = _counted(monkeypatch)
    x = torch.randn(1, 1, SIZES["hidden_size"])
    with torch.no_grad():
        fused = layer(x)[0]
        layer(x, token_mask=torch.ones(1, 1))
    assert len(calls) == 1
    torch.testing.assert_close(layer(x)[0].detach(), fused, rtol=1e-5, atol=1e-6)  # autograd
    with torch.no_grad():
        _layer("fla_delta_net_gated", torch.float64)(x.double())
        layer.kernel_mode = "recurrent"
        torch.testing.assert_close(layer(x)[0], fused, rtol=1e-5, atol=1e-6)
        layer.kernel_mode = "auto"
        fired = []
        handle = layer.k_conv1d.register_forward_hook(lambda *args: fired.append(1))
        torch.testing.assert_close(layer(x)[0], fused, rtol=1e-5, atol=1e-6)
        handle.remove()
        hook = torch.nn.modules.module.register_module_forward_hook(lambda *args: fired.append(2))
        layer(x)
        hook.remove()
        layer(x)
    assert fired[0] == 1 and 2 in fired and len(calls) == 2


def test_token_step_refuses_bad_arguments():
    from fwp_kernels import fast_weight_token_step

    q, v = torch.randn(1, 16), torch.randn(1, 16)
    with torch.no_grad():
        with pytest.raises(ValueError, match="`q`, `k`"):
            fast_weight_token_step(q, torch.randn(1, 8), v, 2, 2)
        with pytest.raises(ValueError, match="`num_heads`"):
            fast_weight_token_step(q, q, v, 3, 3)
        with pytest.raises(ValueError, match="`feature_map`"):
            fast_weight_token_step(q, q, v, 2, 2, feature_map="dpfp")
        with pytest.raises(ValueError, match="`gate_activation`"):
            fast_weight_token_step(q, q, v, 2, 2, gate_activation="tanh")
        _kernel()
        with pytest.raises(RuntimeError, match="gate"):
            fast_weight_token_step(q, q, v, 2, 2, gate=torch.randn(1, 15))
        with pytest.raises(RuntimeError, match="dtype"):
            fast_weight_token_step(q, q.bfloat16(), v, 2, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_decoding_with_the_token_step_equals_the_unfused_ops(monkeypatch, dtype):
    """A whole Gated DeltaNet and an fla-style Delta Net: ``generate`` gives the same tokens with and without the
    fused step (which ran for every layer of every step after the prefill), scores within rounding."""
    _kernel()
    from transformers import AutoModelForCausalLM

    calls = _counted(monkeypatch)
    for config in (GatedDeltaNetConfig(**SIZES), DeltaNetConfig(**SIZES, **dict(FLA_DELTA_NET, output_gate=True))):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).to(dtype).eval()
        ids = torch.randint(0, SIZES["vocab_size"], (2, 7))
        kwargs = dict(max_new_tokens=6, do_sample=False, output_scores=True, return_dict_in_generate=True,
                      pad_token_id=0)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(fast_weight_layers, "token_step_applies", lambda *tensors: False)
            want = model.generate(ids, **kwargs)
        calls.clear()
        got = model.generate(ids, **kwargs)
        assert len(calls) == 5 * SIZES["num_hidden_layers"]
        assert torch.equal(got.sequences, want.sequences)
        tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=5e-2, atol=5e-2)
        torch.testing.assert_close(torch.stack(got.scores), torch.stack(want.scores), **tol)


@pytest.mark.parametrize("config,ops", [
    (GatedDeltaNetConfig(**SIZES, norm_type="layer_norm"), ("token_step",)),  # the layer's token step alone
    (GatedDeltaNetConfig(**SIZES), ("block_decode_step",)),
    (DeltaNetConfig(**SIZES, **FLA_DELTA_NET), ("block_decode_step",)),  # the fused block (its C++ calls token_step)
])
def test_a_traced_decode_step_keeps_the_token_step(config, ops):
    """``torch.compile`` traces the fused calls as the ops they are (they only write their ``out`` arguments: torch
    generates their fake kernels), one graph for the whole step, with eager's logits: the layers' token step, or in
    an RMSNorm / SwiGLU block the block's one call (tests/test_block_decode.py)."""
    _kernel()
    from transformers import AutoModelForCausalLM

    from modeling_fwp.cache_fwp import CACHE_ARGUMENT, output_cache

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(0, SIZES["vocab_size"], (1, 5))
    targets = []

    def backend(graph_module, example_inputs):
        targets.extend(str(node.target) for node in graph_module.graph.nodes if node.op == "call_function")
        return graph_module

    with torch.no_grad():
        caches = [output_cache(model(ids[:, :4], use_cache=True)) for _ in range(2)]
        eager = model(ids[:, 4:], use_cache=True, **{CACHE_ARGUMENT: caches[0]}).logits
        compiled = torch.compile(model, fullgraph=True, backend=backend)
        traced = compiled(ids[:, 4:], use_cache=True, **{CACHE_ARGUMENT: caches[1]}).logits
    torch._dynamo.reset()
    assert torch.equal(traced, eager)
    for op in ops:
        assert sum(op in t.split(".") for t in targets) == SIZES["num_hidden_layers"], (op, targets)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_step_with_large_states_equals_one_sequence_at_a_time(dtype):
    """New states of 1 MB or more (B2 H8 D128) are written with non-temporal stores (csrc's kStreamStateBytes):
    output and states bit for bit those of each sequence's own call (512 KB each, written as usual)."""
    _kernel()
    gen = torch.Generator().manual_seed(3)
    B, H, D = 2, 8, 128
    q, k, v = (torch.randn(B, H * D, generator=gen).to(dtype) for _ in range(3))
    beta_logits = torch.randn(B, H, generator=gen).to(dtype)
    state = 0.1 * torch.randn(B, H, D, D, generator=gen)
    options = dict(beta_logits=beta_logits, state=state, l2_eps=1e-6, feature_map="silu")
    out, new_state, _ = fast_weight_layers.fast_weight_token_step(q, k, v, H, H, **options)
    for b in range(B):
        one = dict(options, beta_logits=beta_logits[b:b + 1], state=state[b:b + 1])
        out_b, state_b, _ = fast_weight_layers.fast_weight_token_step(q[b:b + 1], k[b:b + 1], v[b:b + 1], H, H, **one)
        assert torch.equal(out[b:b + 1], out_b) and torch.equal(new_state[b:b + 1], state_b)
