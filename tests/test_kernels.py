"""fwp_kernels: every mode and dtype against the step-loop reference, forward and backward.

Error measure: norm-wise relative error ||x - x_ref|| / ||x_ref|| of outputs, final state and the
gradients of q, k, v, beta and initial_state, against the step loop run in float64 on the same
(rounded) inputs. Bounds, per input dtype (u = unit roundoff):

* float64: 1e-10. Same math, reassociated: float64 rounding (u = 1.1e-16) grown over at most ~1e3
  steps stays far below (observed <= 1e-15).
* float32: 2e-5. All modes compute in float32 (u = 6e-8); rounding grows over up to 1000 rank-one
  updates and through the chunk's triangular inverse (observed <= 6e-7 at T = 1000; x30 margin).
* float16: 4e-3. Kernel and reference see the same rounded inputs; the kernels compute in float32
  and round o and the gradients once to float16 (u = 4.9e-4), which bounds the norm-wise error by
  about u (observed 3e-4; x8 margin over u).
* bfloat16: 1e-2. Likewise with u = 3.9e-3; the gradients also see the bfloat16-rounded output gradient
  (the reference the float64 one), so up to ~2u. Measured <= 3.1e-3 on every CPU case here (dq at T = 1)
  and 3.3e-3 for the Triton forward under the interpreter (x3 margin); the gated delta rule: <= 3.2e-3 on every
  CPU case (C++ and PyTorch chunk paths and the step loop alike: dq at T = 1) and 3.3e-3 for its Triton forward,
  float16 <= 5.2e-4. The compiled Triton test on CUDA keeps the earlier 3e-2: on an H100 (tests/test_cuda.py) only
  T = 1 at head size 64 has been measured so far (bf16 <= 2.2e-3, fp32 <= 1.5e-7). Where the C++ kernel is built
  with AVX-512 BF16 its products take bfloat16 factors (the state, U' and the gradients rounded as they enter a
  product, float32 sums): <= 4.3e-3 measured (test_bfloat16_products; x2.3 margin).

Inputs are what the models feed: k l2-normalised (delta rules; the gated rule's decays exp(g) spread over
(0.5, 1)) or non-negative and sum-normalised
(sum rule, as phi(k) with sum normalisation), beta = sigmoid(.), so the recurrences stay bounded.
"""
from __future__ import annotations

import functools
import sys

import pytest
import torch
import torch.nn.functional as F

from conftest import triton_interpreted_results
from fwp_kernels import delta_rule, gated_delta_rule, linear_attention
from fwp_kernels.dispatch import RECURRENCES, resolve_mode, select_kernel

RULES = ("delta", "sum", "gated")  # the gated delta rule: g = log-decay
RULE_FUNCTIONS = {"delta": delta_rule, "sum": linear_attention, "gated": gated_delta_rule}
# the registered recurrence (fwp_kernels.dispatch.RECURRENCES) each rule's function runs
RECURRENCE = {"delta": "delta_rule", "sum": "linear_attention", "gated": "gated_delta_rule"}
GATES = {"delta": ("beta",), "sum": (), "gated": ("beta", "g")}  # the positional arguments after v
TOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 1e-2}
CUDA_TOL = {**TOL, torch.bfloat16: 3e-2}  # see the module docstring: barely measured on a GPU yet


def make_inputs(rule, B, H, T, Dk, Dv, dtype=torch.float32, seed=0, state=True):
    g = torch.Generator().manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    if rule != "sum":
        q, k = F.normalize(randn(B, H, T, Dk), dim=-1), F.normalize(randn(B, H, T, Dk), dim=-1)
    else:  # phi(x) >= 0, sum-normalised
        q, k = F.softmax(randn(B, H, T, Dk), dim=-1), F.softmax(randn(B, H, T, Dk), dim=-1)
    inputs = {
        "q": q, "k": k, "v": randn(B, H, T, Dv),
        "beta": torch.sigmoid(randn(B, H, T)) if rule != "sum" else None,
        # decays a_t = exp(g_t) spread over about (0.5, 1): 0.88 in the median, ~3e-4 over a chunk of 64
        "g": F.logsigmoid(randn(B, H, T) + 2) if rule == "gated" else None,
        "initial_state": 0.1 * randn(B, H, Dv, Dk) if state else None,
    }
    return {n: None if x is None else x.to(dtype).requires_grad_() for n, x in inputs.items()}


def positional(rule, inputs):
    """q, k, v and the rule's gates, as its public function takes them."""
    return [inputs["q"], inputs["k"], inputs["v"]] + [inputs[n] for n in GATES[rule]]


def run(rule, inputs, **kwargs):
    fn = RULE_FUNCTIONS[rule]
    return fn(*positional(rule, inputs), initial_state=inputs["initial_state"], output_final_state=True, **kwargs)


def outputs_and_grads(rule, inputs, seed=1, **kwargs):
    """o, final state and the gradients of sum(o * go) + sum(final * gf) w.r.t. every input."""
    o, final = run(rule, inputs, **kwargs)
    g = torch.Generator().manual_seed(seed)
    go = torch.randn(o.shape, generator=g, dtype=torch.float64).to(o)  # dtype and device of the output
    gf = torch.randn(final.shape, generator=g, dtype=torch.float64).to(final)
    names = [n for n, x in inputs.items() if x is not None]
    grads = torch.autograd.grad((o * go).float().sum() + (final * gf).float().sum(), [inputs[n] for n in names])
    return {"o": o, "final_state": final, **{f"d{n}": gr for n, gr in zip(names, grads)}}


def reference(rule, inputs):
    """The float64 step loop. It runs thousands of tiny ops: one thread is faster (and far steadier
    on a busy machine) than two."""
    as64 = {n: None if x is None else x.detach().double().requires_grad_() for n, x in inputs.items()}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return outputs_and_grads(rule, as64, mode="recurrent")
    finally:
        torch.set_num_threads(threads)


@functools.lru_cache(maxsize=None)
def case(rule, B, H, T, Dk, Dv, dtype=torch.float32, seed=0):
    """Inputs and their float64 step-loop reference, computed once per case for all tests."""
    inputs = make_inputs(rule, B, H, T, Dk, Dv, dtype, seed=seed)
    return inputs, reference(rule, inputs)


