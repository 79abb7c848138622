"""Test-time-only FWL (training.test_time_fwl, FWLConfig(fwl_head_type="output")) against a step-by-step reference
written from Clark et al. 2022's equations, generation with and without the cache, and whole-document scoring
(training.document_eval) on a tiny random Llama (SmolLM2's architecture)."""
import copy
import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import Gemma2Config, LlamaConfig, LlamaForCausalLM

from modeling_fwp import FWLConfig, FWLForCausalLM
from training.document_eval import TokenScores, prior_occurrences, score_document
from training.dynamic_eval import DynamicEvaluation, untie_output_embedding
from training.test_time_fwl import TEST_TIME_FAST_PARAMETERS, build_test_time_fwl, set_global_step_size

VOCAB = 40


def tiny_llama(seed=0, **overrides):
    kwargs = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**kwargs)).eval()
    with torch.no_grad():  # a final norm gain other than 1, so that its fast update is visible
        model.model.norm.weight.uniform_(0.5, 1.5)
    return model


def ids_of(length, seed=1, batch=1):
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def reference_logits(base, ids, alpha, fast=("g", "E", "c"), seen_rows=False):
    """Clark et al. 2022 sec. 2 (eq. 1) one position at a time: theta_t = theta - alpha sum_{j<t} grad CE_j(theta)
    for theta = (final RMSNorm gain g, output embedding E (untied), output bias c = 0), gradients at the slow theta,
    logits_t = RMSNorm_{g_t}(h_t) E_t^T + c_t on the base's pre-norm hidden states h_t. With `seen_rows`, the
    gradient of position j changes only E's rows and c's entries of the tokens x_0 .. x_{j+1}."""
    captured = {}
    hook = base.model.norm.register_forward_hook(lambda m, inputs, out: captured.setdefault("h", inputs[0]))
    with torch.no_grad():
        base(ids)
    hook.remove()
    h = captured["h"][0].double()
    eps = base.model.norm.variance_epsilon
    slow = {"g": base.model.norm.weight.double(), "E": base.lm_head.weight.double(),
            "c": torch.zeros(VOCAB, dtype=torch.float64)}

    def logits(theta, h_t):
        n = h_t * torch.rsqrt(h_t.pow(2).mean() + eps)
        return (n * theta["g"]) @ theta["E"].T + theta["c"]

    total = {k: torch.zeros_like(v) for k, v in slow.items()}
    out = []
    for t in range(ids.shape[1]):
        out.append(logits({k: slow[k] - alpha * total[k] if k in fast else slow[k] for k in slow}, h[t]))
        if t + 1 < ids.shape[1]:
            theta = {k: v.clone().requires_grad_(True) for k, v in slow.items()}
            loss = F.cross_entropy(logits(theta, h[t])[None], ids[0, t + 1 : t + 2])
            seen = torch.zeros(VOCAB, dtype=torch.float64)
            seen[ids[0, : t + 2]] = 1  # fast_vocabulary="seen": E's rows and c's entries of x_0 .. x_{t+1} only
            for k, g in zip(theta, torch.autograd.grad(loss, list(theta.values()))):
                total[k] += g * seen.view(-1, *[1] * (g.dim() - 1)) if seen_rows and k in ("E", "c") else g
    return torch.stack(out)


@pytest.mark.parametrize("alpha", [0.05, 0.5])
@pytest.mark.parametrize("gain,vocabulary", [(False, "full"), (True, "full"), (False, "seen"), (True, "seen")])
def test_test_time_fwl_equals_the_step_by_step_reference(alpha, gain, vocabulary):
    """By default E and c are fast (``TEST_TIME_FAST_PARAMETERS``); with ``norm.weight`` the final norm's gain too.
    With ``fast_vocabulary="seen"``, E's and c's gradients kept on the rows of the tokens so far."""
    base = tiny_llama()
    ids = ids_of(14)
    expected = reference_logits(base, ids, alpha, ("g", "E", "c") if gain else ("E", "c"), vocabulary == "seen")
    names = ["norm.weight", "output_embedding.weight", "output_bias"] if gain else None
    model = build_test_time_fwl(copy.deepcopy(base), step_size=alpha, fast_parameters=names, fast_vocabulary=vocabulary)
    assert model.fwl_head.fast_parameter_names == (tuple(names) if gain else TEST_TIME_FAST_PARAMETERS)
    assert [float(model.fwl_head.step_size(n)) for n in model.fwl_head.fast_parameter_names] == pytest.approx(
        [alpha] * (3 if gain else 2))
    with torch.no_grad():
        fast = model(ids).logits[0].double()
        with model.fwl_head.slow_only():
            slow = model(ids).logits
        plain = base(ids).logits
    assert (fast - expected).abs().max() < 1e-5 * max(1.0, expected.abs().max())
    assert (fast - plain[0]).abs().max() > 1e-2  # the fast update does something
    torch.testing.assert_close(slow, plain, rtol=1e-5, atol=1e-5)  # fast update off: exactly the base model


