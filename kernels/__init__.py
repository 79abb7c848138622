"""fwp_kernels: the fast-weight math, with no transformers import.

Public API (DESIGN.md "Kernel contract")::

    delta_rule(q, k, v, beta, *, initial_state=None, output_final_state=False, mode="auto", chunk_size=64)
    linear_attention(q, k, v, *, initial_state=None, output_final_state=False, mode="auto", chunk_size=64)

Both return ``(o, final_state or None)``. Kernels take already-transformed q, k (feature map and
normalisation are the caller's job) and apply no scaling of their own.
"""
from .dispatch import delta_rule, linear_attention

__all__ = ["delta_rule", "linear_attention"]
