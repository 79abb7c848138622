"""training/rl_popgym.py: the policy's core wrapper (no RL library needed) and, with the `rl` extra, PPO end to end."""
from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from training import rl_popgym as rl

RL_MISSING = [name for name in ("torchrl", "tensordict", "popgym", "gymnasium")
              if importlib.util.find_spec(name) is None]
needs_rl = pytest.mark.skipif(bool(RL_MISSING), reason=f"the `rl` extra is not installed (missing {RL_MISSING}): "
                                                       "pip install -e '.[rl]'")


def small_args(**overrides) -> rl.RLArguments:
    values = dict(hidden_size=16, num_layers=2, num_heads=2, intermediate_size=32)
    values.update(overrides)
    return rl.RLArguments(**values)


def make_core(name: str, input_size: int = 5) -> rl.PolicyCore:
    torch.manual_seed(0)
    core, _ = rl.build_core(input_size, small_args(core=name))
    return rl.PolicyCore(core).eval()


@pytest.mark.parametrize("name", ["lstm", "recurrent_delta_net", "delta_rnn", "delta_lstm", "delta_net"])
def test_rollout_with_resets_equals_stepping_one_step_at_a_time(name):
    """What training sees (a [B, T] row from its first state, resets inside) equals what collection did (one step per
    call, the state zeroed at each episode start), outputs and final state."""
    core = make_core(name)
    B, T = 3, 9
    x = torch.randn(B, T, 5)
    reset = torch.zeros(B, T, dtype=torch.bool)
    reset[0, 3] = reset[1, 0] = reset[1, 6] = reset[2, 8] = True
    start = tuple(torch.randn_like(s) for s in core.initial_state(B))  # a state carried over from an earlier batch
    with torch.no_grad():
        y, final = core(x, start, reset)
        state, steps = start, []
        for t in range(T):
            y_t, state = core(x[:, t:t + 1], state, reset[:, t:t + 1])
            steps.append(y_t)
    torch.testing.assert_close(y, torch.cat(steps, dim=1), rtol=1e-4, atol=1e-5)
    for a, b in zip(final, state):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["lstm", "recurrent_delta_net"])
def test_reset_forgets_the_episode_before_it(name):
    """After a reset, the outputs depend on nothing before it: a row whose past differs gives the same outputs from
    the reset on (and different ones before it)."""
    core = make_core(name)
    x = torch.randn(1, 8, 5).repeat(2, 1, 1)
    x[1, :4] = torch.randn(4, 5)
    reset = torch.zeros(2, 8, dtype=torch.bool)
    reset[:, 4] = True
    with torch.no_grad():
        y, _ = core(x, None, reset)
        y_no_reset, _ = core(x, None, None)
    torch.testing.assert_close(y[0, 4:], y[1, 4:])
    assert not torch.allclose(y[0, :4], y[1, :4])
    assert not torch.allclose(y_no_reset[0, 4:], y_no_reset[1, 4:])


def test_lstm_is_matched_to_the_fast_weight_core_in_parameter_count():
    core, counts = rl.build_core(7, rl.RLArguments(core="lstm"))
    assert isinstance(core, rl.LSTMCore) and counts["lstm_hidden_size"] == core.hidden_size
    assert counts["lstm"] == rl.lstm_parameters(7, core.hidden_size) == rl.count_parameters(core)
    assert abs(counts["lstm"] - counts["recurrent_delta_net"]) / counts["recurrent_delta_net"] < 0.01
    for other in (core.hidden_size - 1, core.hidden_size + 1):  # the closest width
        assert abs(counts["lstm"] - counts["recurrent_delta_net"]) <= abs(
            rl.lstm_parameters(7, other) - counts["recurrent_delta_net"])
    _, counts_dl = rl.build_core(7, rl.RLArguments(core="lstm", match_core="delta_lstm"))
    assert counts_dl["lstm_hidden_size"] > counts["lstm_hidden_size"]  # the Delta LSTM is the larger core


