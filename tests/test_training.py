"""Synthetic task generators (checked against independent solvers) and smoke runs of the training scripts."""
from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from conftest import accelerate_launch_two_processes
from training import result_file, synthetic, train_lm, trainer_utils


# --------------------------------------------------------------------------------------------------
# Generators
# --------------------------------------------------------------------------------------------------


def decoded(spec: synthetic.TaskSpec, n: int, seed: int):
    """(tokens, [(position, answer symbol)]) of the first `n` examples of `spec` with `seed`, read back from the
    dataset's ``input_ids`` and ``labels``."""
    rows = []
    for ex in synthetic.generate_examples(spec, n, seed):
        tokens = spec.vocabulary.decode(ex["input_ids"])
        answers = [(i, spec.vocabulary.decode([label])[0]) for i, label in enumerate(ex["labels"])
                   if label != synthetic.IGNORE_INDEX]
        rows.append((tokens, answers))
    return rows


@pytest.mark.parametrize("task", synthetic.TASKS)
def test_fixed_seed_gives_fixed_dataset(task):
    spec = synthetic.build_task(task)
    a, b = synthetic.make_dataset(spec, 20, seed=3), synthetic.make_dataset(spec, 20, seed=3)
    assert a["input_ids"] == b["input_ids"] and a["labels"] == b["labels"]
    assert synthetic.make_dataset(spec, 20, seed=4)["input_ids"] != a["input_ids"]


def test_dataset_on_disk_holds_the_generator_examples_and_is_reused_only_when_it_matches(tmp_path):
    spec = synthetic.build_task("code", num_variables=3, num_statements=8)
    rows = list(synthetic.generate_examples(spec, 40, seed=5))
    expected = {key: [r[key] for r in rows] for key in ("input_ids", "labels")}
    in_memory = synthetic.make_dataset(spec, 40, seed=5)
    on_disk = synthetic.make_dataset(spec, 40, seed=5, cache_dir=tmp_path)
    assert in_memory[:] == expected and on_disk[:] == expected
    assert not in_memory.cache_files and on_disk.cache_files  # memory-mapped from tmp_path
    (path,) = tmp_path.glob("*.arrow")
    written = path.stat().st_mtime_ns

    assert synthetic.make_dataset(spec, 40, seed=5, cache_dir=tmp_path)[:] == expected
    assert path.stat().st_mtime_ns == written  # reused, not rewritten

    other_seed = synthetic.make_dataset(spec, 40, seed=6, cache_dir=tmp_path)
    assert other_seed[:] != expected and len(list(tmp_path.glob("*.arrow"))) == 2
    # a file under this name that holds other examples (e.g. from an older generator) is regenerated
    path.write_bytes(Path(other_seed.cache_files[0]["filename"]).read_bytes())
    assert synthetic.make_dataset(spec, 40, seed=5, cache_dir=tmp_path)[:] == expected
    assert not list(tmp_path.glob("*.partial"))


def test_retrieval_setting_1_answer_is_the_value_of_the_unique_query_key():
    spec = synthetic.build_task("retrieval", num_pairs=12, num_keys=30)
    for tokens, answers in decoded(spec, 50, seed=0):
        keys, values = zip(*(t.split(":") for t in tokens[:12]))
        query = tokens[13]
        assert len(set(keys)) == 12 and tokens[12] == "?"
        assert answers == [(14, values[keys.index(query)])]


def test_retrieval_setting_2_answer_is_the_latest_value():
    spec = synthetic.build_task("retrieval_replace")
    assert spec.setting == {"num_pairs": 40, "num_keys": 20, "num_values": 10}
    repeated = 0
    for tokens, answers in decoded(spec, 50, seed=0):
        keys, values = zip(*(t.split(":") for t in tokens[:40]))
        assert set(keys) <= {f"k{i}" for i in range(20)} and tokens[40] == "?"
        query = tokens[41]
        last = max(i for i, k in enumerate(keys) if k == query)
        repeated += keys.count(query) > 1
        assert answers == [(42, values[last])]
    assert repeated > 0  # the with-replacement case is actually exercised


