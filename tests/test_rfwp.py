"""Recurrent Fast Weight Programmers (Irie et al. 2021): the scan kernels and the five model families."""
import sys

import pytest
import torch

import modeling_fwp
from fwp_kernels import ScanState, fast_rnn_scan, recurrent_delta_rule, rfwp_scan
from fwp_kernels.fast_rnn_scan_kernels import CELLS
from modeling_fwp import (
    DeltaDeltaNetConfig,
    DeltaLSTMConfig,
    DeltaMLPConfig,
    DeltaNetConfig,
    DeltaRNNConfig,
    FastWeightCache,
    RecurrentDeltaNetConfig,
)

from conftest import check_bfloat16_forward, relative_error, tiny_config, tiny_model, triton_interpreted_results

needs_cpu_kernel = pytest.mark.skipif(
    not rfwp_scan.cpu_kernel_available(), reason="the C++ scans could not be built here (step loop only)"
)


# ---------------------------------------------------------------------------------------------------------------
# kernels: inputs, one run, and the comparison of two runs
# ---------------------------------------------------------------------------------------------------------------


def scan_inputs(kind, B=2, H=2, T=9, D=5, dtype=torch.float32, seed=0):
    """Leaf tensors for one scan: `kind` is a cell of CELLS or "rdn" (Recurrent Delta Net)."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)

    if kind == "rdn":
        x = dict(q=rand(B, H, T, D), k=rand(B, H, T, D), v=rand(B, H, T, D), beta=rand(B, H, T),
                 r_q=rand(H, D, D, scale=0.5), r_k=rand(H, D, D, scale=0.5), r_v=rand(H, D, D, scale=0.5),
                 r_beta=rand(H, D), fast_weight=rand(B, H, D, D, scale=0.3), output=rand(B, H, D))
    else:
        G = 3 if kind.startswith("lstm") else 1
        x = dict(z=rand(B, H, G, T, D), k=rand(B, H, G, T, D), v=rand(B, H, G, T, D), beta=rand(B, H, G, T),
                 fast_weight=rand(B, H, G, D, D, scale=0.3), output=rand(B, H, D))
        if G == 3:
            x["cell"] = rand(B, H, D)
    return {name: t.requires_grad_() for name, t in x.items()}


def padding_mask(B, T):
    mask = torch.ones(B, T)
    mask[0, :2] = 0  # a left-padded row
    if B > 1:
        mask[1, T // 2] = 0  # and a hole in the middle
    return mask


def run_scan(kind, x, mode, mask=None):
    """(y, final state), from raw inputs: keys and betas get the activations a layer would apply."""
    state = ScanState(x["fast_weight"], x["output"], x.get("cell"))
    if kind == "rdn":
        return recurrent_delta_rule(x["q"], x["k"], x["v"], x["beta"], x["r_q"], x["r_k"], x["r_v"], x["r_beta"],
                                    initial_state=state, mask=mask, output_final_state=True, mode=mode)
    return fast_rnn_scan(x["z"], torch.softmax(x["k"], -1), x["v"], torch.sigmoid(x["beta"]), cell=kind,
                         initial_state=state, mask=mask, output_final_state=True, mode=mode)


def outputs_and_grads(kind, x, mode, mask=None):
    """Outputs, final states and the gradients of every input of a random projection of all of them."""
    y, final = run_scan(kind, x, mode, mask)
    results = {"y": y, **{f"final_{n}": t for n, t in final._asdict().items() if t is not None}}
    g = torch.Generator().manual_seed(7)
    loss = sum((t * torch.randn(t.shape, generator=g).to(t)).sum() for t in results.values())
    names = list(x)
    grads = torch.autograd.grad(loss, [x[n] for n in names])
    results.update({f"grad_{n}": gr for n, gr in zip(names, grads)})
    return results


def assert_close_dicts(got, expected, rtol, atol):
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


KINDS = list(CELLS) + ["rdn"]


@needs_cpu_kernel
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("with_mask", [False, True], ids=["no-mask", "mask"])
def test_cpu_kernel_matches_step_loop(kind, with_mask):
    x = scan_inputs(kind)
    mask = padding_mask(2, 9) if with_mask else None
    expected = outputs_and_grads(kind, x, "recurrent", mask)
    got = outputs_and_grads(kind, x, "fused", mask)
    assert_close_dicts(got, expected, rtol=1e-4, atol=1e-5)


@needs_cpu_kernel
@pytest.mark.parametrize("kind", ["rnn_b", "lstm_c", "rdn"])
@pytest.mark.parametrize("threads", [1, 2])
def test_cpu_kernel_matches_step_loop_at_1_and_2_threads(kind, threads):
    """The fused scans run one (batch, head) sequence per task of at::parallel_for over every torch thread."""
    x = scan_inputs(kind)
    expected = outputs_and_grads(kind, x, "recurrent", padding_mask(2, 9))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = outputs_and_grads(kind, x, "fused", padding_mask(2, 9))
    finally:
        torch.set_num_threads(before)
    assert_close_dicts(got, expected, rtol=1e-4, atol=1e-5)


@needs_cpu_kernel
@pytest.mark.parametrize("kind", KINDS)
def test_cpu_kernel_gradcheck_float64(kind):
    x = scan_inputs(kind, B=1, H=1, T=3, D=3, dtype=torch.float64, seed=3)
    names = list(x)
    mask = torch.tensor([[1.0, 0.0, 1.0]])

    def fn(*tensors):
        y, final = run_scan(kind, dict(zip(names, tensors)), "fused", mask)
        return (y,) + tuple(t for t in final if t is not None)

    assert torch.autograd.gradcheck(fn, tuple(x[n] for n in names), eps=1e-6, atol=1e-6)


@needs_cpu_kernel
@pytest.mark.parametrize("kind", ["lstm_d", "rdn"])
def test_backward_stores_no_fast_weight_per_step(kind):
    """The custom backward undoes the delta rule writes: nothing of size T x D x D is saved."""
    B, H, T, D = 1, 2, 64, 8
    x = scan_inputs(kind, B=B, H=H, T=T, D=D)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        y, _ = run_scan(kind, x, "fused")
    y.sum().backward()
    G = 3 if kind.startswith("lstm") else 1
    assert max(saved) < B * H * G * T * D * D / 2, sorted(saved)[-3:]


# Fused scans on bfloat16 inputs vs the float64 step loop on the same rounded inputs: measured norm-wise relative
# error of y and of every final state <= 2.8e-3 over every kind (3 seeds, T = 5; bf16 unit roundoff 3.9e-3: y is
# rounded once, the recurrent keys' softmax is taken in bfloat16).
BF16_SCAN_TOL = 8e-3


@needs_cpu_kernel
@pytest.mark.parametrize("kind", KINDS)
def test_fused_scans_run_bfloat16_inputs_with_float32_states(kind):
    x = {n: t.detach().to(torch.bfloat16) for n, t in scan_inputs(kind, T=5).items()}
    y, final = run_scan(kind, x, "fused")
    y_ref, final_ref = run_scan(kind, {n: t.double() for n, t in x.items()}, "recurrent")
    assert y.dtype == torch.bfloat16 and all(t.dtype == torch.float32 for t in final if t is not None)
    errors = {"y": relative_error(y, y_ref)}
    errors.update({name: relative_error(t, t_ref) for name, t, t_ref in zip(final._fields, final, final_ref)
                   if t_ref is not None})
    assert max(errors.values()) < BF16_SCAN_TOL, errors


@pytest.mark.parametrize("kind", ["rnn_b", "lstm_c", "rdn"])
def test_padded_positions_leave_every_state_unchanged(kind):
    """Padding anywhere: the result equals running the scan without those positions at all."""
    x = {n: t.detach() for n, t in scan_inputs(kind, B=1, T=6).items()}
    mask = torch.tensor([[0.0, 1, 1, 0, 0, 1]])
    keep = mask[0].bool()
    y, final = run_scan(kind, x, "auto", mask)
    time_dim = {"z": 3, "k": 3 if kind != "rdn" else 2, "v": 3 if kind != "rdn" else 2,
                "beta": 3 if kind != "rdn" else 2, "q": 2}
    dense = {n: (t.index_select(time_dim[n], keep.nonzero()[:, 0]) if n in time_dim else t) for n, t in x.items()}
    y_dense, final_dense = run_scan(kind, dense, "recurrent")
    torch.testing.assert_close(y[:, :, keep], y_dense, rtol=1e-5, atol=1e-6)
    for got, expected in zip(final, final_dense):
        if expected is not None:
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    # a padded step outputs the previous output
    torch.testing.assert_close(y[:, :, 4], y[:, :, 2])


def test_step_loop_fallback_when_the_build_is_unavailable(monkeypatch):
    x = scan_inputs("rnn_a", T=4)
    expected, _ = run_scan("rnn_a", x, "recurrent")
    monkeypatch.setattr(rfwp_scan, "cpu_kernel_available", lambda: False)
    y, _ = run_scan("rnn_a", x, "auto")
    torch.testing.assert_close(y, expected)
    with pytest.raises(NotImplementedError, match="no fused recurrent FWP scan"):
        run_scan("rnn_a", x, "fused")


def test_scan_bad_inputs_raise_naming_the_argument():
    x = {n: t.detach() for n, t in scan_inputs("rnn_b").items()}
    z, k, v, beta = x["z"], x["k"], x["v"], x["beta"]
    with pytest.raises(ValueError, match="`cell`"):
        fast_rnn_scan(z, k, v, beta, cell="gru")
    with pytest.raises(ValueError, match="G = 3"):
        fast_rnn_scan(z, k, v, beta, cell="lstm_d")
    with pytest.raises(ValueError, match="`k`"):
        fast_rnn_scan(z, k[..., :4], v, beta)
    with pytest.raises(ValueError, match="`beta`"):
        fast_rnn_scan(z, k, v, beta[..., :3])
    with pytest.raises(ValueError, match="`mask`"):
        fast_rnn_scan(z, k, v, beta, mask=torch.ones(3, 9))
    with pytest.raises(ValueError, match="`mode`"):
        fast_rnn_scan(z, k, v, beta, mode="chunk")
    with pytest.raises(ValueError, match="initial_state.fast_weight"):
        fast_rnn_scan(z, k, v, beta, initial_state=ScanState(torch.zeros(2, 2, 1, 4, 4)))
    r = {n: t.detach() for n, t in scan_inputs("rdn").items()}
    args = [r[n] for n in ("q", "k", "v", "beta", "r_q", "r_k", "r_v", "r_beta")]
    with pytest.raises(ValueError, match="`r_q`"):
        recurrent_delta_rule(*args[:4], r["r_q"][:, :4], *args[5:])
    with pytest.raises(ValueError, match="`r_beta`"):
        recurrent_delta_rule(*args[:7], r["r_beta"][:1])
    with pytest.raises(ValueError, match="`v`"):
        recurrent_delta_rule(args[0], args[1], args[2][..., :4], *args[3:])


# ---------------------------------------------------------------------------------------------------------------
# Triton kernels, under the interpreter on CPU at tiny shapes. Triton reads TRITON_INTERPRET when it is
# imported, so the interpreted runs happen in one subprocess that sets the variable before any import.
# ---------------------------------------------------------------------------------------------------------------


def _triton_errors():
    """{kind: max abs difference of every output and gradient} for the Triton kernels vs the step loop."""
    from fwp_kernels import triton_rfwp

    errors = {}
    for kind in KINDS:
        x = scan_inputs(kind, B=1, H=1, T=3, D=3, seed=5)
        mask = torch.tensor([[1.0, 0.0, 1.0]])
        expected = outputs_and_grads(kind, x, "recurrent", mask)
        original = rfwp_scan._backend
        rfwp_scan._backend = lambda device: triton_rfwp
        try:
            got = outputs_and_grads(kind, x, "fused", mask)
        finally:
            rfwp_scan._backend = original
        errors[kind] = {n: (got[n] - expected[n]).abs().max().item() for n in expected}
    return errors


@pytest.fixture(scope="module")
def triton_interpreted_errors():
    return triton_interpreted_results(__file__)


@pytest.mark.triton
@pytest.mark.parametrize("kind", KINDS)
def test_triton_kernel_matches_step_loop(triton_interpreted_errors, kind):
    errors = triton_interpreted_errors[kind]
    assert max(errors.values()) < 1e-4, errors


# ---------------------------------------------------------------------------------------------------------------
# models
# ---------------------------------------------------------------------------------------------------------------

VARIANTS = [
    (DeltaMLPConfig, {}),
    (DeltaMLPConfig, {"fast_net_depth": 2}),
    (DeltaMLPConfig, {"fast_net_activation": "feature_map"}),
    (DeltaDeltaNetConfig, {}),
    (DeltaRNNConfig, {"version": "A"}),
    (DeltaRNNConfig, {"version": "B"}),
    (DeltaLSTMConfig, {"version": "A"}),
    (DeltaLSTMConfig, {"version": "B"}),
    (DeltaLSTMConfig, {"version": "C"}),
    (DeltaLSTMConfig, {"version": "D"}),
    (RecurrentDeltaNetConfig, {}),
]
FAMILIES = [DeltaMLPConfig, DeltaDeltaNetConfig, DeltaRNNConfig, DeltaLSTMConfig, RecurrentDeltaNetConfig]


def variant_id(variant):
    cls, overrides = variant
    return cls.__name__.replace("Config", "") + "".join(f"-{k}={v}" for k, v in overrides.items())


def stepwise_logits(model, ids, **kwargs):
    cache, logits = None, []
    for t in range(ids.shape[1]):
        out = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True, **kwargs)
        cache = out.past_key_values
        logits.append(out.logits)
    return torch.cat(logits, dim=1), cache


@pytest.mark.parametrize("variant", VARIANTS, ids=variant_id)
def test_cached_steps_equal_full_forward(variant):
    cls, overrides = variant
    model = tiny_model(cls, **overrides)
    ids = torch.randint(3, 61, (2, 10), generator=torch.Generator().manual_seed(1))
    full = model(ids).logits
    steps, cache = stepwise_logits(model, ids)
    torch.testing.assert_close(steps, full, rtol=1e-4, atol=1e-5)
    assert isinstance(cache, FastWeightCache) and cache.get_seq_length() == 10
    prefix = model(ids[:, :6], use_cache=True)
    rest = model(ids[:, 6:], past_key_values=prefix.past_key_values, use_cache=True).logits
    torch.testing.assert_close(torch.cat([prefix.logits, rest], 1), full, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("variant", VARIANTS, ids=variant_id)
def test_generate_with_and_without_cache(variant):
    cls, overrides = variant
    model = tiny_model(cls, **overrides)
    ids = torch.randint(3, 61, (2, 4))
    with_cache = model.generate(ids, max_new_tokens=6, do_sample=False, use_cache=True)
    without = model.generate(ids, max_new_tokens=6, do_sample=False, use_cache=False)
    assert with_cache.shape == (2, 10) and torch.equal(with_cache, without)


@pytest.mark.parametrize("cls", [DeltaRNNConfig, DeltaLSTMConfig, RecurrentDeltaNetConfig], ids=lambda c: c.__name__)
def test_beam_search_with_and_without_cache(cls):
    model = tiny_model(cls)
    ids = torch.randint(3, 61, (2, 4))
    kwargs = dict(max_new_tokens=5, num_beams=3, num_return_sequences=2, do_sample=False)
    with_cache = model.generate(ids, use_cache=True, **kwargs)
    assert with_cache.shape[0] == 4 and torch.equal(with_cache, model.generate(ids, use_cache=False, **kwargs))


@pytest.mark.parametrize("cls", [DeltaRNNConfig, DeltaLSTMConfig, RecurrentDeltaNetConfig], ids=lambda c: c.__name__)
def test_left_padded_batch_equals_each_prompt_alone(cls):
    model = tiny_model(cls)
    prompts = [torch.randint(3, 61, (n,)) for n in (6, 3)]
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = p, 1
    batched = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    for i, p in enumerate(prompts):
        alone = model.generate(p[None], max_new_tokens=5, do_sample=False, pad_token_id=0)[0, len(p) :]
        assert torch.equal(batched[i, width : width + len(alone)], alone)


@pytest.mark.parametrize("variant", VARIANTS, ids=variant_id)
def test_padded_positions_change_no_state(variant):
    """W, R, y and c after a left-padded prompt (garbage under the padding) equal those of the prompt alone."""
    cls, overrides = variant
    model = tiny_model(cls, **overrides)
    ids = torch.randint(3, 61, (1, 5))
    padded = torch.cat([torch.randint(3, 61, (1, 3)), ids], 1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 5, dtype=torch.long)], 1)
    alone = model(ids, use_cache=True).past_key_values
    batched = model(padded, attention_mask=mask, use_cache=True).past_key_values
    for layer_alone, layer_batched in zip(alone.layers, batched.layers):
        assert layer_alone.states.keys() == layer_batched.states.keys()
        for name, expected in layer_alone.states.items():
            torch.testing.assert_close(layer_batched.states[name], expected, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("cls", FAMILIES, ids=lambda c: c.__name__)
def test_fused_kernels_give_the_step_loop_gradients_in_the_model(cls):
    ids = torch.randint(3, 61, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :3] = 0
    grads = []
    for kernel_mode in ("recurrent", "auto"):
        model = tiny_model(cls, kernel_mode=kernel_mode).train()
        model(ids, attention_mask=mask, labels=ids).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert all(g is not None for g in grads[1].values())
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-4, atol=1e-6, msg=name)


FAVOR_VARIANTS = [(DeltaMLPConfig, {"fast_net_activation": "feature_map"}), (DeltaDeltaNetConfig, {}),
                  (DeltaRNNConfig, {}), (DeltaLSTMConfig, {})]  # the Recurrent Delta Net has no feature map


@pytest.mark.parametrize("variant", FAVOR_VARIANTS, ids=variant_id)
def test_favor_features_drawn_once_per_training_forward_and_replayed_under_checkpointing(variant, monkeypatch):
    """One draw of R per feature map and training forward (sec. 5.3: per batch), outside the checkpointed blocks:
    with checkpointing that does not replay the random generator, loss, gradients and R equal the plain run's."""
    from modeling_fwp import feature_maps

    draws = []
    draw = feature_maps.gaussian_random_features
    monkeypatch.setattr(feature_maps, "gaussian_random_features", lambda *a, **k: draws.append(a) or draw(*a, **k))
    cls, overrides = variant
    ids = torch.randint(3, 61, (2, 10), generator=torch.Generator().manual_seed(1))
    runs = []
    for checkpointing in (False, True):
        model = tiny_model(cls, feature_map="favor", favor_features=6, **overrides).train()
        if checkpointing:
            model.activation_checkpointing_enable({"use_reentrant": False, "preserve_rng_state": False})
        maps = [m for m in model.modules() if isinstance(m, feature_maps.FeatureMap)]
        draws.clear()
        torch.manual_seed(5)
        loss = model(ids, labels=ids).loss
        loss.backward()
        assert len(draws) == len(maps) > 0  # once each, the recomputation included
        runs.append([loss.detach()] + [m.projection.clone() for m in maps] + [p.grad for p in model.parameters()])
    for got, expected in zip(runs[1], runs[0]):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cls", FAMILIES, ids=lambda c: c.__name__)
