"""A recurrent policy on POPGym's memory tasks, trained with PPO or IMPALA's V-trace actor-critic (torchrl): a
fast-weight core as a drop-in for the LSTM core.

Irie et al. (2021, sec. 4.4, appendix C) replace the LSTM core of IMPALA agents on Atari by a Recurrent Delta Net or a
Delta RNN. Atari is out of reach of a small CPU machine; this script runs the same comparison at small scale on
POPGym's memory tasks (Morad et al. 2023: `RepeatPreviousEasy`, `CountRecallEasy`, `AutoencodeEasy`, ...), with
torchrl's ``Collector`` over a ``SerialEnv``. The recurrent core is the only thing that changes between runs:

- ``--core lstm``: ``torch.nn.LSTM`` (one layer), its width chosen so that its parameter count is the closest to the
  fast-weight core's of the same ``--hidden_size`` / ``--num_layers`` (``--match_core``);
- ``--core recurrent_delta_net | delta_rnn | delta_lstm | delta_net``: ``modeling_fwp.FastWeightRecurrentCore`` (the
  paper's small RDN: 2 layers, d 128, 4 heads, feed-forward 512 are the defaults).

Both sit behind :class:`PolicyCore` (``core(x [B, T, D], state, reset [B, T]) -> (y, state)``; an episode start
zeroes that row's state before its step) inside :class:`TensorDictCore`, the torchrl module that reads the stored
state and ``is_init`` (torchrl's ``InitTracker``) from the rollout: one step per call while collecting, whole
``[env, time]`` rows from their stored first state under ``torchrl.modules.set_recurrent_mode(True)`` for the
advantages and the loss (truncated backpropagation over ``--rollout_length`` steps, the paper's span 50 by default).

The learner (``--algorithm``, :func:`build_learner`):

- ``ppo`` (default): torchrl's ``ClipPPOLoss`` (clip 0.2, entropy 0.01, critic coefficient 1.0, smooth-L1 value loss:
  its defaults) and ``GAE`` (gamma 0.99, lambda 0.95), Adam lr 3e-4, 4 epochs over 4 minibatches of environment rows
  per batch, gradient-norm clipping 0.5: the usual PPO settings (Schulman et al. 2017; torchrl's PPO examples), not
  tuned here.
- ``impala``: the paper's learner (Espeholt et al. 2018, as Torchbeast's polybeast runs it): V-trace targets
  (:class:`VTraceTargets`), torchrl's ``A2CLoss`` summed over the batch, RMSProp lr 6e-4 (epsilon 0.01) annealed
  linearly to 0, gradient clipping 40, entropy 0.01 (Irie et al. 2021, appendix C); one update per batch, collected
  by the learner's own policy (no asynchronous actors).

The paper's values that carry over to both: entropy 0.01, 32 environments per batch, backpropagation span 50.
In both, the loss runs the core once per minibatch and both heads read its features (:func:`learner_losses`).

    OMP_NUM_THREADS=1 python -m training.rl_popgym --core recurrent_delta_net --env RepeatPreviousEasy --seed 0 \\
        --total_frames 200000 --output_dir runs/rl/rdn_s0

Writes ``<output_dir>/curve.json`` (a :class:`~training.result_file.RunRecord`: frames vs mean episodic return of the
episodes that ended in each batch, parameter counts, frames/s) and, with ``--plot``, ``curve.png``.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from modeling_fwp import FastWeightRecurrentCore

from .arguments import parse_arguments, require_positive
from .result_file import RunRecord

try:  # the `rl` extra; PolicyCore and the parameter matching work without it
    from tensordict.nn import TensorDictModuleBase
    HAVE_RL = True
except ImportError:  # pragma: no cover - depends on the environment
    TensorDictModuleBase = nn.Module
    HAVE_RL = False

CORES = ("lstm", "recurrent_delta_net", "delta_rnn", "delta_lstm", "delta_net")
FEATURES_KEY = "core_features"
ALGORITHMS = ("ppo", "impala")
# What --learning_rate / --max_grad_norm mean when left out. PPO: the usual settings (Schulman et al. 2017; torchrl's
# examples). IMPALA: Irie et al. (2021, appendix C): RMSProp, lr 6e-4 (epsilon 0.01), gradient clipping at 40.
ALGORITHM_DEFAULTS = {"ppo": {"learning_rate": 3e-4, "max_grad_norm": 0.5},
                      "impala": {"learning_rate": 6e-4, "max_grad_norm": 40.0}}
PPO_ONLY = {"ppo_epochs": 4, "num_minibatches": 4, "clip_epsilon": 0.2, "gae_lambda": 0.95}  # their defaults
State = Tuple[torch.Tensor, ...]


@dataclass
class RLArguments:
    """The experiment: environment, core, learner (PPO or IMPALA)."""

    core: str = field(default="recurrent_delta_net", metadata={"help": "the policy's recurrent core", "choices": CORES})
    env: str = field(default="RepeatPreviousEasy", metadata={"help": "a POPGym env name (popgym-<env>-v0)"})
    seed: int = field(default=0, metadata={"help": "torch and environment seed"})
    total_frames: int = field(default=200_000, metadata={"help": "environment steps in all"})
    num_envs: int = field(default=32, metadata={"help": "environments per batch (the paper's batch 32)"})
    rollout_length: int = field(default=50, metadata={"help": "steps per env per batch = backprop span (paper: 50)"})
    hidden_size: int = field(default=128, metadata={"help": "fast-weight core width d (paper's small RDN: 128)"})
    num_layers: int = field(default=2, metadata={"help": "fast-weight core layers (paper: 2)"})
    num_heads: int = field(default=4, metadata={"help": "fast-weight core heads (paper: 4)"})
    intermediate_size: int = field(default=512, metadata={"help": "fast-weight core feed-forward size (paper: 512)"})
    match_core: str = field(default="recurrent_delta_net", metadata={
        "help": "with --core lstm: the fast-weight core whose parameter count the LSTM matches", "choices": CORES[1:]})
    lstm_hidden_size: Optional[int] = field(default=None, metadata={"help": "LSTM width; None: matched (--match_core)"})
    algorithm: str = field(default="ppo", metadata={"help": "learner: PPO or IMPALA's V-trace actor-critic",
                                                     "choices": ALGORITHMS})
    learning_rate: Optional[float] = field(default=None, metadata={
        "help": "None: the algorithm's (PPO: Adam 3e-4; IMPALA: RMSProp 6e-4, the paper's, annealed linearly to 0)"})
    ppo_epochs: int = field(default=4, metadata={"help": "passes over each batch (PPO only)"})
    num_minibatches: int = field(default=4, metadata={"help": "minibatches (of whole env rows) per pass (PPO only)"})
    clip_epsilon: float = field(default=0.2, metadata={"help": "PPO clip (ClipPPOLoss default; PPO only)"})
    entropy_coeff: float = field(default=0.01, metadata={"help": "entropy bonus (ClipPPOLoss default; paper 0.01)"})
    gamma: float = field(default=0.99, metadata={"help": "discount"})
    gae_lambda: float = field(default=0.95, metadata={"help": "GAE lambda (PPO only)"})
    max_grad_norm: Optional[float] = field(default=None, metadata={
        "help": "gradient-norm clipping; None: the algorithm's (PPO 0.5; IMPALA 40, the paper's)"})
    output_dir: str = field(default="runs/rl_popgym", metadata={"help": "where curve.json (and curve.png) go"})
    plot: bool = field(default=False, metadata={"help": "also write curve.png (matplotlib)"})

    def __post_init__(self) -> None:
        if self.core not in CORES:
            raise ValueError(f"--core must be one of {CORES}, got {self.core!r}")
        if self.match_core not in CORES[1:]:
            raise ValueError(f"--match_core must be one of {CORES[1:]}, got {self.match_core!r}")
        if not 0.0 <= self.gamma <= 1.0 or not 0.0 <= self.gae_lambda <= 1.0:
            raise ValueError(f"--gamma and --gae_lambda must lie in [0, 1], got {self.gamma}, {self.gae_lambda}")
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"--algorithm must be one of {ALGORITHMS}, got {self.algorithm!r}")
        changed = [f"--{name}" for name, value in PPO_ONLY.items() if getattr(self, name) != value]
        if self.algorithm != "ppo" and changed:
            raise ValueError(f"{', '.join(changed)} only apply to --algorithm ppo, got --algorithm {self.algorithm}")
        if self.algorithm == "ppo" and self.num_minibatches > self.num_envs:
            raise ValueError(f"--num_minibatches ({self.num_minibatches}) must be at most --num_envs ({self.num_envs})")
        for name, value in ALGORITHM_DEFAULTS[self.algorithm].items():
            if getattr(self, name) is None:
                setattr(self, name, value)


# --------------------------------------------------------------------------------------------------- the cores


class LSTMCore(nn.Module):
    """``nn.LSTM`` with the fast-weight core's interface: batch-first ``x``, a state tuple ``(h, c)`` of
    ``[B, num_layers, H]`` (batch first), and ``reset [B, T]`` zeroing a row's state before the step where it is 1."""

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1) -> None:
        super().__init__()
        self.lstm = nn.LSTM(input_size, hidden_size, num_layers, batch_first=True)
        self.hidden_size = hidden_size

    def initial_state(self, batch_size: int, device: Optional[torch.device] = None) -> State:
        """Zeros ``(h, c)``, each ``[batch_size, num_layers, hidden_size]``."""
        shape = (batch_size, self.lstm.num_layers, self.hidden_size)
        return (torch.zeros(shape, device=device), torch.zeros(shape, device=device))

    def forward(self, x: torch.Tensor, state: Optional[State] = None,
                reset: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, State]:
        state = self.initial_state(x.shape[0], x.device) if state is None else state
        outputs, start = [], 0
        bounds = [0] if reset is None else torch.nonzero(reset.bool().any(dim=0)).flatten().tolist()
        for end in [t for t in bounds if t > 0] + [x.shape[1]]:  # stretches without an episode start inside
            if reset is not None:
                keep = (~reset[:, start].bool()).to(x.dtype).view(-1, 1, 1)
                state = tuple(s * keep for s in state)
            y, (h, c) = self.lstm(x[:, start:end], tuple(s.transpose(0, 1).contiguous() for s in state))
            outputs.append(y)
            state, start = (h.transpose(0, 1), c.transpose(0, 1)), end
        return torch.cat(outputs, dim=1), state


