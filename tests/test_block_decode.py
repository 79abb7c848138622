"""A pre-norm block's decode step in one C++ call (``FastWeightBlock._decode_step``: ``fwp_kernels.block_decode_step``,
which runs ``norm_linears``, the fast-weight layer's token step and ``swiglu_block``; a model's blocks prepared first
and run in one pass, ``FastWeightModel._decode_in_one_pass``) against the block's unfused ops and the block loop:
logits and every cache state bit for bit, both dtypes, one and two sequences, over several steps; the cases that keep
the unfused ops (hooks, replaced modules, dropout at work, autograd, other norms and feed-forwards, padding, several
positions); the op against its three calls. A traced step keeps the fused call:
tests/test_token_step.py::test_a_traced_decode_step_keeps_the_token_step."""
import pytest
import torch

import modeling_fwp.modeling_fwp as modeling
from fwp_kernels import block_decode_step, dense, dense_linears, normalize_rows
from modeling_fwp.cache_fwp import CACHE_ARGUMENT, output_cache
from modeling_fwp.configuration_fwp import DeltaNetConfig, GatedDeltaNetConfig
from test_token_step import FLA_DELTA_NET, SIZES, perturbed

CONFIGS = {
    "fla_delta_net": lambda **kw: DeltaNetConfig(**SIZES, **{**FLA_DELTA_NET, "output_gate": True, **kw}),
    "gated_grouped_values": lambda **kw: GatedDeltaNetConfig(**SIZES, num_v_heads=4, value_head_dim=12, **kw),
}


def _kernels():
    from fwp_kernels import chunk

    if not (dense._CPU_KERNEL.available() and chunk.cpu_kernel_available()):
        pytest.skip("the C++ kernels are not built here")


def _model(name: str, dtype: torch.dtype, **options):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return perturbed(AutoModelForCausalLM.from_config(CONFIGS[name](**options)), dtype)


def _counted(monkeypatch):
    """The fused block op's calls, by name, as the blocks make them (each block's, or the model's in one pass:
    ``BlockDecodeCall.run``)."""
    calls = []
    real = modeling.BlockDecodeCall.run
    monkeypatch.setattr(modeling.BlockDecodeCall, "run", lambda self: calls.append("block_decode_step") or real(self))
    return calls


