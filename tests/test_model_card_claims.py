"""Model cards say what is true of the model and the run (issue 21, item 8): a card is generated from a saved folder
of each family of the table and its claims are checked against the model: the measured generation cache (constant for
the fast-weight states, the base's growing key/value cache inside the FWL's), the base model as recorded when it was
loaded (not a folder of the machine it was loaded on), an instruction-tuned base named as such, the loading lines,
and the training and evaluation files as the run used them."""
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import model_cards
import modeling_fwp
from model_cards.generator import _bytes
from modeling_fwp import FWLForCausalLM
from modeling_fwp.families import FAMILIES, FamilySpec

from conftest import make_word_tokenizer, tiny_config

TINY_LLAMA = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
LENGTHS = (8, 48)  # prompt lengths the cache is measured at (the cards of real runs: 16 and 256)
MEM_LEN = 32  # Transformer-XL's memory: between the two measured prompt lengths, so the card must say it is bounded


def _tiny_model(spec: FamilySpec):
    torch.manual_seed(0)
    if spec.model_class is None:  # the FWL head on a causal LM with a key/value cache
        return FWLForCausalLM.from_base_pretrained(LlamaForCausalLM(LlamaConfig(**TINY_LLAMA))).eval()
    extra = {"mem_len": MEM_LEN} if "mem_len" in spec.config_class.__dataclass_fields__ else {}
    return spec.causal_lm_class(tiny_config(spec.config_class, **extra)).eval()


def _cache_after(model, length: int):
    out = model(input_ids=torch.randint(61, (1, length)), use_cache=True)
    return out.get("cache", None) or out.get("past_key_values", None)


@pytest.mark.parametrize("spec", FAMILIES, ids=lambda spec: spec.name)
def test_card_cache_claim_is_measured(spec, tmp_path):
    model = _tiny_model(spec)
    model.save_pretrained(tmp_path)
    make_word_tokenizer().save_pretrained(tmp_path)
    # the card save_pretrained writes (model_cards is imported) neither reloads nor runs the model: no cache claim
    assert "Generation cache" not in (tmp_path / "README.md").read_text()
    card = model_cards.validate_card(model_cards.card_for_folder(tmp_path, cache_prompt_lengths=LENGTHS))
    text = " ".join(card.text.split())
    short, long = LENGTHS
    with torch.no_grad():
        caches = {n: _cache_after(model, n) for n in (short, long)}
    if isinstance(caches[short], modeling_fwp.TransfoXLCache):  # memories up to mem_len
        assert caches[long].memory_length() == MEM_LEN > caches[short].memory_length() == short
        assert f"it grows with the context until it holds `mem_len` = {MEM_LEN} positions per layer" in text
    elif isinstance(caches[short], modeling_fwp.FastWeightCache):  # the fast-weight families: a recurrent state
        sizes = {n: cache.nbytes() for n, cache in caches.items()}
        assert sizes[short] == sizes[long]
        assert f"{_bytes(sizes[short])} after {short} prompt tokens, {_bytes(sizes[long])} after {long}" in text
        assert "constant size" in text.split("Generation cache, measured")[1]
    else:  # the FWL: the base's key/value cache is inside its cache, so it grows
        assert isinstance(caches[short], modeling_fwp.FWLCache)
        assert caches[long].base_cache.get_seq_length() == long
        assert "it grows with the context: besides the FWL's state it holds the base model's key/value cache" in text
        assert "constant size" not in text
    assert 'AutoTokenizer.from_pretrained("path/to/this/folder", trust_remote_code=True)' in text
    no_claim = model_cards.card_for_folder(tmp_path, measure=False)
    assert "Generation cache, measured" not in no_claim.text


def _fwl_on_saved_base(folder, monkeypatch, **recorded):
    """An FWL put on a tiny Llama saved in `folder` (its config.json carrying `recorded`), loaded by a relative path
    from folder's parent as finetune_fwl loads ``checkpoints/smollm2-135m``."""
    config = LlamaConfig(**TINY_LLAMA, **recorded)
    LlamaForCausalLM(config).save_pretrained(folder)
    monkeypatch.chdir(folder.parent)
    return FWLForCausalLM.from_base_pretrained(folder.name)


@pytest.mark.parametrize("recorded, base_model", [
    ({"source_model_id": "HuggingFaceTB/SmolLM2-135M-Instruct"}, "HuggingFaceTB/SmolLM2-135M-Instruct"),
    ({}, None),  # a local folder that records no Hub id: no base_model, and no link made of the folder's name
])
def test_fwl_card_names_the_base_as_recorded_at_load_time(recorded, base_model, tmp_path, monkeypatch):
    (tmp_path / "run").mkdir()
    model = _fwl_on_saved_base(tmp_path / "run" / "smollm2-135m", monkeypatch, **recorded)
    assert model.config.base_model_id == base_model
    model.save_pretrained(tmp_path / "fwl")
    monkeypatch.chdir(tmp_path)  # the card is made elsewhere: where "smollm2-135m" is no folder
    card = model_cards.card_for_folder(tmp_path / "fwl", measure=False)
    text = " ".join(card.text.split())
    assert card.data.base_model == base_model
    assert "huggingface.co/smollm2-135m" not in text and "huggingface.co/run" not in text
    if base_model:  # SmolLM2-135M-Instruct is instruction-tuned: the card says so, not that it had no such tuning
        assert f"Its base model is instruction-tuned (`{base_model}`)" in text
        assert "It has had no instruction tuning" not in text
    else:
        assert "its Hub id was not recorded" in text and "It has had no instruction tuning" in text


def test_instruction_tuned_names():
    from model_cards.generator import instruction_tuned_name

    for name in ("HuggingFaceTB/SmolLM2-135M-Instruct", "meta-llama/Llama-2-7b-chat-hf", "google/gemma-2b-it",
                 "HuggingFaceH4/zephyr-7b-sft-full"):
        assert instruction_tuned_name(None, name) == name
    for name in ("HuggingFaceTB/SmolLM2-135M", "openai-community/gpt2", "EleutherAI/pythia-70m", "itsme/italian-gpt2"):
        assert instruction_tuned_name(name) is None


def test_card_names_the_training_and_evaluation_files_as_used(tmp_path):
    """finetune_fwl's results: the training table names the training file, the evaluation the validation file."""
    model = _tiny_model(next(spec for spec in FAMILIES if spec.model_class is None))
    model.save_pretrained(tmp_path)
    stage = {"nll": 3.0, "ppl": 20.09, "tokens": 500}
    results = {
        "base": stage, "base_finetuned": stage, "base_fwl": stage,
        "settings": {"model_name_or_path": "checkpoints/smollm2-135m", "train_file": "data/wiki/train.txt",
                     "validation_file": "data/wiki/valid.txt", "block_size": 64, "max_steps": 3},
    }
    card = model_cards.validate_card(model_cards.card_for_folder(tmp_path, results, measure=False))
    assert "| `train_file` | data/wiki/train.txt |" in card.text
    assert "| `validation_file` | data/wiki/valid.txt |" in card.text
    assert {r.dataset_type for r in card.data.eval_results} == {"valid.txt"}
    assert card.data.base_model is None  # the settings' base path is not a Hub id
