"""The paper's associative retrieval experiment (training/associative_retrieval.py): data checked by an independent
solver, the memory checked against a step-loop fast weight reference, and smoke runs of both settings."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from training import associative_retrieval as ar
from training import synthetic


# --------------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("replace", [False, True])
def test_fixed_seed_gives_fixed_batch(replace):
    a = ar.retrieval_batch(np.random.default_rng(5), 6, 10, 10, replace, num_queries=3)
    b = ar.retrieval_batch(np.random.default_rng(5), 6, 10, 10, replace, num_queries=3)
    c = ar.retrieval_batch(np.random.default_rng(6), 6, 10, 10, replace, num_queries=3)
    for name in ("keys", "values", "queries", "answers"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    assert not np.array_equal(a.keys, c.keys)


def independent_answer(keys, values, query):
    """The latest value stored under `query`, by scanning the sequence from the end."""
    for key, value in reversed(list(zip(keys.tolist(), values.tolist()))):
        if key == query:
            return value
    raise AssertionError(f"query {query} does not occur")


def test_capacity_batches_are_unique_pairs_with_correct_answers():
    batch = ar.retrieval_batch(np.random.default_rng(0), 50, 12, 12, replace=False, num_queries=4)
    assert batch.keys.shape == batch.values.shape == (50, 12) and batch.queries.shape == (50, 4)
    for keys, values, queries, answers in zip(batch.keys, batch.values, batch.queries, batch.answers):
        assert sorted(keys.tolist()) == list(range(12)) and sorted(values.tolist()) == list(range(12))
        assert len(set(queries.tolist())) == 4  # distinct positions, hence distinct keys without replacement
        assert [independent_answer(keys, values, q) for q in queries] == answers.tolist()


def test_update_rule_batches_answer_the_latest_value():
    seq_len, num_keys = ar.setting_lengths("update_rules", 20)
    assert (seq_len, num_keys) == (40, True)
    batch = ar.retrieval_batch(np.random.default_rng(1), 200, 20, 40, replace=True, num_queries=2)
    overwritten = 0
    for keys, values, queries, answers in zip(batch.keys, batch.values, batch.queries, batch.answers):
        assert [independent_answer(keys, values, q) for q in queries] == answers.tolist()
        first = {int(k): int(v) for k, v in reversed(list(zip(keys, values)))}  # value at the first occurrence
        overwritten += sum(first[int(q)] != int(a) for q, a in zip(queries, answers))
    assert overwritten > 100  # most queried keys were re-assigned: remembering the first value is not enough


def test_bad_arguments_raise_value_error():
    with pytest.raises(ValueError, match="seq_len"):
        ar.retrieval_batch(np.random.default_rng(0), 2, 5, 8, replace=False)
    with pytest.raises(ValueError, match="num_queries"):
        ar.retrieval_batch(np.random.default_rng(0), 2, 5, 4, replace=False, num_queries=5)
    with pytest.raises(ValueError, match="memory"):
        ar.parse_memory("delta-cosine")
    with pytest.raises(ValueError, match="unknown ablation"):
        ar.parse_memory("sum-dpfp1-beta1")
    with pytest.raises(ValueError, match="setting"):
        ar.setting_lengths("sorting", 4)


def test_memory_names():
    spec = ar.parse_memory("dpfp3")
    assert (spec.update_rule, spec.feature_map, spec.dpfp_nu, spec.attention_normalization) == ("sum", "dpfp", 3, True)
    assert spec.feature_dim(16) == 96
    spec = ar.parse_memory("delta-favor32-beta1")
    assert (spec.update_rule, spec.favor_features, spec.sum_normalization, spec.learned_beta) == (
        "delta", 32, True, False)
    assert spec.feature_dim(16) == 64  # FAVOR+: d_dot = 2 m (Schlag et al. 2021 eq. 32)
    spec = ar.parse_memory("sum-linear-sumnorm")
    assert (spec.sum_normalization, spec.attention_normalization, spec.feature_dim(16)) == (True, False, 16)
    assert ar.parse_memory("softmax").attention == "softmax"


# --------------------------------------------------------------------------------------------------
# The memory against a step-loop reference
# --------------------------------------------------------------------------------------------------


def step_loop_reference(model: ar.RetrievalMemoryModel, keys, values, queries) -> torch.Tensor:
    """Writes the pairs one at a time into an explicit fast weight matrix, then reads every query."""
    spec = model.spec
    v = model.value_codes[values]
    x = torch.cat([v, model.key_embedding(keys)], dim=-1)
    phi_k = model.feature_map(model.key_proj(x)[:, None])[:, 0]
    phi_q = model.feature_map(model.query_proj(model.key_embedding(queries))[:, None])[:, 0]
    B, T, S = v.shape
    W = v.new_zeros(B, S, phi_k.shape[-1])
    z = v.new_zeros(B, phi_k.shape[-1])
    for t in range(T):
        k_t, v_t = phi_k[:, t], v[:, t]
        if spec.update_rule == "delta":
            beta = torch.sigmoid(model.beta_proj(x[:, t])) if model.beta_proj is not None else v.new_ones(B, 1)
            W = W + beta[:, :, None] * torch.einsum("bs,bf->bsf", v_t - torch.einsum("bsf,bf->bs", W, k_t), k_t)
        else:
            W = W + torch.einsum("bs,bf->bsf", v_t, k_t)
        z = z + k_t
    out = torch.einsum("bsf,bqf->bqs", W, phi_q)
    if spec.attention_normalization:
        out = out / torch.einsum("bf,bqf->bq", z, phi_q)[..., None]  # eq. 19
    return out


SUM_MEMORIES = ["linear", "dpfp2", "favor8", "sum-dpfp1-sumnorm"]
DELTA_MEMORIES = ["delta-dpfp1", "delta-linear", "delta-dpfp1-beta1", "delta-favor8-nosumnorm"]


@pytest.mark.parametrize(
    "memory, path",
    [(m, "kernel") for m in SUM_MEMORIES + DELTA_MEMORIES] + [(m, "closed_form") for m in SUM_MEMORIES],
)  # the closed form exists for the sum rule only
def test_memory_matches_step_loop(memory, path):
    spec = ar.parse_memory(memory)
    torch.manual_seed(0)
    model = ar.RetrievalMemoryModel(spec, num_keys=9, d_key=6, sum_rule_path=path).double()
    with torch.no_grad():  # a larger beta bias makes the delta rule's corrections matter
        if model.beta_proj is not None:
            model.beta_proj.bias.fill_(1.5)
    keys, values, queries, _ = ar.retrieval_batch(np.random.default_rng(2), 3, 9, 14, True, num_queries=5).tensors()
    out = model(keys, values, queries)
    ref = step_loop_reference(model, keys, values, queries)
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-10)
    # gradients vs autograd through the step loop
    grads = torch.autograd.grad(out.square().sum(), [p for p in model.parameters() if p.requires_grad])
    ref_grads = torch.autograd.grad(ref.square().sum(), [p for p in model.parameters() if p.requires_grad])
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-8, atol=1e-10)


def test_fwm_rule_is_the_delta_rule_inside_the_unit_ball():
    """While ||W||_F stays below 1 the FWM rule is the delta rule (our kernel) on unnormalised phi, read through LN."""
    torch.manual_seed(0)
    fwm = ar.RetrievalMemoryModel(ar.parse_memory("fwm-dpfp1"), num_keys=9, d_key=6).double()
    delta = ar.RetrievalMemoryModel(ar.parse_memory("delta-dpfp1-nosumnorm"), num_keys=9, d_key=6).double()
    with torch.no_grad():
        fwm.key_proj.weight.mul_(0.2)  # small keys: the memory stays inside the unit ball
        fwm.beta_proj.bias.fill_(1.5)
    delta.load_state_dict(fwm.state_dict())
    keys, values, queries, _ = ar.retrieval_batch(np.random.default_rng(2), 3, 9, 14, True, num_queries=5).tensors()
    x = torch.cat([fwm.value_codes[values], fwm.key_embedding(keys)], dim=-1)
    phi_k = fwm.feature_map(fwm.key_proj(x)[:, None])[:, 0]
    memory = ar.fast_weight_memory_rule(phi_k, fwm.value_codes[values], torch.sigmoid(fwm.beta_proj(x)).squeeze(-1))
    assert memory.flatten(1).norm(dim=-1).max() < 0.9
    torch.testing.assert_close(fwm(keys, values, queries),
                               torch.nn.functional.layer_norm(delta(keys, values, queries), (9,)),
                               rtol=1e-9, atol=1e-10)


def test_fwm_rule_rescales_to_the_unit_ball():
    """Large writes: every step ends with ||W_t||_F <= 1 (= 1 once it was exceeded), checked against numpy."""
    rng = np.random.default_rng(3)
    phi_k = torch.as_tensor(rng.uniform(0, 2, (2, 7, 5)))
    v = torch.as_tensor(np.eye(4)[rng.integers(0, 4, (2, 7))])
    beta = torch.as_tensor(rng.uniform(0.2, 1, (2, 7)))
    for b in range(2):
        W = np.zeros((4, 5))
        for t in range(7):
            k = phi_k[b, t].numpy()
            W = W + beta[b, t].item() * np.outer(v[b, t].numpy() - W @ k, k)
            W = W / max(1.0, np.linalg.norm(W))
        got = ar.fast_weight_memory_rule(phi_k[b:b + 1, :7], v[b:b + 1], beta[b:b + 1])[0].numpy()
        np.testing.assert_allclose(got, W, rtol=1e-12, atol=1e-14)
        assert abs(np.linalg.norm(got) - 1) < 1e-12  # these writes are large enough to need the rescaling
    with pytest.raises(ValueError, match="unknown ablation"):
        ar.parse_memory("fwm-dpfp1-beta1")


def test_softmax_memory_is_softmax_attention():
    torch.manual_seed(0)
    model = ar.RetrievalMemoryModel(ar.parse_memory("softmax"), num_keys=7, d_key=5).double()
    keys, values, queries, _ = ar.retrieval_batch(np.random.default_rng(3), 2, 7, 7, False, num_queries=3).tensors()
    out = model(keys, values, queries)
    for b in range(2):
        k = model.key_proj(torch.cat([model.value_codes[values[b]], model.key_embedding(keys[b])], -1))
        for i, query in enumerate(queries[b]):
            q = model.query_proj(model.key_embedding(query))
            weights = torch.softmax(k @ q / 5**0.5, dim=0)
            torch.testing.assert_close(out[b, i], weights @ model.value_codes[values[b]])


def test_small_memory_learns_below_capacity():
    """S = 4 pairs in an ELU+1 sum-rule memory of d_dot = 8: it learns to retrieve (chance loss is 0.375)."""
    torch.set_num_threads(1)
    config = ar.TrainConfig(d_key=8, max_steps=400, eval_every=50, train_queries=4, eval_sequences=50, seed=0)
    row = ar.train_memory("linear", "capacity", 4, config)
    assert row["final_accuracy"] == 1.0 and row["final_loss"] < 0.1, row["final_loss"]
    assert row["curve"][0]["loss"] > 0.3  # it started near chance: the low final loss was learned


# --------------------------------------------------------------------------------------------------
# Smoke runs: JSON and PNG outputs
# --------------------------------------------------------------------------------------------------

NO_MATPLOTLIB = "matplotlib is not installed: the plots are optional (the JSON results above are checked)"


def test_capacity_smoke(tmp_path):
    argv = ["capacity", "--memory", "softmax", "dpfp1", "--num_keys", "3", "5", "--d_key", "4", "--max_steps", "3",
            "--eval_every", "1", "--eval_sequences", "4", "--output_dir", str(tmp_path),
            "--results_file", str(tmp_path / "committed" / "capacity.json")]
    results = ar.main(argv)
    saved = json.loads((tmp_path / "capacity.json").read_text())
    assert [(r["memory"], r["num_keys"]) for r in saved["results"]] == [
        ("softmax", 3), ("dpfp1", 3), ("softmax", 5), ("dpfp1", 5)]
    assert all(np.isfinite(r["final_loss"]) and len(r["curve"]) >= 1 for r in saved["results"])
    # the run's record, and the same file at --results_file (the copy meant to be committed)
    assert saved["run"]["command"].startswith("python -m training.associative_retrieval capacity --memory softmax")
    assert len(saved["run"]["load_average_start"]) == len(saved["run"]["load_average_end"]) == 3
    assert (tmp_path / "committed" / "capacity.json").read_text() == (tmp_path / "capacity.json").read_text()
    pytest.importorskip("matplotlib", reason=NO_MATPLOTLIB)
    assert Path(results["plot"]).is_file() and Path(results["plot"]).stat().st_size > 1000


def test_update_rules_smoke_through_synthetic_cli(tmp_path):
    results = synthetic.main(["--task", "update_rules", "--memory", "sum-dpfp1", "delta-dpfp1-beta1", "fwm-dpfp1",
                              "--num_keys", "4", "--d_key", "4", "--max_steps", "2", "--eval_every", "1",
                              "--eval_sequences", "4", "--output_dir", str(tmp_path)])
    saved = json.loads((tmp_path / "update_rules.json").read_text())
    assert [(r["memory"], r["seq_len"]) for r in saved["results"]] == [
        ("sum-dpfp1", 8), ("delta-dpfp1-beta1", 8), ("fwm-dpfp1", 8)]
    plot = ar.main(["plot", "update_rules", str(tmp_path / "update_rules.json"), "--out", str(tmp_path / "c.png")])
    pytest.importorskip("matplotlib", reason=NO_MATPLOTLIB)
    assert Path(results["plot"]).is_file() and Path(plot["plot"]).is_file()
