"""``python -m fwp_kernels.build``: compiles the C++ CPU kernels now (``make install`` runs it after ``pip install``)
instead of on first use, into the build cache of ``cpp_build`` that every environment with the same torch reuses.

Prints one line per kernel (``chunk_delta: built``, ``rfwp_scan: unavailable (no C++ compiler ...)``). Exit status
1 when a build was tried and failed, 0 otherwise: no compiler is not an error (the PyTorch paths run instead).
"""
from __future__ import annotations

import argparse
import sys
from typing import Dict, Optional, Sequence

from . import chunk, dense, gated_delta_rule_kernels, rfwp_scan  # noqa: F401  (importing one registers its kernel)
from .cpp_build import BUILD_DIR_ENV, KERNELS


def build_all() -> Dict[str, str]:
    """Builds (or loads from the cache) every registered C++ kernel; ``{stem: status}``."""
    statuses = {}
    for stem, kernel in KERNELS.items():
        kernel.available()
        statuses[stem] = kernel.describe()
    return statuses


def main(argv: Optional[Sequence[str]] = None) -> int:
    argparse.ArgumentParser(
        prog="python -m fwp_kernels.build",
        description=f"Compile fwp_kernels' C++ CPU kernels into the build cache (${BUILD_DIR_ENV}, default "
        "~/.cache/fwp_kernels).",
    ).parse_args(argv)
    statuses = build_all()
    for stem, status in statuses.items():
        print(f"{stem}: {status}")
    return 1 if any(status.startswith("failed") for status in statuses.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