def test_segments_with_cache_and_generation_cached_vs_uncached():
    model = build_test_time_fwl(tiny_llama(), step_size=0.3)
    ids = ids_of(17, seed=3)
    with torch.no_grad():
        full = model(ids).logits
        out, parts = None, []
        for start in range(0, 17, 5):
            out = model(ids[:, start : start + 5], use_cache=True, past_key_values=out.past_key_values if out else None)
            parts.append(out.logits)
        cached = model.generate(ids[:, :6], max_new_tokens=8, do_sample=False, use_cache=True)
        uncached = model.generate(ids[:, :6], max_new_tokens=8, do_sample=False, use_cache=False)
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-5, atol=1e-5)
    assert torch.equal(cached, uncached)


def test_output_side_head_save_load_keeps_the_untied_copy(tmp_path):
    base = tiny_llama()
    model = build_test_time_fwl(copy.deepcopy(base), step_size=0.2)
    E = model.fwl_head.slow.output_embedding.weight
    assert E.data_ptr() != model.get_input_embeddings().weight.data_ptr()
    torch.testing.assert_close(E, base.lm_head.weight)
    model.save_pretrained(tmp_path)
    loaded = FWLForCausalLM.from_pretrained(tmp_path).eval()
    ids = ids_of(9)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=1e-6, atol=1e-6)


def test_output_side_head_bad_input():
    with pytest.raises(ValueError, match="fwl_residual"):
        FWLConfig(text_config=LlamaConfig(vocab_size=VOCAB, hidden_size=32), fwl_head_type="output", fwl_residual=True)
    with pytest.raises(ValueError, match="fwl_head_type"):
        FWLConfig(text_config=LlamaConfig(vocab_size=VOCAB, hidden_size=32), fwl_head_type="attention")
    with pytest.raises(ValueError, match="up_proj.weight"):  # no MLP in an output-side head
        build_test_time_fwl(tiny_llama(), fast_parameters=["up_proj.weight"])
    gemma = Gemma2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    from transformers import Gemma2ForCausalLM

    torch.manual_seed(0)
    gemma_model = Gemma2ForCausalLM(gemma)
    with torch.no_grad():
        gemma_model.model.norm.weight.uniform_(0.5, 1.5)
    with pytest.raises(ValueError, match="RMSNorm"):  # Gemma's (1 + w) gain
        build_test_time_fwl(gemma_model)
    with pytest.raises(ValueError, match="step_size"):
        set_global_step_size(build_test_time_fwl(tiny_llama()).fwl_head, 0.0)


def test_document_scoring_in_segments_equals_one_forward_and_dynamic_adapts_a_copy():
    base = tiny_llama()
    ids = ids_of(23, seed=5)[0]
    with torch.no_grad():
        logits = base(ids[None]).logits[0]
    expected = F.cross_entropy(logits[:-1], ids[1:], reduction="none").double().numpy()
    np.testing.assert_allclose(score_document(base, ids, segment_length=5), expected, rtol=1e-5)
    np.testing.assert_allclose(score_document(base, ids, 5, DynamicEvaluation(lr=0.0)), expected, rtol=1e-5)
    before = {n: p.clone() for n, p in base.named_parameters()}
    adapted = score_document(base, ids, 5, DynamicEvaluation(lr=1.0, parameters=["lm_head.weight"]))
    np.testing.assert_allclose(adapted[:5], expected[:5], rtol=1e-5)  # the first segment is scored before any step
    assert np.abs(adapted[5:] - expected[5:]).max() > 1e-3
    assert all(torch.equal(p, before[n]) for n, p in base.named_parameters())


def test_untie_output_embedding():
    model = tiny_llama()
    assert untie_output_embedding(model) and not untie_output_embedding(model)
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    torch.testing.assert_close(model.lm_head.weight, model.model.embed_tokens.weight)


def test_prior_occurrences_and_summary_buckets():
    ids = torch.tensor([5, 6, 5, 5, 7, 6])
    assert prior_occurrences(ids).tolist() == [0, 1, 2, 0, 1]  # targets 6, 5, 5, 7, 6
    nll = np.log(np.array([2.0, 4.0, 4.0, 8.0, 2.0]))
    scores = TokenScores(nll, np.arange(1, 6), prior_occurrences(ids), np.array([5, 50, 50, 500, 5]), 1.0)
    s = scores.summary()
    assert s["tokens"] == 5 and s["perplexity"] == pytest.approx(math.exp(nll.mean()), rel=1e-4)
    assert s["first"] == {"perplexity": pytest.approx(math.sqrt(2 * 8), rel=1e-4), "tokens": 2}
    assert s["repeated"]["tokens"] == 3 and s["rare"]["tokens"] == 4
    assert s["by_prior_occurrences"]["2-4"]["tokens"] == 1 and s["by_train_frequency"]["100-999"]["tokens"] == 1


