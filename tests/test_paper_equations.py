"""The layers against the papers' equations, written here token by token in float64.

- Delta rule with attention normalisation: Schlag, Irie, Schmidhuber 2021, sec. 4.2, eqs. 20-28.
- FAVOR+: the same paper, sec. 5.3, eqs. 31-32.
- Delta MLP: Irie, Schlag, Csordas, Schmidhuber 2021, sec. 3.1, eqs. 13-14 (and appendix A.2).
"""
import math

import pytest
import torch

from modeling_fwp import DeltaNetConfig
from modeling_fwp.fast_weight_layers import FastWeightLinearAttention

from conftest import relative_error, tiny_config


# ---------------------------------------------------------------------------------------------------------------
# feature maps as the papers write them
# ---------------------------------------------------------------------------------------------------------------


def phi_reference(x: torch.Tensor, kind: str, sum_normalization: bool) -> torch.Tensor:
    """eq. 30 (ELU + 1), ReLU or the identity, then optionally eq. 29 (divide by the sum of the components; 0 stays
    0)."""
    phi = {"elu": lambda: torch.where(x > 0, x + 1, torch.exp(x)), "relu": lambda: x.clamp_min(0),
           "identity": lambda: x}[kind]()
    if sum_normalization:
        total = phi.sum(-1, keepdim=True)
        phi = phi / torch.where(total > 0, total, torch.ones_like(total))
    return phi


# ---------------------------------------------------------------------------------------------------------------
# 1. delta rule with attention normalisation (Schlag et al. 2021, eqs. 20-28)
# ---------------------------------------------------------------------------------------------------------------


def attention_normalized_delta_reference(layer, x, kind, sum_normalization, normalize_retrieval=True):
    """The layer's output by eqs. 4, 21, 26, 27, 24, 28, one token at a time, in float64, from its weights
    (``W_0 = 0``, ``z_0 = 0``); with ``normalize_retrieval=False`` eq. 20 replaces eq. 27.

    ``x [B, T, D]``. Returns ``(output [B, T, D], W [B, H, d, F], z [B, H, F])``.
    """
    H, d = layer.num_heads, layer.head_dim
    B, T, _ = x.shape
    x = x.double()
    W_q, W_k, W_v = (proj.weight.double().view(H, d, -1) for proj in (layer.q_proj, layer.k_proj, layer.v_proj))
    W_beta, b_beta = layer.beta_proj.weight.double(), layer.beta_proj.bias.double()
    outputs, W, z = [], None, None
    for t in range(T):
        x_t = x[:, t]
        # eq. 4 per head, then phi; eq. 21
        k = phi_reference(torch.einsum("hdi,bi->bhd", W_k, x_t), kind, sum_normalization)
        q = phi_reference(torch.einsum("hdi,bi->bhd", W_q, x_t), kind, sum_normalization)
        v = torch.einsum("hdi,bi->bhd", W_v, x_t)
        beta = torch.sigmoid(x_t @ W_beta.T + b_beta)  # [B, H]
        if W is None:
            W, z = x.new_zeros(B, H, d, k.shape[-1]), x.new_zeros(B, H, k.shape[-1])
        # eq. 27: v_bar = W_{t-1} phi(k_t) / (z_{t-1} . phi(k_t)); v_bar_1 = 0 (z_0 = 0)
        s = (z * k).sum(-1, keepdim=True)
        retrieved = torch.einsum("bhvf,bhf->bhv", W, k)
        assert (retrieved[(s == 0).expand_as(retrieved)] == 0).all()
        v_bar = torch.where(s != 0, retrieved / torch.where(s != 0, s, 1), torch.zeros_like(retrieved))
        if not normalize_retrieval:
            v_bar = retrieved  # eq. 20
        W = W + beta[..., None, None] * torch.einsum("bhv,bhf->bhvf", v - v_bar, k)  # eq. 24
        z = z + k  # eq. 26
        # eq. 28: y = W_t phi(q_t) / (z_t . phi(q_t)); where the denominator is 0 so is the numerator: y = 0
        numerator, denominator = torch.einsum("bhvf,bhf->bhv", W, q), (z * q).sum(-1, keepdim=True)
        assert (numerator[(denominator == 0).expand_as(numerator)] == 0).all()
        outputs.append(numerator / torch.where(denominator != 0, denominator, 1))
    y = torch.stack(outputs, dim=1).flatten(2)  # [B, T, H * d]
    return y @ layer.o_proj.weight.double().T, W, z


