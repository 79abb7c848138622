"""The fast-weight encoder-decoder (Schlag et al. 2021 sec. 6.2): equations, cache, padding, generation, save/export,
training."""
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForSeq2SeqLM

import modeling_fwp  # noqa: F401  (registers the Auto classes)
from modeling_fwp import FastWeightSeq2SeqCache, FastWeightSeq2SeqConfig
from modeling_fwp.modeling_fwp_seq2seq import NonCausalLinearAttention, SoftmaxCrossAttention, shift_tokens_right

from conftest import relative_error

PAD, BOS, EOS = 0, 1, 2
VOCAB = 23
# (update_rule, feature_map, cross_attention): both rules, the paper's three maps, both cross-attentions
VARIANTS = [("sum", "elu", "linear"), ("delta", "elu", "linear"), ("delta", "dpfp", "softmax"),
            ("sum", "favor", "linear")]
TOL = 1e-10  # float64 everywhere below except the export round trip


def tiny_config(**overrides) -> FastWeightSeq2SeqConfig:
    kwargs = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_hidden_layers=2, intermediate_size=48,
                  pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS, favor_features=8, initializer_range=0.2)
    kwargs.update(overrides)
    return FastWeightSeq2SeqConfig(**kwargs)


def tiny_model(variant=VARIANTS[1], seed=0, dtype=torch.float64, **overrides):
    update_rule, feature_map, cross = variant
    torch.manual_seed(seed)
    config = tiny_config(update_rule=update_rule, feature_map=feature_map, cross_attention=cross, **overrides)
    return AutoModelForSeq2SeqLM.from_config(config).to(dtype).eval()


def random_ids(*shape, seed=1):
    return torch.randint(3, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("variant", VARIANTS, ids="-".join)
def test_cached_decoding_equals_full_forward(variant):
    """Decoding one token at a time from the cache gives the full (uncached) forward's logits at every position."""
    model = tiny_model(variant)
    src, tgt = random_ids(2, 7), random_ids(2, 6, seed=2)
    with torch.no_grad():
        full = model(input_ids=src, decoder_input_ids=tgt, use_cache=False).logits
        cache, steps = None, []
        for t in range(tgt.shape[1]):
            out = model(input_ids=src, decoder_input_ids=tgt[:, t:t + 1], cache=cache, use_cache=True)
            cache = out.cache
            steps.append(out.logits)
        # two tokens, then the rest in one call: a multi-token continuation from the cache
        head = model(input_ids=src, decoder_input_ids=tgt[:, :2], use_cache=True)
        tail = model(input_ids=src, decoder_input_ids=tgt[:, 2:], cache=head.cache).logits
    assert isinstance(cache, FastWeightSeq2SeqCache) and cache.get_seq_length() == tgt.shape[1]
    assert relative_error(torch.cat(steps, 1), full) < TOL
    assert relative_error(torch.cat([head.logits, tail], 1), full) < TOL


def test_cache_size_is_constant_in_generated_tokens():
    model = tiny_model()
    src = random_ids(2, 7)
    with torch.no_grad():
        out = model(input_ids=src, decoder_input_ids=random_ids(2, 1))
        sizes = [out.cache.nbytes()]
        for _ in range(5):
            out = model(input_ids=src, decoder_input_ids=random_ids(2, 1), cache=out.cache)
            sizes.append(out.cache.nbytes())
    assert len(set(sizes)) == 1


@pytest.mark.parametrize("variant", VARIANTS[::3], ids="-".join)
def test_greedy_generation_equals_argmax_of_uncached_forward(variant):
    model = tiny_model(variant)
    src = random_ids(2, 7)
    with torch.no_grad():
        generated = model.generate(src, max_new_tokens=8, do_sample=False, min_new_tokens=8)
        uncached = model.generate(src, max_new_tokens=8, do_sample=False, min_new_tokens=8, use_cache=False)
        logits = model(input_ids=src, decoder_input_ids=generated[:, :-1], use_cache=False).logits
    assert generated[:, 0].eq(model.config.decoder_start_token_id).all()
    assert torch.equal(generated, uncached)
    # min_new_tokens forbids EOS: the argmax over the other tokens
    logits[..., EOS] = -float("inf")
    assert torch.equal(generated[:, 1:], logits.argmax(-1))


@pytest.mark.parametrize("variant", VARIANTS[1:3], ids="-".join)
def test_beam_search_reorders_the_cache(variant):
    """Cached beam search (the cache reordered at every step) equals beam search re-reading the whole prefix;
    one beam is greedy search."""
    model = tiny_model(variant)
    src = random_ids(3, 7)
    kwargs = dict(max_new_tokens=5, do_sample=False, num_beams=3, num_return_sequences=2, length_penalty=0.0)
    with torch.no_grad():
        cached = model.generate(src, **kwargs, output_scores=True, return_dict_in_generate=True)
        uncached = model.generate(src, **kwargs, use_cache=False, output_scores=True, return_dict_in_generate=True)
        greedy = model.generate(src, max_new_tokens=5, do_sample=False)
        one_beam = model.generate(src, max_new_tokens=5, do_sample=False, num_beams=1)
    assert cached.sequences.shape[0] == 6
    assert torch.equal(cached.sequences, uncached.sequences)
    assert torch.allclose(cached.sequences_scores, uncached.sequences_scores, atol=1e-9)
    assert torch.equal(greedy, one_beam)


def test_gradient_checkpointing_keeps_every_gradient():
    """Checkpointed blocks (the cross-attention state passed in as a dict) give every parameter the same gradient."""
    model = tiny_model(("delta", "elu", "linear")).train()
    src, labels = random_ids(2, 6), random_ids(2, 5, seed=2)

    def gradients():
        model.zero_grad()
        model(input_ids=src, labels=labels).loss.backward()
        return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    plain = gradients()
    model.gradient_checkpointing_enable()
    checkpointed = gradients()
    assert plain.keys() == checkpointed.keys() == {name for name, _ in model.named_parameters()}
    assert all(relative_error(checkpointed[name], plain[name]) < TOL for name in plain)


def _pad(rows, side):
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), PAD)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        span = slice(0, len(row)) if side == "right" else slice(width - len(row), width)
        ids[i, span], mask[i, span] = row, 1
    return ids, mask


