"""Result files of the benchmarks and experiments: what was run, on what, under which load, and timing summaries.

Every figure quoted in README.md, kernels/README.md and docs/RESULTS.md is meant to come from a committed result file
(``benchmarks/results/*.json``, ``docs/results/*.json``) written by the script that measured it. Such a file starts
with a ``"run"`` record:

- ``command``: the command line as run, relative to the repository root, with the thread / kernel environment
  variables that were set (``OMP_NUM_THREADS=1 python benchmarks/bench_kernels.py --threads 1``);
- ``versions``: python, torch, transformers, numpy (read from the installed distributions at run time);
- ``machine``: platform, CPU model, family and vector extensions (``/proc/cpuinfo``), CPU count, torch intra-op
  threads;
- ``git_commit`` (and whether tracked files differed from it), ``started`` / ``finished`` (UTC), ``wall_s``;
- ``load_average_start`` / ``load_average_end``: ``os.getloadavg()`` (1, 5, 15 minutes) before and after.

Repeated timings are kept as ``{"best", "median", "all"}`` (:func:`summarize`); ratios of two such timings as
``{"of_medians", "of_bests"}`` (:func:`ratio`). The ratio of medians is the headline figure: the best of a few rounds
on a shared machine favours whichever side happened to get a quiet moment.

    record = RunRecord.start("python benchmarks/bench_x.py")   # after torch.set_num_threads(...)
    ...                                                          # measure
    record.write("benchmarks/results/bench_x.json", {"timings": {...}})
"""
from __future__ import annotations

import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Union

ROOT = Path(__file__).resolve().parents[1]
# environment variables that change what a measurement measures; prefixed to the recorded command when set
RECORDED_ENVIRONMENT = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "FWP_KERNELS_NO_BUILD", "FWP_KERNELS_NO_ONEDNN",
                        "TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES")
VERSIONED_PACKAGES = ("torch", "transformers", "numpy")


def command_line(program: str, argv: Optional[Sequence[str]] = None) -> str:
    """The command as run: `program` (e.g. ``"python -m training.synthetic"``) followed by `argv` (default
    ``sys.argv[1:]``), shell-quoted, with the :data:`RECORDED_ENVIRONMENT` variables that are set in front.
    Absolute paths inside the repository are written relative to its root."""
    if not isinstance(program, str) or not program.strip():
        raise ValueError(f"`program` must be a non-empty string such as 'python benchmarks/x.py', got {program!r}")
    args = list(sys.argv[1:] if argv is None else argv)
    root = str(ROOT) + os.sep
    args = [a.replace(root, "") if isinstance(a, str) else str(a) for a in args]
    env = [f"{name}={shlex.quote(os.environ[name])}" for name in RECORDED_ENVIRONMENT if name in os.environ]
    return " ".join(env + [program] + [shlex.quote(a) for a in args])


def package_versions(packages: Sequence[str] = VERSIONED_PACKAGES) -> Dict[str, Optional[str]]:
    """Python's version and the installed versions of `packages` (None for one that is not installed); a package
    already imported reports its ``__version__`` (torch's includes the build, e.g. ``2.13.0+cpu``)."""
    versions: Dict[str, Optional[str]] = {"python": platform.python_version()}
    for name in packages:
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "__version__"):
            versions[name] = str(module.__version__)
            continue
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def cpuinfo_field(name: str) -> Optional[str]:
    """The value of the first ``name`` line of /proc/cpuinfo ("" where the file has none; None where there is no
    such file)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next((line.split(":", 1)[1].strip() for line in f
                         if ":" in line and line.split(":", 1)[0].strip() == name), "")
    except OSError:
        return None


def cpu_model() -> Optional[str]:
    """The ``model name`` line of /proc/cpuinfo (None where there is none)."""
    return cpuinfo_field("model name") or None


def cpu_generation() -> Optional[str]:
    """``"family F model M"`` from /proc/cpuinfo (None where it has neither): a VM's ``model name`` can be the same
    for two generations (``AMD EPYC`` for Zen 4, family 25, and Zen 5, family 26), whose vector units differ (Zen 4
    executes a 512-bit instruction as two 256-bit halves)."""
    family, model = cpuinfo_field("cpu family"), cpuinfo_field("model")
    return f"family {family} model {model}" if family and model else None


# CPU features that change which kernels run (oneDNN's AVX-512 and bf16 paths, AMX): a ratio measured with them is
# not that of a CPU without them
CPU_VECTOR_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def cpu_vector_flags() -> Optional[List[str]]:
    """The flags of ``CPU_VECTOR_FLAGS`` that /proc/cpuinfo lists for the first CPU (None where there is no such
    file)."""
    flags = cpuinfo_field("flags")
    return None if flags is None else [flag for flag in CPU_VECTOR_FLAGS if flag in flags.split()]


def machine() -> Dict[str, Any]:
    """Platform, CPU model, family and vector extensions, CPU count and (when torch is imported) torch's intra-op thread
    count."""
    torch = sys.modules.get("torch")
    return {
        "platform": platform.platform(),
        "cpu_model": cpu_model(),
        "cpu_flags": cpu_vector_flags(),
        "cpu_generation": cpu_generation(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads() if torch is not None else None,
    }


def environment() -> Dict[str, Any]:
    """The ``environment`` of a training script's results.json (a model card's "Environment" line): python, torch and
    transformers versions, torch's intra-op thread count (when torch is imported) and the machine architecture."""
    torch = sys.modules.get("torch")
    return {**package_versions(("torch", "transformers")),
            "threads": torch.get_num_threads() if torch is not None else None, "machine": platform.machine()}