def test_document_eval_command_line_end_to_end(tiny_wiki, gpt2_format_bpe, tmp_path):
    """``training.document_eval.main`` on a tiny Llama and the fixture corpus: every method scores the same tokens,
    the step sizes come from the valid split, and the results file carries the run record and the settings under
    the HfArgumentParser option names."""
    from modeling_fwp.tokenization import gpt2_tokenizer
    from training import document_eval

    tokenizer = gpt2_tokenizer(data_dir=gpt2_format_bpe[0])
    tiny_llama(vocab_size=len(tokenizer)).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    out = document_eval.main([
        "--model_name_or_path", str(tmp_path / "model"), "--data_dir", str(tiny_wiki["train"].parent),
        "--methods", "base", "test_time_fwl", "test_time_fwl_seen", "dynamic_output", "--max_documents", "1",
        "--valid_documents", "1",
        "--max_length", "48", "--segment_length", "16", "--train_documents", "2", "--fwl_step_sizes", "1e-4", "1e-3",
        "--dynamic_lr", "1e-3", "--results_file", str(tmp_path / "results.json")])
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["run"]["command"].startswith("python -m training.document_eval --model_name_or_path")
    assert (saved["settings"]["model_name_or_path"] == str(tmp_path / "model")
            and saved["settings"]["segment_length"] == 16)
    assert (list(saved["results"]) == ["base", "test_time_fwl", "test_time_fwl_seen", "dynamic_output"]
            == list(out["results"]))
    tokens = {method: result["summary"]["tokens"] for method, result in saved["results"].items()}
    assert len(set(tokens.values())) == 1 and tokens["base"] == 47  # one document cut to 48 tokens
    assert set(saved["results"]["test_time_fwl"]["valid_perplexity_by_step_size"]) == {"0.0001", "0.001"}
    assert saved["results"]["dynamic_output"]["step_size"] == 1e-3 and saved["results"]["base"]["step_size"] is None


def one_table_folders(tmp_path, tokenizer):
    """Model folders (1) base, (2) "fine-tuned" (another seed) and (3) an FWL model on (1), for ``--one_table``."""
    from modeling_fwp import FWLForCausalLM

    folders = {name: tmp_path / name for name in ("base", "finetuned", "fwl")}
    tiny_llama(vocab_size=len(tokenizer)).save_pretrained(folders["base"])
    tiny_llama(seed=3, vocab_size=len(tokenizer)).save_pretrained(folders["finetuned"])
    fwl = FWLForCausalLM.from_base_pretrained(tiny_llama(vocab_size=len(tokenizer)), fwl_intermediate_size=16,
                                              fwl_step_size_init=0.5)
    fwl.save_pretrained(folders["fwl"])
    for folder in folders.values():
        tokenizer.save_pretrained(folder)
    return folders


def test_document_eval_one_table_rows_and_goals(tiny_wiki, gpt2_format_bpe, tmp_path):
    """``--one_table``: exactly issue 17 item 4's rows from three folders, on the same tokens; (2) + dynamic evaluation
    and the test-time FWL on (2) get their step sizes from valid; (3') is (3) with its fast updates off; the goals
    are computed from the rows."""
    from modeling_fwp.tokenization import gpt2_tokenizer
    from training import document_eval

    tokenizer = gpt2_tokenizer(data_dir=gpt2_format_bpe[0])
    folders = one_table_folders(tmp_path, tokenizer)
    out = document_eval.main([
        "--model_name_or_path", str(folders["base"]), "--finetuned_model", str(folders["finetuned"]),
        "--fwl_model", str(folders["fwl"]), "--one_table", "--data_dir", str(tiny_wiki["train"].parent),
        "--max_documents", "1", "--valid_documents", "1", "--max_length", "48", "--segment_length", "16",
        "--train_documents", "2", "--fwl_step_sizes", "1e-4", "1e-2", "--dynamic_lr", "1e-3", "3e-2"])
    results = out["results"]
    assert list(results) == list(document_eval.ONE_TABLE)
    assert {m: r["summary"]["tokens"] for m, r in results.items()} == dict.fromkeys(document_eval.ONE_TABLE, 47)
    assert (results["finetuned_dynamic"]["model"] == str(folders["finetuned"])
            == results["finetuned_test_time_fwl"]["model"])
    for method in ("finetuned_dynamic", "finetuned_test_time_fwl"):  # chosen on valid among the candidates given
        tried = results[method]["valid_perplexity_by_step_size"]
        assert len(tried) == 2 and f"{results[method]['step_size']:g}" == min(tried, key=tried.get)
    ppl = {m: r["summary"]["perplexity"] for m, r in results.items()}
    assert ppl["finetuned"] != ppl["base"] and ppl["fwl_slow_only"] != ppl["fwl"]  # fast updates off changes (3)
    assert ppl["finetuned_dynamic"] != ppl["finetuned"] and ppl["finetuned_test_time_fwl"] != ppl["finetuned"]
    goals = out["goals"]
    assert goals["trained_fwl"]["gain_over_finetuned"] == pytest.approx(ppl["finetuned"] - ppl["fwl"], abs=1e-3)
    assert goals["test_time_fwl_on_base"]["gain_over_base"] == pytest.approx(ppl["base"] - ppl["test_time_fwl"],
                                                                             abs=1e-3)