def test_save_load_round_trip_with_auto_classes(tmp_path, cls):
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    overrides = {"version": "A"} if cls in (DeltaRNNConfig, DeltaLSTMConfig) else {}
    model = tiny_model(cls, **overrides)
    model.save_pretrained(tmp_path)
    config = AutoConfig.from_pretrained(tmp_path)
    assert type(config) is cls and config.model_type.startswith("fwp_")
    assert getattr(config, "version", "A") == "A"
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(reloaded) is type(model)
    ids = torch.randint(3, 61, (2, 6))
    torch.testing.assert_close(reloaded(ids).logits, model(ids).logits)
    assert type(AutoModel.from_pretrained(tmp_path)).__name__ == cls.__name__.replace("Config", "Model")


@pytest.mark.parametrize("variant", VARIANTS, ids=variant_id)
def test_bfloat16_model_runs_with_float32_states(variant):
    cls, overrides = variant
    check_bfloat16_forward(tiny_model(cls, **overrides))


# ---------------------------------------------------------------------------------------------------------------
# parameter counts at the paper's small configuration
# ---------------------------------------------------------------------------------------------------------------


def paper_small(cls, **overrides):
    """Irie et al. 2021 sec. 4.1 (WikiText-103 small): 16 layers, d_model 128, 8 heads of 16, d_ff 2048."""
    return cls(vocab_size=1000, hidden_size=128, num_attention_heads=8, num_hidden_layers=16, intermediate_size=2048,
               **overrides)


