"""fwp_kernels: the fast-weight math, with no transformers import.

Public API (DESIGN.md "Kernel contract")::

    delta_rule(q, k, v, beta, *, initial_state=None, output_final_state=False, mode="auto", chunk_size=64, mask=None)
    linear_attention(q, k, v, *, initial_state=None, output_final_state=False, mode="auto", chunk_size=64, mask=None)
    gated_delta_rule(q, k, v, beta, g, *, initial_state=None, output_final_state=False, mode="auto", chunk_size=64,
                     mask=None)                                       # g [B, H, T]: log-decay, a_t = exp(g_t)

All three return ``(o, final_state or None)``. Kernels take already-transformed q, k (feature map and
normalisation are the caller's job) and apply no scaling of their own.

Recurrent FWP scans (Irie et al. 2021), same layout, states in a ``ScanState``::

    fast_rnn_scan(z, k, v, beta, *, cell="rnn_b", initial_state=None, mask=None, output_final_state=False, mode="auto")
    recurrent_delta_rule(q, k, v, beta, r_q, r_k, r_v, r_beta, *, initial_state=None, mask=None,
                         output_final_state=False, mode="auto")

Every recurrence takes ``mode`` from one vocabulary, ``MODES`` ("auto", "recurrent", "chunk", "fused"; "recurrent",
the step loop, everywhere; dispatch.py says which recurrence has which) and the padding mask ``mask [B, T]`` (0 at
padded positions, which write nothing). One module per recurrence: ``<function>_kernels.py``.

Vocabulary-sized products of the Fast Weight Layers (dense.py; Clark et al. 2022)::

    dense_linear(x, weight, bias=None)                                  # x W^T + b, oneDNN on CPU
    dense_linears(x, weights)                          # (x W_1^T, x W_2^T, ...): a decode step's one pass over all
    linear_cross_entropy_input_gradient(x, weight, bias, target, scale=None)   # scale (softmax(x W^T + b) - onehot) W

A decode step's other per-token ops in one C++ pass each, where ``cpu_ops_apply(*tensors)`` (CPU inference)::

    short_conv_step(x, cache, weight)                  # one position of a depthwise causal convolution
    short_conv(x, cache, weight)                       # the same over T positions, channels last (a prefill)
    normalize_rows(x, weight, eps, mean_square)        # RMSNorm (mean_square) or L2 normalisation of each row

A pre-norm RMSNorm / SwiGLU block's decode step around its mixing layer in two C++ calls, where
``block_ops_apply(x, norm_weights, weights)``::

    norm_linears(x, norm_weight, eps, weights)         # (RMSNorm(x) W_1^T, RMSNorm(x) W_2^T, ...)
    swiglu_block(x, mixed, o_weight, norm_weight, eps, gate_weight, up_weight, down_weight)   # h + SwiGLU(norm(h))

A model's CPU forward over many positions keeps its large freed buffers for reuse (no page faults on fresh memory)::

    with reusing_cpu_buffers(hidden_states): ...       # a no-op on GPU, for short inputs and under torch.compile

A Delta Net / Gated DeltaNet layer's whole decode step between its projections in one C++ call, where
``token_step_applies(*tensors)`` and its feature map is one of ``TOKEN_STEP_FEATURE_MAPS`` (token_step.py)::

    fast_weight_token_step(q, k, v, num_heads, num_value_heads, *, beta_logits, beta_scale, decay, state,
                           conv_weights, conv_states, feature_map, sum_normalization, value_silu, l2_eps,
                           query_scale, norm_weight, norm_eps, gate, gate_activation)  # -> (out, state, conv states)

and a whole RMSNorm / SwiGLU block's decode step around it in one C++ call (norm_linears, the token step, then
swiglu_block), where both apply::

    block_decode_step(x, norm_weights, eps, weights, num_heads, num_value_heads, *, has_beta, has_gate,
                      decay_parameters, beta_scale, state, conv_weights, ...)      # -> (out, state, conv states)

or prepared first and run later, a model's blocks one after the other (its outputs allocated, not yet computed)::

    call = prepare_block_decode_step(x, ...)   # the same arguments -> BlockDecodeCall(arguments, out, ...)
    new_state = call.run()                     # computes out and call.new_conv_states, returns the new state
"""
import importlib
import importlib.metadata
import importlib.util
import sys
from pathlib import Path


def _hub_kernels_package():
    """Hugging Face's own ``kernels`` (the kernel hub), loaded from where it is installed, or None where it is not.
    transformers >= 5.25 requires it and imports it with its own first import; from the repository's root this
    folder comes first on ``sys.path`` under that name, and must give way to it."""
    try:
        init = Path(importlib.metadata.distribution("kernels").locate_file("kernels/__init__.py"))
    except importlib.metadata.PackageNotFoundError:
        return None
    if not init.is_file() or init.resolve() == Path(__file__).resolve():
        return None
    spec = importlib.util.spec_from_file_location("kernels", init, submodule_search_locations=[str(init.parent)])
    package = importlib.util.module_from_spec(spec)
    sys.modules["kernels"] = package
    try:
        spec.loader.exec_module(package)
    except BaseException:
        del sys.modules["kernels"]
        raise
    return package


def _installed_package():
    """The package to stand for this folder when it is imported under another name than ``fwp_kernels``, else None.
    Where the repository's root is on ``sys.path`` the folder is also a top-level ``kernels``, the import name of the
    Hub's ``kernels`` library that transformers probes (``is_kernels_available``) and imports. As ``kernels`` it is
    the Hub's library where that is installed; otherwise the same module object as ``fwp_kernels``, so that its
    modules, C++ builds and torch ops exist once per process."""
    if __name__ == "fwp_kernels":
        return None
    if __name__ == "kernels":
        hub = _hub_kernels_package()
        if hub is not None:
            return hub
    try:
        return importlib.import_module("fwp_kernels")
    except ImportError:  # not installed: this folder is the package, under the name it was imported by
        return None


_PACKAGE = _installed_package()
if _PACKAGE is not None:
    sys.modules[__name__] = _PACKAGE
else:
    from .delta_rule_kernels import delta_rule
    from .dense import (
        block_ops_apply, cpu_ops_apply, dense_linear, dense_linears, linear_cross_entropy_input_gradient,
        norm_linears, normalize_rows, reusing_cpu_buffers, short_conv, short_conv_step, swiglu_block,
    )
    from .dispatch import MODES
    from .fast_rnn_scan_kernels import fast_rnn_scan
    from .gated_delta_rule_kernels import gated_delta_rule
    from .linear_attention_kernels import linear_attention
    from .recurrent_delta_rule_kernels import recurrent_delta_rule
    from .rfwp_scan import ScanState
    from .token_step import (
        TOKEN_STEP_FEATURE_MAPS, BlockDecodeCall, block_decode_step, fast_weight_token_step,
        prepare_block_decode_step, token_step_applies,
    )

__all__ = [
    "delta_rule",
    "linear_attention",
    "gated_delta_rule",
    "ScanState",
    "fast_rnn_scan",
    "recurrent_delta_rule",
    "dense_linear",
    "dense_linears",
    "linear_cross_entropy_input_gradient",
    "cpu_ops_apply",
    "short_conv_step",
    "short_conv",
    "normalize_rows",
    "block_ops_apply",
    "norm_linears",
    "swiglu_block",
    "reusing_cpu_buffers",
    "fast_weight_token_step",
    "block_decode_step",
    "prepare_block_decode_step",
    "BlockDecodeCall",
    "token_step_applies",
    "TOKEN_STEP_FEATURE_MAPS",
    "MODES",
]
