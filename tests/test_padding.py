"""Padding anywhere changes nothing: for every fast-weight family and variant, a sequence with padded positions
(at the start, in the middle, at the end, or inside a chunk continued from a cache) gives the cache state and the
logits at its real positions of the same sequence with the padded positions removed.

Garbage token ids (never the pad id) lie under the padding, so that a layer which reads them shows. Layouts are
strings: ``x`` a real token, ``.`` a padded position.
"""
import pytest
import torch

from modeling_fwp import (
    DeltaLSTMConfig,
    DeltaNetConfig,
    GatedDeltaNetConfig,
    LinearTransformerConfig,
    RecurrentDeltaNetConfig,
)
from modeling_fwp.cache_fwp import output_cache

from conftest import tiny_model
from test_fwl import ALL_FAST, tiny_fwl
from test_rfwp import VARIANTS, variant_id
from test_transfo_xl import fwl_model, txl_model

FAST_WEIGHT_VARIANTS = [
    (LinearTransformerConfig, {}),  # ELU+1 with attention normalisation (its default)
    (LinearTransformerConfig, {"attention_normalization": False}),
    (LinearTransformerConfig, {"feature_map": "dpfp", "dpfp_nu": 2}),
    (LinearTransformerConfig, {"feature_map": "favor", "favor_features": 12}),
    (DeltaNetConfig, {}),  # ELU+1 with sum normalisation
    (DeltaNetConfig, {"attention_normalization": True}),
    (DeltaNetConfig, {"feature_map": "dpfp", "dpfp_nu": 2}),
    (DeltaNetConfig, {"feature_map": "identity"}),
    # flash-linear-attention's Delta Net options (short convolution, L2 norm, ...) and the Gated DeltaNet
    (DeltaNetConfig, {"feature_map": "silu", "short_conv_size": 3, "value_activation": "silu", "query_scaling": True,
                      "qk_l2_normalization": True, "sum_normalization": False, "beta_bias": False, "output_norm": True,
                      "output_gate": True, "allow_neg_eigval": True, "norm_type": "rms_norm",
                      "feed_forward_type": "swiglu"}),
    (GatedDeltaNetConfig, {"num_v_heads": 8, "value_head_dim": 12}),
] + VARIANTS

# One batch: rows of different real lengths, padded at the start, in the middle, at the end, and all three.
ROWS = ["xxxxxxxxxxx", "...xxxxxxxx", "xxx..xxxx.x", "xxxxxx.....", ".xx..xxx..."]
# A prefix run with use_cache, then a chunk continued from its cache, per row; padding in both (the prefix
# rows end at different lengths; one row's prefix is only padding, another row's chunk is).
PREFIX_ROWS = ["xxxxx", "..xxx", "xx...", "xxxx.", ".....", "xxx.."]
CHUNK_ROWS = ["x..xxx", "xxxx..", "..x.xx", "......", "xx.xx.", "xxxxxx"]
RTOL, ATOL = 1e-5, 1e-6  # float32: a padded run differs from the unpadded one only by summation order


def make_model(variant, **overrides):
    cls, options = variant
    # chunk_size 4: the chunkwise kernels' chunk boundaries fall inside and between the padded stretches (for the
    # families that run a chunkwise rule)
    chunking = {} if "chunk_size" in cls.unused_fields else {"chunk_size": 4}
    return tiny_model(cls, **{**chunking, **options, **overrides})


def layout(rows, generator, vocab_size=61, device="cpu"):
    """``(ids [B, T], mask [B, T], real [list of [n_b] ids])`` for equal-length layout strings, on `device`."""
    mask = torch.tensor([[c == "x" for c in row] for row in rows], dtype=torch.long)
    ids = torch.randint(3, vocab_size, mask.shape, generator=generator)  # garbage under the padding, not the pad id
    ids, mask = ids.to(device), mask.to(device)
    return ids, mask, [ids[b][mask[b].bool()] for b in range(len(rows))]


def assert_states_equal(got_cache, expected_cache, row, label, tolerance=(RTOL, ATOL)):
    """Every tensor of every layer's state of batch row `row` equals the unbatched reference's (``(rtol, atol)``)."""
    for layer_idx, (got, expected) in enumerate(zip(got_cache.layers, expected_cache.layers)):
        assert got.states.keys() == expected.states.keys()
        for name, tensor in expected.states.items():
            torch.testing.assert_close(
                got.states[name][row : row + 1], tensor, rtol=tolerance[0], atol=tolerance[1],
                msg=lambda m: f"row {label!r}, layer {layer_idx}, state {name}: {m}",
            )


def run_alone(model, tokens):
    """``(logits [1, n, V], cache)`` of the real tokens alone (`tokens` [n], n >= 1)."""
    out = model(tokens[None], use_cache=True)
    return out.logits, output_cache(out)


def check_padded_rows(model, tolerance=(RTOL, ATOL)):
    """(a) states, (b) logits at every real position, (c) rows of different real lengths in one batch: each row of
    ROWS equals its real tokens run alone, within ``tolerance = (rtol, atol)``."""
    ids, mask, real = layout(ROWS, torch.Generator().manual_seed(0), device=model.device)
    with torch.no_grad():
        out = model(ids, attention_mask=mask, use_cache=True)
        assert torch.isfinite(out.logits).all()  # padded positions' outputs are don't-care, but finite
        for row, label in enumerate(ROWS):
            logits, cache = run_alone(model, real[row])
            torch.testing.assert_close(
                out.logits[row, mask[row].bool()], logits[0], rtol=tolerance[0], atol=tolerance[1],
                msg=lambda m: f"row {label!r}, logits: {m}",
            )
            assert_states_equal(output_cache(out), cache, row, label, tolerance)