def extra_parameters_per_layer(cls, D=128, H=8, d=16, K=1):
    """What each model adds to a Delta Net layer, counted from the paper's equations.

    The Delta Net layer: W_q, W_k, W_v [D, H d] (no bias), W_beta [D, H] with bias, output projection [H d, D].
    """
    beta = D * H + H  # one more slow beta per head (weights and bias)
    if cls is RecurrentDeltaNetConfig:
        return 3 * H * d * d + H * d  # R_q, R_k, R_v [d, d] and r_beta [d] per head, nothing else
    if cls is DeltaRNNConfig:
        return D * H * 2 * d + beta  # the recurrent fast weight's own slow key, value and beta
    if cls is DeltaLSTMConfig:
        return D * H * 12 * d + 5 * beta  # 6 fast weights (3 gates x feedforward/recurrent) vs 1
    if cls is DeltaDeltaNetConfig:
        return D * H * (2 * d + 1)  # the slow value programs a fast q, k, v (3d) and beta (1)
    if cls is DeltaMLPConfig:
        f = 4 * d  # per block: U [f, d] and V [d, f], each with its own key, value and beta, and a LayerNorm(d)
        return D * H * (d + K * (d + f + f + d) - 3 * d) + (2 * K - 1) * beta + K * 2 * d
    raise AssertionError(cls)