@pytest.mark.parametrize("variant, side", list(zip(VARIANTS, ["right", "left"] * 2)),
                         ids=lambda x: "-".join(x) if isinstance(x, tuple) else x)
def test_padded_source_and_target_equal_unpadded_rows(variant, side):
    """A batch of padded sources (and right-padded targets) gives each row the logits and the generation it gets
    alone: padded source keys write nothing into the encoder's or the cross-attention's fast weights."""
    model = tiny_model(variant)
    sources = [random_ids(7, seed=3), random_ids(4, seed=4), random_ids(2, seed=5)]
    targets = [random_ids(5, seed=6), random_ids(3, seed=7), random_ids(5, seed=8)]
    src, src_mask = _pad(sources, side)
    tgt, tgt_mask = _pad(targets, "right")
    with torch.no_grad():
        batch = model(input_ids=src, attention_mask=src_mask, decoder_input_ids=tgt, decoder_attention_mask=tgt_mask,
                      use_cache=False).logits
        generated = model.generate(src, attention_mask=src_mask, max_new_tokens=4, min_new_tokens=4, do_sample=False)
        for i, (source, target) in enumerate(zip(sources, targets)):
            alone = model(input_ids=source[None], decoder_input_ids=target[None], use_cache=False).logits[0]
            assert relative_error(batch[i, : len(target)], alone) < TOL
            alone_generated = model.generate(source[None], max_new_tokens=4, min_new_tokens=4, do_sample=False)
            assert torch.equal(generated[i], alone_generated[0])


def _reference_linear_attention(module, x, memory, mask):
    """Eqs. 17-19 as a loop over query and key positions: ``y_i = sum_j m_j (phi(q_i) . phi(k_j)) v_j / sum_j m_j
    phi(q_i) . phi(k_j)`` per head (phi without any rescaling)."""
    H = module.num_heads
    q = module.q_proj(x).unflatten(-1, (H, -1)).transpose(1, 2)
    k, v = (t.unflatten(-1, (H, -1)).transpose(1, 2) for t in module.kv_proj(memory).chunk(2, -1))
    phi_q, phi_k = module.feature_map(q), module.feature_map(k)
    out = torch.zeros(q.shape[:3] + (v.shape[-1],), dtype=x.dtype)
    for b in range(x.shape[0]):
        for h in range(H):
            for i in range(x.shape[1]):
                numerator, denominator = torch.zeros(v.shape[-1], dtype=x.dtype), torch.zeros((), dtype=x.dtype)
                for j in range(memory.shape[1]):
                    if mask[b, j]:
                        score = phi_q[b, h, i] @ phi_k[b, h, j]
                        numerator, denominator = numerator + score * v[b, h, j], denominator + score
                out[b, h, i] = numerator / denominator
    return module.o_proj(out.transpose(1, 2).flatten(2))


