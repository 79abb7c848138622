"""benchmarks/bench_gpu.py's own code on the CPU (``--smoke``: tiny shapes, no flash-linear-attention): the GPU script
must not have rotted by the time a session is lent a GPU, whose minutes are too few to debug it there."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_gpu_smoke_run_writes_every_section(tmp_path):
    out = tmp_path / "bench_gpu.json"
    sections = ["peaks", "auto_crossover", "kernel_times", "model_1p3b"]
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_gpu.py"), "--smoke", "--no_fla", "--rounds", "1",
                    "--head_sizes", "16", "32", "--sections", *sections, "--out", str(out)], check=True, cwd=ROOT,
                   capture_output=True, timeout=600)
    results = json.loads(out.read_text())
    assert results["device"] == "cpu (--smoke)" and list(results["sections"]) == sections
    for name, section in results["sections"].items():
        assert "error" not in section, (name, section.get("error"))
    times = results["sections"]["kernel_times"]
    for key in ("delta-bfloat16", "sum-float32", "gated-bfloat16", "delta-float32-D32", "gated-bfloat16-D32"):
        row = times[key]
        assert not [n for n in row if n.endswith("_error")], row
        assert {"ours_triton_fwd_s", "ours_triton_fwd_bwd_s", "ours_torch_chunk_fwd_s", "step_loop_fwd_s"} <= set(row)
    assert set(results["sections"]["auto_crossover"]) - {"section_wall_s"} == {"1", "8"}
    model = results["sections"]["model_1p3b"]  # without fla: ours (from config_from_fla) and the Llama
    assert set(model["prefill_s"]) == set(model["decode_ms_per_token"]) == {"ours", "llama"}, model
    against_fp32 = model["logits_half"]["against_ours_float32"]["ours_bf16"]
    assert 0 < against_fp32["relative_error"] < 0.1, against_fp32  # bf16 rounding, not a wrong model


def test_bench_gpu_compile_only_calls_each_contender_once_and_times_nothing(tmp_path):
    """``--compile_only`` (gpu_check.sh fills Triton's caches with it beside the tests): the rules asked for, every
    contender called without error, no time recorded."""
    out = tmp_path / "bench_gpu.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_gpu.py"), "--smoke", "--no_fla", "--compile_only",
                    "--rules", "gated", "--dtypes", "float32", "--sections", "kernel_times", "--out", str(out)],
                   check=True, cwd=ROOT, capture_output=True, timeout=600)
    results = json.loads(out.read_text())
    times = results["sections"]["kernel_times"]
    assert results["compile_only"] and set(times) == {"shape", "gated-float32", "section_wall_s"}, times
    row = times["gated-float32"]
    assert not [n for n in row if n.endswith("_error")], row
    assert all(v["median"] != v["median"] for n, v in row.items()), row  # NaN: nothing timed