def count_parameters(module: nn.Module) -> int:
    """The number of parameters of `module`."""
    return sum(p.numel() for p in module.parameters())


def lstm_parameters(input_size: int, hidden_size: int) -> int:
    """Parameters of a one-layer ``nn.LSTM(input_size, hidden_size)``: 4 gates of weights and two biases."""
    return 4 * hidden_size * (input_size + hidden_size + 2)


def matched_lstm_size(input_size: int, target: int) -> int:
    """The LSTM width whose parameter count (:func:`lstm_parameters`) is the closest to `target`."""
    if target <= 0:
        raise ValueError(f"`target` must be a positive parameter count, got {target}")
    width = int((math.sqrt((input_size + 2) ** 2 + target) - (input_size + 2)) / 2)  # 4H^2 + 4H(in+2) = target
    return min(range(max(1, width - 2), width + 3), key=lambda h: abs(lstm_parameters(input_size, h) - target))


def build_fast_weight_core(family: str, input_size: int, args: RLArguments) -> FastWeightRecurrentCore:
    """``FastWeightRecurrentCore.from_family`` with the arguments' sizes, batch first."""
    return FastWeightRecurrentCore.from_family(
        family, input_size, args.hidden_size, num_layers=args.num_layers, batch_first=True,
        num_attention_heads=args.num_heads, intermediate_size=args.intermediate_size)


