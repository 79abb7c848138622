"""Stream scoring and dynamic evaluation (training.dynamic_eval) on transformers' own causal LMs: a tiny random Llama
(SmolLM2's architecture), whose DynamicCache is carried between segments, and the FWL head on it. Our Transformer-XL
and fast-weight models are covered in test_transfo_xl.py."""
import json
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from modeling_fwp import FWLConfig, FWLForCausalLM
from modeling_fwp.cache_fwp import CACHE_ARGUMENT, output_cache
from training.dynamic_eval import DynamicEvaluation, score_stream

VOCAB = 40


def llama_config(**overrides) -> LlamaConfig:
    kwargs = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True,
    )
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


def tiny_lm(kind: str, seed: int = 0, **overrides) -> torch.nn.Module:
    torch.manual_seed(seed)
    if kind == "llama":
        return LlamaForCausalLM(llama_config(**overrides)).eval()
    return FWLForCausalLM(FWLConfig(text_config=llama_config(**overrides), fwl_step_size_init=0.1)).eval()


def ids_of(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def token_nll(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """``[B, N - 1]``: -log p(ids[:, t + 1] | ids[:, :t + 1]) from one full forward."""
    logits = model(ids).logits.float()
    return -logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]


@pytest.mark.parametrize("kind", ["llama", "fwl_on_llama"])
def test_carried_cache_scoring_equals_one_full_forward(kind):
    model = tiny_lm(kind)
    ids = ids_of(2, 23)
    with torch.no_grad():
        nll = token_nll(model, ids)
    result = score_stream(model, ids, segment_length=5)
    assert result.num_tokens == 2 * 22 and len(result.segment_nll) == 5
    expected = [float(nll[:, start : start + 5].sum()) for start in range(0, 22, 5)]
    assert result.segment_nll == pytest.approx(expected, rel=1e-5)
    assert result.seconds_per_token > 0


@pytest.mark.parametrize("kind", ["llama", "fwl_on_llama"])
def test_dynamic_evaluation_adapts_a_copy_of_any_causal_lm(kind):
    """The carried KV cache is detached between segments (a second backward through it would fail), the loss on a
    repeated segment drops, and the caller's model is left as it was (weights, ties, gradients, mode)."""
    model = tiny_lm(kind).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    objects = dict(model.named_parameters(remove_duplicate=False))
    segment = ids_of(1, 12, seed=9)
    ids = torch.cat([segment, segment, segment], 1)
    static = score_stream(model, ids, segment_length=12)
    for method, lr in (("sgd", 0.3), ("rms", 1e-2)):
        dynamic = score_stream(model, ids, segment_length=12, dynamic=DynamicEvaluation(lr=lr, method=method))
        assert dynamic.segment_nll[0] == pytest.approx(static.segment_nll[0], rel=1e-5)  # same weights at the start
        assert dynamic.segment_nll[2] < static.segment_nll[2] - 1.0, method  # adapted to the repeated text
    assert model.training
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in model.parameters())
    assert all(p is objects[n] for n, p in model.named_parameters(remove_duplicate=False))


def reference_sgd(model: torch.nn.Module, ids: torch.Tensor, segment_length: int, lr: float, names: list) -> list:
    """Krause et al.'s SGD dynamic evaluation written out with ``torch.func.functional_call``: per segment, score
    with the current weights and the carried (constant) keys and values, then theta -= lr * grad(mean segment NLL)."""
    params = {name: p.detach().clone().requires_grad_(True) for name, p in model.named_parameters() if name in names}
    cache, nlls = None, []
    for start in range(0, ids.shape[1] - 1, segment_length):
        end = min(start + segment_length, ids.shape[1] - 1)
        kwargs = {"input_ids": ids[:, start:end], "use_cache": True, CACHE_ARGUMENT: cache}
        out = torch.func.functional_call(model, params, args=(), kwargs=kwargs)
        logp = out.logits.float().log_softmax(-1)
        nll = -logp.gather(-1, ids[:, start + 1 : end + 1, None]).sum()
        grads = torch.autograd.grad(nll / (end - start), list(params.values()))
        params = {name: (p - lr * g).detach().requires_grad_(True) for (name, p), g in zip(params.items(), grads)}
        cache = output_cache(out)
        for layer in cache.layers:
            layer.keys, layer.values = layer.keys.detach(), layer.values.detach()
        nlls.append(float(nll.detach()))
    return nlls


