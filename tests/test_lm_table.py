"""training.lm_table: the resumable driver of the language-modelling table (``--quick`` on the fixture corpus)."""
from __future__ import annotations

import json

import pytest

from training import lm_table, train_lm


def quick_argv(tiny_wiki, tmp_path) -> list:
    return ["--quick", "--data_dir", str(tiny_wiki["train"].parent), "--results_dir", str(tmp_path / "table"),
            "--table_file", str(tmp_path / "lm_table.md"), "--threads", "1"]


def test_quick_table_end_to_end_then_resumed_without_training(tiny_wiki, tmp_path, monkeypatch):
    done = lm_table.main(quick_argv(tiny_wiki, tmp_path))
    assert [p.name for p in done["runs"]] == ["delta_net_seed0.json", "llama_seed0.json"] and not done["skipped"]
    results = {p.name: json.loads(p.read_text()) for p in done["runs"]}
    delta, llama = results["delta_net_seed0.json"], results["llama_seed0.json"]
    assert delta["model_type"] == "fwp_delta_net" and llama["model_type"] == "llama"
    assert delta["run"]["command"].startswith("python -m training.lm_table --quick")
    for result in (delta, llama):
        assert result["training"]["steps"] == 3 and result["training"]["tokens_per_second"] > 0
        assert result["parameters"] > 0 and result["data"]["vocab_size"] == delta["data"]["vocab_size"]
    # the softmax baseline of the same size: within 10% of the Delta Net's parameters
    assert llama["parameters"] == pytest.approx(delta["parameters"], rel=0.1)
    protocols = {r["family"]: {(e["split"], e["protocol"]) for e in r["evaluation"]} for r in (delta, llama)}
    assert protocols["delta_net"] == {(s, p) for s in ("valid", "test") for p in ("sliding_window", "carried_state")}
    assert protocols["llama"] == {("valid", "sliding_window"), ("test", "sliding_window")}
    assert all(1 < e["perplexity"] < 1e4 and e["scored_tokens"] > 0 for e in delta["evaluation"])

    table = (tmp_path / "lm_table.md").read_text()
    sliding_test = next(e["perplexity"] for e in delta["evaluation"] if (e["split"], e["protocol"]) ==
                        ("test", "sliding_window"))
    delta_row = next(line for line in table.splitlines() if line.startswith("| Delta Net |"))
    assert f"| {sliding_test:.1f} |" in delta_row and "| 34.1 / 35.2 |" in delta_row  # ours and the paper's
    assert next(line for line in table.splitlines() if line.startswith("| Transformer (Llama) |")).count("| - |") >= 2
    assert "python -m training.lm_table --quick" in table

    # resumed: both runs exist, nothing is trained again
    monkeypatch.setattr(train_lm, "train_model", lambda args: pytest.fail("a finished run was trained again"))
    again = lm_table.main(quick_argv(tiny_wiki, tmp_path))
    assert not again["runs"] and len(again["skipped"]) == 2


def test_table_shows_mean_and_spread_over_seeds(tmp_path):
    runs = [{"seed": s, "parameters": 2e6, "training": {"tokens_per_second": 100.0},
             "evaluation": [{"split": "test", "protocol": "sliding_window", "perplexity": p}]}
            for s, p in ((0, 10.0), (1, 12.0))]
    row = lm_table.table_row("delta_rnn", runs)
    assert "| 11.0 ± 1.4 |" in row and "| 0, 1 |" in row and "| 31.8 / 32.8 |" in row and "| 2.00 |" in row


def test_rank_correlation_is_spearmans_with_mean_ranks_for_ties():
    assert lm_table.rank_correlation([10.0, 20.0, 30.0], [3.0, 2.0, 1.0]) == pytest.approx(-1.0)
    # ranks [1, 2, 3] against [1.5, 1.5, 3]: covariance 1.5, variances 2 and 1.5
    assert lm_table.rank_correlation([1.0, 2.0, 3.0], [5.0, 5.0, 7.0]) == pytest.approx(1.5 / (2 * 1.5) ** 0.5)
    with pytest.raises(ValueError, match="same length"):
        lm_table.rank_correlation([1.0, 2.0], [1.0])


