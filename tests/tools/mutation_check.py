#!/usr/bin/env python
"""Mutation check: plants realistic one-line bugs, one at a time, in a temporary copy of the repository and reports
which of them the test suite catches.

    python tests/tools/mutation_check.py [--only NAME ...] [--list] [--jobs N] [--full-suite] [--out FILE]

Each mutation (``mutations.py``: name, file, exact old text, new text, test files as glob patterns) is planted in a
fresh copy of the tracked and untracked-not-ignored files, with the ``fwp_kernels -> kernels`` link, and the named
test files run there (``python -m pytest -q -p no:cacheprovider``, cwd and PYTHONPATH = the copy, so the copy's
``modeling_fwp`` and ``fwp_kernels`` are imported, not the editable install). Caught: pytest exits 1 with at least one
failure. A mutation whose old text does not occur exactly once is reported as rotten, never as caught.

C++ kernels are built per source hash (``kernels/cpp_build.py``) in the usual build directory: an unmutated kernel
reuses the cached build, a mutated source gets a directory of its own (no collision), removed after its run.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mutations import MUTATIONS, Mutation  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = "benchmarks/results/mutation_check.md"


@dataclass
class Outcome:
    """What one run of pytest on one (possibly mutated) copy gave."""

    name: str
    path: str
    tests: List[str]
    status: str  # caught | MISSED | ROTTEN | no tests | collection error | timeout | exit <rc>
    returncode: Optional[int] = None
    failures: Optional[int] = None
    seconds: float = 0.0
    detail: str = ""


def repository_files(root: Path) -> List[str]:
    """Tracked and untracked-not-ignored files of `root`, relative paths (deleted tracked files left out)."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                         check=True, capture_output=True).stdout.decode()
    return sorted({p for p in out.split("\0") if p and (root / p).is_file()})


def make_copy(root: Path, files: Sequence[str], dest: Path) -> None:
    """Copies `files` from `root` into `dest` and adds the ``fwp_kernels -> kernels`` link."""
    for rel in files:
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / rel, target, follow_symlinks=False)
    if not (dest / "fwp_kernels").exists():
        (dest / "fwp_kernels").symlink_to("kernels")


def occurrences(mutation: Mutation, root: Path) -> int:
    """How often the mutation's old text occurs in its file (must be exactly 1; 0 when the file is gone)."""
    path = root / mutation.path
    return path.read_text(encoding="utf-8").count(mutation.old) if path.is_file() else 0


def resolve_tests(patterns: Sequence[str], root: Path) -> Tuple[List[str], List[str]]:
    """``(test files matching the glob patterns, patterns that matched nothing)``, paths relative to `root`."""
    found: List[str] = []
    missing = []
    for pattern in patterns:
        matches = sorted(str(Path(p).relative_to(root)) for p in glob.glob(str(root / pattern)))
        found += [m for m in matches if m not in found]
        if not matches:
            missing.append(pattern)
    return found, missing


def pytest_environment(copy: Path) -> Dict[str, str]:
    """The environment of a run in `copy`: its own packages first on the path, nothing inherited on PYTHONPATH."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(copy)
    env.pop("PYTEST_ADDOPTS", None)
    return env


def check_imports(copy: Path) -> None:
    """Fails loudly when ``modeling_fwp`` / ``fwp_kernels`` would not be imported from the copy."""
    code = "import fwp_kernels, modeling_fwp; print(fwp_kernels.__file__); print(modeling_fwp.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=copy, env=pytest_environment(copy), capture_output=True,
                         text=True)
    paths = out.stdout.split()
    if out.returncode != 0 or len(paths) != 2 or not all(str(copy) in str(Path(p)) for p in paths):
        sys.exit(f"mutation_check: the copy's packages are not the ones imported ({out.stdout}{out.stderr})")


def count_failures(output: str) -> Optional[int]:
    """Failed + errored tests from pytest's summary line (``3 failed, 40 passed, 1 error in 9.1s``)."""
    for line in reversed(output.strip().splitlines()):
        if re.search(r"\d+ (passed|failed|errors?|skipped|deselected)|no tests ran", line):
            return sum(int(n) for n, _ in re.findall(r"(\d+) (failed|errors?)\b", line))
    return None


