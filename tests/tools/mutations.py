"""The bugs `mutation_check.py` plants: realistic one-line slips, each an exact text edit of one file.

``old`` must occur exactly once in ``path`` (the check reports the entry as rotten otherwise, so that moved code
cannot silently turn a mutation into a no-op); ``tests`` are glob patterns of the test files that should catch it.
"""
from __future__ import annotations

from typing import NamedTuple, Tuple


class Mutation(NamedTuple):
    """One planted bug: replace `old` (exactly once in `path`) by `new`; `tests` should then fail."""

    name: str
    path: str
    old: str
    new: str
    tests: Tuple[str, ...]
    what: str


KERNELS = ("tests/test_kernels.py",)
RFWP = ("tests/test_rfwp.py", "tests/test_padding.py")
LINEAR = ("tests/test_model.py", "tests/test_padding.py")
FWL = ("tests/test_fwl.py", "tests/test_padding.py")
TXL = ("tests/test_transfo_xl*.py",)
EQUATIONS = ("tests/test_paper_equations.py",)
CHUNK, CHUNK_CPP, DELTA = "kernels/chunk.py", "kernels/csrc/chunk_delta.cpp", "kernels/delta_rule_kernels.py"
FAST_RNN, SCAN_CPP = "kernels/fast_rnn_scan_kernels.py", "kernels/csrc/rfwp_scan.cpp"
LAYERS, RFWP_LAYERS, FWL_PY = "modeling_fwp/fast_weight_layers.py", "modeling_fwp/rfwp_layers.py", "modeling_fwp/fwl.py"
CACHE, FEATURES = "modeling_fwp/cache_fwp.py", "modeling_fwp/feature_maps.py"
TXL_PY = "modeling_fwp/modeling_transfo_xl.py"
GATED = "kernels/gated_delta_rule_kernels.py"
DECODE_LINEAR_CPP, DENSE = "kernels/csrc/decode_linear.cpp", ("tests/test_dense.py",)

