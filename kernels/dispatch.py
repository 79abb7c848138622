"""The front end every recurrence of fwp_kernels shares: one mode vocabulary, one registry, one dispatcher, and the
argument checks and accumulation dtype of all of them.

Each recurrence lives in a module of its own (``delta_rule_kernels.py``, ``linear_attention_kernels.py``,
``fast_rnn_scan_kernels.py``, ``recurrent_delta_rule_kernels.py``), which registers a :class:`Recurrence`: its
step-loop reference, the kernels of its other modes, and what ``"auto"`` runs. Its public function checks its
arguments and asks :func:`select_kernel` for the kernel. The modes, one vocabulary for all recurrences:

=============  ==========================================================================================
"recurrent"    the step loop in PyTorch: the ground truth every other mode is tested against (every recurrence)
"chunk"        chunkwise-parallel (delta_rule, linear_attention): C++ on CPU, Triton forward on CUDA, else PyTorch
"fused"        one compiled sequential scan (fast_rnn_scan, recurrent_delta_rule): C++ on CPU, Triton on CUDA
"auto"         what the recurrence judges fastest for the device and the length (every recurrence)
=============  ==========================================================================================

A mode a recurrence does not have raises ``ValueError`` naming ``mode``; a mode it has but cannot run on the device
(``"fused"`` where the C++ scans could not be built) raises ``NotImplementedError``.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple

import torch

MODES = ("auto", "recurrent", "chunk", "fused")

Kernel = Callable[..., Any]
# mode -> the kernel that mode runs on a device, or None where it has none there (e.g. "fused" without a build)
KernelFinder = Callable[[torch.device], Optional[Kernel]]


@dataclass(frozen=True)
class Recurrence:
    """One recurrence as the dispatcher sees it.

    Args:
        name: its public function, for messages.
        reference: the step loop, the kernel of mode "recurrent".
        kernels: the finders of its other modes (keys from ``MODES``), each ``device -> kernel or None``. Every
            kernel of a recurrence, the reference included, takes the same arguments.
        auto: ``(T, device) -> mode``: the mode "auto" runs for T positions on the device.
        description: what its kernels are called in messages ("no fused <description> is available ...").
    """

    name: str
    reference: Kernel
    kernels: Mapping[str, KernelFinder] = field(default_factory=dict)
    auto: Callable[[int, torch.device], str] = lambda T, device: "recurrent"
    description: str = "kernel"

    def __post_init__(self) -> None:
        unknown = set(self.kernels) - set(MODES[2:])
        if unknown:
            raise ValueError(f"{self.name}: `kernels` may hold the modes {MODES[2:]}, got {sorted(unknown)}")

    @functools.cached_property  # (read at every call of the public functions)
    def modes(self) -> Tuple[str, ...]:
        """The modes this recurrence accepts, in the order of ``MODES``."""
        return tuple(mode for mode in MODES if mode in ("auto", "recurrent") or mode in self.kernels)


RECURRENCES: Dict[str, Recurrence] = {}


def register(recurrence: Recurrence) -> Recurrence:
    """Adds `recurrence` to ``RECURRENCES`` (by name) and returns it."""
    RECURRENCES[recurrence.name] = recurrence
    return recurrence


def check_mode(recurrence: Recurrence, mode: str) -> None:
    """``ValueError`` naming ``mode`` unless `recurrence` has it."""
    if mode not in recurrence.modes:
        raise ValueError(f"`mode` must be one of {recurrence.modes} for {recurrence.name}, got {mode!r}")


def resolve_mode(recurrence: Recurrence, mode: str, T: int, device: torch.device) -> str:
    """The mode that runs for `mode` on T positions on `device`: `mode` itself, or the recurrence's choice for
    "auto"."""
    check_mode(recurrence, mode)
    return recurrence.auto(T, device) if mode == "auto" else mode


def select_kernel(recurrence: Recurrence, mode: str, T: int, device: torch.device) -> Kernel:
    """The kernel `recurrence` runs in `mode` for T positions on `device` (the one dispatcher of fwp_kernels).

    Raises:
        ValueError: the recurrence has no mode `mode`.
        NotImplementedError: the mode has no kernel for the device.
    """
    resolved = resolve_mode(recurrence, mode, T, device)
    if resolved == "recurrent":
        return recurrence.reference
    kernel = recurrence.kernels[resolved](device)
    if kernel is None:
        raise NotImplementedError(
            f"no {resolved} {recurrence.description} ({recurrence.name}) is available for device {device.type!r}"
        )
    return kernel


# ---------------------------------------------------------------------------------------------------------------
# what the recurrences share: accumulation dtype, argument checks, padding
# ---------------------------------------------------------------------------------------------------------------


def acc_dtype(*xs: Optional[torch.Tensor]) -> torch.dtype:
    """float32, or float64 when any input is float64: the state is never accumulated below fp32."""
    return torch.float64 if any(x is not None and x.dtype == torch.float64 for x in xs) else torch.float32


def as_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in `dtype`: x itself where it already is (``x.to`` returns x then too, after a dispatch of its own: 2.0-2.3
    against 0.3-0.4 us per tensor, by hand, Zen 3; a few per short call of the chunk kernels)."""
    return x if x.dtype == dtype else x.to(dtype)