def run_pytest(copy: Path, tests: Sequence[str], args: argparse.Namespace) -> Tuple[int, Optional[int], float, str]:
    """``(exit code, failures, seconds, output tail)`` of pytest on `tests` in `copy` (exit code -1: timed out)."""
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *(["-x"] if args.full_suite else []),
               *tests]
    start = time.perf_counter()
    try:
        proc = subprocess.run(command, cwd=copy, env=pytest_environment(copy), capture_output=True, text=True,
                              timeout=args.timeout)
    except subprocess.TimeoutExpired as error:
        output = (error.stdout or b"").decode() if isinstance(error.stdout, bytes) else (error.stdout or "")
        return -1, None, time.perf_counter() - start, output[-2000:]
    output = proc.stdout + proc.stderr
    return proc.returncode, count_failures(proc.stdout), time.perf_counter() - start, output[-2000:]


def classify(returncode: int, failures: Optional[int]) -> str:
    """pytest's exit code (and failure count) -> the status column."""
    if returncode == 1 and failures:
        return "caught"
    named = {0: "MISSED", 2: "collection error", 5: "no tests collected", -1: "timeout"}
    return named.get(returncode, f"exit {returncode}")


def remove_mutant_build(mutation: Mutation, mutated_text: str) -> str:
    """Deletes the build directory of a mutated C++ source (``<build root>/<tag>/<stem>_<hash of the source>``).

    Returns what the run did with that source: ``"built"``, ``"build failed"`` or ``"never built"`` ("" for Python).
    """
    if not mutation.path.endswith(".cpp"):
        return ""
    from fwp_kernels.cpp_build import KERNELS  # the build directory as the kernel's loader names it (source + flags)

    directory = KERNELS[Path(mutation.path).stem].build_directory(mutated_text)
    if not directory.is_dir():
        return "never built"
    found = "built" if any(directory.glob("*.so")) else "build failed"
    shutil.rmtree(directory, ignore_errors=True)
    return found


def run_mutation(mutation: Mutation, files: Sequence[str], args: argparse.Namespace) -> Outcome:
    """Plants `mutation` in a fresh copy, runs its tests, classifies the result; the copy is removed afterwards."""
    tests = ["tests"] if args.full_suite else resolve_tests(mutation.tests, ROOT)[0]
    outcome = Outcome(mutation.name, mutation.path, tests, "no tests")
    count = occurrences(mutation, ROOT)
    if count != 1:
        outcome.status, outcome.detail = "ROTTEN", f"old text found {count} times in {mutation.path}"
        return outcome
    if not tests:
        return outcome
    copy = Path(tempfile.mkdtemp(prefix=f"fwp_mutation_{mutation.name}_"))
    try:
        make_copy(ROOT, files, copy)
        target = copy / mutation.path
        mutated = target.read_text(encoding="utf-8").replace(mutation.old, mutation.new)
        target.write_text(mutated, encoding="utf-8")
        rc, failures, seconds, tail = run_pytest(copy, tests, args)
        build = remove_mutant_build(mutation, mutated)
    finally:
        shutil.rmtree(copy, ignore_errors=True)
    outcome.returncode, outcome.failures, outcome.seconds = rc, failures, seconds
    outcome.status = classify(rc, failures)
    notes = [] if build in ("", "built") else [f"the mutated C++ source was {build}: its kernel never ran"]
    if outcome.status != "caught":
        notes.append(tail.strip().splitlines()[-1] if tail.strip() else "")
    outcome.detail = "; ".join(n for n in notes if n)
    return outcome


