"""fwp_kernels.dense: the vocabulary-sized products of the Fast Weight Layers against plain autograd."""
import pytest
import torch
import torch.nn.functional as F

from fwp_kernels import dense, dense_linear, linear_cross_entropy_input_gradient


def ce_input_gradient_by_autograd(x, weight, bias, target, scale):
    """Row n of d/dx sum_n scale_n CE(x_n W^T + b, target_n): each row's loss only depends on its own input."""
    x = x.detach().requires_grad_(True)
    losses = F.cross_entropy(F.linear(x, weight, bias), target, reduction="none")
    (grad,) = torch.autograd.grad((losses * scale).sum(), x)
    return grad


def random_layer(dtype, N=23, K=12, V=37, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(N, K, generator=gen, dtype=dtype)
    weight = torch.randn(V, K, generator=gen, dtype=dtype)
    bias = torch.randn(V, generator=gen, dtype=dtype)
    target = torch.randint(0, V, (N,), generator=gen)
    scale = (torch.rand(N, generator=gen) > 0.3).to(dtype)  # some rows do not count
    return x, weight, bias, target, scale


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("block_bytes", [37 * 5 * 8, dense.BLOCK_BYTES])  # several row blocks (5 or 10 rows) / one
@pytest.mark.parametrize("with_bias,with_scale", [(True, True), (False, False)])
def test_ce_input_gradient_outside_autograd_matches_autograd(monkeypatch, dtype, tol, block_bytes, with_bias,
                                                             with_scale):
    monkeypatch.setattr(dense, "BLOCK_BYTES", block_bytes)
    x, weight, bias, target, scale = random_layer(dtype)
    bias = bias if with_bias else None
    scale = scale if with_scale else None
    expected = ce_input_gradient_by_autograd(x, weight, bias, target,
                                             scale if scale is not None else torch.ones_like(x[:, 0]))
    with torch.no_grad():
        got = linear_cross_entropy_input_gradient(x, weight, bias, target, scale)
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol)
    if scale is not None:
        assert torch.equal(got[scale == 0], torch.zeros_like(got[scale == 0]))  # rows that do not count: exactly 0


