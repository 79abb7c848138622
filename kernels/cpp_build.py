"""The one loader of the optional C++ CPU kernels of fwp_kernels: built once, cached, registered in ``KERNELS``.

A kernel module (``chunk.py`` for ``csrc/chunk_delta.cpp``, ``rfwp_scan.py`` for ``csrc/rfwp_scan.cpp``) registers
its source with :func:`register_cpu_kernel` and asks ``kernel.available()`` before taking the compiled path;
:func:`cpu_kernel_statuses` reports every registered kernel. The build:

- runs at install time where a compiler exists (``python -m fwp_kernels.build``, which ``make install`` runs), else
  on first use (a saved model folder loaded with ``trust_remote_code`` builds its own copy of the source); every
  build logs a one-line notice on the ``fwp_kernels`` logger (a warning: shown on stderr by default);
- is cached in ``$FWP_KERNELS_BUILD_DIR`` (default ``~/.cache/fwp_kernels``) under ``torch<version>/<stem>_<key>``,
  the key hashing what the binary depends on (:meth:`CompiledCpuKernel.build_key`: the source text, torch's version
  and C++ ABI, the compiler and its flags) and nothing about where Python or torch lie, so that a second virtual
  environment with the same torch, or a saved folder with the same source, loads the finished library (marked by
  ``built.json``) without running the compiler or ninja (ninja would rebuild: its command line holds torch's paths);
- takes the source from the package's ``csrc/``, from a copy next to the module (a saved model folder imported
  from where it lies), or from the string the module was given (``<stem>_csrc.py``, written by
  ``modeling_fwp.remote_code``: transformers copies only Python files into its module cache);
- falls back silently when ``FWP_KERNELS_NO_BUILD=1`` or when no C++ compiler / ninja / source is there, and with
  one RuntimeWarning when a build was tried and failed; ``kernel.status`` says which path runs.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import platform
import shutil
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Dict, Optional, Sequence, Tuple

import torch

logger = logging.getLogger("fwp_kernels")

NO_BUILD_ENV = "FWP_KERNELS_NO_BUILD"  # "1": never build, always run the PyTorch path on CPU
BUILD_DIR_ENV = "FWP_KERNELS_BUILD_DIR"  # where builds are cached (default ~/.cache/fwp_kernels)
STALE_LOCK_SECONDS = 600  # a build lock older than this was left by a killed build (torch would wait on it forever)
CSRC_DIR = Path(__file__).resolve().parent / "csrc"  # the package's C++ sources (a saved folder: next to the code)
BUILT_MARKER = "built.json"  # written next to the library once it loaded and registered its op: the cache entry
# The kernels' flags. -fopenmp is what makes at::parallel_for parallel in an extension: without it the header's
# `omp parallel` is compiled out and every task runs in the calling thread (measured: 2 threads no faster than 1, and
# CPU time equal to wall time). It also vectorises the `omp simd` loops, as -fopenmp-simd did.
OPENMP_CFLAGS = ("-O3", "-fopenmp")
# The kernels' own loops (dot products, updates, forward substitution: everything not in BLAS) are compiled for the
# vector units of the CPU that builds them (AVX-512 on this project's machine, where -O3 alone emits SSE2), on x86-64
# only; the CPU's identity is part of the build key (a cache shared by machines keeps one build per CPU kind).
# Measured by hand (2026-11-26): the decode step of the 1.3B Delta Net shape, 16 heads of 128, 169 -> 100 us on 1
# thread and 90 -> 48 us on 2; benchmarks/bench_cpu.py times the decode of all 24 layers.
NATIVE_ARCH_FLAG = "-march=native"


def native_arch_flags() -> Tuple[str, ...]:
    """``("-march=native",)`` where the compiler targets the building CPU's vector units (x86-64), else ``()``."""
    return (NATIVE_ARCH_FLAG,) if platform.machine().lower() in ("x86_64", "amd64") else ()


@functools.lru_cache(maxsize=None)
def _cpuinfo() -> Optional[Tuple[Tuple[str, str], ...]]:
    """/proc/cpuinfo's ``(key, value)`` lines, stripped, read once per process (None where it cannot be read)."""
    try:
        lines = Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines()
    except OSError:
        return None
    return tuple((key.strip(), value.strip()) for key, _, value in (line.partition(":") for line in lines))


