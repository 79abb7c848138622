"""Vocabulary-sized dense products: ``x W^T + b`` and the input gradient of a softmax cross-entropy output layer.

These are what a Fast Weight Layer adds to a language model (Clark et al. 2022): every position's slow logits over the
whole vocabulary and their gradient back through the output embedding. Both are plain fp32 matrix products, exact in
the input's dtype; two things make them cheap on CPU:

- **oneDNN's matmul.** PyTorch sends fp32 ``F.linear`` to MKL's sgemm, which runs a generic AVX2 code path on CPUs
  that are not Intel's; oneDNN (bundled with PyTorch, ``torch.ops.mkldnn._linear_pointwise``) picks its kernel by the
  instruction sets the CPU reports. Measured here (2-core AMD EPYC with AVX-512, T=4096, D=576, V=49152): 1.2 s with
  MKL, 0.6 s with oneDNN, same fp32 result up to summation order. Used for CPU float32 / bfloat16 tensors outside
  autograd (the op has no backward); ``FWP_KERNELS_NO_ONEDNN=1`` turns it off.
- **One weight read per token.** With one row of input (decoding), the product is bound by reading the weight from
  memory; ``csrc/decode_linear.cpp`` streams it once over all threads (float32 FMA, or bfloat16 dot products, float32
  sums), where F.linear reached about half the read bandwidth here in float32 and less in bfloat16
  (``benchmarks/bench_cpu.py``, "linear_rows": measured side by side).
- **Row blocks.** Outside autograd ``linear_cross_entropy_input_gradient`` runs over blocks of rows whose logits fit in
  the cache (about 30 MB), so no ``[N, V]`` tensor is allocated (page faults on 800 MB cost 0.2-0.3 s here) and the
  softmax passes stay in cache.
"""
from __future__ import annotations

import contextlib
import os
from typing import Callable, Iterator, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from .cpp_build import KERNEL_CFLAGS, register_cpu_kernel, widest_avx2_flags

# Bytes of logits per row block of `linear_cross_entropy_input_gradient` outside autograd: under glibc's largest mmap
# threshold (32 MB), so that every block reuses heap memory instead of faulting in fresh pages (128 rows of SmolLM2's
# 49,152-token vocabulary in fp32; measured fastest here among 32 to 512 rows).
BLOCK_BYTES = 30 << 20


def onednn_linear_available() -> bool:
    """Whether ``dense_linear`` can run oneDNN's matmul (PyTorch built with it, not disabled by the environment)."""
    return (
        os.environ.get("FWP_KERNELS_NO_ONEDNN", "") in ("", "0")
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


_ONEDNN = onednn_linear_available()
# oneDNN's bfloat16 matmul needs AVX-512 (or AMX); on an AVX2-only CPU it raises ("could not create a primitive
# descriptor"), where F.linear computes the same product in its own kernels.
_ONEDNN_BF16 = _ONEDNN and getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)()
# BF16_WIDEN_NOTE. Without oneDNN's bfloat16 matmul (an AVX2-only CPU), F.linear multiplies bfloat16 in its own
# kernels at 7 to 10 GFLOP/s on this 2-core AMD EPYC (1 thread, 2048 x 2048 weight, 16 to 512 rows), where widening x
# and W to float32 for the float32 matmul and rounding the output once took 5 / 17 / 77 ms against 13 / 109 / 637 ms
# (16 / 128 / 512 rows; by hand at load 2: a rough guide). On a quiet machine, the whole 1.3B Delta Net's bfloat16
# prefill ran 3.6x / 3.0x F.linear's at 1 / 2 threads (benchmarks/bench_decode.py, bench_decode_avx2_bf16.json). The
# result is F.linear's up to summation order: bfloat16 products are exact in float32, and both accumulate in float32.
# One or two rows stream the bfloat16 weight instead.

try:  # inside a saved model folder the C++ source travels as a string (transformers copies only Python modules)
    from .decode_linear_csrc import CPP_SOURCE as _EMBEDDED_SOURCE
