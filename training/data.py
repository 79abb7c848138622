"""The embedded offline corpus: real Wikipedia articles from gensim's test data, as clean text splits.

gensim 4.4.0 ships a shortened enwiki dump (MediaWiki XML, about 105 articles) as test data. We only
read that file; gensim itself is never imported (it needs scipy). `prepare_wiki(out_dir)` writes

    out_dir/train.txt, valid.txt, test.txt   one document per block, blocks separated by one blank
                                             line; inside a block the first line is the title, then
                                             one paragraph, heading or list item per line (no blank
                                             lines inside a document). Files end with a blank line.
    out_dir/meta.json                        counts per split, seed, source file and its sha256.

That layout is what `datasets`' "text" loader reads as one example per document with
`sample_by="paragraph"` (see `load_wiki_splits`), or one example per line with the default
`sample_by="line"`.

CLI: `python -m training.data --output_dir data/wiki` (installed: `fwp-prepare-data`) (installs gensim with
pip --no-deps if it is missing).
"""

from __future__ import annotations

import bz2
import hashlib
import html
import json
import logging
import random
import re
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Iterator

from .packages import locate_data_package

if TYPE_CHECKING:
    from datasets import DatasetDict

logger = logging.getLogger(__name__)

GENSIM_REQUIREMENT = "gensim==4.4.0"
WIKI_DUMP_RELPATH = Path("test", "test_data", "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2")
SPLITS = ("train", "valid", "test")

# Sections that hold citations or link lists rather than prose; dropped with their subsections.
DROP_SECTIONS = frozenset(
    {
        "references", "external links", "see also", "further reading", "notes", "bibliography",
        "sources", "footnotes", "citations", "notes and references", "works cited", "literature",
    }
)


# --------------------------------------------------------------------------------------------------
# Locating the dump
# --------------------------------------------------------------------------------------------------


def ensure_gensim(install: bool = True) -> Path:
    """Return gensim's package folder (found with find_spec, never imported).

    If gensim is missing and `install` is True, run `sys.executable -m pip install --no-deps
    gensim==4.4.0` first. Raises ModuleNotFoundError if it is missing and `install` is False, and
    RuntimeError if pip fails.
    """
    return locate_data_package("gensim", [GENSIM_REQUIREMENT], "the Wikipedia dump used as offline corpus", install)


def find_wiki_dump(install: bool = False) -> Path:
    """Path of gensim's shortened enwiki dump (`.xml.bz2`).

    `install=True` pip-installs gensim (no deps) when it is missing; otherwise a missing gensim raises
    ModuleNotFoundError and a gensim without the file raises FileNotFoundError.
    """
    path = ensure_gensim(install=install) / WIKI_DUMP_RELPATH
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: this gensim does not ship the test dump; install {GENSIM_REQUIREMENT}"
        )
    return path


def iter_wiki_pages(path: str | Path) -> Iterator[tuple[str, str]]:
    """Yield (title, wikitext) for each article of a MediaWiki XML dump (`.bz2` or plain).

    Skips redirects and pages outside the main namespace (ns 0). Streams with iterparse.
    """
    path = Path(path)
    opener = bz2.open if path.suffix == ".bz2" else open
    with opener(path, "rb") as f:
        for _, elem in ET.iterparse(f, events=("end",)):
            if elem.tag.rsplit("}", 1)[-1] != "page":
                continue
            title = elem.findtext("{*}title") or ""
            ns = (elem.findtext("{*}ns") or "0").strip()
            text = elem.findtext("{*}revision/{*}text") or ""
            is_redirect = elem.find("{*}redirect") is not None or text.lstrip()[:9].upper() == "#REDIRECT"
            elem.clear()
            if ns == "0" and not is_redirect and text.strip():
                yield title, text


# --------------------------------------------------------------------------------------------------
# Wikitext -> prose
# --------------------------------------------------------------------------------------------------

