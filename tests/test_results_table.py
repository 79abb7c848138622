"""The README's and kernels/README.md's figures against the committed result files, and the result-file helpers."""
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from training import result_file

ROOT = Path(__file__).resolve().parents[1]


def load_results_table():
    spec = importlib.util.spec_from_file_location("results_table", ROOT / "benchmarks" / "results_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


results_table = load_results_table()


def copy_of_repository(tmp_path: Path) -> Path:
    """The documents and result files that the tables are rendered from, copied under `tmp_path`."""
    for name in list(results_table.DOCUMENTS) + ["benchmarks/results", "docs/results"]:
        src, dst = ROOT / name, tmp_path / name
        if src.is_dir():
            shutil.copytree(src, dst)
        elif src.is_file():
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(src, dst)
    return tmp_path


def check(root: Path) -> subprocess.CompletedProcess:
    script = ROOT / "benchmarks" / "results_table.py"
    return subprocess.run([sys.executable, str(script), "--check", "--root", str(root)], capture_output=True, text=True)


def test_committed_documents_match_their_result_files():
    """Every generated table in README.md and kernels/README.md equals its rendering from the committed files: a
    figure edited by hand, or a result file rerun without `python benchmarks/results_table.py`, fails here."""
    done = check(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr


def test_check_fails_on_a_stale_figure_and_the_renderer_fixes_it(tmp_path):
    root = copy_of_repository(tmp_path)
    path = root / "benchmarks" / "results" / "bench_training.json"
    data = json.loads(path.read_text())
    data["lengths"]["256"]["step_s"]["llama_sdpa"] *= 2  # the best Llama step of T=256 is now twice as long
    path.write_text(json.dumps(data))
    done = check(root)
    assert done.returncode == 1 and "README.md" in done.stdout
    old = data["lengths"]["256"]["tokens_per_s"]["llama_sdpa"]
    new = old / 2
    assert "+| training tok/s" in done.stdout and f"{new:,.0f} / " in done.stdout and f"{old:,.0f} / " in done.stdout
    assert results_table.main(["--root", str(root)]) == 0  # rewrites the table
    assert check(root).returncode == 0

    readme = root / "README.md"  # a figure edited by hand inside a generated table
    readme.write_text(readme.read_text().replace("196,616 / 196,616", "196,616 / 196,617", 1))
    assert check(root).returncode == 1


def test_missing_figures_read_na_and_medians_come_from_stored_rounds(tmp_path):
    """A file without the run record or a median renders "n/a (rerun)" there; a median it can take from the stored
    per-round values is taken from them."""
    (tmp_path / "old.json").write_text(json.dumps({"steps": [3.0, 1.0, 2.0, 10.0], "best": 1.0}))
    source = results_table.Source(tmp_path, "old.json")
    assert source.pair("median", "best") == (None, 1.0)
    assert source.pair("median", "best", "steps") == (2.5, 1.0)
    assert source.provenance() == "`old.json`: command n/a (rerun); load n/a (rerun) -> n/a (rerun)"
    assert "n/a (rerun) median; 1.0 best" == results_table.both("{t:.1f}", t=source.pair("median", "best"))
    assert "no such file" in results_table.Source(tmp_path, "missing.json").provenance()


def test_replace_block_needs_its_markers():
    start, end = results_table.START.format(name="x"), results_table.END.format(name="x")
    assert results_table.replace_block(f"a\n{start}\nold\n{end}\nb", "x", "new") == f"a\n{start}\nnew\n{end}\nb"
    with pytest.raises(ValueError, match="results-table:x"):
        results_table.replace_block("no markers", "x", "new")


@pytest.mark.parametrize("script, argv, rows", [
    ("bench_generation.py", ["--contexts", "4", "8", "--steps", "2", "--threads", "1"], "generation_rows"),
    ("bench_training.py", ["--lengths", "4", "8", "--rounds", "2", "--vocab", "32", "--batch", "1", "--threads", "1"],
     "training_rows"),
    ("bench_decode.py", ["--quick", "--dtypes", "float32", "--threads", "1"], "decode_rows"),
    ("bench_decode.py", ["--quick", "--dtypes", "bfloat16", "--threads", "1", "--compile"], "compiled_decode_rows"),
    ("bench_decode.py", ["--quick", "--dtypes", "bfloat16", "--threads", "1", "--batch_size", "2"],
     "decode_batch_rows"),
])
def test_a_fresh_benchmark_file_renders_every_figure(tmp_path, script, argv, rows):
    """A benchmark run now (tiny settings) writes a file that the table renders without any "n/a": the run record
    (command, versions, load averages) and medians beside bests."""
    out = tmp_path / "result.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *argv, "--out", str(out)],
                          capture_output=True, text=True, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    run = json.loads(out.read_text())["run"]
    assert run["command"] == f"OMP_NUM_THREADS=1 python benchmarks/{script} {' '.join(argv)} --out {out}"
    assert run["versions"]["torch"] and run["machine"]["torch_threads"] == 1 and len(run["load_average_end"]) == 3
    source = results_table.Source(tmp_path, "result.json")
    cells = [cell for row in getattr(results_table, rows)(source) for cell in row] + [source.provenance()]
    assert not [cell for cell in cells if results_table.NA in cell], cells
    assert all(" median; " in cell for cell in cells if " best" in cell)


def test_command_line_quotes_arguments_and_records_thread_variables(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    line = result_file.command_line("python benchmarks/x.py", ["--out", str(ROOT / "a b.json"), "--n", "3"])
    assert line == "OMP_NUM_THREADS=1 python benchmarks/x.py --out 'a b.json' --n 3"
    with pytest.raises(ValueError, match="program"):
        result_file.command_line("", [])


def test_summaries_and_ratios():
    times = result_file.summarize([0.4, 0.1, 0.3, 0.2])
    assert times == {"best": 0.1, "median": 0.25, "all": [0.4, 0.1, 0.3, 0.2]}
    assert result_file.summarize([5, 9, 7], best="max")["best"] == 9
    assert result_file.ratio(result_file.summarize([2.0, 4.0, 9.0]), times) == {"of_medians": 16.0, "of_bests": 20.0}
    assert result_file.scaled(times, 1e3)["median"] == pytest.approx(250.0)
    with pytest.raises(ValueError, match="best"):
        result_file.summarize([1.0], best="mean")
    with pytest.raises(ValueError, match="empty"):
        result_file.summarize([])


def test_environment_names_versions_threads_and_machine():
    import platform

    import torch
    import transformers

    assert result_file.environment() == {
        "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
        "threads": torch.get_num_threads(), "machine": platform.machine()}


def test_run_record_written_with_results(tmp_path):
    record = result_file.RunRecord.start("python benchmarks/x.py", ["--n", "3"])
    path = record.write(tmp_path / "sub" / "x.json", {"value": 1}, copies=[tmp_path / "copy.json"])
    data = json.loads(path.read_text())
    assert data["value"] == 1 and data["run"]["command"] == "python benchmarks/x.py --n 3"
    assert set(data["run"]) >= {"started", "finished", "wall_s", "git_commit", "versions", "machine",
                                "load_average_start", "load_average_end"}
    assert data["run"]["versions"]["python"] and data["run"]["machine"]["cpus"] == os.cpu_count()
    flags = data["run"]["machine"]["cpu_flags"]
    generation = data["run"]["machine"]["cpu_generation"]
    assert generation is None or re.fullmatch(r"family \d+ model \d+", generation), generation
    assert flags is None or set(flags) <= set(result_file.CPU_VECTOR_FLAGS)
    source = results_table.Source(tmp_path, "sub/x.json")
    data["run"]["machine"]["cpu_flags"] = ["avx2", "avx512f"]  # the provenance line says which kernels could run
    source.data = data
    assert "avx2 avx512f); commit" in source.versions()
    data["run"]["machine"]["cpu_flags"] = []
    assert "no AVX2); commit" in source.versions()
    data["run"]["machine"]["cpu_generation"] = "family 25 model 17"  # Zen 4 and Zen 5 VMs share the model name
    assert f"({data['run']['machine']['cpu_model']} family 25 model 17, no AVX2); commit" in source.versions()
    del data["run"]["machine"]["cpu_flags"], data["run"]["machine"]["cpu_generation"]  # an older file: nothing added
    assert f"({data['run']['machine']['cpu_model']}); commit" in source.versions()
    assert (tmp_path / "copy.json").read_text() == path.read_text()
    with pytest.raises(ValueError, match="run"):
        record.write(tmp_path / "y.json", {"run": 1})


def test_trained_fwl_row_appears_only_when_timed(tmp_path):
    """bench_test_time_fwl run with --fwl_model adds the trained FWL's row (goal <= 1.2x), its ratio to the base of
    the same run; without it, one row."""
    methods = ("base", "test_time_fwl_off", "test_time_fwl", "test_time_fwl_bf16", "test_time_fwl_with_gain",
               "test_time_fwl_with_gain_bf16", "test_time_fwl_seen", "dynamic_output", "dynamic")
    data = {"tokens": 1023, "settings": {"model": "m", "threads": 2, "repeats": 3},
            "seconds": {m: {"median": 2.0, "best": 1.0, "all": [1.0, 2.0, 3.0]} for m in methods}}
    (tmp_path / "a.json").write_text(json.dumps(data))
    assert len(results_table.test_time_fwl_rows(results_table.Source(tmp_path, "a.json"))) == 1
    data["settings"]["fwl_model"] = "outputs/x/base_fwl/final"
    data["seconds"]["trained_fwl"] = {"median": 2.3, "best": 1.1, "all": [1.1, 2.3, 2.5]}
    data["seconds"]["trained_fwl_slow_only"] = {"median": 2.1, "best": 1.05, "all": [1.05, 2.1, 2.2]}
    (tmp_path / "b.json").write_text(json.dumps(data))
    rows = results_table.test_time_fwl_rows(results_table.Source(tmp_path, "b.json"))
    assert rows[1][0].startswith("trained FWL (3), outputs/x/base_fwl/final")
    assert rows[1][1] == "**1.15x the base** median; 1.10x the base best" and "(3') 1.05x" in rows[1][2]
    assert rows[1][3] == "<= 1.2x the base"
    data["seconds"]["trained_fwl_seen"] = {"median": 1.8, "best": 1.0, "all": [1.0, 1.8, 1.9]}
    (tmp_path / "c.json").write_text(json.dumps(data))
    rows = results_table.test_time_fwl_rows(results_table.Source(tmp_path, "c.json"))
    assert rows[1][1] == ("**1.15x the base; its update on the seen rows 0.90x** median; "
                          "1.10x the base; its update on the seen rows 1.00x best")


def test_trained_segment_start_row_quotes_the_trained_fwl_and_its_neighbours(tmp_path):
    """bench_test_time_fwl with a segment-start trained FWL: (3)'s ratio to the base of the same run, beside its slow
    head and both test-time updates; a method the file lacks reads n/a, never a number from elsewhere."""
    seconds = {"base": 2.0, "test_time_fwl": 2.6, "test_time_fwl_segment_start": 2.8, "trained_fwl": 2.5,
               "trained_fwl_slow_only": 1.9}
    data = {"tokens": 1023, "settings": {"threads": 2, "repeats": 3, "fwl_model": "outputs/s/base_fwl/final"},
            "seconds": {m: {"median": v, "best": v / 2, "all": [v / 2, v, v]} for m, v in seconds.items()}}
    (tmp_path / "a.json").write_text(json.dumps(data))
    [row] = results_table.trained_segment_start_rows(results_table.Source(tmp_path, "a.json"))
    assert "outputs/s/base_fwl/final" in row[0] and "3 interleaved rounds" in row[0]
    assert row[1] == "**1.25x the base** median; 1.25x the base best"
    assert row[2].startswith("its slow head alone (3') 0.95x; test-time FWL on (1): segment start 1.40x, the paper's "
                             "update 1.30x; base 2.00 s median") and row[3] == "<= 1.2x the base"
    del data["seconds"]["trained_fwl_slow_only"]
    (tmp_path / "b.json").write_text(json.dumps(data))
    [row] = results_table.trained_segment_start_rows(results_table.Source(tmp_path, "b.json"))
    assert row[2].startswith(results_table.NA)
    # timed with the update on the seen rows too (trained and test-time): both ratios quoted beside the others
    data["seconds"]["trained_fwl_seen"] = {"median": 2.2, "best": 1.0, "all": [1.0, 2.2, 2.4]}
    data["seconds"]["test_time_fwl_segment_start_seen"] = {"median": 2.1, "best": 1.1, "all": [1.1, 2.1, 2.3]}
    data["seconds"]["trained_fwl_slow_only"] = {"median": 1.9, "best": 0.95, "all": [0.95, 1.9, 2.0]}
    (tmp_path / "c.json").write_text(json.dumps(data))
    [row] = results_table.trained_segment_start_rows(results_table.Source(tmp_path, "c.json"))
    assert row[1] == ("**1.25x the base; its update on the seen rows (`fwl_fast_vocabulary=\"seen\"`) 1.10x** median; "
                      "1.25x the base; its update on the seen rows (`fwl_fast_vocabulary=\"seen\"`) 1.00x best")
    assert row[2].startswith("its slow head alone (3') 0.95x; test-time FWL on (1): segment start 1.40x, on the seen "
                             "rows 1.05x, the paper's update 1.30x; base 2.00 s median")
    assert "trained with its update on the seen rows" not in row[0]
    data["trained_fwl_head"] = {"gradient_point": "segment_start", "fast_vocabulary": "seen"}  # as the bench records it
    (tmp_path / "d.json").write_text(json.dumps(data))
    [row] = results_table.trained_segment_start_rows(results_table.Source(tmp_path, "d.json"))
    assert "segments of 128), trained with its update on the seen rows, outputs/s/base_fwl/final" in row[0]


def test_one_table_row_quotes_the_goals_and_perplexities(tmp_path):
    """document_eval --one_table's file gives one row: (3)'s perplexity and ratio to (2), the gain ratio and time of
    the first goal, the test-time FWL on (1) for the second, met / not met as the file records them."""
    def result(ppl, seconds):
        return {"summary": {"perplexity": ppl, "tokens": 1000, "seconds": seconds}}

    data = {"documents": 2, "settings": {"data_dir": "data/wiki", "max_length": 4096, "fwl_model": "f"},
            "results": {"base": result(20.0, 10.0), "finetuned": result(16.0, 10.0),
                        "finetuned_dynamic": result(15.0, 30.0), "fwl": result(15.4, 11.0),
                        "fwl_slow_only": result(15.9, 10.0), "finetuned_test_time_fwl": result(15.8, 11.0),
                        "test_time_fwl": result(19.8, 11.0)},
            "goals": {"trained_fwl": {"gain_ratio": 0.6, "time_vs_base": 1.1, "met": True},
                      "test_time_fwl_on_base": {"ppl_ratio": 0.99, "time_vs_base": 1.1, "met": False}}}
    (tmp_path / "t.json").write_text(json.dumps(data))
    [row] = results_table.one_table_rows(results_table.Source(tmp_path, "t.json"))
    assert row[0].startswith("issue 17's one table: 2 held-out test articles of `data/wiki` (1,000 tokens")
    assert row[1] == ("**trained FWL (3): perplexity 15.400, 0.9625 of (2)'s, gain ratio 0.60 at 1.10x the base's "
                      "time (goal met by this one-pass time); test-time FWL on (1): 19.800, 0.9900 of (1)'s at 1.10x "
                      "(goal not met)**")
    assert "(2) + dynamic evaluation 15.000 at 3.00x the base's time" in row[2] and "(3') 15.900" in row[2]
    del data["goals"]
    (tmp_path / "u.json").write_text(json.dumps(data))
    [row] = results_table.one_table_rows(results_table.Source(tmp_path, "u.json"))
    assert row[1] == "n/a (rerun)"
