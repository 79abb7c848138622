"""Hub publishing: self-contained exports, model cards from measured results, uploads, safe loading."""
import json
import math
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig, pipeline

import model_cards
import modeling_fwp
from model_cards import hub
from model_cards.__main__ import main as model_cards_main
from modeling_fwp import FastWeightCache
from modeling_fwp.cache_fwp import CACHE_ARGUMENT
from modeling_fwp.remote_code import (
    check_remote_code_imports,
    exported_module_text,
    remote_code_sources,
    stage_remote_code,
)
from training import hub_options

from conftest import make_word_tokenizer, tiny_config

FAMILIES = hub.registered_families()
PROMPT = "the cat sat on the mat"
NEW_TOKENS = 8
SCAN_FAMILIES = {"fwp_delta_rnn", "fwp_delta_lstm", "fwp_recurrent_delta_net"}  # use fwp_kernels.rfwp_scan


def _variant(model_type, build=None, env=None, uses_scan=None):
    return {"model_type": model_type, "build": build, "env": env or {},
            "uses_scan": model_type in SCAN_FAMILIES if uses_scan is None else uses_scan}


def _fwl_on(config_cls):
    return lambda: modeling_fwp.FWLConfig(text_config=tiny_config(config_cls).to_dict())


# Every model family and the variants of the list, exported and loaded in one clean process:
# name -> model_type (the family), build (a config factory; None: the family's tiny default), env (set in the clean
# process while that folder loads and runs), uses_scan (whether it runs the recurrent FWP scans of rfwp_scan).
VARIANTS = {name: _variant(name) for name in FAMILIES}
VARIANTS.update({
    "fwp_delta_rnn-A": _variant("fwp_delta_rnn", lambda: tiny_config(modeling_fwp.DeltaRNNConfig, version="A")),
    **{f"fwp_delta_lstm-{v}": _variant("fwp_delta_lstm",
                                       lambda v=v: tiny_config(modeling_fwp.DeltaLSTMConfig, version=v))
       for v in "ABC"},
    "fwp_transfo_xl-fwl": _variant("fwp_transfo_xl", lambda: tiny_config(modeling_fwp.TransfoXLConfig, use_fwl=True)),
    "fwp_fwl-delta_net": _variant("fwp_fwl", _fwl_on(modeling_fwp.DeltaNetConfig), uses_scan=False),
    # flash-linear-attention's Delta Net options (what convert_fla writes for fla-hub/delta_net-1.3B-100B)
    "fwp_delta_net-fla": _variant("fwp_delta_net", lambda: tiny_config(
        modeling_fwp.DeltaNetConfig, feature_map="silu", short_conv_size=4, value_activation="silu",
        qk_l2_normalization=True, sum_normalization=False, query_scaling=True, beta_bias=False, output_norm=True,
        norm_type="rms_norm", feed_forward_type="swiglu", hidden_act="silu", tie_word_embeddings=False)),
    # the exported loader's fallbacks: the build disabled (documented switch) and no C++ compiler on the machine
    "fwp_delta_rnn-no_build": _variant("fwp_delta_rnn", env={"FWP_KERNELS_NO_BUILD": "1"}),
    "fwp_recurrent_delta_net-no_build": _variant("fwp_recurrent_delta_net", env={"FWP_KERNELS_NO_BUILD": "1"}),
    "fwp_delta_lstm-no_compiler": _variant("fwp_delta_lstm", env={"CXX": "/nonexistent/c++"}),
})
FALLBACK_STATUS = {"FWP_KERNELS_NO_BUILD": "disabled (FWP_KERNELS_NO_BUILD=1)", "CXX": "unavailable (no C++ compiler"}

# Runs in a fresh interpreter in which modeling_fwp, fwp_kernels and model_cards cannot be imported: loads every
# exported folder with trust_remote_code, writes its logits, and reports pipeline / generate outputs and which CPU
# path the folder's own copy of the recurrent FWP scans took.
CLEAN_LOADER = r"""
import importlib.abc, json, os, sys, traceback

HIDDEN = ("modeling_fwp", "fwp_kernels", "model_cards")


class HidePackages(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in HIDDEN:
            raise ModuleNotFoundError(f"No module named {name!r} (hidden by the test)", name=name)
        return None


sys.meta_path.insert(0, HidePackages())
import torch
from safetensors.torch import save_file
from transformers import pipeline

torch.set_num_threads(2)
report = {}
for job in json.loads(sys.argv[1]):
    saved_env = {name: os.environ.get(name) for name in job["env"]}
    os.environ.update(job["env"])
    try:
        generator = pipeline("text-generation", model=job["folder"], trust_remote_code=True)
        model = generator.model.eval()
        text = generator(job["prompt"], max_new_tokens=job["new_tokens"], do_sample=False)[0]["generated_text"]
        ids = torch.tensor(job["input_ids"])
        with torch.no_grad():
            save_file({"logits": model(ids).logits.contiguous()}, job["logits_file"])
        generated = model.generate(ids[:1], max_new_tokens=job["new_tokens"], do_sample=False)
        scan = sys.modules[type(model).__module__.rpartition(".")[0] + ".rfwp_scan"]
        hidden = []
        for name in HIDDEN:
            try:
                __import__(name)
            except ModuleNotFoundError:
                hidden.append(name)
        report[job["folder"]] = {
            "module": type(model).__module__, "text": text, "generated": generated.tolist(), "hidden": hidden,
            "scan_module": scan.__name__, "scan_status": scan.cpu_kernel_status(),
        }
    except Exception as error:
        report[job["folder"]] = {"error": f"{type(error).__name__}: {str(error)[:500]}\n"
                                          + traceback.format_exc()[-2000:]}
    finally:
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
print("REPORT " + json.dumps(report))
"""


