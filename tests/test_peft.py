"""PEFT LoRA on our models: the projection names transformers users type (``q_proj``, ``v_proj``) and "all-linear"
reach the fast-weight layers of every family (``modeling_fwp.families.FAMILIES``: Linear Transformer, Delta Net, Gated
DeltaNet, the five recurrent FWPs, Transformer-XL, the FWL head on a causal LM); after a training step the adapter
changes the logits, and merging, unmerging, disabling, saving and loading the adapter, and merge-and-unload, all give
the logits they should."""
import pytest
import torch
from torch import nn

peft = pytest.importorskip("peft")
from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402

from modeling_fwp import FWLConfig  # noqa: E402
from modeling_fwp.families import FAMILIES  # noqa: E402

from conftest import tiny_model  # noqa: E402
from test_fwl import random_ids, tiny_fwl  # noqa: E402

# every family, tiny: the FWL head on a tiny Delta Net, the others from conftest.tiny_config
MODELS = {spec.name: (lambda cls=spec.config_class: tiny_model(cls, seed=0))
          for spec in FAMILIES if spec.config_class is not FWLConfig}
MODELS["fwl"] = lambda: tiny_fwl("delta_net", seed=0)
# the names users type for transformers models, on the families whose layers have them
CASES = [(name, ["q_proj", "v_proj"]) for name in ("linear_transformer", "delta_net", "gated_delta_net", "fwl")] + [
    (name, "all-linear") for name in MODELS
]
ATOL = 1e-5  # float32: merged W + BA against W x + B(A x)


def _train_step(model, ids):
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-2)
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    model.eval()


def _lora_modules(model):
    return {name.removeprefix("base_model.model.") for name, module in model.named_modules()
            if hasattr(module, "lora_A") and not isinstance(module, nn.ModuleDict)}


@pytest.mark.parametrize("name, targets", CASES, ids=lambda x: x if isinstance(x, str) else "+".join(x))
def test_lora_train_merge_unmerge_save_load(name, targets, tmp_path):
    base = MODELS[name]()
    linear = {n for n, m in base.named_modules() if isinstance(m, nn.Linear)}
    ids = random_ids(2, 10)
    with torch.no_grad():
        base_logits = base(ids).logits
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets))
    wrapped = _lora_modules(model)
    if targets == "all-linear":  # every projection but the output layer
        output = {n for n, m in base.named_modules() if m is base.get_output_embeddings()}
        assert wrapped == linear - output, sorted(linear - output - wrapped)
        # the output layer is never adapted (Transformer-XL's adaptive softmax has no single output embedding)
        assert not {n for n in wrapped if n.split(".")[0] == "lm_head"}, sorted(wrapped)
        layers = {n for n in wrapped if ".layers." in n}  # each block's own projections are adapted
        assert {n.split(".layers.")[1].split(".")[0] for n in layers} == {"0", "1"}, sorted(wrapped)
    else:
        assert wrapped and {n.rsplit(".", 1)[-1] for n in wrapped} == set(targets)
    _train_step(model, ids)
    with torch.no_grad():
        adapted = model(ids).logits
        assert (adapted - base_logits).abs().max() > 1e-3  # the adapters take part in the forward pass
        model.merge_adapter()
        torch.testing.assert_close(model(ids).logits, adapted, rtol=0, atol=ATOL)
        model.unmerge_adapter()
        torch.testing.assert_close(model(ids).logits, adapted, rtol=0, atol=ATOL)
        with model.disable_adapter():
            torch.testing.assert_close(model(ids).logits, base_logits, rtol=0, atol=ATOL)
    model.save_pretrained(tmp_path)
    loaded = PeftModel.from_pretrained(MODELS[name](), tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, adapted, rtol=0, atol=ATOL)
        merged = loaded.merge_and_unload()
        assert not _lora_modules(merged)
        torch.testing.assert_close(merged(ids).logits, adapted, rtol=0, atol=ATOL)