def build_core(input_size: int, args: RLArguments) -> Tuple[nn.Module, Dict[str, int]]:
    """The core of ``--core`` and the parameter counts of both sides of the comparison (``lstm``, the fast-weight
    core's family); the LSTM is sized to the fast-weight core (``--match_core``) unless ``--lstm_hidden_size``."""
    family = args.core if args.core != "lstm" else args.match_core
    fast = build_fast_weight_core(family, input_size, args)
    width = args.lstm_hidden_size or matched_lstm_size(input_size, count_parameters(fast))
    lstm = LSTMCore(input_size, width)
    counts = {"lstm": count_parameters(lstm), "lstm_hidden_size": width, family: count_parameters(fast)}
    return (lstm if args.core == "lstm" else fast), counts


class PolicyCore(nn.Module):
    """Either core, called one way: ``core(x [B, T, D], state, reset [B, T]) -> (y [B, T, H], state)``, the state a
    tuple of batch-first tensors; ``initial_state(B)`` gives zeros of the right shapes (torchrl's primer specs)."""

    def __init__(self, core: nn.Module) -> None:
        super().__init__()
        if not isinstance(core, (LSTMCore, FastWeightRecurrentCore)):
            raise TypeError(f"`core` must be an LSTMCore or a FastWeightRecurrentCore, got {type(core).__name__}")
        if isinstance(core, FastWeightRecurrentCore) and not core.batch_first:
            raise ValueError("`core` must be built with batch_first=True")
        self.core = core
        self.output_size = core.hidden_size

    def initial_state(self, batch_size: int) -> State:
        """Zero state of `batch_size` rows."""
        return tuple(self.core.initial_state(batch_size))

    def forward(self, x: torch.Tensor, state: Optional[Sequence[torch.Tensor]] = None,
                reset: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, State]:
        y, new_state = self.core(x, None if state is None else tuple(state), reset)
        return y, tuple(new_state)