def test_one_table_needs_its_model_folders_and_an_fwl_model(tmp_path, word_tokenizer):
    from training import document_eval

    with pytest.raises(ValueError, match="--finetuned_model"):
        document_eval.parse_args(["--one_table", "--fwl_model", "x"])
    with pytest.raises(ValueError, match="--fwl_model"):
        document_eval.parse_args(["--methods", "base", "fwl_slow_only"])
    with pytest.raises(ValueError, match="twice"):
        document_eval.parse_args(["--methods", "base", "base"])
    assert document_eval.parse_args(["--one_table", "--fwl_model", "a", "--finetuned_model", "b"]).methods == list(
        document_eval.ONE_TABLE)
    tiny_llama(vocab_size=len(word_tokenizer)).save_pretrained(tmp_path / "plain")
    args = document_eval.parse_args(["--methods", "fwl_slow_only", "--fwl_model", str(tmp_path / "plain")])
    with pytest.raises(ValueError, match="has no FWL head"):
        document_eval.build_method("fwl_slow_only", args)


def rows(**ppl_and_speed):
    """Hand-made summaries: method=(perplexity, tokens/s)."""
    return {m: {"perplexity": p, "tokens_per_second": v} for m, (p, v) in ppl_and_speed.items()}


def test_goal_summary_arithmetic_met_and_not_met():
    from training.document_eval import goal_report, goal_summary

    # (2) 18.0, (2) + dynamic evaluation 17.0 (gain 1.0), (3) 17.4 (gain 0.6: ratio 0.6), 1.1x the base's time
    met = goal_summary(rows(base=(20.0, 100.0), finetuned=(18.0, 100.0), finetuned_dynamic=(17.0, 30.0),
                            fwl=(17.4, 100 / 1.1), test_time_fwl=(19.9, 100 / 1.1)))
    assert met["trained_fwl"]["gain_ratio"] == pytest.approx(0.6) and met["trained_fwl"]["met"] is True
    assert met["trained_fwl"]["time_vs_base"] == pytest.approx(1.1)
    assert met["test_time_fwl_on_base"]["met"] is True and met["test_time_fwl_on_base"]["ppl_ratio"] == 0.995
    assert goal_report(met).count("NOT MET") == 0 and goal_report(met).count("MET") == 2
    # gain ratio 0.4 < 0.5; the test-time FWL gains but at 1.62x: both not met
    slow = goal_summary(rows(base=(20.0, 100.0), finetuned=(18.0, 100.0), finetuned_dynamic=(17.0, 30.0),
                             fwl=(17.6, 100.0), test_time_fwl=(19.9, 100 / 1.62)))
    assert slow["trained_fwl"]["gain_ratio"] == pytest.approx(0.4) and slow["trained_fwl"]["met"] is False
    assert slow["test_time_fwl_on_base"]["met"] is False and goal_report(slow).count("NOT MET") == 2
    # enough gain but 1.3x the base's time; and no gain at all for the test-time FWL
    late = goal_summary(rows(base=(20.0, 100.0), finetuned=(18.0, 100.0), finetuned_dynamic=(17.0, 30.0),
                             fwl=(17.0, 100 / 1.3), test_time_fwl=(20.1, 100.0)))
    assert late["trained_fwl"]["gain_ratio"] == pytest.approx(1.0) and late["trained_fwl"]["met"] is False
    assert late["test_time_fwl_on_base"]["met"] is False
    # dynamic evaluation gains nothing over (2): no ratio; (3) must still gain
    flat = goal_summary(rows(base=(20.0, 100.0), finetuned=(18.0, 100.0), finetuned_dynamic=(18.1, 30.0),
                             fwl=(18.0, 100.0)))
    assert flat["trained_fwl"]["gain_ratio"] is None and flat["trained_fwl"]["met"] is False
    assert "n/a" in goal_report(flat) and "test_time_fwl_on_base" not in flat
    assert goal_summary(rows(base=(20.0, 100.0), fwl=(17.0, 100.0))) == {}  # rows missing: no goal
    # the seen-rows variant is checked on its own: a gain at 1.03x met, beside the full update's 1.3x not met
    both = goal_summary(rows(base=(20.0, 100.0), test_time_fwl=(19.8, 100 / 1.3),
                             test_time_fwl_seen=(19.9, 100 / 1.03)))
    assert both["test_time_fwl_on_base"]["met"] is False and both["test_time_fwl_seen_on_base"]["met"] is True
    assert both["test_time_fwl_seen_on_base"]["gain_over_base"] == pytest.approx(0.1)
    assert "seen rows only" in goal_report(both)


def test_test_time_fwl_bf16_gradients_approximate_the_exact_update():
    """``build_test_time_fwl(gradient_dtype="bfloat16")`` (the benchmark's test_time_fwl_bf16): the config carries
    it, the logits stay close to the exact fast update's and are not the same computation."""
    base = tiny_llama()
    ids = ids_of(20)
    exact = build_test_time_fwl(copy.deepcopy(base), step_size=0.5)
    approx = build_test_time_fwl(copy.deepcopy(base), step_size=0.5, gradient_dtype="bfloat16")
    assert approx.config.fwl_gradient_dtype == "bfloat16" and approx.fwl_head.gradient_dtype == torch.bfloat16
    with torch.no_grad():
        want, got, plain = exact(ids).logits, approx(ids).logits, base(ids).logits
    assert (got - want).abs().max() < 0.05 * (want - plain).abs().max()
    assert not torch.equal(got, want)
    with pytest.raises(ValueError, match="fwl_gradient_dtype"):
        build_test_time_fwl(copy.deepcopy(base), gradient_dtype="int8")