def test_relative_table_compares_each_row_with_the_baseline_beside_the_paper():
    def runs(valid, test, **training):
        return [{"seed": 0, "training": training, "evaluation": [
            {"split": "valid", "protocol": "sliding_window", "perplexity": valid},
            {"split": "test", "protocol": "sliding_window", "perplexity": test}]}]

    grouped = {("llama", False): runs(100.0, 200.0), ("delta_lstm", False): runs(90.0, 210.0),
               ("linear_transformer", False): runs(150.0, 300.0), ("delta_net", False): runs(1.0, 1.0, in_order=True),
               ("delta_rnn", True): runs(1.0, 1.0, carry_state=True)}
    lines = lm_table.relative_to_baseline(grouped)
    assert "| Delta LSTM | -10.0% | +5.0% | -1.2% | -0.9% |" in lines
    assert "| Linear Transformer | +50.0% | +50.0% | +12.4% | +12.3% |" in lines
    assert not any(line.startswith(("| Delta Net", "| Delta RNN")) for line in lines)  # ablation, full context
    # valid ranks (LSTM, Llama, LT) agree with the paper's; test ranks (Llama, LSTM, LT) swap the first two
    assert lines[-2] == "Spearman rank correlation of these 3 rows with the paper's: 1.00 valid, 0.50 test."
    del grouped[("llama", False)]
    assert lm_table.relative_to_baseline(grouped) == []


def test_full_context_row_is_compared_with_the_papers_full_context_number():
    runs = [{"seed": 0, "parameters": 2e6, "training": {"tokens_per_second": 100.0, "carry_state": True},
             "evaluation": [{"split": "test", "protocol": "carried_state", "perplexity": 50.0}]}]
    row = lm_table.table_row("delta_rnn", runs, full_context=True)
    assert row.startswith("| Delta RNN + full context | 0 |") and row.endswith("| - | 31.8 / 32.8 | 44.6 |")
    assert "| 50.0 |" in row


def test_in_order_ablation_row_says_so():
    """A run of ``--train_lm_args --in_order`` (data in order, state reset) is not labelled as shuffled segments."""
    runs = [{"seed": 0, "parameters": 2e6, "training": {"tokens_per_second": 100.0, "in_order": True},
             "evaluation": []}]
    assert lm_table.table_row("recurrent_delta_net", runs).startswith(
        "| Recurrent Delta Net (data in order, state reset) | 0 |")
    runs[0]["training"]["carry_state"] = True
    assert lm_table.table_row("recurrent_delta_net", runs, full_context=True).startswith(
        "| Recurrent Delta Net + full context | 0 |")


def test_carried_state_runs_are_kept_apart_and_get_their_own_row(tiny_wiki, tmp_path):
    """``--carry_state``: trained with the state carried (train_lm's StateCarryingTrainer), written to
    ``<family>_full_context_seed<seed>.json`` beside the independent-segment run of the same family and seed (whose
    file does not mark it done), and shown in a row of its own."""
    results = tmp_path / "results"
    results.mkdir()
    segments = {"run": {"command": "python -m training.lm_table --families delta_net"}, "family": "delta_net",
                "seed": 0, "parameters": 10.5e6, "training": {"tokens_per_second": 500.0, "tokens_seen": 192,
                                                              "block_size": 32, "carry_state": False},
                "data": {"source": "data/wiki", "train_tokens": 650160, "vocab_size": 300},
                "window_size": 32, "stride": 8,
                "evaluation": [{"split": "test", "protocol": "sliding_window", "perplexity": 77.7}]}
    (results / "delta_net_seed0.json").write_text(json.dumps(segments))
    argv = quick_argv(tiny_wiki, tmp_path) + ["--families", "delta_net", "--carry_state", "--results_files_dir",
                                              str(results)]
    done = lm_table.main(argv)
    assert [p.name for p in done["runs"]] == ["delta_net_full_context_seed0.json"]
    carried = json.loads(done["runs"][0].read_text())
    assert carried["training"]["carry_state"] and carried["training"]["num_streams"] == 2
    assert (tmp_path / "table" / "runs" / "delta_net_full_context_seed0" / "model").is_dir()
    rows = [line for line in (tmp_path / "lm_table.md").read_text().splitlines() if line.startswith("| Delta Net")]
    assert [r.split(" |")[0] for r in rows] == ["| Delta Net", "| Delta Net + full context"]
    assert "| 77.7 |" in rows[0] and "| 77.7 |" not in rows[1]
    carried_test = next(e["perplexity"] for e in carried["evaluation"] if (e["split"], e["protocol"]) ==
                        ("test", "carried_state"))
    assert f"| {carried_test:.1f} |" in rows[1]