class TensorDictCore(TensorDictModuleBase):
    """The torchrl side of :class:`PolicyCore`: reads ``observation``, ``is_init`` and the state keys, writes
    ``core_features`` and ``("next", <state key>)``.

    Collecting (not in recurrent mode): the tensordict is ``[num_envs]``; one step, the state zeroed where
    ``is_init``. Under ``set_recurrent_mode(True)`` it is ``[num_envs, T]``: the rows run from their stored first state
    with ``reset = is_init`` (the first step's too, so a stored state from before an episode start is dropped).
    """

    def __init__(self, core: PolicyCore, observation_key: str = "observation") -> None:
        super().__init__()
        self.core = core
        self.state_keys = [f"core_state_{i}" for i in range(len(core.initial_state(1)))]
        self.in_keys = [observation_key, "is_init", *self.state_keys]
        self.out_keys = [FEATURES_KEY, *[("next", key) for key in self.state_keys]]

    def make_primer(self) -> Any:
        """A ``TensorDictPrimer`` that puts zero states into the environment's reset (and carries them between
        steps), as torchrl's ``LSTMModule.make_tensordict_primer`` does."""
        from torchrl.data import Unbounded
        from torchrl.envs import TensorDictPrimer

        zeros = self.core.initial_state(1)
        return TensorDictPrimer({key: Unbounded(shape=t.shape[1:], dtype=t.dtype)
                                 for key, t in zip(self.state_keys, zeros)}, expand_specs=True)

    def forward(self, tensordict: Any) -> Any:
        from torchrl.modules import recurrent_mode

        x = tensordict.get(self.in_keys[0]).float()  # one-hot observations come as integers
        reset = tensordict.get("is_init").squeeze(-1)
        state = [tensordict.get(key) for key in self.state_keys]
        if recurrent_mode():
            if tensordict.ndim != 2:
                raise ValueError(f"`tensordict` must be [env, time] in recurrent mode, got {tuple(tensordict.shape)}")
            y, _ = self.core(x, [s[:, 0] for s in state], reset)
            tensordict.set(FEATURES_KEY, y)
            return tensordict
        lead = x.shape[:-1]
        y, new_state = self.core(x.reshape(-1, 1, x.shape[-1]), [s.reshape(-1, *s.shape[len(lead):]) for s in state],
                                 reset.reshape(-1, 1))
        tensordict.set(FEATURES_KEY, y.reshape(*lead, -1))
        for key, s in zip(self.state_keys, new_state):
            tensordict.set(("next", key), s.reshape(*lead, *s.shape[1:]))
        return tensordict