def tiny_family_model(config_cls, seed=0):
    """A tiny random model of any registered family (an FWL family gets a tiny random Llama as its base)."""
    if "text_config" in getattr(config_cls, "sub_configs", {}):
        base = LlamaConfig(
            vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        )
        config = config_cls(text_config=base.to_dict())
    else:
        config = tiny_config(config_cls)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).eval()


def tiny_variant_model(name, seed=0):
    variant = VARIANTS[name]
    if variant["build"] is None:
        return tiny_family_model(FAMILIES[variant["model_type"]][0], seed)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(variant["build"]()).eval()


def demo_style_results(model, loss=3.25):
    """A results dict with the keys training/demo.py writes (values made up for the test, model config real)."""
    return {
        "model": {"class": type(model).__name__, "parameters": 1234, "config": model.config.to_dict()},
        "data": {"source": "/data/enwiki-sample.xml.bz2", "tokenizer": "word level", "train_tokens": 1000},
        "training": {"steps": 3, "batch_size": 2, "block_size": 16, "peak_lr": 0.002, "loss_curve": [1, 2]},
        "evaluation": {
            "split": "valid", "segment_tokens": 16, "scored_tokens": 300, "loss": loss,
            "perplexity": math.exp(loss), "unigram_perplexity": 50.0,
        },
        "environment": {"torch": torch.__version__},
        "args": {"minutes": 1.0, "seed": 0},
    }


def kernels_as_in_export(patch, folder, fallback):
    """Makes this process run the kernels the clean process runs for ``folder``: a compiled CPU kernel of
    fwp_kernels only when the export carries its source (``<stem>_csrc.py``) and the variant does not fall back."""
    import fwp_kernels.chunk
    import fwp_kernels.rfwp_scan

    for module in (fwp_kernels.rfwp_scan, fwp_kernels.chunk):
        source = getattr(module, "_SOURCE", None)
        if source is None or not hasattr(module, "cpu_kernel_available"):
            continue
        if fallback or not (Path(folder) / f"{source.stem}_csrc.py").is_file():
            patch.setattr(module, "cpu_kernel_available", lambda: False)


@pytest.fixture(scope="module")
def exports(tmp_path_factory, module_word_tokenizer):
    """Every variant exported with a tokenizer, its in-process outputs, and the clean-process report.

    In-process outputs use the kernels the clean process should use (:func:`kernels_as_in_export`): the C++ scans
    when they build here (the export carries their source), the step loop for the fallback variants.
    """
    from fwp_kernels import rfwp_scan

    tokenizer = module_word_tokenizer
    root = tmp_path_factory.mktemp("exports")
    ids = tokenizer([PROMPT, "fast weights are programmed by slow nets"], return_tensors="pt", padding=True)
    input_ids = ids["input_ids"]
    jobs, expected = [], {}
    for name, variant in VARIANTS.items():
        model = tiny_variant_model(name)
        folder = root / name
        hub.export_for_hub(model, tokenizer, folder, results=demo_style_results(model), repo_id=f"test/{name}")
        with pytest.MonkeyPatch.context() as patch:
            kernels_as_in_export(patch, folder, fallback=bool(variant["env"]))
            with torch.no_grad():
                logits = model(input_ids).logits
            text = pipeline("text-generation", model=model, tokenizer=tokenizer)(
                PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False
            )[0]["generated_text"]
            generated = model.generate(input_ids[:1], max_new_tokens=NEW_TOKENS, do_sample=False)
        expected[name] = {"model": model, "logits": logits, "text": text, "generated": generated.tolist()}
        jobs.append(
            {"folder": str(folder), "input_ids": input_ids.tolist(), "logits_file": str(root / f"{name}.safetensors"),
             "prompt": PROMPT, "new_tokens": NEW_TOKENS, "env": variant["env"]}
        )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(root / "hf_modules"), TOKENIZERS_PARALLELISM="false")
    script = root / "clean_loader.py"
    script.write_text(CLEAN_LOADER)
    try:
        proc = subprocess.run(
            [sys.executable, str(script), json.dumps(jobs)], cwd=root, env=env, stdin=subprocess.DEVNULL,
            capture_output=True, text=True, timeout=600,
        )
    except subprocess.TimeoutExpired as error:  # e.g. waiting on a C++ build lock held by another process
        pytest.fail(f"the clean loader timed out: {(error.stdout or b'')[-2000:]!r} {(error.stderr or b'')[-4000:]!r}")
    reports = [line[len("REPORT "):] for line in proc.stdout.splitlines() if line.startswith("REPORT ")]
    assert proc.returncode == 0 and reports, proc.stdout[-2000:] + proc.stderr[-4000:]
    report = json.loads(reports[0])
    return {"root": root, "expected": expected, "report": report, "input_ids": input_ids,
            "cpp_here": rfwp_scan.cpu_kernel_available()}


