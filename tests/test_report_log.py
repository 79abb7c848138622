"""tests/conftest.py's FWP_REPORT_LOG: the GPU checks' record of each test as it ends, kept when a time limit stops
pytest before its summary (the first H100 run lost a failure's message so)."""
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_report_log_holds_each_failure_and_printed_output_as_the_test_ends(tmp_path):
    (tmp_path / "test_sample.py").write_text(
        "def test_prints():\n    print('relative errors: 1e-7')\n\n"
        "def test_fails():\n    assert 1 == 2, 'the message that must survive'\n\n"
        "def test_silent():\n    pass\n"
    )
    log = tmp_path / "reports.log"
    env = {**os.environ, "FWP_REPORT_LOG": str(log), "PYTHONPATH": str(TESTS)}
    env.pop("PYTEST_XDIST_WORKER", None)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest", "--rootdir", str(tmp_path),
         str(tmp_path / "test_sample.py")], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 1, result.stdout + result.stderr  # one test fails
    text = log.read_text()
    assert "==== PASSED test_sample.py::test_prints (call)\nrelative errors: 1e-7" in text, text
    assert "==== FAILED test_sample.py::test_fails (call)" in text and "the message that must survive" in text, text
    assert "test_silent" not in text, text  # nothing printed, nothing failed: not logged