def rel_err(x, ref):
    return ((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def assert_close(got, ref, tol):
    assert got.keys() == ref.keys()
    errors = {n: rel_err(got[n], ref[n]) for n in ref}
    assert max(errors.values()) < tol, errors


# ---------------------------------------------------------------------------------------------------
# Chunked kernel, float64: exact up to rounding, across T, chunk sizes and head sizes


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("T", [1, 7, 64, 100])
@pytest.mark.parametrize("Dk,Dv", [(16, 16), (24, 48), (48, 24)])
def test_chunk_matches_step_loop_float64(rule, T, Dk, Dv):
    inputs, ref = case(rule, 2, 2, T, Dk, Dv, torch.float64, seed=T + Dk)
    for chunk_size in (16, 32, 64):
        got = outputs_and_grads(rule, inputs, mode="chunk", chunk_size=chunk_size)
        assert got["o"].dtype == torch.float64
        assert_close(got, ref, TOL[torch.float64])


@pytest.mark.parametrize("rule", RULES)
def test_chunk_odd_chunk_sizes(rule):
    inputs, ref = case(rule, 1, 2, 77, 24, 16, torch.float64)
    for chunk_size in (1, 5, 48, 100):
        assert_close(outputs_and_grads(rule, inputs, mode="chunk", chunk_size=chunk_size), ref, TOL[torch.float64])


# ---------------------------------------------------------------------------------------------------
# Every mode and dtype


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("mode", ["recurrent", "chunk", "auto"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("T", [1, 7, 100])
def test_modes_and_dtypes(rule, mode, dtype, T):
    inputs, ref = case(rule, 2, 3, T, 32, 24, dtype, seed=T)
    got = outputs_and_grads(rule, inputs, mode=mode, chunk_size=32)
    assert got["o"].dtype == dtype and got["final_state"].dtype == torch.float32
    for n, x in inputs.items():
        if x is not None:
            assert got[f"d{n}"].dtype == x.dtype
    assert_close(got, ref, TOL[dtype])


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("chunk_size", [16, 32, 64])
def test_chunk_long_sequence_float32(rule, chunk_size):
    """T = 1000 with small B and H: the float64 step loop (forward and backward) is the slow part."""
    inputs, ref = case(rule, 1, 2, 1000, 24, 16, torch.float32, seed=5)
    got = outputs_and_grads(rule, inputs, mode="chunk", chunk_size=chunk_size)
    assert_close(got, ref, TOL[torch.float32])


# ---------------------------------------------------------------------------------------------------
# The two CPU paths of mode="chunk": the C++ kernel (csrc/chunk_delta.cpp) and the PyTorch one, which
# runs where the C++ one cannot be built. The tests above run whichever this machine has (C++ when a
# compiler is there); these run both, explicitly.


def _cpp_kernel_modules():
    """The modules whose ``cpu_kernel_available`` switch the C++ chunk kernels: chunk.py (csrc/chunk_delta.cpp, sum
    and delta rule) and gated_delta_rule_kernels.py (the same source's gated ops)."""
    from fwp_kernels import chunk, gated_delta_rule_kernels

    return chunk, gated_delta_rule_kernels


def _cpp_kernel_or_skip():
    for module in _cpp_kernel_modules():
        if not module.cpu_kernel_available():
            pytest.skip(f"the C++ chunk kernel of {module.__name__} is {module.cpu_kernel_status()}")


def _disable_cpp_kernels(monkeypatch):
    for module in _cpp_kernel_modules():
        monkeypatch.setattr(module, "cpu_kernel_available", lambda: False)


@pytest.fixture(params=["cpp", "pytorch"])
def chunk_path(request, monkeypatch):
    """Runs a test once with the C++ chunk kernels (skipped when they cannot be built) and once with the
    PyTorch chunked kernel."""
    if request.param == "cpp":
        _cpp_kernel_or_skip()
    else:
        _disable_cpp_kernels(monkeypatch)
    return request.param


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("T,chunk_size", [(1, 64), (7, 4), (64, 16), (100, 32), (130, 64)])
def test_chunk_paths_float64(chunk_path, rule, T, chunk_size):
    inputs, ref = case(rule, 2, 3, T, 24, 40, torch.float64, seed=T)
    assert_close(outputs_and_grads(rule, inputs, mode="chunk", chunk_size=chunk_size), ref, TOL[torch.float64])


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_chunk_paths_float32_bfloat16(chunk_path, rule, dtype):
    inputs, ref = case(rule, 2, 3, 100, 32, 24, dtype, seed=3)
    got = outputs_and_grads(rule, inputs, mode="chunk", chunk_size=32)
    assert got["o"].dtype == dtype and got["final_state"].dtype == torch.float32
    assert_close(got, ref, TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
def test_linear_attention_one_chunk_closed_form(dtype, monkeypatch):
    """A sequence that fits in one chunk takes the closed form (tril(QK^T)V + QS0^T, S0 + V^TK) and matches the
    step loop in outputs, final state and every gradient (initial state included)."""
    from fwp_kernels import linear_attention_kernels

    calls = []
    closed_form = linear_attention_kernels.linear_attention_one_chunk
    monkeypatch.setattr(
        linear_attention_kernels, "linear_attention_one_chunk", lambda *a: calls.append(1) or closed_form(*a)
    )
    inputs, ref = case("sum", 2, 3, 48, 24, 40, dtype, seed=5)
    got = outputs_and_grads("sum", inputs, mode="chunk", chunk_size=64)
    assert calls and got["o"].dtype == dtype
    assert got["final_state"].dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert_close(got, ref, TOL[dtype])


@pytest.mark.parametrize("rule", RULES)
def test_cpp_kernel_agrees_with_pytorch_path(rule, monkeypatch):
    """Same inputs through both paths, float32, T = 300 (no multiple of C), a leaf initial state; also
    that the C++ forward leaves the caller's initial state untouched (it updates a copy in place)."""
    _cpp_kernel_or_skip()
    inputs = make_inputs(rule, 2, 2, 300, 64, 64, torch.float32, seed=11)
    state_before = inputs["initial_state"].detach().clone()
    cpp = outputs_and_grads(rule, inputs, mode="chunk", chunk_size=64)
    assert torch.equal(inputs["initial_state"].detach(), state_before)
    _disable_cpp_kernels(monkeypatch)
    torch_path = outputs_and_grads(rule, inputs, mode="chunk", chunk_size=64)
    assert_close(cpp, torch_path, TOL[torch.float32])


def _products_or_skip(kind):
    from fwp_kernels import chunk

    _cpp_kernel_or_skip()
    if kind not in chunk.cpu_product_kinds():
        pytest.skip(f"the C++ kernel's build has no products of kind {kind} (AVX-512 / AVX-512 BF16) on this CPU")


def _bfloat16_kind_or_skip(kind: str, monkeypatch) -> int:
    """The products of bfloat16 `kind` ("vdpbf16ps" or "tiles"), made the bfloat16 inputs' default; skips where the
    build or the machine has none."""
    from fwp_kernels import chunk

    products = {"vdpbf16ps": chunk.BFLOAT16_PRODUCTS, "tiles": chunk.TILE_BFLOAT16_PRODUCTS}[kind]
    _products_or_skip(products)
    monkeypatch.setattr(chunk, "BFLOAT16_DEFAULT_PRODUCTS", products)
    return products


def _spy_op_dtypes(monkeypatch, op: str) -> list:
    """Records the dtypes of the tensors that every call of the C++ kernel's op `op` is given."""
    from fwp_kernels import chunk

    calls = []

    class Spy:  # the kernel's ops, `op` recording its calls
        def __init__(self, ops):
            self.ops = ops

        def __getattr__(self, name):
            found = getattr(self.ops, name)
            if name != op:
                return found
            return lambda *args: calls.append([t.dtype for t in args if isinstance(t, torch.Tensor)]) or found(*args)

    monkeypatch.setattr(chunk._CPU_KERNEL, "ops", Spy(chunk._CPU_KERNEL.ops))
    return calls


def _spy_products(monkeypatch):
    """Records what chunk.cpu_products chose for every C++ chunk call."""
    from fwp_kernels import chunk

    chosen, choose = [], chunk.cpu_products
    monkeypatch.setattr(chunk, "cpu_products", lambda *a, **kw: chosen.append(choose(*a, **kw)) or chosen[-1])
    return chosen


@pytest.mark.parametrize("rule", ["delta", "sum", "gated"])
@pytest.mark.parametrize(
    "B,H,T,Dk,Dv,chunk_size",
    [(2, 3, 100, 32, 48, 32), (1, 2, 77, 16, 16, 16), (2, 1, 21, 64, 32, 10), (1, 2, 300, 64, 64, 64),
     (1, 2, 130, 128, 128, 32), (2, 1, 200, 24, 80, 48), (1, 2, 90, 40, 24, 20), (1, 2, 53, 17, 19, 16)],
)
@pytest.mark.parametrize("kind", ["vdpbf16ps", "tiles"])
def test_bfloat16_products(rule, B, H, T, Dk, Dv, chunk_size, kind, monkeypatch):
    """bfloat16 inputs multiply with bfloat16 factors and float32 sums (the micro-kernel's vdpbf16ps; state, solve
    and sums in float32) where the build has AVX-512 BF16, forward and backward, and with float32 factors forced on
    the backward: outputs, final state and every gradient within the bfloat16 bound of the float64 step loop. Odd
    chunks (T = 21, 53, 77), chunks and heads that are no multiple of 16 (10, 20, 24, 40, 48) or odd (17, 19) pad
    the packed operands and mask the last columns; 80 and 128 columns run 64-column blocks and a 16-column one.
    Measured on a Zen 5 CPU: o <= 3.6e-3 (the sum rule's 2.1e-3 is about its rounding to bfloat16 alone), final
    state <= 2.7e-3 (sum rule 6.8e-8), gradients <= 4.3e-3; the gated rule (its decays on the delta rule's products):
    o <= 3.1e-3, final state <= 2.4e-3, gradients <= 4.3e-3 (dg). `kind`: vdpbf16ps (AVX-512 BF16) or AMX's tiles,
    each where the machine has it (on an Intel Xeon with AMX, both kinds over these cases: delta rule o <= 3.6e-3, final
    state <= 2.7e-3, gradients <= 4.3e-3; gated o <= 3.1e-3, final state <= 2.4e-3, gradients <= 4.3e-3; the same to
    two digits for the two kinds)."""
    from fwp_kernels import chunk

    products = _bfloat16_kind_or_skip(kind, monkeypatch)
    chosen = _spy_products(monkeypatch)
    inputs, ref = case(rule, B, H, T, Dk, Dv, torch.bfloat16, seed=T + Dk)
    got = outputs_and_grads(rule, inputs, mode="chunk", chunk_size=chunk_size)
    float32 = chunk.FLOAT32_DEFAULT_PRODUCTS if chunk.FLOAT32_DEFAULT_PRODUCTS in chunk.cpu_product_kinds() \
        else chunk.BLAS_PRODUCTS
    assert chosen == [products] * 2  # forward, backward
    assert got["o"].dtype == torch.bfloat16 and got["final_state"].dtype == torch.float32
    assert_close(got, ref, TOL[torch.bfloat16])
    owner, name = (_cpp_kernel_modules()[1].GatedDeltaRuleChunks, "compiled_backward") if rule == "gated" \
        else (chunk, "_backward_cpu")
    backward = getattr(owner, name)

    def backward_with_float32_factors(*args):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(chunk, "cpu_products", lambda *a, **kw: float32)
            return backward(*args)

    monkeypatch.setattr(owner, name, backward_with_float32_factors)
    assert_close(outputs_and_grads(rule, inputs, mode="chunk", chunk_size=chunk_size), ref, TOL[torch.bfloat16])
    assert chosen[2:] == [products]  # the forward's; the backward's forced


@pytest.mark.parametrize("rule", ["delta", "sum"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("B,H,T,Dk,Dv,chunk_size", [(2, 3, 100, 32, 48, 32), (1, 1, 150, 17, 40, 16),
                                                    (1, 2, 53, 64, 19, 20)])
@pytest.mark.parametrize("kind", ["vdpbf16ps", "tiles"])
def test_bfloat16_backward_widens_and_rounds(rule, threads, B, H, T, Dk, Dv, chunk_size, kind, monkeypatch):
    """The C++ backward of bfloat16 inputs takes q, k, v, beta and the output gradient as bfloat16 and writes bfloat16
    gradients: exactly the float32 backward of the widened inputs with its gradients rounded once (the kernel widens
    and rounds chunk by chunk; at B*H = 1 and 2 threads the value-column blocks sum their partial dq, dk and dbeta in
    float32 before rounding), with float32 factors and with bfloat16 ones (read in place in its recomputation of the
    forward, packed from float32 on the widened inputs). Ragged last chunks, odd Dk and Dv; the autograd path hands
    the op bfloat16 tensors. `kind`: the bfloat16 factors' products, vdpbf16ps or AMX's tiles (skipped without)."""
    from fwp_kernels import chunk

    _cpp_kernel_or_skip()
    if kind == "tiles" or chunk.BFLOAT16_PRODUCTS in chunk.cpu_product_kinds():
        _bfloat16_kind_or_skip(kind, monkeypatch)
    g = torch.Generator().manual_seed(T)
    BH = B * H
    q, k = (F.normalize(torch.randn(BH, T, Dk, generator=g), dim=-1).bfloat16() for _ in range(2))
    v, do = (torch.randn(BH, T, Dv, generator=g).bfloat16() for _ in range(2))
    beta = torch.sigmoid(torch.randn(BH, T, generator=g)).bfloat16() if rule == "delta" else None
    s0, d_final = (0.1 * torch.randn(BH, Dv, Dk, generator=g) for _ in range(2))
    gates = () if beta is None else (beta,)
    kinds = {chunk.cpu_products(q, k, v, gates), chunk.cpu_products(q, k, v, gates, bfloat16_factors=False)}

    def backward(dtype, products):
        x = [None if t is None else t.to(dtype) for t in (q, k, v, beta)]
        dS = d_final.clone()
        grads = [torch.empty_like(t) for t in x[:3]] + [None if beta is None else torch.empty_like(x[3])]
        _with_threads(threads, lambda: chunk._CPU_KERNEL.ops.chunk_backward(
            *x, s0, chunk_size, do.to(dtype), dS, *grads, products))
        return [t for t in grads if t is not None] + [dS]

    for products in kinds:
        got, widened = backward(torch.bfloat16, products), backward(torch.float32, products)
        assert all(t.dtype == torch.bfloat16 for t in got[:-1])
        for a, b in zip(got, widened):
            assert torch.equal(a, b.to(a.dtype)), products
    calls = _spy_op_dtypes(monkeypatch, "chunk_backward")
    outputs_and_grads(rule, make_inputs(rule, B, H, T, Dk, Dv, torch.bfloat16, seed=T), mode="chunk",
                      chunk_size=chunk_size)
    bf16, f32, n = torch.bfloat16, torch.float32, (4 if rule == "delta" else 3)  # q, k, v (, beta)
    assert calls == [[bf16] * n + [f32, bf16, f32] + [bf16] * n]  # inputs, s0, do, dS, their gradients


def test_bfloat16_outputs_round_as_torch_does():
    """The C++ kernels round their float32 results to bfloat16 outputs as torch's ``.to(torch.bfloat16)`` does, bit for
    bit: ties to even, values that round past the largest finite to infinity, denormals kept (the vector instruction
    would flush them), and the last lanes of rows that are no multiple of 32 wide. The sum rule's
    outputs with one-hot queries and zero keys and values are columns of the initial state, here holding such values;
    a row holding a NaN makes its whole output column NaN (0 * NaN), written as 0x7FC0 whatever its payload."""
    from fwp_kernels import chunk

    _products_or_skip(chunk.FLOAT32_PRODUCTS)
    Dk, Dv, T = 16, 40, 70
    g = torch.Generator().manual_seed(0)
    S = torch.randn(1, Dv, Dk, generator=g) * torch.logspace(-30, 30, Dk)
    bits = torch.tensor([0x3F808000, 0x3F818000, 0xBF808000, 0x3F80FFFF, 0x7F7FC99E, 0x00800000, 0x007FFFFF, 0x00000001,
                         0x80012345, 0x00008000, 0x7F7F7FFF], dtype=torch.int64).to(torch.int32)
    specials = bits.view(torch.float32)  # ties (even / odd), overflow to infinity, the smallest normal, denormals
    S[0, 1 : 1 + len(specials), 3] = specials
    S[0, 20:31, 5] = specials
    nan_rows = [33, 38]
    S[0, 33, 7] = torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32)  # a quiet NaN with a payload
    S[0, 38, 2] = torch.tensor([0x7F800001], dtype=torch.int32).view(torch.float32)  # a signalling NaN
    columns = torch.arange(T) % Dk
    q = F.one_hot(columns, Dk).to(torch.bfloat16)[None]
    k, v = torch.zeros_like(q), torch.zeros(1, T, Dv, dtype=torch.bfloat16)
    o = torch.empty_like(v)
    chunk._CPU_KERNEL.ops.chunk_forward(q, k, v, None, S.clone(), 16, o, None, None, chunk.FLOAT32_PRODUCTS)
    expected = S[0][:, columns].T  # o_t = S q_t
    finite = [i for i in range(Dv) if i not in nan_rows]
    assert torch.equal(o[0][:, finite].view(torch.int16), expected[:, finite].to(torch.bfloat16).view(torch.int16))
    # NaN as c10::BFloat16(float) writes it (torch's vectorised tensor conversion writes 0xFFFF, another NaN)
    assert torch.all(o[0][:, nan_rows].view(torch.int16) == 0x7FC0)


@pytest.mark.parametrize("rule", ["delta", "sum"])
@pytest.mark.parametrize("BH,T,Dk,Dv,chunk_size", [(2, 21, 64, 32, 10), (2, 100, 64, 64, 16), (1, 53, 17, 19, 16),
                                                   (2, 70, 128, 80, 32), (1, 40, 24, 24, 20)])
@pytest.mark.parametrize("kind", ["vdpbf16ps", "tiles"])
def test_bfloat16_operands_in_place_are_the_generic_ones(rule, BH, T, Dk, Dv, chunk_size, kind, monkeypatch):
    """The bfloat16 forward's own operands (q and k read in place, K interleaved once, S^T's pairs written by the
    previous chunk's update from its registers) give bit for bit the outputs and final state of the generic
    bfloat16-factor products on the widened inputs, which pack every operand from float32 per product: short chunks
    (copied and stacked), odd Dk, Dv of two column blocks, ragged last chunks; with vdpbf16ps and with AMX's tiles."""
    from fwp_kernels import chunk

    products = _bfloat16_kind_or_skip(kind, monkeypatch)
    g = torch.Generator().manual_seed(T + Dk)
    q, k = (F.normalize(torch.randn(BH, T, Dk, generator=g), dim=-1).bfloat16() for _ in range(2))
    v = torch.randn(BH, T, Dv, generator=g).bfloat16()
    beta = torch.sigmoid(torch.randn(BH, T, generator=g)).bfloat16() if rule == "delta" else None
    s0 = 0.1 * torch.randn(BH, Dv, Dk, generator=g)

    def forward(dtype):
        x = [None if t is None else t.to(dtype) for t in (q, k, v, beta)]
        S, o = s0.clone(), torch.empty_like(x[2])
        chunk._CPU_KERNEL.ops.chunk_forward(*x, S, chunk_size, o, None, None, products)
        return o, S

    (o, S), (o_generic, S_generic) = forward(torch.bfloat16), forward(torch.float32)
    assert torch.equal(o, o_generic.bfloat16()) and torch.equal(S, S_generic)


@pytest.mark.parametrize("rule", ["delta", "sum"])
@pytest.mark.parametrize("B,H,T,Dk,Dv,chunk_size", [(2, 3, 100, 32, 48, 32), (2, 1, 200, 24, 40, 48),
                                                    (1, 2, 53, 17, 19, 16), (1, 3, 150, 64, 80, 32)])
def test_float32_products_agree_with_the_blas(rule, B, H, T, Dk, Dv, chunk_size, monkeypatch):
    """float32 inputs take the micro-kernel's float32 products where the build has AVX-512 or AVX2 + FMA; they and the
    BLAS's each stay within the float32 bound of the float64 step loop, and agree with each other to float32
    rounding."""
    from fwp_kernels import chunk

    _products_or_skip(chunk.FLOAT32_PRODUCTS)
    chosen = _spy_products(monkeypatch)
    inputs, ref = case(rule, B, H, T, Dk, Dv, torch.float32, seed=T + Dk)
    vector = outputs_and_grads(rule, inputs, mode="chunk", chunk_size=chunk_size)
    monkeypatch.setattr(chunk, "FLOAT32_DEFAULT_PRODUCTS", chunk.BLAS_PRODUCTS)
    blas = outputs_and_grads(rule, inputs, mode="chunk", chunk_size=chunk_size)
    assert chosen == [chunk.FLOAT32_PRODUCTS] * 2 + [chunk.BLAS_PRODUCTS] * 2
    assert_close(vector, ref, TOL[torch.float32])
    assert_close(blas, ref, TOL[torch.float32])
    assert_close(vector, blas, TOL[torch.float32])


def test_products_follow_the_inputs_dtypes():
    """bfloat16 factors only for q, k, v and beta all bfloat16 and at least bfloat16_products_min_t positions for the
    head width; float64 always the BLAS."""
    from fwp_kernels import chunk

    _cpp_kernel_or_skip()
    kinds = chunk.cpu_product_kinds()
    bfloat16 = chunk.cpu_bfloat16_products()
    T = chunk.bfloat16_products_min_t(8, bfloat16 if bfloat16 is not None else chunk.BFLOAT16_PRODUCTS)
    if bfloat16 in (None, chunk.BFLOAT16_PRODUCTS):  # vdpbf16ps: wider heads need more positions
        wide = torch.zeros(1, 1, T, 128, dtype=torch.bfloat16)
        assert chunk.bfloat16_products_min_t(128) > T
        assert chunk.cpu_products(wide, wide, wide, (torch.zeros(1, 1, T, dtype=torch.bfloat16),)) == (
            chunk.FLOAT32_DEFAULT_PRODUCTS if chunk.FLOAT32_DEFAULT_PRODUCTS in kinds else chunk.BLAS_PRODUCTS)
    x = {d: torch.zeros(1, 1, T, 8, dtype=d) for d in (torch.float64, torch.float32, torch.bfloat16, torch.float16)}
    beta = torch.zeros(1, 1, T, dtype=torch.bfloat16)
    fp32 = chunk.FLOAT32_DEFAULT_PRODUCTS if chunk.FLOAT32_DEFAULT_PRODUCTS in kinds else chunk.BLAS_PRODUCTS
    bf16 = chunk.cpu_bfloat16_products() or fp32
    b16 = x[torch.bfloat16]
    assert chunk.cpu_products(b16, b16, b16, (beta,)) == bf16 and chunk.cpu_products(b16, b16, b16, ()) == bf16
    assert chunk.cpu_products(b16, b16, b16, (beta,), bfloat16_factors=False) == fp32
    short = b16[:, :, : T - 1]
    assert chunk.cpu_products(short, short, short, (beta[..., : T - 1],)) == fp32
    assert chunk.cpu_products(b16, b16, b16, (beta.float(),)) == fp32
    assert chunk.cpu_products(x[torch.float32], b16, b16, ()) == fp32
    assert chunk.cpu_products(*[x[torch.float16]] * 3, ()) == fp32
    assert chunk.cpu_products(*[x[torch.float64]] * 3, ()) == chunk.BLAS_PRODUCTS
    assert chunk.BLAS_PRODUCTS in kinds


@pytest.mark.parametrize("rule", ["delta", "gated"])
def test_cpp_kernel_threads_agree(rule):
    """One sequence per task of at::parallel_for: 1 and 2 threads give the same bits."""
    _cpp_kernel_or_skip()
    inputs = make_inputs(rule, 2, 3, 150, 32, 32, torch.float32, seed=2)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = outputs_and_grads(rule, inputs, mode="chunk", chunk_size=32)
        torch.set_num_threads(2)
        two = outputs_and_grads(rule, inputs, mode="chunk", chunk_size=32)
    finally:
        torch.set_num_threads(threads)
    for name in one:
        assert torch.equal(one[name], two[name]), name


def test_cpp_kernel_failed_build_falls_back(monkeypatch, tmp_path):
    """A source that does not compile: one RuntimeWarning, status "failed (...)", and the PyTorch path runs."""
    from fwp_kernels import chunk

    from fwp_kernels.cpp_build import missing_toolchain

    if missing_toolchain() is not None:
        pytest.skip(f"no toolchain to fail with: {missing_toolchain()}")
    kernel = chunk._CPU_KERNEL
    monkeypatch.setattr(kernel, "_available", None)
    monkeypatch.setattr(kernel, "status", "not tried yet")
    monkeypatch.setattr(kernel, "source", lambda: ("this is not C++;\n", "test source"))
    monkeypatch.setenv("FWP_KERNELS_BUILD_DIR", str(tmp_path))
    monkeypatch.delenv("FWP_KERNELS_NO_BUILD", raising=False)
    inputs, ref = case("delta", 1, 2, 40, 16, 16, torch.float64, seed=4)
    with pytest.warns(RuntimeWarning, match="building the C\\+\\+ kernel chunk_delta.cpp"):
        got = outputs_and_grads("delta", inputs, mode="chunk", chunk_size=16)
    assert chunk.cpu_kernel_status().startswith("failed")
    assert_close(got, ref, TOL[torch.float64])


def test_cpp_kernel_disabled_by_environment(monkeypatch):
    from fwp_kernels import chunk

    monkeypatch.setattr(chunk._CPU_KERNEL, "_available", None)
    monkeypatch.setattr(chunk._CPU_KERNEL, "status", "not tried yet")
    monkeypatch.setenv("FWP_KERNELS_NO_BUILD", "1")
    assert chunk.cpu_kernel_available() is False
    assert chunk.cpu_kernel_status() == "disabled (FWP_KERNELS_NO_BUILD=1)"
    inputs, ref = case("sum", 1, 2, 40, 16, 16, torch.float64, seed=4)
    assert_close(outputs_and_grads("sum", inputs, mode="chunk", chunk_size=16), ref, TOL[torch.float64])


# ---------------------------------------------------------------------------------------------------
# State handling


@pytest.mark.parametrize("rule", RULES)
def test_chunked_prefill_then_recurrent_decode(rule):
    inputs = make_inputs(rule, 2, 2, 90, 24, 48, torch.float32)
    with torch.no_grad():
        o_ref, s_ref = run(rule, inputs, mode="recurrent")

        def part(sl, state, mode):
            piece = {n: x[:, :, sl] if n != "initial_state" and x is not None else x for n, x in inputs.items()}
            piece["initial_state"] = state
            return run(rule, piece, mode=mode, chunk_size=32)

        o_pre, state = part(slice(0, 70), inputs["initial_state"], "chunk")  # prefill, chunked
        outs = [o_pre]
        for t in range(70, 80):  # decode steps ("auto" with T = 1: the C++ decode step on CPU)
            o_t, state = part(slice(t, t + 1), state, "auto")
            outs.append(o_t)
        o_rest, state = part(slice(80, 90), state, "chunk")  # a second chunked prefill
        outs.append(o_rest)
    assert rel_err(torch.cat(outs, dim=2), o_ref) < TOL[torch.float32]
    assert rel_err(state, s_ref) < TOL[torch.float32]


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("mode", ["recurrent", "chunk"])
def test_without_initial_or_final_state(rule, mode):
    inputs = make_inputs(rule, 1, 2, 20, 16, 16, torch.float64, state=False)
    o, final = RULE_FUNCTIONS[rule](*positional(rule, inputs), mode=mode)
    assert final is None
    o.sum().backward()
    ref = reference(rule, inputs)
    assert rel_err(o, ref["o"]) < TOL[torch.float64]


@pytest.mark.parametrize("rule", RULES)
def test_chunk_empty_sequence(rule):
    inputs = make_inputs(rule, 1, 2, 0, 16, 8, torch.float32)
    got = outputs_and_grads(rule, inputs, mode="chunk")
    assert got["o"].shape == (1, 2, 0, 8) and got["dq"].shape == (1, 2, 0, 16)
    torch.testing.assert_close(got["final_state"], inputs["initial_state"].detach())


@pytest.mark.parametrize("rule", RULES)
def test_chunk_non_contiguous_inputs(rule):
    """[B, T, H, D] activations transposed to [B, H, T, D] without a copy."""
    inputs = make_inputs(rule, 2, 3, 50, 16, 16, torch.float32)
    strided = {
        n: None if x is None or n == "initial_state" else x.detach().transpose(1, 2).contiguous().transpose(1, 2)
        for n, x in inputs.items()
    }
    strided["initial_state"] = inputs["initial_state"]
    got = run(rule, strided, mode="chunk")
    ref = run(rule, inputs, mode="recurrent")
    assert rel_err(got[0], ref[0]) < TOL[torch.float32]


@pytest.mark.parametrize("rule", RULES)
def test_chunk_backward_saves_no_per_step_state(rule):
    """Saved for backward: the inputs only (no per-step, not even per-chunk, states)."""
    inputs = make_inputs(rule, 1, 2, 256, 16, 16, torch.float32)
    saved = []

    def pack(x):
        saved.append(x.numel() * x.element_size())
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        run(rule, inputs, mode="chunk", chunk_size=16)
    input_bytes = sum(x.numel() * x.element_size() for x in inputs.values() if x is not None)
    assert sum(saved) <= input_bytes


@pytest.mark.parametrize("rule", ["delta", "gated"])
def test_auto_mode_resolution(rule, monkeypatch):
    from fwp_kernels import chunk, gated_delta_rule_kernels

    kernel_module = gated_delta_rule_kernels if rule == "gated" else chunk
    _resolve_mode = functools.partial(resolve_mode, RECURRENCES[RULE_FUNCTIONS[rule].__name__])
    cpu = torch.device("cpu")
    built = kernel_module.cpu_kernel_available()
    # a decode step: the C++ one-pass decode step (mode "chunk" with T = 1; the gated rule's is the delta rule's with
    # the decay, so it needs both kernels) when built, else the step loop
    decode_built = built and chunk.cpu_kernel_available()
    assert _resolve_mode("auto", 1, cpu) == ("chunk" if decode_built else "recurrent")
    if rule == "gated" and built:  # its chunk kernel without the delta rule's: a decode step is the loop
        with monkeypatch.context() as patch:
            patch.setattr(chunk, "cpu_kernel_available", lambda: False)
            assert _resolve_mode("auto", 1, cpu) == "recurrent" and _resolve_mode("auto", 2, cpu) == "chunk"
    assert _resolve_mode("auto", 512, cpu) == "chunk"
    assert _resolve_mode("auto", 1, torch.device("cuda")) == "recurrent"
    assert _resolve_mode("auto", 512, torch.device("cuda")) == "chunk"
    assert _resolve_mode("recurrent", 512, cpu) == "recurrent"
    assert _resolve_mode("chunk", 1, cpu) == "chunk"
    # Two positions: chunkwise with the rule's C++ chunk kernel (faster from T = 2 on), a step loop without it.
    assert _resolve_mode("auto", 2, cpu) == ("chunk" if built else "recurrent")
    assert _resolve_mode("auto", 4, cpu) == "chunk"
    monkeypatch.setattr(kernel_module, "cpu_kernel_available", lambda: False)
    assert _resolve_mode("auto", 1, cpu) == "recurrent"
    assert _resolve_mode("auto", 3, cpu) == "recurrent" and _resolve_mode("auto", 4, cpu) == "chunk"


def test_auto_chunk_size_from_the_measured_table(monkeypatch):
    """mode="auto" on CPU takes the table's chunk size for heads it covers and the caller's for wider ones (the
    Fast Weight Layers' vocabulary-wide heads); without the C++ kernel always the caller's."""
    from fwp_kernels import chunk

    cpu = torch.device("cpu")
    monkeypatch.setattr(chunk, "cpu_kernel_available", lambda: True)
    for threads in (1, 2, 8):
        row = chunk.cpu_auto_choice(threads)
        for width, size in row.chunk_sizes:
            monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
            assert chunk.auto_chunk_size(cpu, width, 64) == size
        assert chunk.auto_chunk_size(cpu, row.chunk_sizes[-1][0] + 1, 256) == 256
        for width, size in row.bfloat16_tile_chunk_sizes:  # bfloat16 factors in AMX tiles: their own row
            assert chunk.auto_chunk_size(cpu, width, 64, chunk.TILE_BFLOAT16_PRODUCTS) == size
        for width, size in row.chunk_sizes:  # other products: the float32 row
            assert chunk.auto_chunk_size(cpu, width, 64, chunk.BFLOAT16_PRODUCTS) == size
            if width > max((w for w, _ in row.bfloat16_tile_chunk_sizes), default=0):
                assert chunk.auto_chunk_size(cpu, width, 64, chunk.TILE_BFLOAT16_PRODUCTS) == size
    assert chunk.cpu_auto_choice(8) == chunk._CPU_AUTO_TABLE[max(chunk._CPU_AUTO_TABLE)]
    monkeypatch.setattr(chunk, "cpu_kernel_available", lambda: False)
    assert chunk.auto_chunk_size(cpu, 64, 64) == 64


def test_auto_table_of_an_avx2_build_takes_chunks_of_16_at_width_128(monkeypatch):
    """An AVX2-only build (the micro-kernel in 8-lane registers) runs its own rows, which differ from the AVX-512
    rows at width 128 (16 instead of 32); the build kind follows the CPU's flags."""
    from fwp_kernels import chunk, cpp_build

    assert chunk._CPU_AUTO_TABLE is (chunk._CPU_AUTO_AVX2 if cpp_build.avx2_only_build() else chunk._CPU_AUTO)
    monkeypatch.setattr(cpp_build, "native_arch_flags", lambda: (cpp_build.NATIVE_ARCH_FLAG,))
    for flags, avx2_only in ((("fma", "avx2"), True), (("fma", "avx2", "avx512f"), False), (("avx2",), False)):
        monkeypatch.setattr(cpp_build, "cpu_flags", lambda flags=flags: flags)
        assert cpp_build.avx2_only_build() is avx2_only
        assert cpp_build.widest_avx2_flags() == (("-mprefer-vector-width=256",) if avx2_only else ())
    monkeypatch.setattr(cpp_build, "cpu_flags", lambda: ("fma", "avx2"))
    monkeypatch.setattr(cpp_build, "native_arch_flags", lambda: ())  # not x86-64: no -march=native build
    assert not cpp_build.avx2_only_build()
    for threads in (1, 2):
        assert dict(chunk._CPU_AUTO_AVX2[threads].chunk_sizes) == {64: 16, 128: 16}
        assert dict(chunk._CPU_AUTO[threads].chunk_sizes) == {64: 16, 128: 32}
    monkeypatch.setattr(chunk, "_CPU_AUTO_TABLE", chunk._CPU_AUTO_AVX2)
    monkeypatch.setattr(chunk, "cpu_kernel_available", lambda: True)
    assert chunk.auto_chunk_size(torch.device("cpu"), 128, 64) == 16


@pytest.mark.parametrize("rule", ["delta", "gated"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_auto_mode_runs_the_table_chunk_size(rule, dtype):
    """mode="auto" with the C++ kernel runs the table's chunk size for the delta and the gated rule alike (for
    bfloat16 inputs, the row of their products: AMX tiles' own where the machine has them): the same bits as
    mode="chunk" at that size, whatever chunk_size the caller passed."""
    from fwp_kernels import chunk

    _cpp_kernel_or_skip()
    inputs = {n: None if x is None else x.detach()
              for n, x in make_inputs(rule, 1, 2, 100, 64, 64, dtype, seed=3).items()}
    gates = tuple(inputs[n] for n in ("beta", "g") if inputs.get(n) is not None)
    products = chunk.cpu_products(inputs["q"], inputs["k"], inputs["v"], gates)
    size = chunk.auto_chunk_size(torch.device("cpu"), 64, 64, products)
    auto, _ = run(rule, inputs, mode="auto", chunk_size=128)
    table, _ = run(rule, inputs, mode="chunk", chunk_size=size)
    other, _ = run(rule, inputs, mode="chunk", chunk_size=128)
    assert torch.equal(auto, table) and not torch.equal(auto, other)


def _with_threads(threads, fn):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
def test_cpp_kernel_fewer_sequences_than_threads(rule, threads, dtype):
    """B*H = 1 < 2 threads: the C++ kernel splits the value columns over tasks (partial dq, dk, dbeta summed);
    forward and backward against the float64 step loop, at 1 and 2 threads. Dv = 40: blocks of 20 columns (for
    bfloat16 and float32 the micro-kernel's products where built, their last columns masked)."""
    _cpp_kernel_or_skip()
    inputs, ref = case(rule, 1, 1, 150, 32, 40, dtype, seed=5)
    got = _with_threads(threads, lambda: outputs_and_grads(rule, inputs, mode="chunk", chunk_size=32))
    assert_close(got, ref, TOL[dtype])


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("state", [True, False])
def test_decode_step_matches_step_loop(rule, threads, dtype, state):
    """T = 1 through mode "auto" (the C++ decode step on CPU, one pass over the state): output, new state and every
    gradient (the backward is the chunk kernel's) against the float64 step loop; the caller's state is unchanged."""
    from fwp_kernels import chunk

    inputs = make_inputs(rule, 2, 3, 1, 32, 24, dtype, seed=7, state=state)
    ref = reference(rule, inputs)
    before = None if not state else inputs["initial_state"].detach().clone()
    calls = []
    decode = chunk.decode_cpu
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(chunk, "decode_cpu", lambda *args: calls.append(1) or decode(*args))
        got = _with_threads(threads, lambda: outputs_and_grads(rule, inputs, mode="auto"))
    assert len(calls) == (1 if chunk.cpu_kernel_available() else 0)  # the one-pass kernel ran (where built)
    assert got["o"].dtype == dtype and got["o"].shape == inputs["v"].shape
    assert_close(got, ref, TOL[dtype])
    if state:
        assert torch.equal(inputs["initial_state"].detach(), before)


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("state", [True, False])
def test_large_decode_states_written_around_the_caches(rule, threads, state):
    """A decode step whose new states take 1 MB or more (csrc's kStreamStateBytes: B2 H8 D128 float32) writes them
    with non-temporal stores: output and states bit for bit those of the same step one sequence at a time (512 KB,
    written as usual), and the float64 step loop's within float32 rounding."""
    from fwp_kernels import chunk

    if not chunk.cpu_kernel_available():
        pytest.skip("the C++ chunk kernel is not built")
    made = make_inputs(rule, 2, 8, 1, 128, 128, torch.float32, seed=11, state=state)
    inputs = {n: None if x is None else x.detach() for n, x in made.items()}
    with torch.no_grad():
        o, final = _with_threads(threads, lambda: run(rule, inputs, mode="auto"))
        alone = [run(rule, {n: None if x is None else x[b:b + 1] for n, x in inputs.items()}, mode="auto")
                 for b in range(2)]
    assert torch.equal(o, torch.cat([a[0] for a in alone])) and torch.equal(final, torch.cat([a[1] for a in alone]))
    ref = reference(rule, inputs)
    assert_close({"o": o, "final_state": final}, {"o": ref["o"], "final_state": ref["final_state"]},
                 TOL[torch.float32])


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
def test_untracked_decode_step_skips_the_autograd_function(rule, dtype):
    """T = 1 outside autograd (a decode step of generate) goes to the one-pass kernel without the autograd Function
    (``chunk.chunk_fast_weights``; checked by making the Function fail), bfloat16 inputs as they are (the op widens
    them): output and state against the float64 step loop, and bit for bit the widened float32 inputs' result."""
    from fwp_kernels import chunk

    if not chunk.cpu_kernel_available():
        pytest.skip("the C++ chunk kernel is not built")
    made = make_inputs(rule, 2, 3, 1, 32, 24, dtype, seed=9)
    inputs = {n: None if x is None else x.detach() for n, x in made.items()}
    ref = reference(rule, inputs)
    with pytest.MonkeyPatch.context() as patch, torch.no_grad():
        patch.setattr(chunk.ChunkFastWeightFunction, "apply", lambda *args: pytest.fail("the Function ran"))
        o, final = run(rule, inputs, mode="auto")
        widened = {n: x if x is None or n == "initial_state" else x.float() for n, x in inputs.items()}
        o32, final32 = run(rule, widened, mode="auto")
    assert o.dtype == dtype and final.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert_close({"o": o, "final_state": final}, {"o": ref["o"], "final_state": ref["final_state"]}, TOL[dtype])
    if dtype == torch.bfloat16:
        assert torch.equal(o, o32.to(dtype)) and torch.equal(final, final32)


# ---------------------------------------------------------------------------------------------------
# The gated delta rule against the equation, and against the delta rule at g = 0


def gated_equation_loop(q, k, v, beta, g, initial_state):
    """W_t = a_t W_{t-1} + beta_t (v_t - a_t W_{t-1} k_t) k_t^T, a_t = exp(g_t), o_t = W_t q_t (Yang et al. 2025,
    sec. 3.1) in float64, one (batch, head) and one step at a time, as written."""
    B, H, T, _ = q.shape
    o = torch.zeros(B, H, T, v.shape[-1], dtype=torch.float64)
    final = initial_state.double().clone()
    for b in range(B):
        for h in range(H):
            W = final[b, h]
            for t in range(T):
                a, k_t = torch.exp(g[b, h, t].double()), k[b, h, t].double()
                W = a * W + beta[b, h, t].double() * torch.outer(v[b, h, t].double() - a * W @ k_t, k_t)
                o[b, h, t] = W @ q[b, h, t].double()
            final[b, h] = W
    return o, final


@pytest.mark.parametrize("mode", ["recurrent", "auto"])
@pytest.mark.parametrize("T", [1, 37])
def test_gated_delta_rule_matches_equation(mode, T):
    inputs = {n: x.detach() for n, x in make_inputs("gated", 2, 3, T, 8, 12, torch.float64, seed=T).items()}
    o, final = run("gated", inputs, mode=mode)
    o_ref, final_ref = gated_equation_loop(*positional("gated", inputs), inputs["initial_state"])
    assert o.dtype == final.dtype == torch.float64
    assert rel_err(o, o_ref) < TOL[torch.float64] and rel_err(final, final_ref) < TOL[torch.float64]


@pytest.mark.parametrize("mode", ["recurrent", "chunk"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_gated_delta_rule_with_zero_gate_is_the_delta_rule(dtype, mode):
    """g = 0 (no decay): the same outputs, final state and gradients as delta_rule; to the bit in the step loop
    (the same operations, times exp(0) = 1), to rounding chunkwise (another kernel)."""
    inputs = make_inputs("gated", 2, 2, 30, 16, 8, dtype, seed=4)
    inputs["g"] = torch.zeros_like(inputs["g"], requires_grad=True)
    gated = outputs_and_grads("gated", inputs, mode=mode, chunk_size=8)
    delta = outputs_and_grads("delta", {n: x for n, x in inputs.items() if n != "g"}, mode=mode, chunk_size=8)
    assert gated.pop("dg").abs().sum() > 0  # the decay's gradient is there (a real input of the rule)
    if mode == "chunk":
        assert_close(gated, delta, TOL[dtype])
        return
    assert gated.keys() == delta.keys()
    for name in delta:
        assert torch.equal(gated[name], delta[name]), name


# log-decays per step of each chunk of 32 (cycled): spans of their cumulative sums over a chunk of 3.2 to 320
STRONG_DECAYS = {"near_the_span": [-2.4], "wide": [-3.0], "alternating": [-0.1, -10.0]}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("decays", list(STRONG_DECAYS))
def test_gated_cpp_kernel_with_strong_decays(dtype, decays):
    """The C++ kernel forms a chunk's decays D_ij = exp(gamma_i - gamma_j) from 2c exponentials where the chunk's
    cumulative log-decays span at most 80, from one per entry where they span more (csrc/chunk_delta.cpp, Decays):
    log-decays of -2.4 per step (a span of 74 over a chunk of 32: the factored form at its widest), of -3 (93: every
    chunk the other way), and chunks that alternate between -0.1 and -10 per step (the ragged last chunk of 4 spans
    30; exp(gamma_i - m) alone would overflow there). Outputs, final state and every gradient against the float64 step loop."""
    _cpp_kernel_or_skip()
    B, H, T, Dk, Dv, C = 1, 2, 100, 16, 12, 32
    inputs = {n: x.detach().double() for n, x in make_inputs("gated", B, H, T, Dk, Dv, torch.float64, seed=6).items()}
    per_chunk = STRONG_DECAYS[decays]
    steps = torch.tensor([per_chunk[(t // C) % len(per_chunk)] for t in range(T)], dtype=torch.float64)
    noise = torch.rand(B, H, T, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    inputs["g"] = steps * (0.9 + 0.2 * noise)
    inputs = {n: x.to(dtype).requires_grad_() for n, x in inputs.items()}
    got = outputs_and_grads("gated", inputs, mode="chunk", chunk_size=C)
    assert_close(got, reference("gated", inputs), TOL[dtype])


@pytest.mark.parametrize("g_dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("B,H,T,Dk,Dv,chunk_size", [(2, 3, 100, 32, 48, 32), (1, 2, 53, 17, 19, 16),
                                                    (1, 1, 150, 17, 40, 16)])
def test_gated_bfloat16_widens_and_rounds(g_dtype, threads, B, H, T, Dk, Dv, chunk_size, monkeypatch):
    """The C++ gated kernel takes bfloat16 q, k, v, beta (and dout) as they are, with g in bfloat16 or in float32 (as a
    bfloat16 model computes its log-decays: GatedDeltaNetLayer.log_decay), and writes bfloat16 o and gradients, dg in
    g's dtype: exactly its forward and backward of the widened inputs, each output rounded once, with every product
    kind (ragged last chunks, odd Dk and Dv; B*H = 1 at 2 threads: value blocks); the public function hands them as
    they are (no float32 copies), returns bfloat16, and stays within the bfloat16 bound of the float64 step loop with
    the products it picks (bfloat16 factors where the build has AVX-512 BF16)."""
    from fwp_kernels import chunk

    _cpp_kernel_or_skip()
    inputs = make_inputs("gated", B, H, T, Dk, Dv, torch.bfloat16, seed=T)
    inputs["g"] = inputs["g"].detach().to(g_dtype).requires_grad_()
    flat = [x.detach().reshape(B * H, T, -1).squeeze(-1) for x in positional("gated", inputs)]  # q, k, v, beta, g
    s0 = inputs["initial_state"].detach().float().reshape(B * H, Dv, Dk)
    do = torch.randn(B * H, T, Dv, generator=torch.Generator().manual_seed(1)).bfloat16()
    d_final = torch.randn(B * H, Dv, Dk, generator=torch.Generator().manual_seed(2))
    ops = chunk._CPU_KERNEL.ops

    def forward_and_backward(dtype, products):
        x = [t.to(dtype) for t in flat[:4]] + [flat[4].to(torch.promote_types(dtype, g_dtype))]
        S, o = s0.clone(), torch.empty_like(x[2])
        dS, grads = d_final.clone(), [torch.empty_like(t) for t in x]
        _with_threads(threads, lambda: ops.gated_forward(*x, S, chunk_size, o, products))
        _with_threads(threads, lambda: ops.gated_backward(*x, s0, chunk_size, do.to(dtype), dS, *grads, products))
        return [o, S, dS, *grads]

    bf16, f32 = torch.bfloat16, torch.float32
    for products in sorted(chunk.cpu_product_kinds()):
        got, widened = forward_and_backward(bf16, products), forward_and_backward(f32, products)
        for a, b in zip(got, widened):
            assert torch.equal(a, b.to(a.dtype)), products
        assert [t.dtype for t in got] == [bf16] + [f32] * 2 + [bf16] * 4 + [g_dtype]
    calls = [_spy_op_dtypes(monkeypatch, op) for op in ("gated_forward", "gated_backward")]
    chosen = _spy_products(monkeypatch)
    got = _with_threads(threads, lambda: outputs_and_grads("gated", inputs, mode="chunk", chunk_size=chunk_size))
    assert_close(got, reference("gated", inputs), TOL[bf16])
    assert got["o"].dtype == bf16 and got["dg"].dtype == g_dtype
    assert calls[0] == [[bf16] * 4 + [g_dtype, f32, bf16]]  # q, k, v, beta, g, S, o
    assert calls[1] == [[bf16] * 4 + [g_dtype, f32, bf16, f32] + [bf16] * 4 + [g_dtype]]  # ..., s0, dout, dS, grads
    if chunk.cpu_bfloat16_products() is not None:
        assert set(chosen) == {chunk.cpu_bfloat16_products()}


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("T", [1, 40])
def test_bfloat16_inputs_with_a_float64_state(rule, T):
    """bfloat16 inputs with a float64 initial state run in float64 on the C++ kernels (the chunk loops, T = 40, and the
    decode step, T = 1; their bfloat16 path keeps a float32 state and refused the float64 one): o in bfloat16, the
    final state in float64, within the bfloat16 bound of the float64 step loop, gradients included."""
    _cpp_kernel_or_skip()
    inputs = make_inputs(rule, 1, 2, T, 16, 16, torch.bfloat16, seed=T)
    inputs["initial_state"] = inputs["initial_state"].detach().double().requires_grad_()
    if rule == "gated":  # as a bfloat16 model computes it: float32
        inputs["g"] = inputs["g"].detach().float().requires_grad_()
    got = outputs_and_grads(rule, inputs, mode="chunk", chunk_size=16)
    assert got["o"].dtype == torch.bfloat16 and got["final_state"].dtype == torch.float64
    assert_close(got, reference(rule, inputs), TOL[torch.bfloat16])


@pytest.mark.parametrize("qk_l2norm", [False, True])
@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_gated_delta_rule_matches_transformers(mode, qk_l2norm):
    """transformers' own torch path (Qwen3-Next's torch_chunk_gated_delta_rule, float32) gives our outputs and final
    state to 1e-5 once its conventions are converted: [B, T, H, D] layout, q and k L2-normalised inside (optional,
    eps 1e-6 under the root), q scaled by Dk^-1/2 inside, value heads grouped over query/key heads (repeat_interleave),
    state [B, H, Dk, Dv] (ours: [B, H, Dv, Dk])."""
    qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    B, T, Hk, Hv, Dk, Dv = 2, 100, 2, 4, 32, 24  # T: no multiple of its chunk of 64
    gen = torch.Generator().manual_seed(7)
    randn = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    q, k = randn(B, T, Hk, Dk), randn(B, T, Hk, Dk)
    if not qk_l2norm:  # the caller normalises (a bounded recurrence)
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    v, beta, g = randn(B, T, Hv, Dv), torch.sigmoid(randn(B, T, Hv)), F.logsigmoid(randn(B, T, Hv) + 2)
    state = 0.1 * randn(B, Hv, Dk, Dv)
    o_ref, final_ref = qwen3_next.torch_chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=qk_l2norm
    )
    if qk_l2norm:
        q, k = (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
    heads = lambda x: x.repeat_interleave(Hv // Hk, dim=2).transpose(1, 2)  # noqa: E731  [B, Hv, T, D]
    o, final = gated_delta_rule(
        heads(q) * Dk**-0.5, heads(k), v.transpose(1, 2), beta.transpose(1, 2), g.transpose(1, 2),
        initial_state=state.mT, output_final_state=True, mode=mode, chunk_size=32,
    )
    assert rel_err(o.transpose(1, 2), o_ref) < 1e-5
    assert rel_err(final.mT, final_ref) < 1e-5


# ---------------------------------------------------------------------------------------------------
# Padding: `mask` [B, T], 0 at padded positions, which write nothing


def _padding(B, T):
    keep = torch.ones(B, T, dtype=torch.bool)
    keep[0, :5] = False  # a left-padded row
    keep[1, 10:13] = False  # a hole
    return keep


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("mode", ["recurrent", "chunk", "auto"])
def test_mask_equals_step_loop_without_the_padded_positions(rule, mode):
    """Outputs at the tokens, the final state and every gradient equal those of the float64 step loop run on each
    row with its padded positions removed (the outputs at padded positions are of no use: they get no gradient; the
    gated rule's state does not decay there either)."""
    B, H, T, Dk, Dv = 2, 2, 23, 16, 8
    inputs = make_inputs(rule, B, H, T, Dk, Dv, torch.float64, seed=9)
    keep = _padding(B, T)
    g = torch.Generator().manual_seed(1)
    go = torch.randn(B, H, T, Dv, generator=g, dtype=torch.float64) * keep[:, None, :, None]
    gf = torch.randn(B, H, Dv, Dk, generator=g, dtype=torch.float64)
    names = [n for n, x in inputs.items() if x is not None]

    def loss_and_grads(xs, mask, go, gf, **kwargs):
        o, final = run(rule, xs, mask=mask, **kwargs)
        grads = torch.autograd.grad((o * go).sum() + (final * gf).sum(), [xs[n] for n in names])
        return o, final, dict(zip(names, grads))

    o, final, grads = loss_and_grads(inputs, keep.long(), go, gf, mode=mode, chunk_size=8)
    for b in range(B):
        t = keep[b].nonzero()[:, 0]
        row = {n: None if x is None else (x[b:b + 1] if n == "initial_state" else x[b:b + 1, :, t]).detach()
               for n, x in inputs.items()}
        row = {n: None if x is None else x.requires_grad_() for n, x in row.items()}
        o_ref, final_ref, grads_ref = loss_and_grads(row, None, go[b:b + 1, :, t], gf[b:b + 1], mode="recurrent")
        assert rel_err(o[b:b + 1, :, t], o_ref) < TOL[torch.float64]
        assert rel_err(final[b:b + 1], final_ref) < TOL[torch.float64]
        for n in names:
            got = grads[n][b:b + 1] if n == "initial_state" else grads[n][b:b + 1, :, t]
            assert rel_err(got, grads_ref[n]) < TOL[torch.float64], n
            if n != "initial_state":  # padded positions take no part
                assert not grads[n][b, :, ~keep[b]].any(), n


@pytest.mark.parametrize("rule", RULES)
def test_mask_bad_shape_raises_value_error_naming_mask(rule):
    inputs = make_inputs(rule, 1, 2, 5, 8, 4, torch.float32)
    with pytest.raises(ValueError, match="`mask`"):
        run(rule, inputs, mask=torch.ones(1, 6))


# ---------------------------------------------------------------------------------------------------
# One mode vocabulary and one dispatcher for every recurrence


def _recurrence_args(name, T=6, D=4):
    """Small float64 positional arguments of the public function `name`."""
    g = torch.Generator().manual_seed(0)
    r = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    if name == "fast_rnn_scan":
        return (r(1, 2, 1, T, D), torch.softmax(r(1, 2, 1, T, D), -1), r(1, 2, 1, T, D), torch.rand(1, 2, 1, T))
    q, k, v = F.normalize(r(1, 2, T, D), dim=-1), F.normalize(r(1, 2, T, D), dim=-1), r(1, 2, T, D)
    beta = torch.sigmoid(r(1, 2, T))
    return {
        "linear_attention": (q, k, v),
        "delta_rule": (q, k, v, beta),
        "gated_delta_rule": (q, k, v, beta, F.logsigmoid(r(1, 2, T))),
        "recurrent_delta_rule": (q, k, v, beta, 0.5 * r(2, D, D), 0.5 * r(2, D, D), 0.5 * r(2, D, D), r(2, D)),
    }[name]


def test_every_recurrence_is_registered():
    assert set(RECURRENCES) == {
        "delta_rule", "linear_attention", "gated_delta_rule", "fast_rnn_scan", "recurrent_delta_rule"
    }


@pytest.mark.parametrize("name", sorted(RECURRENCES))
def test_mode_vocabulary(name):
    """Every recurrence is registered with the dispatcher, takes its modes from `MODES` ("auto" and "recurrent", the
    step loop, everywhere), agrees with its step loop in each mode it has, and raises a ValueError naming `mode` for
    the others."""
    import fwp_kernels

    recurrence, fn = RECURRENCES[name], getattr(fwp_kernels, name)
    assert {"auto", "recurrent"} <= set(recurrence.modes) <= set(fwp_kernels.MODES)
    assert select_kernel(recurrence, "recurrent", 6, torch.device("cpu")) is recurrence.reference
    args = _recurrence_args(name)
    ref, _ = fn(*args, mode="recurrent")
    for mode in fwp_kernels.MODES + ("parallel",):
        if mode not in recurrence.modes:
            with pytest.raises(ValueError, match=f"`mode` must be one of .* for {name}"):
                fn(*args, mode=mode)
            continue
        try:
            got, _ = fn(*args, mode=mode)
        except NotImplementedError:  # "fused" where the C++ scans could not be built
            assert mode == "fused"
            continue
        assert rel_err(got, ref) < TOL[torch.float64], mode


# ---------------------------------------------------------------------------------------------------
# Bad input


def _bad_inputs():
    q = torch.randn(1, 2, 5, 8)
    v = torch.randn(1, 2, 5, 4)
    beta = torch.rand(1, 2, 5)
    ok = dict(q=q, k=q, v=v, beta=beta, g=-beta)
    return [
        ("q", dict(ok, q=torch.randn(2, 5, 8))),
        ("q", dict(ok, q=[[1.0]])),
        ("k", dict(ok, k=torch.randn(1, 2, 5, 7))),
        ("v", dict(ok, v=torch.randn(1, 2, 6, 4))),
        ("beta", dict(ok, beta=torch.rand(1, 2, 6))),
        ("g", dict(ok, g=torch.rand(1, 2, 5, 1))),
        ("g", dict(ok, g=None)),
        ("initial_state", dict(ok, initial_state=torch.zeros(1, 2, 8, 4))),
        ("mode", dict(ok, mode="parallel")),
        ("chunk_size", dict(ok, chunk_size=0)),
        ("chunk_size", dict(ok, chunk_size=16.0)),
    ]


@pytest.mark.parametrize("name,kwargs", _bad_inputs())
@pytest.mark.parametrize("rule", RULES)
def test_bad_input_raises_value_error_naming_argument(rule, name, kwargs):
    if name in ("beta", "g") and name not in GATES[rule]:
        pytest.skip(f"the {rule} rule has no {name}")
    kwargs = dict(kwargs)
    args = [kwargs.pop(n) for n in ("q", "k", "v")] + [kwargs.get(n) for n in GATES[rule]]
    kwargs = {n: x for n, x in kwargs.items() if n not in ("beta", "g")}
    with pytest.raises(ValueError, match=f"`{name}`"):
        RULE_FUNCTIONS[rule](*args, **kwargs)


# ---------------------------------------------------------------------------------------------------
# Triton forward (backward: the PyTorch one), under the interpreter on CPU at small shapes.
# Triton reads TRITON_INTERPRET when it is imported, and other packages (transformers) may import it
# first, so the interpreted runs happen in one subprocess that sets the variable before any import.

TRITON_CASES = [
    (rule, T, chunk_size, Dk, Dv, dtype)
    for rule in ("delta", "sum")
    for T, chunk_size, Dk, Dv, dtype in [(45, 16, 24, 48, "float32"), (40, 32, 32, 72, "bfloat16")]
] + [("gated", 45, 16, 24, 48, "float32"), ("gated", 20, 16, 16, 16, "bfloat16")]


def cuda_chunk_kernels(rule: str):
    """The dispatcher's mode "chunk" on CUDA for `rule` (a ``chunk.CudaChunkKernel``: its ``triton_kernel`` and
    ``torch_kernel``), chosen by the device type alone: no GPU needed, triton must import."""
    from fwp_kernels.dispatch import RECURRENCES, select_kernel

    return select_kernel(RECURRENCES[RECURRENCE[rule]], "chunk", 2, torch.device("cuda"))


def _triton_errors(cases, device="cpu"):
    """{case id: {tensor name: relative error}} for the Triton forward (+ PyTorch backward)."""
    errors = {}
    for rule, T, chunk_size, Dk, Dv, dtype in cases:
        inputs, ref = case(rule, 1, 2, T, Dk, Dv, getattr(torch, dtype), seed=T)
        inputs = {n: None if x is None else x.detach().to(device).requires_grad_() for n, x in inputs.items()}
        o, final = cuda_chunk_kernels(rule).triton_kernel(*positional(rule, inputs), inputs["initial_state"], True,
                                                          chunk_size)
        assert o.dtype == getattr(torch, dtype) and final.dtype == torch.float32
        g = torch.Generator().manual_seed(1)
        go = torch.randn(o.shape, generator=g, dtype=torch.float64).to(o)
        gf = torch.randn(final.shape, generator=g, dtype=torch.float64).to(final)
        names = [n for n, x in inputs.items() if x is not None]
        grads = torch.autograd.grad((o * go).float().sum() + (final * gf).float().sum(), [inputs[n] for n in names])
        got = {"o": o, "final_state": final, **{f"d{n}": gr for n, gr in zip(names, grads)}}
        errors["-".join(map(str, (rule, T, chunk_size, Dk, Dv, dtype)))] = {
            n: rel_err(got[n].cpu(), ref[n]) for n in ref
        }
    return errors


@pytest.fixture(scope="module")
def triton_interpreted_errors():
    return triton_interpreted_results(__file__)


@pytest.mark.triton
@pytest.mark.parametrize("case", TRITON_CASES, ids=lambda c: "-".join(map(str, c)))
def test_triton_forward_matches_step_loop(triton_interpreted_errors, case):
    errors = triton_interpreted_errors["-".join(map(str, case))]
    assert max(errors.values()) < TOL[getattr(torch, case[-1])], errors


@pytest.mark.triton
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("rule", RULES)
def test_triton_compiled_on_cuda(rule, dtype):
    """One test per rule and dtype, so that pytest-xdist spreads Triton's compiles (CPU-bound, 10 to 40 s each on the
    lent H100) over its processes: as one test, its compiles outran 330 s there (GPU run 6)."""
    pytest.importorskip("triton", reason="triton is not installed: the CUDA kernels need it")
    cases = [(rule, T, 64, 64, 64, dtype) for T in (1, 100, 1000)]
    for case, errors in _triton_errors(cases, device="cuda").items():
        assert max(errors.values()) < CUDA_TOL[getattr(torch, case.split("-")[-1])], (case, errors)


def test_triton_launch_falls_back_to_fewer_pipelining_stages(monkeypatch):
    """A kernel whose buffers exceed the device's shared memory at Triton's default depth (the delta rule's scan at
    head size 128 on an H100) launches with fewer stages; the depth found is kept; none fitting raises, at once the
    second time."""
    pytest.importorskip("triton", reason="the launcher is part of the Triton kernels")
    import triton.language as tl
    from triton.runtime.errors import OutOfResources

    from fwp_kernels import triton_chunk

    def body(x_ptr, T, K: tl.constexpr):
        pass

    class FakeKernel:
        fn = staticmethod(body)  # as triton.jit keeps the function: not bound to the instance

        def __init__(self, fits):
            self.fits, self.tried = fits, []

        def __getitem__(self, grid):
            def run(*args, num_stages=None):
                self.tried.append(num_stages)
                if not self.fits(num_stages):
                    raise OutOfResources(262144, 232448, "shared memory")
            return run

    x = torch.zeros(3)
    monkeypatch.setattr(triton_chunk, "_LAUNCH_STAGES", {})
    kernel = FakeKernel(lambda stages: stages is not None and stages <= 2)
    for T in (5, 7):  # T is no constexpr: the depth found for K = 128 holds for every T
        triton_chunk.launch(kernel, (1,), x, T, 128)
    assert kernel.tried == [None, 2, 2]
    monkeypatch.setattr(triton_chunk, "_LAUNCH_STAGES", {})
    monkeypatch.setattr(triton_chunk, "_FITS_AT_NO_DEPTH", {})
    never = FakeKernel(lambda stages: False)
    for _ in range(2):  # the second call raises without trying the depths again
        with pytest.raises(OutOfResources):
            triton_chunk.launch(never, (1,), x, 5, 128)
    assert never.tried == list(triton_chunk.STAGE_FALLBACK)


@pytest.mark.parametrize("rule", RULES)
def test_triton_kernel_that_fits_at_no_depth_runs_the_pytorch_kernel(rule, monkeypatch):
    """Where no pipelining depth fits the GPU's shared memory (head size 256 on a 99 KB GPU), the PyTorch chunk kernel
    runs instead, with a warning, and gives its result."""
    pytest.importorskip("triton", reason="the fallback is part of the Triton kernels")
    from triton.runtime.errors import OutOfResources

    from fwp_kernels import triton_chunk, triton_gated_chunk

    def too_big(*args):
        raise OutOfResources(262144, 101376, "shared memory")

    for function in (triton_chunk.TritonChunkFastWeightFunction, triton_gated_chunk.TritonGatedChunkFunction):
        monkeypatch.setattr(function, "apply", too_big)
    monkeypatch.setattr(triton_chunk, "_WARNED_TORCH_FALLBACK", set())
    kernels = cuda_chunk_kernels(rule)
    inputs = make_inputs(rule, 1, 2, 20, 8, 8)
    args = positional(rule, inputs) + [inputs["initial_state"], True, 8]
    with pytest.warns(RuntimeWarning, match="does not fit"):
        got = kernels.triton_kernel(*args)
    expected = kernels.torch_kernel(*args)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


@pytest.mark.parametrize("rule", RULES)
def test_chunk_mode_on_cuda_runs_triton_below_head_width_64_and_pytorch_from_it(rule):
    """Mode "chunk" on CUDA (chosen without a GPU: the device type decides): the Triton kernel for heads narrower than
    ``chunk.CUDA_TORCH_CHUNK_MIN_WIDTH`` (64), the PyTorch chunk kernel from there, by max(Dk, Dv), whose result
    the call returns (the H100's timings in kernels/chunk.py)."""
    pytest.importorskip("triton", reason="without triton, CUDA runs the PyTorch kernels at every width")
    from fwp_kernels.chunk import CUDA_TORCH_CHUNK_MIN_WIDTH, CudaChunkKernel

    kernel = cuda_chunk_kernels(rule)
    assert isinstance(kernel, CudaChunkKernel) and CUDA_TORCH_CHUNK_MIN_WIDTH == 64
    assert kernel.torch_kernel.__module__ == f"fwp_kernels.{RECURRENCE[rule]}_kernels"
    assert kernel.triton_kernel.__module__.startswith("fwp_kernels.triton_")
    calls = []
    spy = CudaChunkKernel(lambda *a: calls.append("triton"), lambda *a: calls.append("torch") or "result")
    for Dk, Dv in ((32, 32), (63, 16), (64, 32), (16, 64), (128, 256)):
        inputs = make_inputs(rule, 1, 1, 3, Dk, Dv)
        result = spy(*positional(rule, inputs), None, False, 64)
        assert calls[-1] == ("torch" if max(Dk, Dv) >= 64 else "triton"), (Dk, Dv)
        assert result == ("result" if calls[-1] == "torch" else None)


def test_package_imports_without_triton():
    """The Triton module is optional and loaded lazily, for CUDA tensors only."""
    import subprocess

    code = (
        "import sys; sys.modules['triton'] = None\n"  # makes `import triton` fail
        "import torch, fwp_kernels\n"
        "from fwp_kernels.dispatch import RECURRENCES, select_kernel\n"
        "kernel = select_kernel(RECURRENCES['delta_rule'], 'chunk', 20, torch.device('cuda'))\n"
        "assert kernel.__module__ == 'fwp_kernels.delta_rule_kernels'\n"
        "kernel = select_kernel(RECURRENCES['gated_delta_rule'], 'chunk', 20, torch.device('cuda'))\n"
        "assert kernel.__module__ == 'fwp_kernels.gated_delta_rule_kernels'\n"
        "o, _ = fwp_kernels.delta_rule(*[torch.rand(1, 1, 20, 4)] * 3, torch.rand(1, 1, 20))\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


if __name__ == "__main__" and sys.argv[1:] == ["--triton-worker"]:
    import json

    print(json.dumps(_triton_errors(TRITON_CASES)))