def test_bad_arguments_name_the_option():
    with pytest.raises(ValueError, match="--core"):
        rl.RLArguments(core="gru")
    with pytest.raises(ValueError, match="--num_minibatches"):
        rl.RLArguments(num_envs=2, num_minibatches=4)
    with pytest.raises(ValueError, match="--total_frames"):
        rl.main(["--total_frames", "0"])
    with pytest.raises(TypeError, match="core"):
        rl.PolicyCore(torch.nn.GRU(3, 4))
    with pytest.raises(ValueError, match="--algorithm"):
        rl.RLArguments(algorithm="a3c")
    with pytest.raises(ValueError, match="--ppo_epochs, --gae_lambda only apply to --algorithm ppo"):
        rl.RLArguments(algorithm="impala", ppo_epochs=2, gae_lambda=0.9)


def test_algorithm_defaults_fill_only_what_was_left_out():
    ppo, impala = rl.RLArguments(), rl.RLArguments(algorithm="impala", num_envs=2)  # no minibatch check for IMPALA
    assert (ppo.learning_rate, ppo.max_grad_norm) == (3e-4, 0.5)
    assert (impala.learning_rate, impala.max_grad_norm) == (6e-4, 40.0)  # Irie et al. 2021, appendix C
    assert rl.RLArguments(algorithm="impala", learning_rate=1e-3).learning_rate == 1e-3


@needs_rl
def test_bad_env_name_is_a_value_error():
    with pytest.raises(ValueError, match="--env"):
        rl.make_env("NoSuchTaskEasy")


@needs_rl
@pytest.mark.parametrize("core", ["recurrent_delta_net", "delta_rnn"])
def test_collected_logits_equal_the_recurrent_mode_recomputation(core):
    """torchrl's collector steps the core one step per call; the loss reruns whole rows in recurrent mode from the
    stored first state with is_init resets: before any update both give the same logits."""
    from torchrl.collectors import Collector
    from torchrl.modules import set_recurrent_mode

    args = small_args(core=core, env="RepeatPreviousEasy", num_envs=3, rollout_length=40,
                      num_minibatches=1)
    torch.manual_seed(0)
    agent = rl.build_agent(args)
    collector = Collector(agent["env"], agent["actor"], frames_per_batch=120, total_frames=240)
    batches = [b.clone() for b in collector]  # the second batch starts from states carried over from the first
    collector.shutdown()
    last = batches[-1]
    assert last["is_init"][:, 1:].any(), "RepeatPreviousEasy episodes (52 steps) must end inside 80 steps"
    assert last["core_state_0"][:, 0].abs().sum() > 0
    stored = last["logits"].clone()
    with set_recurrent_mode(True), torch.no_grad():
        recomputed = agent["actor"](last.exclude("logits"))["logits"]
    torch.testing.assert_close(recomputed, stored, rtol=1e-4, atol=1e-5)


def vtrace_reference(value, next_value, reward, done, terminated, log_pi, log_mu, gamma):
    """V-trace written from Espeholt et al. (2018), sec. 4.1, eq. (1) and sec. 4.2, one env row at a time, backwards:
    v_s = V(x_s) + rho_s delta_s + gamma c_s (v_{s+1} - V(x_{s+1})), delta_s = r_s + gamma V(x_{s+1}) - V(x_s), the
    policy-gradient advantage rho_s (r_s + gamma v_{s+1} - V(x_s)); rho and c clipped at 1; the trace cut where an
    episode ends and the bootstrap dropped where it terminates. All inputs ``[B, T]``."""
    B, T = value.shape
    targets, advantages = torch.zeros(B, T), torch.zeros(B, T)
    for b in range(B):
        correction = 0.0  # v_{s+1} - V(x_{s+1}) of the same episode
        for t in reversed(range(T)):
            rho = min(1.0, float(torch.exp(log_pi[b, t] - log_mu[b, t])))
            bootstrap = 0.0 if terminated[b, t] else gamma * float(next_value[b, t])
            trace = 0.0 if done[b, t] else gamma * rho * correction
            correction = rho * (float(reward[b, t]) + bootstrap - float(value[b, t])) + trace
            targets[b, t] = float(value[b, t]) + correction
            v_next = float(next_value[b, t]) if done[b, t] or t == T - 1 else float(targets[b, t + 1])
            advantages[b, t] = rho * (float(reward[b, t]) + (0.0 if terminated[b, t] else gamma * v_next)
                                      - float(value[b, t]))
    return advantages, targets