@pytest.mark.parametrize(
    "cls,overrides",
    [(DeltaMLPConfig, {}), (DeltaMLPConfig, {"fast_net_depth": 3}), (DeltaDeltaNetConfig, {}),
     (DeltaRNNConfig, {}), (DeltaLSTMConfig, {}), (RecurrentDeltaNetConfig, {})],
    ids=lambda x: x.__name__ if isinstance(x, type) else str(x),
)
def test_parameter_counts_follow_the_paper(cls, overrides):
    from transformers import AutoModelForCausalLM

    def count(config):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        return sum(p.numel() for p in model.parameters()), model

    delta_net, _ = count(paper_small(DeltaNetConfig))
    total, model = count(paper_small(cls, **overrides))
    per_layer = extra_parameters_per_layer(cls, K=overrides.get("fast_net_depth", 1))
    assert total - delta_net == 16 * per_layer
    layer = model.model.layers[0].fast_weight
    assert type(layer).__name__ != "FastWeightLinearAttention"
    if cls is RecurrentDeltaNetConfig:
        assert sorted(n for n, _ in layer.named_parameters() if not n.startswith(("slow.", "o_proj."))) == [
            "r_beta", "r_k", "r_q", "r_v"
        ]


# ---------------------------------------------------------------------------------------------------------------
# bad input and registration
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cls,kwargs,argument",
    [
        (DeltaRNNConfig, dict(version="C"), "version"),
        (DeltaRNNConfig, dict(version="b"), "version"),
        (DeltaLSTMConfig, dict(version="E"), "version"),
        (DeltaLSTMConfig, dict(version=None), "version"),
        (DeltaMLPConfig, dict(fast_net_depth=0), "fast_net_depth"),
        (DeltaMLPConfig, dict(fast_net_depth=-2), "fast_net_depth"),
        (DeltaMLPConfig, dict(fast_net_depth=1.5), "fast_net_depth"),
        (DeltaMLPConfig, dict(fast_net_activation="relu"), "fast_net_activation"),
        (DeltaMLPConfig, dict(feature_map="favor"), "feature_map"),  # softmax queries: phi must keep head_dim
        (RecurrentDeltaNetConfig, dict(feature_map="elu"), "feature_map"),
        (DeltaRNNConfig, dict(feature_map="softmax"), "feature_map"),
        (DeltaLSTMConfig, dict(hidden_size=30), "hidden_size"),  # 30 is not divisible by 4 heads
        (DeltaRNNConfig, dict(hidden_size=4, num_attention_heads=4), "head_dim"),  # softmax over 1 entry
        (DeltaDeltaNetConfig, dict(update_rule="sum"), "update_rule"),
        (DeltaMLPConfig, dict(attention_normalization=True), "attention_normalization"),
        (DeltaRNNConfig, dict(feature_map="dpfp", dpfp_nu=4), "dpfp_nu"),
        # settings a family never reads are refused, not ignored
        (RecurrentDeltaNetConfig, dict(sum_normalization=False), "sum_normalization"),  # its softmax is normalised
        (RecurrentDeltaNetConfig, dict(chunk_size=16), "chunk_size"),  # one scan, no chunkwise form
        (RecurrentDeltaNetConfig, dict(kernel_mode="chunk"), "kernel_mode"),
        (RecurrentDeltaNetConfig, dict(dpfp_nu=2), "dpfp_nu"),  # no feature map
        (RecurrentDeltaNetConfig, dict(favor_features=8), "favor_features"),
        (DeltaMLPConfig, dict(kernel_mode="fused"), "kernel_mode"),  # no scan
        (DeltaNetConfig, dict(kernel_mode="fused"), "kernel_mode"),
        (DeltaRNNConfig, dict(fast_net_depth=2), "fast_net_depth"),  # another family's field
        (DeltaMLPConfig, dict(version="A"), "version"),
        (DeltaNetConfig, dict(fast_net_activation="softmax"), "fast_net_activation"),
    ],
)
def test_bad_config_raises_naming_the_argument(cls, kwargs, argument):
    with pytest.raises(ValueError, match=argument):
        tiny_config(cls, **kwargs)