@pytest.mark.parametrize("num_variables", [3, 5])
def test_code_answers_match_python_exec(num_variables):
    """Each program, translated line by line to Python and run, prints exactly the answers; the answers never occur
    in the input (the label after ``print x ;`` sits on the next statement's first token)."""
    spec = synthetic.build_task("code", num_variables=num_variables, num_statements=40)
    kinds = set()
    for tokens, answers in decoded(spec, 30, seed=1):
        assert tokens[-1] == "<eos>" and tokens[0] != "print"
        statements, current = [], []
        for tok in tokens[:-1]:
            current.append(tok)
            if tok == ";":
                statements.append(current)
                current = []
        assert not current
        lines, print_ends, position = [], [], 0
        for st in statements:
            position += len(st)
            prefix = ""
            if st[0] == "if":  # if x > 3 : <statement>
                prefix, st = f"if {st[1]} {st[2]} {st[3]}: ", st[5:]
                kinds.add("if")
            if st[0] == "print":
                lines.append(prefix + f"out({st[1]})")
                print_ends.append(position)
            elif st[1] in ("++", "--"):
                lines.append(prefix + f"{st[0]} {st[1][0]}= 1")
            else:
                assert st[1] == "=" and len(st) == 4
                lines.append(prefix + f"{st[0]} = {int(st[2])}")
            kinds.add(st[1] if st[0] != "print" else "print")
        printed = []
        exec("\n".join(lines), {"__builtins__": {}, "out": printed.append})  # noqa: S102
        assert [int(tok) for _, tok in answers] == printed and printed
        assert all(-8 <= v <= 16 for v in printed)
        # each answer is predicted right after a print that ran, i.e. at the position after its ";"
        assert {p for p, _ in answers} <= set(print_ends)
        assert statements[-1][0] == "print" and answers[-1][0] == len(tokens) - 1
    assert kinds == {"if", "=", "++", "--", "print"}


def _eval_listops(tokens):
    """An independent ListOps evaluator (recursive descent; MED = lower median)."""
    ops = {"MIN": min, "MAX": max, "MED": statistics.median_low, "SM": lambda xs: sum(xs) % 10}

    def parse(i):
        if tokens[i] != "[":
            return int(tokens[i]), i + 1, 0
        op, i, args, depth = tokens[i + 1], i + 2, [], 0
        while tokens[i] != "]":
            value, i, d = parse(i)
            args.append(value)
            depth = max(depth, d)
        return ops[op](args), i + 1, depth + 1

    value, end, depth = parse(0)
    return value, end, depth


def test_listops_answers_match_an_independent_evaluator():
    spec = synthetic.build_task("listops", depth=10)
    for tokens, answers in decoded(spec, 30, seed=2):
        value, end, depth = _eval_listops(tokens)
        assert tokens[end] == "=" and end + 2 == len(tokens)
        assert depth == 10
        assert answers == [(len(tokens) - 1, str(value))] and tokens[-1] == str(value)


def test_build_task_rejects_bad_options():
    with pytest.raises(ValueError, match="num_pairs"):
        synthetic.build_task("retrieval", num_pairs=30, num_keys=20)
    with pytest.raises(ValueError, match="depth"):
        synthetic.build_task("retrieval", depth=3)
    with pytest.raises(ValueError, match="task"):
        synthetic.build_task("sorting")


def test_sweep_settings_take_the_task_options_and_reject_others():
    args = synthetic.parse_args(["--task", "listops", "--depth", "4", "6", "--max_args", "2"])
    assert synthetic.task_settings(args) == [{"depth": 4, "max_args": 2}, {"depth": 6, "max_args": 2}]
    args = synthetic.parse_args(["--task", "code", "--num_variables", "3", "--num_statements", "12"])
    assert synthetic.task_settings(args) == [{"num_variables": 3, "num_statements": 12}]
    with pytest.raises(ValueError, match="--max_args does not apply to --task code"):
        synthetic.task_settings(synthetic.parse_args(["--task", "code", "--max_args", "2"]))
    with pytest.raises(ValueError, match="--num_keys does not apply to --task listops"):
        synthetic.task_settings(synthetic.parse_args(["--task", "listops", "--num_keys", "20"]))


# --------------------------------------------------------------------------------------------------
# train_lm pieces
# --------------------------------------------------------------------------------------------------


