"""Long-document corpora for evaluation where fast weights matter (Clark et al. 2022 evaluate on whole documents).

``prepare_austen``: Jane Austen's six novels from Debian's ``r-cran-janeaustenr`` (an R data package: lazy-load
``Rdata.rdx`` / ``Rdata.rdb``, read without R by ``training.rdata_reader``), one document per chapter, written as
``train.txt`` / ``valid.txt`` / ``test.txt`` in the layout of ``training.data`` (a heading line, then one paragraph per
line; documents separated by a blank line) plus ``meta.json``. Offline from the apt index: if the package is not
installed, ``apt-get download r-cran-janeaustenr`` fetches its .deb (no root needed, nothing installed system-wide)
and ``dpkg -x`` unpacks it into a temporary folder.

    python -m training.corpora --out data/austen
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from .rdata_reader import read_lazy_load

logger = logging.getLogger(__name__)

DEBIAN_PACKAGE = "r-cran-janeaustenr"
INSTALLED_DATA = Path("/usr/lib/R/site-library/janeaustenr/data/Rdata.rdx")
# The novels in publication order, as janeaustenr names its objects.
NOVELS = {
    "sensesensibility": "Sense and Sensibility",
    "prideprejudice": "Pride and Prejudice",
    "mansfieldpark": "Mansfield Park",
    "emma": "Emma",
    "northangerabbey": "Northanger Abbey",
    "persuasion": "Persuasion",
}
SPLITS = ("train", "valid", "test")
_CHAPTER = re.compile(r"^\s*chapter\s+([0-9]+|[ivxlc]+)\.?\s*$", re.IGNORECASE)
_VOLUME = re.compile(r"^\s*volume\s+([0-9]+|[ivxlc]+)\.?\s*$", re.IGNORECASE)


def split_of_chapter(index: int, period: int = 20) -> str:
    """The split of the `index`-th chapter (0-based, counting through all novels in order): one chapter in
    `period` goes to valid, one to test, spread over every novel."""
    if index % period == period // 2 - 3:
        return "valid"
    if index % period == period - 3:
        return "test"
    return "train"


def chapters(lines: List[Optional[str]], title: str) -> List[str]:
    """A novel's lines (as janeaustenr stores them: wrapped text, blank lines between paragraphs) -> one document
    per chapter: ``"<title>, Chapter <n>"``, then one paragraph per line. The front matter before the first chapter
    heading and volume headings are dropped."""
    documents: List[str] = []
    heading: Optional[str] = None
    paragraphs: List[str] = []
    current: List[str] = []

    def end_paragraph() -> None:
        if current:
            paragraphs.append(" ".join(current))
            current.clear()

    def end_chapter() -> None:
        end_paragraph()
        if heading is not None and paragraphs:
            documents.append("\n".join([heading] + paragraphs))
        paragraphs.clear()

    for line in lines:
        text = (line or "").strip()
        match = _CHAPTER.match(text)
        if match:
            end_chapter()
            heading = f"{title}, Chapter {match.group(1)}"
        elif _VOLUME.match(text) or not text:
            end_paragraph()
        elif heading is not None:
            current.append(" ".join(text.split()))
    end_chapter()
    return documents


def find_austen_data(install: bool = True) -> Tuple[Path, Optional[Path]]:
    """(``Rdata.rdx`` of janeaustenr, a temporary folder to remove after use or None): the installed package's, or
    one unpacked from ``apt-get download`` into a temporary folder."""
    if INSTALLED_DATA.is_file():
        return INSTALLED_DATA, None
    if not install:
        raise FileNotFoundError(
            f"{INSTALLED_DATA} not found; `apt-get download {DEBIAN_PACKAGE}` and `dpkg -x` it, or pass --rdx"
        )
    for tool in ("apt-get", "dpkg"):
        if shutil.which(tool) is None:
            raise FileNotFoundError(f"`{tool}` is needed to fetch {DEBIAN_PACKAGE} (a Debian package); pass --rdx")
    folder = Path(tempfile.mkdtemp(prefix="janeaustenr-"))
    logger.warning("%s is not installed; fetching it with `apt-get download %s` (from the apt index)",
                   DEBIAN_PACKAGE, DEBIAN_PACKAGE)
    for cmd in (["apt-get", "download", DEBIAN_PACKAGE], None):
        if cmd is None:
            debs = sorted(folder.glob(f"{DEBIAN_PACKAGE}_*.deb"))
            if not debs:
                raise RuntimeError(f"`apt-get download {DEBIAN_PACKAGE}` wrote no .deb into {folder}")
            cmd = ["dpkg", "-x", str(debs[-1]), str(folder / "root")]
        result = subprocess.run(cmd, cwd=folder, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"`{' '.join(cmd)}` failed (exit {result.returncode}):\n{result.stderr[-2000:]}")
    return folder / "root" / INSTALLED_DATA.relative_to("/"), folder


def austen_documents(rdx: Path) -> List[Tuple[str, str]]:
    """``[(novel key, chapter document)]`` in publication order, read from janeaustenr's lazy-load data."""
    objects = read_lazy_load(rdx)
    missing = [key for key in NOVELS if key not in objects]
    if missing:
        raise ValueError(f"{rdx} lacks the novels {missing}; it holds {sorted(objects)}")
    return [(key, doc) for key, title in NOVELS.items() for doc in chapters(objects[key].value, title)]


