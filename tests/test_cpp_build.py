"""The C++ kernels' build (fwp_kernels.cpp_build, issue 21 item 7): a notice whenever a build runs, a cache key of
what the binary depends on (source, torch version, compiler flags) and of nothing about where Python or torch lie,
and a cached build loaded without the compiler, as a second environment with the same torch does."""
import logging
import os
import sys

import pytest
import torch
import torch.utils.cpp_extension

from fwp_kernels import build, chunk, cpp_build, dense
from fwp_kernels.cpp_build import BUILT_MARKER, CompiledCpuKernel, missing_toolchain


def _twin(kernel: CompiledCpuKernel, **changes) -> CompiledCpuKernel:
    """A new loader of the same kernel (what a fresh process or environment creates), with `changes` applied."""
    args = dict(source=kernel.source_path, embedded_source=kernel.embedded_source, namespace=kernel.namespace,
                op=kernel.op, extra_cflags=kernel.extra_cflags, fallback=kernel.fallback)
    return CompiledCpuKernel(**{**args, **changes})


def _notices(caplog) -> list:
    return [r.getMessage() for r in caplog.records if r.name == "fwp_kernels" and "compiling" in r.getMessage()]


def test_build_key_covers_source_torch_and_flags(monkeypatch, tmp_path):
    monkeypatch.setenv("FWP_KERNELS_BUILD_DIR", str(tmp_path))
    kernel = chunk._CPU_KERNEL
    source = kernel.source()[0]
    directory = kernel.build_directory(source)
    assert directory.parent.parent == tmp_path and directory.name.startswith("chunk_delta_")
    assert _twin(kernel).build_directory(source) == directory  # the same inputs, the same entry
    changed = {
        "source": kernel.build_directory(source + "\n// edited\n"),
        "flags": _twin(kernel, extra_cflags=["-O2"]).build_directory(source),
    }
    monkeypatch.setattr(torch, "__version__", "9.9.9+cpu")
    changed["torch version"] = kernel.build_directory(source)
    monkeypatch.undo()
    monkeypatch.setenv("FWP_KERNELS_BUILD_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "clang++")
    changed["compiler"] = kernel.build_directory(source)
    monkeypatch.delenv("CXX")
    if cpp_build.NATIVE_ARCH_FLAG in kernel.extra_cflags:  # a -march=native build is one CPU kind's
        monkeypatch.setattr(cpp_build, "cpu_identity", lambda: "another CPU | avx2")
        changed["CPU"] = kernel.build_directory(source)
        monkeypatch.undo()
        monkeypatch.setenv("FWP_KERNELS_BUILD_DIR", str(tmp_path))
    for what, other in changed.items():
        assert other != directory, f"the build key ignores the {what}"
    # Another environment: Python, torch and its headers elsewhere. The key holds no paths: the same entry.
    monkeypatch.setattr(sys, "prefix", "/elsewhere/venv2")
    monkeypatch.setattr(sys, "executable", "/elsewhere/venv2/bin/python")
    monkeypatch.setattr(torch.utils.cpp_extension, "include_paths", lambda *a, **k: ["/elsewhere/venv2/include"])
    assert kernel.build_directory(source) == directory


def test_a_build_logs_one_notice(monkeypatch, tmp_path, caplog):
    """A build that runs (here: one that fails at once) says so on the fwp_kernels logger, naming the kernel."""
    if missing_toolchain() is not None:
        pytest.skip(f"no toolchain: {missing_toolchain()}")
    monkeypatch.setenv("FWP_KERNELS_BUILD_DIR", str(tmp_path))
    monkeypatch.delenv("FWP_KERNELS_NO_BUILD", raising=False)
    kernel = _twin(chunk._CPU_KERNEL)
    monkeypatch.setattr(kernel, "source", lambda: ("#error not a kernel\n", "test source"))
    with caplog.at_level(logging.WARNING, logger="fwp_kernels"), pytest.warns(RuntimeWarning, match="failed"):
        assert kernel.available() is False
    notices = _notices(caplog)
    assert len(notices) == 1 and "chunk_delta.cpp" in notices[0] and str(tmp_path) in notices[0]
    assert not (kernel.build_directory("#error not a kernel\n") / BUILT_MARKER).exists()  # a failure is not cached


def test_cached_build_loads_without_compiler(monkeypatch, caplog):
    """After one build, a new loader (a fresh process, or a second environment with the same torch) loads the library
    from the cache: no compiler, no ninja, no notice."""
    monkeypatch.delenv("FWP_KERNELS_NO_BUILD", raising=False)
    kernel = chunk._CPU_KERNEL
    if not kernel.available():
        pytest.skip(f"the C++ chunk kernel is {kernel.describe()}")
    caplog.clear()  # available() may have built it just now (a cold cache): only what follows counts
    source = kernel.source()[0]
    assert (kernel.build_directory(source) / BUILT_MARKER).is_file()

    def no_compiler(*args, **kwargs):
        raise AssertionError("a cached kernel was compiled again")

    monkeypatch.setattr(torch.utils.cpp_extension, "load", no_compiler)
    monkeypatch.setattr("fwp_kernels.cpp_build.missing_toolchain", lambda: "no C++ compiler (test)")
    twin = _twin(kernel)
    with caplog.at_level(logging.WARNING, logger="fwp_kernels"):
        assert twin.available() is True and twin.describe() == "built"
    assert _notices(caplog) == []


def test_prebuild_command_reports_every_kernel(monkeypatch, capsys):
    """``python -m fwp_kernels.build`` (run by ``make install``) reports each registered kernel's status."""
    monkeypatch.setenv("FWP_KERNELS_NO_BUILD", "1")
    kernels = {stem: kernel for stem, kernel in build.KERNELS.items()}
    for kernel in kernels.values():  # forget this process's outcome; restored below
        monkeypatch.setattr(kernel, "_available", None)
        monkeypatch.setattr(kernel, "status", "not tried yet")
    assert build.main([]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"{stem}: disabled (FWP_KERNELS_NO_BUILD=1)" for stem in kernels]
    assert {"chunk_delta", "rfwp_scan"} <= set(kernels)


@pytest.mark.parametrize("stem", ["chunk_delta", "rfwp_scan", "decode_linear"])
def test_kernels_are_built_with_openmp(stem):
    """at::parallel_for runs its tasks on several threads only in code compiled with -fopenmp (otherwise the header's
    `omp parallel` is compiled out: every kernel ran on one thread, whatever torch.set_num_threads said). The built
    library must call the OpenMP runtime's parallel entry point."""
    from fwp_kernels.cpp_build import KERNELS

    kernel = KERNELS[stem]
    if not kernel.available():
        pytest.skip(f"{stem}: {kernel.describe()}")
    assert "-fopenmp" in kernel.extra_cflags
    assert set(cpp_build.native_arch_flags()) <= set(kernel.extra_cflags)  # the building CPU's vector units
    directory = kernel.build_directory(kernel.source()[0])
    library = directory / f"fwp_{directory.name}.so"
    assert b"GOMP_parallel" in library.read_bytes()



_TWO_COPIES_SCRIPT = """
import os, sys
from pathlib import Path
import torch
from fwp_kernels import dense
from fwp_kernels.cpp_build import CompiledCpuKernel
installed = dense._CPU_KERNEL
assert installed.available(), installed.describe()
os.environ["FWP_KERNELS_BUILD_DIR"] = sys.argv[1]  # the other copy is built in the test's directory
source = installed.source()[0] + "\\n// another version of the source, as a saved model folder may carry\\n"
other = CompiledCpuKernel(Path("/nowhere/csrc/decode_linear.cpp"), source, installed.namespace, installed.op,
                          installed.extra_cflags)
assert other.available(), other.describe()
x, w = torch.randn(1, 64), torch.randn(32, 64)
for kernel in (installed, other):
    out = torch.empty(1, 32)
    kernel.ops.linear_rows(x, w, None, out)
    torch.testing.assert_close(out, x @ w.T, rtol=1e-5, atol=1e-5)
print(installed.ops.name, other.ops.name)
"""


def test_builds_of_two_sources_load_in_one_process(tmp_path):
    """The package's kernel and a saved model folder's copy of another version of its source, both loaded in one
    process (a folder loaded with trust_remote_code beside the installed package): each build registers its ops in a
    namespace of its own. With one fixed namespace the second library's registration aborted the process
    (c10::Error thrown while dlopen ran its static initialisers: std::terminate), hence a subprocess here."""
    import subprocess

    if missing_toolchain() is not None or not dense._CPU_KERNEL.available():
        pytest.skip(f"the C++ decode_linear kernel is {dense._CPU_KERNEL.describe()}")
    env = {k: v for k, v in os.environ.items() if k != "FWP_KERNELS_NO_BUILD"}
    run = subprocess.run([sys.executable, "-c", _TWO_COPIES_SCRIPT, str(tmp_path)], capture_output=True, text=True,
                         env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    names = run.stdout.split()
    assert len(names) == 2 and names[0] != names[1] and all(n.startswith("fwp_dense_") for n in names), names


@pytest.mark.parametrize("stem", ["chunk_delta", "rfwp_scan", "decode_linear"])
@pytest.mark.parametrize("arch", ["x86-64", "x86-64-v3"])
def test_kernels_compile_for_cpus_without_avx512(stem, arch):
    """Each C++ source compiles for x86-64 CPUs without AVX-512 (the baseline and AVX2), not only for the building
    CPU's -march=native: its AVX-512 code sits behind __AVX512F__ and the rest must stand without it (a helper placed
    inside that section broke these builds once). Syntax and templates checked, nothing linked."""
    import platform
    import subprocess

    if platform.machine().lower() not in ("x86_64", "amd64") or missing_toolchain() is not None:
        pytest.skip("an x86-64 C++ toolchain is needed")
    includes = [f"-I{path}" for path in torch.utils.cpp_extension.include_paths()]
    # -std=c++20 as torch's extension builder compiles them
    command = [cpp_build.compiler(), "-std=c++20", "-fsyntax-only", "-fopenmp", f"-march={arch}",
               "-DFWP_OP_NAMESPACE=check", *includes, str(cpp_build.CSRC_DIR / f"{stem}.cpp")]
    run = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]


@pytest.mark.parametrize("arch,products", [("x86-64", set()), ("x86-64-v3", {"FWP_VECTOR_PRODUCTS"}),
                                           ("skylake-avx512", {"FWP_VECTOR_PRODUCTS"}),
                                           ("cooperlake", {"FWP_VECTOR_PRODUCTS", "FWP_NATIVE_BF16"}),
                                           ("sapphirerapids", {"FWP_VECTOR_PRODUCTS", "FWP_NATIVE_BF16",
                                                               "FWP_TILE_BF16"})])
def test_chunk_kernel_products_by_instruction_set(arch, products):
    """Which products csrc/chunk_delta.cpp builds for a CPU (its preprocessor's macros; nothing compiled): the BLAS
    only on the x86-64 baseline, the float32 micro-kernel with AVX2 + FMA (x86-64-v3: Zen 1-3) and with AVX-512, and
    bfloat16 factors only with AVX-512 BF16 (Cooper Lake, Zen 4-5), in AMX tiles as well with AMX-BF16 (Sapphire
    Rapids and later Xeons)."""
    import platform
    import subprocess

    if platform.machine().lower() not in ("x86_64", "amd64") or missing_toolchain() is not None:
        pytest.skip("an x86-64 C++ toolchain is needed")
    includes = [f"-I{path}" for path in torch.utils.cpp_extension.include_paths()]
    command = [cpp_build.compiler(), "-std=c++20", "-E", "-dM", "-fopenmp", f"-march={arch}",
               "-DFWP_OP_NAMESPACE=check", *includes, str(cpp_build.CSRC_DIR / "chunk_delta.cpp")]
    run = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    defined = {line.split()[1] for line in run.stdout.splitlines() if line.startswith("#define FWP_")}
    assert defined & {"FWP_VECTOR_PRODUCTS", "FWP_NATIVE_BF16", "FWP_TILE_BF16"} == products
