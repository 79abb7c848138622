"""flash-linear-attention checkpoints as our models: converted fla 0.6 DeltaNets and a Gated DeltaNet give fla's own
logits (tests/fixtures/fla_0_6, made by fla itself with make_fixtures.py), in prefill, cached decoding and a left-padded
batch; the converter's config, dtype, shards, command line and refusals; old checkpoints with a fused ``qkv_proj``."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from modeling_fwp import DeltaNetForCausalLM, GatedDeltaNetForCausalLM, convert_fla_checkpoint
from modeling_fwp.cache_fwp import output_cache
from modeling_fwp.convert_fla import config_from_fla
from training.convert_fla import main as convert_main

from conftest import FIXTURES, tiny_model

FLA = FIXTURES / "fla_0_6"
NAMES = ["delta_net", "delta_net_gated", "gated_deltanet"]
# float32: measured max |ours - fla| 2.0e-6 .. 4.7e-6 over all fixtures (logits up to 4 in size); a layer's
# query scaling, conv window or decay off by one token moves them by > 1e-2
ATOL = 1e-5


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """name -> (the converted model loaded with AutoModelForCausalLM, fla's expected outputs, the folder)."""
    root = tmp_path_factory.mktemp("fla")
    out = {}
    for name in NAMES:
        folder = root / name
        convert_fla_checkpoint(FLA / name, folder, repo_id=f"fla-hub/{name}-tiny")
        out[name] = (AutoModelForCausalLM.from_pretrained(folder).eval(),
                     load_file(FLA / name / "expected.safetensors"), folder)
    return out


def _close(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=0, atol=ATOL)


@pytest.mark.parametrize("name", NAMES)
@torch.no_grad()
def test_prefill_and_cached_decoding_match_fla(converted, name):
    model, expected, _ = converted[name]
    ids = expected["input_ids"]
    _close(model(ids).logits, expected["prefill_logits"])
    for block in model.model.layers:  # the chunkwise kernels (chunks of 5: a partial last chunk)
        block.fast_weight.kernel_mode, block.fast_weight.chunk_size = "chunk", 5
    try:
        _close(model(ids).logits, expected["prefill_logits"])
    finally:
        for block in model.model.layers:
            block.fast_weight.kernel_mode, block.fast_weight.chunk_size = "auto", 64
    cache = output_cache(model(ids[:, :8], use_cache=True))
    steps = [model(ids[:, t:t + 1], cache=cache).logits for t in range(8, 12)]
    _close(torch.cat(steps, dim=1), expected["decode_logits"])


@pytest.mark.parametrize("name", NAMES)
@torch.no_grad()
def test_left_padded_batch_and_its_decoding_match_fla(converted, name):
    model, expected, _ = converted[name]
    mask = expected["padded_mask"]
    out = model(expected["padded_ids"], attention_mask=mask, use_cache=True)
    _close(out.logits * mask[..., None], expected["padded_logits"])
    steps = []
    for t in range(expected["padded_decode_ids"].shape[1]):
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        steps.append(model(expected["padded_decode_ids"][:, t:t + 1], attention_mask=mask,
                           cache=output_cache(out)).logits)
    _close(torch.cat(steps, dim=1), expected["padded_decode_logits"])


@pytest.mark.parametrize("name", ["delta_net", "gated_deltanet"])
@torch.no_grad()
def test_greedy_and_beam_search(converted, name):
    """Greedy decoding picks the argmax of a full forward at every step; beam search returns sequences whose scores
    are their log-probabilities under a full forward (length penalty 0)."""
    model, expected, _ = converted[name]
    prompt = expected["padded_ids"][:, 5:]  # both rows unpadded
    greedy = model.generate(prompt, max_new_tokens=5, do_sample=False)
    full = model(greedy[:, :-1]).logits[:, prompt.shape[1] - 1:]
    new = greedy[:, prompt.shape[1]:]
    finished = (new == model.config.eos_token_id).long().cumsum(-1) - (new == model.config.eos_token_id).long() > 0
    assert ((new == full.argmax(-1)) | finished).all() and (~finished).sum() >= 7  # after an EOS: padding
    beams = model.generate(prompt, max_new_tokens=4, num_beams=3, do_sample=False, length_penalty=0.0,
                           output_scores=True, return_dict_in_generate=True, early_stopping=True, suppress_tokens=[2])
    seqs = beams.sequences
    logprobs = torch.log_softmax(model(seqs[:, :-1]).logits[:, prompt.shape[1] - 1:], -1)
    score = logprobs.gather(-1, seqs[:, prompt.shape[1]:, None]).squeeze(-1).sum(-1)
    torch.testing.assert_close(beams.sequences_scores, score, rtol=0, atol=1e-4)


def test_converted_config_records_the_source(converted):
    model, _, folder = converted["delta_net"]
    assert (isinstance(model, DeltaNetForCausalLM)
            and isinstance(converted["gated_deltanet"][0], GatedDeltaNetForCausalLM))
    config = model.config
    assert (config.short_conv_size, config.feature_map, config.qk_l2_normalization, config.norm_type) == (
        4, "silu", True, "rms_norm")
    source = config.pretrained_source
    assert source["repo_id"] == "fla-hub/delta_net-tiny" and source["model_type"] == "delta_net"
    assert source["license"] == "mit" and source["license_source"].startswith("not stated by the weights' repository")
    assert json.loads((folder / "config.json").read_text())["pretrained_source"]["library"].startswith(
        "flash-linear-attention")
    assert (folder / "configuration_fwp.py").is_file()  # the remote code, as every save_pretrained writes it


def test_license_from_the_readme_and_dtype(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(FLA / "delta_net", src)
    (src / "README.md").write_text("---\nlicense: apache-2.0\ntags: [x]\n---\n# a model\n")
    model = convert_fla_checkpoint(src, tmp_path / "bf16", dtype="bfloat16", repo_id="someone/model")
    assert model.config.pretrained_source["license"] == "apache-2.0"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16")
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}
    assert convert_fla_checkpoint(FLA / "delta_net", tmp_path / "f32", repo_id="a/b").config.pretrained_source[
        "license"] is None  # no README, no config license, not fla-hub: nothing is claimed


def test_sharded_checkpoint_and_command_line(tmp_path, converted):
    src = tmp_path / "sharded"
    shutil.copytree(FLA / "delta_net", src, ignore=shutil.ignore_patterns("model.safetensors"))
    state = load_file(FLA / "delta_net" / "model.safetensors")
    keys = sorted(state)
    weight_map = {}
    for i, part in enumerate((keys[: len(keys) // 2], keys[len(keys) // 2:])):
        name = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({k: state[k] for k in part}, src / name, metadata={"format": "pt"})
        weight_map.update({k: name for k in part})
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    convert_main(["--src_dir", str(src), "--output_dir", str(tmp_path / "out"), "--dtype", "float32"])
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    ids = converted["delta_net"][1]["input_ids"]
    with torch.no_grad():
        _close(model(ids).logits, converted["delta_net"][1]["prefill_logits"])


@pytest.mark.parametrize("field, value", [
    ("model_type", "mamba2"), ("use_beta", False), ("attn", {"layers": [1]}), ("hidden_act", "powlu"),
    ("qk_norm", "sum"), ("conv_bias", True),
])
def test_unsupported_fla_configs_are_refused(field, value):
    fla = json.loads((FLA / "delta_net" / "config.json").read_text())
    fla[field] = value
    with pytest.raises(ValueError, match=field):
        config_from_fla(fla)


def fused_qkv_layout(state):
    """A state dict in the layout before q_proj / k_proj / v_proj: one ``qkv_proj`` per layer (rows W_q, W_k, W_v)."""
    old = {}
    for key, value in state.items():
        if ".q_proj." in key:
            old[key.replace("q_proj", "qkv_proj")] = torch.cat([state[key.replace("q_proj", n)]
                                                                 for n in ("q_proj", "k_proj", "v_proj")])
        elif ".k_proj." not in key and ".v_proj." not in key:
            old[key] = value
    return old


def test_old_fused_qkv_checkpoints_load(tmp_path):
    """A state dict (load_state_dict) and a saved folder (from_pretrained) of the fused-qkv layout load and give the
    same logits; saving again writes the current layout."""
    model = tiny_model(seed=3)
    ids = torch.randint(3, 61, (2, 9), generator=torch.Generator().manual_seed(0))
    reloaded = tiny_model(seed=4)
    reloaded.load_state_dict(fused_qkv_layout(model.state_dict()))
    model.save_pretrained(tmp_path / "old")
    save_file(fused_qkv_layout(load_file(tmp_path / "old" / "model.safetensors")),
              tmp_path / "old" / "model.safetensors", metadata={"format": "pt"})
    from_folder = AutoModelForCausalLM.from_pretrained(tmp_path / "old").eval()
    from_folder.save_pretrained(tmp_path / "again")
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)
        assert torch.equal(from_folder(ids).logits, model(ids).logits)
    saved = load_file(tmp_path / "again" / "model.safetensors")
    assert "model.layers.0.fast_weight.q_proj.weight" in saved and not any("qkv_proj" in key for key in saved)


@pytest.mark.parametrize("repo_id, license_name", [("fla-hub/delta_net-tiny", "mit"), ("someone/model", "other")])
def test_card_of_a_converted_checkpoint_says_where_the_weights_came_from(tmp_path, repo_id, license_name):
    from model_cards.generator import card_for_folder, validate_card

    convert_fla_checkpoint(FLA / "delta_net", tmp_path, repo_id=repo_id)
    card = validate_card(card_for_folder(tmp_path))
    assert card.data.license == license_name and card.data.base_model == repo_id
    text = str(card)
    assert f"[`{repo_id}`](https://huggingface.co/{repo_id})" in text and "convert_fla_checkpoint" in text
    inferred = ("License: `mit`, not stated by the weights' repository; inferred from flash-linear-attention's code "
                "license (MIT)")
    assert (inferred in text) == (license_name == "mit")
    assert "as stated" not in text  # neither source states a license
    assert ("states no license" in text) == (license_name == "other")
    assert "causal depthwise convolution of width 4" in text and "RMSNorm(x)" in text


def test_license_stated_by_the_source_is_called_so(tmp_path):
    from model_cards.generator import card_for_folder

    src = tmp_path / "src"
    shutil.copytree(FLA / "delta_net", src)
    (src / "README.md").write_text("---\nlicense: apache-2.0\n---\n# a model\n")
    # the README wins over fla-hub's MIT
    convert_fla_checkpoint(src, tmp_path / "out", repo_id="fla-hub/delta_net-tiny")
    text = str(card_for_folder(tmp_path / "out"))
    assert "License: `apache-2.0`, as stated in the README of the weights' repository." in text
    assert "inferred" not in text


def test_convert_command_writes_the_model_card(tmp_path):
    """The README's command, run as a user would in a fresh interpreter (no model_cards imported beforehand): the
    folder has the card with its source section, and runpy gives no warning."""
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "converted"
    proc = subprocess.run(
        [sys.executable, "-m", "training.convert_fla", "--src_dir", str(FLA / "gated_deltanet"), "--output_dir",
         str(out), "--repo_id", "fla-hub/gated_deltanet-tiny"],
        cwd=root, capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "RuntimeWarning" not in proc.stderr
    card = (out / "README.md").read_text()
    assert "## Source of the weights" in card
    assert "[`fla-hub/gated_deltanet-tiny`](https://huggingface.co/fla-hub/gated_deltanet-tiny)" in card
    assert "License: `mit`, not stated by the weights' repository" in card
    assert isinstance(AutoModelForCausalLM.from_pretrained(out), GatedDeltaNetForCausalLM)
    old = subprocess.run([sys.executable, "-m", "modeling_fwp.convert_fla"], cwd=root, capture_output=True, text=True,
                         timeout=300)
    assert old.returncode != 0 and "fwp-convert-fla" in old.stderr  # the old module command points to the new one
