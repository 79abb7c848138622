"""training.rl_table: the seeds of one (environment, core) pair become one row with the right statistics."""
import json
import statistics

import pytest

from training import rl_table


def write_run(folder, core, seed, returns, env="RepeatPreviousEasy", match_core=None, units=None, algorithm=None):
    """A curve.json as training.rl_popgym writes it: one point per 1,600 frames (no ``algorithm``: as before it)."""
    counts = {"lstm": 1000, "lstm_hidden_size": 10, "policy": 5} if core == "lstm" else {core: 900, "policy": 5}
    run = {"args": {"core": core, "env": env, "seed": seed, "match_core": match_core, "lstm_hidden_size": units},
           "curve": [{"frames": 1600 * (i + 1), "mean_return": r} for i, r in enumerate(returns)],
           "frames": 1600 * len(returns), "frames_per_s": 100.0 + seed, "parameters": counts}
    if algorithm is not None:
        run["args"]["algorithm"] = algorithm
    path = folder / f"{core}_{match_core}_{algorithm}_s{seed}" / "curve.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(run))


def test_rows_average_seeds_and_keep_matched_lstms_apart(tmp_path):
    write_run(tmp_path, "recurrent_delta_net", 0, [-0.5, 0.0, 0.2, 0.4, 0.6, 0.8, 0.9, 1.0, 1.0, 0.6])
    write_run(tmp_path, "recurrent_delta_net", 1, [-0.5, 0.0, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.2])
    write_run(tmp_path, "lstm", 0, [-0.5] * 10, match_core="recurrent_delta_net")
    write_run(tmp_path, "lstm", 0, [-0.4] * 10, match_core="delta_lstm")
    write_run(tmp_path, "recurrent_delta_net", 0, [0.0] * 10, algorithm="impala")  # the same seed, another learner
    rows = rl_table.load(tmp_path)
    labels = [row.label for row in rows]
    assert labels == ["LSTM (10 units, for delta_lstm)", "LSTM (10 units, for recurrent_delta_net)",
                      "Recurrent Delta Net", "Recurrent Delta Net, IMPALA"]
    assert rows[-1].seeds() == [0] and rows[-1].runs[0]["curve"][0]["mean_return"] == 0.0
    rdn = rows[-2]
    assert rdn.seeds() == [0, 1] and rdn.core_parameters == 900
    # the last 10% of 16,000 frames is the last point; the mean return weighs every point alike
    finals = [rl_table.final_return(run, 0.1) for run in rdn.runs]
    assert finals == [0.6, 0.2]
    assert rl_table.final_return(rdn.runs[0], 0.2) == pytest.approx(0.8)
    assert rl_table.mean_return(rdn.runs[1]) == pytest.approx(statistics.mean(
        [-0.5, 0.0, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.2]))
    table = rl_table.render(rows)
    assert f"| Recurrent Delta Net | 900 | 0, 1 | 16,000 | +0.400 ± {statistics.stdev([0.6, 0.2]):.3f} |" in table
    assert "| LSTM (10 units, for recurrent_delta_net) | 1,000 | 0 | 16,000 | -0.500 | -0.500 | 100.0 |" in table
    # frames until the mean of 3 consecutive points reaches 0.5: seed 0 at its 6th point (0.4, 0.6, 0.8), seed 1 never
    assert [rl_table.frames_to_return(run, 0.5, window=3) for run in rdn.runs] == [1600 * 6, None]
    assert rl_table.frames_to_return(rdn.runs[0], 0.0) == 1600 * 10  # the default 10-point window: the whole curve
    learned = rl_table.render(rows, learned_return=0.3)
    assert "| frames to a return of +0.30 (per seed) | frames/s |\n|---|---|---|---|---|---|---|---|" in learned
    assert "| Recurrent Delta Net | 900 | 0, 1 | 16,000 | +0.400 ± " in learned and "| 16,000, - | 100.5 |" in learned


def test_plot_and_bad_input(tmp_path):
    write_run(tmp_path, "delta_lstm", 0, [-0.5, 0.5])
    write_run(tmp_path, "delta_lstm", 1, [-0.3, 0.1])
    out = tmp_path / "table.md"
    rl_table.main([str(tmp_path), "--output", str(out), "--plot", str(tmp_path / "fig_{env}.png")])
    assert (tmp_path / "fig_RepeatPreviousEasy.png").stat().st_size > 0 and "Delta LSTM" in out.read_text()
    with pytest.raises(ValueError, match="--plot"):
        rl_table.main([str(tmp_path), "--plot", str(tmp_path / "fig.png")])
    with pytest.raises(ValueError, match="--final_fraction"):
        rl_table.main([str(tmp_path), "--final_fraction", "0"])
    (tmp_path / "ppo").mkdir()  # a run that names the default learner is a seed of the same row as one that does not
    write_run(tmp_path / "ppo", "delta_lstm", 1, [0.0], algorithm="ppo")
    with pytest.raises(ValueError, match="seed 1"):
        rl_table.load(tmp_path)
    (tmp_path / "ppo" / "delta_lstm_None_ppo_s1" / "curve.json").unlink()
    (tmp_path / "again").mkdir()
    write_run(tmp_path / "again", "delta_lstm", 1, [0.0])
    with pytest.raises(ValueError, match="seed 1"):
        rl_table.load(tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no rl_popgym"):
        rl_table.load(tmp_path / "empty")
