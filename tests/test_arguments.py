"""The scripts' command lines (HfArgumentParser with TrainingArguments) and the Trainer pieces they share.

--help of every script shows its defaults; Trainer flags reach TrainingArguments; removed option names fail; the
wall-clock schedule equals transformers' cosine_with_min_lr when its end does not move; parameter groups; a tiny
Transformer-XL run through StateCarryingTrainer scores the same losses as a step loop carrying the memories by hand.
"""
from __future__ import annotations

import configparser
import copy
import json
import math
import re
from pathlib import Path

import pytest
import torch
from transformers import TrainingArguments, get_cosine_with_min_lr_schedule_with_warmup

from training import (cli, convert_fla, convert_gguf, data, demo, document_eval, eval_lm, finetune_fwl, lm_table,
                      synthetic, train_lm, train_seq2seq, train_transfo_xl)
from training import trainer_utils

SCRIPTS = {"train_lm": train_lm.parse_args, "finetune_fwl": finetune_fwl.parse_args,
           "train_transfo_xl": train_transfo_xl.parse_args, "eval_lm": eval_lm.parse_args, "demo": demo.parse_args,
           "synthetic": synthetic.parse_args, "data": data.main, "convert_gguf": convert_gguf.main,
           "document_eval": document_eval.parse_args, "train_seq2seq": train_seq2seq.parse_args,
           "convert_fla": convert_fla.main, "lm_table": lm_table.parse_args}