# ---------------------------------------------------------------------------------------------- environments


def require_rl() -> None:
    """ImportError naming the extra when torchrl / tensordict / popgym are not installed."""
    missing = []
    for name in ("torchrl", "tensordict", "popgym", "gymnasium"):
        try:
            __import__(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise ImportError(f"training.rl_popgym needs {missing}: pip install -e '.[rl]'")


def make_env(env_name: str, seed: int = 0) -> Any:
    """One POPGym env as a torchrl env: observations flattened to a float vector (one-hot for discrete parts),
    integer actions, ``is_init`` (``InitTracker``) and the running episode return (``RewardSum``)."""
    import gymnasium as gym
    import popgym  # noqa: F401  (registers the popgym-*-v0 ids)
    from torchrl.envs import Compose, DoubleToFloat, GymWrapper, InitTracker, RewardSum, TransformedEnv

    env_id = f"popgym-{env_name}-v0"
    if env_id not in gym.registry:
        names = sorted(k[len("popgym-"):-len("-v0")] for k in gym.registry if k.startswith("popgym-"))
        raise ValueError(f"--env must be a POPGym env name such as {names[:6]}, got {env_name!r}")
    env = gym.wrappers.FlattenObservation(gym.make(env_id))
    if not isinstance(env.action_space, gym.spaces.Discrete):
        raise ValueError(f"--env {env_name!r} has a {type(env.action_space).__name__} action space; only Discrete "
                         "action spaces are supported")
    base = GymWrapper(env, categorical_action_encoding=True)
    base.set_seed(seed)
    return TransformedEnv(base, Compose(DoubleToFloat(), InitTracker(), RewardSum()))


def make_batched_env(args: RLArguments, core_module: Optional[TensorDictCore] = None) -> Any:
    """``--num_envs`` POPGym envs in a ``SerialEnv`` (seeds ``seed * 1000 + i``), with the core's state primer."""
    from torchrl.envs import SerialEnv, TransformedEnv

    env = SerialEnv(args.num_envs, [lambda i=i: make_env(args.env, args.seed * 1000 + i)
                                    for i in range(args.num_envs)])
    return TransformedEnv(env, core_module.make_primer()) if core_module is not None else env


def build_policy(env: Any, core_module: TensorDictCore, num_actions: int) -> Dict[str, Any]:
    """The policy's modules, sharing one core: ``actor`` (core + categorical head; the collector's and V-trace's)
    and ``critic`` (core + value head; the value estimators'), and the two heads alone, ``actor_head`` and
    ``value_head``, on the core's features (the losses': :func:`learner_losses` runs the core once for both)."""
    from tensordict.nn import TensorDictModule, TensorDictSequential
    from torchrl.modules import ProbabilisticActor

    width = core_module.core.output_size
    logits_head = TensorDictModule(nn.Linear(width, num_actions), [FEATURES_KEY], ["logits"])
    value_head = TensorDictModule(nn.Linear(width, 1), [FEATURES_KEY], ["state_value"])

    def categorical(module: Any) -> Any:
        return ProbabilisticActor(module, in_keys=["logits"], distribution_class=torch.distributions.Categorical,
                                  return_log_prob=True, spec=env.action_spec)

    return {"actor": categorical(TensorDictSequential(core_module, logits_head)),
            "critic": TensorDictSequential(core_module, value_head),
            "actor_head": categorical(logits_head), "value_head": value_head}


def episode_returns(batch: Any) -> List[float]:
    """Returns of the episodes that ended in `batch` (``RewardSum``'s ``episode_reward`` where ``done``)."""
    done = batch.get(("next", "done")).squeeze(-1)
    return batch.get(("next", "episode_reward")).squeeze(-1)[done].tolist()


# -------------------------------------------------------------------------------------------------- learners


def learner_losses(minibatch: Any, agent: Dict[str, Any]) -> Dict[str, torch.Tensor]:
    """The learner's loss terms (``loss_*``, scalars) on `minibatch` ``[rows, T]``, in recurrent mode. The core runs
    once over the rows, with gradients, and writes its features; the loss module's actor and critic are the heads
    alone and read them (torchrl's losses would run a shared core once for the actor and again for the critic)."""
    agent["core"](minibatch)
    losses = agent["loss"](minibatch)
    return {k: v for k, v in losses.items() if k.startswith("loss_")}


def policy_update(batch: Any, agent: Dict[str, Any], args: RLArguments) -> Dict[str, float]:
    """One learner update on `batch` ``[num_envs, T]``, in torchrl's recurrent mode (the core runs each env row from
    its stored first state). PPO: ``--ppo_epochs`` passes of ClipPPOLoss in ``--num_minibatches`` minibatches of whole
    rows, GAE recomputed before each pass. IMPALA: V-trace targets, then one step of the actor-critic loss on the whole
    batch (Espeholt et al. 2018), the learning rate annealed after it. Returns the mean of each loss term."""
    from torchrl.modules import set_recurrent_mode

    optimizer = agent["optimizer"]
    passes, minibatches = (args.ppo_epochs, args.num_minibatches) if args.algorithm == "ppo" else (1, 1)
    totals: Dict[str, float] = {}
    with set_recurrent_mode(True):
        for _ in range(passes):
            with torch.no_grad():
                agent["advantage"](batch)
            for rows in torch.randperm(batch.shape[0]).chunk(minibatches):
                parts = learner_losses(batch[rows], agent)
                optimizer.zero_grad()
                sum(parts.values()).backward()
                nn.utils.clip_grad_norm_(agent["parameters"], args.max_grad_norm)
                optimizer.step()
                for k, v in parts.items():
                    totals[k] = totals.get(k, 0.0) + float(v.detach()) / (passes * minibatches)
    if agent["scheduler"] is not None:
        agent["scheduler"].step()
    return totals


class VTraceTargets:
    """V-trace targets and policy-gradient advantages (Espeholt et al. 2018, sec. 4.1, eq. (1); sec. 4.2), rho and c
    clipped at 1, written into a ``[num_envs, T]`` batch as ``value_target`` and ``advantage``.

    The values come from `values` (a GAE estimator; only its shifted value pass is used: ``state_value`` and
    ``("next", "state_value")``), the recursion from torchrl's ``vtrace_advantage_estimate``. The importance weights
    are pi(a_t | x_t) / mu(a_t | x_t) of the action taken, mu being the stored ``action_log_prob``. (torchrl 0.14.1's
    ``VTrace`` module takes pi of the policy's mode instead of the action taken; on-policy with rho clipped at 1 that
    happens to give 1 as well, off-policy it does not; tests/test_rl_popgym.py checks ours off-policy.)"""

    def __init__(self, actor: Any, values: Any, gamma: float) -> None:
        self.actor, self.values, self.gamma = actor, values, gamma

    def __call__(self, batch: Any) -> Any:
        from torchrl.objectives.value.functional import vtrace_advantage_estimate

        self.values(batch)
        logits = self.actor(batch.select(*self.actor.in_keys).clone())["logits"]
        log_pi = torch.distributions.Categorical(logits=logits).log_prob(batch["action"]).unsqueeze(-1)
        log_mu = batch["action_log_prob"].reshape(log_pi.shape)
        advantage, target = vtrace_advantage_estimate(
            self.gamma, log_pi, log_mu, batch["state_value"], batch["next", "state_value"], batch["next", "reward"],
            batch["next", "done"], batch["next", "terminated"], rho_thresh=1.0, c_thresh=1.0, time_dim=1)
        batch.set("advantage", advantage)
        batch.set("value_target", target)
        return batch


def build_loss(args: RLArguments, actor: Any, critic: Any) -> Any:
    """torchrl's loss module of ``--algorithm`` on `actor` and `critic`: ClipPPOLoss (PPO), or A2CLoss with
    polybeast's baseline cost 0.5 of half the squared value error, summed over the batch (IMPALA). The learner gives
    it the heads alone (:func:`learner_losses`); given the whole actor and critic it runs the core once for each."""
    from torchrl.objectives import A2CLoss, ClipPPOLoss

    if args.algorithm == "ppo":
        return ClipPPOLoss(actor, critic, clip_epsilon=args.clip_epsilon, entropy_coeff=args.entropy_coeff,
                           functional=False)
    return A2CLoss(actor, critic, entropy_coeff=args.entropy_coeff, critic_coeff=0.25, loss_critic_type="l2",
                   reduction="sum", functional=False)


def build_learner(args: RLArguments, policy: Dict[str, Any]) -> Dict[str, Any]:
    """``{"loss", "advantage", "parameters", "optimizer", "scheduler"}`` of ``--algorithm``, for the modules of
    :func:`build_policy`: the advantage estimators run ``actor`` / ``critic``, the loss the heads alone.

    PPO: ClipPPOLoss, GAE, Adam, a constant learning rate. IMPALA, as the paper ran it (Irie et al. 2021, appendix C,
    with polybeast's remaining defaults): V-trace targets and advantages (rho and c clipped at 1), the policy-gradient
    loss plus 0.5 * baseline cost 0.5 of the summed squared value errors plus the entropy term, all summed over the
    batch as polybeast does; RMSProp (alpha 0.99, epsilon 0.01), the learning rate annealed linearly to 0 at
    ``--total_frames``. Here the learner trains on each batch as soon as it is collected, so the behaviour policy is
    the learner's own and the importance weights are 1 up to the policy's float noise: V-trace reduces to n-step
    returns over the rollout (the asynchronous actors that make them differ are not simulated)."""
    from torchrl.objectives.value import GAE

    # shifted: one core pass over [root steps, last next step] (the values at t + 1 are the next row's, with the state
    # chain intact); the vmapped two-pass path would run the core on the "next" observations alone, which lack each
    # episode's first observation. No vmap: the cores split rows at episode starts (data-dependent shapes). One
    # approximation remains, torchrl's: the bootstrap step after the row's last step gets that step's is_init, so where
    # an episode starts at the last step, its bootstrap value is computed from a zero state (about 1 row in 50).
    actor, critic, heads = policy["actor"], policy["critic"], (policy["actor_head"], policy["value_head"])
    parameters = list(nn.ModuleList([actor, critic]).parameters())  # the core's once, and both heads'
    loss_module = build_loss(args, *heads)
    if args.algorithm == "ppo":
        advantage = GAE(gamma=args.gamma, lmbda=args.gae_lambda, value_network=critic, time_dim=1,
                        shifted=True, deactivate_vmap=True)
        optimizer, scheduler = torch.optim.Adam(parameters, lr=args.learning_rate), None
    else:
        advantage = VTraceTargets(actor, GAE(gamma=args.gamma, lmbda=1.0, value_network=critic, time_dim=1,
                                             shifted=True, deactivate_vmap=True), args.gamma)
        optimizer = torch.optim.RMSprop(parameters, lr=args.learning_rate, alpha=0.99, eps=0.01)
        updates = max(1, args.total_frames // (args.num_envs * args.rollout_length))
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda done: 1.0 - min(done, updates) / updates)
    return {"loss": loss_module, "advantage": advantage, "parameters": parameters, "optimizer": optimizer,
            "scheduler": scheduler}


def build_agent(args: RLArguments) -> Dict[str, Any]:
    """Env, core, the policy's modules (:func:`build_policy`), the learner (:func:`build_learner`) and the parameter
    counts."""
    probe = make_env(args.env, args.seed)
    obs_size, num_actions = probe.observation_spec["observation"].shape[-1], int(probe.action_spec.space.n)
    core, counts = build_core(obs_size, args)
    core_module = TensorDictCore(PolicyCore(core))
    env = make_batched_env(args, core_module)
    policy = build_policy(env, core_module, num_actions)
    learner = build_learner(args, policy)
    counts["policy"] = sum(p.numel() for p in learner["parameters"])
    return {"env": env, "core": core_module, **policy, **learner, "counts": counts, "observation_size": obs_size,
            "num_actions": num_actions}


def train(args: RLArguments) -> Dict[str, Any]:
    """Collects ``--total_frames`` frames with torchrl's ``Collector`` and updates after each batch; returns the
    learning curve (one point per batch in which episodes ended) and the timings."""
    from torchrl.collectors import Collector

    torch.manual_seed(args.seed)
    agent = build_agent(args)
    frames_per_batch = args.num_envs * args.rollout_length
    collector = Collector(agent["env"], agent["actor"], frames_per_batch=frames_per_batch,
                          total_frames=args.total_frames)
    curve, frames, start, update_s = [], 0, time.perf_counter(), 0.0
    for batch in collector:
        frames += batch.numel()
        returns = episode_returns(batch)
        tick = time.perf_counter()
        losses = policy_update(batch, agent, args)
        update_s += time.perf_counter() - tick
        collector.update_policy_weights_()
        if returns:
            curve.append({"frames": frames, "mean_return": sum(returns) / len(returns), "episodes": len(returns),
                          **{k: round(v, 5) for k, v in losses.items()}})
            print(f"frames {frames:>8}  mean return {curve[-1]['mean_return']:+.3f}  ({len(returns)} episodes)",
                  flush=True)
    collector.shutdown()
    wall = time.perf_counter() - start
    return {"curve": curve, "frames": frames, "wall_s": round(wall, 2), "frames_per_s": round(frames / wall, 1),
            "update_s": round(update_s, 2), "parameters": agent["counts"],
            "observation_size": agent["observation_size"], "num_actions": agent["num_actions"]}


def plot_curve(curve: List[Dict[str, Any]], title: str, path: Path) -> Path:
    """Frames vs mean episodic return, as a PNG at `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot([p["frames"] for p in curve], [p["mean_return"] for p in curve])
    ax.set_xlabel("frames")
    ax.set_ylabel("mean episodic return")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """Parses the arguments, trains, writes ``<output_dir>/curve.json`` (and ``curve.png``); returns the results."""
    (args,) = parse_arguments([RLArguments], argv, description=__doc__).groups
    require_positive(args, ["total_frames", "num_envs", "rollout_length", "hidden_size", "num_layers", "num_heads",
                            "intermediate_size", "learning_rate", "ppo_epochs", "num_minibatches"])
    require_rl()
    record = RunRecord.start("python -m training.rl_popgym", argv)
    results = train(args)
    counts = results["parameters"]
    print("parameters: " + ", ".join(f"{k} {v:,}" for k, v in counts.items()), flush=True)
    print(f"{results['frames']} frames in {results['wall_s']} s: {results['frames_per_s']} frames/s", flush=True)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    results = {"experiment": "PPO (torchrl) on POPGym, recurrent core compared (training/rl_popgym.py)",
               "args": asdict(args), "library": _library_versions(), **results}
    record.write(out / "curve.json", results)
    if args.plot and results["curve"]:
        plot_curve(results["curve"], f"{args.env}: {args.core} (seed {args.seed})", out / "curve.png")
    return results


def _library_versions() -> Dict[str, Optional[str]]:
    from .result_file import package_versions

    return package_versions(("torchrl", "tensordict", "popgym", "gymnasium"))


if __name__ == "__main__":
    main()