@needs_rl
def test_impala_learner_follows_the_vtrace_equations():
    """The IMPALA learner's V-trace targets and advantages on a collected batch, with episode ends inside and the
    behaviour log-probabilities perturbed (so that rho and c clip on some steps and not on others), equal the step
    loop written from the equations, given the values and the target policy's log-probabilities the learner used."""
    from torchrl.collectors import Collector
    from torchrl.modules import set_recurrent_mode

    args = small_args(core="recurrent_delta_net", env="RepeatPreviousEasy", num_envs=2, rollout_length=80,
                      algorithm="impala", gamma=0.9)
    torch.manual_seed(0)
    agent = rl.build_agent(args)
    assert isinstance(agent["optimizer"], torch.optim.RMSprop)
    assert agent["optimizer"].defaults["eps"] == 0.01 and agent["optimizer"].defaults["lr"] == 6e-4
    collector = Collector(agent["env"], agent["actor"], frames_per_batch=160, total_frames=160)
    batch = next(iter(collector)).clone()
    collector.shutdown()
    done = batch["next", "done"].squeeze(-1)
    assert done[:, :-1].any(), "RepeatPreviousEasy episodes (52 steps) must end inside 80 steps"
    key = "action_log_prob"  # the behaviour policy mu
    log_mu = batch[key] + 0.5 * torch.randn(batch[key].shape)
    batch.set(key, log_mu)
    with set_recurrent_mode(True), torch.no_grad():
        agent["advantage"](batch)
        logits = agent["actor"](batch.exclude("logits", key))["logits"]
    log_pi = torch.distributions.Categorical(logits=logits).log_prob(batch["action"])
    rho = torch.exp(log_pi - log_mu)
    assert (rho > 1).any() and (rho < 1).any()
    expected_adv, expected_targets = vtrace_reference(
        batch["state_value"].squeeze(-1), batch["next", "state_value"].squeeze(-1), batch["next", "reward"].squeeze(-1),
        done, batch["next", "terminated"].squeeze(-1), log_pi, log_mu, args.gamma)
    torch.testing.assert_close(batch["advantage"].squeeze(-1), expected_adv, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(batch["value_target"].squeeze(-1), expected_targets, rtol=1e-4, atol=1e-5)
    # the learning rate is annealed linearly to 0 at --total_frames (polybeast's schedule)
    updates = args.total_frames // (args.num_envs * args.rollout_length)
    for _ in range(updates):
        agent["scheduler"].step()
    assert agent["optimizer"].param_groups[0]["lr"] == 0.0


@needs_rl
@pytest.mark.parametrize("algorithm", ["ppo", "impala"])
def test_learner_losses_equal_torchrls_losses_on_the_whole_policy(algorithm):
    """learner_losses runs the core once and gives its features to both heads; torchrl's loss module given the whole
    actor and the whole critic runs the core once for each. Same loss terms, same gradients on every parameter."""
    from torchrl.collectors import Collector
    from torchrl.modules import set_recurrent_mode
    from torchrl.objectives import A2CLoss, ClipPPOLoss

    args = small_args(core="recurrent_delta_net", env="RepeatPreviousEasy", num_envs=4, rollout_length=30,
                      algorithm=algorithm)
    torch.manual_seed(0)
    agent = rl.build_agent(args)
    collector = Collector(agent["env"], agent["actor"], frames_per_batch=120, total_frames=240)
    batch = [b.clone() for b in collector][-1]  # the second batch: stored states carried over, episode starts inside
    collector.shutdown()
    reference = rl.build_loss(args, agent["actor"], agent["critic"])  # the learner's settings, on the whole modules
    assert type(reference) is type(agent["loss"]) is (ClipPPOLoss if algorithm == "ppo" else A2CLoss)
    settings = (("clip_epsilon", 0.2), ("critic_coeff", 1.0), ("loss_critic_type", "smooth_l1"), ("reduction", "mean"))
    if algorithm == "impala":  # polybeast's: baseline cost 0.5 of half the squared error, summed over the batch
        settings = (("critic_coeff", 0.25), ("loss_critic_type", "l2"), ("reduction", "sum"))
    for loss in (reference, agent["loss"]):
        assert float(loss.entropy_coeff) == pytest.approx(0.01) and not loss.functional
        for name, value in settings:
            got = getattr(loss, name)
            assert (float(got) == pytest.approx(value)) if isinstance(value, float) else got == value, name
    params = agent["parameters"]
    assert sum(p.numel() for p in params) == agent["counts"]["policy"] == rl.count_parameters(
        torch.nn.ModuleList([agent["actor"], agent["critic"]]))
    with set_recurrent_mode(True):
        with torch.no_grad():
            agent["advantage"](batch)
        ours = rl.learner_losses(batch[1:], agent)
        grads = torch.autograd.grad(sum(ours.values()), params)
        theirs = {k: v for k, v in reference(batch[1:]).items() if k.startswith("loss_")}
        expected = torch.autograd.grad(sum(theirs.values()), params)
    assert sorted(ours) == sorted(theirs) and len(ours) == 3
    for k in ours:
        torch.testing.assert_close(ours[k], theirs[k], rtol=1e-5, atol=1e-6)
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-6)
    assert all(float(g.abs().sum()) > 0 for g in grads)  # the core gets gradients from both heads' losses