def git_commit() -> Dict[str, Any]:
    """``{"git_commit": sha or None, "git_dirty": bool or None}`` of the repository holding this file (dirty: tracked
    files differ from the commit)."""
    def git(*args: str) -> Optional[str]:
        try:
            done = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    sha = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no") if sha else None
    return {"git_commit": sha, "git_dirty": None if status is None else bool(status)}


def load_average() -> List[float]:
    """``os.getloadavg()`` (1, 5 and 15 minutes), rounded to 2 decimals."""
    return [round(x, 2) for x in os.getloadavg()]


def summarize(values: Sequence[float], best: str = "min") -> Dict[str, Any]:
    """``{"best", "median", "all"}`` of repeated measurements `values`; `best` is ``"min"`` for times and ``"max"``
    for rates (tokens/s)."""
    if best not in ("min", "max"):
        raise ValueError(f"`best` must be 'min' or 'max', got {best!r}")
    values = [float(v) for v in values]
    if not values:
        raise ValueError("`values` is empty: nothing to summarize")
    return {"best": min(values) if best == "min" else max(values), "median": statistics.median(values),
            "all": values}


def mean_and_spread(values: Sequence[float], digits: int = 1, signed: bool = False) -> str:
    """A table cell for one figure over seeds: ``"m"`` for one value, ``"m ± s"`` (sample standard deviation) for
    several, ``"-"`` for none; `digits` decimals, the mean with its sign when `signed` (returns)."""
    if not values:
        return "-"
    sign = "+" if signed else ""
    if len(values) == 1:
        return f"{values[0]:{sign}.{digits}f}"
    return f"{statistics.mean(values):{sign}.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def scaled(summary: Dict[str, Any], factor: float) -> Dict[str, Any]:
    """A :func:`summarize` result with every value multiplied by `factor` (seconds -> ms: 1e3)."""
    return {"best": summary["best"] * factor, "median": summary["median"] * factor,
            "all": [v * factor for v in summary["all"]]}


def ratio(numerator: Dict[str, Any], denominator: Dict[str, Any]) -> Dict[str, float]:
    """``{"of_medians", "of_bests"}``: numerator / denominator of two :func:`summarize` results (the ratio of medians
    is the headline)."""
    return {"of_medians": numerator["median"] / denominator["median"],
            "of_bests": numerator["best"] / denominator["best"]}


@dataclass
class RunRecord:
    """Provenance of one run; :meth:`start` before measuring, :meth:`write` after."""

    command: str
    fields: Dict[str, Any] = field(default_factory=dict)
    started_at: float = field(default_factory=time.perf_counter)

    @classmethod
    def start(cls, program: str, argv: Optional[Sequence[str]] = None) -> "RunRecord":
        """Records the command (see :func:`command_line`), versions, machine, git commit, time and load average."""
        record = cls(command_line(program, argv))
        record.fields = {
            "command": record.command,
            "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            **git_commit(),
            "versions": package_versions(),
            "machine": machine(),
            "load_average_start": load_average(),
        }
        return record

    def finish(self) -> Dict[str, Any]:
        """The record with the end time, the wall time since :meth:`start` and the load average now."""
        return {
            **self.fields,
            "finished": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "wall_s": round(time.perf_counter() - self.started_at, 1),
            "load_average_end": load_average(),
        }

    def write(self, path: Union[str, os.PathLike], results: Dict[str, Any],
              copies: Sequence[Union[str, os.PathLike]] = ()) -> Path:
        """Writes ``{"run": <finished record>, **results}`` as indented JSON to `path` and to each of `copies` (the
        same text; folders created); returns `path`."""
        if "run" in results:
            raise ValueError("`results` must not have a 'run' key: the record goes there")
        text = json.dumps({"run": self.finish(), **results}, indent=2, default=str) + "\n"
        for target in [path, *copies]:
            Path(target).parent.mkdir(parents=True, exist_ok=True)
            Path(target).write_text(text, encoding="utf-8")
        return Path(path)