def test_unused_fields_keep_accepting_their_defaults():
    """Configs saved before unused fields were refused hold their defaults (a Recurrent Delta Net's
    ``sum_normalization`` resolved to True): they still load, and a config's own dict builds it again."""
    from transformers import AutoConfig

    saved = dict(tiny_config(RecurrentDeltaNetConfig).to_dict(), sum_normalization=True, chunk_size=64, dpfp_nu=1,
                 favor_features=64, kernel_mode="auto")
    assert AutoConfig.for_model(**saved).sum_normalization is True
    for cls in FAMILIES:
        config = tiny_config(cls)
        assert type(config).from_dict(config.to_dict()).to_dict() == config.to_dict()


@pytest.mark.parametrize(
    "cls,kernel_mode,delta_mode,scan_mode",
    [(DeltaRNNConfig, "chunk", "chunk", "auto"), (DeltaRNNConfig, "fused", "auto", "fused"),
     (DeltaLSTMConfig, "recurrent", "recurrent", "recurrent"), (DeltaLSTMConfig, "fused", "auto", "fused"),
     (DeltaMLPConfig, "chunk", "chunk", None), (RecurrentDeltaNetConfig, "fused", None, "fused")],
)
def test_kernel_mode_reaches_the_recurrences_that_have_it(monkeypatch, cls, kernel_mode, delta_mode, scan_mode):
    """Each mode goes to the recurrence it names ("chunk": delta rule, "fused": scans), the other runs "auto"; every
    mode computes the step loops' logits."""
    from modeling_fwp import rfwp_layers

    modes = {"delta": set(), "scan": set()}
    for name, kind in (("delta_rule", "delta"), ("fast_rnn_scan", "scan"), ("recurrent_delta_rule", "scan")):
        kernel = getattr(rfwp_layers, name)
        spy = (lambda kernel, kind: lambda *a, **k: modes[kind].add(k["mode"]) or kernel(*a, **k))(kernel, kind)
        monkeypatch.setattr(rfwp_layers, name, spy)
    ids = torch.randint(3, 61, (2, 7), generator=torch.Generator().manual_seed(0))
    if scan_mode == "fused" and not rfwp_scan.cpu_kernel_available():
        pytest.skip("the C++ scans could not be built here")
    logits = tiny_model(cls, kernel_mode=kernel_mode)(ids).logits
    assert modes == {"delta": {delta_mode} - {None}, "scan": {scan_mode} - {None}}
    torch.testing.assert_close(logits, tiny_model(cls, kernel_mode="recurrent")(ids).logits, rtol=1e-4, atol=1e-5)


