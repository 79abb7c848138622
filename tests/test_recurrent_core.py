"""The LSTM-like recurrent core (issue 22 item 2): equal to the full-sequence model on the same inputs, chunked calls
with a carried state equal one call, resets equal separate runs of each episode, gradients flow."""
import pytest
import torch

from modeling_fwp import (
    DeltaLSTMConfig,
    DeltaNetConfig,
    DeltaRNNConfig,
    FastWeightModel,
    FastWeightRecurrentCore,
    RecurrentDeltaNetConfig,
)

from conftest import tiny_config

# every recurrent family the issue names; the Delta Net with attention normalisation carries a second state (z)
VARIANTS = [(DeltaNetConfig, {}), (DeltaNetConfig, {"attention_normalization": True}), (DeltaRNNConfig, {}),
            (DeltaLSTMConfig, {}), (RecurrentDeltaNetConfig, {})]
RTOL, ATOL = 1e-5, 1e-5


def variant_id(variant):
    cls, overrides = variant
    return cls.__name__.replace("Config", "") + "".join(f"-{k}={v}" for k, v in overrides.items())


def make_core(variant, **kwargs):
    cls, overrides = variant
    torch.manual_seed(0)
    config = tiny_config(cls, hidden_size=16, num_attention_heads=2, intermediate_size=24, **overrides)
    return FastWeightRecurrentCore(config, **kwargs).eval()


def inputs(T, B, D, seed=0):
    return torch.randn(T, B, D, generator=torch.Generator().manual_seed(seed))


def assert_states_close(got, expected):
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("variant", VARIANTS, ids=variant_id)
def test_core_equals_the_full_sequence_model(variant):
    core = make_core(variant)
    model = FastWeightModel(core.config).eval()
    # the core's modules are the model's (less the embedding): the model's weights load into it
    core.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("embed_tokens")})
    x = inputs(9, 3, 16)
    y, state = core(x)
    out = model(inputs_embeds=x.transpose(0, 1), use_cache=True)
    torch.testing.assert_close(y, out.last_hidden_state.transpose(0, 1), rtol=RTOL, atol=ATOL)
    expected = tuple(out.past_key_values.layers[i].states[name] for i, name in core.state_names)
    assert_states_close(state, expected)


@pytest.mark.parametrize("variant", VARIANTS, ids=variant_id)
def test_chunked_calls_with_carried_state_equal_one_call_forward_and_backward(variant):
    core = make_core(variant, input_size=5)  # an input projection, as nn.LSTM(input_size != hidden_size)
    x = inputs(10, 2, 5).requires_grad_()
    runs = []
    for bounds in ((0, 10), (0, 1, 4, 10)):  # one call; a 1-step call (a decode step), then 3 and 6 steps
        core.zero_grad()
        x.grad = None
        state, ys = None, []
        for start, end in zip(bounds, bounds[1:]):
            y, state = core(x[start:end], state)
            ys.append(y)
        y = torch.cat(ys)
        (y.pow(2).sum() + sum(s.sum() for s in state)).backward()  # gradients cross the chunk boundaries
        runs.append([y.detach(), *(s.detach() for s in state), x.grad.clone()]
                    + [p.grad.clone() for p in core.parameters()])
    assert all(g.abs().sum() > 0 for g in runs[0][-len(list(core.parameters())):])  # every parameter gets one
    for got, expected in zip(runs[1], runs[0]):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("variant", VARIANTS, ids=variant_id)
def test_resets_equal_separate_runs_of_each_episode(variant):
    core = make_core(variant, batch_first=True)
    B, T = 3, 10
    x = inputs(B, T, 16, seed=1)
    _, carried = core(inputs(B, 4, 16, seed=2))  # a non-zero state to start from
    reset = torch.zeros(B, T, dtype=torch.bool)
    reset[0, 4] = True  # row 0: two episodes
    reset[1, 0] = reset[1, 7] = True  # row 1: the carried state is dropped at once, then a second episode
    # row 2: no reset, one episode continuing the carried state
    y, state = core(x, carried, reset)
    for b in range(B):
        starts = [0] + [t for t in range(1, T) if reset[b, t]]
        row_state = None if reset[b, 0] else tuple(s[b : b + 1] for s in carried)
        for i, (start, end) in enumerate(zip(starts, starts[1:] + [T])):
            # an episode alone: from the carried state (the row's first, unless reset at once), else from zeros
            expected, row_state = core(x[b : b + 1, start:end], row_state if i == 0 else None)
            torch.testing.assert_close(y[b : b + 1, start:end], expected, rtol=RTOL, atol=ATOL)
        assert_states_close(tuple(s[b : b + 1] for s in state), row_state)


def test_initial_state_is_the_zero_state_and_from_family_builds_like_lstm():
    core = FastWeightRecurrentCore.from_family("recurrent_delta_net", input_size=6, hidden_size=16, num_layers=2,
                                               num_attention_heads=4, intermediate_size=32)
    assert isinstance(core.config, RecurrentDeltaNetConfig) and len(core.layers) == 2
    x = inputs(5, 2, 6)
    zeros = core.initial_state(2)
    assert [n for _, n in core.state_names] == ["fast_weight", "output"] * 2
    assert all(s.shape[0] == 2 and not s.any() for s in zeros)
    y, state = core(x, zeros)
    y_none, state_none = core(x)
    assert y.shape == (5, 2, 16)
    torch.testing.assert_close(y, y_none)
    assert_states_close(state, state_none)
    lstm_y, _ = torch.nn.LSTM(6, 16)(x)
    assert lstm_y.shape == y.shape  # the same shapes in and out as nn.LSTM(6, 16)


@pytest.mark.parametrize(
    "call,argument",
    [
        (lambda core: core(torch.zeros(4, 2, 7)), "x"),
        (lambda core: core(torch.zeros(4, 2, 16), reset=torch.zeros(4, 3)), "reset"),
        (lambda core: core(torch.zeros(4, 2, 16), state=(torch.zeros(2, 1),)), "state"),
        (lambda core: core(torch.zeros(4, 2, 16), state=core.initial_state(3)), "state"),
        (lambda core: FastWeightRecurrentCore.from_family("transfo_xl", 4, 16), "family"),
        (lambda core: FastWeightRecurrentCore(tiny_config(DeltaNetConfig, position_embedding_type="learned")),
         "position_embedding_type"),
    ],
)
def test_bad_input_raises_naming_the_argument(call, argument):
    core = make_core((DeltaRNNConfig, {}))
    with pytest.raises(ValueError, match=argument):
        call(core)