def run_baseline(files: Sequence[str], tests: Sequence[str], args: argparse.Namespace) -> float:
    """Runs `tests` on an unmutated copy; exits with a clear message unless they all pass. Returns the seconds."""
    copy = Path(tempfile.mkdtemp(prefix="fwp_mutation_baseline_"))
    try:
        make_copy(ROOT, files, copy)
        check_imports(copy)
        rc, failures, seconds, tail = run_pytest(copy, tests, args)
    finally:
        shutil.rmtree(copy, ignore_errors=True)
    if rc != 0:
        sys.exit(f"mutation_check: the baseline (no mutation) does not pass: exit code {rc}, {failures} failures.\n"
                 f"Fix the suite first; the mutation results would mean nothing.\n--- pytest output (tail) ---\n{tail}")
    return seconds


def render(outcomes: Sequence[Outcome], baseline_seconds: float, command: str) -> str:
    """The markdown report: how it was made, then one row per mutation."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    caught = sum(o.status == "caught" for o in outcomes)
    lines = [
        "# Mutation check", "",
        f"- command: `{command}`",
        f"- commit: `{commit.strip()}`{' (with uncommitted changes)' if dirty else ''}",
        f"- date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}",
        f"- baseline (no mutation) passed in {baseline_seconds:.0f} s",
        f"- **caught {caught} of {len(outcomes)}**", "",
        "| mutation | file | tests run | caught? | failures | seconds |",
        "|---|---|---|---|---|---|",
    ]
    for o in outcomes:
        status = o.status + (f" ({o.detail})" if o.detail else "")
        tests = ", ".join(Path(t).name for t in o.tests) or "-"
        failures = "-" if o.failures is None else str(o.failures)
        lines.append(f"| {o.name} | {o.path} | {tests} | {status.replace('|', '/')} | {failures} | {o.seconds:.0f} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these mutations")
    parser.add_argument("--list", action="store_true", help="list the mutations (and whether each still applies)")
    parser.add_argument("--jobs", type=int, default=1, help="mutations run at the same time (default 1)")
    parser.add_argument("--full-suite", action="store_true", help="run the whole tests/ (with -x) per mutation")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per pytest run (default 1800)")
    parser.add_argument("--out", default=DEFAULT_OUT, help=f"markdown report, JSON beside it (default {DEFAULT_OUT})")
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.list:
        for m in MUTATIONS:
            count = occurrences(m, ROOT)
            print(f"{m.name:45s} {m.path:40s} {'ok' if count == 1 else f'ROTTEN ({count})':12s} {m.what}")
        return 0
    known = {m.name: m for m in MUTATIONS}
    unknown = [n for n in args.only or [] if n not in known]
    if unknown:
        raise SystemExit(f"mutation_check: unknown mutation(s) {unknown}; --list shows the names")
    selected = [known[n] for n in args.only] if args.only else list(MUTATIONS)
    files = repository_files(ROOT)
    union, missing = resolve_tests([p for m in selected for p in m.tests], ROOT)
    for pattern in [] if args.full_suite else missing:
        print(f"warning: no test file matches {pattern} (skipped)", file=sys.stderr)
    union = ["tests"] if args.full_suite else union
    print(f"baseline: {len(union)} test file(s) on an unmutated copy ...", flush=True)
    baseline_seconds = run_baseline(files, union, args)
    outcomes: List[Outcome] = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for outcome in pool.map(lambda m: run_mutation(m, files, args), selected):
            print(f"{outcome.name}: {outcome.status} ({outcome.failures} failures, {outcome.seconds:.0f} s)",
                  flush=True)
            outcomes.append(outcome)
    command = " ".join(["python", "tests/tools/mutation_check.py", *(argv or sys.argv[1:])])
    report = render(outcomes, baseline_seconds, command)
    print(report)
    out = ROOT / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report, encoding="utf-8")
    out.with_suffix(".json").write_text(json.dumps([asdict(o) for o in outcomes], indent=1) + "\n", encoding="utf-8")
    return 0 if all(o.status == "caught" for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
