"""A real English -> X parallel corpus that installs offline: the gettext message catalogs of Debian packages.

No parallel corpus of the WMT kind installs here from the package indexes (pip, apt), but every Debian package that
is localised ships its translations as compiled gettext catalogs, ``/usr/share/locale/<lang>/LC_MESSAGES/*.mo``: the
English user-interface messages of the program (``msgid``) and a translator's rendering of each (``msgstr``). On this
machine's image the 86 German catalogs of 51 packages (postgresql, git, iso-codes, gtk, krb5, libc, glib, coreutils,
dpkg, xkb-data, gnupg, apt, ...) give 34,061 pairs under the rules below. The domain is software messages, not the
paper's news (Schlag et al. 2021 sec. 6.2 train on WMT14 En-De): short sentences, menu labels, error messages,
country, language and keyboard names, format strings such as ``%s``.

What is kept, stated here because it changes the corpus (``read_catalog_pairs``): single-line messages (no newline
or tab in either side); the ``msgctxt`` prefix of a message dropped; plural forms skipped; pairs whose translation
equals the source skipped (untranslated strings, not translations); for a message that several catalogs translate,
the first catalog in file-name order wins. ``build_splits`` then drops pairs longer than ``max_tokens`` BPE tokens on
either side (counted and reported, never truncated) and splits by a hash of the English text, so one English
message never lies in two splits.
"""
from __future__ import annotations

import gettext
import hashlib
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Dict, List, Sequence, Tuple

if TYPE_CHECKING:
    from tokenizers import Tokenizer

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]  # ids 0, 1, 2, 3: train_seq2seq's PAD, BOS, EOS


def read_catalog_pairs(locale_dir: str | Path, language: str) -> Tuple[List[Tuple[str, str]], Dict[str, int]]:
    """The (English, translation) pairs of every ``<locale_dir>/<language>/LC_MESSAGES/*.mo`` catalog.

    Returns the pairs in a fixed order (catalog file name, then message) and the number of pairs each catalog
    contributed. Raises ``ValueError`` when no catalog is found. Each catalog is decoded with the charset its header
    declares; one whose bytes do not decode with it (on this image net-tools' German catalog, labelled UTF-8, is
    Latin-1) is skipped and counted as -1 rather than guessed.
    """
    folder = Path(locale_dir) / language / "LC_MESSAGES"
    files = sorted(folder.glob("*.mo"))
    if not files:
        raise ValueError(f"no gettext catalog (*.mo) under {folder}: `locale_dir` / `language` name no installed "
                         "translations (Debian installs them with the localised packages)")
    seen, pairs, per_catalog = set(), [], {}
    for path in files:
        try:
            with open(path, "rb") as handle:
                catalog = gettext.GNUTranslations(handle)._catalog
        except (UnicodeDecodeError, OSError):
            per_catalog[path.stem] = -1
            continue
        count = 0
        for key, translation in sorted((k, v) for k, v in catalog.items() if isinstance(k, str)):
            source = key.split("\x04", 1)[-1]  # "context\x04message" -> message
            if (not source or not translation or source == translation or source in seen
                    or any(c in text for text in (source, translation) for c in "\n\t\r")):
                continue
            seen.add(source)
            pairs.append((source, translation))
            count += 1
        per_catalog[path.stem] = count
    return pairs, per_catalog


def split_of(source: str, valid_permille: int, test_permille: int) -> str:
    """"valid", "test" or "train", from a hash of the English text (stable across runs and machines)."""
    bucket = zlib.crc32(source.encode("utf-8")) % 1000
    return "valid" if bucket < valid_permille else "test" if bucket < valid_permille + test_permille else "train"


def train_bpe(texts: Sequence[str], vocab_size: int) -> Tokenizer:
    """A joint BPE (``tokenizers``) over both languages, as the paper's shared 32K BPE: ids 0..3 are
    ``SPECIAL_TOKENS``; Metaspace pre-tokenisation, so decoding gives back the text."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    tokenizer.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                                             show_progress=False))
    return tokenizer


@dataclass
class CorpusSplits:
    """Token-id pairs per split, the tokenizer, and what was dropped."""

    pairs: Dict[str, List[Tuple[List[int], List[int]]]]
    texts: Dict[str, List[Tuple[str, str]]]
    tokenizer: object
    manifest: Dict


def build_splits(locale_dir: str | Path, language: str, vocab_size: int, max_tokens: int,
                 valid_permille: int = 20, test_permille: int = 20) -> CorpusSplits:
    """Reads the catalogs, splits them, trains the BPE on the training split and encodes every pair.

    A pair longer than ``max_tokens`` tokens on either side (before EOS) is dropped from its split and counted in
    ``manifest["dropped_too_long"]``. The manifest also records the catalogs, the split sizes and a SHA-256 of the
    kept pairs, so two runs can be checked to use the same corpus.
    """
    if max_tokens < 1 or vocab_size <= len(SPECIAL_TOKENS):
        raise ValueError(f"need max_tokens >= 1 and vocab_size > {len(SPECIAL_TOKENS)}, got {max_tokens}, {vocab_size}")
    pairs, per_catalog = read_catalog_pairs(locale_dir, language)
    texts = {"train": [], "valid": [], "test": []}
    for source, target in pairs:
        texts[split_of(source, valid_permille, test_permille)].append((source, target))
    tokenizer = train_bpe([side for pair in texts["train"] for side in pair], vocab_size)
    encoded, dropped, digest = {}, {}, hashlib.sha256()
    for split, rows in texts.items():
        kept_texts, kept = [], []
        for source, target in rows:
            ids = (tokenizer.encode(source).ids, tokenizer.encode(target).ids)
            if max(len(ids[0]), len(ids[1])) <= max_tokens:
                kept.append(ids)
                kept_texts.append((source, target))
                digest.update(f"{split}\t{source}\t{target}\n".encode("utf-8"))
        dropped[split] = len(rows) - len(kept)
        encoded[split], texts[split] = kept, kept_texts
    manifest = {"source": f"{Path(locale_dir) / language / 'LC_MESSAGES'}/*.mo", "language_pair": f"en-{language}",
                "catalogs": per_catalog, "pairs_read": len(pairs), "max_tokens": max_tokens,
                "dropped_too_long": dropped, "sizes": {k: len(v) for k, v in encoded.items()},
                "vocab_size": tokenizer.get_vocab_size(), "sha256": digest.hexdigest()}
    return CorpusSplits(encoded, texts, tokenizer, manifest)
