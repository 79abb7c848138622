"""training.dynamic_eval_layers: dynamic evaluation restricted to parameter groups, each at its best step size."""
import json

import pytest
import torch

from test_test_time_fwl import ids_of, tiny_llama
from training import dynamic_eval_layers as layers
from training.document_eval import score_document
from training.dynamic_eval import DynamicEvaluation, untie_output_embedding


def untied(**overrides):
    model = tiny_llama(num_hidden_layers=5, **overrides)
    untie_output_embedding(model)
    return model


def test_groups_name_the_last_blocks_and_the_untied_output_side():
    model = untied()
    assert layers.group_parameters(model, "all") is None
    assert layers.group_parameters(model, "output") == ["model.norm.weight", "lm_head.weight"]
    assert layers.group_parameters(model, "last_down") == ["model.layers.4.mlp.down_proj.weight"]
    assert sorted(layers.group_parameters(model, "last_down_o")) == [
        "model.layers.4.mlp.down_proj.weight", "model.layers.4.self_attn.o_proj.weight"]
    last4 = layers.group_parameters(model, "last_4_blocks")
    assert {n.split(".")[2] for n in last4} == {"1", "2", "3", "4"} and "model.norm.weight" not in last4
    both = layers.group_parameters(model, "output_last_block")
    assert "lm_head.weight" in both and all(".layers.4." in n for n in both[2:]) and len(both) > 4
    assert "model.embed_tokens.weight" not in both  # the untied copy adapts, the input embedding stays
    with pytest.raises(ValueError, match="unknown group"):
        layers.group_parameters(model, "first_block")
    with pytest.raises(ValueError, match="layers"):
        layers.block_prefixes(torch.nn.Linear(2, 2))


def test_measure_picks_each_groups_best_step_size_and_leaves_the_model_alone():
    model = untied()
    documents = [ids_of(300, seed=3)[0], ids_of(200, seed=4)[0]]  # more than one segment of 128
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    results = layers.measure(model, documents, ["last_down", "all"], [1e-3, 3e-1])
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    row = results["last_down"]
    # a group's perplexity is dynamic evaluation of exactly its parameters (the step loop of document_eval)
    want = torch.cat([torch.as_tensor(score_document(model, d, 128, DynamicEvaluation(
        3e-1, parameters=["model.layers.4.mlp.down_proj.weight"]))) for d in documents]).mean().exp()
    assert row["perplexity"][3e-1] == pytest.approx(want.item(), rel=1e-6)
    assert row["perplexity"][3e-1] != pytest.approx(results["base"]["perplexity"], rel=1e-6)
    assert row["best"] == min(row["perplexity"].values())
    assert row["vs_base"] == pytest.approx(row["best"] / results["base"]["perplexity"])
    gain_all = results["base"]["perplexity"] - results["all"]["best"]
    if gain_all > 0:
        assert results["all"]["share_of_all"] == pytest.approx(1.0)
        assert row["share_of_all"] == pytest.approx((results["base"]["perplexity"] - row["best"]) / gain_all)
    assert "| last_down |" in layers.report(results)


def test_command_line_writes_its_record(tiny_wiki, gpt2_format_bpe, tmp_path):
    from modeling_fwp.tokenization import gpt2_tokenizer

    tokenizer = gpt2_tokenizer(data_dir=gpt2_format_bpe[0])
    tiny_llama(vocab_size=len(tokenizer)).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    out = layers.main(["--model", str(tmp_path / "model"), "--data_dir", str(tiny_wiki["train"].parent),
                       "--documents", "1", "--max_length", "40", "--groups", "output", "last_down",
                       "--step_sizes", "1e-2", "--results_file", str(tmp_path / "r.json")])
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["run"]["command"].startswith("python -m training.dynamic_eval_layers --model")
    assert saved["tokens"] == out["tokens"] == 39 and set(saved["results"]) == {"base", "output", "last_down"}
    with pytest.raises(ValueError, match="--step_sizes"):
        layers.main(["--model", str(tmp_path / "model"), "--step_sizes", "0"])
