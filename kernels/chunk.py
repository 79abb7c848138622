"""Chunkwise-parallel machinery of the outer-product rules (sum rule, delta rule, gated delta rule): plain PyTorch on
any device, and a C++ kernel on CPU. The rule-specific half of the algorithm is a :class:`ChunkRule`, defined in the
rule's own module (``linear_attention_kernels.py``, ``delta_rule_kernels.py``, ``gated_delta_rule_kernels.py``, which
overrides the forward and backward and has a C++ kernel of its own); this module runs it.

Per (batch, head), the sequence is cut into chunks of C positions. Inside a chunk, with the state
S ``[Dv, Dk]`` entering it (y = S q) and the chunk's rows Q, K ``[C, Dk]``, V ``[C, Dv]``, beta ``[C]``:

    sum rule   (Schlag et al. 2021, eqs. 10-11): O = Q S^T + tril(Q K^T) V,    S' = S + V^T K
    delta rule (eqs. 20-25, WY form):            U' = U - W S^T
                                                 O  = Q S^T + tril(Q K^T) U',  S' = S + U'^T K
    with the UT transform  T = (I + A)^-1,  A = strictly_lower(diag(beta) K K^T),
                           W = T diag(beta) K,  U = T diag(beta) V.

Everything that does not depend on S (tril(Q K^T), T, W, U: :meth:`ChunkRule.intra`) is computed for all chunks at
once in batched matmuls. The sequential pass across chunks (:meth:`ChunkRule.state_pass`) is two small matmuls per
chunk (U' and S'), and the outputs are again one batched matmul over all chunks, given the state entering each chunk.
The backward recomputes those states from the saved inputs and runs the transposed pass from the last chunk; it holds
one state per chunk while it runs, never one per step. Derivation: README.md.

On CPU the forward and the backward run in a C++ kernel instead (csrc/chunk_delta.cpp, built on first use by
``cpp_build`` and cached in ``$FWP_KERNELS_BUILD_DIR`` or ``~/.cache/fwp_kernels``) for the rules it implements
(``ChunkRule.cpp``): per sequence, chunk by chunk, it solves ``(I + A) U' = diag(beta) (V - K S^T)`` by forward
substitution and runs two products per chunk, so the sequential pass costs no Python or dispatcher time and T, W, U are
never formed; its backward recomputes the states entering the chunks (one per chunk, per sequence) and runs the
transposed pass in the same loop; with fewer sequences than threads it splits the value columns over threads, and one
position (a decode step) is one pass over the state (``decode_step``). Its products (``cpu_products``): the file's own
micro-kernel for float32 inputs where the CPU has AVX-512 or AVX2 with FMA, with bfloat16 factors and float32 sums
for the forward of bfloat16 inputs where it has AVX-512 BF16, else the BLAS; bfloat16 inputs are read and o written
in bfloat16 by the forward, the output gradient read and the gradients written in bfloat16 by the backward; the
state stays float32. Without the build the PyTorch path above runs: silently when there
is no compiler or ninja or ``FWP_KERNELS_NO_BUILD=1``, with one warning when a build fails. A saved model folder
carries the C++ source (``chunk_delta.cpp`` and the string of ``chunk_delta_csrc.py``, written by
``modeling_fwp.remote_code``) and builds it the same way.
"""
from __future__ import annotations

import importlib
from typing import Callable, Dict, FrozenSet, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F

from .cpp_build import KERNEL_CFLAGS, NATIVE_ARCH_FLAG, avx2_only_build, register_cpu_kernel
from .dispatch import (
    KernelFinder,
    Recurrence,
    acc_dtype,
    as_dtype,
    check_fast_weight_inputs,
    mask_positions,
    select_kernel,
)

# Diagonal blocks of this size are inverted by batched triangular solves (LAPACK / cuBLAS), then
# merged by doubling (see `unit_lower_inverse`).
_SOLVE_BLOCK = 32