@pytest.fixture(scope="module")
def module_word_tokenizer():
    tokenizer = make_word_tokenizer()
    tokenizer.padding_side = "left"  # as pipeline("text-generation") uses it
    return tokenizer


def test_every_family_is_covered():
    assert {"fwp_linear_transformer", "fwp_delta_net", "fwp_delta_mlp", "fwp_delta_delta_net", "fwp_delta_rnn",
            "fwp_delta_lstm", "fwp_recurrent_delta_net", "fwp_transfo_xl", "fwp_fwl"} <= set(FAMILIES)
    for model_type in FAMILIES:
        assert model_type.startswith("fwp_")
    assert {v["model_type"] for v in VARIANTS.values()} == set(FAMILIES)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_export_loads_without_the_package(exports, name):
    folder = str(exports["root"] / name)
    got = exports["report"][folder]
    assert "error" not in got, got.get("error")
    want = exports["expected"][name]
    assert got["hidden"] == ["modeling_fwp", "fwp_kernels", "model_cards"]
    assert got["module"].startswith("transformers_modules.") and got["scan_module"].startswith("transformers_modules.")
    logits = load_file(exports["root"] / f"{name}.safetensors")["logits"]
    assert torch.equal(logits, want["logits"])
    assert got["text"] == want["text"]
    assert got["generated"] == want["generated"]


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_export_reports_its_kernel_path(exports, name):
    """The folder's own copy of the recurrent FWP scans built the C++ ops from the source it carries (when they
    build here), or fell back to the step loop silently when told to or when there is no compiler."""
    got = exports["report"][str(exports["root"] / name)]
    assert "error" not in got, got.get("error")
    variant = VARIANTS[name]
    if not variant["uses_scan"]:
        assert got["scan_status"] == "not tried yet"
    elif variant["env"]:
        (switch,) = variant["env"]
        assert got["scan_status"].startswith(FALLBACK_STATUS[switch]), got["scan_status"]
    elif exports["cpp_here"]:
        assert got["scan_status"] == "built"
    else:
        assert got["scan_status"] != "built"


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_export_loads_with_the_package_without_trust_remote_code(exports, name):
    folder = exports["root"] / name
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert type(model).__module__.startswith("modeling_fwp.")
    with pytest.MonkeyPatch.context() as patch, torch.no_grad():
        kernels_as_in_export(patch, folder, fallback=bool(VARIANTS[name]["env"]))
        assert torch.equal(model(exports["input_ids"]).logits, exports["expected"][name]["logits"])


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_export_contents(exports, name):
    folder = exports["root"] / name
    model = exports["expected"][name]["model"]
    config = json.loads((folder / "config.json").read_text())
    assert config["auto_map"]["AutoConfig"].split(".")[1] == type(model.config).__name__
    assert config["auto_map"]["AutoModelForCausalLM"].endswith("." + type(model).__name__)
    files = hub.check_export(folder)
    for file in ("config.json", "model.safetensors", "README.md", "results.json", "tokenizer.json", "pretrained.py",
                 "fwp_kernels.py", "delta_rule_kernels.py", "dispatch.py", "remote_code.py", "rfwp_scan.py",
                 "rfwp_scan.cpp", "rfwp_scan_csrc.py", "dense.py", "decode_linear.cpp", "decode_linear_csrc.py"):
        assert file in files, file
    assert "hub.py" not in files and not any(f.endswith(".bin") for f in files)
    # The C++ source travels twice: as the file, and as the string transformers' module cache will hold.
    cpp = (Path(modeling_fwp.__file__).parents[1] / "kernels" / "csrc" / "rfwp_scan.cpp").read_text()
    assert (folder / "rfwp_scan.cpp").read_text() == cpp
    namespace = {}
    exec((folder / "rfwp_scan_csrc.py").read_text(), namespace)
    assert namespace["CPP_SOURCE"] == cpp
    # The folder's code is closed under sibling imports and imports nothing beyond a transformers install.
    sources = remote_code_sources([folder / file for file in files if file.endswith(".py")])
    assert set(sources) == {file for file in files if file.endswith(".py")}
    check_remote_code_imports(sources)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_card_parses_back_with_complete_model_index(exports, name):
    folder = exports["root"] / name
    card = model_cards.validate_card((folder / "README.md").read_text())
    results = json.loads((folder / "results.json").read_text())
    data = card.data
    assert data.library_name == "transformers" and data.pipeline_tag == "text-generation"
    assert data.license == "apache-2.0"
    assert {"fast-weights", "linear-attention"} <= set(data.tags) or name == "fwp_transfo_xl"
    assert data.model_name == name
    by_metric = {r.metric_type: r for r in data.eval_results}
    assert set(by_metric) == {"perplexity", "loss"}
    for key, metric in (("perplexity", "perplexity"), ("loss", "loss")):
        r = by_metric[metric]
        assert r.metric_value == results["evaluation"][key]  # read from the results, never typed in
        assert (r.task_type, r.dataset_split) == ("text-generation", "valid")
        assert r.dataset_type == "enwiki-sample.xml.bz2" and r.dataset_name
    assert "unigram perplexity (reference, not this model)" in card.text
    assert "@inproceedings" in card.text and "Slow net" in card.text and f'from_pretrained("test/{name}"' in card.text