@pytest.mark.parametrize("name, option, default", [
    ("train_lm", "--block_size", "256"), ("train_lm", "--learning_rate", "0.001"),
    ("finetune_fwl", "--max_steps", "30"), ("finetune_fwl", "--model_name_or_path", "checkpoints/smollm2-135m"),
    ("train_transfo_xl", "--max_grad_norm", "0.25"), ("train_transfo_xl", "--max_train_minutes", "3.0"),
    ("eval_lm", "--block_size", "64"), ("eval_lm", "--dynamic_method", "sgd"),
    ("demo", "--per_device_train_batch_size", "8"), ("demo", "--output_dir", "outputs/demo"),
    ("synthetic", "--max_steps", "1000"), ("synthetic", "--model_type", "['linear_transformer', 'delta_net']"),
    ("data", "--output_dir", "data/wiki"), ("convert_gguf", "--output_dir", "checkpoints/smollm2-135m"),
    ("document_eval", "--model_name_or_path", "checkpoints/smollm2-135m"), ("document_eval", "--segment_length", "128"),
    ("document_eval", "--methods", "['base', 'test_time_fwl', 'dynamic']"),
    ("document_eval", "--dynamic_method", "sgd"),
    ("train_seq2seq", "--feature_map", "elu"), ("train_seq2seq", "--num_words", "32"),
    ("train_seq2seq", "--output_dir", "outputs/mt"), ("train_seq2seq", "--predict_with_generate", "False"),
    ("convert_fla", "--dtype", "None"), ("lm_table", "--num_hidden_layers", "16"), ("lm_table", "--hidden_size", "128"),
    ("eval_lm", "--eval_mode", "carried"),
])
def test_help_runs_and_shows_the_script_defaults(name, option, default, capsys):
    with pytest.raises(SystemExit) as exit_info:
        SCRIPTS[name](["--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    entries = text[text.index(" options: "):]  # after the usage line and the description
    entry = entries[entries.index(f" {option} "):]
    assert entry[entry.index("(default: "):].startswith(f"(default: {default})"), entry[:300]


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_help_states_each_default_once(name, capsys):
    """Every option's help ends with its default, and none states a second, contradicting one."""
    with pytest.raises(SystemExit):
        SCRIPTS[name](["--help"])
    options = capsys.readouterr().out.split("\noptions:\n", 1)[1]
    entries = [" ".join(e.split()) for e in re.split(r"\n  (?=-)", "\n" + options) if e.strip()]
    assert len(entries) >= 3  # -h and at least two options
    for entry in entries:
        if not entry.startswith("-h, --help"):
            assert entry.count("(default:") == 1, entry


def test_console_script_runs_the_script_on_the_command_line(monkeypatch, capsys):
    """``fwp-eval-lm --help`` (setup.cfg: ``fwp_training.cli:eval_lm``) is ``python -m training.eval_lm --help``."""
    monkeypatch.setattr("sys.argv", ["fwp-eval-lm", "--help"])
    with pytest.raises(SystemExit) as exit_info:
        cli.eval_lm()
    assert exit_info.value.code == 0 and "--model_name_or_path" in capsys.readouterr().out


CONSOLE_SCRIPTS = {"fwp-document-eval": ("document_eval", "--segment_length"),
                   "fwp-train-seq2seq": ("train_seq2seq", "--cross_attention"),
                   "fwp-convert-fla": ("convert_fla", "--src_dir"),
                   "fwp-rl-popgym": ("rl_popgym", "--total_frames"), "fwp-lm-table": ("lm_table", "--seeds")}


def setup_cfg_console_scripts() -> dict:
    """``{command: function name in training.cli}`` of setup.cfg's console scripts."""
    config = configparser.ConfigParser()
    config.read(Path(__file__).resolve().parents[1] / "setup.cfg")
    scripts = {}
    for line in config["options.entry_points"]["console_scripts"].strip().splitlines():
        command, target = (part.strip() for part in line.split("="))
        module, function = target.split(":")
        assert module == "fwp_training.cli", line
        scripts[command] = function
    return scripts


@pytest.mark.parametrize("command", sorted(CONSOLE_SCRIPTS))
def test_new_console_scripts_exist_and_run_their_script(command, monkeypatch, capsys):
    """setup.cfg names the command; its function in training.cli runs the script's own command line."""
    module, option = CONSOLE_SCRIPTS[command]
    function = setup_cfg_console_scripts()[command]
    monkeypatch.setattr("sys.argv", [command, "--help"])
    with pytest.raises(SystemExit) as exit_info:
        getattr(cli, function)()
    text = capsys.readouterr().out
    assert exit_info.value.code == 0 and f" {option} " in text and "(default:" in text
    assert f"training.{module}" in text  # the script's docstring is the description


def test_document_eval_arguments():
    args = document_eval.parse_args(["--methods", "base", "dynamic_output", "--dynamic_eval_params", "lm_head.*",
                                     "--fwl_step_sizes", "1e-5", "3e-5", "--results_file", "r.json"])
    assert args.methods == ["base", "dynamic_output"] and args.dynamic_eval_params == ["lm_head.*"]
    assert args.fwl_step_sizes == [1e-5, 3e-5] and args.results_file == "r.json" and args.split == "test"
    record = args.record()
    assert record["model_name_or_path"] == "checkpoints/smollm2-135m" and record["segment_length"] == 128
    json.dumps(record)  # the results file's settings
    with pytest.raises(ValueError, match="--segment_length must be positive"):
        document_eval.parse_args(["--segment_length", "0"])
    with pytest.raises(SystemExit):  # argparse's choices
        document_eval.parse_args(["--methods", "oracle"])


def test_train_seq2seq_arguments():
    args = train_seq2seq.parse_args(["--model", "softmax", "--max_steps", "5", "--save_total_limit", "2", "--num_beams",
                                     "1", "--predict_with_generate"])
    model_args, task_args, training = args.groups
    assert model_args.model == "softmax" and task_args.num_beams == 1
    assert training.max_steps == 5 and training.save_total_limit == 2 and training.predict_with_generate
    assert training.output_dir == "outputs/mt"
    with pytest.raises(SystemExit):
        train_seq2seq.parse_args(["--feature_map", "softmax"])


def test_trainer_flags_reach_training_arguments():
    args = train_lm.parse_args(["--save_total_limit", "3", "--gradient_checkpointing", "--report_to", "none",
                                "--lr_scheduler_type", "linear", "--adam_beta1", "0.8", "--max_steps", "7"])
    training = args.training
    assert isinstance(training, TrainingArguments)
    assert training.save_total_limit == 3 and training.max_steps == 7 and training.adam_beta1 == 0.8
    assert training.activation_checkpointing  # --gradient_checkpointing: transformers' alias
    assert str(training.lr_scheduler_type.value) == "linear" and training.report_to in ("none", ["none"], [])
    # the script's own defaults for Trainer options, and one namespace over all groups
    assert training.learning_rate == 1e-3 and training.adam_beta2 == 0.98 and args.learning_rate == 1e-3
    assert args.output_dir == "outputs/train_lm" and args.block_size == 256 and args.model_type == "fwp_delta_net"
    record = args.record()
    assert record["save_total_limit"] == 3 and record["block_size"] == 256 and "hub_token" not in record
    json.dumps(record)  # written into results files


@pytest.mark.parametrize("name, argv", [
    ("train_lm", ["--lr", "1e-3"]), ("train_lm", ["--batch_size", "2"]), ("train_lm", ["--segment_length", "8"]),
    ("finetune_fwl", ["--model", "x"]), ("finetune_fwl", ["--dataset", "wikitext"]),
    ("eval_lm", ["--model_name_or_path", "m", "--model", "x"]),
    ("eval_lm", ["--model_name_or_path", "m", "--output", "x"]),
    ("demo", ["--minutes", "1"]), ("train_transfo_xl", ["--init_from", "x"]),
    ("synthetic", ["--task", "code", "--steps", "3"]), ("synthetic", ["--task", "code", "--resume", "x"]),
    ("document_eval", ["--model", "x"]), ("document_eval", ["--output", "x"]),
    ("document_eval", ["--dynamic_params", "x"]),
])
def test_removed_option_names_fail(name, argv):
    """Not taken for a longer option by its prefix either (--model for --model_name_or_path)."""
    with pytest.raises(ValueError, match=f"not used by the HfArgumentParser: \\['{argv[-2]}'"):
        SCRIPTS[name](argv)


@pytest.mark.parametrize("argv, message", [
    (["--block_size", "1"], "--block_size must be at least 2"),
    (["--per_device_train_batch_size", "0"], "--per_device_train_batch_size must be positive"),
    (["--dataset_name", "x", "--train_file", "y"], "either --dataset_name or --train_file"),
    (["--config_overrides", "hidden_size"], "--config_overrides: expected key=value"),
])
def test_bad_values_name_the_option(argv, message):
    with pytest.raises(ValueError, match=message):
        train_lm.parse_args(argv)


def test_budget_schedule_is_transformers_cosine_with_min_lr_when_the_end_is_fixed(tmp_path):
    """Warm-up then cosine to min_lr_rate; with a fixed number of steps it is transformers' schedule exactly, and
    with a moving estimate it follows the budget's current total."""
    param = torch.nn.Parameter(torch.zeros(2, 2))
    args = TrainingArguments(output_dir=str(tmp_path), warmup_steps=3, lr_scheduler_kwargs={"min_lr_rate": 0.1},
                             learning_rate=1.0)
    budget = trainer_utils.WallClockBudget(60.0, fixed_steps=20)
    ours = trainer_utils.budget_schedule(torch.optim.SGD([param], lr=1.0), budget, args)
    reference = get_cosine_with_min_lr_schedule_with_warmup(torch.optim.SGD([param], lr=1.0), 3, 20, min_lr_rate=0.1)
    ours_lrs, reference_lrs = [], []
    for _ in range(20):
        ours_lrs.append(ours.get_last_lr()[0])
        reference_lrs.append(reference.get_last_lr()[0])
        ours.optimizer.step(), ours.step(), reference.optimizer.step(), reference.step()
    assert ours_lrs == pytest.approx(reference_lrs, abs=1e-12)
    assert ours_lrs[0] == 0.0 and ours_lrs[3] == pytest.approx(1.0) and ours_lrs[-1] > 0.1
    budget.total_steps = 1000  # a faster machine than estimated: the decay stretches
    assert ours.lr_lambdas[0](19) > reference.lr_lambdas[0](19)


def test_parameter_groups_decay_matrices_only_and_take_the_first_matching_rate():
    model = torch.nn.Sequential(torch.nn.Embedding(5, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 5))
    model[2].weight = model[0].weight  # tied: listed once
    model[1].bias.requires_grad_(False)
    rates = [(lambda n: n.startswith("1."), 0.5), (lambda n: n.endswith("weight"), 0.25)]
    groups = trainer_utils.parameter_groups(model, learning_rate=1.0, weight_decay=0.1, learning_rates=rates)
    by_param = {id(p): (g["lr"], g["weight_decay"]) for g in groups for p in g["params"]}
    assert len(by_param) == sum(len(g["params"]) for g in groups) == 3  # tied once, frozen bias left out
    assert by_param[id(model[0].weight)] == (0.25, 0.1)  # a matrix: decayed
    assert by_param[id(model[1].weight)] == (0.5, 0.0)  # the first match wins; a gain is not decayed
    assert by_param[id(model[2].bias)] == (1.0, 0.0)


@pytest.fixture(scope="module")
def tiny_wiki(tmp_path_factory):
    folder = tmp_path_factory.mktemp("wiki")
    words = "the a cat dog sat on mat fast weights are programmed by slow nets and read with queries".split()
    gen = torch.Generator().manual_seed(0)
    docs = [" ".join(words[i] for i in torch.randint(0, len(words), (60,), generator=gen).tolist()) for _ in range(12)]
    (folder / "train.txt").write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    return folder


def test_train_transfo_xl_carries_memories_like_a_step_loop(tiny_wiki, tmp_path):
    """Through StateCarryingTrainer, step i of a tiny Transformer-XL + FWL run scores segment start + i of every
    stream with the memories of the previous step: the same losses as a loop written out by hand (learning rate
    1e-9, so the weights stay put)."""
    argv = ["--data_dir", tiny_wiki, "--output_dir", tmp_path / "run", "--min_count", "1", "--hidden_size", "16",
            "--num_attention_heads", "2", "--num_hidden_layers", "1", "--mem_len", "8", "--block_size", "8",
            "--per_device_train_batch_size", "2", "--hidden_dropout", "0", "--use_fwl", "--max_steps", "3",
            "--learning_rate", "1e-9", "--warmup_steps", "0", "--logging_steps", "1", "--start_segment", "5"]
    args = train_transfo_xl.parse_args(argv)
    documents = train_transfo_xl.read_documents(tiny_wiki / "train.txt")
    tokenizer = train_transfo_xl.build_word_level_tokenizer(
        train_transfo_xl.build_word_vocabulary(documents, 1), split_punctuation=True)
    stream = train_transfo_xl.encode_stream(tokenizer, documents)
    torch.manual_seed(0)
    model = train_transfo_xl.TransfoXLForCausalLM(train_transfo_xl.small_config(len(tokenizer), args))
    reference = copy.deepcopy(model).train()
    log = train_transfo_xl.train(model, stream, args, start_segment=5)
    assert log["steps"] == 3 and len(log["history"]) == 3

    per_stream = (stream.numel() - 1) // 2 // 8  # segments per stream (2 streams of 8-token segments)
    inputs, targets = (s[: 2 * per_stream * 8].view(2, per_stream * 8) for s in (stream[:-1], stream[1:]))
    cache, losses = None, []
    with torch.no_grad():
        for i in range(3):
            window = slice((5 + i) % per_stream * 8, ((5 + i) % per_stream + 1) * 8)
            out = reference(inputs[:, window], labels=inputs[:, window], shift_labels=targets[:, window].contiguous(),
                            cache=cache, use_cache=True)
            cache, losses = out.past_key_values, losses + [out.loss.item()]
    assert [h["loss"] for h in log["history"]] == pytest.approx(losses, abs=2e-4)  # Trainer logs 4 decimals
    assert len(set(round(x, 3) for x in losses)) == 3


def test_train_transfo_xl_main_fixed_steps_and_wall_clock_budget(tiny_wiki, tmp_path):
    common = ["--data_dir", tiny_wiki, "--min_count", "1", "--hidden_size", "16", "--num_attention_heads", "2",
              "--num_hidden_layers", "1", "--mem_len", "8", "--block_size", "8", "--per_device_train_batch_size", "2",
              "--save_total_limit", "1"]
    fixed = train_transfo_xl.main(common + ["--output_dir", tmp_path / "fixed", "--max_steps", "2"])
    assert fixed["steps"] == 2 and not fixed["stopped_by_budget"] and math.isfinite(fixed["final_train_loss"])
    saved = json.loads((tmp_path / "fixed" / "train_log.json").read_text())
    assert (saved["max_steps"] == 2 and saved["save_total_limit"] == 1
            and saved["lr_scheduler_type"] == "cosine_with_min_lr")
    assert (tmp_path / "fixed" / "config.json").is_file()
    budget = train_transfo_xl.main(common + ["--output_dir", tmp_path / "budget", "--max_train_minutes", "0.001"])
    assert budget["steps"] >= 1 and budget["stopped_by_budget"] and budget["max_steps"] == -1