def test_parse_overrides():
    assert train_lm.parse_overrides('{"hidden_size": 64}') == {"hidden_size": 64}
    assert train_lm.parse_overrides("hidden_size=64,feature_map=dpfp,sum_normalization=false") == {
        "hidden_size": 64, "feature_map": "dpfp", "sum_normalization": False}
    with pytest.raises(ValueError, match="key=value"):
        train_lm.parse_overrides("hidden_size")


def test_segment_dataset_keeps_stream_order_per_batch_row():
    ids = torch.arange(1000)
    ds = train_lm.segment_dataset(ids, segment_length=10, num_streams=4)
    segments = torch.stack(list(ds["input_ids"])).view(-1, 4, 10)  # [step, row, L]
    # row s of step i + 1 continues row s of step i in the original stream
    assert torch.equal(segments[1:, :, 0], segments[:-1, :, -1] + 1)
    assert ds[:]["labels"].equal(ds[:]["input_ids"])


# --------------------------------------------------------------------------------------------------
# Smoke runs
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_corpus(tmp_path_factory):
    """Generated documents (the same on every machine, whatever data/ holds)."""
    folder = tmp_path_factory.mktemp("corpus")
    text = "\n\n".join(f"Title {i}\nSome words about topic {i} and more words." for i in range(300))
    (folder / "train.txt").write_text(text, encoding="utf-8")
    (folder / "valid.txt").write_text(text[:3000], encoding="utf-8")
    return folder


def test_train_lm_smoke_carry_state_and_resume(tiny_corpus, tmp_path):
    out = tmp_path / "run"
    common = ["--train_file", str(tiny_corpus / "train.txt"), "--validation_file", str(tiny_corpus / "valid.txt"),
              "--config_overrides", "hidden_size=32,num_hidden_layers=1,num_attention_heads=2",
              "--per_device_train_batch_size", "2", "--block_size", "16", "--vocab_size", "300", "--carry_state",
              "--output_dir", str(out), "--save_steps", "1", "--save_total_limit", "1", "--logging_steps", "1",
              "--warmup_steps", "1", "--max_eval_tokens", "300"]
    results = train_lm.main(common + ["--max_steps", "2"])
    saved = json.loads((out / "results.json").read_text())
    assert saved["training"]["steps"] == 2 and saved["training"]["carry_state"]
    entries = {(e["split"], e["protocol"]): e for e in saved["evaluation"]}
    assert set(entries) == {("valid", "carried_state"), ("valid", "independent_segments")}  # no test file given
    assert all(e["perplexity"] > 1 for e in entries.values())
    assert (out / "model" / "config.json").is_file()
    # a Trainer flag through the script's parser: --save_total_limit 1 keeps the last of the two checkpoints
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["checkpoint-2"]
    assert saved["args"]["save_total_limit"] == 1 and saved["args"]["block_size"] == 16
    assert saved["environment"] == result_file.environment()  # the model card's "Environment" line
    assert results["model"]["model_type"] == "fwp_delta_net"
    # on CPU the Trainer's KeepFreedCpuMemory callback told glibc to keep freed memory (unless the process had chosen)
    assert saved["training"]["cpu_keep_freed_memory"] is trainer_utils.keep_freed_cpu_memory()

    resumed = train_lm.main(common + ["--max_steps", "3", "--resume_from_checkpoint", "latest"])
    assert resumed["training"]["steps"] == 3


def test_train_lm_continues_a_saved_model(tiny_corpus, tmp_path):
    """``--model_name_or_path``: training starts from the saved weights (with learning rate 1e-12 they come back
    unchanged, and the first logged loss is the saved model's); a tokenizer of another vocabulary is refused."""
    common = ["--train_file", str(tiny_corpus / "train.txt"), "--validation_file", str(tiny_corpus / "valid.txt"),
              "--per_device_train_batch_size", "2", "--block_size", "16", "--save_steps", "100", "--logging_steps",
              "1", "--warmup_steps", "0", "--max_eval_tokens", "100", "--max_steps", "2"]
    first = tmp_path / "first"
    train_lm.main(common + ["--config_overrides", "hidden_size=32,num_hidden_layers=1,num_attention_heads=2",
                            "--vocab_size", "300", "--output_dir", str(first), "--max_steps", "20",
                            "--learning_rate", "1e-2"])
    saved = str(first / "model")
    again = train_lm.main(common + ["--model_name_or_path", saved, "--tokenizer_name", saved,
                                    "--learning_rate", "1e-12", "--weight_decay", "0", "--carry_state",
                                    "--output_dir", str(tmp_path / "again")])
    before = transformers.AutoModelForCausalLM.from_pretrained(saved).state_dict()
    after = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "again" / "model")).state_dict()
    assert all(torch.allclose(before[k], after[k], rtol=0, atol=1e-9) for k in before)
    fresh = json.loads((first / "results.json").read_text())["training"]["loss_curve"][0]["loss"]
    assert again["training"]["loss_curve"][0]["loss"] < fresh - 0.01  # from the trained weights, not a new model
    with pytest.raises(ValueError, match="--model_name_or_path .* vocabulary"):
        train_lm.main(common + ["--model_name_or_path", saved, "--tokenizer_name", "bpe", "--vocab_size", "280",
                                "--output_dir", str(tmp_path / "bad")])
    with pytest.raises(ValueError, match="--config_overrides"):
        train_lm.main(common + ["--model_name_or_path", saved, "--tokenizer_name", saved, "--config_overrides",
                                "hidden_size=16", "--output_dir", str(tmp_path / "bad")])