def test_card_without_results_says_so(tmp_path):
    model = tiny_family_model(modeling_fwp.DeltaNetConfig)
    model.save_pretrained(tmp_path)  # save_pretrained alone writes a card without numbers
    card = model_cards.validate_card((tmp_path / "README.md").read_text())
    assert model_cards.NO_RESULTS_NOTE in card.text
    assert card.data.eval_results is None and "model-index" not in card.data.to_dict()
    assert "Perplexity |" not in card.text and "No training record" in card.text
    # validation catches a card that has neither results nor the statement
    with pytest.raises(ValueError, match="does not say that no results"):
        model_cards.validate_card(str(card).replace(model_cards.NO_RESULTS_NOTE, ""))


def test_card_refuses_results_of_another_model(tmp_path):
    model = tiny_family_model(modeling_fwp.DeltaNetConfig)
    model.save_pretrained(tmp_path)
    other = tiny_family_model(modeling_fwp.DeltaNetConfig)
    other.config.hidden_size = 64
    with pytest.raises(ValueError, match="different model.*hidden_size 64 != 32"):
        model_cards.card_for_folder(tmp_path, demo_style_results(other))
    bad = demo_style_results(model)
    del bad["evaluation"]["loss"], bad["evaluation"]["perplexity"]
    with pytest.raises(ValueError, match="none of the metrics"):
        model_cards.card_for_folder(tmp_path, bad)


def test_cli_card_validate_and_dry_run_push(tmp_path, capsys, module_word_tokenizer):
    model = tiny_family_model(modeling_fwp.LinearTransformerConfig)
    results_file = tmp_path / "results.json"
    results_file.write_text(json.dumps(demo_style_results(model, loss=2.5)))
    folder = tmp_path / "export"
    hub.export_for_hub(model, module_word_tokenizer, folder)
    assert model_cards_main(["card", str(folder), "--results", str(results_file), "--repo-id", "me/lt"]) == 0
    card = model_cards.validate_card((folder / "README.md").read_text())
    assert {r.metric_value for r in card.data.eval_results} == {
        2.5, json.loads(results_file.read_text())["evaluation"]["perplexity"]}
    assert model_cards_main(["validate", str(folder)]) == 0
    capsys.readouterr()
    assert model_cards_main(["push", str(folder), "--repo-id", "me/lt", "--dry-run"]) == 0
    listed = capsys.readouterr().out
    for name in ("README.md", "model.safetensors", "config.json", "modeling_fwp.py", "fwp_kernels.py",
                 "tokenizer.json"):
        assert f"  {name}\n" in listed
    (folder / "README.md").unlink()
    with pytest.raises(ValueError, match="no README.md"):
        hub.push_folder(folder, "me/lt", dry_run=True)


def test_push_to_hub_uploads_code_weights_and_our_card(monkeypatch, module_word_tokenizer):
    from huggingface_hub import HfApi

    uploads = {}

    def create_repo(self, repo_id, **kwargs):
        uploads["created"] = repo_id
        return type("RepoUrl", (), {"repo_id": repo_id})()

    def upload_folder(self, *, repo_id, folder_path, **kwargs):
        folder = Path(folder_path)
        uploads["files"] = sorted(p.name for p in folder.iterdir())
        uploads["card"] = (folder / "README.md").read_text()
        return "commit"

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    model = tiny_family_model(modeling_fwp.DeltaNetConfig)
    assert model.push_to_hub("me/dn", tokenizer=module_word_tokenizer, results=demo_style_results(model)) == "commit"
    assert uploads["created"] == "me/dn"
    assert ({"modeling_fwp.py", "fwp_kernels.py", "model.safetensors", "tokenizer.json", "README.md"}
            <= set(uploads["files"]))
    card = model_cards.validate_card(uploads["card"])
    assert card.data.model_name == "dn" and card.data.eval_results and "delta-net" in card.data.tags
    assert "This model card has been automatically generated" not in uploads["card"]  # not transformers' card