_COMMENT = re.compile(r"<!--.*?(?:-->|\Z)", re.S)
_NOWIKI = re.compile(r"<nowiki\s*/?>|</nowiki\s*>", re.I)
_REF_SELF_CLOSING = re.compile(r"<ref\b[^>]*?/\s*>", re.I)
_REF = re.compile(r"<ref\b[^>]*>.*?</ref\s*>", re.I | re.S)
_NON_PROSE_TAGS = (
    "math|chem|ce|gallery|timeline|imagemap|score|hiero|graph|syntaxhighlight|source|references"
    "|templatedata|mapframe|categorytree|inputbox"
)
_NON_PROSE_BLOCK = re.compile(rf"<({_NON_PROSE_TAGS})\b[^>]*>.*?</\1\s*>", re.I | re.S)
_NON_PROSE_SELF_CLOSING = re.compile(rf"<(?:{_NON_PROSE_TAGS})\b[^>]*?/\s*>", re.I)
_BR = re.compile(r"<br\s*/?\s*>", re.I)
_HTML_TAG = re.compile(r"</?[A-Za-z][A-Za-z0-9]*\b[^<>]*>")
_INNER_LINK = re.compile(r"\[\[((?:[^\[\]]|\[(?!\[)|\](?!\]))*)\]\]")  # single brackets allowed inside
_INNER_TEMPLATE = re.compile(r"\{\{([^{}]*)\}\}")
_TEMPLATE_PARAM = re.compile(r"\{\{\{[^{}]*\}\}\}")
_EXTERNAL_LINK = re.compile(r"\[(?:https?:|ftp:)?//[^\s\]]*(?:\s+([^\]]*))?\]")
_BARE_URL = re.compile(r"https?://[^\s<>\]|]+")
_QUOTES = re.compile(r"'{2,}")
_HEADING = re.compile(r"^(={1,6})\s*(.*?)\s*\1\s*$")
_LIST_MARKER = re.compile(r"^[*#:;]+\s*")
_MAGIC_WORD = re.compile(r"__[A-Z]+__")
_EMPTY_PARENS = re.compile(r"\(\s*(?:[,;:]\s*)*\)")
# Separators a removed template leaves at the edge of parentheses: "({{IPA|..}}; born 1947)" -> "(; born 1947)".
_PAREN_LEADING_SEPARATORS = re.compile(r"\(\s*(?:[,;:]\s*)+")
_PAREN_TRAILING_SEPARATORS = re.compile(r"\s*(?:[,;:]\s*)+\)")
_SPACES = re.compile(r"[ \t\u00a0\u2002\u2003\u2009\u202f]+")
_SPACE_BEFORE_PUNCT = re.compile(r" +([,.;:!?)\]])")
_SPACE_AFTER_OPEN = re.compile(r"([(\[]) +")

_DROPPED_LINK_PREFIXES = frozenset({"file", "image", "media", "category"})
_INTERWIKI = re.compile(r"^[a-z]{2,3}(?:-[a-z]{2,8})*$")  # interlanguage prefixes: de, fr, zh-yue
_DASH_TEMPLATES = {"ndash": "–", "mdash": "—", "snd": " – ", "spaced ndash": " – ", "spnd": " – ", "'": "'",
                   "nbsp": " "}
_FIRST_ARG_TEMPLATES = frozenset(
    {"nowrap", "nobr", "nobreak", "small", "smaller", "big", "sic", "not a typo", "bold", "em", "strong",
     "keep together", "math", "mvar", "var", "sub", "sup", "linktext", "visible anchor", "vanchor", "smallcaps"}
)
_JOIN_ARGS_TEMPLATES = frozenset({"chem", "chem2", "chemf", "ce"})
_RANGE_WORDS = frozenset({"to", "-", "–", "and", "or", "by", "x", "×", "&"})


def _render_link(inner: str) -> str:
    """Text of an internal link `[[inner]]`: the label, or "" for files, categories, interlanguage."""
    target, _, label = inner.partition("|")
    target = target.strip()
    leading_colon = target.startswith(":")
    target = target.lstrip(":").strip()
    prefix, colon, _ = target.partition(":")
    if colon and not leading_colon:
        key = prefix.strip().lower()
        if key in _DROPPED_LINK_PREFIXES or _INTERWIKI.match(key):
            return ""
    if label.strip():
        # Everything after the first pipe: it may hold a template whose own pipes must survive.
        return label.strip()
    page, _, anchor = target.partition("#")
    return page.strip() or anchor.strip()