MUTATIONS: Tuple[Mutation, ...] = (
    # --- fwp_kernels: chunked delta rule, PyTorch path and C++ kernel
    Mutation("chunk_pytorch_beta_dropped_from_U", DELTA,
             "return Intra(P, bmm(Tb, v), bmm(Tb, k), T)", "return Intra(P, bmm(T, v), bmm(Tb, k), T)",
             KERNELS, "U = T V instead of T diag(beta) V"),
    Mutation("chunk_cpp_beta_dropped_from_A", CHUNK_CPP,
             "row[j] *= b[i];\n      }\n      unit_lower_solve_rm<T>(c, Dv, A, Un);",
             "row[j] *= T(1);\n      }\n      unit_lower_solve_rm<T>(c, Dv, A, Un);",
             KERNELS, "forward: A = strictly_lower(K K^T), beta left out"),
    Mutation("chunk_cpp_state_reset_per_chunk", CHUNK_CPP,
             "gemm_rm<T>(false, false, Dk, Dv, c, T(1), Kt, c, U, Dv, T(1), St, Dv);",
             "gemm_rm<T>(false, false, Dk, Dv, c, T(1), Kt, c, U, Dv, T(0), St, Dv);",
             KERNELS, "S^T <- K^T U' (overwritten, not accumulated) at each chunk"),
    Mutation("chunk_initial_state_ignored", CHUNK,
             "        state.copy_(initial_state.reshape(B * H, Dv, Dk))", "        state.zero_()",
             KERNELS, "C++ path wrapper starts from zeros whatever initial_state is"),
    # --- fwp_kernels: recurrent scans (padded steps carry y_{t-1})
    Mutation("scan_reference_padded_step_emits_new_output", FAST_RNN,
             "        outputs.append(y)\n    return torch.stack(outputs, dim=2), R, c",
             "        outputs.append(y_new)\n    return torch.stack(outputs, dim=2), R, c",
             RFWP, "fast RNN step loop: a padded step outputs y_new instead of the carried y_{t-1}"),
    Mutation("scan_cpp_rdn_padded_step_outputs_zeros", SCAN_CPP,
             "std::copy(y_prev.begin(), y_prev.end(), yt);\n      continue;",
             "std::fill(yt, yt + D, T(0));\n      continue;",
             RFWP, "Recurrent Delta Net C++ scan: a padded step outputs 0 instead of y_{t-1}"),
    # --- Linear Transformer / Delta Net layer
    Mutation("delta_layer_ignores_padding_mask", LAYERS,
             "if token_mask is not None:", "if token_mask is not None and beta is None:",
             LINEAR, "delta rule: padded positions write the fast weight"),
    Mutation("sum_layer_ignores_padding_mask", LAYERS,
             "if token_mask is not None:", "if token_mask is not None and beta is not None:",
             LINEAR, "sum rule (Linear Transformer): padded positions write the fast weight"),
    Mutation("normalizer_z_not_masked", LAYERS,
             "k = k * mask[..., None]", "v = v * mask[..., None]",
             LINEAR, "padding masks the values: the sum rule's write vanishes, z = sum phi(k) still grows"),
    Mutation("attention_normalization_denominator_dropped", LAYERS,
             "out = out / torch.where(denominator > 0, denominator, torch.ones_like(denominator))", "out = out",
             LINEAR + EQUATIONS, "eq. 28: y_t not divided by z_t . phi(q_t)"),
    Mutation("delta_retrieval_not_attention_normalized", LAYERS,
             'v, beta = attention_normalized_delta_inputs(k, v, beta, state.get("normalizer"))', "pass",
             EQUATIONS, "eq. 27: the delta rule's v_bar_t = W_{t-1} phi(k_t), not divided by z_{t-1} . phi(k_t)"),
    Mutation("sum_normalization_skipped", FEATURES,
             "phi = phi / phi.sum(-1, keepdim=True).clamp_min(1e-6)", "phi = phi",
             LINEAR, "eq. 29 not applied"),
    Mutation("dpfp_roll_direction", FEATURES,
             "torch.roll(r, shifts=-i, dims=-1)", "torch.roll(r, shifts=i, dims=-1)",
             LINEAR, "DPFP products r_j r_{j-i} instead of r_j r_{j+i} (feature order)"),
    # --- cache
    Mutation("cache_beam_reorder_skipped", CACHE,
             "self._map(lambda t: t.index_select(0, beam_idx.to(t.device)))", "self._map(lambda t: t)",
             ("tests/test_model.py", "tests/test_rfwp.py"), "reorder_cache leaves the rows as they are"),
    Mutation("cache_seen_tokens_off_by_one", CACHE,
             "self.seen_tokens += num_new_tokens", "self.seen_tokens += num_new_tokens + 1",
             ("tests/test_model.py", "tests/test_rfwp.py"), "get_seq_length counts one token too many per call"),
    # --- recurrent FWP layers
    Mutation("ddn_inner_fast_weight_written_at_padding", RFWP_LAYERS,
             "k2 = masked(self.phi(k2), token_mask, 2)\n        b2 = masked(torch.sigmoid(b2[..., 0]), token_mask, 2)",
             "k2 = self.phi(k2)\n        b2 = torch.sigmoid(b2[..., 0])",
             RFWP, "Delta-Delta Net: the inner Delta Net's keys and betas unmasked"),
    Mutation("delta_lstm_output_zeroed", RFWP_LAYERS,
             'new_state["cell"] = final.cell', 'new_state["cell"], y = final.cell, torch.zeros_like(y)',
             RFWP, "Delta LSTM layer outputs zeros (only the residual stream is left)"),
    # --- FWL (Clark et al. 2022)
    Mutation("fwl_causal_shift_removed", FWL_PY,
             "return torch.cat([first.to(new.dtype), new], dim=1)",
             "return torch.cat([new, first.to(new.dtype)], dim=1)",
             FWL, "position t's fast weights include its own loss (sees its own label)"),
    Mutation("fwl_labels_shifted_by_one", FWL_PY,
             "_slice(inter, slice(None, -1)), input_ids[:, 1:]", "_slice(inter, slice(None, -1)), input_ids[:, :-1]",
             FWL, "position j's loss uses label x_j instead of x_{j+1}"),
    Mutation("fwl_step_size_sign_flipped", FWL_PY,
             "return self.head.step_size(name).to(correction.dtype) * correction",
             "return -self.head.step_size(name).to(correction.dtype) * correction",
             FWL, "gradient ascent: theta + alpha * grad"),
    Mutation("fwl_layernorm_gradient_missing_mean", FWL_PY,
             "centred = dn if self.rms_norm else dn - dn.mean(-1, keepdim=True)",
             "centred = dn",
             FWL, "LayerNorm backward without its mean term"),
    Mutation("fwl_padding_teaches", FWL_PY,
             "return prev_weights, (None if mask is None else mask[:, :-1] * mask[:, 1:])", "return prev_weights, None",
             FWL, "padded positions' losses enter the fast weights"),
    # --- Transformer-XL
    Mutation("txl_same_length_off_by_one", TXL_PY,
             "allowed = allowed & (distance < self.config.mem_len)",
             "allowed = allowed & (distance <= self.config.mem_len)",
             TXL, "same_length: distances up to mem_len inclusive"),
    Mutation("txl_memory_one_too_long", TXL_PY,
             "start = max(0, hidden_states.shape[1] - mem_len)", "start = max(0, hidden_states.shape[1] - mem_len - 1)",
             TXL, "the memory keeps mem_len + 1 positions"),
    Mutation("txl_clamp_len_off_by_one", TXL_PY,
             "distances.clamp(max=config.clamp_len)", "distances.clamp(max=config.clamp_len - 1)",
             TXL, "relative distances clamped one short"),
    Mutation("txl_loss_ignores_num_items_in_batch", TXL_PY,
             "return (nll.sum() / num_items_in_batch).to(hidden_states.dtype)",
             "return nll.mean().to(hidden_states.dtype)",
             TXL, "the loss is a mean per call, not the token sum over num_items_in_batch"),
    # --- later additions: the gated delta rule, the short convolution's cache, the rollback of assisted decoding
    Mutation("gated_reference_decay_dropped", GATED,
             "        W = af[:, :, t, None, None] * W\n        v_old",
             "        v_old",
             KERNELS, "gated step loop: the decay a_t never applied to W_{t-1}"),
    Mutation("short_conv_cache_not_carried", LAYERS,
             "            return y.transpose(1, 2), window[..., T:]",
             "            return y.transpose(1, 2), torch.zeros_like(window[..., T:])",
             ("tests/test_fla.py", "tests/test_model.py"),
             "short convolution: the next call starts from an empty window"),
    Mutation("short_conv_decode_taps_reversed", LAYERS,
             "y = (window.to(acc) * self.weight[:, 0].to(acc)).sum(-1, keepdim=True).to(x.dtype)",
             "y = (window.to(acc) * self.weight[:, 0].flip(-1).to(acc)).sum(-1, keepdim=True).to(x.dtype)",
             ("tests/test_fla.py", "tests/test_model.py"),
             "a decode step's short convolution applies its taps reversed"),
    # --- session 26: the decode step's decay, the streaming matrix-vector kernel
    Mutation("decode_cpp_gated_decay_left_out_of_v_old", CHUNK_CPP,
             "const T d = beta != nullptr ? *beta * (v[r] - a * sk[r]) : v[r];",
             "const T d = beta != nullptr ? *beta * (v[r] - sk[r]) : v[r];",
             KERNELS, "gated decode step: the value read back from W_{t-1} k, not from the decayed a W_{t-1} k"),
    Mutation("decode_linear_fp32_tail_dropped", DECODE_LINEAR_CPP,
             "  for (; j < K; ++j) tail += w[j] * x[j];",
             "  for (; j < K; ++j) tail += 0;",
             DENSE, "streaming fp32 matrix-vector product: the last K % 16 columns left out"),
    Mutation("decode_linear_bias_dropped", DECODE_LINEAR_CPP,
             "+ (bias ? widen(bias[n]) : 0.f));",
             "+ 0.f);",
             DENSE, "streaming matrix-vector product: the bias never added"),
    # --- session 27: the fast output layer outside autograd, its running sum written in place
    Mutation("fwl_output_layer_sees_own_position", FWL_PY,
             "causal = (steps <= steps[keep][:, None]).to(work)",
             "causal = (steps <= steps[keep][:, None] + 1).to(work)",
             FWL + ("tests/test_test_time_fwl.py",),
             "outside autograd, position t's fast E and c include its own loss"),
    Mutation("fwl_output_layer_carried_sum_sign", FWL_PY,
             "z[b, :, rows].sub_(dense_linear(q, S[b, rows].to(value.dtype)))",
             "z[b, :, rows].add_(dense_linear(q, S[b, rows].to(value.dtype)))",
             FWL + ("tests/test_test_time_fwl.py",),
             "outside autograd, the carried sum of E's gradients is added, not subtracted"),
    Mutation("fwl_running_sum_written_in_place_after_a_reader", FWL_PY,
             'return S is not None and "sum.output_embedding.weight" in self.writable',
             "return S is not None",
             FWL + ("tests/test_assisted.py",),
             "E's running sum updated in place although a reader (a checkpoint) holds it"),
    Mutation("fwl_seen_columns_restriction_off_by_one", FWL_PY,
             "return (first[:, None, :] > steps[None, :, None])",
             "return (first[:, None, :] >= steps[None, :, None])",
             FWL + ("tests/test_test_time_fwl.py",), "seen rows (both paths): an entry loses its own label's row"),
    Mutation("fwl_seen_columns_weights_dropped", FWL_PY,
             "        grad.mul_(weights[..., None].to(grad.dtype))\n", "",
             FWL, "dCE/dz on the seen columns: padded positions and the previous call's masked position teach"),
    Mutation("translation_split_leaks", "training/gettext_corpus.py",
             "source == translation or source in seen", "source == translation",
             ("tests/test_translation.py",),
             "a message translated by two catalogs kept twice (possibly in two splits)"),
    Mutation("cache_reader_keeps_in_place_writes", CACHE,
             "        self.writable = frozenset()\n        return self._states",
             "        return self._states",
             FWL + ("tests/test_assisted.py",), "reading a cache layer's states leaves them writable in place"),
    Mutation("rollback_skips_replay", CACHE,
             "                    checkpoint.replay(checkpoint.num_tokens - remove)",
             "                    pass",
             ("tests/test_assisted.py",),
             "crop(-n) restores the pass's start state but never replays its accepted tokens"),
)