def test_pickled_weights_are_rejected(tmp_path):
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    model = tiny_family_model(modeling_fwp.DeltaNetConfig)
    model.save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    torch.save({**model.state_dict(), "payload": Payload()}, tmp_path / "pytorch_model.bin")
    with pytest.raises(pickle.UnpicklingError,
                       match=r"Refusing to load the pickled checkpoint.*\(unsupported GLOBAL posix.system\)"
                             r".*arbitrary code"):
        AutoModelForCausalLM.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="`weights_only` must be True"):
        AutoModelForCausalLM.from_pretrained(tmp_path, weights_only=False)
    assert not marker.exists()
    # a weights-only pickle (legacy checkpoint) still loads, through torch.load(weights_only=True)
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert torch.equal(reloaded.lm_head.weight, model.lm_head.weight)
    with pytest.raises(ValueError, match="pickled files"):
        hub.check_export(tmp_path)


@pytest.mark.parametrize(
    "damage,message",
    [
        (lambda data: data[: len(data) // 2],
         "is truncated: its header describes \\d+ bytes of tensor data but the file holds \\d+"),
        (lambda data: data[:5], "is truncated: 5 bytes"),
        (lambda data: data[:8] + b"{garbage" + data[16:], "is corrupted: its header is not valid JSON"),
        (lambda data: (10**9).to_bytes(8, "little") + data[8:],
         "is truncated or corrupted: its header claims 1000000000 bytes"),
        (lambda data: data + b"\0" * 7, "is corrupted: 7 bytes follow the tensor data"),
    ],
)
def test_damaged_safetensors_give_clear_errors(tmp_path, damage, message):
    tiny_family_model(modeling_fwp.DeltaNetConfig).save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(damage(weights.read_bytes()))
    with pytest.raises(OSError, match=f"{weights}.*{message}.*re-download or re-save"):
        AutoModelForCausalLM.from_pretrained(tmp_path)


def assert_generates_with_cache(model, prompt, new_tokens=6):
    """generate() feeds the prompt once, then one token per step with the carried FastWeightCache, and matches
    generation without a cache."""
    calls = []
    forward = model.forward

    def spy(*args, **kwargs):
        calls.append((kwargs.get("use_cache"), kwargs.get(CACHE_ARGUMENT), kwargs["input_ids"].shape[1]))
        return forward(*args, **kwargs)

    model.forward = spy
    try:
        with_cache = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    finally:
        model.forward = forward
    assert all(use_cache for use_cache, _, _ in calls)
    assert [length for _, _, length in calls] == [prompt.shape[1]] + [1] * (new_tokens - 1)
    assert all(isinstance(cache, FastWeightCache) for _, cache, _ in calls[1:])
    without = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             use_cache=False)
    assert torch.equal(with_cache, without)


def test_trainer_checkpoint_generates_with_cache(tmp_path):
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments, default_data_collator

    ids = torch.randint(3, 61, (4, 12), generator=torch.Generator().manual_seed(0))
    prompt = ids[:1, :5]
    # 1. a checkpoint written by Trainer after a training script turned the cache off
    model = tiny_family_model(modeling_fwp.DeltaNetConfig)
    model.config.use_cache = False
    data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()}).with_format("torch")
    args = TrainingArguments(
        output_dir=str(tmp_path / "run"), max_steps=1, per_device_train_batch_size=2, report_to="none", use_cpu=True,
        save_strategy="no", disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=default_data_collator)
    trainer.train()
    trainer.save_model(str(tmp_path / "trainer"))
    # 2. a model created with use_cache=False: its generation_config.json is derived from that config
    config = tiny_config(modeling_fwp.DeltaNetConfig, use_cache=False)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "derived")
    assert json.loads((tmp_path / "derived" / "generation_config.json").read_text())["use_cache"] is False
    # 3. no generation_config.json at all
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "bare")
    (tmp_path / "bare" / "generation_config.json").unlink()
    for name in ("trainer", "derived", "bare"):
        assert json.loads((tmp_path / name / "config.json").read_text())["use_cache"] is False
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / name).eval()
        assert loaded.config.use_cache is False  # training-time default kept; generation still uses the state
        assert_generates_with_cache(loaded, prompt)
    # a generation config written by hand (not derived from the model config) keeps its explicit choice
    (tmp_path / "bare" / "generation_config.json").write_text(json.dumps({"use_cache": False}))
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "bare").generation_config.use_cache is False


def test_export_refuses_code_that_needs_the_package(tmp_path):
    (tmp_path / "modeling_x.py").write_text("import torch\nfrom fwp_kernels import delta_rule\n"
                                            "from .helper_x import y\n")
    (tmp_path / "helper_x.py").write_text("try:\n    import triton\nexcept ImportError:\n    triton = None\ny = 1\n")
    sources = remote_code_sources([tmp_path / "modeling_x.py"])
    assert set(sources) == {"modeling_x.py", "helper_x.py"}
    with pytest.raises(ImportError, match="modeling_x.py .* imports fwp_kernels.*as `from fwp_kernels import name`"):
        check_remote_code_imports(sources)
    (tmp_path / "modeling_y.py").write_text("from .missing_z import w\n")
    with pytest.raises(FileNotFoundError, match="imports `.missing_z`"):
        remote_code_sources([tmp_path / "modeling_y.py"])
    # exported code is flat: two modules with one file name cannot both travel
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "helper_x.py").write_text("y = 2\n")
    with pytest.raises(ValueError, match="Two modules would be saved as helper_x.py"):
        remote_code_sources([tmp_path / "modeling_x.py", tmp_path / "other" / "helper_x.py"])