def _render_template(inner: str) -> str:
    """Text of a template `{{inner}}` whose arguments are already plain: kept for a few inline ones."""
    parts = [p.strip() for p in inner.split("|")]
    name = parts[0].replace("_", " ").strip().lower()
    positional = [p for p in parts[1:] if "=" not in p]
    if name in _DASH_TEMPLATES:
        return _DASH_TEMPLATES[name]
    if name in _FIRST_ARG_TEMPLATES:
        return positional[0] if positional else ""
    if name in _JOIN_ARGS_TEMPLATES:
        return "".join(positional)
    if name in ("convert", "cvt") and len(positional) >= 2:
        if positional[1].lower() in _RANGE_WORDS and len(positional) >= 4:
            return " ".join(positional[:4])
        return f"{positional[0]} {positional[1]}"
    if name == "lang" and len(positional) >= 2:
        return positional[1]
    if name.startswith("lang-") and positional:
        return positional[0]
    if name == "transl" and positional:
        return positional[-1]
    if name in ("circa", "c.") and positional:
        return f"c. {positional[0]}"
    if name == "as of" and positional:
        return "As of " + " ".join(positional[:3])
    if name in ("frac", "fraction") and positional:
        if len(positional) == 3:
            return f"{positional[0]} {positional[1]}/{positional[2]}"
        if len(positional) == 2:
            return f"{positional[0]}/{positional[1]}"
        return f"1/{positional[0]}"
    return ""


def _remove_tables(text: str) -> str:
    """Drop MediaWiki tables (`{|` ... `|}` at line starts), nested ones included."""
    lines = text.split("\n")
    drop = [False] * len(lines)
    stack: list[int] = []
    for i, line in enumerate(lines):
        stripped = line.lstrip(" :")
        if stripped.startswith("{|"):
            stack.append(i)
        elif stack and stripped.startswith("|}"):
            start = stack.pop()
            if not stack:
                for j in range(start, i + 1):
                    drop[j] = True
    for start in stack:  # unterminated table: drop its opening line only
        drop[start] = True
    return "\n".join(line for line, d in zip(lines, drop) if not d)


def _strip_templates_and_tables(text: str) -> str:
    """Remove templates (nested, innermost first) and tables until neither changes the text."""
    text = _TEMPLATE_PARAM.sub("", text)
    while True:
        before = text
        while True:
            new = _INNER_TEMPLATE.sub(lambda m: _render_template(m.group(1)), text)
            if new == text:
                break
            text = new
        text = _remove_tables(text)
        if text == before:
            return text


def _strip_links(text: str) -> str:
    """Replace internal links by their text, innermost first (captions inside file links)."""
    while True:
        new = _INNER_LINK.sub(lambda m: _render_link(m.group(1)), text)
        if new == text:
            return new
        text = new


def _clean_line(line: str) -> str:
    line = _LIST_MARKER.sub("", line.strip())
    line = _MAGIC_WORD.sub("", line)
    line = _SPACES.sub(" ", line)
    line = _EMPTY_PARENS.sub("", line)
    line = _PAREN_LEADING_SEPARATORS.sub("(", line)
    line = _PAREN_TRAILING_SEPARATORS.sub(")", line)
    line = _SPACES.sub(" ", line)
    line = _SPACE_BEFORE_PUNCT.sub(r"\1", line)
    line = _SPACE_AFTER_OPEN.sub(r"\1", line)
    return line.strip()


