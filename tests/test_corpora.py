"""The R serialization reader (training.rdata_reader) and the Jane Austen corpus (training.corpora), offline: the
real janeaustenr index (an R-written .rdx, 262 bytes) and a tiny lazy-load database written here in R's XDR format."""

import gzip
import struct
import sys
import zlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from training.corpora import NOVELS, chapters, prepare_austen, split_of_chapter  # noqa: E402
from training.rdata_reader import data_frame_columns, read_lazy_load, read_rds, unserialize  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures" / "janeaustenr"
HAS_ATTR, HAS_TAG = 1 << 9, 1 << 10


# A writer of the R XDR items the reader supports (R Internals, "Serialization Formats"), for fixtures only.
def _int(v):
    return struct.pack(">i", v)


def _char(s):
    if s is None:
        return _int(9) + _int(-1)
    raw = s.encode()
    return _int(9 | (1 << 15)) + _int(len(raw)) + raw  # CHARSXP, UTF-8 flag in the levels


def _attrs(attributes):
    out = b""
    for name, value in attributes.items():  # pairlist of tagged cells (first cell's symbol, then by reference)
        out += _int(2 | HAS_TAG) + _int(1) + _char(name) + value
    return out + _int(254)


def _vector(kind, items, attributes=None):
    flags = kind | (HAS_ATTR if attributes else 0)
    if kind in (10, 13):
        body = b"".join(_int(v) for v in items)
    elif kind == 14:
        body = b"".join(struct.pack(">d", v) for v in items)
    elif kind == 16:
        body = b"".join(_char(s) for s in items)
    else:
        body = b"".join(items)
    return _int(flags) + _int(len(items)) + body + (_attrs(attributes) if attributes else b"")


def _serialize(item, version=3):
    header = b"X\n" + _int(version) + _int(0x40201) + _int(0x30500)
    if version == 3:
        header += _int(5) + b"UTF-8"
    return header + item


def write_lazy_load(folder, objects):
    """``<folder>/Rdata.rdx`` and ``.rdb`` holding `objects` ({name: serialized item}), as R's makeLazyLoadDB."""
    blob, offsets = b"", []
    for item in objects.values():
        data = _serialize(item)
        chunk = struct.pack(">I", len(data)) + zlib.compress(data)
        offsets.append(_vector(13, [len(blob), len(chunk)]))
        blob += chunk
    variables = _vector(19, offsets, {"names": _vector(16, list(objects))})
    index = _vector(19, [variables, _vector(19, []), _vector(10, [1])],
                    {"names": _vector(16, ["variables", "references", "compressed"])})
    (folder / "Rdata.rdb").write_bytes(blob)
    (folder / "Rdata.rdx").write_bytes(gzip.compress(_serialize(index, version=2)))
    return folder / "Rdata.rdx"


NOVEL_LINES = [
    "Title", "", "by", "Jane Austen", "", "VOLUME I", "", "CHAPTER I", "", "It is a truth universally",
    "acknowledged, that a single man.", "", '"My dear," said his lady', "", "Chapter 2", "", "Mr. Bennet was",
    "among the  earliest.", None,
]


def test_real_janeaustenr_index():
    """The index R wrote for janeaustenr (gzip, XDR version 3, pairlist attributes, a names attribute)."""
    index = read_rds(FIXTURES / "real_Rdata.rdx")
    names = index.attributes["names"].value
    assert names == ["variables", "references", "compressed"]
    variables = index.value[0]
    assert variables.attributes["names"].value == sorted(NOVELS)
    offsets = [v.value for v in variables.value]
    assert offsets[0][0] == 0 and all(a[0] + a[1] == b[0] for a, b in zip(offsets, offsets[1:]))


def test_reader_vectors_and_data_frame(tmp_path):
    """Integers with NA, reals, strings with NA and a factor column of a data.frame, through a lazy-load database."""
    factor = _vector(13, [2, 1, -(2**31)], {"levels": _vector(16, ["a", "b"]), "class": _vector(16, ["factor"])})
    frame = _vector(19, [_vector(16, ["x", None, "zé"]), factor], {"names": _vector(16, ["text", "book"])})
    rdx = write_lazy_load(tmp_path, {"frame": frame, "reals": _vector(14, [1.5, -2.0])})
    objects = read_lazy_load(rdx)
    assert data_frame_columns(objects["frame"]) == {"text": ["x", None, "zé"], "book": ["b", "a", None]}
    assert objects["reals"].value == [1.5, -2.0]
    assert read_lazy_load(rdx, "reals")["reals"].value == [1.5, -2.0]
    with pytest.raises(KeyError, match="frame"):
        read_lazy_load(rdx, "missing")
    with pytest.raises(ValueError, match="XDR"):
        unserialize(b"A\n" + _int(3))


def test_chapters():
    docs = chapters(NOVEL_LINES, "Pride and Prejudice")
    assert docs == [
        "Pride and Prejudice, Chapter I\nIt is a truth universally acknowledged, that a single man.\n"
        "\"My dear,\" said his lady",
        "Pride and Prejudice, Chapter 2\nMr. Bennet was among the earliest.",
    ]


def test_prepare_austen(tmp_path):
    """Six fixture novels of 20 chapters each -> train/valid/test by chapter index, every chapter exactly once."""
    novels = {}
    for key in NOVELS:
        lines = ["Front matter", ""]
        for c in range(1, 21):
            lines += [f"Chapter {c}", "", f"{key} text of chapter {c}.", ""]
        novels[key] = _vector(16, lines)
    rdx = write_lazy_load(tmp_path, novels)
    paths = prepare_austen(tmp_path / "austen", rdx=rdx, install=False)
    split_docs = {name: paths[name].read_text().split("\n\n")[:-1] for name in ("train", "valid", "test")}
    assert [len(split_docs[s]) for s in ("train", "valid", "test")] == [108, 6, 6]
    all_docs = [doc for docs in split_docs.values() for doc in docs]
    assert len(set(all_docs)) == 120 and all("Front matter" not in doc for doc in all_docs)
    assert split_docs["test"][0] == "Sense and Sensibility, Chapter 18\nsensesensibility text of chapter 18."
    assert [split_of_chapter(i) for i in (7, 17, 27, 0)] == ["valid", "test", "valid", "train"]