def test_kernel_mode_set_after_the_config_is_refused_by_the_layer():
    config = tiny_config(RecurrentDeltaNetConfig)
    config.kernel_mode = "chunk"  # a mode the Recurrent Delta Net has not: not silently "auto"
    from transformers import AutoModelForCausalLM

    with pytest.raises(ValueError, match="kernel_mode"):
        AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("feature_map", ["dpfp", "favor", "relu", "identity"])
def test_feedforward_fast_weights_take_every_feature_map(feature_map):
    # the Delta MLP's phi on a hidden layer of 4 d (its softmax activation needs a phi that keeps head_dim);
    # the Delta LSTM's gates folded into heads
    mlp_activation = "softmax" if feature_map in ("relu", "identity") else "feature_map"
    for cls, extra in ((DeltaMLPConfig, {"fast_net_activation": mlp_activation}), (DeltaLSTMConfig, {})):
        model = tiny_model(cls, feature_map=feature_map, dpfp_nu=2, favor_features=6, **extra)
        ids = torch.randint(3, 61, (1, 5))
        steps, _ = stepwise_logits(model, ids)
        torch.testing.assert_close(steps, model(ids).logits, rtol=1e-4, atol=1e-5)


def test_every_variant_is_registered_with_the_auto_classes():
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    for cls in FAMILIES:
        name = cls.__name__[: -len("Config")]
        assert cls.model_type.startswith("fwp_")
        kwargs = {k: v for k, v in tiny_config(cls).to_dict().items() if k != "model_type"}
        config = AutoConfig.for_model(cls.model_type, **kwargs)
        assert type(config) is cls
        assert type(AutoModel.from_config(config)) is getattr(modeling_fwp, f"{name}Model")
        assert type(AutoModelForCausalLM.from_config(config)) is getattr(modeling_fwp, f"{name}ForCausalLM")


if __name__ == "__main__" and sys.argv[1:] == ["--triton-worker"]:
    import json

    print(json.dumps(_triton_errors()))