def _to_chunks(x: torch.Tensor, chunk_size: int, dtype: torch.dtype) -> torch.Tensor:
    """``[B, H, T, *D]`` -> ``[B*H, N, C, *D]`` in `dtype`, zero-padded to ``N*C >= T``.

    Padded positions have k = v = beta = 0, so they leave the state untouched.
    """
    B, H, T = x.shape[:3]
    x = x.reshape(B * H, T, *x.shape[3:]).to(dtype)
    pad = -T % chunk_size
    if pad:
        x = F.pad(x, (0, 0, 0, pad) if x.dim() == 3 else (0, pad))
    return x.unflatten(1, ((T + pad) // chunk_size, chunk_size))


def _from_chunks(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``[B*H, N, C, *D]`` -> ``[B, H, T, *D]`` with B, H, T and dtype of `like` (drops the padding)."""
    B, H, T = like.shape[:3]
    x = x.flatten(1, 2)[:, :T]
    return x.reshape(B, H, T, *x.shape[2:]).to(like.dtype)


def _diagonal_blocks(A: torch.Tensor, s: int) -> torch.Tensor:
    """The diagonal ``s x s`` blocks of ``A [..., C, C]`` as a view ``[..., C // s, s, s]``."""
    nb = A.shape[-1] // s
    blocks = A.unflatten(-1, (nb, s)).unflatten(-3, (nb, s)).diagonal(dim1=-4, dim2=-2)  # [..., s, s, nb]
    return blocks.movedim(-1, -3)


def unit_lower_inverse(A: torch.Tensor) -> torch.Tensor:
    """``T = (I + A)^-1`` for strictly lower triangular ``A [..., C, C]`` (the UT transform).

    The diagonal blocks of size `_SOLVE_BLOCK` are inverted by batched triangular solves; then
    neighbouring diagonal blocks are merged, doubling their size, with
    ``[[I + A11, 0], [A21, I + A22]]^-1 = [[T1, 0], [-T2 A21 T1, T2]]``.
    """
    C = A.shape[-1]
    b = min(C, _SOLVE_BLOCK)
    size = b
    while size < C:
        size *= 2
    eye = torch.eye(b, dtype=A.dtype, device=A.device)
    if size == b:  # unitriangular: the solver reads neither the diagonal (zero in A) nor above it
        return torch.linalg.solve_triangular(A, eye.expand_as(A), upper=False, unitriangular=True)
    if size != C:  # zero rows/columns give identity blocks and leave the top-left inverse unchanged
        A = F.pad(A, (0, size - C, 0, size - C))
    T = torch.zeros_like(A)
    A_diag = _diagonal_blocks(A, b)
    T_diag = torch.linalg.solve_triangular(A_diag, eye.expand_as(A_diag), upper=False, unitriangular=True)
    _diagonal_blocks(T, b).copy_(T_diag)
    s = b
    while s < size:
        T2s, A2s = _diagonal_blocks(T, 2 * s), _diagonal_blocks(A, 2 * s)
        T2s[..., s:, :s] = -(T2s[..., s:, s:] @ (A2s[..., s:, :s] @ T2s[..., :s, :s]))
        s *= 2
    return T[..., :C, :C] if size != C else T


def bmm(x: torch.Tensor, y: torch.Tensor, add: Optional[torch.Tensor] = None, alpha: float = 1.0) -> torch.Tensor:
    """``add + alpha * x @ y`` for ``[BH, N, ., .]`` operands, as one 3-D bmm.

    `add` (a temporary) is accumulated into in place, which saves a copy of it.
    """
    x3, y3 = x.flatten(0, 1), y.flatten(0, 1)
    out = torch.bmm(x3, y3) if add is None else add.flatten(0, 1).baddbmm_(x3, y3, alpha=alpha)
    return out.unflatten(0, x.shape[:2])


class Intra(NamedTuple):
    """Per-chunk quantities that do not depend on the state, all ``[B*H, N, ...]``."""

    P: torch.Tensor  # tril(Q K^T), diagonal included        [C, C]
    U: torch.Tensor  # the values written before the state's correction (sum rule: V) [C, Dv]
    W: Optional[torch.Tensor] = None  # delta rule: T diag(beta) K   [C, Dk]
    T: Optional[torch.Tensor] = None  # delta rule: (I + A)^-1       [C, C]


class ChunkRule:
    """The rule-specific half of the chunkwise algorithm; :class:`ChunkFastWeightFunction` runs the rest.

    A rule module subclasses it. All tensors are chunked, ``[BH, N, C, ...]`` (q, k ``[.., C, Dk]``, v ``[.., C, Dv]``,
    each gate ``[BH, N, C]``), states ``[BH, N, Dv, Dk]`` (one per chunk) or ``[BH, Dv, Dk]``.

    Attributes:
        name: for messages.
        gates: names of the rule's per-position scalars ``[B, H, T]``, the arguments after v (delta rule: beta).
        cpp: whether csrc/chunk_delta.cpp implements the rule (its op's ``beta``: the rule's one gate; none: sum rule).
            A rule with a compiled kernel of its own overrides the three ``compiled*`` methods instead.
    """

    name: str = ""
    gates: Tuple[str, ...] = ()
    cpp: bool = False

    def intra(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *gates: torch.Tensor) -> Intra:
        """The per-chunk quantities that do not depend on the state."""
        raise NotImplementedError

    def state_pass(self, s0: torch.Tensor, k: torch.Tensor, intra: Intra) -> Tuple[torch.Tensor, ...]:
        """The sequential pass over the chunks: ``(state entering each chunk [BH, N, Dv, Dk], the values written to
        the state U' [BH, N, C, Dv], the final state [BH, Dv, Dk])``, so that ``O = Q S^T + P U'``."""
        raise NotImplementedError

    def state_pass_backward(
        self, d_final: torch.Tensor, q: torch.Tensor, k: torch.Tensor, do: torch.Tensor, intra: Intra
    ) -> Tuple[torch.Tensor, ...]:
        """The transposed pass, from the last chunk: ``(dS' [BH, N, Dv, Dk], dU' [BH, N, C, Dv], dS_0 [BH, Dv, Dk])``,
        dS' being the gradient w.r.t. the state leaving each chunk and dS_0 that of the initial state."""
        raise NotImplementedError

    def value_grads(
        self, dk: torch.Tensor, dU_new: torch.Tensor, S: torch.Tensor, intra: Intra, k: torch.Tensor,
        v: torch.Tensor, *gates: torch.Tensor,
    ) -> Tuple[torch.Tensor, torch.Tensor, Tuple[torch.Tensor, ...]]:
        """From dU' (and dk's part through ``O`` and ``S'``): ``(dk, dv, the gates' gradients)``."""
        raise NotImplementedError

    def forward_chunks(self, q, k, v, gates, s0) -> Tuple[torch.Tensor, torch.Tensor]:
        """The PyTorch forward on chunked inputs: ``(O [BH, N, C, Dv], final state [BH, Dv, Dk])``. A rule whose
        output is not ``Q S^T + P U'`` (the gated delta rule) overrides it and :meth:`backward_chunks`."""
        return _forward(self, q, k, v, gates, s0)

    def backward_chunks(self, do, d_final, q, k, v, gates, s0) -> Tuple:
        """The PyTorch backward on chunked inputs: ``(dq, dk, dv, dgates, ds0)``."""
        return _backward(self, do, d_final, q, k, v, gates, s0)

    def compiled(self, x: torch.Tensor, acc: torch.dtype) -> bool:
        """Whether a compiled kernel runs the rule for inputs like `x` accumulated in `acc`: csrc/chunk_delta.cpp on
        CPU for float32 / float64 when ``cpp`` and the kernel is built."""
        return self.cpp and x.device.type == "cpu" and acc in (torch.float32, torch.float64) and cpu_kernel_available()

    def compiled_forward(self, q, k, v, gates, initial_state, chunk_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """The compiled forward on ``[B, H, T, D]`` inputs: ``(o [B, H, T, Dv] in q's dtype, final state)``."""
        return _forward_cpu(q, k, v, gates, initial_state, chunk_size)

    def compiled_backward(self, do, d_final, q, k, v, gates, initial_state, chunk_size: int):
        """The compiled backward: ``(dq, dk, dv, dgates, d initial_state)``."""
        return _backward_cpu(do, d_final, q, k, v, gates, initial_state, chunk_size)


def _forward(rule: ChunkRule, q, k, v, gates, s0):
    """Chunked inputs ``[BH, N, C, D]`` -> chunked outputs ``[BH, N, C, Dv]`` and the final state."""
    if q.shape[1] == 0:  # T = 0
        return v.clone(), s0
    intra = rule.intra(q, k, v, *gates)
    S, U_new, final = rule.state_pass(s0, k, intra)
    return bmm(q, S.mT, add=bmm(intra.P, U_new)), final  # O = Q S^T + P U'


def _backward(rule: ChunkRule, do, d_final, q, k, v, gates, s0):
    """Gradients ``(dq, dk, dv, dgates, ds0)`` of the chunked inputs and of s0, recomputing the forward's per-chunk
    quantities."""
    if q.shape[1] == 0:  # T = 0
        return q.clone(), k.clone(), v.clone(), tuple(g.clone() for g in gates), d_final
    intra = rule.intra(q, k, v, *gates)
    S, U_new, _ = rule.state_pass(s0, k, intra)
    dS_next, dU_new, ds0 = rule.state_pass_backward(d_final, q, k, do, intra)
    # O = Q S^T + P U', P = tril(Q K^T), S' = S + U'^T K
    dP = bmm(do, U_new.mT).tril_()
    dq = bmm(dP, k, add=bmm(do, S))
    dk = bmm(dP.mT, q, add=bmm(U_new, dS_next))
    dk, dv, dgates = rule.value_grads(dk, dU_new, S, intra, k, v, *gates)
    return dq, dk, dv, dgates, ds0


def _prepare(q, k, v, gates, initial_state, chunk_size):
    """Chunked fp32 (fp64) copies ``(q, k, v, gates)`` of the inputs and the ``[B*H, Dv, Dk]`` initial state."""
    acc = acc_dtype(q, k, v, initial_state, *gates)
    B, H, _, Dk = q.shape
    Dv = v.shape[-1]
    q, k, v = (_to_chunks(x, chunk_size, acc) for x in (q, k, v))
    chunks = (q, k, v, tuple(_to_chunks(g, chunk_size, acc) for g in gates))
    if initial_state is None:
        return chunks, q.new_zeros(B * H, Dv, Dk, dtype=acc)
    return chunks, initial_state.reshape(B * H, Dv, Dk).to(acc)


# ---------------------------------------------------------------------------------------------------
# the compiled CPU kernel (csrc/chunk_delta.cpp): the sum rule and the delta rule

try:  # inside a saved model folder the C++ source travels as a string (transformers copies only Python modules)
    from .chunk_delta_csrc import CPP_SOURCE as _EMBEDDED_SOURCE
except ImportError:  # the installed package: the source is csrc/chunk_delta.cpp
    _EMBEDDED_SOURCE = None
# The chunk kernel's flags: every kernel's, with the loops the compiler vectorises (the substitutions, the epilogues,
# the packing) in 512-bit registers where the CPU has AVX-512 (no effect on one without): GCC's tuning for Intel's
# cores and its generic one prefer 256 bits, half the width of the intrinsics beside them. Side by side in one process
# (2026-12-02, Intel Xeon with AMX, B1 H8 T4096 D64, ratio of medians over 21 rounds, outputs and gradients bit for
# bit the same; benchmarks/results/bench_chunk_builds_wide_vectors.json): forward 1.02-1.20x faster at 1 thread and
# 1.02-1.12x at 2 (delta and gated rules, float32 and bfloat16; bfloat16 1.10-1.20x), forward + backward 0.96-1.07x
# and 1.01-1.07x; T = 16 0.99-1.03x. The decode step keeps 256 bits (csrc/chunk_delta.cpp, above decode_rows).
CHUNK_KERNEL_CFLAGS = KERNEL_CFLAGS + (("-mprefer-vector-width=512",) if NATIVE_ARCH_FLAG in KERNEL_CFLAGS else ())
_CPU_KERNEL = register_cpu_kernel(
    "chunk_delta", _EMBEDDED_SOURCE, "fwp_chunk", "chunk_forward", CHUNK_KERNEL_CFLAGS,
    "the PyTorch chunked kernel (slower on CPU)",
)
_SOURCE = _CPU_KERNEL.source_path
# Which CPU path the chunked kernels take (see CompiledCpuKernel.describe), and the build on first use (False: the
# PyTorch path runs). Module attributes, so that tests and benchmarks can switch the C++ path off.
cpu_kernel_status = _CPU_KERNEL.describe
cpu_kernel_available = _CPU_KERNEL.available


# How the C++ kernel computes its products (csrc/chunk_delta.cpp's `Products`): the BLAS that torch links, or the file's
# own AVX-512 micro-kernel with float32 factors, or with bfloat16 factors and float32 sums (AVX-512 BF16), or the same
# bfloat16 factors in AMX's tile registers (TILE_BFLOAT16_PRODUCTS: a build with AMX-BF16 on a Linux that grants the
# process the tile data).
BLAS_PRODUCTS, FLOAT32_PRODUCTS, BFLOAT16_PRODUCTS, TILE_BFLOAT16_PRODUCTS = 0, 1, 2, 3
# bfloat16 factors take the tiles where the machine has them: on an Intel Xeon with AMX (2 vCPUs), B1 H8 T4096 D64,
# mode auto, 1 / 2 threads, the bfloat16 forward 11.59 / 5.86 ms with vdpbf16ps (which those cores issue at half their
# float32 FMA rate: slower than the float32 kernel's 8.13 / 4.10) and 5.20 / 2.82 with the tiles (bench_cpu_amx.json).
BFLOAT16_DEFAULT_PRODUCTS = TILE_BFLOAT16_PRODUCTS
# float32 inputs take the micro-kernel where it is built: faster than MKL's sgemm at the chunk loops' sizes on the AMD
# CPUs measured (MKL runs AVX2 code there; bench_cpu, "kernels": fp32 forward and forward + backward).
FLOAT32_DEFAULT_PRODUCTS = FLOAT32_PRODUCTS


def bfloat16_products_min_t(head_dim: int, products: int = BFLOAT16_PRODUCTS) -> int:
    """The positions from which bfloat16 inputs take bfloat16 factors of kind `products`, for heads `head_dim`
    (max(Dk, Dv)) wide. AMX tiles (TILE_BFLOAT16_PRODUCTS): 16 (bench_cpu_amx.json, products_by_length, time with
    float32 factors / with the tiles, 1 / 2 threads: D = 64 T = 8 0.91x / 0.98x, T = 16 0.98x / 0.98x, T = 64 1.21x /
    1.12x; D = 128 T = 8 1.05x / 0.98x, T = 16 1.30x / 1.20x). vdpbf16ps: 8 up to 64, 16 above. Below it the state's
    packing into pairs (Dk x Dv per chunk) outweighs the few rows multiplied
    (bench_cpu_zen5.json at ce9bee2, products_by_length, bfloat16 inputs, time with float32 factors / with bfloat16
    factors, 1 / 2 threads: D = 64 T = 4 1.00x / 0.99x, T = 8 1.03x / 1.03x, T = 16 1.10x / 1.06x; D = 128 T = 8
    0.90x / 0.91x, T = 16 1.00x / 1.00x, T = 1,024 1.65x / 1.62x; at 4c33034 D = 128 T = 8 was 1.06x / 1.02x, at
    3648aca 0.97-1.10x over both widths: 8 for both until ce9bee2)."""
    if products == TILE_BFLOAT16_PRODUCTS:
        return 16
    return 8 if head_dim <= 64 else 16


# The loaded build's kinds of products, asked of it once (an op call and a set per kernel call: cpu_products 6.6-7.4
# instead of 3.9 us, by hand, Zen 3, 1 thread); one build per process.
_BUILT_PRODUCT_KINDS: Dict[str, FrozenSet[int]] = {}


@torch.compiler.assume_constant_result
def _built_product_kinds() -> int:
    """The build's ``product_kinds()`` bits; a constant of the graph under ``torch.compile`` (read while tracing)."""
    return int(_CPU_KERNEL.ops.product_kinds())


def cpu_product_kinds() -> FrozenSet[int]:
    """The kinds of products the C++ kernel's build has (none without the build)."""
    if not cpu_kernel_available():
        return frozenset()
    if "kinds" not in _BUILT_PRODUCT_KINDS:
        bits = _built_product_kinds()
        _BUILT_PRODUCT_KINDS["kinds"] = frozenset(
            kind for kind in (BLAS_PRODUCTS, FLOAT32_PRODUCTS, BFLOAT16_PRODUCTS, TILE_BFLOAT16_PRODUCTS)
            if bits >> kind & 1)
    return _BUILT_PRODUCT_KINDS["kinds"]


def cpu_bfloat16_products() -> Optional[int]:
    """The kind of bfloat16-factor products the C++ kernel gives bfloat16 inputs on this machine:
    ``BFLOAT16_DEFAULT_PRODUCTS`` where built, else ``BFLOAT16_PRODUCTS`` where built, else None."""
    kinds = cpu_product_kinds()
    for kind in (BFLOAT16_DEFAULT_PRODUCTS, BFLOAT16_PRODUCTS):
        if kind in kinds:
            return kind
    return None


def native_bf16_available() -> bool:
    """Whether the C++ kernel multiplies bfloat16 natively (its build has AVX-512 BF16)."""
    return BFLOAT16_PRODUCTS in cpu_product_kinds()


def cpu_products(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gates: Tuple[torch.Tensor, ...],
                 bfloat16_factors: bool = True) -> int:
    """How the C++ chunk kernel computes the products for these inputs (forward and backward alike): with bfloat16
    factors (``cpu_bfloat16_products``: AMX tiles where the machine has them, else vdpbf16ps) when q, k, v and the
    gates are all bfloat16, the build has AVX-512 BF16, there are at least ``bfloat16_products_min_t`` positions for
    that kind and `bfloat16_factors` (float32 sums, state and substitutions; the state,
    U' and the gradients rounded only as factors of a product, as fla's kernels multiply on a GPU); else float32 with
    ``FLOAT32_DEFAULT_PRODUCTS`` where built; else (float64, float16, mixed) the BLAS. The backward of bfloat16 inputs
    took float32 factors until its products shed their per-chunk transposes and re-multiplications: with bfloat16
    factors it is now 15-20% faster (by hand, B1 H8 T4096 D64, 1 thread), its gradients within 4.3e-3 of the float64
    step loop where float32 factors give 2.4e-3 (``tests/test_kernels.py::test_bfloat16_products``)."""
    kinds = cpu_product_kinds()
    dtypes = {x.dtype for x in (q, k, v, *gates)}
    bfloat16 = cpu_bfloat16_products()
    long_enough = q.shape[-2] >= bfloat16_products_min_t(max(q.shape[-1], v.shape[-1]), bfloat16)
    if _bfloat16_io(q, k, v, gates) and bfloat16 is not None and bfloat16_factors and long_enough:
        return bfloat16
    if dtypes <= {torch.float32, torch.bfloat16, torch.float16} and FLOAT32_DEFAULT_PRODUCTS in kinds:
        return FLOAT32_DEFAULT_PRODUCTS
    return BLAS_PRODUCTS


def _bfloat16_io(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gates: Tuple[torch.Tensor, ...]) -> bool:
    """Whether q, k, v and the gates are all bfloat16: the C++ kernels then read them as they are."""
    return all(x.dtype == torch.bfloat16 for x in (q, k, v, *gates))


def io_dtype(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gates: Tuple[torch.Tensor, ...],
             acc: torch.dtype) -> torch.dtype:
    """The dtype in which the C++ chunk kernels (every rule) read q, k, v, the gates and the output gradient and write
    o and the gradients: bfloat16 when q, k, v and the gates all are and `acc` is float32 (widened chunk by chunk as
    they are read, each output rounded once as it is written; the state and the sums float32), else `acc` (a float64
    initial state makes it float64: the kernels' bfloat16 path keeps a float32 state, and refused it before)."""
    return torch.bfloat16 if _bfloat16_io(q, k, v, gates) and acc == torch.float32 else acc


def _flat(x: Optional[torch.Tensor], acc: torch.dtype) -> Optional[torch.Tensor]:
    """``[B, H, T, *D]`` -> contiguous ``[B*H, T, *D]`` in `acc` (a view when it already is)."""
    return None if x is None else as_dtype(x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]), acc).contiguous()


def _flat_products(flat: list) -> int:
    """``cpu_products`` for the tensors the ops are handed (q, k, v, beta or None, in the dtype they run in)."""
    q, k, v, beta = flat
    return cpu_products(q, k, v, () if beta is None else (beta,))


def _op_beta(gates: Tuple[torch.Tensor, ...]) -> Optional[torch.Tensor]:
    """The C++ ops' ``Tensor? beta``: the delta rule's beta; None makes the op run the sum rule."""
    (beta,) = gates or (None,)
    return beta


def decode_cpu(q, k, v, gates, initial_state) -> Tuple[torch.Tensor, torch.Tensor]:
    """One position (T = 1) of every head in one C++ call that reads each row of the state once and writes it once
    (``decode_step`` in csrc/chunk_delta.cpp): ``[B, H, 1, D]`` inputs -> o ``[B, H, 1, Dv]``, state ``[B, H, Dv, Dk]``.
    `gates`: ``()`` (sum rule), ``(beta,)`` (delta rule) or ``(beta, g)`` (gated delta rule, g the log-decay).
    """
    acc = acc_dtype(q, k, v, initial_state, *gates)
    io = io_dtype(q, k, v, gates, acc)  # bfloat16 inputs go in as they are (the op widens them)
    B, H, _, Dk = q.shape
    Dv = v.shape[-1]
    q1, k1, v1 = (x.reshape(B * H, x.shape[-1]).to(io).contiguous() for x in (q, k, v))
    beta, g = (None if x is None else x.reshape(B * H).to(io).contiguous() for x in (tuple(gates) + (None, None))[:2])
    state = None if initial_state is None else initial_state.reshape(B * H, Dv, Dk).to(acc).contiguous()
    new_state = q.new_empty(B, H, Dv, Dk, dtype=acc)  # never written in place: the caller's state stays
    o = q.new_empty(B, H, 1, Dv, dtype=io)
    _CPU_KERNEL.ops.decode_step(q1, k1, v1, beta, g, state, new_state, o)
    return o.to(q.dtype), new_state


def compiled_forward_buffers(
    q, v, initial_state, acc: torch.dtype, out_dtype: Optional[torch.dtype] = None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """What a C++ chunk forward writes into: the state ``[B*H, Dv, Dk]`` in `acc` (a copy of `initial_state`, or
    zeros: never the caller's tensor) and the output ``[B*H, T, Dv]`` in `out_dtype` (default `acc`)."""
    B, H, T, Dk = q.shape
    Dv = v.shape[-1]
    state = q.new_zeros(B * H, Dv, Dk, dtype=acc)
    if initial_state is not None:
        state.copy_(initial_state.reshape(B * H, Dv, Dk))
    return state, q.new_empty(B * H, T, Dv, dtype=out_dtype or acc)


def _forward_cpu(q, k, v, gates, initial_state, chunk_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The C++ forward: ``[B, H, T, D]`` inputs -> o ``[B, H, T, Dv]`` (q's dtype), final state ``[B, H, Dv, Dk]``."""
    if q.shape[2] == 1:
        return decode_cpu(q, k, v, gates, initial_state)
    acc = acc_dtype(q, k, v, initial_state, *gates)
    io = io_dtype(q, k, v, gates, acc)
    state, o = compiled_forward_buffers(q, v, initial_state, acc, io)
    flat = [_flat(x, io) for x in (q, k, v, _op_beta(gates))]
    _CPU_KERNEL.ops.chunk_forward(*flat, state, chunk_size, o, None, None, _flat_products(flat))
    return as_dtype(o.view_as(v), q.dtype), state.view(*q.shape[:2], v.shape[-1], q.shape[-1])


def _backward_cpu(do, d_final, q, k, v, gates, initial_state, chunk_size: int):
    """The C++ backward (recomputes the states entering the chunks): gradients ``(dq, dk, dv, dgates, ds0)``."""
    acc = acc_dtype(q, k, v, initial_state, *gates)
    B, H, T, Dk = q.shape
    Dv = v.shape[-1]
    beta = _op_beta(gates)
    io = io_dtype(q, k, v, gates, acc)
    flat = [_flat(x, io) for x in (q, k, v, beta)]
    s0 = q.new_zeros(B * H, Dv, Dk, dtype=acc) if initial_state is None else _flat(initial_state, acc)
    do = torch.zeros_like(flat[2]) if do is None else _flat(do, io)
    dS = q.new_zeros(B * H, Dv, Dk, dtype=acc)  # in: the final state's gradient, out: the initial state's
    if d_final is not None:
        dS.copy_(d_final.reshape(B * H, Dv, Dk))
    dq, dk, dv = torch.empty_like(flat[0]), torch.empty_like(flat[1]), torch.empty_like(flat[2])
    dbeta = None if beta is None else torch.empty_like(flat[3])
    _CPU_KERNEL.ops.chunk_backward(*flat, s0, chunk_size, do, dS, dq, dk, dv, dbeta, _flat_products(flat))
    dq, dk, dv = (g.view(x.shape).to(x.dtype) for g, x in ((dq, q), (dk, k), (dv, v)))
    dgates = () if beta is None else (dbeta.view(beta.shape).to(beta.dtype),)
    ds0 = None if initial_state is None else dS.view(initial_state.shape).to(initial_state.dtype)
    return dq, dk, dv, dgates, ds0


class ChunkFastWeightFunction(torch.autograd.Function):
    """Chunkwise fast weights of one :class:`ChunkRule`:
    ``apply(rule, chunk_size, q, k, v, initial_state, *gates) -> (o, final state)``.

    Saves only its inputs for backward, which recomputes everything else chunk by chunk.
    """

    @staticmethod
    def save_inputs(ctx, rule, chunk_size, q, k, v, initial_state, gates) -> int:
        """Saves the inputs for backward; returns the chunk length (a sequence shorter than a chunk is one chunk of
        its own length: no padded work)."""
        ctx.save_for_backward(q, k, v, initial_state, *gates)
        ctx.rule, ctx.chunk_size = rule, max(1, min(chunk_size, q.shape[2]))
        ctx.set_materialize_grads(False)
        return ctx.chunk_size

    @staticmethod
    def forward(ctx, rule, chunk_size, q, k, v, initial_state, *gates):
        chunk_size = ChunkFastWeightFunction.save_inputs(ctx, rule, chunk_size, q, k, v, initial_state, gates)
        if rule.compiled(q, acc_dtype(q, k, v, initial_state, *gates)):
            return rule.compiled_forward(q, k, v, gates, initial_state, chunk_size)
        (qc, kc, vc, gc), s0 = _prepare(q, k, v, gates, initial_state, chunk_size)
        o, final = rule.forward_chunks(qc, kc, vc, gc, s0)
        return _from_chunks(o, q), final.view(*q.shape[:2], *final.shape[1:])

    @staticmethod
    def backward(ctx, do, d_final):
        q, k, v, initial_state, *gates = ctx.saved_tensors
        rule, chunk_size = ctx.rule, ctx.chunk_size
        if rule.compiled(q, acc_dtype(q, k, v, initial_state, *gates)):
            dq, dk, dv, dgates, ds0 = rule.compiled_backward(do, d_final, q, k, v, gates, initial_state, chunk_size)
            return (None, None, dq, dk, dv, ds0, *dgates)
        (qc, kc, vc, gc), s0 = _prepare(q, k, v, gates, initial_state, chunk_size)
        do = torch.zeros_like(v, dtype=s0.dtype) if do is None else do
        d_final = torch.zeros_like(s0) if d_final is None else d_final.reshape(s0.shape).to(s0.dtype)
        do = _to_chunks(do, chunk_size, s0.dtype)
        dq, dk, dv, dgates, ds0 = rule.backward_chunks(do, d_final, qc, kc, vc, gc, s0)
        dq, dk, dv = (_from_chunks(g, x) for g, x in ((dq, q), (dk, k), (dv, v)))
        dgates = (_from_chunks(g, x) for g, x in zip(dgates, gates))
        ds0 = None if initial_state is None else ds0.view(initial_state.shape).to(initial_state.dtype)
        return (None, None, dq, dk, dv, ds0, *dgates)


def chunk_fast_weights(rule: ChunkRule, chunk_size: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       initial_state: Optional[torch.Tensor], *gates: torch.Tensor
                       ) -> Tuple[torch.Tensor, torch.Tensor]:
    """``ChunkFastWeightFunction.apply(rule, chunk_size, q, k, v, initial_state, *gates)`` -> ``(o [B, H, T, Dv],
    final state [B, H, Dv, Dk])``, but a call that autograd does not track runs the compiled kernel directly, as the
    Function's forward would (the same op, the same chunk length): its bookkeeping took 8 of a decode step's 36 us (16
    heads of 128, by hand, 2026-11-28), and of the delta rule's forward at B*H = 8, D = 64 outside autograd 119 -> 86
    us at T = 2, 140 -> 107 at T = 8, 401 -> 343 at T = 64 (by hand, interleaved, Zen 3, 1 thread, 2026-12-02)."""
    inputs = (q, k, v, initial_state, *gates)
    if not (torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in inputs)):
        if rule.compiled(q, acc_dtype(*inputs)):
            return rule.compiled_forward(q, k, v, gates, initial_state, max(1, min(chunk_size, q.shape[2])))
    return ChunkFastWeightFunction.apply(rule, chunk_size, q, k, v, initial_state, *gates)


# ---------------------------------------------------------------------------------------------------
# mode "chunk" in the dispatcher: which kernel, and when "auto" takes it

class CpuAutoChoice(NamedTuple):
    """What mode="auto" runs on CPU with the C++ kernel at one torch thread count."""

    recurrent_max_t: int  # the step loop up to this many positions (0: never; T = 1 is the C++ decode step)
    chunk_sizes: Tuple[Tuple[int, int], ...]  # (head width max(Dk, Dv) up to, chunk size); wider: the caller's
    # the same for bfloat16 factors multiplied in AMX tiles (TILE_BFLOAT16_PRODUCTS); () or a width past the last
    # row: chunk_sizes'
    bfloat16_tile_chunk_sizes: Tuple[Tuple[int, int], ...] = ()


# mode="auto" on CPU with the C++ kernel, by torch thread count (more threads than listed: the last row). Regenerated
# by `python benchmarks/bench_cpu.py` ("auto_table": B*H = 8, fp32, forward and forward + backward), which prints
# the rows. Measured, process CPU time, one thread, on a loaded machine (load 9-10, s24-cpu), B*H = 8, forward /
# forward + backward ms, delta rule then sum rule:
#   D = 64,  T = 4096:  C=16 15.8 / 72.9, 9.7 / 44.4;   C=32 17.5 / 79.3, 10.5 / 49.0;   C=64 23.4 / 96.8, 12.0 / 49.3
#   D = 128, T = 2048:  C=16 21.9 / 110.9, 15.1 / 62.6; C=32 23.8 / 104.6, 15.2 / 65.0; C=64 29.8 / 123.2, 17.5 / 68.7
# (a quiet run, benchmarks/results/bench_kernels.json at bd87491: D = 64, C=32 18.7 / 76.6, C=64 24.0 / 96.2 ms).
# Short T: the chunk kernel beats the step loop from T = 2 (0.062 vs 0.089 ms, same file); T = 1, the decode step
# (csrc decode_step) vs the step loop: 0.029 vs 0.042 ms (B*H = 8, D = 64), 0.091 vs 0.116 ms (B*H = 16, D = 128).
# Two threads (benchmarks/results/bench_cpu.json, 2026-11-26, load 0.7 before, the kernels now built with -fopenmp:
# the earlier 2-thread row, C=64, came from builds that ran every task on one thread): T = 2048, B*H = 8, forward /
# forward + backward ms, D = 64: C=16 7.4 / 34.8, C=32 8.3 / 34.2, C=64 10.7 / 41.5; D = 128: C=16 18.7 / 90.8,
# C=32 19.8 / 83.6, C=64 23.4 / 87.8 (one thread, same run: D = 64 C=16 9.9 / 45.6; D = 128 C=32 29.1 / 130.5).
# Decode step vs step loop at T = 1: 0.115 vs 0.200 ms (D = 64), 0.097 vs 0.128 (D = 128).
# With the kernel's AVX-512 products (benchmarks/results/bench_cpu_zen5.json, a Zen 5 EPYC, commit 66be559, load
# 0.45-0.67), T = 2048, B*H = 8, forward / forward + backward ms, 1 thread: D = 64 C=16 3.5 / 17.8, C=32 3.7 / 18.6,
# C=64 4.8 / 22.5; D = 128 C=16 11.2 / 51.1, C=32 10.6 / 49.8, C=64 13.1 / 57.1; 2 threads: D = 64 C=16 1.7 / 9.4,
# C=32 1.9 / 10.3, C=64 2.3 / 12.2; D = 128 C=16 5.5 / 29.7, C=32 5.6 / 27.8, C=64 6.7 / 30.7. The rows stand (the
# bench's sum of the two picks 16 for width 64 and 32 for width 128 at both thread counts; session 44's runs picked 16
# or 32 for width 128 by 1-3%, and one before the transposed operands were vectorized picked 64; session 47's runs
# picked 16 or 32 for width 128 at 1 thread by 1-2%, 32 in the kept one at ce9bee2; the gated rule below, which
# takes the same rows, is 10% slower at 16). On a Zen 4 EPYC with the paced prefetches (bench_cpu_zen4.json, commit
# 7e9f745, load 0.44), T = 2048, B*H = 8, forward / forward + backward ms, 1 thread: D = 64 C=16 6.4 / 25.0, C=32
# 7.1 / 28.7, C=64 10.1 / 38.4; D = 128 C=16 19.2 / 82.2, C=32 21.2 / 85.3, C=64 25.4 / 101.7; 2 threads: D = 128
# C=16 10.3 / 45.3, C=32 11.3 / 45.4; by hand, interleaved, D = 128, forward + backward C=16 / 32: delta float32 94.0
# / 87.7 (1 thread), the gated rule 103.8 / 94.0 (1 thread) and 59.5 / 55.5 (2): 32 stays for width 128. The gated delta
# rule's kernel (the same products) takes the same rows (it kept the caller's 64 before): by hand, interleaved, B*H = 8,
# fp32, forward / forward + backward ms, C = 16, 32, 64, 1 thread: D = 64 (T = 4096) 11.7 / 50.7, 11.3 / 53.9,
# 13.6 / 60.2; D = 128 (T = 2048) 18.0 / 77.0, 15.7 / 69.2, 16.8 / 72.4; 2 threads: D = 64 7.0 / 30.1, 6.8 / 31.4,
# 8.0 / 35.1; D = 128 8.2 / 39.1, 7.9 / 35.8, 8.3 / 36.5.
# bfloat16 inputs whose products run in AMX tiles (an Intel Xeon with AMX-BF16, 2 vCPUs, session 61; by hand,
# interleaved, B*H = 8, bf16 / fp32 inputs, forward / forward + backward ms, C = 16, 32, 64): 1 thread D = 64 (T =
# 4096) bf16 7.0 / 33.0, 5.3 / 26.5, 6.7 / 32.8 (fp32 10.8 / 46.9, 11.0 / 52.7, 14.6 / 61.7); D = 128 (T = 2048) bf16
# 10.1 / 45.7, 8.7 / 36.0, 9.2 / 36.5 (fp32 15.3 / 87.6, 19.0 / 81.0, 21.8 / 84.1); 2 threads D = 64 bf16 3.8 / 18.0,
# 3.4 / 16.3, 4.6 / 18.0; D = 128 bf16 5.3 / 25.7, 4.6 / 19.8, 5.2 / 21.6: 32 at both widths (the tiles' products
# cost little beside the chunk's float32 work, of which there is less per position in longer chunks). bench_cpu's
# auto_table (bench_cpu_amx.json, T = 2048) picked 32 for width 64 and 64 for 128, where 64's forward + (forward +
# backward) was 2% less than 32's and its forward 16-19% more: 32 kept for both.
_CPU_AUTO = {
    1: CpuAutoChoice(recurrent_max_t=0, chunk_sizes=((64, 16), (128, 32)),
                     bfloat16_tile_chunk_sizes=((64, 32), (128, 32))),
    2: CpuAutoChoice(recurrent_max_t=0, chunk_sizes=((64, 16), (128, 32)),
                     bfloat16_tile_chunk_sizes=((64, 32), (128, 32))),
}
# AVX2-only builds (the float32 micro-kernel in 8-lane registers, cpp_build.avx2_only_build): 16 for width 128 too.
# bench_cpu's auto_table, T = 2048, B*H = 8, fp32, forward / forward + backward ms, C = 16 vs 32: a Zen 1 EPYC
# (bench_cpu_zen1.json, 2026-12-07) 1 thread 50.1 / 214.0 vs 55.0 / 234.6, 2 threads 28.4 / 118.6 vs 31.2 / 125.4;
# a Zen 3 EPYC (bench_cpu_zen3.json) 37.2 / 162.4 vs 40.8 / 166.0 and 18.3 / 90.6 vs 21.3 / 86.7 (the one row that
# picked 32, by 1% of the sum). The 1.3B Delta Net's shape on the Zen 1 (B 1, H 16, T 2048, D 128; by hand,
# interleaved, medians of 5-7): delta rule C = 16 / 32 forward 103.2 / 115.5 ms at 1 thread and 50.4 / 55.3 at 2,
# forward + backward 462.2 / 499.4 and 213.9 / 228.6; the gated rule 106.8 / 114.8, 60.4 / 60.3, 462.8 / 474.7,
# 258.7 / 264.6.
_CPU_AUTO_AVX2 = {
    threads: CpuAutoChoice(recurrent_max_t=0, chunk_sizes=((64, 16), (128, 16))) for threads in (1, 2)
}
# the table of this build (one per process: the build is the running CPU's, -march=native)
_CPU_AUTO_TABLE = _CPU_AUTO_AVX2 if avx2_only_build() else _CPU_AUTO
# CPU without the C++ kernel: the PyTorch chunked kernel's fixed cost (~40 tensor ops) equals about 3 steps of the loop
# (same benchmark). CUDA, measured on an H100 (benchmarks/results/gpu_check_h100/run3_bench_gpu.json, auto_crossover:
# delta rule, bf16, B 1, H 16, D 128, forward ms, step loop / Triton chunk): T = 1 0.38 / 1.70, 2 0.57 / 1.40,
# 4 1.22 / 1.40, 8 1.94 / 1.39, 16 3.88 / 1.44; both are launch-bound there, so the loop stays up to 4 positions.
_RECURRENT_MAX_T_CPU_PYTORCH = 3
_RECURRENT_MAX_T = {"cuda": 4}
_RECURRENT_MAX_T_DEFAULT = 3


@torch.compiler.assume_constant_result
def _torch_threads() -> int:
    """torch's intra-op thread count; a constant of the graph under ``torch.compile`` (read while tracing)."""
    return torch.get_num_threads()


def cpu_auto_choice(threads: Optional[int] = None) -> CpuAutoChoice:
    """The row of the measured table for `threads` (default: torch's current intra-op thread count)."""
    threads = _torch_threads() if threads is None else threads
    table = _CPU_AUTO_TABLE
    return table.get(threads, table[max(table)] if threads > max(table) else table[1])


def _recurrent_max_t(device: torch.device) -> int:
    if device.type == "cpu":
        return cpu_auto_choice().recurrent_max_t if cpu_kernel_available() else _RECURRENT_MAX_T_CPU_PYTORCH
    return _RECURRENT_MAX_T.get(device.type, _RECURRENT_MAX_T_DEFAULT)


def auto_mode(T: int, device: torch.device) -> str:
    """mode="auto" of the chunkwise rules: the step loop up to the measured crossover (on CPU with the C++ kernel
    never: a decode step is its one-pass ``decode_step``), the chunkwise-parallel form above it."""
    return "recurrent" if T <= _recurrent_max_t(device) else "chunk"


def auto_chunk_size(device: torch.device, head_width: int, chunk_size: int, products: Optional[int] = None) -> int:
    """mode="auto"'s chunk size for heads ``head_width = max(Dk, Dv)`` wide: the measured table's on CPU with the C++
    kernel, for widths it covers (``bfloat16_tile_chunk_sizes`` where `products`, the call's ``cpu_products``, are
    ``TILE_BFLOAT16_PRODUCTS``); else the caller's `chunk_size` (e.g. the Fast Weight Layers'
    vocabulary-wide heads)."""
    if device.type == "cpu" and cpu_kernel_available():
        row = cpu_auto_choice()
        rows = row.chunk_sizes
        if products == TILE_BFLOAT16_PRODUCTS and row.bfloat16_tile_chunk_sizes:
            rows = row.bfloat16_tile_chunk_sizes + tuple(r for r in rows if r[0] > row.bfloat16_tile_chunk_sizes[-1][0])
        for width, size in rows:
            if head_width <= width:
                return size
    return chunk_size


# Mode "chunk" on CUDA by head width max(Dk, Dv): our Triton kernels multiply in IEEE fp32 (input_precision="ieee":
# within 4e-7 of the float64 step loop on an H100, but no tensor cores) and scan the chunks of a head in one program.
# On an H100 (bench_gpu's kernel_times, B 4, H 16, T 4096, bf16 inputs; benchmarks/results/gpu_check_h100/), ms,
# Triton / PyTorch chunk kernel, delta / sum / gated rule: head 128 (run 3) forward 51.6 / 5.1, 21.3 / 2.0, 50.9 / 6.5,
# forward + backward 62 / 21, 26 / 7, 64 / 24; head 64 (run 5) forward 10.4 / 7.2, 6.2 / 1.0, 23.7 / 9.9, forward +
# backward 16.8 / 20.6, 8.2 / 3.4, 32.0 / 25.7. So CUDA runs the PyTorch kernels from width 64 on (the delta rule's
# training step at 64 is the one case where Triton was faster, 0.82x). Narrower heads (the papers' 16 and 32) keep
# Triton: not timed on a GPU.
CUDA_TORCH_CHUNK_MIN_WIDTH = 64


class CudaChunkKernel:
    """Mode "chunk" on CUDA: `triton_kernel` for heads narrower than ``CUDA_TORCH_CHUNK_MIN_WIDTH``, `torch_kernel`
    from that width on. Called as the chunk kernels are: ``(q [B, H, T, Dk], k, v [B, H, T, Dv], *gates,
    initial_state, output_final_state, chunk_size) -> (o, final_state)``."""

    def __init__(self, triton_kernel: Callable, torch_kernel: Callable):
        self.triton_kernel, self.torch_kernel = triton_kernel, torch_kernel

    def for_width(self, head_width: int) -> Callable:
        """The kernel that runs heads ``head_width = max(Dk, Dv)`` wide."""
        return self.torch_kernel if head_width >= CUDA_TORCH_CHUNK_MIN_WIDTH else self.triton_kernel

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *rest):
        return self.for_width(max(q.shape[-1], v.shape[-1]))(q, k, v, *rest)


def chunk_kernel_finder(torch_kernel, triton_kernel: str) -> KernelFinder:
    """The dispatcher's finder for mode "chunk": on CUDA, when triton imports, a :class:`CudaChunkKernel` of
    `triton_kernel` (``"<module>.<function>"`` of this package, e.g. ``"triton_chunk.delta_rule_chunk"``, imported
    lazily: it needs triton) and `torch_kernel`; else `torch_kernel` (the C++ kernel on CPU, PyTorch elsewhere)."""
    module, name = triton_kernel.split(".")

    def find(device: torch.device):
        if device.type == "cuda":
            try:
                return CudaChunkKernel(getattr(importlib.import_module(f".{module}", __package__), name), torch_kernel)
            except ImportError:  # no triton (or a saved model folder, which carries no Triton code): PyTorch on CUDA
                pass
        return torch_kernel

    return find


def run_outer_product_rule(
    recurrence: Recurrence,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gates: Dict[str, torch.Tensor],
    initial_state: Optional[torch.Tensor],
    output_final_state: bool,
    mode: str,
    chunk_size: int,
    mask: Optional[torch.Tensor],
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """What the public outer-product rules (``delta_rule``, ``gated_delta_rule``, ``linear_attention``) do with their
    arguments: check them (``ValueError`` naming the bad one), pick `recurrence`'s kernel for `mode`, take the measured
    chunk size in mode "auto" (``auto_chunk_size``), zero k and the gates at padded positions, and run it.

    Args:
        q, k: ``[B, H, T, Dk]``; v: ``[B, H, T, Dv]``.
        gates: the rule's per-position inputs ``[B, H, T]`` by argument name, in the kernel's order (``beta``, ``g``).
        initial_state, output_final_state, mode, chunk_size, mask: as the public function's.
    Returns:
        ``(o [B, H, T, Dv] in q's dtype, final_state [B, H, Dv, Dk] or None)``.
    """
    check_fast_weight_inputs(q, k, v, initial_state, chunk_size, mask, **gates)
    device = q.device
    kernel = select_kernel(recurrence, mode, q.shape[2], device)
    values = tuple(gates.values())
    if mode == "auto":  # the measured chunk size
        # (only bfloat16 inputs have a row of their own: cpu_products is a few us, on every decode step)
        products = cpu_products(q, k, v, values) if device.type == "cpu" and q.dtype == torch.bfloat16 else None
        chunk_size = auto_chunk_size(device, max(q.shape[-1], v.shape[-1]), chunk_size, products)
    if mask is not None:
        k, *values = mask_positions(mask, k, *values)
    return kernel(q, k, v, *values, initial_state, output_final_state, chunk_size)