def test_export_rewrites_kernel_imports_into_sibling_imports(tmp_path):
    """A saved folder is flat: each `from fwp_kernels import ...` statement of the model code becomes an import of the
    folder's copy of the kernels (`from .fwp_kernels import ...`), which then travels with the code; nothing else of
    the module changes (not a docstring that shows such a line)."""
    import fwp_kernels

    source = tmp_path / "modeling_z.py"
    body = (
        '"""Example:\nfrom {m} import delta_rule\n"""\nimport torch\nfrom {m} import (\n    delta_rule,\n)\n\n\n'
        "def read():\n    from {m} import linear_attention  # lazy\n\n    return linear_attention\n"
    )
    source.write_text(body.format(m="fwp_kernels"))
    assert exported_module_text(source) == body.format(m="fwp_kernels").replace(
        "\nfrom fwp_kernels import (", "\nfrom .fwp_kernels import ("
    ).replace("    from fwp_kernels import linear", "    from .fwp_kernels import linear")
    assert set(remote_code_sources([source])) == {"modeling_z.py"}  # as transformers sees the unsaved file
    sources = remote_code_sources([source], rewrite_kernel_imports=True)
    assert sources["fwp_kernels.py"] == Path(fwp_kernels.__file__)
    assert ({"dispatch.py", "chunk.py", "chunk_delta_csrc.py", "rfwp_scan_csrc.py", "decode_linear_csrc.py"}
            <= set(sources))
    staging = tmp_path / "staged"
    staging.mkdir()
    staged = stage_remote_code(sources, staging)
    assert (staging / "modeling_z.py").read_text() == exported_module_text(source)
    check_remote_code_imports(staged)  # the staged folder imports no fwp_kernels package any more
    assert remote_code_sources([staged["modeling_z.py"]]) == {n: p for n, p in staged.items() if n.endswith(".py")}


def finetune_fwl_style_results(fwl_ppl=20.0):
    """The layout training/finetune_fwl.py writes (its stage metrics and settings; values made up for the test)."""
    stage = lambda ppl: {  # noqa: E731
        "nll": math.log(ppl), "ppl": ppl, "tokens": 500, "nll_first": math.log(ppl * 1.5), "ppl_first": ppl * 1.5,
        "tokens_first": 300, "nll_repeated": math.log(ppl / 2), "ppl_repeated": ppl / 2, "tokens_repeated": 200,
        "loss": math.log(ppl), "runtime": 1.0,
    }
    return {
        "base": stage(30.0), "base_finetuned": stage(25.0), "base_fwl": stage(fwl_ppl),
        "fwl_vs_finetuned": {"ppl_ratio": fwl_ppl / 25.0},
        "settings": {"model": "checkpoints/smollm2-135m", "dataset": None, "validation_file": "data/wiki/valid.txt",
                     "block_size": 64, "max_steps": 3, "learning_rate": 5e-5, "fwl_learning_rate": 1e-3, "seed": 0},
    }


def test_card_from_finetune_fwl_results(tmp_path):
    model = tiny_family_model(modeling_fwp.FWLConfig)
    results = finetune_fwl_style_results()
    hub.export_for_hub(model, None, tmp_path, results=results, base_model="HuggingFaceTB/SmolLM2-135M-Instruct")
    card = model_cards.validate_card((tmp_path / "README.md").read_text())
    assert card.data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert "fast-weight-layers" in card.data.tags
    by_metric = {r.metric_type: r.metric_value for r in card.data.eval_results}
    assert by_metric == {"perplexity": results["base_fwl"]["ppl"], "loss": results["base_fwl"]["nll"]}
    assert ("base model fine-tuned without FWL (same steps and data): perplexity (reference, not this model) | 25"
            in card.text)
    assert "repeated tokens: perplexity | 10" in card.text and "`results.json`" in card.text