def test_train_lm_under_accelerate_launch_two_processes_equals_one_process(tiny_corpus, tmp_path):
    """Full-context training under `accelerate launch --multi_gpu --num_processes 2` (gloo): rank r reads stream r, so
    two processes with batch 1 take the same steps as one process with batch 2 over the same 2 streams."""
    def argv(out, batch_size):
        return ["--train_file", tiny_corpus / "train.txt", "--validation_file", tiny_corpus / "valid.txt",
                "--config_overrides", "hidden_size=32,num_hidden_layers=1,num_attention_heads=2",
                "--learning_rate", "3e-3", "--per_device_train_batch_size", batch_size, "--block_size", "16",
                "--vocab_size", "300", "--carry_state", "--output_dir", out, "--save_steps", "100",
                "--logging_steps", "1", "--warmup_steps", "0", "--max_eval_tokens", "300", "--max_steps", "4"]

    alone = train_lm.main([str(a) for a in argv(tmp_path / "one", 2)])
    done = accelerate_launch_two_processes("training.train_lm", argv(tmp_path / "two", 1), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    ddp = json.loads((tmp_path / "two" / "results.json").read_text())
    assert ddp["training"]["world_size"] == 2 and ddp["training"]["num_streams"] == 2
    assert ddp["training"]["tokens_seen"] == alone["training"]["tokens_seen"]
    losses = [[h["loss"] for h in run["training"]["loss_curve"]] for run in (alone, ddp)]
    assert losses[0][0] != pytest.approx(losses[0][-1], rel=1e-3)  # training moved the model
    assert losses[1] == pytest.approx(losses[0], rel=1e-3)
    for one, two in zip(alone["evaluation"], ddp["evaluation"]):
        assert two["perplexity"] == pytest.approx(one["perplexity"], rel=1e-3), one["protocol"]


def test_state_is_carried_between_steps(tiny_corpus, tmp_path):
    """The carried cache has seen every segment of its rows since the start of training."""
    from transformers import AutoConfig, AutoModelForCausalLM, TrainingArguments, default_data_collator

    ids = torch.arange(2000) % 50
    ds = train_lm.segment_dataset(ids, 8, num_streams=2)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "fwp_delta_net", vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2))
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=3, use_cpu=True,
                             report_to="none", save_strategy="no", remove_unused_columns=False, disable_tqdm=True)
    trainer = train_lm.StateCarryingTrainer(model=model, args=args, train_dataset=ds,
                                            data_collator=default_data_collator)
    trainer.train()
    assert trainer.carried_state.get_seq_length() == 3 * 8
    assert all(not t.requires_grad for layer in trainer.carried_state.layers for t in layer.states.values())


