"""Transformer-XL (+ FWL) for transformers 5: converter, memories, adaptive softmax, FWL carry-over, dynamic
evaluation."""
import json
import math
import pathlib

import pytest
import torch
import torch.nn.functional as F

from modeling_fwp import TransfoXLConfig, TransfoXLForCausalLM, convert_transfo_xl_checkpoint

V = 100
CUTOFFS = [20, 40, 70]  # 4 clusters


def txl_config(**overrides) -> TransfoXLConfig:
    kwargs = dict(
        vocab_size=V, cutoffs=CUTOFFS, hidden_size=32, embedding_size=128, num_attention_heads=4, head_dim=8,
        intermediate_size=48, num_hidden_layers=2, div_val=4, mem_len=6, clamp_len=9, same_length=True,
        hidden_dropout=0.0, attention_dropout=0.0, eos_token_id=0,
    )
    kwargs.update(overrides)
    return TransfoXLConfig(**kwargs)


def txl_model(seed=0, **overrides) -> TransfoXLForCausalLM:
    torch.manual_seed(seed)
    model = TransfoXLForCausalLM(txl_config(**overrides)).eval()
    with torch.no_grad():  # non-zero biases and LayerNorm gains, so that every parameter matters
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def ids_of(*shape, seed=1):
    return torch.randint(0, V, shape, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------------------------
# A transformers-4 checkpoint written from scratch in the legacy layout, and a reference forward on its keys
# ---------------------------------------------------------------------------------------------------------------

LEGACY_CONFIG = dict(
    architectures=["TransfoXLLMHeadModel"], model_type="transfo-xl", vocab_size=V, cutoffs=CUTOFFS, d_model=32,
    d_embed=128, n_head=4, d_head=8, d_inner=48, div_val=4, pre_lnorm=False, n_layer=2, mem_len=6, clamp_len=9,
    same_length=True, proj_share_all_but_first=True, tie_projs=[False, True, True, True], attn_type=0,
    sample_softmax=-1, adaptive=True, dropout=0.1, dropatt=0.0, untie_r=True, init="normal", init_range=0.01,
    proj_init_std=0.01, init_std=0.02, layer_norm_epsilon=1e-5, eos_token_id=0, tie_word_embeddings=True,
)


def legacy_state_dict(c: dict, seed: int = 0) -> dict:
    """Random tensors under transformers 4's TransfoXLLMHeadModel keys and shapes, tied copies sharing storage."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *shape, scale=0.2: torch.randn(*shape, generator=g) * scale  # noqa: E731
    D, E, H, Dh, L = c["d_model"], c["d_embed"], c["n_head"], c["d_head"], c["n_layer"]
    ends = c["cutoffs"] + [c["vocab_size"]]
    bounds = list(zip([0] + ends[:-1], ends))
    dims = [E // c["div_val"] ** i for i in range(len(bounds))]
    sd = {}
    for i, ((start, end), d) in enumerate(zip(bounds, dims)):
        sd[f"transformer.word_emb.emb_layers.{i}.weight"] = rnd(end - start, d)
        sd[f"transformer.word_emb.emb_projs.{i}"] = rnd(D, d)
    for l in range(L):
        p = f"transformer.layers.{l}."
        sd[p + "dec_attn.r_r_bias"], sd[p + "dec_attn.r_w_bias"] = rnd(H, Dh), rnd(H, Dh)
        sd[p + "dec_attn.qkv_net.weight"] = rnd(3 * H * Dh, D)
        sd[p + "dec_attn.o_net.weight"] = rnd(D, H * Dh)
        sd[p + "dec_attn.layer_norm.weight"], sd[p + "dec_attn.layer_norm.bias"] = 1 + rnd(D), rnd(D)
        sd[p + "dec_attn.r_net.weight"] = rnd(H * Dh, D)
        sd[p + "pos_ff.CoreNet.0.weight"], sd[p + "pos_ff.CoreNet.0.bias"] = rnd(c["d_inner"], D), rnd(c["d_inner"])
        sd[p + "pos_ff.CoreNet.3.weight"], sd[p + "pos_ff.CoreNet.3.bias"] = rnd(D, c["d_inner"]), rnd(D)
        sd[p + "pos_ff.layer_norm.weight"], sd[p + "pos_ff.layer_norm.bias"] = 1 + rnd(D), rnd(D)
    sd["transformer.pos_emb.inv_freq"] = 1 / (10000 ** (torch.arange(0.0, D, 2.0) / D))
    if len(bounds) > 1:
        sd["crit.cluster_weight"], sd["crit.cluster_bias"] = rnd(len(bounds) - 1, E), rnd(len(bounds) - 1)
    for i, (start, end) in enumerate(bounds):
        sd[f"crit.out_layers.{i}.weight"] = sd[f"transformer.word_emb.emb_layers.{i}.weight"]  # tie_weight
        sd[f"crit.out_layers.{i}.bias"] = rnd(end - start)
        tied = c["tie_projs"][i]
        sd[f"crit.out_projs.{i}"] = sd[f"transformer.word_emb.emb_projs.{i}"] if tied else rnd(D, dims[i])
    return sd


def reference_forward(sd: dict, c: dict, ids: torch.Tensor, mems=None):
    """transformers-4 / kimiyoung Transformer-XL math on the legacy keys, sequence-first as the original, with the
    position term indexed by distance directly (no shift trick). Returns (log-probs [B, T, V], new mems)."""
    D, H, Dh = c["d_model"], c["n_head"], c["d_head"]
    ends = c["cutoffs"] + [c["vocab_size"]]
    bounds = list(zip([0] + ends[:-1], ends))
    x = ids.t()  # [T, B]
    T, B = x.shape
    emb = torch.zeros(T, B, D)
    for i, (start, end) in enumerate(bounds):
        sel = (x >= start) & (x < end)
        table, proj = sd[f"transformer.word_emb.emb_layers.{i}.weight"], sd[f"transformer.word_emb.emb_projs.{i}"]
        emb[sel] = table[x[sel] - start] @ proj.t()
    h = emb * D**0.5
    mlen = 0 if mems is None else mems[0].shape[0]
    klen = mlen + T
    dist = mlen + torch.arange(T)[:, None] - torch.arange(klen)[None, :]  # [T, K]
    masked = (dist < 0) | ((dist >= c["mem_len"]) if c["same_length"] else False)
    pos = torch.arange(klen - 1, -1, -1.0).clamp(max=c["clamp_len"])
    inv_freq = 1 / (10000 ** (torch.arange(0.0, D, 2.0) / D))
    pos_emb = torch.cat([torch.outer(pos, inv_freq).sin(), torch.outer(pos, inv_freq).cos()], -1)  # [K, D]
    hids = []
    for l in range(c["n_layer"]):
        p = f"transformer.layers.{l}."
        hids.append(h)
        cat = h if mems is None else torch.cat([mems[l], h], 0)
        q, k, v = (cat @ sd[p + "dec_attn.qkv_net.weight"].t()).chunk(3, -1)
        q = q[-T:].view(T, B, H, Dh)
        k, v = k.view(klen, B, H, Dh), v.view(klen, B, H, Dh)
        r = (pos_emb @ sd[p + "dec_attn.r_net.weight"].t()).view(klen, H, Dh)
        ac = torch.einsum("ibnd,jbnd->ijbn", q + sd[p + "dec_attn.r_w_bias"], k)
        r_by_dist = r[(klen - 1 - dist).clamp(0, klen - 1)]  # [T, K, H, Dh]: R of distance i - j
        bd = torch.einsum("ibnd,ijnd->ijbn", q + sd[p + "dec_attn.r_r_bias"], r_by_dist)
        score = ((ac + bd) / Dh**0.5).masked_fill(masked[:, :, None, None], float("-inf"))
        attn = torch.einsum("ijbn,jbnd->ibnd", score.softmax(1), v).reshape(T, B, H * Dh)
        ln = lambda y, name: F.layer_norm(y, (D,), sd[p + name + ".weight"], sd[p + name + ".bias"],  # noqa: E731
                                          c["layer_norm_epsilon"])
        h = ln(h + attn @ sd[p + "dec_attn.o_net.weight"].t(), "dec_attn.layer_norm")
        ff = F.relu(h @ sd[p + "pos_ff.CoreNet.0.weight"].t() + sd[p + "pos_ff.CoreNet.0.bias"])
        h = ln(h + ff @ sd[p + "pos_ff.CoreNet.3.weight"].t() + sd[p + "pos_ff.CoreNet.3.bias"], "pos_ff.layer_norm")
    new_mems = [torch.cat([hid] if mems is None else [mems[l], hid], 0)[-c["mem_len"] :] for l, hid in enumerate(hids)]
    # projected adaptive softmax, dense: p(y) = p_head(cluster of y) * p_tail(y | cluster)
    logits = lambda i, w, b: (h @ sd[f"crit.out_projs.{i}"]) @ w.t() + b  # noqa: E731
    clusters = [sd.get("crit.cluster_weight", torch.zeros(0, c["d_embed"])),
                sd.get("crit.cluster_bias", torch.zeros(0))]
    head = logits(0, torch.cat([sd["crit.out_layers.0.weight"], clusters[0]]),
                  torch.cat([sd["crit.out_layers.0.bias"], clusters[1]])).log_softmax(-1)
    shortlist = bounds[0][1]
    out = [head[..., :shortlist]]
    for i in range(1, len(bounds)):
        tail = logits(i, sd[f"crit.out_layers.{i}.weight"], sd[f"crit.out_layers.{i}.bias"]).log_softmax(-1)
        out.append(head[..., shortlist + i - 1 : shortlist + i] + tail)
    return torch.cat(out, -1).transpose(0, 1), new_mems


def write_legacy_checkpoint(folder: pathlib.Path, config: dict = LEGACY_CONFIG, seed: int = 0) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    sd = legacy_state_dict(config, seed)
    torch.save(sd, folder / "pytorch_model.bin")
    return sd


# ---------------------------------------------------------------------------------------------------------------
# converter
# ---------------------------------------------------------------------------------------------------------------


def test_converter_loads_with_no_missing_or_unexpected_keys_and_matches_the_reference(tmp_path):
    from transformers import AutoModelForCausalLM

    sd = write_legacy_checkpoint(tmp_path / "legacy")
    (tmp_path / "legacy" / "vocab.txt").write_text("\n".join(["<eos>", "<unk>"]
                                                             + [f"w{i} {1000 - i}" for i in range(V - 2)]))
    converted = convert_transfo_xl_checkpoint(tmp_path / "legacy", tmp_path / "ours")
    assert (tmp_path / "ours" / "model.safetensors").exists() and not (tmp_path / "ours" / "pytorch_model.bin").exists()
    loaded, info = AutoModelForCausalLM.from_pretrained(tmp_path / "ours", output_loading_info=True)
    assert type(loaded) is TransfoXLForCausalLM
    assert info["missing_keys"] == set() or not info["missing_keys"]
    assert not info["unexpected_keys"] and not info["mismatched_keys"]
    loaded.eval()
    # tied tensors stay shared after loading
    assert loaded.lm_head.layers[2].weight.data_ptr() == loaded.model.word_embeddings.layers[2].weight.data_ptr()
    assert (loaded.lm_head.projections[3].weight.data_ptr()
            == loaded.model.word_embeddings.projections[3].weight.data_ptr())
    assert (loaded.lm_head.projections[0].weight.data_ptr()
            != loaded.model.word_embeddings.projections[0].weight.data_ptr())

    ids = ids_of(2, 9)
    a, b = converted(ids, use_cache=True), loaded(ids, use_cache=True)
    assert torch.equal(a.logits, b.logits)  # bit-identical before and after save/load
    # ... and the same function as the transformers-4 math on the legacy tensors, over two segments with memories
    ref, mems = reference_forward(sd, LEGACY_CONFIG, ids)
    torch.testing.assert_close(b.logits, ref, rtol=1e-4, atol=1e-4)
    ids2 = ids_of(2, 5, seed=2)
    ref2, _ = reference_forward(sd, LEGACY_CONFIG, ids2, mems)
    torch.testing.assert_close(loaded(ids2, past_key_values=b.past_key_values).logits, ref2, rtol=1e-4, atol=1e-4)
    # transformers 4 started from mem_len zero memories: reproducible with init_memories
    zeros = [torch.zeros(LEGACY_CONFIG["mem_len"], 2, 32)] * 2
    torch.testing.assert_close(loaded(ids, past_key_values=loaded.init_memories(2)).logits,
                               reference_forward(sd, LEGACY_CONFIG, ids, zeros)[0], rtol=1e-4, atol=1e-4)

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tmp_path / "ours")
    assert tok("w3 w0 zzz").input_ids == [5, 2, 1] and tok.eos_token == "<eos>"
    assert tok.decode([5, 2]) == "w3 w0"


def test_converter_refuses_a_pickle_with_arbitrary_objects(tmp_path):
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (pathlib.Path.touch, (marker,))

    folder = tmp_path / "legacy"
    write_legacy_checkpoint(folder)
    sd = torch.load(folder / "pytorch_model.bin", weights_only=True)
    sd["extra"] = Payload()
    torch.save(sd, folder / "pytorch_model.bin")
    with pytest.raises(ValueError, match="refused rather than unpickled"):
        convert_transfo_xl_checkpoint(folder, tmp_path / "ours")
    assert not marker.exists()
    (folder / "vocab.pkl").write_bytes(b"")
    from modeling_fwp.convert_transfo_xl import load_vocabulary

    with pytest.raises(ValueError, match="pickle"):
        load_vocabulary(folder / "vocab.pkl")


def test_converter_shared_position_biases_and_plain_softmax(tmp_path):
    config = dict(LEGACY_CONFIG, untie_r=False, div_val=1, d_embed=24, cutoffs=[], tie_projs=[False],
                  proj_share_all_but_first=False, same_length=False)
    sd = legacy_state_dict(config, seed=3)
    for l in range(2):  # transformers 4 registered the shared biases in every layer as well
        sd["transformer.r_w_bias"] = sd.pop(f"transformer.layers.{l}.dec_attn.r_w_bias")
        sd["transformer.r_r_bias"] = sd.pop(f"transformer.layers.{l}.dec_attn.r_r_bias")
    for l in range(2):
        sd[f"transformer.layers.{l}.dec_attn.r_w_bias"] = sd["transformer.r_w_bias"]
        sd[f"transformer.layers.{l}.dec_attn.r_r_bias"] = sd["transformer.r_r_bias"]
    (tmp_path / "legacy").mkdir()
    (tmp_path / "legacy" / "config.json").write_text(json.dumps(config))
    torch.save(sd, tmp_path / "legacy" / "pytorch_model.bin")
    model = convert_transfo_xl_checkpoint(tmp_path / "legacy", tmp_path / "ours")
    assert not hasattr(model.model.layers[0].attention, "r_w_bias")
    ids = ids_of(1, 7)
    ref_sd = dict(sd)
    for l in range(2):
        ref_sd[f"transformer.layers.{l}.dec_attn.r_w_bias"] = sd["transformer.r_w_bias"]
        ref_sd[f"transformer.layers.{l}.dec_attn.r_r_bias"] = sd["transformer.r_r_bias"]
    ref, _ = reference_forward(ref_sd, config, ids)
    torch.testing.assert_close(model(ids).logits, ref, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------------------------
# adaptive softmax
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("div_val", [1, 4])
def test_adaptive_log_softmax_is_normalised_and_matches_a_dense_reference(div_val):
    model = txl_model(div_val=div_val, embedding_size=128 if div_val == 4 else 24)
    head = model.lm_head
    h = torch.randn(5, 32)
    logp = head.log_prob(h)
    torch.testing.assert_close(logp.exp().sum(-1), torch.ones(5))
    # dense reference: loop over tokens, p(y) = p_head(y or its cluster) * p_tail(y)
    P = lambda i: head.projections[i].weight if head.projections is not None else torch.eye(32)  # noqa: E731
    W = lambda i, s, e: head.layers[0].weight[s:e] if div_val == 1 else head.layers[i].weight  # noqa: E731
    Bv = lambda i, s, e: head.layers[0].bias[s:e] if div_val == 1 else head.layers[i].bias  # noqa: E731
    head_logits = ((h @ P(0)) @ torch.cat([W(0, 0, 20), head.cluster_weight]).t()
                   + torch.cat([Bv(0, 0, 20), head.cluster_bias]))
    p_head = head_logits.softmax(-1)
    bounds = [(0, 20), (20, 40), (40, 70), (70, V)]
    dense = torch.empty(5, V)
    for y in range(V):
        i = next(i for i, (s, e) in enumerate(bounds) if s <= y < e)
        if i == 0:
            dense[:, y] = p_head[:, y]
        else:
            s, e = bounds[i]
            p_tail = ((h @ P(i)) @ W(i, s, e).t() + Bv(i, s, e)).softmax(-1)
            dense[:, y] = p_head[:, 20 + i - 1] * p_tail[:, y - s]
    torch.testing.assert_close(logp, dense.log(), rtol=1e-5, atol=1e-5)
    # the per-target NLL and its analytic input gradient agree with the full distribution and autograd
    target = torch.tensor([3, 25, 45, 99, 71])
    torch.testing.assert_close(head.nll(h, target), -logp.gather(1, target[:, None])[:, 0])
    hh = h.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(head.nll(hh, target).sum(), hh)
    torch.testing.assert_close(head.input_gradient(h, target), grad, rtol=1e-4, atol=1e-6)


def test_loss_is_token_sum_over_num_items_in_batch():
    model = txl_model()
    ids = ids_of(2, 8)
    labels = ids.clone()
    labels[1, 4:] = -100
    out = model(ids, labels=labels)
    logp = out.logits[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    valid = labels[:, 1:] != -100
    torch.testing.assert_close(out.loss, -logp[valid].mean())
    n = int(valid.sum())
    torch.testing.assert_close(model(ids, labels=labels, num_items_in_batch=torch.tensor(3 * n)).loss, out.loss / 3)
    with pytest.raises(ValueError, match="labels"):
        model(ids, labels=torch.full_like(ids, V))


# ---------------------------------------------------------------------------------------------------------------
# memories, cache, generation
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides",
    [
        dict(same_length=True, mem_len=6),  # every query sees 6 keys: any segmentation agrees
        dict(same_length=False, mem_len=32),  # memory longer than the document: full attention
        dict(same_length=True, mem_len=5, pre_lnorm=True, untie_r=False, clamp_len=3),
        dict(same_length=True, mem_len=7, div_val=1, embedding_size=24, cutoffs=[]),
    ],
)
def test_segments_with_memories_equal_one_long_segment(overrides):
    model = txl_model(**overrides)
    ids = ids_of(2, 24)
    full = model(ids).logits
    cache, pieces = None, []
    for start in range(0, 24, 6):  # segments of 6 tokens, memories carried
        out = model(ids[:, start : start + 6], past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        pieces.append(out.logits)
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=1e-4, atol=1e-5)
    assert cache.get_seq_length() == 24
    assert cache.memory_length() == min(model.config.mem_len, 24)


def test_memory_is_bounded_and_gradients_stop_at_the_segment_boundary():
    model = txl_model().train()
    cache = model(ids_of(1, 4), use_cache=True).past_key_values
    sizes = []
    for i in range(10):
        cache = model(ids_of(1, 3, seed=i), past_key_values=cache, use_cache=True).past_key_values
        sizes.append(cache.nbytes())
    assert cache.get_seq_length() == 34 and cache.memory_length() == 6
    assert len(set(sizes)) == 1 and sizes[0] > 0  # mem_len rows from the first segments on, whatever the tokens seen
    # the memory is detached: a loss on segment 2 gives no gradient to tokens seen only in segment 1
    model = txl_model(tie_word_embeddings=False).train()
    first, second = torch.arange(0, 10)[None], torch.arange(20, 30)[None]  # clusters 0 and 1
    cache = model(first, use_cache=True).past_key_values
    model(second, past_key_values=cache, labels=second).loss.backward()
    embeddings = model.model.word_embeddings
    assert embeddings.layers[0].weight.grad is None and embeddings.projections[0].weight.grad is None
    assert embeddings.layers[1].weight.grad.abs().sum() > 0


def test_cached_steps_and_generation_equal_the_full_forward():
    model = txl_model(same_length=True, mem_len=5)
    ids = ids_of(2, 11)
    full = model(ids).logits
    cache, steps = None, []
    for t in range(11):
        out = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-4, atol=1e-5)
    prompt = ids[:, :4]
    with_cache = model.generate(prompt, max_new_tokens=10, do_sample=False, use_cache=True, pad_token_id=0)
    without = model.generate(prompt, max_new_tokens=10, do_sample=False, use_cache=False, pad_token_id=0)
    assert with_cache.shape == (2, 14) and torch.equal(with_cache, without)
    # the greedy tokens are the argmax of the full forward over the generated text
    assert torch.equal(model(with_cache).logits[:, 3:-1].argmax(-1), with_cache[:, 4:])


def test_beam_search_reorders_the_memories():
    model = txl_model(same_length=False, mem_len=20)
    prompt = ids_of(2, 3)
    kwargs = dict(max_new_tokens=6, num_beams=3, num_return_sequences=2, do_sample=False, pad_token_id=0)
    with_cache = model.generate(prompt, use_cache=True, **kwargs)
    assert torch.equal(with_cache, model.generate(prompt, use_cache=False, **kwargs))
    cache = model(ids_of(3, 4), use_cache=True).past_key_values
    before = cache.layers[1].states["memory"].clone()
    cache.reorder_cache(torch.tensor([2, 2, 0]))
    assert torch.equal(cache.layers[1].states["memory"], before[[2, 2, 0]])
    with pytest.raises(ValueError, match="cannot be cropped"):
        cache.crop(1)


def test_left_padded_batch_equals_each_prompt_alone():
    model = txl_model(same_length=True, mem_len=6)
    prompts = [ids_of(1, n, seed=n)[0] for n in (7, 3)]
    ids = torch.zeros(2, 7, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, 7 - len(p) :], mask[i, 7 - len(p) :] = p, 1
    batched = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    for i, p in enumerate(prompts):
        alone = model.generate(p[None], max_new_tokens=5, do_sample=False, pad_token_id=0)
        assert torch.equal(batched[i, 7:], alone[0, len(p) :])


def test_save_load_round_trip_keeps_ties_and_untied_variants(tmp_path):
    from transformers import AutoModelForCausalLM

    for overrides in (dict(), dict(tie_word_embeddings=False, tie_projs=[False, False, True, False])):
        model = txl_model(**overrides)
        model.save_pretrained(tmp_path / str(len(overrides)))
        loaded, info = AutoModelForCausalLM.from_pretrained(tmp_path / str(len(overrides)), output_loading_info=True)
        assert not any(info.values())
        reference = model.state_dict()
        assert all(torch.equal(t, reference[name]) for name, t in loaded.state_dict().items())
        ids = ids_of(2, 6)
        # Equal weights, but transformers >= 5.24 loads them zero-copy at unaligned addresses, where BLAS may round
        # differently: the logits agree to float32 rounding.
        torch.testing.assert_close(loaded.eval()(ids).logits, model(ids).logits, rtol=1e-6, atol=1e-6)
        tied = (loaded.lm_head.projections[2].weight.data_ptr()
                == loaded.model.word_embeddings.projections[2].weight.data_ptr())
        assert tied
        tied_words = (loaded.lm_head.layers[0].weight.data_ptr()
                      == loaded.model.word_embeddings.layers[0].weight.data_ptr())
        assert tied_words == loaded.config.tie_word_embeddings


@pytest.mark.parametrize(
    "kwargs,argument",
    [
        (dict(cutoffs=[50, 20]), "cutoffs"),
        (dict(tie_projs=[True]), "tie_projs"),
        (dict(same_length=True, mem_len=0), "mem_len"),
        (dict(div_val=4, embedding_size=32), "embedding_size"),
        (dict(use_fwl=True, fwl_output_bias=True), "fwl_output_bias"),  # the adaptive softmax: no c, a slow output
        (dict(use_fwl=True, fwl_fast_parameters=["output_bias"]), "fwl_fast_parameters"),
        (dict(use_fwl=True, fwl_gradient_dtype="bfloat16"), "fwl_gradient_dtype"),
    ],
)
def test_bad_config_raises_naming_the_argument(kwargs, argument):
    with pytest.raises(ValueError, match=argument):
        txl_config(**kwargs)


# ---------------------------------------------------------------------------------------------------------------
# Transformer-XL + FWL: segment recurrence of the fast update
# ---------------------------------------------------------------------------------------------------------------


def fwl_model(**overrides):
    kwargs = dict(use_fwl=True, fwl_step_size_init=0.3, fwl_decay_init=0.7, fwl_intermediate_size=24)
    kwargs.update(overrides)
    return txl_model(**kwargs)


def slow_gradients(model, hidden, targets):
    """{name: sum_j grad CE(slow(h_j), y_j)} at the slow weights, by autograd; hidden [N, D], targets [N]."""
    slow = model.fwl_head.slow
    params = {n: p for n, p in slow.named_parameters() if n in model.fwl_head.fast_parameter_names}
    loss = -slow(hidden[None])[0].gather(-1, targets[:, None]).sum()
    return dict(zip(params, torch.autograd.grad(loss, list(params.values()))))


@pytest.mark.parametrize("residual", [False, True])
def test_fwl_state_after_two_segments_is_the_decayed_sum_of_per_token_gradients(residual):
    model = fwl_model(fwl_residual=residual)
    ids1, ids2 = ids_of(1, 7, seed=4), ids_of(1, 5, seed=5)
    out1 = model(ids1, use_cache=True, output_hidden_states=True)
    h1 = out1.hidden_states[-1][0]
    out2 = model(ids2, past_key_values=out1.past_key_values, use_cache=True, output_hidden_states=True)
    h2 = out2.hidden_states[-1][0]
    state = out2.past_key_values.get_state(out2.past_key_values.fwl_layer_idx)
    # segment 1 knows the labels of its positions 0..5; position 6's label (ids2[0]) arrives with segment 2
    g1 = slow_gradients(model, h1[:-1], ids1[0, 1:])
    g2 = slow_gradients(model, torch.cat([h1[-1:], h2[:-1]]), torch.cat([ids2[0, :1], ids2[0, 1:]]))
    for name in model.fwl_head.fast_parameter_names:
        expected = model.fwl_head.decay.gamma(name) * g1[name] + g2[name]
        torch.testing.assert_close(state[f"sum.{name}"][0], expected, rtol=1e-4, atol=1e-5, msg=name)
        assert not state[f"sum.{name}"].requires_grad
    assert int(state["segment.tokens"][0]) == 5


@pytest.mark.parametrize("residual", [False, True])
def test_fwl_fast_outputs_are_the_slow_head_after_a_gradient_step(residual):
    """FWL contract across segments: position t uses theta - alpha (gamma Delta_1 + sum_{j<t, segment 2} g_j)."""
    from torch.func import functional_call

    model = fwl_model(fwl_residual=residual)
    ids1, ids2 = ids_of(1, 6, seed=6), ids_of(1, 4, seed=7)
    out1 = model(ids1, use_cache=True, output_hidden_states=True)
    h1 = out1.hidden_states[-1][0]
    out2 = model(ids2, past_key_values=out1.past_key_values, use_cache=True, output_hidden_states=True)
    h2 = out2.hidden_states[-1][0]
    head, slow = model.fwl_head, model.fwl_head.slow
    hs, ys = torch.cat([h1, h2]), torch.cat([ids1[0], ids2[0]])
    carried = slow_gradients(model, hs[:5], ys[1:6])  # segment 1: positions 0..4 (position 5's label is ids2[0])
    for t in range(10):
        if t < 6:
            totals = slow_gradients(model, hs[:t], ys[1 : t + 1])
        else:
            new = slow_gradients(model, hs[5:t], ys[6 : t + 1])
            totals = {name: model.fwl_head.decay.gamma(name) * carried[name] + new[name] for name in new}
        params = dict(slow.named_parameters())
        for name in head.fast_parameter_names:
            params[name] = params[name] - head.step_size(name) * totals[name]
        expected = functional_call(slow, params, (hs[t][None, None],))[0, 0]
        got = out1.logits[0, t] if t < 6 else out2.logits[0, t - 6]
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5, msg=f"position {t}")
    with torch.no_grad():  # the inference path (no cache, no autograd) computes the same
        torch.testing.assert_close(model(ids1).logits, out1.logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mask", [False, True])
def test_fwl_previous_position_in_one_backward_equals_a_separate_call(monkeypatch, mask):
    """The adaptive FWL computes the gradient of the previous segment's last position in the same backward as the new
    positions (``merge_previous_position``); the generic head's separate call gives the same outputs, loss and state."""
    from modeling_fwp.modeling_transfo_xl import AdaptiveSoftmaxFWLSlowHead

    model = fwl_model()
    ids = ids_of(2, 15, seed=11)
    attention_mask = torch.ones_like(ids)
    if mask:
        attention_mask[0, :3] = 0  # left padding in the first row

    def run():
        cache, logits, losses = None, [], []
        for start, end in ((0, 6), (6, 7), (7, 12), (12, 14)):  # a one-token segment included
            out = model(ids[:, start:end], attention_mask=attention_mask[:, :end], labels=ids[:, start:end],
                        shift_labels=ids[:, start + 1 : end + 1], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            logits.append(out.logits)
            losses.append(out.loss)
        return torch.cat(logits, 1), torch.stack(losses), cache.get_state(cache.fwl_layer_idx)

    assert AdaptiveSoftmaxFWLSlowHead.merge_previous_position
    merged = run()
    monkeypatch.setattr(AdaptiveSoftmaxFWLSlowHead, "merge_previous_position", False)
    separate = run()
    torch.testing.assert_close(merged[0], separate[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(merged[1], separate[1], rtol=1e-5, atol=1e-6)
    assert merged[2].keys() == separate[2].keys()
    for key in merged[2]:
        torch.testing.assert_close(merged[2][key], separate[2][key], rtol=1e-5, atol=1e-6, msg=key)


def test_residual_fwl_starts_as_the_base_model_and_continued_training_loads_it(tmp_path, word_tokenizer):
    """``fwl_residual``: gain 0 at initialisation, so h + f(h) = h and the log-probabilities are the base model's; the
    training script's --model_name_or_path attaches it to a saved base model (only FWL parameters are new)."""
    import argparse

    from training.train_transfo_xl import continued_model

    base = txl_model(vocab_size=len(word_tokenizer), cutoffs=[8, 16])
    base.save_pretrained(tmp_path / "base")
    word_tokenizer.save_pretrained(tmp_path / "base")
    (tmp_path / "base" / "train_log.json").write_text(json.dumps({"steps": 7, "start_segment": 3}))
    args = argparse.Namespace(use_fwl=True, fwl_residual=True, fwl_step_size_init=0.05, block_size=4,
                              hidden_dropout=0.0, tokenizer_name=None)
    model, tokenizer, next_segment = continued_model(tmp_path / "base", args)
    model.eval()
    assert next_segment == 10 and len(tokenizer) == len(word_tokenizer)
    assert model.config.use_fwl and model.config.fwl_residual and model.config.fwl_segment_length == 4
    assert torch.equal(model.fwl_head.slow.norm.weight, torch.zeros_like(model.fwl_head.slow.norm.weight))
    ids = torch.randint(0, len(word_tokenizer), (2, 9), generator=torch.Generator().manual_seed(3))
    cache_base = cache_fwl = None
    for start in (0, 5):  # the fast updates of U, W, b are zero too (dCE/dz2 = 0 while the gain is 0)
        out_base = base(ids[:, start : start + 5], past_key_values=cache_base, use_cache=True)
        out_fwl = model(ids[:, start : start + 5], past_key_values=cache_fwl, use_cache=True)
        cache_base, cache_fwl = out_base.past_key_values, out_fwl.past_key_values
        torch.testing.assert_close(out_fwl.logits, out_base.logits, rtol=1e-5, atol=1e-5)
    assert model.fwl_head.step_size("norm.weight").item() == pytest.approx(0.05, rel=1e-5)
    args.use_fwl = False  # an FWL checkpoint cannot be continued as a base model
    model.save_pretrained(tmp_path / "fwl")
    with pytest.raises(ValueError, match="--use_fwl"):
        continued_model(tmp_path / "fwl", args)


def test_fwl_checkpoints_keep_the_decay_key_and_reload_exactly(tmp_path):
    """The segment decay is part of the FWL head (``fwl_head.decay``); saved folders keep its key
    ``fwl_decay.raw_decay`` (renamed on load and back on save), so folders saved before and after load alike."""
    from safetensors import safe_open

    model = fwl_model()
    with torch.no_grad():
        model.fwl_head.decay.raw_decay.add_(torch.linspace(-1, 1, 6))
    model.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "fwl_decay.raw_decay" in keys and not any("decay" in k for k in keys - {"fwl_decay.raw_decay"})
    loaded = TransfoXLForCausalLM.from_pretrained(tmp_path).eval()
    torch.testing.assert_close(loaded.fwl_head.decay.raw_decay, model.fwl_head.decay.raw_decay, rtol=0, atol=0)
    ids = ids_of(2, 9)
    cache_a = model(ids[:, :5], use_cache=True).past_key_values
    cache_b = loaded(ids[:, :5], use_cache=True).past_key_values
    torch.testing.assert_close(
        loaded(ids[:, 5:], past_key_values=cache_b).logits, model(ids[:, 5:], past_key_values=cache_a).logits,
        rtol=1e-6, atol=1e-6,
    )


def test_fwl_gradients_reach_the_decay_but_not_earlier_segments():
    model = fwl_model(tie_word_embeddings=False).train()
    first, second = torch.arange(0, 10)[None], torch.arange(20, 30)[None]  # clusters 0 and 1
    cache = model(first, use_cache=True).past_key_values
    model(second, past_key_values=cache, labels=second).loss.backward()
    embeddings = model.model.word_embeddings
    assert embeddings.layers[0].weight.grad is None and embeddings.projections[0].weight.grad is None
    assert embeddings.layers[1].weight.grad.abs().sum() > 0
    assert model.fwl_head.decay.raw_decay.grad.abs().min() > 0  # every gamma is learned
    assert model.fwl_head.raw_step_size.grad.abs().min() > 0


def test_fwl_token_by_token_equals_segments_when_the_boundaries_agree():
    """With fwl_segment_length = L, one token at a time decays the update exactly where segments of L tokens do."""
    ids = ids_of(2, 12)
    model = fwl_model(fwl_segment_length=4, same_length=True, mem_len=6)
    cache, segments = None, []
    for start in range(0, 12, 4):
        out = model(ids[:, start : start + 4], past_key_values=cache, use_cache=True)
        cache, segments = out.past_key_values, segments + [out.logits]
    cache, steps = None, []
    for t in range(12):
        out = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
        cache, steps = out.past_key_values, steps + [out.logits]
    torch.testing.assert_close(torch.cat(steps, 1), torch.cat(segments, 1), rtol=1e-4, atol=1e-5)
    # no boundary inside the text: generation with the cache equals the full forward
    model = fwl_model(fwl_segment_length=100, same_length=True, mem_len=6)
    prompt = ids[:, :4]
    with_cache = model.generate(prompt, max_new_tokens=8, do_sample=False, use_cache=True, pad_token_id=0)
    assert torch.equal(with_cache, model.generate(prompt, max_new_tokens=8, do_sample=False, use_cache=False,
                                                  pad_token_id=0))


# ---------------------------------------------------------------------------------------------------------------
# dynamic evaluation and long-document scoring
# ---------------------------------------------------------------------------------------------------------------


def test_stream_scoring_equals_the_full_forward_and_counts_every_token_once():
    from training.dynamic_eval import score_stream

    model = txl_model(same_length=True, mem_len=6)
    ids = ids_of(1, 23)
    logp = model(ids).logits[0, :-1].gather(-1, ids[0, 1:, None])[:, 0]
    result = score_stream(model, ids, segment_length=5)
    assert result.num_tokens == 22 and len(result.segment_nll) == 5
    assert math.isclose(result.nll_sum, -float(logp.sum().detach()), rel_tol=1e-4)


@pytest.mark.parametrize("dynamic", [False, True])
def test_score_segments_yields_the_segments_of_score_stream(dynamic):
    """The generator form (benchmarks interleave several of them) scores the same segments as score_stream."""
    from training.dynamic_eval import DynamicEvaluation, score_segments, score_stream

    model = txl_model(use_fwl=True, same_length=True, mem_len=6)
    ids = ids_of(1, 23)
    evaluation = DynamicEvaluation(lr=0.1) if dynamic else None
    other = score_segments(txl_model(seed=5), ids, 5)  # a second model advanced in turn leaves this one unaffected
    steps = []
    for step in score_segments(model, ids, 5, evaluation):
        steps.append(step)
        next(other, None)
    result = score_stream(model, ids, 5, evaluation)
    assert [n for _, n, _ in steps] == [5, 5, 5, 5, 2] and all(seconds > 0 for _, _, seconds in steps)
    assert [nll for nll, _, _ in steps] == pytest.approx(result.segment_nll, rel=1e-5)


@pytest.mark.parametrize("family", ["transfo_xl", "transfo_xl_fwl", "delta_net"])
def test_dynamic_evaluation_keeps_the_model_and_lowers_the_loss_on_a_repeated_segment(family):
    from conftest import tiny_model
    from modeling_fwp import DeltaNetConfig
    from training.dynamic_eval import DynamicEvaluation, score_stream

    if family == "delta_net":
        model = tiny_model(DeltaNetConfig, vocab_size=V)
    else:
        model = txl_model(use_fwl=family == "transfo_xl_fwl", same_length=True, mem_len=4).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    objects = dict(model.named_parameters(remove_duplicate=False))
    segment = ids_of(1, 16, seed=9)
    ids = torch.cat([segment, segment, segment], 1)
    static = score_stream(model, ids, segment_length=16)
    for method, lr in (("sgd", 0.5), ("rms", 1e-3)):
        dynamic = score_stream(model, ids, segment_length=16,
                               dynamic=DynamicEvaluation(lr=lr, method=method, decay=0.01))
        assert dynamic.segment_nll[0] == pytest.approx(static.segment_nll[0], rel=1e-5)  # same weights at the start
        assert dynamic.segment_nll[2] < static.segment_nll[2] - 1.0, method  # adapted to the repeated text
    assert model.training == (family != "delta_net")  # mode restored
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in model.parameters())
    assert all(p is objects[n] for n, p in model.named_parameters(remove_duplicate=False))  # ties intact


def test_eval_lm_scores_saved_models_with_carried_state(tmp_path, word_tokenizer):
    from conftest import tiny_model
    from modeling_fwp import DeltaNetConfig
    from training import eval_lm

    vocab = len(word_tokenizer)
    folders = []
    for name, model in (
        ("txl", txl_model(vocab_size=vocab, cutoffs=[8, 16])),
        ("txl_fwl", fwl_model(vocab_size=vocab, cutoffs=[8, 16])),
        ("delta_net", tiny_model(DeltaNetConfig, vocab_size=vocab)),
    ):
        model.save_pretrained(tmp_path / name)
        word_tokenizer.save_pretrained(tmp_path / name)
        folders.append(str(tmp_path / name))
    text = "the cat sat on the mat\nfast weights are programmed by slow nets\n\nthe dog sat on a mat and read\n"
    (tmp_path / "data").mkdir()
    for split in ("valid", "test"):
        (tmp_path / "data" / f"{split}.txt").write_text(text)
    rows = eval_lm.main(["--model_name_or_path", *folders, "--data_dir", str(tmp_path / "data"), "--block_size", "4",
                         "--dynamic_eval", "--max_eval_tokens", "12", "--dynamic_lr", "0.01", "0.1",
                         "--results_file", str(tmp_path / "out.json")])
    assert [r["mode"].split()[0] for r in rows] == ["static", "dynamic"] * 3
    # the first 12 tokens, minus the first
    assert all(r["tokens"] == 11 and math.isfinite(r["perplexity"]) for r in rows)
    assert json.loads((tmp_path / "out.json").read_text())["results"] == rows