except ImportError:  # the installed package: the source is csrc/decode_linear.cpp
    _EMBEDDED_SOURCE = None
# The streaming kernel's flags: every kernel's, in 256-bit vectors on an AVX2-only CPU. Side by side in one process
# (2026-12-07, AMD EPYC family 23 model 1 (Zen 1, whose GCC tuning vectorises in 128 bits), 180 MB of weights,
# medians of 11 rounds; benchmarks/results/bench_stream_builds_zen1_vector_width.json): 1.12-1.18x faster in float32
# and 1.09-1.40x in bfloat16, one and two rows, 1 and 2 threads. (The recurrent FWPs' scans, D = 16, were 0.97-1.0x
# with it: csrc/rfwp_scan.cpp keeps every kernel's flags.)
DECODE_LINEAR_CFLAGS = KERNEL_CFLAGS + widest_avx2_flags()
_CPU_KERNEL = register_cpu_kernel(
    "decode_linear", _EMBEDDED_SOURCE, "fwp_dense", "linear_rows", DECODE_LINEAR_CFLAGS, "oneDNN's or torch's matmul",
)
# Rows of input up to which the weight-streaming kernel runs (decoding one or two sequences, assisted decoding's
# one-token drafts); above, oneDNN's matmul, which reuses each weight block over the rows. Measured side by side
# (benchmarks/bench_cpu.py "linear_rows", 2026-11-26, GB/s of weights at 1 / 2 threads, 8 weights of 5632 x 2048):
# 1 row float32 21.5 / 43.6 (oneDNN 19.0 / 38.6, F.linear 17.3 / 18.3), bfloat16 24.9 / 44.3 (oneDNN 10.4 / 15.6);
# 2 rows float32 14.1 / 28.7 (oneDNN 13.3 / 23.6), bfloat16 23.8 / 43.2 (oneDNN 12.4 / 20.1). Whole-model effect at
# two rows: benchmarks/bench_decode.py --batch_size 2 (bench_decode_batch2.json; was 1 until then).
STREAMING_MAX_ROWS = 2


def onednn_matmul_supports(dtype: torch.dtype) -> bool:
    """Whether ``dense_linear`` hands products of `dtype` (float32 or bfloat16) to oneDNN's matmul: where PyTorch has
    oneDNN, and for bfloat16 only where the CPU has a bfloat16 matmul (AVX-512 or AMX)."""
    return _ONEDNN and (dtype != torch.bfloat16 or _ONEDNN_BF16)