def test_resumes_from_a_checkpoint(tmp_path):
    args = lm_table.parse_args(["--results_dir", str(tmp_path)])
    argv = lm_table.train_lm_argv(args, "delta_lstm", 1, tmp_path / "tok")
    assert "--resume_from_checkpoint" not in argv and argv[argv.index("--max_steps") + 1] == "977"
    (tmp_path / "runs" / "delta_lstm_seed1" / "checkpoints" / "checkpoint-5").mkdir(parents=True)
    argv = lm_table.train_lm_argv(args, "delta_lstm", 1, tmp_path / "tok")
    assert argv[argv.index("--resume_from_checkpoint") + 1] == "latest"
    overrides = json.loads(argv[argv.index("--config_overrides") + 1])
    assert overrides == {"hidden_size": 128, "num_hidden_layers": 16, "num_attention_heads": 8,
                         "intermediate_size": 2048}
    train_lm.parse_args(argv)  # train_lm accepts the command line


@pytest.mark.parametrize("argv, option", [
    (["--families", "delta_net", "gpt9"], "--families"), (["--stride", "300"], "--stride"),
    (["--hidden_size", "100"], "--hidden_size"), (["--train_tokens", "0"], "--train_tokens"),
    (["--carry_state"], "--carry_state"),  # the default families hold the softmax baseline: nothing fixed to carry
])
def test_bad_options_name_the_option(argv, option):
    with pytest.raises(ValueError, match=option):
        lm_table.parse_args(argv)


def test_results_files_dir_holds_the_done_runs_and_feeds_the_table(tiny_wiki, tmp_path, monkeypatch):
    """``--results_files_dir``: a run whose results file is there is done (not trained again, even with an empty
    ``--results_dir``), and the table is rendered from that folder and names it."""
    committed = tmp_path / "committed"
    committed.mkdir()
    result = {"run": {"command": "python -m training.lm_table --families delta_net"}, "family": "delta_net", "seed": 0,
              "parameters": 10.5e6, "training": {"tokens_per_second": 500.0, "tokens_seen": 2_000_000,
                                                 "block_size": 256},
              "data": {"source": "data/wiki", "train_tokens": 650160, "vocab_size": 8192},
              "window_size": 256, "stride": 32,
              "evaluation": [{"split": "test", "protocol": "sliding_window", "perplexity": 77.7}]}
    (committed / "delta_net_seed0.json").write_text(json.dumps(result))
    monkeypatch.setattr(train_lm, "train_model", lambda args: pytest.fail("a finished run was trained again"))
    argv = quick_argv(tiny_wiki, tmp_path) + ["--families", "delta_net", "--results_files_dir", str(committed)]
    done = lm_table.main(argv)
    assert not done["runs"] and done["skipped"] == [committed / "delta_net_seed0.json"]
    table = (tmp_path / "lm_table.md").read_text()
    assert "| 77.7 |" in next(line for line in table.splitlines() if line.startswith("| Delta Net |"))
    assert f"`{committed}/<family>_seed<seed>.json`" in table