@needs_rl
@pytest.mark.parametrize("core", ["lstm", "recurrent_delta_net"])
def test_end_to_end_writes_the_learning_curve(core, tmp_path):
    out = tmp_path / core
    results = rl.main(["--core", core, "--env", "RepeatPreviousEasy", "--total_frames", "240", "--num_envs", "2",
                       "--rollout_length", "60", "--hidden_size", "32", "--num_heads", "2", "--intermediate_size",
                       "64", "--num_minibatches", "1", "--ppo_epochs", "1", "--output_dir", str(out), "--plot"])
    written = json.loads((out / "curve.json").read_text())
    assert "python -m training.rl_popgym --core " + core in written["run"]["command"]
    assert written["frames"] == results["frames"] == 240  # two batches of 2 x 60; episodes last about 51 steps
    curve = written["curve"]
    assert curve and [p["frames"] for p in curve] == sorted(p["frames"] for p in curve)
    assert all(-1.0 <= p["mean_return"] <= 1.0 and p["episodes"] > 0 for p in curve)  # POPGym returns lie in [-1, 1]
    assert [(p["frames"], p["episodes"]) for p in curve] == [(120, 2), (240, 2)]
    params = written["parameters"]
    assert set(params) >= {"lstm", "recurrent_delta_net", "policy"} and written["frames_per_s"] > 0
    assert abs(params["lstm"] - params["recurrent_delta_net"]) / params["recurrent_delta_net"] < 0.02
    assert written["library"]["torchrl"] and (out / "curve.png").stat().st_size > 0


@needs_rl
def test_impala_end_to_end_learns_with_the_papers_settings(tmp_path):
    """--algorithm impala trains (the loss terms are recorded and the weights move) and records its settings."""
    results = rl.main(["--algorithm", "impala", "--core", "recurrent_delta_net", "--env", "RepeatPreviousEasy",
                       "--total_frames", "240", "--num_envs", "2", "--rollout_length", "60", "--hidden_size", "32",
                       "--num_heads", "2", "--intermediate_size", "64", "--output_dir", str(tmp_path)])
    written = json.loads((tmp_path / "curve.json").read_text())
    assert written["args"]["algorithm"] == "impala" and written["args"]["learning_rate"] == 6e-4
    assert results["frames"] == 240 and {"loss_objective", "loss_critic", "loss_entropy"} <= set(written["curve"][0])