def disjoint_keys_layer(layer):
    """ReLU keys with disjoint supports: input unit i < D/2 writes only the first half of every head's key features,
    i >= D/2 only the second half, so a key of the second kind meets z_{t-1} != 0 with z_{t-1} . phi(k_t) = 0."""
    H, d = layer.num_heads, layer.head_dim
    with torch.no_grad():
        W_k = layer.k_proj.weight.view(H, d, -1)
        D = W_k.shape[-1]
        W_k.abs_()
        W_k[:, : d // 2, D // 2 :] *= -1
        W_k[:, d // 2 :, : D // 2] *= -1
    return layer


CASES = {
    # (feature map, eq. 29 sum normalisation, inputs)
    "elu": ("elu", False, "random"),
    "elu_sumnorm": ("elu", True, "random"),
    "relu_zero_first_keys": ("relu", False, "zero_start"),
    "relu_disjoint_keys": ("relu", False, "disjoint"),
}


def case_layer_and_inputs(case, kernel_mode, dtype=torch.float64):
    kind, sum_normalization, inputs = CASES[case]
    config = tiny_config(DeltaNetConfig, hidden_size=16, num_attention_heads=2, feature_map=kind,
                         sum_normalization=sum_normalization, attention_normalization=True, kernel_mode=kernel_mode,
                         chunk_size=4)
    torch.manual_seed(0)
    layer = FastWeightLinearAttention(config).to(dtype).eval()
    generator = torch.Generator().manual_seed(1)
    T = 13
    if inputs == "disjoint":
        disjoint_keys_layer(layer)
        units = torch.randint(0, 8, (2, T), generator=generator)
        units[:, 4:] += 8 * torch.randint(0, 2, (2, T - 4), generator=generator)  # 4 tokens of the first kind first
        x = torch.nn.functional.one_hot(units, 16).to(dtype)
    else:
        x = torch.randn(2, T, 16, generator=generator, dtype=dtype)
        if inputs == "zero_start":
            x[:, :3] = 0  # phi(k) = 0 for three tokens: z stays 0 and the fourth token has v_bar = 0 again
    return layer, x, kind, sum_normalization


@pytest.mark.parametrize("kernel_mode", ["recurrent", "chunk"])
@pytest.mark.parametrize("case", list(CASES))
def test_attention_normalized_delta_rule_follows_eqs_26_28(case, kernel_mode):
    layer, x, kind, sum_normalization = case_layer_and_inputs(case, kernel_mode)
    expected, W, z = attention_normalized_delta_reference(layer, x, kind, sum_normalization)
    with torch.no_grad():
        full, state = layer(x)
        torch.testing.assert_close(full, expected, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(state["fast_weight"], W, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(state["normalizer"][:, :, 0], z, rtol=1e-10, atol=1e-12)
        # prefill 6 tokens, then one token, then the rest from the cache
        outputs, state = [], None
        for part in (slice(0, 6), slice(6, 7), slice(7, None)):
            out, state = layer(x[:, part], state=state)
            outputs.append(out)
        torch.testing.assert_close(torch.cat(outputs, 1), expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("case", ["elu", "elu_sumnorm"])
def test_retrieval_normalisation_of_eq_27_changes_the_output(case):
    """The test data tell eq. 27 from eq. 20: the layer is far from the delta rule normalised by eq. 28 alone."""
    layer, x, kind, sum_normalization = case_layer_and_inputs(case, "chunk")
    output_only, _, _ = attention_normalized_delta_reference(layer, x, kind, sum_normalization, False)
    with torch.no_grad():
        out, _ = layer(x)
    assert relative_error(out, output_only) > 0.05


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", ["elu_sumnorm", "relu_zero_first_keys", "relu_disjoint_keys"])
def test_attention_normalized_delta_rule_low_precision(case, dtype):
    """float32 / bfloat16 / float16 layers: finite, float32 states, within their precision of the float64 equations
    (1 / s_t and s_t v_t go to the kernel in float32, outside float16's range or not)."""
    layer, x, kind, sum_normalization = case_layer_and_inputs(case, "chunk", dtype)
    expected, W, _ = attention_normalized_delta_reference(layer, x, kind, sum_normalization)
    # measured norm-wise relative errors (every case here): float32 <= 1.5e-7, bfloat16 <= 4.8e-3, float16 <= 5.1e-4
    tolerance = {torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    with torch.no_grad():
        prefill, state = layer(x[:, :6])
        rest, state = layer(x[:, 6:], state=state)
    out = torch.cat([prefill, rest], 1)
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert all(t.dtype == torch.float32 and torch.isfinite(t).all() for t in state.values())
    assert relative_error(out, expected) < tolerance
    assert relative_error(state["fast_weight"], W) < tolerance


# ---------------------------------------------------------------------------------------------------------------
# 2. FAVOR+ (Schlag et al. 2021, sec. 5.3, eqs. 31-32)
# ---------------------------------------------------------------------------------------------------------------


def favor_reference(x: torch.Tensor, R: torch.Tensor) -> torch.Tensor:
    """eq. 31: h(x) = exp(-|x|^2 / 2) / sqrt(2); eq. 32: phi(x) = h(x) / sqrt(m) [exp(R x); exp(-R x)].

    ``x [B, H, T, d]``, ``R [H, m, d]`` -> ``[B, H, T, 2 m]``, in float64."""
    x, R = x.double(), R.double()
    h = torch.exp(-x.pow(2).sum(-1, keepdim=True) / 2) / math.sqrt(2)
    Rx = torch.einsum("hmd,bhtd->bhtm", R, x)
    return h / math.sqrt(R.shape[1]) * torch.cat([torch.exp(Rx), torch.exp(-Rx)], dim=-1)


@pytest.mark.parametrize("sum_normalization", [False, True])
@pytest.mark.parametrize("dtype,rtol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_favor_feature_map_is_eqs_31_32(dtype, rtol, sum_normalization):
    from modeling_fwp.feature_maps import FeatureMap, favor_feature_map

    config = tiny_config(DeltaNetConfig, hidden_size=24, num_attention_heads=3, feature_map="favor", favor_features=5,
                         sum_normalization=sum_normalization)
    fmap = FeatureMap(config).to(dtype)
    x = torch.randn(2, 3, 7, 8, generator=torch.Generator().manual_seed(0), dtype=dtype)
    x[1] *= 8  # |x|^2 ~ 500: h(x) = exp(-250) / sqrt(2) is 0 in float32, the sum-normalised features are not
    phi = fmap(x)
    assert phi.shape == (2, 3, 7, 10) and config.feature_dim == 10  # d_dot = 2 m
    expected = favor_reference(x, fmap.projection)
    if sum_normalization:
        expected = phi_reference(expected, "identity", True)  # eq. 29 (float64: h(x) does not underflow here)
        # (atol: float32 softmax entries below its smallest normal number are denormals of lower precision)
        torch.testing.assert_close(phi.double(), expected, rtol=rtol, atol=torch.finfo(dtype).tiny)
    else:  # the float32 map underflows with h(x) for the large inputs, as eq. 32 computed literally must
        rows = slice(None) if dtype == torch.float64 else slice(0, 1)
        torch.testing.assert_close(phi[rows].double(), expected[rows], rtol=rtol, atol=0)
    torch.testing.assert_close(favor_feature_map(x, fmap.projection, sum_normalization), phi, rtol=0, atol=0)


def test_favor_linear_transformer_in_float32_where_the_literal_features_underflow():
    """Sum rule with attention normalisation (eqs. 17-19) and FAVOR+ (eqs. 31-32), |q|^2, |k|^2 ~ 80: the float32
    layer equals the float64 equations although z_t . phi(q_t) computed literally in float32 underflows (the layer
    takes h(q) / sqrt(m), which eq. 19 cancels, out of the query's exponents)."""
    from modeling_fwp import LinearTransformerConfig

    config = tiny_config(LinearTransformerConfig, hidden_size=16, num_attention_heads=2, feature_map="favor",
                         favor_features=8, chunk_size=4)
    torch.manual_seed(0)
    layer = FastWeightLinearAttention(config).eval()
    with torch.no_grad():
        layer.q_proj.weight *= 5
        layer.k_proj.weight *= 5
    x = torch.randn(2, 9, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out, _ = layer(x)
    H, d = layer.num_heads, layer.head_dim
    q, k, v = (torch.einsum("hdi,bti->bhtd", w, x.double()) for w in (
        proj.weight.double().view(H, d, -1) for proj in (layer.q_proj, layer.k_proj, layer.v_proj)))
    phi_q, phi_k = favor_reference(q, layer.feature_map.projection), favor_reference(k, layer.feature_map.projection)
    scores = torch.einsum("bhtf,bhsf->bhts", phi_q, phi_k).tril()  # phi(q_t) . phi(k_s), s <= t
    y = torch.einsum("bhts,bhsv->bhtv", scores, v) / scores.sum(-1, keepdim=True)  # eqs. 17-19
    expected = y.transpose(1, 2).flatten(2) @ layer.o_proj.weight.double().T
    assert (scores.float() == 0).any()  # the literal float32 products underflow
    assert relative_error(out, expected) < 1e-5


def test_favor_features_estimate_the_softmax_kernel():
    """Rows of R from N(0, I) (as FeatureMap draws them) make phi(x) . phi(y) an unbiased estimate of exp(x . y)
    (Schlag et al. 2021 eq. 12's kernel), and phi(x) . phi(-x) = exp(-|x|^2) exactly for any R."""
    from modeling_fwp.feature_maps import FeatureMap

    m, d = 20000, 4
    config = tiny_config(DeltaNetConfig, hidden_size=4, num_attention_heads=1, feature_map="favor", favor_features=m,
                         sum_normalization=False)
    fmap = FeatureMap(config).double()
    x = torch.randn(1, 1, 6, d, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 0.3
    torch.manual_seed(0)
    estimate = 0
    for _ in range(4):  # four draws of R, as four training batches
        fmap.redraw()
        phi = fmap(x)[0, 0]
        estimate = estimate + phi @ phi.T / 4
        exact = torch.exp(-x[0, 0].pow(2).sum(-1))
        torch.testing.assert_close((phi * fmap(-x)[0, 0]).sum(-1), exact, rtol=1e-12, atol=0)
    # measured over 20 seeds: max relative error 2.4e-2; inputs scaled by d^-1/4 (as Performer's code does) would
    # estimate exp(x . y / 2) instead, up to 37 % off here
    torch.testing.assert_close(estimate, torch.exp(x[0, 0] @ x[0, 0].T), rtol=4e-2, atol=0)


# ---------------------------------------------------------------------------------------------------------------
# 3. Delta MLP (Irie et al. 2021, sec. 3.1, eqs. 8-10, 13-14)
# ---------------------------------------------------------------------------------------------------------------


def layer_norm_reference(x: torch.Tensor, norm: torch.nn.LayerNorm) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) * gamma + delta over the last dimension, float64."""
    centred = x - x.mean(-1, keepdim=True)
    return centred / torch.sqrt(centred.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight.double() + \
        norm.bias.double()


def delta_mlp_reference(layer, x, activation):
    """The Delta MLP layer's output, one token at a time in float64, from its weights.

    Slow net (eqs. 5, 9): q and, per fast matrix, k, v, beta = sigmoid(.) from x_t; every fast matrix by the delta
    rule (eqs. 8, 10) with keys phi(k) (ELU+1 and sum normalisation, eqs. 29-30 of Schlag et al.); fast net (eqs.
    13-14) as Transformer feed-forward blocks, h^l = h^{l-1} + V^l_t f(U^l_t f(LN^l(h^{l-1}))), y_t = h^K, with
    f = softmax (sec. 3.1) or ELU+1 and sum normalisation (the official code).
    """
    H, d, K = layer.num_heads, layer.head_dim, layer.depth
    B, T, _ = x.shape
    x = x.double()
    f = (lambda u: torch.softmax(u, -1)) if activation == "softmax" else (lambda u: phi_reference(u, "elu", True))
    vectors = (x @ layer.slow.proj.weight.double().T).view(B, T, H, -1).split(list(layer.slow.sizes.values()), -1)
    p = dict(zip(layer.slow.sizes, vectors))  # name -> [B, T, H, size]
    betas = torch.sigmoid(x @ layer.slow.beta_proj.weight.double().T + layer.slow.beta_proj.bias.double())
    betas = betas.view(B, T, H, 2 * K)
    fast = {}  # (l, part) -> [B, H, out, in], from W_0 = 0
    outputs = []
    for t in range(T):
        h = p["q"][:, t]  # h^0 = q_t
        for l in range(K):
            u = layer_norm_reference(h, layer.norms[l])
            for j, part in enumerate(("up", "down")):
                k = phi_reference(p[f"k{l}_{part}"][:, t], "elu", True)
                v = p[f"v{l}_{part}"][:, t]
                W = fast.get((l, part), x.new_zeros(B, H, v.shape[-1], k.shape[-1]))
                v_bar = torch.einsum("bhvk,bhk->bhv", W, k)  # eq. 10
                W = W + betas[:, t, :, 2 * l + j, None, None] * torch.einsum("bhv,bhk->bhvk", v - v_bar, k)  # eq. 8
                fast[(l, part)] = W
                u = torch.einsum("bhvk,bhk->bhv", W, f(u))  # eq. 13
            h = h + u
        outputs.append(h.flatten(1))  # eq. 14: y_t = h^K
    return torch.stack(outputs, 1) @ layer.o_proj.weight.double().T


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("activation", ["softmax", "feature_map"])
def test_delta_mlp_follows_eqs_13_14(activation, depth):
    from modeling_fwp import DeltaMLPConfig
    from modeling_fwp.rfwp_layers import DeltaMLPLayer

    config = tiny_config(DeltaMLPConfig, hidden_size=16, num_attention_heads=2, fast_net_depth=depth,
                         fast_net_activation=activation, chunk_size=4)
    torch.manual_seed(0)
    layer = DeltaMLPLayer(config).double().eval()
    with torch.no_grad():
        layer.slow.proj.weight.mul_(4)  # keys far from uniform, so that the fast weights' columns differ
        for norm in layer.norms:  # not the identity LayerNorm of the initialisation
            norm.weight.uniform_(0.5, 1.5)
            norm.bias.uniform_(-0.5, 0.5)
    x = torch.randn(2, 11, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    with torch.no_grad():
        expected = delta_mlp_reference(layer, x, activation)
        full, _ = layer(x)
        prefill, state = layer(x[:, :5])
        rest, _ = layer(x[:, 5:], state=state)
        # the two activations are different models: the test data tell their fast nets' outputs apart
        other = delta_mlp_reference(layer, x, "feature_map" if activation == "softmax" else "softmax")
        residual = layer.o_proj(layer.slow(x)["q"].transpose(1, 2).flatten(2))  # h^0 = q_t alone
    torch.testing.assert_close(full, expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(torch.cat([prefill, rest], 1), expected, rtol=1e-10, atol=1e-12)
    assert relative_error(full - residual, other - residual) > 1e-2  # measured 2.9e-2 .. 3.6e-2, tolerance 1e-10


def test_delta_mlp_config_validates_the_activation():
    from modeling_fwp import DeltaMLPConfig

    assert DeltaMLPConfig().fast_net_activation == "softmax"  # the paper's f (sec. 3.1)
    with pytest.raises(ValueError, match="fast_net_activation"):
        tiny_config(DeltaMLPConfig, fast_net_activation="tanh")
    with pytest.raises(ValueError, match="feature_map"):  # softmax queries of size head_dim, DPFP keys of 2 d nu
        tiny_config(DeltaMLPConfig, feature_map="dpfp", dpfp_nu=2)
    config = tiny_config(DeltaMLPConfig, feature_map="dpfp", dpfp_nu=2, fast_net_activation="feature_map")
    assert config.feature_dim == 32