def test_dynamic_evaluation_of_named_parameters_matches_a_reference():
    model = tiny_lm("llama", tie_word_embeddings=False)
    ids = ids_of(1, 26, seed=3)
    globs = ["model.layers.*.mlp.*", "lm_head.weight"]
    evaluation = DynamicEvaluation(lr=0.5, parameters=globs)
    names = evaluation.adapted_names(model)
    assert names == [n for n, _ in model.named_parameters() if ".mlp." in n] + ["lm_head.weight"]
    got = score_stream(model, ids, segment_length=6, dynamic=evaluation).segment_nll
    expected = reference_sgd(model, ids, 6, 0.5, names)
    assert got == pytest.approx(expected, rel=1e-5)
    assert got[-1] != pytest.approx(score_stream(model, ids, segment_length=6).segment_nll[-1], rel=1e-3)


def test_parameter_names_follow_ties_and_are_checked():
    model = tiny_lm("llama")  # lm_head.weight is model.embed_tokens.weight
    assert DynamicEvaluation(parameters=["lm_head.weight"]).adapted_names(model) == ["model.embed_tokens.weight"]
    with pytest.raises(ValueError, match=r"`parameters`.*'model\.layers\.\*\.mlpp\.\*'"):
        DynamicEvaluation(parameters=["model.layers.*.mlpp.*", "lm_head.weight"]).adapted_names(model)
    with pytest.raises(ValueError, match="`parameters` must be"):
        DynamicEvaluation(parameters="lm_head.weight")
    with pytest.raises(ValueError, match="`method`"):
        DynamicEvaluation(method="adam")


def test_eval_lm_dynamic_evaluation_of_a_llama_folder(tmp_path, word_tokenizer):
    """`python -m training.eval_lm --model_name_or_path <Llama folder> --dynamic_eval`: the step size is chosen on the
    valid split from the default grid, and the rows report it with the perplexities tried and the time per token."""
    from training import eval_lm
    from training.dynamic_eval import DEFAULT_STEP_SIZES

    tiny_lm("llama", vocab_size=len(word_tokenizer)).save_pretrained(tmp_path / "llama")
    word_tokenizer.save_pretrained(tmp_path / "llama")
    (tmp_path / "data").mkdir()
    for split, text in (("valid", "the cat sat on the mat\nthe dog sat\n"), ("test", "fast weights are slow nets\n")):
        (tmp_path / "data" / f"{split}.txt").write_text(text * 3)
    rows = eval_lm.main(["--model_name_or_path", str(tmp_path / "llama"), "--data_dir", str(tmp_path / "data"),
                         "--block_size", "4", "--dynamic_eval", "--dynamic_method", "rms", "--dynamic_eval_params",
                         "model.layers.1.*", "--max_eval_tokens", "16", "--results_file", str(tmp_path / "out.json")])
    static, dynamic = rows
    assert static["mode"] == "static" and dynamic["mode"].startswith("dynamic (rms, lr ")
    tried = {float(k): v for k, v in dynamic["dynamic_lr_on_valid"].items()}
    assert sorted(tried) == sorted(DEFAULT_STEP_SIZES["rms"]) and all(math.isfinite(v) for v in tried.values())
    assert dynamic["dynamic_lr"] == min(tried, key=tried.get)
    assert dynamic["dynamic_eval_params"] == ["model.layers.1.*"]
    assert all(r["tokens"] == 15 and r["ms_per_token"] > 0 for r in rows)
    assert json.loads((tmp_path / "out.json").read_text())["results"] == rows