def check_continued_chunk(model, tolerance=(RTOL, ATOL)):
    """A prefix run with use_cache, then a chunk with padding continued from that cache (attention_mask over
    past + new tokens, as generate passes it): states and real logits equal those of the real tokens in one run,
    within ``tolerance = (rtol, atol)``."""
    generator = torch.Generator().manual_seed(1)
    prefix_ids, prefix_mask, prefix_real = layout(PREFIX_ROWS, generator, device=model.device)
    chunk_ids, chunk_mask, chunk_real = layout(CHUNK_ROWS, generator, device=model.device)
    full_mask = torch.cat([prefix_mask, chunk_mask], 1)
    with torch.no_grad():
        prefix = model(prefix_ids, attention_mask=prefix_mask, use_cache=True)
        chunk = model(chunk_ids, attention_mask=full_mask, cache=output_cache(prefix), use_cache=True)
        assert torch.isfinite(chunk.logits).all()
        real_logits = torch.cat([prefix.logits, chunk.logits], 1)[full_mask.bool()]  # rows one after another
        offsets = [0] + full_mask.sum(1).cumsum(0).tolist()
        for row, label in enumerate(zip(PREFIX_ROWS, CHUNK_ROWS)):
            logits, cache = run_alone(model, torch.cat([prefix_real[row], chunk_real[row]]))
            torch.testing.assert_close(
                real_logits[offsets[row] : offsets[row + 1]], logits[0], rtol=tolerance[0], atol=tolerance[1],
                msg=lambda m: f"row {label!r}, logits: {m}",
            )
            assert_states_equal(output_cache(chunk), cache, row, label, tolerance)


@pytest.mark.parametrize("kernel_mode", ["auto", "recurrent"])
@pytest.mark.parametrize("variant", FAST_WEIGHT_VARIANTS, ids=variant_id)
def test_padded_rows_equal_each_row_alone(variant, kernel_mode):
    check_padded_rows(make_model(variant, kernel_mode=kernel_mode))


@pytest.mark.parametrize("variant", FAST_WEIGHT_VARIANTS, ids=variant_id)
def test_padded_chunk_continued_from_a_cache(variant):
    check_continued_chunk(make_model(variant))


@pytest.mark.parametrize("position_embedding_type", ["sinusoidal", "learned"])
@pytest.mark.parametrize(
    "variant",
    [(LinearTransformerConfig, {}), (DeltaNetConfig, {}), (DeltaLSTMConfig, {}), (RecurrentDeltaNetConfig, {})],
    ids=variant_id,
)
def test_absolute_positions_count_only_real_tokens(variant, position_embedding_type):
    """Positions come from the attention mask and the cache's token counts: a real token's position is the number
    of real tokens before it, wherever the padding lies."""
    model = make_model(variant, position_embedding_type=position_embedding_type, max_position_embeddings=64)
    check_padded_rows(model)
    check_continued_chunk(model)


# ---------------------------------------------------------------------------------------------------------------
# Transformer-XL and the FWL: relative distances (Transformer-XL) and next-token labels (FWL) count positions, so
# these take left padding, and padding after a row's last token within the call; not padding between real tokens.
# ---------------------------------------------------------------------------------------------------------------

POSITIONAL_MODELS = {
    "transfo_xl": lambda: txl_model(mem_len=8),  # memory >= the prefix: nothing real falls out of it
    "transfo_xl_fwl": lambda: fwl_model(mem_len=8),
    "fwl_delta_net": lambda: tiny_fwl("delta_net", fwl_fast_parameters=ALL_FAST),
    "fwl_llama": lambda: tiny_fwl("llama", fwl_fast_parameters=ALL_FAST),
}


@pytest.mark.parametrize("name", POSITIONAL_MODELS)
def test_left_padded_prefix_and_its_continuation_equal_each_row_alone(name):
    """Rows of a left-padded batch (one also padded at its end) give their real tokens' logits alone, and so does
    an unpadded chunk continued from the left-padded rows' cache."""
    model = POSITIONAL_MODELS[name]()
    vocab_size = model.config.get_text_config().vocab_size
    generator = torch.Generator().manual_seed(2)
    ids, mask, real = layout(["xxxxxxx", "...xxxx", "xxxxx..", "..xxx.."], generator, vocab_size)
    prefix_ids, prefix_mask, prefix_real = layout(["xxxxx", "..xxx", "....x"], generator, vocab_size)
    chunk = torch.randint(3, vocab_size, (3, 4), generator=generator)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits
        assert torch.isfinite(logits).all()
        for row in range(len(real)):
            torch.testing.assert_close(logits[row, mask[row].bool()], model(real[row][None]).logits[0], rtol=RTOL,
                                       atol=ATOL, msg=lambda m: f"row {row}: {m}")
        prefix = model(prefix_ids, attention_mask=prefix_mask, use_cache=True)
        full_mask = torch.cat([prefix_mask, torch.ones_like(chunk)], 1)
        continued = model(chunk, attention_mask=full_mask, cache=output_cache(prefix), use_cache=True)
        for row in range(len(prefix_real)):
            # alone in the same two calls: the FWL of Transformer-XL decays its carried update at call boundaries
            alone = model(prefix_real[row][None], use_cache=True)
            alone_chunk = model(chunk[row][None], cache=output_cache(alone), use_cache=True)
            torch.testing.assert_close(
                torch.cat([prefix.logits[row, prefix_mask[row].bool()], continued.logits[row]]),
                torch.cat([alone.logits[0], alone_chunk.logits[0]]), rtol=RTOL, atol=ATOL,
                msg=lambda m: f"continued row {row}: {m}",
            )