@pytest.mark.parametrize("feature_map", ["elu", "relu", "dpfp", "favor"])
@pytest.mark.parametrize("sum_normalization", [False, True])
def test_non_causal_linear_attention_equals_reference_loop(feature_map, sum_normalization):
    """Encoder self-attention (memory = the input) and cross-attention (memory = another sequence) with a padded key
    against the loop written from the equations."""
    config = tiny_config(feature_map=feature_map, sum_normalization=sum_normalization, dpfp_nu=2)
    torch.manual_seed(0)
    module = NonCausalLinearAttention(config).double()
    x, memory = torch.randn(2, 5, 32, dtype=torch.float64), torch.randn(2, 6, 32, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    with torch.no_grad():
        cross = module.read(x, module.program(memory, mask))
        self_attention = module.read(x, module.program(x, mask[:, :5]))
        assert relative_error(cross, _reference_linear_attention(module, x, memory, mask)) < TOL
        assert relative_error(self_attention, _reference_linear_attention(module, x, x, mask[:, :5])) < TOL


def test_softmax_cross_attention_equals_reference():
    torch.manual_seed(0)
    module = SoftmaxCrossAttention(tiny_config()).double()
    x, memory = torch.randn(2, 5, 32, dtype=torch.float64), torch.randn(2, 6, 32, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]])
    with torch.no_grad():
        q = module.q_proj(x).unflatten(-1, (4, 8)).transpose(1, 2)
        k, v = (t.unflatten(-1, (4, 8)).transpose(1, 2) for t in module.kv_proj(memory).chunk(2, -1))
        scores = (q @ k.transpose(-1, -2)) / 8 ** 0.5
        scores = scores.masked_fill(mask[:, None, None] == 0, -float("inf"))
        reference = module.o_proj((scores.softmax(-1) @ v).transpose(1, 2).flatten(2))
        assert relative_error(module.read(x, module.program(memory, mask)), reference) < TOL


def test_labels_give_the_shifted_cross_entropy():
    model = tiny_model()
    src, labels = random_ids(2, 7), random_ids(2, 5, seed=2)
    labels[1, 3:] = -100
    decoder_input_ids = shift_tokens_right(labels, PAD, model.config.decoder_start_token_id)
    assert torch.equal(decoder_input_ids[:, 1:], labels[:, :-1].masked_fill(labels[:, :-1] == -100, PAD))
    with torch.no_grad():
        out = model(input_ids=src, labels=labels)
        logits = model(input_ids=src, decoder_input_ids=decoder_input_ids).logits
        summed = model(input_ids=src, labels=labels, num_items_in_batch=torch.tensor(4)).loss
    keep = labels != -100
    expected = -logits.log_softmax(-1)[keep].gather(-1, labels[keep][:, None]).squeeze(-1)
    assert out.cache is None
    assert abs(out.loss.item() - expected.mean().item()) < 1e-10
    assert abs(summed.item() - expected.sum().item() / 4) < 1e-10


@pytest.mark.parametrize(
    "overrides, message",
    [(dict(cross_attention="bogus"), "cross_attention"), (dict(feature_map="identity"), "feature_map"),
     (dict(decoder_layers=0), "decoder_layers")],
)
def test_bad_config_is_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        tiny_config(**overrides)


def test_bad_inputs_are_refused():
    model = tiny_model()
    src = random_ids(2, 7)
    with pytest.raises(ValueError, match="FastWeightSeq2SeqCache"):
        model(input_ids=src, decoder_input_ids=src, cache=modeling_fwp.FastWeightCache(2))
    with pytest.raises(ValueError, match="decoder_input_ids"):
        model(input_ids=src, decoder_input_ids=src + VOCAB)
    with pytest.raises(ValueError, match="attention_mask"):
        model(input_ids=src, attention_mask=torch.ones(2, 3), decoder_input_ids=src)


CLEAN_LOADER = r"""
import importlib.abc, json, sys
class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("modeling_fwp", "fwp_kernels", "model_cards", "training"):
            raise ModuleNotFoundError(name)
sys.meta_path.insert(0, Hide())
import torch
from safetensors.torch import save_file
from transformers import AutoModelForSeq2SeqLM
torch.set_num_threads(2)
job = json.loads(sys.argv[1])
model = AutoModelForSeq2SeqLM.from_pretrained(job["folder"], trust_remote_code=True).eval()
src, tgt = torch.tensor(job["src"]), torch.tensor(job["tgt"])
with torch.no_grad():
    logits = model(input_ids=src, decoder_input_ids=tgt).logits
    beams = model.generate(src, max_new_tokens=6, num_beams=3, do_sample=False)
save_file({"logits": logits.contiguous(), "beams": beams.contiguous()}, job["out"])
print("MODULE", type(model).__module__)
"""


