"""What the scans of the recurrent Fast Weight Programmers share (Irie, Schlag, Csordas, Schmidhuber 2021): their
state, their step-loop helpers and their fused backends. The scans themselves: ``fast_rnn_scan_kernels.py`` (Delta
RNN / Delta LSTM) and ``recurrent_delta_rule_kernels.py`` (Recurrent Delta Net).

Both are sequential recurrences that no chunkwise trick parallelises, because a nonlinearity of the previous output
feeds the next step. Layout (head-first, as ``delta_rule``): ``[B, H, T, D]``, gates next to heads
``[B, H, G, T, D]``; fast weights ``[B, H, (G,) D, D]`` read as ``y = R x``, kept in float32 (float64 for float64
inputs). An optional ``mask [B, T]`` (1 = token, 0 = padding) makes padded positions leave every state unchanged:
fast weights, previous output and cell carry through, and the output there is ``y_{t-1}``.

Modes (``dispatch.MODES``): "recurrent" is the PyTorch step loop (the ground truth, differentiated by autograd);
"fused" is the compiled kernel - C++ on CPU (csrc/rfwp_scan.cpp, built on first use by ``cpp_build``, cached in
``$FWP_KERNELS_BUILD_DIR`` or ``~/.cache/fwp_kernels``), Triton on CUDA (``triton_rfwp.py``) - whose custom backward
recomputes the fast weights by undoing the updates (``R_{t-1} = R_t - delta_t k_t^T``) instead of storing one per
step; "auto" takes "fused" when available and falls back to the step loop (silently when
``FWP_KERNELS_NO_BUILD=1`` or when no C++ compiler / ninja is installed, with one warning when a build fails;
:func:`cpu_kernel_status` says which path runs). A saved model folder carries the C++ source (as ``rfwp_scan.cpp``
and as the string of ``rfwp_scan_csrc.py``, written by ``modeling_fwp.remote_code``) and builds it the same way, into
the same cache. Equations and backward: kernels/README.md.
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple, Optional, Tuple

import torch

from .cpp_build import KERNEL_CFLAGS, register_cpu_kernel
from .dispatch import KernelFinder, check_tensor

DESCRIPTION = "recurrent FWP scan"  # what the scans are called in the dispatcher's messages


class ScanState(NamedTuple):
    """Recurrent state of a scan (batch first).

    fast_weight: ``[B, H, G, D, D]`` (fast_rnn_scan) or ``[B, H, D, D]`` (recurrent_delta_rule).
    output: the last output ``y [B, H, D]``. cell: the LSTM cell ``c [B, H, D]`` (None otherwise).
    As an initial state, any field may be None (zeros).
    """

    fast_weight: Optional[torch.Tensor] = None
    output: Optional[torch.Tensor] = None
    cell: Optional[torch.Tensor] = None


# ---------------------------------------------------------------------------------------------------------------
# step-loop helpers
# ---------------------------------------------------------------------------------------------------------------


def keep_mask(mask: Optional[torch.Tensor], t: int, like: torch.Tensor) -> Optional[torch.Tensor]:
    """``mask[:, t]`` as a boolean broadcastable against `like` ``[B, ...]`` (None when there is no mask)."""
    if mask is None:
        return None
    return (mask[:, t] != 0).view(-1, *([1] * (like.dim() - 1)))


def carry(keep: Optional[torch.Tensor], new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """`new` where `keep` (a token), `old` at padded positions."""
    return new if keep is None else torch.where(keep, new, old)


def delta_write(R: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """``R + beta (v - R k) k^T`` for ``R [..., D, D]``, k, v ``[..., D]``, beta ``[...]``."""
    v_old = (R @ k.unsqueeze(-1)).squeeze(-1)
    return R + (beta.unsqueeze(-1) * (v - v_old)).unsqueeze(-1) * k.unsqueeze(-2)


# ---------------------------------------------------------------------------------------------------------------
# the fused backends: the compiled CPU kernel and the Triton kernels
# ---------------------------------------------------------------------------------------------------------------

try:  # inside a saved model folder the C++ source travels as a string (transformers copies only Python modules)
    from .rfwp_scan_csrc import CPP_SOURCE as _EMBEDDED_SOURCE
except ImportError:  # the installed package: the source is csrc/rfwp_scan.cpp
    _EMBEDDED_SOURCE = None
_CPU_KERNEL = register_cpu_kernel(
    "rfwp_scan", _EMBEDDED_SOURCE, "fwp_rfwp", "fast_rnn_forward", KERNEL_CFLAGS,
    "the PyTorch step loop (much slower)",
)
_SOURCE = _CPU_KERNEL.source_path
# Which CPU path the scans take (see CompiledCpuKernel.describe), and the build on first use (False: the step loop
# runs). Module attributes, so that tests and benchmarks can switch the C++ path off.
cpu_kernel_status = _CPU_KERNEL.describe
cpu_kernel_available = _CPU_KERNEL.available


def _triton_ops():
    from . import triton_rfwp  # needs triton; imported lazily (CUDA, or TRITON_INTERPRET=1 in tests)

    return triton_rfwp


def _triton_available() -> bool:
    try:
        _triton_ops()
    except ImportError:
        return False
    return True


def _backend(device: torch.device):
    """The fused backend for `device` (the C++ ops on CPU, the Triton wrappers with their signatures on CUDA), or
    None where there is none."""
    if device.type == "cpu" and cpu_kernel_available():
        return _CPU_KERNEL.ops
    if device.type == "cuda" and _triton_available():
        return _triton_ops()
    return None


def fused_kernel(apply: Callable[..., Tuple[torch.Tensor, ...]]) -> KernelFinder:
    """The dispatcher's finder for mode "fused": ``apply(ops, *args)`` with the backend of the device bound as `ops`,
    or None where the device has no backend."""

    def find(device: torch.device):
        ops = _backend(device)
        return None if ops is None else functools.partial(apply, ops)

    return find


def auto_mode(T: int, device: torch.device) -> str:
    """mode="auto" of the scans: "fused" when the device has a backend, else the step loop."""
    return "fused" if _backend(device) is not None else "recurrent"


# ---------------------------------------------------------------------------------------------------------------
# arguments
# ---------------------------------------------------------------------------------------------------------------


def check_initial_state(state: ScanState, shapes: dict) -> None:
    """``ValueError`` naming ``initial_state.<field>`` unless each field of `state` named in `shapes` is None or has
    its shape."""
    for name, shape in shapes.items():
        if getattr(state, name) is not None:
            check_tensor(f"initial_state.{name}", getattr(state, name), shape)


def state_or_zeros(x: Optional[torch.Tensor], shape: tuple, dtype: torch.dtype, like: torch.Tensor) -> torch.Tensor:
    """`x` in `dtype`, contiguous, or zeros of `shape`: a field of the initial ``ScanState``."""
    return like.new_zeros(shape, dtype=dtype) if x is None else x.to(dtype).contiguous()

