"""training.carried_state_curve: each segment's loss with the state carried and from an empty state, checked against
a full-sequence forward (carried) and the segment alone (empty)."""
from __future__ import annotations

import json

import pytest
import torch

from modeling_fwp import RecurrentDeltaNetConfig
from tests.conftest import tiny_model
from training import carried_state_curve


@torch.no_grad()
def test_segment_losses_equal_one_forward_and_the_segments_alone():
    model = tiny_model(RecurrentDeltaNetConfig).eval()
    ids = torch.randint(3, 61, (45,), generator=torch.Generator().manual_seed(0))
    losses = carried_state_curve.segment_losses(model, ids, 16)
    assert len(losses["carried"]) == len(losses["empty"]) == 3  # 44 predicted tokens: 16 + 16 + 12
    per_token = torch.nn.functional.cross_entropy(model(input_ids=ids[None, :-1]).logits[0], ids[1:],
                                                  reduction="none")
    for i, start in enumerate(range(0, 44, 16)):
        assert losses["carried"][i] == pytest.approx(float(per_token[start : start + 16].mean()), rel=1e-5)
        alone = model(input_ids=ids[None, start : min(start + 16, 44)]).logits[0]
        expected = torch.nn.functional.cross_entropy(alone, ids[start + 1 : start + 1 + alone.shape[0]])
        assert losses["empty"][i] == pytest.approx(float(expected), rel=1e-5)
    assert losses["carried"][0] == losses["empty"][0] and losses["carried"][1] != losses["empty"][1]


def test_doubling_buckets():
    losses = {"carried": [1.0, 2.0, 3.0, 5.0, 4.0, 4.0], "empty": [1.0, 1.0, 1.0, 1.0, 2.0, 2.0]}
    buckets = carried_state_curve.doubling_buckets(losses)
    assert [b["segments"] for b in buckets] == [[0, 0], [1, 1], [2, 3], [4, 5]]
    assert [b["difference"] for b in buckets] == [0.0, 1.0, 3.0, 2.0]


def test_main_writes_a_results_file(tmp_path):
    model = tiny_model(RecurrentDeltaNetConfig)
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<eos>"] + [f"w{i}" for i in range(60)]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>")
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "valid.txt").write_text("w1 w2 w3 w4 w5 w6 w7\n\nw8 w9 w10 w11 w12 w13 w14 w15 w16\n")
    out = carried_state_curve.main(["--models", str(tmp_path / "model"), "--data_dir", str(tmp_path / "data"),
                                    "--segment_length", "4", "--output", str(tmp_path / "curve.json")])
    saved = json.loads((tmp_path / "curve.json").read_text())
    result = saved["models"][str(tmp_path / "model")]
    assert result["tokens"] == 18 and len(result["segments"]["carried"]) == 5  # 17 predicted tokens
    assert saved["run"]["command"].startswith("python -m training.carried_state_curve")
    assert out["models"][str(tmp_path / "model")]["buckets"] == result["buckets"]
    with pytest.raises(ValueError, match="--split"):
        carried_state_curve.main(["--models", "x", "--split", "train"])