def test_ce_input_gradient_is_differentiable_to_second_order():
    """With autograd the gradient is a differentiable function of x, W and b: its own gradients match double
    backward through F.cross_entropy (the FWL trains through its per-token gradients)."""
    x, weight, bias, target, scale = random_layer(torch.float64)
    probe = torch.randn_like(x)
    leaves = [t.clone().requires_grad_(True) for t in (x, weight, bias)]
    got = torch.autograd.grad((linear_cross_entropy_input_gradient(*leaves, target, scale) * probe).sum(), leaves)
    leaves2 = [t.clone().requires_grad_(True) for t in (x, weight, bias)]
    losses = F.cross_entropy(F.linear(*leaves2), target, reduction="none")
    (dx,) = torch.autograd.grad((losses * scale).sum(), leaves2[0], create_graph=True)
    expected = torch.autograd.grad((dx * probe).sum(), leaves2)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_ce_input_gradient_clamps_targets_of_rows_that_do_not_count():
    x, weight, bias, target, scale = random_layer(torch.float32)
    target = torch.where(scale == 0, torch.full_like(target, -100), target)  # ignore_index-style ids
    with torch.no_grad():
        got = linear_cross_entropy_input_gradient(x, weight, bias, target, scale)
    assert torch.isfinite(got).all() and torch.equal(got[scale == 0], torch.zeros_like(got[scale == 0]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_dense_linear_matches_f_linear(dtype):
    x, weight, bias, _, _ = random_layer(dtype, N=64, K=40, V=300)
    x = x.view(4, 16, 40)
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    with torch.no_grad():
        for b in (bias, None):
            torch.testing.assert_close(dense_linear(x, weight, b), F.linear(x, weight, b), rtol=tol, atol=tol)
        # a transposed view as the weight: P @ E
        probs = torch.softmax(F.linear(x, weight), -1)
        torch.testing.assert_close(dense_linear(probs, weight.t()), probs @ weight, rtol=tol, atol=tol)


def test_dense_linear_uses_onednn_only_outside_autograd():
    if not dense.onednn_linear_available():
        pytest.skip("PyTorch has no oneDNN here")
    x, weight, bias, _, _ = random_layer(torch.float32)
    assert dense._cpu_inference(x, weight, bias)
    leaf = weight.clone().requires_grad_(True)
    assert not dense._cpu_inference(x, leaf, bias)  # tracked: F.linear, which has a backward
    out = dense_linear(x, leaf, bias)
    out.sum().backward()
    torch.testing.assert_close(leaf.grad, x.sum(0).expand_as(leaf).contiguous(), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        assert dense._cpu_inference(x, leaf, bias)
    assert not dense._cpu_inference(x.double(), weight.double(), None)  # float64: F.linear (the exact references)


def test_onednn_linear_op_is_defined_once_and_eager_calls_onednn_directly(monkeypatch):
    """``fwp_kernels::onednn_linear`` (for traced graphs) is one op however often dense.py is imported (as
    ``fwp_kernels.dense`` and under a second name: from this repository's root, ``kernels.dense`` where the Hub's
    ``kernels`` library is not installed), and eager products of more rows than stream call oneDNN's op directly."""
    import importlib.util

    if not dense.onednn_linear_available():
        pytest.skip("PyTorch has no oneDNN here")
    spec = importlib.util.spec_from_file_location("fwp_kernels._second_dense", dense.__file__)
    copy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(copy)  # dense.py executed a second time, under another name
    assert copy is not dense and copy.onednn_linear is dense.onednn_linear
    calls = []
    monkeypatch.setattr(dense, "onednn_linear", lambda *args: calls.append(1) or copy.onednn_linear(*args))
    x, weight, bias, _, _ = random_layer(torch.float32)
    with torch.no_grad():
        assert x.shape[0] > dense.STREAMING_MAX_ROWS
        out = dense_linear(x, weight, bias)
        traced = dense.onednn_linear(x, weight, bias)
    assert calls == [1]  # only the explicit call
    torch.testing.assert_close(out, traced, rtol=0, atol=0)
    torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


def _streaming_kernel():
    if not dense._CPU_KERNEL.available():
        pytest.skip(f"the C++ decode_linear kernel is {dense._CPU_KERNEL.describe()}")
    return dense._CPU_KERNEL.ops.linear_rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [2, 3])
def test_streaming_linear_threads_write_every_row_once(dtype, threads):
    """csrc/decode_linear.cpp's parallel_rows: each thread streams its share of the rows in grabs of 256 KB, then
    takes grabs from the shares not yet done; with several grabs per share (uneven ones at 3 threads) every row of
    out is written, with the one-thread sums bit for bit, for linear_rows and the grouped pass over stacked weights."""
    _streaming_kernel()
    ops = dense._CPU_KERNEL.ops
    g = torch.Generator().manual_seed(threads)
    K = 64  # 256 KB of weights per grab: 1024 float32 rows, 2048 bfloat16 rows
    weights = [torch.randn(n, K, generator=g).to(dtype) for n in (4099, 2050, 6151)]
    x = torch.randn(2, K, generator=g).to(dtype)
    before = torch.get_num_threads()
    results = {}
    try:
        for t in (1, threads):
            torch.set_num_threads(t)
            out = torch.full((2, weights[0].shape[0]), float("nan"), dtype=dtype)
            ops.linear_rows(x, weights[0], None, out)
            grouped = torch.full((2, sum(w.shape[0] for w in weights)), float("nan"), dtype=dtype)
            ops.linear_rows_grouped(x, weights, grouped)
            results[t] = (out, grouped)
    finally:
        torch.set_num_threads(before)
    for one, many in zip(results[1], results[threads]):
        assert not many.isnan().any()
        assert torch.equal(one, many)
    torch.testing.assert_close(results[1][1][:, :4099], results[1][0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# N and K no multiples of 4 / 16; K = 59: the AVX2 bfloat16 loop's 32-, 16- and one-entry steps, two rows of x
@pytest.mark.parametrize("rows,N,K", [(1, 37, 40), (1, 300, 129), (3, 43, 7), (2, 19, 59)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_streaming_linear_matches_float64(dtype, rows, N, K, with_bias):
    """csrc/decode_linear.cpp: x W^T + b with float32 accumulation, against float64, for the four-row blocks and the
    tail rows, several rows of x (each in the dot products' order: dot_operand), with and without bias; bfloat16
    output rounded once (within one bf16 step)."""
    linear_rows = _streaming_kernel()
    x, weight, bias, _, _ = random_layer(dtype, N=rows, K=K, V=N, seed=rows + N)
    bias = bias if with_bias else None
    out = torch.full((rows, N), float("nan"), dtype=dtype)
    linear_rows(x, weight, bias, out)
    expected = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    else:  # the exact sum rounded to bf16 vs ours: at most one bf16 step (8 bits of mantissa) apart, plus fp32 sums
        step = expected.abs().clamp_min(1e-3) * 2.0 ** -7
        assert ((out.double() - expected).abs() <= step + 1e-4).all()


def test_streaming_linear_refuses_bad_shapes_and_dtypes():
    linear_rows = _streaming_kernel()
    x, weight = torch.randn(1, 8), torch.randn(5, 8)
    with pytest.raises(RuntimeError, match="weight"):
        linear_rows(torch.randn(1, 7), weight, None, torch.empty(1, 5))
    with pytest.raises(RuntimeError, match="one dtype"):
        linear_rows(x, weight.double(), None, torch.empty(1, 5))
    with pytest.raises(RuntimeError, match="out"):
        linear_rows(x, weight, None, torch.empty(2, 5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_linear_streams_up_to_two_rows_and_leaves_other_cases_to_matmuls(monkeypatch, dtype):
    """One or two rows outside autograd (a decode step of one or two sequences: STREAMING_MAX_ROWS = 2): the streaming
    kernel's result, bit for bit; three rows, a tracked weight, autocast: not the kernel (checked by making it fail)."""
    linear_rows = _streaming_kernel()
    assert dense.STREAMING_MAX_ROWS == 2
    x, weight, bias, _, _ = random_layer(dtype, N=3, K=64, V=50)
    one = x[:1].view(1, 1, 64)  # [B, T, K] of a decode step
    for rows in (1, 2):
        expected = torch.empty(rows, 50, dtype=dtype)
        linear_rows(x[:rows].contiguous(), weight, bias, expected)
        with torch.no_grad():
            assert torch.equal(dense_linear(x[:rows].view(rows, 1, 64), weight, bias), expected.view(rows, 1, 50))
    monkeypatch.setattr(dense._CPU_KERNEL, "available", lambda: pytest.fail("the streaming kernel was asked"))
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    with torch.no_grad():
        torch.testing.assert_close(dense_linear(x, weight, bias), F.linear(x, weight, bias), rtol=tol, atol=tol)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert dense_linear(one.float(), weight.float(), bias.float()).dtype == torch.bfloat16  # autocast's cast
    leaf = weight.clone().requires_grad_(True)
    dense_linear(one, leaf, bias).sum().backward()
    assert leaf.grad is not None


@pytest.mark.parametrize("transposed", [False, True])
def test_bfloat16_matmul_widens_where_the_cpu_has_no_bfloat16_matmul(monkeypatch, transposed):
    """Without oneDNN's bfloat16 matmul (AVX2-only CPUs; forced here), three or more bfloat16 rows outside autograd are
    the float32 product of the widened inputs rounded once (F.linear's bfloat16 kernels ran 6-8x slower there):
    bit for bit that, and within one bfloat16 step of the float64 product; the weight may be a transposed view."""
    monkeypatch.setattr(dense, "_ONEDNN_BF16", False)
    f_linear = F.linear

    def float_only_linear(x, weight, bias=None):
        assert x.dtype != torch.bfloat16, "F.linear's bfloat16 kernels ran"
        return f_linear(x, weight, bias)

    monkeypatch.setattr(F, "linear", float_only_linear)
    x, weight, bias, _, _ = random_layer(torch.bfloat16, N=24, K=40, V=70, seed=5)
    if transposed:  # P @ E with E [V, K] as weight.t(): x must be [*, V]
        weight, x, bias = weight.t(), torch.randn(24, 70).to(torch.bfloat16), None
    with torch.no_grad():
        got = dense_linear(x.view(2, 12, -1), weight, bias)
        widened = dense_linear(x.float(), weight.float(), None if bias is None else bias.float())
    assert got.dtype == torch.bfloat16 and torch.equal(got.view(24, -1), widened.to(torch.bfloat16))
    expected = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    step = expected.abs().clamp_min(1e-3) * 2.0 ** -7
    assert ((got.view(24, -1).double() - expected).abs() <= step + 1e-4).all()


def conv_step_by_definition(x, cache, weight):
    """y[b, c] = sum_i w[c, i] [cache[b, c, :], x[b, c]]_i in float64; the new cache drops the oldest input."""
    window = torch.cat([cache, x[..., None]], dim=-1).double()
    return (window * weight.double()).sum(-1), window[..., 1:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("B,C,K", [(1, 37, 4), (3, 5, 2), (2, 16, 3)])
def test_short_conv_step_matches_its_definition(dtype, B, C, K):
    """csrc/decode_linear.cpp's short_conv_step: float32 sums (float64 for float64) against float64, the result
    rounded once; the new cache is the window's last K - 1 inputs exactly; the inputs are not written."""
    if not dense.cpu_ops_apply(torch.zeros(1)):
        pytest.skip(f"the C++ decode_linear kernel is {dense._CPU_KERNEL.describe()}")
    gen = torch.Generator().manual_seed(B * C * K)
    x, cache, weight = (torch.randn(*shape, generator=gen).to(dtype) for shape in ((B, C), (B, C, K - 1), (C, K)))
    before = (x.clone(), cache.clone())
    y, new_cache = dense.short_conv_step(x, cache, weight)
    expected, expected_cache = conv_step_by_definition(x, cache, weight)
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(y.double(), expected, rtol=tol, atol=tol)
    assert y.dtype == dtype and torch.equal(new_cache.double(), expected_cache)
    assert torch.equal(x, before[0]) and torch.equal(cache, before[1])


def conv_by_definition(x, cache, weight):
    """The step definition position by position: y[b, t, c] from the K - 1 inputs before t (the cache first), float64;
    and the cache after the last position."""
    ys = []
    for t in range(x.shape[1]):
        y, cache = conv_step_by_definition(x[:, t], cache, weight)
        ys.append(y)
    return torch.stack(ys, 1) if ys else x.double(), cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("B,T,C,K", [(1, 50, 37, 4), (3, 2, 5, 4), (2, 7, 16, 3), (2, 1, 8, 2), (1, 0, 6, 4),
                                     (2, 300, 130, 5)])
def test_short_conv_matches_step_by_step(dtype, B, T, C, K):
    """short_conv over T positions (channels last, parallel over positions) is the step definition at every position
    (T shorter than the window included: the cache is read), float32 sums rounded once; its new cache is exactly the
    last K - 1 inputs of [cache, x]; the inputs are not written."""
    if not dense.cpu_ops_apply(torch.zeros(1)):
        pytest.skip(f"the C++ decode_linear kernel is {dense._CPU_KERNEL.describe()}")
    gen = torch.Generator().manual_seed(B * T * C * K)
    x, cache, weight = (torch.randn(*shape, generator=gen).to(dtype) for shape in ((B, T, C), (B, C, K - 1), (C, K)))
    before = (x.clone(), cache.clone())
    y, new_cache = dense.short_conv(x, cache, weight)
    expected, expected_cache = conv_by_definition(x, cache, weight)
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 1e-2}[dtype]
    assert y.shape == x.shape and y.dtype == dtype
    torch.testing.assert_close(y.double(), expected, rtol=tol, atol=tol)
    assert torch.equal(new_cache.double(), expected_cache)
    assert torch.equal(x, before[0]) and torch.equal(cache, before[1])
    if T > 0:  # each output as the decode step's (same sums, same order)
        step = dense.short_conv_step(x[:, -1].contiguous(), dense.short_conv(x[:, :-1], cache, weight)[1], weight)
        assert torch.equal(step[0], y[:, -1]) and torch.equal(step[1], new_cache)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("mean_square", [True, False])
def test_normalize_rows_matches_its_definition(dtype, mean_square):
    """normalize_rows: RMSNorm (times a gain) or L2 normalisation of each row over the last dimension, computed in
    float32 for every dtype (as modeling_fwp's ``x.float()``), against float64 from the float32-rounded inputs."""
    if not dense.cpu_ops_apply(torch.zeros(1)):
        pytest.skip(f"the C++ decode_linear kernel is {dense._CPU_KERNEL.describe()}")
    gen = torch.Generator().manual_seed(int(mean_square))
    x = (torch.randn(2, 3, 5, 33, generator=gen) * 3).to(dtype)
    weight = torch.randn(33, generator=gen).to(dtype) if mean_square else None
    got = dense.normalize_rows(x, weight, 1e-6, mean_square)
    xf = x.float().double()
    squares = xf.pow(2).mean(-1, keepdim=True) if mean_square else xf.pow(2).sum(-1, keepdim=True)
    expected = xf / torch.sqrt(squares + 1e-6) * (1 if weight is None else weight.float().double())
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got.double(), expected, rtol=tol, atol=tol)


def test_cpu_ops_apply_only_to_cpu_inference_in_one_supported_dtype():
    """The decode-step ops run outside autograd, autocast and tracing, on CPU tensors of one dtype (float32, bfloat16,
    float64); everything else keeps torch's differentiable code."""
    if not dense._CPU_KERNEL.available():
        pytest.skip(f"the C++ decode_linear kernel is {dense._CPU_KERNEL.describe()}")
    x, w = torch.randn(2, 4), torch.randn(4)
    assert dense.cpu_ops_apply(x, w) and dense.cpu_ops_apply(x.double(), None)
    assert not dense.cpu_ops_apply(x, w.double())  # mixed dtypes
    assert not dense.cpu_ops_apply(x.half(), w.half())
    assert not dense.cpu_ops_apply(x, w.requires_grad_())
    with torch.no_grad():
        assert dense.cpu_ops_apply(x, w)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert not dense.cpu_ops_apply(x, w)


def test_layers_take_the_decode_ops_outside_autograd_only(monkeypatch):
    """CausalConv1d's decode step, RMSNorm and l2_normalize: under no_grad the C++ ops (counted), with autograd
    torch's code; the same values within float32 rounding, gradients still flow."""
    from modeling_fwp import fast_weight_layers
    from modeling_fwp.fast_weight_layers import CausalConv1d, RMSNorm, l2_normalize

    if not dense._CPU_KERNEL.available():
        pytest.skip(f"the C++ decode_linear kernel is {dense._CPU_KERNEL.describe()}")
    calls = []
    for name in ("short_conv_step", "short_conv", "normalize_rows"):
        op = getattr(fast_weight_layers, name)
        counted = lambda *args, _op=op, _name=name, **kwargs: calls.append(_name) or _op(*args, **kwargs)  # noqa: E731
        monkeypatch.setattr(fast_weight_layers, name, counted)
    torch.manual_seed(0)
    conv, norm = CausalConv1d(24, 4), RMSNorm(24)
    torch.nn.init.normal_(norm.weight)
    x, cache = torch.randn(2, 1, 24, requires_grad=True), torch.randn(2, 24, 3)
    tracked = (conv(x, cache), norm(x), l2_normalize(x))
    (tracked[0][0].sum() + tracked[1].sum() + tracked[2].sum()).backward()
    assert x.grad is not None and conv.weight.grad is not None and norm.weight.grad is not None and not calls
    with torch.no_grad():
        untracked = (conv(x, cache), norm(x), l2_normalize(x))
    assert calls == ["short_conv_step", "normalize_rows", "normalize_rows"]
    torch.testing.assert_close(untracked[0][0], tracked[0][0].detach(), rtol=1e-6, atol=1e-6)
    assert torch.equal(untracked[0][1], tracked[0][1])
    prefill = torch.randn(2, 9, 24, requires_grad=True)  # more positions: short_conv, against F.conv1d's path
    tracked_conv = conv(prefill, cache)
    with torch.no_grad():
        untracked_conv = conv(prefill, cache)
    assert calls[-1] == "short_conv"
    torch.testing.assert_close(untracked_conv[0], tracked_conv[0].detach(), rtol=1e-6, atol=1e-6)
    assert torch.equal(untracked_conv[1], tracked_conv[1])
    for got, want in zip(untracked[1:], tracked[1:]):
        torch.testing.assert_close(got, want.detach(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3])
def test_dense_linears_one_pass_equals_one_call_per_weight(dtype, rows):
    """dense_linears: up to STREAMING_MAX_ROWS rows of bfloat16, one grouped pass (``linear_rows_grouped``; float32
    takes it through the op directly) that gives each weight's dense_linear bit for bit (weights of 7, 50 and 1 rows:
    task ranges across their borders); three rows: one dense_linear per weight (the matmul)."""
    _streaming_kernel()
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 1, 64, generator=gen).to(dtype)
    weights = [torch.randn(n, 64, generator=gen).to(dtype) for n in (7, 50, 1)]
    calls = []
    op = dense._CPU_KERNEL.ops.linear_rows_grouped
    with torch.no_grad():
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(dense._CPU_KERNEL, "ops", type("Ops", (), {
                "linear_rows_grouped": staticmethod(lambda *args: calls.append(1) or op(*args)),
                "linear_rows": staticmethod(dense._CPU_KERNEL.ops.linear_rows)}))
            got = dense.dense_linears(x, weights)
        expected = [dense_linear(x, w) for w in weights]
        stacked = torch.empty(rows, 58, dtype=dtype)
        op(x.view(rows, 64), weights, stacked)
    assert len(calls) == (1 if dtype == torch.bfloat16 and rows <= dense.STREAMING_MAX_ROWS else 0)
    assert [g.shape for g in got] == [(rows, 1, 7), (rows, 1, 50), (rows, 1, 1)]
    assert all(torch.equal(g, e) for g, e in zip(got, expected))
    if rows <= dense.STREAMING_MAX_ROWS:  # the op itself, both dtypes, against one streaming call per weight
        assert torch.equal(stacked, torch.cat([e.view(rows, -1) for e in expected], dim=-1))


def test_grouped_streaming_refuses_bad_shapes_and_dtypes():
    _streaming_kernel()
    op = dense._CPU_KERNEL.ops.linear_rows_grouped
    x, weights = torch.randn(1, 8), [torch.randn(5, 8), torch.randn(3, 8)]
    with pytest.raises(RuntimeError, match="every weight"):
        op(x, [weights[0], torch.randn(3, 7)], torch.empty(1, 8))
    with pytest.raises(RuntimeError, match="one dtype"):
        op(x, [weights[0], weights[1].double()], torch.empty(1, 8))
    with pytest.raises(RuntimeError, match="out"):
        op(x, weights, torch.empty(1, 7))


def test_projections_share_one_pass_only_outside_autograd_and_untouched(monkeypatch):
    """modeling_fwp's ``project``: untracked bias-free Linears go through dense_linears (counted); a hook, a bias or
    autograd keep each module's own call, so hooks fire and gradients flow."""
    from modeling_fwp import fast_weight_layers
    from modeling_fwp.fast_weight_layers import Linear, project

    grouped = []
    real = fast_weight_layers.dense_linears
    monkeypatch.setattr(fast_weight_layers, "dense_linears", lambda x, ws: grouped.append(len(ws)) or real(x, ws))
    layers = [Linear(16, n, bias=False).to(torch.bfloat16) for n in (4, 6)]
    x = torch.randn(1, 1, 16, dtype=torch.bfloat16)
    with torch.no_grad():
        together, one_by_one = project(x, *layers), [layer(x) for layer in layers]
    assert grouped == [2] and all(torch.equal(a, b) for a, b in zip(together, one_by_one))
    hooked = []
    handle = layers[1].register_forward_hook(lambda *args: hooked.append(1))
    with torch.no_grad():
        project(x, *layers)
    handle.remove()
    assert hooked == [1] and grouped == [2]
    out = project(x, *layers)  # autograd
    sum(o.sum() for o in out).backward()
    assert grouped == [2] and all(layer.weight.grad is not None for layer in layers)
    with torch.no_grad():
        project(x, Linear(16, 3, bias=True).to(torch.bfloat16), layers[0])
    assert grouped == [2]


def _reuse_stats() -> dict:
    depth, installed, reused, kept = dense._CPU_KERNEL.ops.reuse_buffers_stats()
    return {"depth": depth, "installed": bool(installed), "reused": reused, "kept": kept}


def test_reusing_cpu_buffers_hands_a_freed_block_to_the_next_request_of_its_size():
    """Inside the scope a freed tensor of 1 MB or more is kept and comes back for the next request of its size (pages
    still mapped); small ones are not kept; nested scopes count; the last exit frees what it kept (the allocator stays
    installed, passing blocks through); a tensor made inside keeps its values after the scope and frees without harm."""
    if not dense._CPU_KERNEL.available():
        pytest.skip("the C++ kernel is not built here")
    hidden = torch.zeros(1, 256, 1024)  # 1 MB: the threshold
    before = _reuse_stats()
    assert before["depth"] == 0 and before["kept"] == 0
    with dense.reusing_cpu_buffers(hidden):
        assert _reuse_stats()["depth"] == 1 and _reuse_stats()["installed"]
        big = torch.empty(2**20)  # 4 MB
        address = big.data_ptr()
        del big
        assert _reuse_stats()["kept"] >= 4 * 2**20
        again = torch.empty(2**20)
        assert again.data_ptr() == address and _reuse_stats()["reused"] == before["reused"] + 1
        small = torch.empty(1000)
        del small
        kept = _reuse_stats()["kept"]
        assert kept == 0  # `again` holds the one big block; the small one went back to malloc
        outlives = torch.arange(2**19, dtype=torch.float32)  # 2 MB made inside
        with dense.reusing_cpu_buffers(hidden):
            assert _reuse_stats()["depth"] == 2
        assert _reuse_stats()["depth"] == 1 and _reuse_stats()["installed"]
        del again
        assert _reuse_stats()["kept"] > 0
    after = _reuse_stats()
    assert after["depth"] == 0 and after["installed"] and after["kept"] == 0
    assert torch.equal(outlives, torch.arange(2**19, dtype=torch.float32))
    del outlives
    fresh = torch.empty(2**20)  # the default allocator again: nothing is kept
    del fresh
    assert _reuse_stats()["kept"] == 0


def test_reusing_cpu_buffers_applies_only_to_large_cpu_inputs_and_ends_on_errors(monkeypatch):
    if not dense._CPU_KERNEL.available():
        pytest.skip("the C++ kernel is not built here")
    with dense.reusing_cpu_buffers(torch.zeros(10, 10)):  # below REUSE_BUFFERS_MIN_BYTES: nothing happens
        assert _reuse_stats()["depth"] == 0
    monkeypatch.setattr(dense, "_REUSE_BUFFERS", False)  # FWP_KERNELS_NO_BUFFER_REUSE=1
    with dense.reusing_cpu_buffers(torch.zeros(1, 256, 1024)):
        assert _reuse_stats()["depth"] == 0
    monkeypatch.setattr(dense, "_REUSE_BUFFERS", True)
    with pytest.raises(RuntimeError, match="boom"):
        with dense.reusing_cpu_buffers(torch.zeros(1, 256, 1024)):
            assert _reuse_stats()["depth"] == 1
            raise RuntimeError("boom")
    assert _reuse_stats()["depth"] == 0 and _reuse_stats()["kept"] == 0


def test_reusing_cpu_buffers_under_concurrent_forwards(monkeypatch):
    """Three threads' forwards, their scopes overlapping, each result the one of a lone forward. oneDNN (ideep) takes
    buffers with the CPU allocator's raw_allocate and frees them later with whatever allocator is current: while the
    scope installed and removed its allocator, one thread's exit paired the two (a double free: 1 of 10 runs of this
    test crashed, by hand); the allocator now stays once installed."""
    if not dense._CPU_KERNEL.available():
        pytest.skip("the C++ kernel is not built here")
    import threading

    from conftest import tiny_model
    from modeling_fwp import GatedDeltaNetConfig

    monkeypatch.setattr(dense, "REUSE_BUFFERS_MIN_BYTES", 2**16)
    model = tiny_model(GatedDeltaNetConfig, num_hidden_layers=3, hidden_size=128, intermediate_size=512,
                       short_conv_size=4)
    ids = [torch.randint(3, 61, (2, 300), generator=torch.Generator().manual_seed(i)) for i in range(4)]
    with torch.no_grad():
        expected = [model(x).logits for x in ids]  # 2 x 300 x 128 floats: 300 KB, above the lowered threshold
    mismatches = []

    def forwards(i):
        with torch.no_grad():
            for r in range(8):
                j = (i + r) % len(ids)
                if not torch.equal(model(ids[j]).logits, expected[j]):
                    mismatches.append((i, r))

    threads = [threading.Thread(target=forwards, args=(i,)) for i in range(3)]
    reused = _reuse_stats()["reused"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not mismatches and _reuse_stats()["reused"] > reused
    assert _reuse_stats()["depth"] == 0 and _reuse_stats()["kept"] == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_forward_reuses_buffers_with_the_same_logits_and_cache(monkeypatch, dtype):
    """A model's forward over many positions runs its layers inside ``reusing_cpu_buffers`` (blocks are reused from
    layer to layer) and returns exactly what it returns without it; a short decode step does not enter it."""
    if not dense._CPU_KERNEL.available():
        pytest.skip("the C++ kernel is not built here")
    from conftest import tiny_model
    from modeling_fwp import GatedDeltaNetConfig
    from modeling_fwp.cache_fwp import output_cache

    model = tiny_model(GatedDeltaNetConfig, num_hidden_layers=3, hidden_size=256, intermediate_size=1024,
                       short_conv_size=4).to(dtype)
    ids = torch.randint(3, 61, (2, 512))  # hidden states 2 x 512 x 256: 1 MB in float32, 0.5 in bfloat16
    monkeypatch.setattr(dense, "REUSE_BUFFERS_MIN_BYTES", 2**19)
    runs = {}
    for reuse in (True, False):
        monkeypatch.setattr(dense, "_REUSE_BUFFERS", reuse)
        reused = _reuse_stats()["reused"]
        with torch.no_grad():
            out = model(ids, use_cache=True)
            step = model(ids[:, :1], past_key_values=output_cache(out), use_cache=True)
        runs[reuse] = (out.logits, step.logits, output_cache(step).layers[0]._states)
        assert (_reuse_stats()["reused"] > reused) == reuse
        assert _reuse_stats()["depth"] == 0
    assert torch.equal(runs[True][0], runs[False][0]) and torch.equal(runs[True][1], runs[False][1])
    for key, state in runs[True][2].items():
        assert torch.equal(state, runs[False][2][key]), key