def cpu_identity() -> str:
    """The building CPU's model and instruction-set flags (Linux: /proc/cpuinfo), what a -march=native build
    depends on; the platform's processor string elsewhere."""
    info = _cpuinfo()
    if info is None:
        return platform.processor() or platform.machine()
    return " | ".join(sorted({value for key, value in info if key in ("model name", "flags")}))


def cpu_flags() -> Tuple[str, ...]:
    """The instruction-set flags /proc/cpuinfo lists for the first CPU (``()`` where it cannot be read)."""
    return next((tuple(value.split()) for key, value in _cpuinfo() or () if key == "flags"), ())


def avx2_only_build() -> bool:
    """Whether the kernels are built for a CPU whose widest vectors are AVX2's (-march=native on x86-64, AVX2 and
    FMA, no AVX-512F): the chunk kernel's float32 micro-kernel then runs in 8-lane registers."""
    flags = cpu_flags()
    return (NATIVE_ARCH_FLAG in native_arch_flags() and "avx2" in flags and "fma" in flags
            and "avx512f" not in flags)


def widest_avx2_flags() -> Tuple[str, ...]:
    """``("-mprefer-vector-width=256",)`` for an :func:`avx2_only_build`, else ``()``: GCC's tuning for AMD's Zen 1
    (-march=native there is znver1), which runs a 256-bit operation as two halves, vectorises `omp simd` loops in 128
    bits, twice the instructions. A kernel adds it where it was measured faster (the decode's weight streaming:
    kernels/dense.py)."""
    return ("-mprefer-vector-width=256",) if avx2_only_build() else ()


KERNEL_CFLAGS = OPENMP_CFLAGS + native_arch_flags()  # what every C++ kernel is built with


def compiler() -> str:
    """The C++ compiler torch's extension builder runs: ``$CXX``, else ``c++``."""
    return os.environ.get("CXX", "c++")


def missing_toolchain() -> Optional[str]:
    """What of the C++ toolchain (compiler ``$CXX`` or ``c++``, ninja) is missing, or None when both are there."""
    from torch.utils.cpp_extension import is_ninja_available

    if shutil.which(compiler()) is None:
        return f"no C++ compiler ({compiler()!r} is not on PATH)"
    if not is_ninja_available():
        return "no ninja"
    return None