def clean_wikitext(text: str, drop_sections: Iterable[str] = DROP_SECTIONS) -> str:
    """Turn MediaWiki markup into plain prose: one paragraph, heading or list item per line.

    Removes comments, <ref>s, math/gallery-like blocks, templates `{{...}}` (nested; a few inline
    ones such as convert, lang, nowrap keep their text), tables `{|...|}`, file/image/category and
    interlanguage links, html tags and bold/italic quotes; `[[target|label]]` becomes `label`,
    `[url label]` becomes `label`, entities such as `&nbsp;` are decoded, headings `== X ==` become
    the line `X`. Sections whose heading (case-insensitive) is in `drop_sections` are removed with
    their subsections. The result has no blank lines and no trailing whitespace.
    """
    if not isinstance(text, str):
        raise TypeError(f"clean_wikitext: text must be a str, got {type(text).__name__}")
    drop = {s.lower() for s in drop_sections}
    text = _COMMENT.sub("", text)
    text = _NOWIKI.sub("", text)
    text = _REF_SELF_CLOSING.sub("", text)
    text = _REF.sub("", text)
    text = _NON_PROSE_BLOCK.sub("", text)
    text = _NON_PROSE_SELF_CLOSING.sub("", text)
    text = _strip_links(text)
    text = _strip_templates_and_tables(text)
    text = _EXTERNAL_LINK.sub(lambda m: m.group(1) or "", text)
    text = _BARE_URL.sub("", text)
    text = _BR.sub(" ", text)
    text = _HTML_TAG.sub("", text)
    text = html.unescape(text)
    text = text.replace("\u200b", "").replace("\ufeff", "")

    out: list[tuple[int, str]] = []  # (heading level or 0 for text, line)
    skip_level = 0  # >0 while inside a dropped section of that heading level
    for raw in text.split("\n"):
        heading = _HEADING.match(raw.strip())
        if heading:
            level, title = len(heading.group(1)), _clean_line(_QUOTES.sub("", heading.group(2)))
            if skip_level and level > skip_level:
                continue
            skip_level = level if title.lower() in drop else 0
            if not skip_level and title:
                out.append((level, title))
            continue
        if skip_level:
            continue
        stripped = raw.strip()
        if stripped.startswith(("|", "!", "{{", "}}", "----")):  # leftovers of broken tables/templates
            continue
        # An unbalanced template (e.g. one holding the characters "{|}") is cut from "{{" on.
        raw = raw.split("{{", 1)[0].replace("}}", "")
        line = _clean_line(_QUOTES.sub("", raw))
        if any(ch.isalnum() for ch in line):
            out.append((0, line))
    return "\n".join(line for i, (level, line) in enumerate(out) if not level or _section_has_text(out, i))


def _section_has_text(lines: list[tuple[int, str]], i: int) -> bool:
    """True if the heading at `i` is followed by text before the next heading of its level or above."""
    level = lines[i][0]
    for next_level, _ in lines[i + 1:]:
        if next_level == 0:
            return True
        if next_level <= level:
            return False
    return False


# --------------------------------------------------------------------------------------------------
# Splits
# --------------------------------------------------------------------------------------------------


