"""Associative retrieval with a single fast-weight memory (Schlag, Irie, Schmidhuber 2021, sec. 6.1 and appendix D).

The experiment isolates the memory: no feed-forward layers, no stacking, no positional information. An input
sequence holds S associations; position t carries key symbol a_t and value symbol b_t at once. Then one or more
queries present a key alone, and the memory must return its value.

- Input of position t: ``x_t = [onehot(b_t), E a_t]`` (fixed one-hot value code, learned key embedding E of size
  ``embedding_size``, 1.1 * 2 S by default as in the paper's code).
- Slow net: ``k_t = W_k x_t`` (d_key), ``beta_t = sigmoid(w_beta . x_t)``; the value written is the one-hot
  code itself, ``v_t = onehot(b_t)`` (sec. 6.1: values are not learned, so the memory alone decides).
- Fast weights (our ``FeatureMap`` and ``fwp_kernels``): sum rule ``W_t = W_{t-1} + v_t phi(k_t)^T`` (eq. 17) read
  with attention normalisation ``W q / (z . q)`` (eqs. 18-19), or the delta rule
  ``W_t = W_{t-1} + beta_t (v_t - W_{t-1} phi(k_t)) phi(k_t)^T`` (eq. 24) with sum-normalised phi (eq. 29).
- The FWM rule (Schlag, Munkhdalai, Schmidhuber 2021; the paper's code runs it in setting 2): the delta rule on
  unnormalised phi(k), ``W'_t = W_{t-1} + beta_t (v_t - W_{t-1} phi(k_t)) phi(k_t)^T``, then
  ``W_t = W'_t / max(1, ||W'_t||_F)``, read through a LayerNorm without affine parameters, ``y = LN(W_T phi(q))``
  (eps 1e-5: the memory can learn to stay so small that eps dominates and LN acts as a scaled mean subtraction,
  which is how the paper's runs reach loss 0.04; the zero mean bounds the loss below by ``0.5 / S``).
- Query: ``q = W_q E a_query``; the read-out ``y = W_S phi(q)`` is compared with ``onehot(b)``:
  loss ``0.5 * ||onehot(b) - y||^2`` (summed over the S value dimensions, averaged over queries), accuracy =
  argmax. A memory that returns the mean value scores ``0.5 * (1 - 1/S)`` ("chance").
- Softmax baseline of the same form: ``y = sum_t softmax_t(q . k_t / sqrt(d_key)) v_t``.

Setting 1 (``capacity``): S unique keys, keys and values drawn without replacement, sequence length S; sweep S.
Setting 2 (``update_rules``): sequence length 2 S (40) with keys drawn with replacement from S (20) keys (values
too); the answer is the latest value of the queried key.

Memories are named ``[rule-]phi[-ablation...]``: ``softmax``; ``linear`` (ELU+1), ``dpfp<nu>``, ``favor<m>``,
optionally prefixed by ``sum-`` (default), ``delta-`` or ``fwm-``; ablations ``sumnorm`` (sum normalisation,
eq. 29, for the sum rule instead of attention normalisation), ``nosumnorm`` (delta rule without eq. 29), ``beta1``
(delta rule with a fixed beta = 1 instead of the learned one).

    python -m training.associative_retrieval capacity --d_key 16 --num_keys 8 16 32 64 \\
        --memory softmax linear dpfp1 dpfp2 --output_dir outputs/synthetic_capacity
    python -m training.associative_retrieval update_rules --d_key 16 \\
        --memory sum-dpfp1 delta-dpfp1 fwm-dpfp1 --output_dir outputs/synthetic_update_rules
    python -m training.associative_retrieval plot capacity outputs/synthetic_capacity/*.json --out docs/figures/x.png

Each run writes ``<output_dir>/<setting>.json`` (per memory and S: final held-out loss, accuracy, learning curve; first
the run's record: command, versions, machine, git commit, load average before and after, ``training.result_file``)
and, with matplotlib installed, ``<output_dir>/<setting>.png``. ``--results_file docs/results/<name>.json`` writes the
same JSON there too, to be committed as the source of the figures quoted in docs/RESULTS.md.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fwp_kernels import delta_rule, linear_attention
from modeling_fwp.feature_maps import FeatureMap

from .result_file import RunRecord

logger = logging.getLogger("training.associative_retrieval")

SETTINGS = ("capacity", "update_rules")


# --------------------------------------------------------------------------------------------------
# Data (sec. 6.1): keys, values, queries and answers as integer arrays
# --------------------------------------------------------------------------------------------------


@dataclass
class RetrievalBatch:
    """One batch: ``keys``, ``values`` ``[B, T]`` (symbols in ``0..num_keys-1`` / ``0..num_values-1``),
    ``queries`` ``[B, Q]`` (keys that occur in the sequence) and ``answers`` ``[B, Q]`` (their latest values)."""

    keys: np.ndarray
    values: np.ndarray
    queries: np.ndarray
    answers: np.ndarray

    def tensors(self) -> Tuple[torch.Tensor, ...]:
        return tuple(torch.as_tensor(a, dtype=torch.long) for a in (self.keys, self.values, self.queries, self.answers))


def retrieval_batch(rng: np.random.Generator, batch_size: int, num_keys: int, seq_len: int, replace: bool,
                    num_queries: int = 1) -> RetrievalBatch:
    """Draws a batch of associative retrieval sequences.

    Args:
        rng: the source of randomness (a seeded generator gives a fixed batch).
        batch_size: B.
        num_keys: S, the number of key symbols; there are as many value symbols.
        seq_len: T. Without replacement (setting 1) T <= S keys and values are each drawn without replacement.
        replace: draw keys and values with replacement (setting 2); the answer is the latest value of the key.
        num_queries: Q query positions per sequence, drawn without replacement from the T positions; the query is
            the key at that position (so its distribution favours frequent keys, as in the paper's code).
    Returns:
        A ``RetrievalBatch`` with ``keys, values [B, T]`` and ``queries, answers [B, Q]``.
    """
    for name, value in (("batch_size", batch_size), ("num_keys", num_keys), ("seq_len", seq_len),
                        ("num_queries", num_queries)):
        if not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"`{name}` must be a positive int, got {value!r}")
    if not replace and seq_len > num_keys:
        raise ValueError(f"`seq_len` ({seq_len}) must be <= `num_keys` ({num_keys}) without replacement")
    if num_queries > seq_len:
        raise ValueError(f"`num_queries` ({num_queries}) must be <= `seq_len` ({seq_len})")
    if replace:
        keys = rng.integers(0, num_keys, size=(batch_size, seq_len))
        values = rng.integers(0, num_keys, size=(batch_size, seq_len))
    else:
        keys = np.argsort(rng.random((batch_size, num_keys)), axis=1)[:, :seq_len]
        values = np.argsort(rng.random((batch_size, num_keys)), axis=1)[:, :seq_len]
    positions = np.argsort(rng.random((batch_size, seq_len)), axis=1)[:, :num_queries]
    queries = np.take_along_axis(keys, positions, axis=1)
    # latest[b, a] = value of key a at its last occurrence in sequence b (later positions overwrite earlier ones)
    latest = np.full((batch_size, num_keys), -1, dtype=np.int64)
    rows = np.arange(batch_size)
    for t in range(seq_len):
        latest[rows, keys[:, t]] = values[:, t]
    answers = np.take_along_axis(latest, queries, axis=1)
    return RetrievalBatch(keys.astype(np.int64), values.astype(np.int64), queries.astype(np.int64), answers)


def setting_lengths(setting: str, num_keys: int) -> Tuple[int, bool]:
    """``(seq_len, replace)`` of a setting for S = `num_keys`: setting 1 reads S unique pairs, setting 2 2S pairs."""
    if setting == "capacity":
        return num_keys, False
    if setting == "update_rules":
        return 2 * num_keys, True
    raise ValueError(f"`setting` must be one of {SETTINGS}, got {setting!r}")


# --------------------------------------------------------------------------------------------------
# Memories
# --------------------------------------------------------------------------------------------------


@dataclass
class MemorySpec:
    """What a memory is: softmax attention, or fast weights with an update rule, phi and normalisations."""

    name: str
    attention: str = "fast_weight"  # or "softmax"
    feature_map: str = "elu"
    dpfp_nu: int = 1
    favor_features: int = 64
    update_rule: str = "sum"
    sum_normalization: bool = False
    attention_normalization: bool = True
    learned_beta: bool = True

    def feature_dim(self, d_key: int) -> int:
        """d_dot, the dimension of phi(k): the capacity the paper predicts for the sum rule."""
        if self.attention == "softmax":
            return 0
        if self.feature_map == "dpfp":
            return 2 * d_key * self.dpfp_nu
        if self.feature_map == "favor":
            return 2 * self.favor_features  # eq. 32: [exp(R k); exp(-R k)]
        return d_key


_PHI = re.compile(r"^(linear|dpfp(\d+)|favor(\d+))$")


def parse_memory(name: str) -> MemorySpec:
    """``softmax`` or ``[sum-|delta-|fwm-]phi[-sumnorm|-nosumnorm|-beta1]`` (see the module docstring)."""
    if name == "softmax":
        return MemorySpec(name, attention="softmax")
    parts = name.split("-")
    rule = parts.pop(0) if parts and parts[0] in ("sum", "delta", "fwm") else "sum"
    match = _PHI.match(parts.pop(0)) if parts else None
    if match is None:
        raise ValueError(f"`memory` must be 'softmax' or '[sum-|delta-|fwm-](linear|dpfp<nu>|favor<m>)[-ablation]', "
                         f"got {name!r}")
    spec = MemorySpec(name, update_rule=rule)
    if match.group(2):
        spec.feature_map, spec.dpfp_nu = "dpfp", int(match.group(2))
    elif match.group(3):
        spec.feature_map, spec.favor_features = "favor", int(match.group(3))
    if (spec.feature_map == "dpfp" and spec.dpfp_nu < 1) or (spec.feature_map == "favor" and spec.favor_features < 1):
        raise ValueError(f"`memory` {name!r}: nu and m must be positive")
    # The paper's pairings: sum rule + attention normalisation (eqs. 17-19), delta rule + sum normalisation (eq. 29).
    spec.sum_normalization = rule == "delta"
    spec.attention_normalization = rule == "sum"
    for ablation in parts:
        if ablation == "sumnorm" and rule == "sum":
            spec.sum_normalization, spec.attention_normalization = True, False
        elif ablation == "nosumnorm" and rule == "delta":
            spec.sum_normalization = False
        elif ablation == "beta1" and rule == "delta":
            spec.learned_beta = False
        else:
            raise ValueError(f"`memory` {name!r}: unknown ablation {ablation!r} for the {rule} rule "
                             "(sum: sumnorm; delta: nosumnorm, beta1; fwm: none)")
    return spec


class RetrievalMemoryModel(nn.Module):
    """One memory layer between a key/value encoder and the value read-out (sec. 6.1).

    ``forward(keys [B, T], values [B, T], queries [B, Q]) -> predicted value codes [B, Q, num_keys]``.

    ``sum_rule_path``: the sum rule's memory is read only after the whole sequence, so besides our
    ``linear_attention`` kernel ("kernel") it can be computed in closed form, ``W_T = sum_t v_t phi(k_t)^T``
    ("closed_form", the same numbers at a fraction of the CPU time, used for the long capacity sweeps). The delta
    rule always runs through ``delta_rule``.
    """

    def __init__(self, spec: MemorySpec, num_keys: int, d_key: int, embedding_size: Optional[int] = None,
                 sum_rule_path: str = "kernel") -> None:
        super().__init__()
        if d_key < 1:
            raise ValueError(f"`d_key` must be positive, got {d_key}")
        if sum_rule_path not in ("kernel", "closed_form"):
            raise ValueError(f"`sum_rule_path` must be 'kernel' or 'closed_form', got {sum_rule_path!r}")
        self.sum_rule_path = sum_rule_path
        self.spec = spec
        self.num_keys = num_keys
        self.d_key = d_key
        embedding_size = embedding_size or math.ceil(1.1 * 2 * num_keys)  # the paper's code: 1.1 (keys + values)
        self.key_embedding = nn.Embedding(num_keys, embedding_size)
        self.register_buffer("value_codes", torch.eye(num_keys), persistent=False)  # fixed one-hot values
        self.key_proj = nn.Linear(num_keys + embedding_size, d_key)  # W_k, sees key and value
        self.query_proj = nn.Linear(embedding_size, d_key)  # W_q, sees the key only
        self.beta_proj = (nn.Linear(num_keys + embedding_size, 1)
                          if spec.update_rule in ("delta", "fwm") and spec.learned_beta and spec.attention != "softmax"
                          else None)
        self.feature_map = None
        if spec.attention != "softmax":
            self.feature_map = FeatureMap(SimpleNamespace(
                feature_map=spec.feature_map, dpfp_nu=spec.dpfp_nu, favor_features=spec.favor_features,
                sum_normalization=spec.sum_normalization, num_attention_heads=1, head_dim=d_key))
        nn.init.normal_(self.key_embedding.weight, std=1.0)
        bound = d_key**-0.5
        for proj in (self.key_proj, self.query_proj):
            nn.init.uniform_(proj.weight, -bound, bound)
            nn.init.zeros_(proj.bias)

    def forward(self, keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
        B, T = keys.shape
        Q = queries.shape[1]
        v = self.value_codes[values]  # [B, T, S]
        x = torch.cat([v, self.key_embedding(keys)], dim=-1)
        k = self.key_proj(x)  # [B, T, d_key]
        q = self.query_proj(self.key_embedding(queries))  # [B, Q, d_key]
        if self.spec.attention == "softmax":
            scores = torch.einsum("bqd,btd->bqt", q, k) / math.sqrt(self.d_key)
            return torch.einsum("bqt,bts->bqs", scores.softmax(-1), v)
        # eq. 19's ratio is unchanged by a positive factor of each phi(q), and of all phi(k) of a sequence under the sum
        # rule: FAVOR+ takes them out of its exponents (its h(x) underflows float32 for |x|^2 > ~200), others ignore it
        normalized_sum = self.spec.attention_normalization and self.spec.update_rule == "sum"
        phi_k = self.feature_map(k[:, None], rescale_dims=(-2, -1) if normalized_sum else None)  # [B, 1, T, F]
        phi_q = self.feature_map(q[:, None], rescale_dims=-1 if self.spec.attention_normalization else None)
        if self.spec.update_rule == "fwm":
            memory = fast_weight_memory_rule(phi_k[:, 0], v, torch.sigmoid(self.beta_proj(x)).squeeze(-1))
            return F.layer_norm(torch.einsum("bsf,bqf->bqs", memory, phi_q[:, 0]), (v.shape[-1],))  # y = LN(W_T phi(q))
        if self.spec.attention_normalization:
            # eqs. 18-19: y = W_T phi(q) / (z_T . phi(q)), z_T = sum_t phi(k_t); z is written as one more value row.
            v = torch.cat([v, v.new_ones(B, T, 1)], dim=-1)
        if self.spec.update_rule == "sum" and self.sum_rule_path == "closed_form":
            # eq. 17 summed over the whole sequence: W_T = sum_t v_t phi(k_t)^T (tests check it equals the kernel's).
            out = torch.einsum("btv,btf,bqf->bqv", v, phi_k[:, 0], phi_q[:, 0])
        else:
            out = self._kernel_read(x, v, phi_k, phi_q)
        if self.spec.attention_normalization:
            # eq. 19 exactly (no epsilon, which would swamp FAVOR+'s tiny h(q) terms); 0 where z_T . phi(q) = 0
            denominator = out[..., -1:]
            out = out[..., :-1] / torch.where(denominator > 0, denominator, torch.ones_like(denominator))
        return out

    def _kernel_read(self, x: torch.Tensor, v: torch.Tensor, phi_k: torch.Tensor, phi_q: torch.Tensor) -> torch.Tensor:
        """Writes positions 0..T-1 and reads Q queries with ``fwp_kernels``: ``[B, Q, Dv]``.

        The reads are positions T..T+Q-1 with phi(k) = 0, v = 0 (and beta = 0): they leave W_T unchanged and return
        ``W_T phi(q)``; the outputs at the write positions are discarded.
        """
        B, _, T, D = phi_k.shape
        Q = phi_q.shape[2]
        k_all = torch.cat([phi_k, phi_k.new_zeros(B, 1, Q, D)], dim=2)
        q_all = torch.cat([phi_q.new_zeros(B, 1, T, D), phi_q], dim=2)
        v_all = torch.cat([v, v.new_zeros(B, Q, v.shape[-1])], dim=1)[:, None]
        if self.spec.update_rule == "delta":
            beta = torch.sigmoid(self.beta_proj(x)).squeeze(-1) if self.beta_proj is not None else x.new_ones(B, T)
            beta_all = torch.cat([beta, beta.new_zeros(B, Q)], dim=1)[:, None]  # eq. 21
            out, _ = delta_rule(q_all, k_all, v_all, beta_all)  # eqs. 20, 24, 25
        else:
            out, _ = linear_attention(q_all, k_all, v_all)  # eq. 17
        return out[:, 0, T:]


def fast_weight_memory_rule(phi_k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """The FWM update rule (Schlag, Munkhdalai, Schmidhuber 2021), written step by step; returns the last memory.

    ``W'_t = W_{t-1} + beta_t (v_t - W_{t-1} phi(k_t)) phi(k_t)^T`` (the delta rule, keys not normalised), then
    ``W_t = W'_t / max(1, ||W'_t||_F)``, from ``W_0 = 0``. (The paper's experiment code skips the rescaling at the
    first step; this follows the equation.)

    Args:
        phi_k: ``[B, T, F]`` mapped keys.
        v: ``[B, T, Dv]`` values.
        beta: ``[B, T]`` write strengths in (0, 1).
    Returns:
        ``W_T``: ``[B, Dv, F]``.
    """
    memory = v.new_zeros(v.shape[0], v.shape[-1], phi_k.shape[-1])
    for t in range(phi_k.shape[1]):
        k_t = phi_k[:, t]
        retrieved = torch.einsum("bsf,bf->bs", memory, k_t)  # W_{t-1} phi(k_t)
        memory = memory + torch.einsum("bs,bf->bsf", beta[:, t, None] * (v[:, t] - retrieved), k_t)
        memory = memory / memory.flatten(1).norm(dim=-1).clamp(min=1.0)[:, None, None]
    return memory


def retrieval_loss(prediction: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
    """``0.5 * ||onehot(answer) - prediction||^2`` summed over the value code, mean over queries (sec. 6.1).

    Args:
        prediction: ``[B, Q, S]``.
        answers: ``[B, Q]`` value symbols.
    """
    target = F.one_hot(answers, prediction.shape[-1]).to(prediction.dtype)
    return 0.5 * (target - prediction).pow(2).sum(-1).mean()


# --------------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------------


@dataclass
class TrainConfig:
    """Optimisation of one run (the paper: Adam 1e-3, batch 32, evaluation every 100 steps, stop at loss 0.001
    or after 10 evaluations without a new best, at most 100k steps)."""

    d_key: int = 16
    batch_size: int = 32
    lr: float = 1e-3
    max_steps: int = 20000
    eval_every: int = 100
    patience: int = 10
    stop_loss: float = 1e-3
    train_queries: int = 1
    eval_sequences: int = 200
    eval_queries: int = 8
    seed: int = 0
    sum_rule_path: str = "kernel"


@torch.no_grad()
def evaluate(model: RetrievalMemoryModel, batch: RetrievalBatch) -> Dict[str, float]:
    """Held-out loss and accuracy on a fixed batch."""
    model.eval()
    keys, values, queries, answers = batch.tensors()
    prediction = model(keys, values, queries)
    return {"loss": retrieval_loss(prediction, answers).item(),
            "accuracy": (prediction.argmax(-1) == answers).float().mean().item()}


def train_memory(memory: str, setting: str, num_keys: int, config: TrainConfig) -> Dict[str, Any]:
    """Trains one memory on one setting and S; returns its final held-out metrics and learning curve."""
    spec = parse_memory(memory)
    seq_len, replace = setting_lengths(setting, num_keys)
    torch.manual_seed(config.seed)
    model = RetrievalMemoryModel(spec, num_keys, config.d_key, sum_rule_path=config.sum_rule_path)
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
    train_rng = np.random.default_rng(config.seed)
    held_out = retrieval_batch(np.random.default_rng(10_000 + config.seed), config.eval_sequences, num_keys, seq_len,
                               replace, num_queries=min(config.eval_queries, seq_len))
    curve: List[Dict[str, float]] = []
    best, strikes, step = math.inf, 0, 0
    start = time.perf_counter()
    for step in range(1, config.max_steps + 1):
        model.train()
        if model.feature_map is not None:
            model.feature_map.redraw()  # FAVOR+: new random features every batch (no-op for other maps)
        keys, values, queries, answers = retrieval_batch(train_rng, config.batch_size, num_keys, seq_len, replace,
                                                         num_queries=config.train_queries).tensors()
        loss = retrieval_loss(model(keys, values, queries), answers)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % config.eval_every == 0:
            metrics = evaluate(model, held_out)
            curve.append({"step": step, "train_loss": loss.item(), **metrics})
            if metrics["loss"] < best:
                best, strikes = metrics["loss"], 0
            else:
                strikes += 1
            if metrics["loss"] <= config.stop_loss or strikes > config.patience:
                break
    final = curve[-1] if curve else {**evaluate(model, held_out), "step": step}
    return {
        "memory": memory, "setting": setting, "num_keys": num_keys, "seq_len": seq_len, "d_key": config.d_key,
        "feature_dim": spec.feature_dim(config.d_key), "spec": asdict(spec),
        "final_loss": final["loss"], "final_accuracy": final["accuracy"], "best_loss": min(best, final["loss"]),
        "chance_loss": 0.5 * (1 - 1 / num_keys), "steps": step, "seconds": time.perf_counter() - start,
        "curve": curve,
    }


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    # not HfArgumentParser: a positional setting (capacity | update_rules | plot) and a plain training loop (no
    # Trainer); the option names are the other scripts' (transformers' example scripts)
    p = argparse.ArgumentParser(prog="python -m training.associative_retrieval",
                                description="Schlag et al. 2021 sec. 6.1 associative retrieval at reduced scale",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("setting", choices=SETTINGS + ("plot",))
    p.add_argument("inputs", nargs="*", help="plot: the setting (capacity|update_rules) then result JSON files")
    p.add_argument("--memory", nargs="+", default=None, help="memories to train (see the module docstring)")
    p.add_argument("--num_keys", type=int, nargs="+", default=None,
                   help="S values (default: 8 16 32 64 for capacity, 20 for update_rules)")
    p.add_argument("--d_key", type=int, default=TrainConfig.d_key)
    p.add_argument("--per_device_train_batch_size", dest="batch_size", type=int, default=TrainConfig.batch_size)
    p.add_argument("--learning_rate", dest="lr", type=float, default=TrainConfig.lr)
    p.add_argument("--max_steps", type=int, default=TrainConfig.max_steps)
    p.add_argument("--eval_every", type=int, default=TrainConfig.eval_every)
    p.add_argument("--patience", type=int, default=TrainConfig.patience)
    p.add_argument("--stop_loss", type=float, default=TrainConfig.stop_loss)
    p.add_argument("--train_queries", type=int, default=TrainConfig.train_queries)
    p.add_argument("--eval_sequences", type=int, default=TrainConfig.eval_sequences)
    p.add_argument("--eval_queries", type=int, default=TrainConfig.eval_queries)
    p.add_argument("--seed", type=int, default=TrainConfig.seed)
    p.add_argument("--sum_rule_path", choices=("kernel", "closed_form"), default=TrainConfig.sum_rule_path,
                   help="sum rule: our linear_attention kernel, or the closed form W_T = sum_t v_t phi(k_t)^T")
    p.add_argument("--output_dir", default=None)
    p.add_argument("--out", default=None, help="plot: the PNG to write")
    p.add_argument("--results_file", default=None, help="also write the result JSON here (e.g. docs/results/x.json)")
    args = p.parse_args(argv)
    if args.setting == "plot":
        if len(args.inputs) < 2 or args.inputs[0] not in SETTINGS or not args.out:
            p.error("plot needs: plot {capacity|update_rules} RESULT.json [...] --out FIGURE.png")
        return args
    if args.inputs:
        p.error(f"unexpected arguments {args.inputs}")
    for name in ("d_key", "batch_size", "max_steps", "eval_every", "train_queries", "eval_sequences", "eval_queries"):
        if getattr(args, name) < 1:
            option = "per_device_train_batch_size" if name == "batch_size" else name
            p.error(f"--{option} must be positive, got {getattr(args, name)}")
    if args.lr <= 0:
        p.error(f"--learning_rate must be positive, got {args.lr}")
    args.memory = args.memory or (["softmax", "linear", "dpfp1", "dpfp2"] if args.setting == "capacity"
                                  else ["sum-dpfp1", "delta-dpfp1"])
    try:
        for memory in args.memory:
            parse_memory(memory)
    except ValueError as error:
        p.error(str(error))
    args.num_keys = args.num_keys or ([8, 16, 32, 64] if args.setting == "capacity" else [20])
    if min(args.num_keys) < 2:
        p.error("--num_keys values must be >= 2")
    args.output_dir = args.output_dir or f"outputs/synthetic_{args.setting}"
    return args


def load_rows(paths: Sequence[str]) -> List[Dict[str, Any]]:
    rows: List[Dict[str, Any]] = []
    for path in paths:
        rows.extend(json.loads(Path(path).read_text(encoding="utf-8"))["results"])
    return rows


def markdown_table(rows: List[Dict[str, Any]], value: str = "final_loss") -> str:
    """A markdown table of `value` with one row per memory and one column per S."""
    sizes = sorted({r["num_keys"] for r in rows})
    lines = ["| memory | d_dot | " + " | ".join(f"S={s}" for s in sizes) + " |", "|---" * (len(sizes) + 2) + "|"]
    for memory in dict.fromkeys(r["memory"] for r in rows):
        cells = {r["num_keys"]: r[value] for r in rows if r["memory"] == memory}
        dim = next(r["feature_dim"] for r in rows if r["memory"] == memory)
        texts = ["" if s not in cells else f"{cells[s]:.4f}" if isinstance(cells[s], float) else str(cells[s])
                 for s in sizes]
        lines.append(f"| {memory} | {dim or '-'} | " + " | ".join(texts) + " |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    from .plots import plot_capacity, plot_learning_curves

    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    plotters = {"capacity": plot_capacity, "update_rules": plot_learning_curves}
    if args.setting == "plot":
        rows = load_rows(args.inputs[1:])
        path = plotters[args.inputs[0]](rows, Path(args.out))
        for value in ("final_loss", "final_accuracy", "steps"):
            print(f"\n{value}:\n{markdown_table(rows, value)}")
        return {"plot": str(path) if path else None}
    record = RunRecord.start("python -m training.associative_retrieval", argv)
    config = TrainConfig(**{name: getattr(args, name) for name in TrainConfig.__dataclass_fields__})
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for num_keys in args.num_keys:
        for memory in args.memory:
            row = train_memory(memory, args.setting, num_keys, config)
            logger.info("%s S=%d %s: loss %.4f (chance %.3f), accuracy %.3f after %d steps (%.0f s)", args.setting,
                        num_keys, memory, row["final_loss"], row["chance_loss"], row["final_accuracy"], row["steps"],
                        row["seconds"])
            rows.append(row)
    results = {"setting": args.setting, "config": asdict(config), "results": rows}
    # with the run's record: command, versions, load average before and after
    record.write(out / f"{args.setting}.json", results, copies=[args.results_file] if args.results_file else [])
    path = plotters[args.setting](rows, out / f"{args.setting}.png")
    results["plot"] = str(path) if path else None
    return results


if __name__ == "__main__":
    main()
