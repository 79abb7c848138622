"""One position of a whole Delta Net / Gated DeltaNet layer between its projections, in one C++ call on CPU.

A decode step of a fast-weight layer is a dozen small ops after its projections (the short convolutions, the feature
map and value activation, the L2 norms, beta, the decay, the state update and read-out, the output norm and gate):
each costs more in Python and dispatch than in arithmetic (about 110 of a layer's 160 us, bfloat16, hidden size 256,
by hand). ``token_step`` in csrc/chunk_delta.cpp runs them all in one call and rounds each value where the unfused ops
store one (bfloat16 follows them step by step; sums and the state in float32); modeling_fwp's
``FastWeightLinearAttention`` calls :func:`fast_weight_token_step` for a decode step where
:func:`token_step_applies`, and the unfused ops otherwise.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Optional, Sequence, Tuple

import torch

from . import chunk, dense

FEATURE_MAP_CODES = {"identity": 0, "silu": 1, "relu": 2, "elu": 3}  # phi as csrc/chunk_delta.cpp's token::FeatureMap
GATE_ACTIVATION_CODES = {"silu": 1, "sigmoid": 2}
TOKEN_STEP_FEATURE_MAPS = frozenset(FEATURE_MAP_CODES)  # the feature maps fast_weight_token_step computes
_DTYPES = (torch.float32, torch.bfloat16)


def token_step_applies(*tensors: Optional[torch.Tensor]) -> bool:
    """Whether :func:`fast_weight_token_step` may run on `tensors` (None entries skipped): the C++ kernel is built,
    they are CPU tensors of one dtype, float32 or bfloat16, outside autograd and autocast (the op has no backward)."""
    dtype = tensors[0].dtype
    if dtype not in _DTYPES or torch.is_grad_enabled() or torch.is_autocast_enabled("cpu"):
        return False
    for t in tensors:
        if t is not None and (not t.is_cpu or t.dtype != dtype):
            return False
    return chunk.cpu_kernel_available()


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int, num_value_heads: int,
                  feature_map: str, gate_activation: str) -> None:
    """ValueError naming the argument unless the shapes, head counts and options are ones the op takes (the op
    checks the optional tensors' sizes and every dtype itself)."""
    if q.dim() != 2 or k.shape != q.shape or v.dim() != 2 or v.shape[0] != q.shape[0]:
        raise ValueError(f"`q`, `k` must be [B, H * Dk] and `v` [B, Hv * Dv], got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    _check_heads_and_options(q.shape[1], v.shape[1], num_heads, num_value_heads, feature_map, gate_activation)


def _check_heads_and_options(q_width: int, v_width: int, num_heads: int, num_value_heads: int, feature_map: str,
                             gate_activation: str) -> None:
    """ValueError naming the argument unless the head counts divide q's and v's widths (H * Dk, Hv * Dv) and the
    options are ones the op has."""
    if num_heads < 1 or q_width % num_heads or num_value_heads % num_heads or v_width % num_value_heads:
        raise ValueError(f"`num_heads` ({num_heads}) must divide q's {q_width} columns and `num_value_heads` "
                         f"({num_value_heads}), which must divide v's {v_width}")
    if feature_map not in FEATURE_MAP_CODES:
        raise ValueError(f"`feature_map` must be one of {sorted(FEATURE_MAP_CODES)}, got {feature_map!r}")
    if gate_activation not in GATE_ACTIVATION_CODES:
        raise ValueError(f"`gate_activation` must be one of {sorted(GATE_ACTIVATION_CODES)}, got {gate_activation!r}")


def _conv_outputs(x: torch.Tensor, conv_weights: Sequence[torch.Tensor],
                  conv_states: Sequence[Optional[torch.Tensor]]) -> Tuple[list, list]:
    """The convolution states the token step reads (zeros ``[B, C, K - 1]`` in x's dtype for None; the others as
    given) and new ones for it to write (contiguous, in x's dtype); conv_weights ``[C, K]`` or ``[C, 1, K]``."""
    states, new_states = [], []
    for w, s in zip(conv_weights, conv_states):
        if s is None:
            s = x.new_zeros(x.shape[0], w.shape[0], w.shape[-1] - 1)
        states.append(s)
        new_states.append(x.new_empty(s.shape))
    return states, new_states


def fast_weight_token_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    num_heads: int,
    num_value_heads: int,
    *,
    beta_logits: Optional[torch.Tensor] = None,
    beta_scale: float = 1.0,
    decay: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
    state: Optional[torch.Tensor] = None,
    conv_weights: Optional[Sequence[torch.Tensor]] = None,
    conv_states: Optional[Sequence[Optional[torch.Tensor]]] = None,
    feature_map: str = "identity",
    sum_normalization: bool = False,
    value_silu: bool = False,
    l2_eps: Optional[float] = None,
    query_scale: Optional[float] = None,
    norm_weight: Optional[torch.Tensor] = None,
    norm_eps: float = 1e-6,
    gate: Optional[torch.Tensor] = None,
    gate_activation: str = "silu",
) -> Tuple[torch.Tensor, torch.Tensor, Tuple[torch.Tensor, ...]]:
    """One position of a fast-weight layer from its projections to the input of its output projection.

    Per sequence: the short causal convolution's step on q, k, v (`conv_weights` given); ``phi`` (`feature_map`:
    identity, silu, relu or elu, i.e. ELU + 1) on q and k, divided by its sum per head (`sum_normalization`, Schlag et
    al. 2021 eq. 29: ``phi / max(sum phi, 1e-6)``), SiLU on v (`value_silu`); the L2 norm of each query and key
    head (`l2_eps` given: ``x / sqrt(|x|^2 + l2_eps)``) and the query scale; ``beta = beta_scale * sigmoid(beta
    logits)`` (Schlag et al. 2021 eq. 21; None: the sum rule, eq. 17); the gated delta rule's log-decay
    ``g = -exp(A_log) softplus(a + dt_bias)`` (`decay` = ``(a [B, Hv], A_log [Hv], dt_bias [Hv])``); the state's
    update and read-out (eqs. 20-25, decayed by ``exp(g)``; value head j reads query / key head ``j // (Hv / H)``);
    then per value head RMSNorm times `norm_weight` and the gate ``act(gate)`` (`gate_activation`).

    Args:
        q, k: ``[B, H * Dk]``; v: ``[B, Hv * Dv]``; beta_logits: ``[B, Hv]``; gate: ``[B, Hv * Dv]``: the
            projections of one position, all of one dtype (``token_step_applies``).
        state: ``[B, Hv, Dv, Dk]`` or None (zeros); conv_weights: ``[C, K]`` for q, k, v; conv_states: ``[B, C, K -
            1]`` each, or None (zeros); norm_weight: ``[Dv]``.
    Returns:
        ``(out [B, Hv * Dv] in q's dtype, new state [B, Hv, Dv, Dk] float32, new conv states [B, C, K - 1] each)``;
        the inputs are not written.
    """
    _check_inputs(q, k, v, num_heads, num_value_heads, feature_map, gate_activation)
    B = q.shape[0]
    Dk, Dv = q.shape[1] // num_heads, v.shape[1] // num_value_heads
    conv_weights = [w.contiguous() for w in conv_weights or ()]
    conv_states, new_conv_states = _conv_outputs(q, conv_weights, conv_states or [None] * len(conv_weights))
    conv_states = [s.to(q.dtype).contiguous() for s in conv_states]
    new_state = q.new_empty(B, num_value_heads, Dv, Dk, dtype=torch.float32)
    out = torch.empty_like(v)
    a, A_log, dt_bias = decay or (None, None, None)
    beta_logits, a, gate = (None if x is None else x.contiguous() for x in (beta_logits, a, gate))
    chunk._CPU_KERNEL.ops.token_step(
        q.contiguous(), k.contiguous(), v.contiguous(), beta_logits, a, A_log, dt_bias, gate, conv_weights,
        conv_states, None if state is None else state.contiguous(), norm_weight, num_heads,
        FEATURE_MAP_CODES[feature_map], sum_normalization, value_silu, -1.0 if l2_eps is None else l2_eps,
        query_scale or 0.0, beta_scale, norm_eps, GATE_ACTIVATION_CODES[gate_activation] if gate is not None else 0,
        new_conv_states, new_state, out,
    )
    return out, new_state, tuple(new_conv_states)


# fast_weight_token_step's keyword arguments that block_decode_step takes as they are, with their defaults
LAYER_OPTIONS = {"beta_scale": 1.0, "state": None, "conv_weights": (), "conv_states": (), "feature_map": "identity",
                 "sum_normalization": False, "value_silu": False, "l2_eps": None, "query_scale": None,
                 "norm_weight": None, "norm_eps": 1e-6, "gate_activation": "silu"}


class BlockDecodeCall(NamedTuple):
    """A block's decode step ready to run (:func:`prepare_block_decode_step`): the op's arguments, checked, and its
    outputs but the new state, allocated and not yet computed; ``run()`` computes them (once: the op reads ``x`` and
    the states given and writes only the outputs). A model may prepare the calls of all its blocks, each block's ``x``
    the ``out`` of the one before, and then run them in order."""

    arguments: tuple                           # the op's, up to its new state and out
    out: torch.Tensor                          # [M, D]
    new_conv_states: Tuple[torch.Tensor, ...]  # [M, C, K - 1] each
    state_shape: Tuple[int, int, int, int]     # [M, Hv, Dv, Dk]

    def run(self) -> torch.Tensor:
        """Computes ``out`` and ``new_conv_states`` (csrc/decode_linear.cpp's ``block_decode_step``) and returns the
        new state ``[M, Hv, Dv, Dk]`` float32, allocated as the call runs: where a model runs its blocks' calls in
        turn and lets each old state go after its call, the next new state takes its memory (all of them allocated
        before the calls, the heap grew by a whole model's states each step and glibc gave it back, faulted in again
        at the next: 8-12 thousand page faults on every other step of the 1.3B's batch-2 bfloat16 decode)."""
        new_state = self.out.new_empty(self.state_shape, dtype=torch.float32)
        dense._CPU_KERNEL.ops.block_decode_step(*self.arguments, new_state, self.out)
        return new_state


def prepare_block_decode_step(
    x: torch.Tensor,
    norm_weights: Tuple[torch.Tensor, torch.Tensor],
    eps: Tuple[float, float],
    weights: Sequence[torch.Tensor],
    num_heads: int,
    num_value_heads: int,
    *,
    has_beta: bool,
    has_gate: bool,
    decay_parameters: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
    **options: Any,
) -> BlockDecodeCall:
    """:func:`block_decode_step`'s checks and allocations, without running it: its call (``BlockDecodeCall.run()``
    computes what :func:`block_decode_step` returns); ``x``'s values are read only when the call runs.

    Args:
        x: ``[M, D]``; norm_weights: the block's two RMSNorm weights ``[D]``, `eps` their eps.
        weights: the layer's projection weights ``[N_g, D]`` (q, k, v, then beta's where `has_beta`, the output
            gate's where `has_gate`, the decay's where `decay_parameters` = ``(A_log [Hv], dt_bias [Hv])`` are given),
            then ``o_proj`` ``[D, Hv * Dv]``, the feed-forward's gate and up ``[F, D]`` and down ``[D, F]``.
        options: the layer's, as :func:`fast_weight_token_step` takes them (``LAYER_OPTIONS``: beta_scale, state,
            conv_weights ``[C, 1, K]`` or ``[C, K]``, conv_states, ..., gate_activation).
    Returns:
        ``BlockDecodeCall(arguments, out [M, D], new_conv_states, state_shape)``; its ``run()`` returns the new state.
    """
    if not options.keys() <= LAYER_OPTIONS.keys():
        raise TypeError(f"block_decode_step() takes the options {sorted(LAYER_OPTIONS)}, got "
                        f"{sorted(options.keys() - LAYER_OPTIONS.keys())}")
    layer = {**LAYER_OPTIONS, **options}  # the layer's options, defaults filled in
    if len(weights) != 7 + has_beta + has_gate + (decay_parameters is not None):
        raise ValueError(f"`weights` must hold the layer's {3 + has_beta + has_gate + (decay_parameters is not None)} "
                         f"projection weights, o_proj's and the feed-forward's three, got {len(weights)}")
    q_weight, v_weight = weights[0], weights[2]  # their rows: q's and v's columns
    _check_heads_and_options(q_weight.shape[0], v_weight.shape[0], num_heads, num_value_heads, layer["feature_map"],
                             layer["gate_activation"])
    *projections, o_weight, gate_weight, up_weight, down_weight = weights
    optional = [has_beta, has_gate, decay_parameters is not None]  # their outputs follow q, k, v in this order
    beta_index, gate_index, decay_index = (3 + sum(optional[:i]) if optional[i] else -1 for i in range(3))
    A_log, dt_bias = decay_parameters or (None, None)
    states, new_states = _conv_outputs(x, layer["conv_weights"], layer["conv_states"])
    state_shape = (x.shape[0], num_value_heads, v_weight.shape[0] // num_value_heads, q_weight.shape[0] // num_heads)
    out = torch.empty_like(x)
    arguments = (
        x, norm_weights[0], float(eps[0]), projections, _token_step_op_name(), beta_index, gate_index, decay_index,
        A_log, dt_bias, list(layer["conv_weights"]), states, layer["state"], layer["norm_weight"], num_heads,
        FEATURE_MAP_CODES[layer["feature_map"]], layer["sum_normalization"], layer["value_silu"],
        -1.0 if layer["l2_eps"] is None else layer["l2_eps"], layer["query_scale"] or 0.0, layer["beta_scale"],
        layer["norm_eps"],
        GATE_ACTIVATION_CODES[layer["gate_activation"]] if has_gate else 0, o_weight, norm_weights[1], float(eps[1]),
        gate_weight, up_weight, down_weight, new_states,
    )
    return BlockDecodeCall(arguments, out, tuple(new_states), state_shape)


def block_decode_step(x: torch.Tensor, norm_weights: Tuple[torch.Tensor, torch.Tensor], eps: Tuple[float, float],
                      weights: Sequence[torch.Tensor], *heads: int, **settings: Any
                      ) -> Tuple[torch.Tensor, torch.Tensor, Tuple[torch.Tensor, ...]]:
    """A decode step of a whole pre-norm block with RMSNorms and a SwiGLU feed-forward around a fast-weight layer, in
    one C++ call where ``block_ops_apply`` and ``token_step_applies`` (``csrc/decode_linear.cpp``,
    ``block_decode_step``): ``norm_linears`` into the layer's projections, the layer's token step on them (as
    :func:`fast_weight_token_step`), then ``swiglu_block``; the same values as those three calls.

    Args:
        x, norm_weights, eps, weights, heads (`num_heads`, `num_value_heads`) and settings (`has_beta`, `has_gate`,
            `decay_parameters` and the layer's options): as :func:`prepare_block_decode_step` takes them.
    Returns:
        ``(out [M, D], new state [M, Hv, Dv, Dk] float32, new conv states [M, C, K - 1] each)``; the inputs are not
        written.
    """
    call = prepare_block_decode_step(x, norm_weights, eps, weights, *heads, **settings)
    new_state = call.run()
    return call.out, new_state, call.new_conv_states


def _token_step_op_name() -> str:
    """The qualified name of the chunk kernel's token_step op (``block_decode_step`` calls it by name)."""
    return f"{chunk._CPU_KERNEL.ops.name}::token_step"
