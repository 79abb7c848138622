"""fwp_kernels: the fast-weight math, with no transformers import.

Public API (DESIGN.md "Kernel contract")::

    delta_rule(q, k, v, beta, *, initial_state=None, output_final_state=False, mode="auto", chunk_size=64)
    linear_attention(q, k, v, *, initial_state=None, output_final_state=False, mode="auto", chunk_size=64)

Both return ``(o, final_state or None)``. Kernels take already-transformed q, k (feature map and
normalisation are the caller's job) and apply no scaling of their own.

Recurrent FWP scans (rfwp_scan.py; Irie et al. 2021), same layout, states in a ``ScanState``::

    fast_rnn_scan(z, k, v, beta, *, cell="rnn_b", initial_state=None, mask=None, output_final_state=False, mode="auto")
    recurrent_delta_rule(q, k, v, beta, r_q, r_k, r_v, r_beta, *, initial_state=None, mask=None,
                         output_final_state=False, mode="auto")
"""
from .dispatch import delta_rule, linear_attention
from .rfwp_scan import ScanState, fast_rnn_scan, recurrent_delta_rule

__all__ = ["delta_rule", "linear_attention", "ScanState", "fast_rnn_scan", "recurrent_delta_rule"]