class CompiledCpuKernel:
    """One optional C++ kernel: its source, how to build it, whether it is usable.

    Args:
        source: ``csrc/<stem>.cpp`` of the package (the stem names the build).
        embedded_source: the same text from ``<stem>_csrc.py`` inside a saved model folder, else None.
        namespace, op: the library registers ``<op>`` in ``torch.ops.<namespace>_<build key hash>`` (checked after
            loading; :attr:`ops` is that namespace): every build has its own, so that two builds of different
            sources (the package's and a saved model folder's older copy) can be loaded in one process, where two
            registrations of one namespace would abort it.
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
        self.ops = None  # torch.ops.<namespace>_<build key hash> once available() is True
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

    def build_key(self, source: str) -> Dict[str, str]:
        """What the built library depends on, and nothing else (no paths: environments with the same torch share a
        build): the source's hash, torch's version and C++ ABI, the compiler's name and the flags."""
        return {
            "source_sha1": hashlib.sha1(source.encode("utf-8")).hexdigest(),
            "torch": torch.__version__,
            "cxx11_abi": str(int(torch._C._GLIBCXX_USE_CXX11_ABI)),
            "compiler": compiler(),  # $CXX as given (c++ by default)
            "cflags": " ".join(self.extra_cflags),
            **({"cpu": hashlib.sha1(cpu_identity().encode("utf-8")).hexdigest()}
               if NATIVE_ARCH_FLAG in self.extra_cflags else {}),
        }

    def build_key_hash(self, source: str) -> str:
        """12 hex digits of :meth:`build_key`'s hash: names the build directory and the ops' namespace."""
        return hashlib.sha1(json.dumps(self.build_key(source), sort_keys=True).encode("utf-8")).hexdigest()[:12]

    def build_directory(self, source: str) -> Path:
        """``$FWP_KERNELS_BUILD_DIR/torch<version>/<stem>_<build_key_hash>``."""
        root = os.environ.get(BUILD_DIR_ENV) or Path.home() / ".cache" / "fwp_kernels"
        stem = f"{self.source_path.stem}_{self.build_key_hash(source)}"
        return Path(root) / f"torch{torch.__version__.replace('+', '_')}" / stem

    def op_namespace(self, source: str) -> str:
        """``<namespace>_<build_key_hash>``, the namespace the build of `source` registers its ops in (the source
        reads it from ``-DFWP_OP_NAMESPACE``; one source, flags and torch, one namespace and one library)."""
        return f"{self.namespace}_{self.build_key_hash(source)}"

    def describe(self) -> str:
        """Which CPU path runs, for reports: ``"built"`` (the C++ kernel), ``"disabled (...)"``, ``"unavailable (...)"``
        (no toolchain or no source), ``"failed (...)"`` (the build failed) - the last three run the PyTorch path -
        or ``"not tried yet"``."""
        return self.status

    def reset(self) -> None:
        """Forget the outcome of an earlier attempt (the next ``available()`` tries again)."""
        self._available, self.status, self.ops = None, "not tried yet", None

    @torch.compiler.assume_constant_result
    def available(self) -> bool:
        """Builds (once per source version, cached on disk) and loads the kernel; False when it cannot.

        Under ``torch.compile`` it runs while tracing and its answer is a constant of the graph (the lock would
        otherwise break the graph on a kernel's first use)."""
        if self._available is not None:
            return self._available
        with self._lock:
            if self._available is None:
                self._available, self.status = self._build()
        return self._available

    def _compile(self, source: str, build_dir: Path, op_namespace: str) -> None:
        """Compiles and loads ``source`` in ``build_dir`` (torch's JIT extension builder, ninja), with a notice."""
        from torch.utils.cpp_extension import load

        logger.warning(
            "fwp_kernels: compiling the C++ kernel %s into %s (once per source, torch version and flags; "
            "`python -m fwp_kernels.build` does it at install time)", self.source_path.name, build_dir,
        )
        build_dir.mkdir(parents=True, exist_ok=True)
        lock = build_dir / "lock"
        if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_SECONDS:
            lock.unlink(missing_ok=True)  # left by a killed build
        build_source = build_dir / self.source_path.name
        if not build_source.is_file() or build_source.read_text(encoding="utf-8") != source:
            build_source.write_text(source, encoding="utf-8")
        load(
            name=f"fwp_{build_dir.name}",
            sources=[str(build_source)],
            build_directory=str(build_dir),
            extra_cflags=self.extra_cflags + [f"-DFWP_OP_NAMESPACE={op_namespace}"],
            # -fopenmp links the OpenMP runtime too: the libgomp.so.1 torch ships and has already loaded (one pool)
            extra_ldflags=[flag for flag in self.extra_cflags if flag == "-fopenmp"],
            is_python_module=False,
            verbose=False,
        )

    def _build(self) -> Tuple[bool, str]:
        if os.environ.get(NO_BUILD_ENV) == "1":
            return False, f"disabled ({NO_BUILD_ENV}=1)"
        source, origin = self.source()
        if source is None:
            return False, f"unavailable (no {self.source_path.name} next to this copy of fwp_kernels)"
        build_dir, op_namespace = self.build_directory(source), self.op_namespace(source)
        library = build_dir / f"fwp_{build_dir.name}.so"
        cached = (build_dir / BUILT_MARKER).is_file() and library.is_file()
        missing = None if cached else missing_toolchain()  # a cached build needs no compiler
        if missing is not None:
            return False, f"unavailable ({missing})"
        try:
            if cached:  # built before, by this or another environment with the same torch
                torch.ops.load_library(str(library))
            else:
                self._compile(source, build_dir, op_namespace)
            ops = getattr(torch.ops, op_namespace)
            if not hasattr(ops, self.op):
                return False, f"failed (the built library registers no {op_namespace}.{self.op})"
            self.ops = ops
            if not cached:
                (build_dir / BUILT_MARKER).write_text(json.dumps(self.build_key(source), indent=1), encoding="utf-8")
            return True, "built"
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
