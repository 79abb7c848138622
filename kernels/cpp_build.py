"""The one loader of the optional C++ CPU kernels of fwp_kernels: built on first use, registered in ``KERNELS``.

A kernel module (``chunk.py`` for ``csrc/chunk_delta.cpp``, ``rfwp_scan.py`` for ``csrc/rfwp_scan.cpp``) registers
its source with :func:`register_cpu_kernel` and asks ``kernel.available()`` before taking the compiled path;
:func:`cpu_kernel_statuses` reports every registered kernel. The build:

- runs once per source version and is cached in ``$FWP_KERNELS_BUILD_DIR`` (default ``~/.cache/fwp_kernels``)
  under ``<python>_<torch>/<stem>_<source hash>``; every caller with the same source text (the installed package,
  saved model folders) compiles the same file there and reuses one build;
- takes the source from the package's ``csrc/``, from a copy next to the module (a saved model folder imported
  from where it lies), or from the string the module was given (``<stem>_csrc.py``, written by
  ``modeling_fwp.remote_code``: transformers copies only Python files into its module cache);
- falls back silently when ``FWP_KERNELS_NO_BUILD=1`` or when no C++ compiler / ninja / source is there, and with
  one RuntimeWarning when a build was tried and failed; ``kernel.status`` says which path runs.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Dict, Optional, Sequence, Tuple

import torch

NO_BUILD_ENV = "FWP_KERNELS_NO_BUILD"  # "1": never build, always run the PyTorch path on CPU
BUILD_DIR_ENV = "FWP_KERNELS_BUILD_DIR"  # where builds are cached (default ~/.cache/fwp_kernels)
STALE_LOCK_SECONDS = 600  # a build lock older than this was left by a killed build (torch would wait on it forever)
CSRC_DIR = Path(__file__).resolve().parent / "csrc"  # the package's C++ sources (a saved folder: next to the code)


def missing_toolchain() -> Optional[str]:
    """What of the C++ toolchain (compiler ``$CXX`` or ``c++``, ninja) is missing, or None when both are there."""
    from torch.utils.cpp_extension import is_ninja_available

    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler!r} is not on PATH)"
    if not is_ninja_available():
        return "no ninja"
    return None


class CompiledCpuKernel:
    """One optional C++ kernel: its source, how to build it, whether it is usable.

    Args:
        source: ``csrc/<stem>.cpp`` of the package (the stem names the build).
        embedded_source: the same text from ``<stem>_csrc.py`` inside a saved model folder, else None.
        namespace, op: a ``torch.ops.<namespace>.<op>`` the built library registers (checked after loading).
        extra_cflags: compiler flags.
        fallback: what runs instead, for the warning ("the PyTorch step loop (much slower)").
    """

    def __init__(
        self,
        source: Path,
        embedded_source: Optional[str],
        namespace: str,
        op: str,
        extra_cflags: Sequence[str] = ("-O3",),
        fallback: str = "the PyTorch path",
    ) -> None:
        self.source_path = source
        self.embedded_source = embedded_source
        self.namespace, self.op = namespace, op
        self.extra_cflags = list(extra_cflags)
        self.fallback = fallback
        self.status = "not tried yet"
        self._available: Optional[bool] = None
        self._lock = threading.Lock()

    def source(self) -> Tuple[Optional[str], str]:
        """``(C++ source text or None, where it came from)``."""
        # csrc/<stem>.cpp of the package, or <stem>.cpp beside the kernel module (a saved folder's flat copy)
        for path in (self.source_path, self.source_path.parent.parent / self.source_path.name):
            if path.is_file():
                return path.read_text(encoding="utf-8"), str(path)
        if self.embedded_source is not None:
            return self.embedded_source, f"{self.source_path.stem}_csrc.py"
        return None, ""

    def build_directory(self, source: str) -> Path:
        """``$FWP_KERNELS_BUILD_DIR/<python>_<torch>/<stem>_<source hash>``."""
        source_hash = hashlib.sha1(source.encode("utf-8")).hexdigest()[:12]
        tag = f"py{sys.version_info.major}{sys.version_info.minor}_torch{torch.__version__.replace('+', '_')}"
        root = os.environ.get(BUILD_DIR_ENV) or Path.home() / ".cache" / "fwp_kernels"
        return Path(root) / tag / f"{self.source_path.stem}_{source_hash}"

    def describe(self) -> str:
        """Which CPU path runs, for reports: ``"built"`` (the C++ kernel), ``"disabled (...)"``, ``"unavailable (...)"``
        (no toolchain or no source), ``"failed (...)"`` (the build failed) - the last three run the PyTorch path -
        or ``"not tried yet"``."""
        return self.status

    def reset(self) -> None:
        """Forget the outcome of an earlier attempt (the next ``available()`` tries again)."""
        self._available, self.status = None, "not tried yet"

    def available(self) -> bool:
        """Builds (once per source version, cached on disk) and loads the kernel; False when it cannot."""
        if self._available is not None:
            return self._available
        with self._lock:
            if self._available is None:
                self._available, self.status = self._build()
        return self._available

    def _build(self) -> Tuple[bool, str]:
        if os.environ.get(NO_BUILD_ENV) == "1":
            return False, f"disabled ({NO_BUILD_ENV}=1)"
        source, origin = self.source()
        if source is None:
            return False, f"unavailable (no {self.source_path.name} next to this copy of fwp_kernels)"
        missing = missing_toolchain()
        if missing is not None:
            return False, f"unavailable ({missing})"
        try:
            from torch.utils.cpp_extension import load

            build_dir = self.build_directory(source)
            build_dir.mkdir(parents=True, exist_ok=True)
            lock = build_dir / "lock"
            if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_SECONDS:
                lock.unlink(missing_ok=True)  # left by a killed build
            build_source = build_dir / self.source_path.name
            if not build_source.is_file() or build_source.read_text(encoding="utf-8") != source:
                build_source.write_text(source, encoding="utf-8")
            if not any(build_dir.glob("*.so")):  # a first build: say why the program pauses
                print(f"fwp_kernels: compiling the C++ kernel {self.source_path.name} (once, about a minute; cached in "
                      f"{build_dir})", file=sys.stderr, flush=True)
            load(
                name=f"fwp_{build_dir.name}",
                sources=[str(build_source)],
                build_directory=str(build_dir),
                extra_cflags=self.extra_cflags,
                is_python_module=False,
                verbose=False,
            )
            if hasattr(getattr(torch.ops, self.namespace), self.op):
                return True, "built"
            return False, f"failed (the built library registers no {self.namespace}.{self.op})"
        except Exception as error:  # a failed build or link: the PyTorch path still works
            detail = " ".join(str(error).split())[:300]
            warnings.warn(
                f"fwp_kernels: building the C++ kernel {self.source_path.name} from {origin} failed "
                f"({type(error).__name__}: {detail}); using {self.fallback} instead",
                RuntimeWarning,
                stacklevel=4,
            )
            return False, f"failed ({type(error).__name__}: {detail})"


KERNELS: Dict[str, CompiledCpuKernel] = {}  # source stem -> kernel, in registration order


def register_cpu_kernel(
    stem: str,
    embedded_source: Optional[str],
    namespace: str,
    op: str,
    extra_cflags: Sequence[str] = ("-O3",),
    fallback: str = "the PyTorch path",
) -> CompiledCpuKernel:
    """Registers the C++ kernel ``csrc/<stem>.cpp`` in ``KERNELS`` and returns it (arguments as in
    :class:`CompiledCpuKernel`; `embedded_source` is the string of ``<stem>_csrc.py`` in a saved folder, else None)."""
    kernel = CompiledCpuKernel(CSRC_DIR / f"{stem}.cpp", embedded_source, namespace, op, extra_cflags, fallback)
    KERNELS[stem] = kernel
    return kernel


def cpu_kernel_statuses() -> Dict[str, str]:
    """``{source stem: status}`` of every registered C++ kernel (see :meth:`CompiledCpuKernel.describe`)."""
    return {stem: kernel.describe() for stem, kernel in KERNELS.items()}