def _decode(model, ids, steps: int, fused: bool):
    """Greedy steps after a prefill of `ids`: (logits of each step, the last cache's states)."""
    with pytest.MonkeyPatch.context() as patch:
        if not fused:
            patch.setattr(modeling.FastWeightBlock, "_decode_plan", lambda *args: None)
        with torch.no_grad():
            out = model(ids, use_cache=True)
            cache, logits = output_cache(out), []
            for _ in range(steps):
                out = model(out.logits[:, -1:].argmax(-1), use_cache=True, **{CACHE_ARGUMENT: cache})
                cache = output_cache(out)
                logits.append(out.logits)
    return logits, [cache.get_state(i) for i in range(model.config.num_hidden_layers)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("batch", [1, 2])
def test_decode_step_equals_the_unfused_block(monkeypatch, name, dtype, batch):
    """Every layer of every decode step through the fused call (counted), with the unfused block's logits and
    states to the bit: the same functions compute every value (normalize_rows, the weight-streaming products, ATen's
    add, silu and mul)."""
    _kernels()
    model = _model(name, dtype)
    ids = torch.randint(0, SIZES["vocab_size"], (batch, 5), generator=torch.Generator().manual_seed(batch))
    want_logits, want_states = _decode(model, ids, 4, fused=False)
    calls = _counted(monkeypatch)
    got_logits, got_states = _decode(model, ids, 4, fused=True)
    assert calls == ["block_decode_step"] * (4 * SIZES["num_hidden_layers"])
    for got, want in zip(got_logits, want_logits):
        assert torch.equal(got, want)
    for got, want in zip(got_states, want_states):
        assert sorted(got) == sorted(want) and all(torch.equal(got[key], want[key]) for key in want)


def _block_loop_only(patch):
    """The model's decode steps block by block (each block's own call), as before the one-pass decode."""
    patch.setattr(modeling.FastWeightModel, "_decode_in_one_pass", lambda *args: None)


def _steps_with_hidden_states(model, ids, steps: int) -> tuple:
    """Greedy steps after a prefill of `ids`, each with its hidden states: (logits, hidden states, last states)."""
    with torch.no_grad():
        out = model(ids, use_cache=True)
        cache, logits, hidden = output_cache(out), [], []
        for _ in range(steps):
            out = model(out.logits[:, -1:].argmax(-1), use_cache=True, output_hidden_states=True,
                        **{CACHE_ARGUMENT: cache})
            cache = output_cache(out)
            logits.append(out.logits)
            hidden.append(out.hidden_states)
    return logits, hidden, [cache.get_state(i) for i in range(model.config.num_hidden_layers)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("batch", [1, 2])
def test_decode_in_one_pass_equals_the_block_loop(monkeypatch, name, dtype, batch):
    """A decode step prepared for all blocks first, then run (``FastWeightModel._decode_in_one_pass``, taken at every
    step: counted), gives the block loop's logits, hidden states and cache states to the bit: the same calls."""
    _kernels()
    model = _model(name, dtype)
    ids = torch.randint(0, SIZES["vocab_size"], (batch, 5), generator=torch.Generator().manual_seed(batch))
    with pytest.MonkeyPatch.context() as patch:
        _block_loop_only(patch)
        want = _steps_with_hidden_states(model, ids, 3)
    passes = []
    real = modeling.FastWeightModel._decode_in_one_pass
    monkeypatch.setattr(modeling.FastWeightModel, "_decode_in_one_pass",
                        lambda *args: passes.append(real(*args)) or passes[-1])
    got = _steps_with_hidden_states(model, ids, 3)
    assert len(passes) == 4 and passes[0] is None and all(p is not None for p in passes[1:])  # prefill, 3 steps
    for got_logits, want_logits in zip(got[0], want[0]):
        assert torch.equal(got_logits, want_logits)
    for got_hidden, want_hidden in zip(got[1], want[1]):
        assert len(got_hidden) == len(want_hidden) == SIZES["num_hidden_layers"] + 1
        assert all(torch.equal(g, w) for g, w in zip(got_hidden, want_hidden))
    for got_state, want_state in zip(got[2], want[2]):
        assert sorted(got_state) == sorted(want_state)
        assert all(torch.equal(got_state[key], want_state[key]) for key in want_state)


def test_decode_in_one_pass_leaves_a_hooked_block_to_the_block_loop(monkeypatch):
    """A hook on a block (or on a module of its last layer, found after the blocks before it were prepared) makes the
    step run block by block: the hook fires and sees the computed output, the cache gets each state once, and the
    logits are the block loop's."""
    _kernels()
    model = _model("fla_delta_net", torch.float32)
    ids = torch.randint(0, SIZES["vocab_size"], (1, 4), generator=torch.Generator().manual_seed(3))
    seen = []
    for module in (model.model.layers[1], model.model.layers[-1].feed_forward.down_proj):
        handle = module.register_forward_hook(lambda mod, args, out: seen.append(
            (out[0] if isinstance(out, tuple) else out).abs().sum().item()))
        want = _decode(model, ids, 2, fused=False)
        seen.clear()
        got = _decode(model, ids, 2, fused=True)
        handle.remove()
        assert len(seen) == 3 and all(v > 0 for v in seen)  # prefill and two steps, outputs computed
        assert all(torch.equal(g, w) for g, w in zip(got[0], want[0]))
        assert all(torch.equal(g[k], w[k]) for g, w in zip(got[1], want[1]) for k in w)
        assert len(_one_step_calls(monkeypatch, model)) == SIZES["num_hidden_layers"]  # unhooked again: all fused


def _one_step_calls(monkeypatch, model, **step_kwargs) -> list:
    """The fused ops called by one decode step of `model` after a prefill of three tokens."""
    ids = torch.randint(0, SIZES["vocab_size"], (1, 3), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cache = output_cache(model(ids, use_cache=True))
    calls = _counted(monkeypatch)
    with torch.no_grad():
        model(ids[:, :1], use_cache=True, **{CACHE_ARGUMENT: cache}, **step_kwargs)
    monkeypatch.undo()
    return calls


def test_decode_step_keeps_the_unfused_block_where_it_cannot_stand_in(monkeypatch):
    """Hooks on a module the fused calls stand in for fire (the block runs unfused); so do a replaced forward and a
    replaced module; dropout at work in training mode, other norms, an MLP feed-forward and a float64 model keep the
    unfused block; autograd and a padded step too. The unhooked model takes the fused calls."""
    _kernels()
    model = _model("fla_delta_net", torch.float32)
    assert len(_one_step_calls(monkeypatch, model)) == SIZES["num_hidden_layers"]
    block = model.model.layers[0]
    for module in (block.feed_forward.down_proj, block.ff_norm, block.fast_weight.o_proj, block.fast_weight,
                   block.feed_forward.act, block.fast_weight.beta_proj):
        fired = []
        handle = module.register_forward_hook(lambda *args: fired.append(1))
        calls = _one_step_calls(monkeypatch, model)
        handle.remove()
        assert fired == [1, 1] and len(calls) == SIZES["num_hidden_layers"] - 1, module  # prefill, step
    block.fast_weight_norm.forward = block.fast_weight_norm.forward  # a forward of the instance's own
    assert len(_one_step_calls(monkeypatch, model)) == SIZES["num_hidden_layers"] - 1
    del block.fast_weight_norm.forward
    original = block.feed_forward.up_proj
    block.feed_forward.up_proj = torch.nn.Linear(SIZES["hidden_size"], SIZES["intermediate_size"], bias=False)
    assert len(_one_step_calls(monkeypatch, model)) == SIZES["num_hidden_layers"] - 1
    block.feed_forward.up_proj = original
    mask = torch.tensor([[1, 1, 1, 1]])
    assert _one_step_calls(monkeypatch, model, attention_mask=mask)  # an all-ones mask: no padding, fused
    assert not _one_step_calls(monkeypatch, model, attention_mask=torch.tensor([[1, 1, 1, 0]]))  # padded
    for other in (_model("fla_delta_net", torch.float32, hidden_dropout=0.1).train(),
                  _model("fla_delta_net", torch.float32, norm_type="layer_norm"),
                  _model("fla_delta_net", torch.float32, feed_forward_type="mlp", hidden_act="gelu"),
                  _model("fla_delta_net", torch.float64)):
        assert not _one_step_calls(monkeypatch, other)
    assert _one_step_calls(monkeypatch, _model("fla_delta_net", torch.float32, hidden_dropout=0.1))  # eval
    ids = torch.randint(0, SIZES["vocab_size"], (1, 3))
    calls = _counted(monkeypatch)
    cache = output_cache(model(ids, use_cache=True))
    model(ids[:, :1], use_cache=True, **{CACHE_ARGUMENT: cache}).logits.sum().backward()  # autograd
    assert not calls and block.feed_forward.down_proj.weight.grad is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2])
def test_block_ops_equal_the_ops_they_stand_in_for(dtype, rows):
    """norm_linears: normalize_rows then dense_linears; swiglu_block: dense_linear, torch's add, normalize_rows,
    dense_linears, torch's silu and mul, dense_linear and add: bit for bit (weights of odd sizes); bad shapes name
    the argument."""
    _kernels()
    gen = torch.Generator().manual_seed(rows)
    D, Dv, F_ = 40, 24, 56
    x = torch.randn(rows, D, generator=gen).to(dtype)
    norm_weight = (1 + torch.randn(D, generator=gen)).to(dtype)
    weights = [torch.randn(n, D, generator=gen).to(dtype) / 4 for n in (7, 33, 1)]
    with torch.no_grad():
        got = dense.norm_linears(x, norm_weight, 1e-6, weights)
        want = dense_linears(normalize_rows(x, norm_weight, 1e-6, mean_square=True), weights)
        assert all(torch.equal(g, w) for g, w in zip(got, want))
        mixed = torch.randn(rows, Dv, generator=gen).to(dtype)
        o_weight, down = (torch.randn(D, n, generator=gen).to(dtype) / 4 for n in (Dv, F_))
        gate, up = (torch.randn(F_, D, generator=gen).to(dtype) / 4 for _ in range(2))
        got = dense.swiglu_block(x, mixed, o_weight, norm_weight, 1e-5, gate, up, down)
        h = x + dense.dense_linear(mixed, o_weight)
        g, u = dense_linears(normalize_rows(h, norm_weight, 1e-5, mean_square=True), [gate, up])
        assert torch.equal(got, h + dense.dense_linear(torch.nn.functional.silu(g) * u, down))
    with pytest.raises(ValueError, match="`weights`"):
        dense.norm_linears(x, norm_weight, 1e-6, [weights[0], torch.randn(3, D - 1).to(dtype)])
    with pytest.raises(ValueError, match="`norm_weight`"):
        dense.norm_linears(x, norm_weight[:-1], 1e-6, weights)
    with pytest.raises(ValueError, match="`down_weight`"):
        dense.swiglu_block(x, mixed, o_weight, norm_weight, 1e-5, gate, up, down.t())
    with pytest.raises(ValueError, match="`mixed`"):
        dense.swiglu_block(x, mixed[:, :-1], o_weight, norm_weight, 1e-5, gate, up, down)



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_block_decode_step_equals_its_three_calls(name, dtype):
    """block_decode_step: norm_linears, the layer's token step (``token_step_from``) and swiglu_block, bit for bit,
    from a carried state with a non-contiguous convolution state and from no state; a float32 convolution state of a
    bfloat16 layer is rounded first, as the layer's Python rounds it; bad arguments name themselves."""
    _kernels()
    block = _model(name, dtype).model.layers[0]
    layer, ff = block.fast_weight, block.feed_forward
    norm_weights = [block.fast_weight_norm.weight, block.ff_norm.weight]
    eps = (block.fast_weight_norm.eps, block.ff_norm.eps)
    projections = [m.weight for m in layer.token_step_projections()]
    weights = projections + [layer.o_proj.weight, ff.gate_proj.weight, ff.up_proj.weight, ff.down_proj.weight]
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, SIZES["hidden_size"], generator=gen).to(dtype)
    with torch.no_grad():
        carried = layer(torch.randn(2, 3, SIZES["hidden_size"], generator=gen).to(dtype))[1]
        conv_q = carried["conv_q"]
        carried["conv_q"] = conv_q.transpose(1, 2).contiguous().transpose(1, 2)  # same values, other strides
        assert not carried["conv_q"].is_contiguous()
        wide = dict(carried, conv_k=carried["conv_k"].float())
        for state in (carried, {}, wide):
            out, fast_weight, conv_states = block_decode_step(x, norm_weights, eps, weights,
                                                              **layer.token_step_settings(state))
            rounded = dict(state, conv_k=state["conv_k"].to(dtype)) if state else state
            mixed, want_state = layer.token_step_from(
                dense.norm_linears(x, norm_weights[0], eps[0], projections), rounded)
            want = dense.swiglu_block(x, mixed, *weights[-4:-3], norm_weights[1], eps[1], *weights[-3:])
            got_state = layer.token_step_state(fast_weight, conv_states)
            assert torch.equal(out, want) and sorted(got_state) == sorted(want_state)
            assert all(torch.equal(got_state[key], want_state[key]) for key in want_state)
        settings = layer.token_step_settings(carried)
        with pytest.raises(ValueError, match="`weights`"):
            block_decode_step(x, norm_weights, eps, weights[1:], **settings)
        with pytest.raises(ValueError, match="`num_heads`"):
            block_decode_step(x, norm_weights, eps, weights, **dict(settings, num_heads=5))
        with pytest.raises(ValueError, match="`feature_map`"):
            block_decode_step(x, norm_weights, eps, weights, **dict(settings, feature_map="dpfp"))
        with pytest.raises(TypeError, match="options"):
            block_decode_step(x, norm_weights, eps, weights, **dict(settings, gate=x))
        with pytest.raises(RuntimeError, match="token_step"):  # the op's own checks: q's rows against the heads
            block_decode_step(x, norm_weights, eps, [weights[0][:-2]] + weights[1:], **settings)
