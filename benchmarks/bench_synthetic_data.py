"""Memory of ``training.synthetic``'s training set: held in memory vs written to disk and memory-mapped.

Each mode builds the same ``--examples`` code-execution programs (3 variables, ``--statements`` statements, seed 0)
with ``synthetic.make_dataset`` in a fresh subprocess, then reads the longest example the way ``train_one`` does,
and reports the growth of the process's anonymous (private, non-file-backed) resident memory and of its peak RSS.
Pages of a memory-mapped Arrow file are file-backed: the kernel can drop them and read them again, so they are
counted apart (``file_mb``). Both modes are checked to give the same rows.

    python benchmarks/bench_synthetic_data.py [--examples 50000] [--statements 30] [--out PATH]

Writes benchmarks/results/bench_synthetic_data.json, with the run's command, versions and load average before and
after (``"run"``, ``training.result_file``). Each mode is measured once (memory, not time: no repeats).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from training.result_file import RunRecord  # noqa: E402

CHILD = r"""
import hashlib, json, sys, time
sys.path.insert(0, sys.argv[1])
from training import synthetic
import pyarrow.compute as pc

def memory():
    status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines() if ":" in line)
    mb = lambda key: int(status[key].split()[0]) / 1024
    return {"anon_mb": mb("RssAnon"), "file_mb": mb("RssFile"), "peak_mb": mb("VmHWM")}

examples, statements, cache_dir = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] or None
spec = synthetic.build_task("code", num_variables=3, num_statements=statements)
before = memory()
start = time.perf_counter()
data = synthetic.make_dataset(spec, examples, seed=0, cache_dir=cache_dir)
longest = pc.max(pc.list_value_length(data.data.column("input_ids"))).as_py()
seconds = time.perf_counter() - start
after = memory()
digest = hashlib.sha256(json.dumps(data[: min(examples, 2000)]).encode()).hexdigest()
print(json.dumps({"before": before, "after": after, "seconds": seconds, "longest": longest, "rows": len(data),
                  "digest_first_2000": digest}))
"""


def measure(examples: int, statements: int, cache_dir: str) -> dict:
    """Runs one mode in a fresh interpreter (one thread) and returns its memory figures."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", CHILD, str(ROOT), str(examples), str(statements), cache_dir],
                         check=True, capture_output=True, text=True, env=env).stdout
    row = json.loads(out.strip().splitlines()[-1])
    row["growth"] = {key: row["after"][key] - row["before"][key] for key in row["after"]}
    return row


def main() -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--examples", type=int, default=50_000)
    p.add_argument("--statements", type=int, default=30)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "bench_synthetic_data.json"))
    args = p.parse_args()
    record = RunRecord.start("python benchmarks/bench_synthetic_data.py")
    with tempfile.TemporaryDirectory() as tmp:
        in_memory = measure(args.examples, args.statements, "")
        on_disk = measure(args.examples, args.statements, tmp)
        disk_bytes = sum(f.stat().st_size for f in Path(tmp).glob("*.arrow"))
    if (in_memory["digest_first_2000"], in_memory["rows"], in_memory["longest"]) != (
            on_disk["digest_first_2000"], on_disk["rows"], on_disk["longest"]):
        raise SystemExit("the two modes built different datasets")
    result = {
        "examples": args.examples, "statements": args.statements, "in_memory": in_memory, "on_disk": on_disk,
        "arrow_file_mb": disk_bytes / 2**20,
        "anon_growth_ratio": in_memory["growth"]["anon_mb"] / max(on_disk["growth"]["anon_mb"], 1e-9),
    }
    for name, row in (("in memory", in_memory), ("on disk", on_disk)):
        g = row["growth"]
        print(f"{name:>9}: anonymous +{g['anon_mb']:.0f} MB, file-backed +{g['file_mb']:.0f} MB, "
              f"peak RSS +{g['peak_mb']:.0f} MB, {row['seconds']:.1f} s")
    print(f"Arrow file {result['arrow_file_mb']:.0f} MB; anonymous memory ratio (in memory / on disk) "
          f"{result['anon_growth_ratio']:.1f}x; same rows in both modes")
    print(f"wrote {record.write(args.out, result)}")
    return result


if __name__ == "__main__":
    main()