def _cpu_inference(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> bool:
    """Whether ``x W^T + b`` may leave F.linear: CPU float32 / bfloat16 in one dtype, outside autograd and autocast
    (which casts F.linear's inputs)."""
    if not x.is_cpu or x.dtype not in (torch.float32, torch.bfloat16) or x.numel() == 0:
        return False
    if weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        return False
    if torch.is_autocast_enabled("cpu"):
        return False
    return not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                             or (bias is not None and bias.requires_grad)))


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """oneDNN's ``x [M, K] W [N, K]^T + b`` -> ``[M, N]`` (``mkldnn._linear_pointwise``)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _define_onednn_linear() -> Callable:
    """``_onednn_linear`` as an op of its own, ``fwp_kernels::onednn_linear``, for traced graphs (``dense_linear``
    calls it under ``torch.compile``): inductor lowers oneDNN's linear only for frozen weights (it raised otherwise),
    and its own lowering of F.linear runs MKL's AVX2 sgemm on AMD CPUs (a float32 prefill 2x slower). Eager code calls
    oneDNN's op directly: eager prefills through this op crashed the process now and then (segmentation faults inside
    the op's call in 1-4 of 20 fresh processes at times on 2026-11-29, torch 2.13; none in the same hour with the
    direct call; the cause is not pinned down). Defined once per process, should this file run twice (a reload, or
    the package's folder imported under a second name where ``fwp_kernels`` is not installed: ``__init__.py``): a
    second ``custom_op`` of the name would replace the first's registration."""
    if not hasattr(torch.ops.fwp_kernels, "onednn_linear"):
        op = torch.library.custom_op("fwp_kernels::onednn_linear", _onednn_linear, mutates_args=())
        op.register_fake(lambda x, weight, bias: x.new_empty(x.shape[0], weight.shape[0]))
    return torch.ops.fwp_kernels.onednn_linear.default


onednn_linear = _define_onednn_linear()


def _streams(rows: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a product that may leave F.linear (``_cpu_inference``) of ``rows [M, K]`` streams `weight` through
    ``linear_rows``: up to ``STREAMING_MAX_ROWS`` rows, a contiguous weight, the C++ kernel built."""
    return rows.shape[0] <= STREAMING_MAX_ROWS and weight.is_contiguous() and _CPU_KERNEL.available()


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x [*, K] @ weight [N, K]^T + bias [N]`` -> ``[*, N]``, as ``F.linear``. On CPU for float32 / bfloat16 outside
    autograd: up to ``STREAMING_MAX_ROWS`` rows of input (decoding) stream the weight (``csrc/decode_linear.cpp``),
    more rows go through oneDNN's matmul (``weight`` may be a transposed view, e.g. ``E.t()`` for ``P @ E``), bfloat16
    through the float32 one where the CPU has no bfloat16 matmul; F.linear otherwise. The same product up to summation
    order (float32 accumulation in every path); ``torch.compile`` keeps these kernels as they are."""
    if not _cpu_inference(x, weight, bias):
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])
    if _streams(rows, weight):
        out = rows.new_empty(rows.shape[0], weight.shape[0])
        _CPU_KERNEL.ops.linear_rows(rows.contiguous(), weight, None if bias is None else bias.contiguous(), out)
    elif onednn_matmul_supports(x.dtype):
        linear = onednn_linear if torch.compiler.is_compiling() else _onednn_linear
        out = linear(rows.contiguous(), weight, bias)
    elif x.dtype == torch.bfloat16:  # widened: the CPU has no bfloat16 matmul (BF16_WIDEN_NOTE)
        widened_bias = None if bias is None else bias.float()
        out = dense_linear(rows.float(), weight.float(), widened_bias).to(torch.bfloat16)
    else:
        return F.linear(x, weight, bias)
    return out.view(*x.shape[:-1], weight.shape[0])


_CPU_OPS_DTYPES = (torch.float32, torch.bfloat16, torch.float64)


def cpu_ops_apply(*tensors: Optional[torch.Tensor]) -> bool:
    """Whether ``short_conv_step`` and ``normalize_rows`` may run on `tensors` (the first a tensor; None entries
    skipped): the C++ kernel is built, they are CPU tensors of one dtype (float32, bfloat16 or float64), outside
    autograd and autocast (the ops have no backward). ``torch.compile`` traces them as they are: ops that only write
    their ``out`` arguments get torch's generated fake kernel, and a compiled decode step calls them without Python
    between them."""
    dtype = tensors[0].dtype
    if dtype not in _CPU_OPS_DTYPES or torch.is_autocast_enabled("cpu"):
        return False
    tracked = torch.is_grad_enabled()
    for t in tensors:  # a plain loop: this runs several times per layer and token (1.1 vs 2.5 us with any())
        if t is not None and (not t.is_cpu or t.dtype != dtype or (tracked and t.requires_grad)):
            return False
    return _CPU_KERNEL.available()


