"""benchmarks/lm_eval_check.py without lm-eval (not installed here): its ``lm_eval`` subprocess is replaced by a scorer
that reloads the exported folder, so the export, our scorer, the comparison and the result file (with the run record of
training/result_file.py) are what is checked; a disagreement still writes the file, then fails."""
import importlib.util
import json
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def lm_eval_check():
    spec = importlib.util.spec_from_file_location("lm_eval_check", ROOT / "benchmarks" / "lm_eval_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fake_lm_eval(module, scale=1.0):
    """Stands in for ``run_lm_eval``: each document's log-likelihood from the exported folder, reloaded (times
    `scale`), and records the folders it was given."""
    calls = []

    def run(folder, task_dir, out_dir):
        calls.append((folder, task_dir))
        assert (task_dir / f"{module.TASK_NAME}.yaml").is_file()
        model = AutoModelForCausalLM.from_pretrained(folder).eval()
        tokenizer = AutoTokenizer.from_pretrained(folder)
        return [scale * value for value in module.our_loglikelihoods(model, tokenizer, module.DOCUMENTS)]

    return run, calls


def test_result_file_has_the_run_record(lm_eval_check, monkeypatch, tmp_path):
    run, calls = fake_lm_eval(lm_eval_check)
    monkeypatch.setattr(lm_eval_check, "run_lm_eval", run)
    out = tmp_path / "results" / "lm_eval_check.json"
    argv = ["--families", "fwp_delta_net", "--output_dir", str(tmp_path / "work"), "--out", str(out)]
    returned = lm_eval_check.main(argv)
    saved = json.loads(out.read_text())
    assert saved["run"]["command"].startswith("python benchmarks/lm_eval_check.py --families fwp_delta_net")
    assert {"versions", "machine", "git_commit", "wall_s", "load_average_end"} <= set(saved["run"])
    assert saved["run"]["versions"]["torch"] and "lm_eval_version" in saved
    result = saved["models"]["fwp_delta_net"]
    assert result["agree"] and result["max_relative_difference"] <= lm_eval_check.TOLERANCE
    assert len(result["ours"]) == len(lm_eval_check.DOCUMENTS) and all(v < 0 for v in result["ours"])
    assert result["perplexity_ours"] == pytest.approx(result["perplexity_lm_eval"], rel=1e-6)
    assert json.loads((tmp_path / "work" / "report.json").read_text()) == saved  # the copy beside the exports
    assert [folder.name for folder, _ in calls] == ["fwp_delta_net"] and returned["models"].keys() == {"fwp_delta_net"}


def test_disagreement_is_written_then_fails(lm_eval_check, monkeypatch, tmp_path):
    run, _ = fake_lm_eval(lm_eval_check, scale=1.001)  # 1e-3 relative: ten times the tolerance
    monkeypatch.setattr(lm_eval_check, "run_lm_eval", run)
    out = tmp_path / "lm_eval_check.json"
    with pytest.raises(SystemExit, match="disagree.*fwp_delta_net"):
        lm_eval_check.main(["--families", "fwp_delta_net", "--output_dir", str(tmp_path / "work"), "--out", str(out)])
    result = json.loads(out.read_text())["models"]["fwp_delta_net"]
    assert not result["agree"] and result["max_relative_difference"] == pytest.approx(1e-3, rel=1e-2)