def test_card_from_eval_lm_and_training_log(tmp_path, module_word_tokenizer):
    """Real files: training/eval_lm.py scores exported models; its JSON and a training log make one card."""
    from training import eval_lm

    data_dir = tmp_path / "data"
    data_dir.mkdir()
    (data_dir / "test.txt").write_text("the cat sat on the mat\n\nfast weights are programmed by slow nets\n\n" * 3)
    folders = []
    for name, config_cls in (("dn", modeling_fwp.DeltaNetConfig), ("lt", modeling_fwp.LinearTransformerConfig)):
        folders.append(hub.export_for_hub(tiny_family_model(config_cls), module_word_tokenizer, tmp_path / name))
    output = tmp_path / "eval_lm.json"
    args = ["--data_dir", str(data_dir), "--split", "test", "--block_size", "8", "--results_file", str(output)]
    eval_lm.main(["--model_name_or_path", *map(str, folders)] + args)
    rows = {Path(r["model"]).name: r for r in json.loads(output.read_text())["results"]}
    train_log = tmp_path / "train_log.json"
    train_log.write_text(json.dumps({"steps": 5, "seconds": 1.5, "final_train_loss": 3.9, "lr": 1e-3,
                                     "parameters": 999}))

    card = model_cards.card_for_folder(folders[0], [train_log, output])  # the folder picks its own eval_lm row
    assert {r.metric_type: r.metric_value for r in card.data.eval_results} == {
        "perplexity": rows["dn"]["perplexity"], "loss": rows["dn"]["loss"]
    }
    assert card.data.eval_results[0].dataset_split == "test"
    assert "`final_train_loss` | 3.9" in card.text and "| 999 |" in card.text and "training/eval_lm.py" in card.text
    with pytest.raises(ValueError, match="cover 2 models"):
        model_cards.card_for_folder(folders[0], output, results_model=tmp_path / "elsewhere")
    card = model_cards.card_for_folder(folders[1], output, results_model=folders[1])
    assert card.data.eval_results[0].metric_value == rows["lt"]["perplexity"]


def test_local_base_model_path_is_not_a_hub_id(tmp_path, monkeypatch):
    """finetune_fwl's default base is a converted local folder (checkpoints/...): not a base_model for the card."""
    from model_cards.generator import _hub_id

    monkeypatch.chdir(tmp_path)
    (tmp_path / "checkpoints" / "smollm2-135m").mkdir(parents=True)
    assert _hub_id("checkpoints/smollm2-135m") is None
    assert _hub_id("HuggingFaceTB/SmolLM2-135M") == "HuggingFaceTB/SmolLM2-135M"


def test_unrecognised_results_layout_is_an_error(tmp_path):
    tiny_family_model(modeling_fwp.DeltaNetConfig).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="Unrecognised results layout"):
        model_cards.card_for_folder(tmp_path, {"ppl": 12.0})


# ---------------------------------------------------------------------------------------------------------------
# --push_to_hub of the training scripts (training.hub_options.add_hub_arguments / push_if_requested)
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture
def fake_hub(monkeypatch):
    """HfApi.create_repo / upload_folder replaced (no network): records what an upload would send."""
    from huggingface_hub import HfApi

    record = {"created": [], "uploads": []}

    def create_repo(self, repo_id, *, private=None, **kwargs):
        # the Hub puts bare names in the token's namespace
        full_id = repo_id if "/" in repo_id else f"token-user/{repo_id}"
        record["created"].append({"repo_id": full_id, "private": private, "token": self.token})
        return type("RepoUrl", (), {"repo_id": full_id})()

    def upload_folder(self, *, repo_id, folder_path, **kwargs):
        folder = Path(folder_path)
        record["uploads"].append({
            "repo_id": repo_id, "token": self.token, "revision": kwargs.get("revision"),
            "files": {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()},
        })
        return "commit"

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    return record


@pytest.fixture(scope="module")
def small_wiki(tiny_wiki):
    """The prepared fixture corpus (conftest.tiny_wiki: 6/3/3 made-up documents), enough for 1-2 training steps."""
    return tiny_wiki["train"].parent


def assert_upload_is_our_export(upload, results_file, model_class):
    """The uploaded folder holds the remote code, safetensors weights, the tokenizer, the run's results and OUR card
    (filled from those results), and no secret."""
    files = upload["files"]
    for name in ("config.json", "model.safetensors", "tokenizer.json", "README.md", "results.json", "modeling_fwp.py",
                 "fwp_kernels.py", "delta_rule_kernels.py", "remote_code.py"):
        assert name in files, name
    assert not any(name.endswith((".bin", ".pt", ".pkl")) or "__pycache__" in name for name in files)
    config = json.loads(files["config.json"])
    assert config["auto_map"]["AutoModelForCausalLM"] == f"modeling_fwp.{model_class}"
    results = json.loads(results_file.read_text())
    assert json.loads(files["results.json"]) == results
    card = model_cards.validate_card(files["README.md"].decode())
    assert "This model card has been automatically generated" not in files["README.md"].decode()
    assert card.data.library_name == "transformers" and card.data.pipeline_tag == "text-generation"
    assert f'from_pretrained("{upload["repo_id"]}"' in card.text
    return card, results