def test_save_load_and_trust_remote_code_export(tmp_path):
    """save_pretrained -> from_pretrained (this package) and -> trust_remote_code in a process that cannot import
    the package: the same logits and beam search output."""
    model = tiny_model(("delta", "dpfp", "linear"), dtype=torch.float32)
    src, tgt = random_ids(2, 7), random_ids(2, 5, seed=2)
    with torch.no_grad():
        logits = model(input_ids=src, decoder_input_ids=tgt).logits
        beams = model.generate(src, max_new_tokens=6, num_beams=3, do_sample=False)
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    assert config["auto_map"]["AutoModelForSeq2SeqLM"].endswith("FastWeightSeq2SeqForConditionalGeneration")
    loaded = AutoModelForSeq2SeqLM.from_pretrained(folder).eval()
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=src, decoder_input_ids=tgt).logits, logits)
    job = {"folder": str(folder), "src": src.tolist(), "tgt": tgt.tolist(), "out": str(tmp_path / "out.safetensors")}
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "hf_modules"))
    proc = subprocess.run([sys.executable, "-c", CLEAN_LOADER, json.dumps(job)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "transformers_modules" in proc.stdout
    remote = load_file(job["out"])
    assert relative_error(remote["logits"], logits) < 1e-6
    assert torch.equal(remote["beams"], beams)


def test_seq2seq_trainer_learns_to_copy(tmp_path):
    """A few Seq2SeqTrainer steps on a toy task (output = the source, then EOS) lower the loss well below the
    uniform guess's ln(vocab)."""
    from torch.utils.data import Dataset
    from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments

    class Copy(Dataset):
        def __init__(self, n):
            g = torch.Generator().manual_seed(0)
            self.rows = [torch.randint(3, 8, (4,), generator=g) for _ in range(n)]

        def __len__(self):
            return len(self.rows)

        def __getitem__(self, i):
            return {"input_ids": self.rows[i], "labels": torch.cat([self.rows[i], torch.tensor([EOS])])}

    model = tiny_model(dtype=torch.float32, initializer_range=0.02)
    model.train()
    args = Seq2SeqTrainingArguments(
        output_dir=str(tmp_path), max_steps=24, per_device_train_batch_size=8, learning_rate=1e-2, logging_steps=4,
        report_to=[], save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True,
    )
    trainer = Seq2SeqTrainer(model=model, args=args, train_dataset=Copy(192))
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 6 and losses[-1] < 0.6 * losses[0], losses


def test_cipher_task_and_training_script(tmp_path):
    """The toy task's translation is the reversed sentence through the dictionary; an oracle scores BLEU = chrF =
    100; the script trains, translates and scores at a tiny size."""
    pytest.importorskip("sacrebleu")
    from training.train_seq2seq import CipherTask, TaskArguments, collate, main, score

    task = CipherTask(TaskArguments(num_words=7, min_len=2, max_len=5))
    examples = task.sample(6, seed=0)
    for example in examples:
        words = example["input_ids"] - 3
        expected = task.dictionary[words.flip(0)] + 3 + 7
        assert torch.equal(example["labels"], torch.cat([expected, torch.tensor([EOS])]))
    batch = collate(examples)
    assert torch.equal(batch["attention_mask"].sum(1), (batch["input_ids"] != PAD).sum(1))

    class Oracle:  # "translates" by looking the source up: the metrics of a perfect system
        def eval(self):
            return self

        def generate(self, input_ids, **kwargs):
            rows = [next(e["labels"] for e in examples if torch.equal(e["input_ids"], src[src != PAD]))
                    for src in input_ids]
            return collate([{"input_ids": torch.cat([torch.tensor([PAD]), row]), "labels": row}
                            for row in rows])["input_ids"]

    perfect = score(Oracle(), task, examples, num_beams=1, batch_size=4)
    assert perfect["bleu"] == pytest.approx(100.0) and perfect["chrf"] == pytest.approx(100.0)
    assert perfect["exact_match"] == 1.0
    results = main([
        "--task", "cipher", "--output_dir", str(tmp_path), "--max_steps", "3", "--per_device_train_batch_size", "4",
        "--train_examples",
        "16", "--eval_examples", "4", "--num_beams", "2", "--report_to", "none", "--use_cpu", "--hidden_size", "16",
        "--intermediate_size", "16", "--feature_map", "favor", "--d_dot", "16", "--save_strategy", "no",
        "--disable_tqdm", "true", "--logging_steps", "1",
    ])
    assert json.loads((tmp_path / "results.json").read_text())["parameters"] == results["parameters"]
    assert len(results["loss_curve"]) == 3 and results["valid"]["bleu"] < 100.0