def test_in_order_trainer_reads_streams_in_order_from_an_empty_state(tmp_path):
    """``train_lm --in_order``: row b of step i holds segment i of stream b, as with the carried state, but every
    step's forward starts from an empty state (no cache passed)."""
    from transformers import AutoConfig, AutoModelForCausalLM, TrainingArguments, default_data_collator

    ids = torch.arange(2000) % 50
    ds = train_lm.segment_dataset(ids, 8, num_streams=2)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "fwp_delta_net", vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2))
    seen = []

    def spy(module, args, kwargs):
        seen.append((kwargs["input_ids"].clone(), kwargs.get("cache")))

    model.register_forward_pre_hook(spy, with_kwargs=True)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=3, use_cpu=True,
                             report_to="none", save_strategy="no", remove_unused_columns=False, disable_tqdm=True)
    train_lm.InOrderTrainer(model=model, args=args, train_dataset=ds, data_collator=default_data_collator).train()
    streams = ids[: 2 * (len(ids) // 16) * 8].view(2, -1, 8)  # [stream, segment, token]
    assert len(seen) == 3
    for step, (input_ids, cache) in enumerate(seen):
        assert torch.equal(input_ids, streams[:, step]) and cache is None


def test_synthetic_smoke(tmp_path):
    results = synthetic.main(["--task", "retrieval", "--model_type", "delta_net", "llama", "--max_steps", "2",
                              "--per_device_train_batch_size", "4", "--hidden_size", "16", "--num_hidden_layers", "1",
                              "--d_key", "8",
                              "--num_pairs", "3", "5", "--eval_examples", "8", "--output_dir", str(tmp_path),
                              "--results_file", str(tmp_path / "committed.json")])
    saved = json.loads((tmp_path / "retrieval.json").read_text())
    assert [(r["model"], r["num_pairs"]) for r in saved["results"]] == [
        ("delta_net", 3), ("llama", 3), ("delta_net", 5), ("llama", 5)]
    assert saved["run"]["command"].startswith("python -m training.synthetic --task retrieval --model_type delta_net")
    assert (tmp_path / "committed.json").read_text() == (tmp_path / "retrieval.json").read_text()
    assert all(np.isfinite(r["test_loss"]) for r in saved["results"])
    if results["plot"]:
        assert Path(results["plot"]).is_file()


@pytest.mark.parametrize("task", ["retrieval_replace", "code", "listops"])
def test_synthetic_tasks_train(task, tmp_path):
    results = synthetic.main(["--task", task, "--model_type", "linear_transformer", "--max_steps", "1",
                              "--per_device_train_batch_size", "2", "--hidden_size", "16", "--num_hidden_layers", "1",
                              "--eval_examples", "4",
                              "--output_dir", str(tmp_path)])
    assert (tmp_path / f"{task}.json").is_file() and len(results["results"]) == 1
    row = results["results"][0]
    assert 0 <= row["test_sequence_accuracy"] <= 1 and 0 <= row["test_accuracy"] <= 1
    if task != "code":  # one answer per example: both levels agree
        assert row["test_sequence_accuracy"] == row["test_accuracy"]
    table = (tmp_path / f"{task}.md").read_text()
    assert table.startswith("| ") and f"| {row['model']} | {row['test_accuracy']:.3f} |" in table


def test_synthetic_resume_equals_an_uninterrupted_run(tmp_path, monkeypatch):
    """A run interrupted after its step-2 checkpoint and continued with --resume_from_checkpoint latest ends exactly
    where a run without a break ends: same data order, optimiser state and learning curve."""
    common = ["--task", "code", "--model_type", "delta_net", "--num_statements", "6", "--max_steps", "4",
              "--per_device_train_batch_size", "3", "--hidden_size", "16", "--num_hidden_layers", "1",
              "--num_attention_heads", "2", "--eval_examples", "8", "--learning_rate", "3e-3", "--logging_steps", "1"]
    straight = synthetic.main(common + ["--output_dir", str(tmp_path / "straight")])["results"][0]

    class Interrupted(Exception):
        pass

    class StopsAfterStep2(transformers.Trainer):
        def training_step(self, *args, **kwargs):
            if self.state.global_step == 2:
                raise Interrupted
            return super().training_step(*args, **kwargs)

    out = tmp_path / "interrupted"
    args = common + ["--save_strategy", "steps", "--save_steps", "2", "--resume_from_checkpoint", "latest",
                     "--output_dir", str(out)]
    with monkeypatch.context() as patch:
        patch.setattr(synthetic, "Trainer", StopsAfterStep2)
        with pytest.raises(Interrupted):
            synthetic.main(args)  # no checkpoint yet: starts from scratch, saves at step 2, then dies
    run_dir = out / "trainer" / "delta_net_num_variables3_num_statements6"
    assert [p.name for p in run_dir.glob("checkpoint-*")] == ["checkpoint-2"]
    resumed = synthetic.main(args)["results"][0]
    assert resumed["resumed_from"] == str(run_dir / "checkpoint-2")
    assert [h["step"] for h in resumed["loss_curve"]] == [1, 2, 3, 4]
    assert resumed["loss_curve"] == straight["loss_curve"]
    assert resumed["test_loss"] == straight["test_loss"] and resumed["test_accuracy"] == straight["test_accuracy"]
    assert [p.name for p in run_dir.glob("checkpoint-*")] == ["checkpoint-4"]  # only the latest is kept
    assert [p.name for p in (out / "data").glob("*.arrow")] == ["code_num_variables3_num_statements6_seed0_n12.arrow"]
    with pytest.raises(ValueError, match="--max_steps must be positive"):
        synthetic.parse_args(common + ["--max_steps", "0"])


def test_answer_metrics_token_and_sequence_level():
    """An oracle that knows every answer but one: token accuracy counts answers, sequence accuracy examples."""
    spec = synthetic.build_task("code", num_statements=12)
    data = synthetic.make_dataset(spec, 6, seed=0)
    vocab = len(spec.vocabulary)

    class Oracle(torch.nn.Module):
        def forward(self, input_ids):
            batch = synthetic.pad_collator([data[i] for i in range(len(data))])
            labels = batch["labels"][:, 1:].clamp_min(0)
            logits = torch.nn.functional.one_hot(labels, vocab).float()
            logits[0, (batch["labels"][0, 1:] >= 0).nonzero()[0, 0]] = 0  # the first answer of example 0: wrong
            logits = torch.cat([logits, logits[:, -1:]], 1)
            return type("Out", (), {"logits": logits})()

    metrics = synthetic.answer_metrics(Oracle(), data, batch_size=len(data))
    answers = sum(sum(label >= 0 for label in ex) for ex in data["labels"])
    assert metrics["answers"] == answers
    assert metrics["accuracy"] == pytest.approx((answers - 1) / answers)
    assert metrics["sequence_accuracy"] == pytest.approx(5 / 6)


def test_plots_cli_draws_the_curves_of_several_runs(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed: only training.plots needs it")
    from training import plots

    curve = [{"step": s, "loss": 2.0 / s} for s in (1, 2, 3)]
    for model in ("linear_transformer", "delta_net"):
        (tmp_path / f"{model}.json").write_text(json.dumps(
            {"results": [{"model": model, "num_statements": 30, "loss_curve": curve}]}))
    runs = [str(tmp_path / f"{m}.json") for m in ("linear_transformer", "delta_net")]
    path = plots.main(["--x_key", "num_statements", "--output", str(tmp_path / "code.png"), *runs])
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit):  # a setting the runs do not have
        plots.main(["--x_key", "depth", "--output", str(tmp_path / "x.png"), *runs])
    rows = [{"model": "delta_net", "depth": 10, "seed": seed, "steps": 10} for seed in (0, 1)]
    assert plots.run_labels(rows, "depth") == ["delta_net (depth=10, seed 0)", "delta_net (depth=10, seed 1)"]
    rows[1].update(seed=0, steps=20)
    assert plots.run_labels(rows, "depth") == ["delta_net (depth=10, steps 10)", "delta_net (depth=10, steps 20)"]


def test_shortcut_accuracy_of_the_trivial_rules():
    import datasets

    def dataset(spec, programs):
        rows = []
        for tokens, answers in programs:
            labels = [synthetic.IGNORE_INDEX] * len(tokens)
            for at, value in answers:
                labels[at] = spec.vocabulary.index[value]
            rows.append({"input_ids": spec.vocabulary.encode(tokens), "labels": labels})
        return datasets.Dataset.from_dict({k: [r[k] for r in rows] for k in ("input_ids", "labels")})

    code = synthetic.build_task("code", num_variables=2, num_statements=3)
    programs = [("a = 3 ; a ++ ; print a ; <eos>".split(), [(10, "4")]),  # the rule says 3: wrong
                ("a = 3 ; b = 5 ; print a ; <eos>".split(), [(11, "3")]),  # right
                ("b = 1 ; if b > 0 : b = 2 ; print b ; <eos>".split(), [(16, "2")])]  # right
    assert synthetic.shortcut_accuracy(code, dataset(code, programs)) == pytest.approx(2 / 3)
    # the generator's answers sit where the rule reads them: a generated program's answers all follow "print x ;"
    generated = synthetic.make_dataset(code, 50, seed=0)
    assert 0.3 < synthetic.shortcut_accuracy(code, generated) < 1.0

    listops = synthetic.build_task("listops", depth=1, max_args=2)
    programs = [("[ MAX 1 3 ] = 3".split(), [(6, "3")]), ("[ MIN 3 4 ] = 3".split(), [(6, "3")]),
                ("[ SM 2 3 ] = 5".split(), [(6, "5")])]
    assert synthetic.shortcut_accuracy(listops, dataset(listops, programs)) == pytest.approx(2 / 3)
    assert synthetic.shortcut_accuracy(synthetic.build_task("retrieval"), generated) is None


# --------------------------------------------------------------------------------------------------
# The allocator on CPU (trainer_utils.keep_freed_cpu_memory)
# --------------------------------------------------------------------------------------------------

# what says that a process chose its allocator already
ALLOCATOR_CHOICES = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "GLIBC_TUNABLES", "LD_PRELOAD",
                     "FWP_KEEP_FREED_MEMORY")


REFAULT_SCRIPT = """
import resource, sys, torch
from training import trainer_utils
kept = trainer_utils.keep_freed_cpu_memory()
n = 64 * 2**20  # 256 MB of float32
faults = []
for _ in range(8):  # allocated, written, freed, as a training step's activations
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    x = torch.empty(n)
    x.fill_(1.0)
    del x
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(kept, min(faults[2:]))  # (torch's 64-byte aligned blocks: glibc may take a few before it reuses them)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc", reason="glibc only")
@pytest.mark.parametrize("opt_out", [False, True])
def test_keep_freed_cpu_memory_reuses_a_freed_block_without_faulting_it_in_again(opt_out):
    env = {k: v for k, v in os.environ.items() if k not in ALLOCATOR_CHOICES}
    env["FWP_KEEP_FREED_MEMORY"] = "0" if opt_out else "1"
    out = subprocess.run([sys.executable, "-c", REFAULT_SCRIPT], env=env, cwd=Path(__file__).resolve().parents[1],
                         capture_output=True, text=True, check=True).stdout.split()
    pages = 256 * 2**20 // 4096  # of one block
    assert out[0] == str(not opt_out)
    if opt_out:  # glibc as shipped: each block was unmapped when freed, and every page of each new one faults
        assert int(out[1]) > pages // 2
    else:
        assert int(out[1]) < pages // 20


@pytest.mark.parametrize("choice", ALLOCATOR_CHOICES)
def test_keep_freed_cpu_memory_leaves_a_process_that_chose_its_allocator_alone(choice, monkeypatch):
    calls = []

    def mallopt(param, value):
        calls.append((param, value))
        return 1

    fake_libc = type("FakeGlibc", (), {"gnu_get_libc_version": object()})()
    fake_libc.mallopt = mallopt
    monkeypatch.setattr(trainer_utils.ctypes, "CDLL", lambda name: fake_libc)
    monkeypatch.setattr(trainer_utils, "_kept_freed", False)
    for name in ALLOCATOR_CHOICES:
        monkeypatch.delenv(name, raising=False)
    value = {"LD_PRELOAD": "/usr/lib/libjemalloc.so.2", "FWP_KEEP_FREED_MEMORY": "0"}.get(choice, "131072")
    monkeypatch.setenv(choice, value)
    assert trainer_utils.keep_freed_cpu_memory() is False and calls == []
    monkeypatch.delenv(choice)
    assert trainer_utils.keep_freed_cpu_memory() is True
    assert calls == [(param, v) for param, _, v in trainer_utils.KEEP_FREED_MALLOPT]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_keep_freed_cpu_memory_callback_acts_on_cpu_only(device, monkeypatch):
    called = []
    monkeypatch.setattr(trainer_utils, "keep_freed_cpu_memory", lambda: called.append(1) or True)
    callback = trainer_utils.KeepFreedCpuMemory()
    args = type("Args", (), {"device": torch.device(device)})()
    callback.on_train_begin(args, None, None)
    assert callback.kept is (device == "cpu") and called == ([1] if device == "cpu" else [])