def test_bench_test_time_fwl_quick_times_every_method(tmp_path, word_tokenizer, capsys):
    """benchmarks/bench_test_time_fwl.py --quick on a tiny Llama: every method timed, dynamic evaluation of the output
    side and the bf16 variant included, with the test-time FWL compared to dynamic_output; with ``--fwl_model`` the
    trained FWL (3) and its slow head (3') too, and asking for them without it is a ValueError naming the option."""
    import importlib.util
    from pathlib import Path

    from modeling_fwp import FWLForCausalLM

    tiny_llama(vocab_size=len(word_tokenizer)).save_pretrained(tmp_path / "model")
    word_tokenizer.save_pretrained(tmp_path / "model")
    FWLForCausalLM.from_base_pretrained(tiny_llama(vocab_size=len(word_tokenizer)), fwl_head_type="output",
                                        fwl_step_size_init=0.5).save_pretrained(tmp_path / "fwl")
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_test_time_fwl.py"
    spec = importlib.util.spec_from_file_location("bench_test_time_fwl", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(["--quick", "--model", str(tmp_path / "model"), "--output", str(tmp_path / "unused.json"),
                "--fwl_model", str(tmp_path / "fwl")])
    printed = capsys.readouterr().out
    for method in bench.METHODS + bench.TRAINED_METHODS:
        assert f"\n{method} " in "\n" + printed
    assert "test_time_fwl_vs_dynamic_output:" in printed and "test_time_fwl_bf16_vs_dynamic_output:" in printed
    assert "trained_fwl_vs_slow_only:" in printed
    assert not (tmp_path / "unused.json").exists()  # --quick writes no result file
    with pytest.raises(ValueError, match="--fwl_model"):
        bench.main(["--quick", "--model", str(tmp_path / "model"), "--methods", "base", "trained_fwl"])
    # the result file names what the trained FWL was (its row in the results table says it)
    trained = FWLForCausalLM.from_pretrained(tmp_path / "fwl")
    assert bench.trained_head_settings({"base": (None, None, None),
                                        "trained_fwl_slow_only": (trained, None, None)}) == {
        "trained_fwl_head": {"gradient_point": "slow", "fast_vocabulary": "full",
                             "fast_parameters": list(trained.fwl_head.fast_parameter_names)}}
    assert bench.trained_head_settings({"base": (None, None, None)}) == {}


def test_trained_fwl_seen_rows_loads_the_saved_model_with_the_restriction(tmp_path):
    """``document_eval.load_fwl_model`` (method ``fwl_seen``, the benchmark's ``trained_fwl_seen``): the saved
    FWL with its config's fwl_fast_vocabulary set to "seen", the same weights: its logits are those of the same model
    built with the restriction, not those of the saved (full) one; a folder without an FWL head is a ValueError."""
    from modeling_fwp import FWLForCausalLM
    from training.document_eval import build_method, load_fwl_model, parse_args

    base = tiny_llama()
    full = FWLForCausalLM.from_base_pretrained(copy.deepcopy(base), fwl_head_type="output",
                                               fwl_fast_parameters=["output_embedding.weight", "output_bias"],
                                               fwl_step_size_init=0.5).eval()
    full.save_pretrained(tmp_path / "fwl")
    loaded = load_fwl_model(str(tmp_path / "fwl"), "--fwl_model", "seen")
    assert loaded.config.fwl_fast_vocabulary == "seen"
    seen = FWLForCausalLM.from_base_pretrained(copy.deepcopy(base), fwl_head_type="output",
                                               fwl_fast_parameters=["output_embedding.weight", "output_bias"],
                                               fwl_step_size_init=0.5, fwl_fast_vocabulary="seen").eval()
    seen.load_state_dict(full.state_dict())
    ids = ids_of(24)
    with torch.no_grad():
        got, want, exact = loaded(ids).logits, seen(ids).logits, full(ids).logits
    torch.testing.assert_close(got, want)
    assert not torch.allclose(got, exact, atol=1e-6)
    args = parse_args(["--methods", "fwl_seen", "--fwl_model", str(tmp_path / "fwl")])
    assert build_method("fwl_seen", args).model.config.fwl_fast_vocabulary == "seen"
    base.save_pretrained(tmp_path / "plain")
    with pytest.raises(ValueError, match="--fwl_model.*no FWL head"):
        load_fwl_model(str(tmp_path / "plain"), "--fwl_model", "seen")
    with pytest.raises(ValueError, match="--fwl_model.*no FWL head"):
        load_fwl_model(str(tmp_path / "plain"), "--fwl_model")


def gradient_point_reference(o, ids, E, alpha, point, segment_length, seen_rows=False):
    """The output side (E, c) made fast one position at a time, each per-token gradient by autograd: weights at t =
    the segment's start minus alpha times the gradients of its earlier positions (none for
    "segment_start_no_in_segment"); a segment's start = the previous start minus alpha times all its gradients;
    gradients at the slow (E, 0) for "slow", at the segment's start otherwise. With `seen_rows`, the gradient of
    position t keeps only E's rows and c's entries of the tokens x_0 .. x_{t+1}."""
    slow = (E.double(), torch.zeros(E.shape[0], dtype=torch.float64))
    start, nll, o, T = slow, [], o.double(), ids.numel() - 1

    def loss(weights, t):
        return F.cross_entropy((o[t] @ weights[0].T + weights[1])[None], ids[t + 1 : t + 2])

    for a in range(0, T, segment_length):
        summed = [torch.zeros_like(start[0]), torch.zeros_like(start[1])]
        for t in range(a, min(a + segment_length, T)):
            current = start if point == "segment_start_no_in_segment" else tuple(
                s - alpha * g for s, g in zip(start, summed))
            nll.append(float(loss(current, t)))
            at = [w.clone().requires_grad_(True) for w in (slow if point == "slow" else start)]
            seen = torch.zeros(E.shape[0], dtype=torch.float64)
            seen[ids[: t + 2]] = 1
            for g, d in zip(summed, torch.autograd.grad(loss(at, t), at)):
                g += d * seen.view(-1, *[1] * (d.dim() - 1)) if seen_rows else d
        start = tuple(s - alpha * g for s, g in zip(start, summed))
    return torch.tensor(nll, dtype=torch.float64)


def gradient_point_module():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "fwl_gradient_point.py"
    spec = importlib.util.spec_from_file_location("fwl_gradient_point", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


@pytest.mark.parametrize("point", ["slow", "segment_start", "segment_start_no_in_segment"])
def test_gradient_point_benchmark_loop_equals_the_per_token_reference(point):
    """benchmarks/fwl_gradient_point.py's loop against per-token autograd from the definitions (3 segments of 6), and
    its "slow" update against the package's test-time FWL (E and c fast) on the same tiny Llama."""
    bench = gradient_point_module()
    base, ids, alpha = tiny_llama(), ids_of(17, seed=3)[0], 0.3
    with torch.no_grad():
        o = base.model(input_ids=ids[None]).last_hidden_state[0]
    E = base.get_output_embeddings().weight.detach()
    ours = bench.output_side_nll(o, ids, E, alpha, point, 6)
    expected = gradient_point_reference(o, ids, E, alpha, point, 6)
    torch.testing.assert_close(ours.double(), expected, rtol=1e-4, atol=1e-5)
    base_nll = bench.output_side_nll(o, ids, E, 0.0, point, 6)
    assert (ours[6:] - base_nll[6:]).abs().max() > 1e-3  # the update acts after the first segment
    if point == "slow":
        package = score_document(build_test_time_fwl(tiny_llama(), step_size=alpha), ids, segment_length=6)
        np.testing.assert_allclose(ours.numpy(), package, rtol=1e-4, atol=1e-5)


def test_gradient_point_benchmark_command_line_on_the_base_and_on_a_trained_fwl(tiny_wiki, gpt2_format_bpe, tmp_path):
    """benchmarks/fwl_gradient_point.py end to end on a tiny Llama and on an output-side FWL built from it (E and c
    fast, learned step sizes of its own): its "slow" loop passes the check against the package (else SystemExit),
    every gradient point is scored, and an FWL whose hidden layer is fast is refused with the option named."""
    from modeling_fwp.tokenization import gpt2_tokenizer

    bench = gradient_point_module()
    tokenizer = gpt2_tokenizer(data_dir=gpt2_format_bpe[0])
    tiny_llama(vocab_size=len(tokenizer)).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    fwl = FWLForCausalLM.from_base_pretrained(tiny_llama(vocab_size=len(tokenizer)), fwl_head_type="output",
                                              fwl_fast_parameters=list(TEST_TIME_FAST_PARAMETERS),
                                              fwl_step_size_init=0.2)
    with torch.no_grad():  # a trained-looking head: its own step sizes and output bias
        fwl.fwl_head.raw_step_size[1] -= 1.0
        fwl.fwl_head.slow.output_bias.normal_(0, 0.3)
    fwl.save_pretrained(tmp_path / "fwl")
    common = ["--model", str(tmp_path / "model"), "--data_dir", str(tiny_wiki["train"].parent), "--documents", "1",
              "--max_length", "40", "--segment_length", "8"]
    base = bench.main(common + ["--step_sizes", "0.1", "0.3", "--check_step_size", "0.3"])
    assert set(base["perplexity"]) == set(bench.GRADIENT_POINTS) and base["learned_step_sizes"] is None
    assert all(set(v) == {"0.1", "0.3"} for v in base["perplexity"].values())
    assert set(base["check"]) == {"slow", "segment_start"} and base["tokens"] == 39
    assert all(check["relative_difference"] < 1e-3 for check in base["check"].values())
    trained = bench.main(common + ["--fwl_model", str(tmp_path / "fwl"), "--output", str(tmp_path / "r.json")])
    alphas = trained["learned_step_sizes"]
    assert alphas[0] == pytest.approx(0.2, rel=1e-4) and alphas[1] < 0.1
    assert list(trained["check"]) == ["slow"] and trained["check"]["slow"]["relative_difference"] < 1e-3
    assert trained["check"]["slow"]["step_size"] == alphas[0]
    assert json.loads((tmp_path / "r.json").read_text())["best"] == trained["best"]
    assert trained["base_perplexity"] != pytest.approx(base["base_perplexity"], rel=1e-3)  # its own bias is read
    FWLForCausalLM.from_base_pretrained(tiny_llama(vocab_size=len(tokenizer)), fwl_head_type="output").save_pretrained(
        tmp_path / "fwl_gain")
    with pytest.raises(ValueError, match="--fwl_model"):
        bench.main(common + ["--fwl_model", str(tmp_path / "fwl_gain")])


@pytest.mark.parametrize("vocabulary", ["full", "seen"])
def test_segment_start_gradient_point_equals_the_per_token_reference_however_the_text_is_split(vocabulary):
    """``fwl_gradient_point="segment_start"`` (segments of 6 positions) scored in calls of 5 (misaligned with the
    segments), in one call, and one token at a time: equal to per-token autograd from the definition (with
    ``fast_vocabulary="seen"``, each gradient on the rows of the tokens so far) and to the benchmark's loop;
    generation cached = uncached; "slow" differs once a segment has passed."""
    base, ids, alpha = tiny_llama(), ids_of(17, seed=3)[0], 0.3
    with torch.no_grad():
        o = base.model(input_ids=ids[None]).last_hidden_state[0]
    E = base.get_output_embeddings().weight.detach()
    seen = vocabulary == "seen"
    expected = gradient_point_reference(o, ids, E, alpha, "segment_start", 6, seen_rows=seen)
    model = build_test_time_fwl(tiny_llama(), step_size=alpha, gradient_point="segment_start", segment_length=6,
                                fast_vocabulary=vocabulary)
    in_fives = torch.from_numpy(score_document(model, ids, segment_length=5))
    torch.testing.assert_close(in_fives, expected, rtol=1e-4, atol=1e-5)
    if seen:  # (the restriction changes the result: VOCAB = 40 rows, 15 of them seen at the end)
        full = gradient_point_reference(o, ids, E, alpha, "segment_start", 6)
        assert (full - expected).abs().max() > 1e-3
    else:
        torch.testing.assert_close(
            gradient_point_module().output_side_nll(o, ids, E, alpha, "segment_start", 6).double(),
            expected, rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        whole = model(ids[None]).logits
        out, steps = None, []
        for t in range(17):
            out = model(ids[None, t : t + 1], use_cache=True, past_key_values=out.past_key_values if out else None)
            steps.append(out.logits)
        cached = model.generate(ids[None, :4], max_new_tokens=10, do_sample=False, use_cache=True)
        uncached = model.generate(ids[None, :4], max_new_tokens=10, do_sample=False, use_cache=False)
    torch.testing.assert_close(torch.cat(steps, 1), whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(F.cross_entropy(whole[0, :-1], ids[1:], reduction="none").double(), expected,
                               rtol=1e-4, atol=1e-5)
    assert torch.equal(cached, uncached)
    slow = torch.from_numpy(score_document(build_test_time_fwl(tiny_llama(), step_size=alpha,
                                                               fast_vocabulary=vocabulary), ids, 5))
    torch.testing.assert_close(slow[:6], in_fives[:6])  # the first segment starts at the slow weights
    assert (slow[6:] - in_fives[6:]).abs().max() > 1e-3


@pytest.mark.parametrize("fold,vocabulary", [(False, "full"), (True, "full"), (False, "seen"), (True, "seen")])
def test_segment_start_calls_of_whole_segments_equal_the_reference_with_the_carried_read_folded_or_not(
        monkeypatch, fold, vocabulary):
    """Calls that each score one whole segment (the scoring's case, where E's carried sum is read once for the
    gradients and the fast pass): that read as a product with the sum S, or folded into the fast weights E - alpha S
    (``FWLHead._folded_preactivation``, for calls of at least ``_FOLD_CARRIED_SUM_MIN_POSITIONS`` positions), equal
    to per-token autograd from the definition, with the gradients on the seen rows or not; in a batch of two
    different texts each row equals its own."""
    from modeling_fwp import fwl as fwl_module

    monkeypatch.setattr(fwl_module, "_FOLD_CARRIED_SUM_MIN_POSITIONS", 1 if fold else 10**9)
    base, alpha = tiny_llama(), 0.3
    E = base.get_output_embeddings().weight.detach()
    model = build_test_time_fwl(tiny_llama(), step_size=alpha, gradient_point="segment_start", segment_length=6,
                                fast_vocabulary=vocabulary)
    texts = ids_of(19, seed=5, batch=2)
    for ids in texts:
        with torch.no_grad():
            o = base.model(input_ids=ids[None]).last_hidden_state[0]
        expected = gradient_point_reference(o, ids, E, alpha, "segment_start", 6, seen_rows=vocabulary == "seen")
        scored = torch.from_numpy(score_document(model, ids, segment_length=6))
        torch.testing.assert_close(scored, expected, rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        out, rows = None, []
        for a in range(0, 19, 6):
            out = model(texts[:, a : a + 6], use_cache=True, past_key_values=out.past_key_values if out else None)
            rows.append(out.logits)
        batched = torch.cat(rows, 1)
        for b in range(2):
            torch.testing.assert_close(batched[b : b + 1], model(texts[b : b + 1]).logits, rtol=1e-5, atol=1e-5)
    assert (model.fwl_head._fold_scratch is not None) == fold
    with torch.no_grad(), model.fwl_head.slow_only():  # (3'): the untouched model, no segment-start sums made
        torch.testing.assert_close(model(texts).logits, base(texts).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("vocabulary", ["full", "seen"])
def test_segment_start_gradient_point_trains_like_it_scores_and_refuses_what_it_cannot_do(tmp_path, vocabulary):
    """With autograd on (training), the same logits as without (the gradients on the seen rows or not); the loss
    reaches the step sizes; saved and loaded, the same model; left padding changes nothing. A hidden-layer
    parameter, a decay, bf16 gradients or a missing segment length: ValueError naming it."""
    model = build_test_time_fwl(tiny_llama(), step_size=0.3, gradient_point="segment_start", segment_length=4,
                                fast_vocabulary=vocabulary)
    model.save_pretrained(tmp_path / "saved")
    loaded = FWLForCausalLM.from_pretrained(tmp_path / "saved").eval()
    assert (loaded.fwl_head.gradient_point, loaded.fwl_head.segment_length) == ("segment_start", 4)
    assert loaded.fwl_head.fast_vocabulary == vocabulary
    model.fwl_head.raw_step_size.requires_grad_(True)
    ids = ids_of(11, seed=4, batch=2)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        inference = model(ids, attention_mask=mask).logits
    out = model(ids, attention_mask=mask, labels=ids)
    torch.testing.assert_close(out.logits, inference, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids, attention_mask=mask).logits, inference, rtol=1e-5, atol=1e-5)
    out.loss.backward()
    assert model.fwl_head.raw_step_size.grad.abs().min() > 0
    # left padding by a whole segment (segments are counted in positions, padding included): padded positions
    # neither learn nor teach, so the real tokens' logits are those of the unpadded row
    padded = torch.cat([torch.zeros(2, 4, dtype=torch.long), ids], 1)
    with torch.no_grad():
        padded_logits = model(padded, attention_mask=torch.cat([torch.zeros(2, 4, dtype=torch.long), mask], 1)).logits
    torch.testing.assert_close(padded_logits[:, 4:], inference, rtol=1e-4, atol=1e-5)
    fwl_config = dict(fwl_head_type="output", fwl_gradient_point="segment_start", fwl_segment_length=4,
                      fwl_fast_parameters=list(TEST_TIME_FAST_PARAMETERS))
    for change, argument in [(dict(fwl_fast_parameters=["norm.weight", "output_bias"]), "fast_parameters"),
                             (dict(fwl_decay_init=0.5), "decay_init"), (dict(fwl_gradient_dtype="bfloat16"),
                                                                       "gradient_dtype"),
                             (dict(fwl_segment_length=None), "fwl_segment_length")]:
        with pytest.raises(ValueError, match=argument):
            FWLForCausalLM.from_base_pretrained(tiny_llama(), **{**fwl_config, **change})
    with pytest.raises(ValueError, match="fwl_gradient_point"):
        FWLConfig(text_config=tiny_llama().config, fwl_gradient_point="fast")


def test_document_eval_builds_the_test_time_fwl_at_the_gradient_point_asked_for(tmp_path):
    """``--fwl_gradient_point segment_start`` reaches the test-time FWL methods, its segments those of scoring unless
    ``--fwl_segment_length`` says otherwise; a non-positive segment length is refused with the option named."""
    from training import document_eval

    tiny_llama().save_pretrained(tmp_path / "model")
    argv = ["--model_name_or_path", str(tmp_path / "model"), "--segment_length", "16"]
    head = document_eval.build_method("test_time_fwl", document_eval.parse_args(argv)).model.fwl_head
    assert head.gradient_point == "slow"
    args = document_eval.parse_args(argv + ["--fwl_gradient_point", "segment_start"])
    head = document_eval.build_method("test_time_fwl", args).model.fwl_head
    assert (head.gradient_point, head.segment_length) == ("segment_start", 16)
    args = document_eval.parse_args(argv + ["--fwl_gradient_point", "segment_start", "--fwl_segment_length", "8"])
    assert document_eval.build_method("test_time_fwl", args).model.fwl_head.segment_length == 8
    with pytest.raises(ValueError, match="--fwl_segment_length"):
        document_eval.parse_args(argv + ["--fwl_segment_length", "0"])