def short_conv_step(
    x: torch.Tensor, cache: torch.Tensor, weight: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """One position of a depthwise causal convolution (``csrc/decode_linear.cpp``), where ``cpu_ops_apply``:
    ``y[b, c] = sum_i weight[c, i] [cache[b, c, :], x[b, c]]_i`` in float32 (float64 for float64).

    Args:
        x: ``[B, C]``; cache: ``[B, C, K - 1]``, the K - 1 inputs before x; weight: ``[C, K]``.
    Returns:
        ``(y [B, C], new_cache [B, C, K - 1])``: the cache's last K - 2 inputs, then x.
    """
    cache = cache.contiguous()
    y, new_cache = torch.empty_like(x), torch.empty_like(cache)
    _CPU_KERNEL.ops.short_conv_step(x.contiguous(), cache, weight.contiguous(), y, new_cache)
    return y, new_cache


def short_conv(x: torch.Tensor, cache: torch.Tensor, weight: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """A depthwise causal convolution over T positions, channels last (``csrc/decode_linear.cpp``), where
    ``cpu_ops_apply``: ``y[b, t, c] = sum_i weight[c, i] [cache[b, c, :], x[b, :, c]]_{t + i}`` in float32 (float64
    for float64), the sums as ``short_conv_step``'s.

    Args:
        x: ``[B, T, C]``; cache: ``[B, C, K - 1]``, the K - 1 inputs before x; weight: ``[C, K]``.
    Returns:
        ``(y [B, T, C], new_cache [B, C, K - 1])``: the last K - 1 inputs of ``[cache, x]``.
    """
    x, cache = x.contiguous(), cache.contiguous()
    y, new_cache = torch.empty_like(x), torch.empty_like(cache)
    _CPU_KERNEL.ops.short_conv(x, cache, weight.contiguous(), y, new_cache)
    return y, new_cache


def normalize_rows(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float, mean_square: bool) -> torch.Tensor:
    """Each row of ``x [*, D]`` over its last dimension in one pass (``csrc/decode_linear.cpp``), where
    ``cpu_ops_apply``: ``x / sqrt(mean(x^2) + eps) * weight`` (`mean_square`: RMSNorm, weight ``[D]``) or ``x /
    sqrt(sum(x^2) + eps)`` (L2; weight None), computed in float32 (float64 too, as ``x.float()`` would) -> ``[*, D]`` in
    x's dtype."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty_like(rows)
    _CPU_KERNEL.ops.normalize_rows(rows, weight, float(eps), mean_square, out)
    return out.view(x.shape)


# Hidden states of at least this many bytes make a model's CPU forward reuse its large buffers (reusing_cpu_buffers):
# 128 positions of a 2,048-wide float32 model. Below, its tensors are small and malloc's heap reuses them anyway.
REUSE_BUFFERS_MIN_BYTES = 1 << 20
_REUSE_BUFFERS = os.environ.get("FWP_KERNELS_NO_BUFFER_REUSE", "") in ("", "0")


@contextlib.contextmanager
def reusing_cpu_buffers(hidden_states: torch.Tensor) -> Iterator[None]:
    """Within, freed CPU tensors of 1 MB or more are kept and handed to the next request of their size
    (``csrc/decode_linear.cpp``, "Large CPU buffers"), where `hidden_states` (``[B, T, D]``) is a CPU tensor of at
    least ``REUSE_BUFFERS_MIN_BYTES``, the C++ kernel is built, no ``torch.compile`` trace is running and
    ``FWP_KERNELS_NO_BUFFER_REUSE`` is unset (or 0); else it does nothing. A model's forward over many positions
    allocates tensors of the same sizes in every layer, and the memory glibc hands back for each is faulted in again
    page by page (about 1 ms per MB here). The blocks kept are freed when the outermost scope ends (nested scopes
    count); values are untouched: only where tensors live changes."""
    if (not hidden_states.is_cpu or hidden_states.numel() * hidden_states.element_size() < REUSE_BUFFERS_MIN_BYTES
            or torch.compiler.is_compiling() or not _REUSE_BUFFERS or not _CPU_KERNEL.available()):
        yield
        return
    _CPU_KERNEL.ops.reuse_buffers_enter()
    try:
        yield
    finally:
        _CPU_KERNEL.ops.reuse_buffers_exit()


def dense_linears(x: torch.Tensor, weights: Sequence[torch.Tensor]) -> Tuple[torch.Tensor, ...]:
    """``tuple(dense_linear(x, w) for w in weights)``, no biases: where the weight-streaming kernel runs (up to
    ``STREAMING_MAX_ROWS`` rows of x, CPU inference, contiguous weights in x's dtype) for bfloat16, one pass over all
    the weights (``linear_rows_grouped``: one call and one wait for the threads, not one per weight; the same sums).
    float32 keeps one call per weight: its grouped pass decoded the 1.3B Delta Net about 3% slower (126 -> 130 ms per
    token at 2 threads, three A/B runs in one process each, by hand, 2026-11-28), where bfloat16 gained 0.2-0.5 ms.

    Args:
        x: ``[*, K]``; weights: ``[N_g, K]`` each.
    Returns:
        ``[*, N_g]`` for each weight (where grouped: views of one ``[*, sum N_g]`` tensor).
    """
    rows = x.reshape(-1, x.shape[-1])
    grouped = x.dtype == torch.bfloat16 and all(_cpu_inference(x, w, None) and _streams(rows, w) for w in weights)
    if not grouped:
        return tuple(dense_linear(x, w) for w in weights)
    sizes = [w.shape[0] for w in weights]
    out = rows.new_empty(rows.shape[0], sum(sizes))
    _CPU_KERNEL.ops.linear_rows_grouped(rows.contiguous(), list(weights), out)
    return out.view(*x.shape[:-1], -1).split(sizes, dim=-1)


def block_ops_apply(x: torch.Tensor, norm_weights: Sequence[torch.Tensor], weights: Sequence[torch.Tensor]) -> bool:
    """Whether ``norm_linears`` and ``swiglu_block`` may stand in for a decode step's unfused ops on ``x [*, D]``:
    outside autograd and autocast, up to ``STREAMING_MAX_ROWS`` rows, CPU tensors of one dtype (float32 or
    bfloat16), `weights` contiguous (as ``dense_linear`` streams them) and the C++ kernel built."""
    dtype = x.dtype
    if (dtype not in (torch.float32, torch.bfloat16) or not x.is_cpu or torch.is_grad_enabled()
            or torch.is_autocast_enabled("cpu") or x.numel() > STREAMING_MAX_ROWS * x.shape[-1]):
        return False
    for w in norm_weights:  # plain loops: this runs once per layer and token
        if w.dtype != dtype or not w.is_cpu:
            return False
    for w in weights:
        if w.dtype != dtype or not w.is_cpu or not w.is_contiguous():
            return False
    return _CPU_KERNEL.available()


def norm_linears(x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                 weights: Sequence[torch.Tensor]) -> Tuple[torch.Tensor, ...]:
    """``dense_linears(normalize_rows(x, norm_weight, eps, mean_square=True), weights)`` in one C++ call, where
    ``block_ops_apply``: a pre-norm block's RMSNorm and its mixing layer's projections in a decode step, the same
    values as the two calls (``csrc/decode_linear.cpp``, ``norm_linear_rows``).

    Args:
        x: ``[M, D]``; norm_weight: ``[D]``; weights: ``[N_g, D]`` each, no biases.
    Returns:
        ``[M, N_g]`` for each weight.
    """
    if x.dim() != 2 or norm_weight.shape != x.shape[1:] or any(w.dim() != 2 or w.shape[1] != x.shape[1]
                                                                for w in weights):
        raise ValueError(f"`x` must be [M, D], `norm_weight` [D] and `weights` [N_g, D], got {tuple(x.shape)}, "
                         f"{tuple(norm_weight.shape)}, {[tuple(w.shape) for w in weights]}")
    outs = [x.new_empty(x.shape[0], w.shape[0]) for w in weights]
    _CPU_KERNEL.ops.norm_linear_rows(x.contiguous(), norm_weight, float(eps), list(weights), outs)
    return tuple(outs)


def swiglu_block(x: torch.Tensor, mixed: torch.Tensor, o_weight: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                 gate_weight: torch.Tensor, up_weight: torch.Tensor, down_weight: torch.Tensor) -> torch.Tensor:
    """A pre-norm block's rest after its mixing layer in one C++ call, where ``block_ops_apply`` (a decode step): ``h =
    x + mixed W_o^T``, then ``h + (SiLU(n W_gate^T) * n W_up^T) W_down^T`` with ``n`` the RMSNorm of ``h`` (SwiGLU,
    Shazeer 2020). The same values as ``dense_linear``, ``normalize_rows`` and torch's add, silu and mul one by one
    (``csrc/decode_linear.cpp``, ``swiglu_block_rows``).

    Args:
        x: ``[M, D]``; mixed: ``[M, Dv]``; o_weight: ``[D, Dv]``; norm_weight: ``[D]``; gate_weight, up_weight:
            ``[F, D]``; down_weight: ``[D, F]``; no biases.
    Returns:
        ``[M, D]``.
    """
    M, D = x.shape if x.dim() == 2 else (-1, -1)
    F_, Dv = gate_weight.shape[0], o_weight.shape[-1]
    for name, t, shape in (("mixed", mixed, (M, Dv)), ("o_weight", o_weight, (D, Dv)),
                           ("norm_weight", norm_weight, (D,)), ("gate_weight", gate_weight, (F_, D)),
                           ("up_weight", up_weight, (F_, D)), ("down_weight", down_weight, (D, F_))):
        if t.shape != shape:
            raise ValueError(f"`{name}` must be {shape} for `x` [M, D] = {tuple(x.shape)}, got {tuple(t.shape)}")
    out = torch.empty_like(x)
    _CPU_KERNEL.ops.swiglu_block_rows(x.contiguous(), mixed.contiguous(), o_weight, norm_weight, float(eps),
                                      gate_weight, up_weight, down_weight, out)
    return out


def linear_cross_entropy_input_gradient(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    target: torch.Tensor,
    scale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Per-row gradient of a softmax cross-entropy output layer with respect to its input, without summing rows:

        g_n = d/dx_n [scale_n CE(x_n W^T + b, target_n)] = scale_n (softmax(x_n W^T + b) - onehot(target_n)) W

    Args:
        x: ``[N, K]`` inputs of the output layer; weight: ``[V, K]``; bias: ``[V]`` or None.
        target: ``[N]`` ids in ``[0, V)`` (any id where the scale is 0); scale: ``[N]`` or None (ones).
    Returns:
        ``[N, K]`` in x's dtype. With autograd it is differentiable in x, weight and bias (a second-order training
        signal, as the FWL needs); outside autograd it runs in row blocks and no ``[N, V]`` tensor exists.
    """
    N, V = x.shape[0], weight.shape[0]
    target = target.clamp(0, V - 1)
    if scale is not None:
        scale = scale.to(x.dtype)
    tracked = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias, scale))
    if tracked:
        probs = torch.softmax(F.linear(x, weight, bias), dim=-1)
        if scale is not None:
            probs = probs * scale[:, None]
        return probs @ weight - _scaled_rows(weight, target, scale)
    out = x.new_empty(N, x.shape[1])
    block = max(1, BLOCK_BYTES // (max(V, 1) * x.element_size()))
    weight_t = weight.t()
    for start in range(0, N, block):
        rows = slice(start, min(start + block, N))
        logits = dense_linear(x[rows], weight, bias)
        probs = logits.sub_(logits.amax(-1, keepdim=True)).exp_()  # softmax in place: the block's only [n, V] tensor
        probs = probs.div_(probs.sum(-1, keepdim=True))
        if scale is not None:
            probs = probs.mul_(scale[rows, None])
        out[rows] = dense_linear(probs, weight_t)
    return out.sub_(_scaled_rows(weight, target, scale))


def _scaled_rows(weight: torch.Tensor, target: torch.Tensor, scale: Optional[torch.Tensor]) -> torch.Tensor:
    """``scale_n W[target_n]`` ``[N, K]`` (the one-hot part of the gradient)."""
    rows = weight.index_select(0, target)
    return rows if scale is None else rows * scale[:, None]