def check_tensor(name: str, x: Any, shape: Sequence[int]) -> None:
    """``ValueError`` naming `name` unless `x` is a tensor of shape `shape`."""
    if not isinstance(x, torch.Tensor) or tuple(x.shape) != tuple(shape):
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"`{name}` must have shape {tuple(shape)}, got {got}")


def check_fast_weight_inputs(
    q: Any, k: Any, v: Any, initial_state: Any, chunk_size: Any, mask: Any, **gates: Any
) -> None:
    """Checks the arguments of the outer-product rules (``delta_rule``, ``linear_attention``): q, k ``[B, H, T, Dk]``,
    v ``[B, H, T, Dv]``, each of `gates` (e.g. ``beta=``) ``[B, H, T]``, initial_state ``[B, H, Dv, Dk]`` or None,
    a positive int chunk_size, mask ``[B, T]`` or None. Raises ``ValueError`` naming the bad argument."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            raise ValueError(f"`{name}` must be a 4-D tensor [B, H, T, D], got {getattr(x, 'shape', type(x))}")
    B, H, T, Dk = q.shape
    if k.shape != q.shape:
        raise ValueError(f"`k` must have the shape of `q` {tuple(q.shape)}, got {tuple(k.shape)}")
    if v.shape[:3] != (B, H, T):
        raise ValueError(f"`v` must be [B, H, T, Dv] with B, H, T = {(B, H, T)}, got {tuple(v.shape)}")
    for name, gate in gates.items():
        if not isinstance(gate, torch.Tensor) or tuple(gate.shape) != (B, H, T):
            raise ValueError(f"`{name}` must be [B, H, T] = {(B, H, T)}, got {getattr(gate, 'shape', type(gate))}")
    if initial_state is not None and tuple(initial_state.shape) != (B, H, v.shape[-1], Dk):
        raise ValueError(
            f"`initial_state` must be [B, H, Dv, Dk] = {(B, H, v.shape[-1], Dk)}, got {tuple(initial_state.shape)}"
        )
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"`chunk_size` must be a positive int, got {chunk_size!r}")
    if mask is not None:
        check_tensor("mask", mask, (B, T))


def mask_positions(mask: torch.Tensor, *xs: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    """Each of `xs` (``[B, H, T, ...]``) with zeros where ``mask [B, T]`` is 0 (padding): a zero key or beta writes
    nothing into an outer-product fast weight."""
    padded = (mask == 0)[:, None, :]  # [B, 1, T]
    return tuple(x.masked_fill(padded.reshape(*padded.shape, *([1] * (x.dim() - 3))), 0) for x in xs)


def initial_fast_weight(
    q: torch.Tensor, v: torch.Tensor, initial_state: Optional[torch.Tensor], dtype: torch.dtype
) -> torch.Tensor:
    """The state ``[B, H, Dv, Dk]`` a step loop starts from, in `dtype`: `initial_state`, or zeros."""
    B, H, _, Dk = q.shape
    Dv = v.shape[-1]
    if initial_state is None:
        return q.new_zeros(B, H, Dv, Dk, dtype=dtype)
    return initial_state.to(dtype)