def split_documents(
    titles: Iterable[str], seed: int = 0, valid_fraction: float = 0.05, test_fraction: float = 0.05,
    min_eval_docs: int = 3,
) -> dict[str, list[str]]:
    """Assign whole documents to train/valid/test by a seeded shuffle of the sorted, unique titles.

    valid and test get `max(min_eval_docs, round(fraction * n))` documents each; train the rest.
    Deterministic for the same titles and seed, whatever their input order. Raises ValueError if
    there are too few documents for a non-empty train split.
    """
    unique = sorted(set(titles))
    if not (0 <= valid_fraction < 1 and 0 <= test_fraction < 1):
        raise ValueError(f"valid_fraction and test_fraction must be in [0, 1), got {valid_fraction}, {test_fraction}")
    n = len(unique)
    n_valid = max(min_eval_docs, round(valid_fraction * n))
    n_test = max(min_eval_docs, round(test_fraction * n))
    if n_valid + n_test >= n:
        raise ValueError(f"{n} documents are too few for {n_valid} valid + {n_test} test documents and a train split")
    random.Random(seed).shuffle(unique)
    return {
        "valid": sorted(unique[:n_valid]),
        "test": sorted(unique[n_valid:n_valid + n_test]),
        "train": sorted(unique[n_valid + n_test:]),
    }


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def prepare_wiki(
    out_dir: str | Path, seed: int = 0, min_chars: int = 200, install: bool = True, dump: str | Path | None = None,
) -> dict[str, Path]:
    """Clean the embedded Wikipedia dump and write train/valid/test .txt files plus meta.json.

    Documents with fewer than `min_chars` characters of clean text are skipped. `dump` overrides the
    gensim file (any MediaWiki XML dump, .bz2 or plain). Returns {"train", "valid", "test", "meta"}
    -> path. Re-running with the same inputs writes identical files.
    """
    out_dir = Path(out_dir)
    dump = Path(dump) if dump is not None else find_wiki_dump(install=install)
    start = time.perf_counter()
    documents: dict[str, str] = {}
    n_pages = 0
    for title, wikitext in iter_wiki_pages(dump):
        n_pages += 1
        body = clean_wikitext(wikitext)
        if len(body) >= min_chars:
            documents[title] = f"{title.strip()}\n{body}"
    if not documents:
        raise ValueError(f"{dump}: no article with at least {min_chars} characters of text")
    splits = split_documents(documents, seed=seed)

    out_dir.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    counts: dict[str, dict[str, int]] = {}
    for name in SPLITS:
        docs = [documents[t] for t in splits[name]]
        path = out_dir / f"{name}.txt"
        path.write_text("".join(doc + "\n\n" for doc in docs), encoding="utf-8")
        paths[name] = path
        counts[name] = {
            "documents": len(docs),
            "lines": sum(doc.count("\n") + 1 for doc in docs),
            "words": sum(len(doc.split()) for doc in docs),
            "characters": sum(len(doc) for doc in docs),
        }
    meta = {
        "source": str(dump),
        "source_sha256": _sha256(dump),
        "pages_read": n_pages,
        "documents_kept": len(documents),
        "min_chars": min_chars,
        "seed": seed,
        "format": "one document per block (title line, then one paragraph per line), blocks separated by a blank line",
        "splits": counts,
        "titles": splits,
    }
    paths["meta"] = out_dir / "meta.json"
    paths["meta"].write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    logger.info("wrote %s in %.1f s: %s", out_dir, time.perf_counter() - start,
                ", ".join(f"{k} {v['documents']} docs / {v['words']} words" for k, v in counts.items()))
    return paths


def load_wiki_splits(data_dir: str | Path, by: str = "paragraph") -> DatasetDict:
    """Load the prepared splits with datasets' "text" loader (offline): a DatasetDict with "text".

    `by="paragraph"` gives one example per document (blocks are separated by blank lines);
    `by="line"` one per line.
    """
    import os

    from datasets import load_dataset

    data_dir = Path(data_dir)
    files = {name: str(data_dir / f"{name}.txt") for name in SPLITS}
    missing = [f for f in files.values() if not Path(f).is_file()]
    if missing:
        raise FileNotFoundError(f"missing {missing}; run `python -m training.data --output_dir {data_dir}` first")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    return load_dataset("text", data_files=files, sample_by=by)


@dataclass
class PrepareArguments:
    """Where the corpus goes and how its documents are split."""

    output_dir: str = field(default="data/wiki", metadata={"help": "output folder"})
    seed: int = field(default=0, metadata={"help": "seed of the document split"})
    min_chars: int = field(default=200, metadata={"help": "skip shorter documents"})
    no_install: bool = field(default=False, metadata={"help": "fail instead of pip-installing gensim"})


def main(argv: list[str] | None = None) -> dict[str, Path]:
    from .arguments import parse_arguments

    args = parse_arguments((PrepareArguments,), argv, description=__doc__)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    paths = prepare_wiki(args.output_dir, seed=args.seed, min_chars=args.min_chars, install=not args.no_install)
    for name, path in paths.items():
        print(f"{name:6s} {path}")
    return paths


if __name__ == "__main__":
    main()