def test_demo_push_to_hub_uploads_our_export(small_wiki, tmp_path, fake_hub):
    from training import demo

    out = tmp_path / "demo_run"
    demo.main([
        "--max_steps", "1", "--hidden_size", "32", "--num_hidden_layers", "1", "--num_attention_heads", "2",
        "--vocab_size", "300", "--block_size", "32", "--per_device_train_batch_size", "2", "--max_eval_blocks", "2",
        "--max_new_tokens", "4",
        "--data_dir", str(small_wiki), "--output_dir", str(out),
        "--push_to_hub", "--hub_model_id", "me/delta-net-demo", "--hub_private_repo", "true",
        "--hub_token", "hf_secret123",
    ])
    assert fake_hub["created"] == [{"repo_id": "me/delta-net-demo", "private": True, "token": "hf_secret123"}]
    (upload,) = fake_hub["uploads"]
    assert upload["repo_id"] == "me/delta-net-demo" and upload["token"] == "hf_secret123"
    card, results = assert_upload_is_our_export(upload, out / "results.json", "DeltaNetForCausalLM")
    assert card.data.model_name == "delta-net-demo" and "delta-net" in card.data.tags
    by_metric = {r.metric_type: r for r in card.data.eval_results}
    assert by_metric["perplexity"].metric_value == results["evaluation"]["perplexity"]
    assert by_metric["loss"].metric_value == results["evaluation"]["loss"]
    assert by_metric["perplexity"].dataset_split == "valid"
    # the token never reaches a file (the results are uploaded with the model)
    assert "hub_token" not in results["args"] and results["args"]["hub_model_id"] == "me/delta-net-demo"
    assert not any(b"hf_secret123" in content for content in upload["files"].values())


def test_train_lm_push_to_hub_defaults_to_the_output_dir_name(small_wiki, tmp_path, fake_hub):
    from training import train_lm

    out = tmp_path / "tiny-lt"
    train_lm.main([
        "--model_type", "fwp_linear_transformer", "--train_file", str(small_wiki / "train.txt"),
        "--validation_file", str(small_wiki / "valid.txt"),
        "--config_overrides", "hidden_size=32,num_hidden_layers=1,num_attention_heads=2",
        "--per_device_train_batch_size", "2", "--block_size", "16", "--vocab_size", "300", "--max_steps", "1",
        "--warmup_steps", "0", "--save_steps", "100", "--max_eval_tokens", "100", "--output_dir", str(out),
        "--push_to_hub",
    ])
    # as with Trainer: no --hub_model_id means the output directory's name in the token's namespace
    assert [c["repo_id"] for c in fake_hub["created"]] == ["token-user/tiny-lt", "token-user/tiny-lt"]
    (upload,) = fake_hub["uploads"]
    assert upload["repo_id"] == "token-user/tiny-lt"
    card, results = assert_upload_is_our_export(upload, out / "results.json", "LinearTransformerForCausalLM")
    assert "linear-transformer" in card.data.tags or "linear-attention" in card.data.tags
    valid = {e["protocol"]: e for e in results["evaluation"] if e["split"] == "valid"}
    assert {r.metric_value for r in card.data.eval_results if r.metric_type == "perplexity"} <= {
        e["perplexity"] for e in valid.values()
    }
    assert card.data.eval_results


def test_push_if_requested_dry_run_and_options(tmp_path, capsys, fake_hub, module_word_tokenizer):
    """Trainer's Hub options parsed with TrainingArguments (plus --hub_dry_run) reach push_if_requested, and Trainer's
    own upload is turned off; the token is never recorded."""
    from transformers import TrainingArguments

    from training.arguments import HubExportArguments, parse_arguments

    def parse(*argv):
        args = parse_arguments((TrainingArguments, HubExportArguments), ["--output_dir", str(out), *argv])
        return args, hub_options.hub_request(args)

    model = tiny_family_model(modeling_fwp.DeltaRNNConfig)
    out = tmp_path / "run"
    out.mkdir()
    (out / "results.json").write_text(json.dumps(demo_style_results(model)))

    args, request = parse()
    assert hub_options.push_if_requested(request, model, module_word_tokenizer, out) is None  # nothing asked
    assert not (out / hub_options.EXPORT_DIR_NAME).exists()

    capsys.readouterr()
    args, request = parse("--push_to_hub", "--hub_dry_run", "--hub_model_id", "me/rnn", "--hub_token", "hf_x")
    assert request.push_to_hub and request.hub_token == "hf_x" and not args.training.push_to_hub  # not Trainer's
    (out / hub_options.EXPORT_DIR_NAME).mkdir()
    (out / hub_options.EXPORT_DIR_NAME / "stale.bin").write_bytes(b"old export")
    listed = hub_options.push_if_requested(request, model, module_word_tokenizer, out)
    printed = capsys.readouterr().out
    assert "Dry run: would upload" in printed and "https://huggingface.co/me/rnn" in printed
    assert "stale.bin" not in listed  # an earlier export is replaced, not merged
    for name in ("README.md", "model.safetensors", "config.json", "tokenizer.json", "results.json", "fwp_kernels.py",
                 "modeling_fwp.py"):
        assert name in listed and f"  {name}\n" in printed, name
    assert fake_hub == {"created": [], "uploads": []}  # no network call in a dry run
    card = model_cards.validate_card((out / hub_options.EXPORT_DIR_NAME / "README.md").read_text())
    assert card.data.eval_results and card.data.model_name == "rnn"
    recorded = args.record()
    assert recorded["hub_model_id"] == "me/rnn" and "hub_token" not in recorded

    with pytest.raises(ValueError, match="--hub_model_id: expected a Hub repo id like 'user/model-name'"):
        parse("--hub_model_id", "not a/valid//id")
    with pytest.raises(ValueError, match="HubRequest.*push_to_hub"):
        hub_options.push_if_requested(object(), model, None, out)