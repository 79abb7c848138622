"""Argument checking and mode dispatch for the public kernels."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .recurrent import delta_rule_recurrent, linear_attention_recurrent

MODES = ("auto", "recurrent", "chunk")

try:  # the chunkwise-parallel kernels (optional until they land)
    from .chunk import cpu_kernel_available as _chunk_cpu_kernel_available
    from .chunk import delta_rule_chunk, linear_attention_chunk  # noqa: F401

    _HAS_CHUNK = True
except ImportError:  # pragma: no cover - exercised only while chunk.py is absent
    _HAS_CHUNK = False


def _check_inputs(q, k, v, beta, initial_state, mode, chunk_size) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            raise ValueError(f"`{name}` must be a 4-D tensor [B, H, T, D], got {getattr(x, 'shape', type(x))}")
    B, H, T, Dk = q.shape
    if k.shape != q.shape:
        raise ValueError(f"`k` must have the shape of `q` {tuple(q.shape)}, got {tuple(k.shape)}")
    if v.shape[:3] != (B, H, T):
        raise ValueError(f"`v` must be [B, H, T, Dv] with B, H, T = {(B, H, T)}, got {tuple(v.shape)}")
    if beta is not None and tuple(beta.shape) != (B, H, T):
        raise ValueError(f"`beta` must be [B, H, T] = {(B, H, T)}, got {tuple(beta.shape)}")
    if initial_state is not None and tuple(initial_state.shape) != (B, H, v.shape[-1], Dk):
        raise ValueError(
            f"`initial_state` must be [B, H, Dv, Dk] = {(B, H, v.shape[-1], Dk)}, got {tuple(initial_state.shape)}"
        )
    if mode not in MODES:
        raise ValueError(f"`mode` must be one of {MODES}, got {mode!r}")
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"`chunk_size` must be a positive int, got {chunk_size!r}")


# mode="auto": inputs up to this many positions run as a step loop, longer ones chunkwise.
# CPU, measured (benchmarks/bench_kernels.py, fp32, D = 64, B*H = 8 and 32, one thread): the C++ chunk
# kernel (chunk.py, csrc/chunk_delta.cpp) is faster than the loop from T = 2 on and ties with it at T = 1;
# without it, the PyTorch chunked kernel's fixed cost (~40 tensor ops) equals about 3 steps of the loop.
# CUDA, estimated (no GPU was available to measure): a step costs ~5 kernel launches, the Triton
# forward two, so only single-token decode steps stay on the loop.
_RECURRENT_MAX_T = {"cpu": 1, "cuda": 1}
_RECURRENT_MAX_T_CPU_PYTORCH = 3  # CPU when the C++ chunk kernel is not built
_RECURRENT_MAX_T_DEFAULT = 3


def _recurrent_max_t(device: torch.device) -> int:
    if device.type == "cpu":
        return _RECURRENT_MAX_T["cpu"] if _chunk_cpu_kernel_available() else _RECURRENT_MAX_T_CPU_PYTORCH
    return _RECURRENT_MAX_T.get(device.type, _RECURRENT_MAX_T_DEFAULT)


def _resolve_mode(mode: str, T: int, device: torch.device) -> str:
    if mode == "chunk" and not _HAS_CHUNK:
        raise NotImplementedError("mode='chunk' is not available in this build of fwp_kernels")
    if mode != "auto":
        return mode
    # Decode steps (and very short inputs) are cheapest as a plain step; longer inputs use the
    # chunkwise-parallel form.
    if not _HAS_CHUNK or T <= 1 or T <= _recurrent_max_t(device):
        return "recurrent"
    return "chunk"


def _chunk_kernels(device: torch.device):
    """(delta_rule_chunk, linear_attention_chunk) for the device: Triton on CUDA when importable."""
    if device.type == "cuda":
        try:
            from . import triton_chunk
        except ImportError:  # no triton: the PyTorch chunked kernels run on CUDA as well
            pass
        else:
            return triton_chunk.delta_rule_chunk, triton_chunk.linear_attention_chunk
    return delta_rule_chunk, linear_attention_chunk


def delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    *,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    mode: str = "auto",
    chunk_size: int = 64,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Delta rule fast weights: ``W_t = W_{t-1} + beta_t (v_t - W_{t-1} k_t) k_t^T``, ``o_t = W_t q_t``.

    Args:
        q, k: ``[B, H, T, Dk]``; v: ``[B, H, T, Dv]``; beta: ``[B, H, T]``.
        initial_state: ``[B, H, Dv, Dk]`` or None (zeros).
        output_final_state: return the final ``[B, H, Dv, Dk]`` float32 state.
        mode: "recurrent" (step loop), "chunk" (chunkwise-parallel) or "auto".
        chunk_size: chunk length for mode "chunk" (any T works; the last chunk is padded internally).
    Returns:
        ``(o [B, H, T, Dv] in q's dtype, final_state or None)``.
    """
    _check_inputs(q, k, v, beta, initial_state, mode, chunk_size)
    if _resolve_mode(mode, q.shape[2], q.device) == "chunk":
        return _chunk_kernels(q.device)[0](q, k, v, beta, initial_state, output_final_state, chunk_size)
    return delta_rule_recurrent(q, k, v, beta, initial_state, output_final_state)


def linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    mode: str = "auto",
    chunk_size: int = 64,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Sum-rule fast weights (linear attention): ``W_t = W_{t-1} + v_t k_t^T``, ``o_t = W_t q_t``.

    Args:
        q, k: ``[B, H, T, Dk]``; v: ``[B, H, T, Dv]``; initial_state ``[B, H, Dv, Dk]`` or None.
        output_final_state, mode, chunk_size: as in :func:`delta_rule`.
    Returns:
        ``(o [B, H, T, Dv] in q's dtype, final_state or None)``.
    """
    _check_inputs(q, k, v, None, initial_state, mode, chunk_size)
    if _resolve_mode(mode, q.shape[2], q.device) == "chunk":
        return _chunk_kernels(q.device)[1](q, k, v, initial_state, output_final_state, chunk_size)
    return linear_attention_recurrent(q, k, v, initial_state, output_final_state)