def prepare_austen(out_dir: str | Path, rdx: Optional[str | Path] = None, install: bool = True) -> Dict[str, Path]:
    """Writes ``out_dir/{train,valid,test}.txt`` (one chapter per document) and ``meta.json``; returns their paths.
    `rdx`: janeaustenr's ``Rdata.rdx`` (default: installed, or fetched with apt). Same input, same files."""
    rdx, fetched = (Path(rdx), None) if rdx is not None else find_austen_data(install)
    try:
        documents = austen_documents(rdx)
        source_sha256 = hashlib.sha256(rdx.with_suffix(".rdb").read_bytes()).hexdigest()
    finally:
        if fetched is not None:
            shutil.rmtree(fetched, ignore_errors=True)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    splits: Dict[str, List[str]] = {name: [] for name in SPLITS}
    headings: Dict[str, List[str]] = {name: [] for name in SPLITS}
    for index, (_, doc) in enumerate(documents):
        name = split_of_chapter(index)
        splits[name].append(doc)
        headings[name].append(doc.split("\n", 1)[0])
    paths: Dict[str, Path] = {}
    for name, docs in splits.items():
        paths[name] = out_dir / f"{name}.txt"
        paths[name].write_text("".join(doc + "\n\n" for doc in docs), encoding="utf-8")
    meta = {
        "source": f"Debian package {DEBIAN_PACKAGE} (janeaustenr's data/Rdata.rdb)",
        "source_sha256": source_sha256,
        "format": "one chapter per block (heading line, then one paragraph per line), blocks separated by a blank line",
        "split": "chapters numbered through the six novels in publication order: index % 20 == 7 valid, == 17 test",
        "splits": {name: {"documents": len(docs), "words": sum(len(d.split()) for d in docs)}
                   for name, docs in splits.items()},
        "chapters": {name: headings[name] for name in ("valid", "test")},
    }
    paths["meta"] = out_dir / "meta.json"
    paths["meta"].write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    logger.info("wrote %s: %s", out_dir, ", ".join(f"{k} {v['documents']} chapters" for k, v in meta["splits"].items()))
    return paths


def main(argv: Optional[List[str]] = None) -> Dict[str, Path]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="data/austen", help="output folder (default: data/austen)")
    parser.add_argument("--rdx", default=None,
                        help="janeaustenr's data/Rdata.rdx (default: installed or apt-get download)")
    parser.add_argument("--no_install", action="store_true", help="fail instead of running apt-get download")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    paths = prepare_austen(args.out, args.rdx, install=not args.no_install)
    for name, path in paths.items():
        print(f"{name:6s} {path}")
    return paths


if __name__ == "__main__":
    main()
