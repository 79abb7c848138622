"""Long-document scoring with carried state, and dynamic evaluation (Krause et al. 2018; 2019) as a baseline.

``score_stream`` scores token streams segment by segment, carrying each model's cache (Transformer-XL memories, fast
weights, FWL running updates) from one segment to the next: the papers' evaluation protocol (batch 1, every token
scored once, predicted from the preceding ones).

``DynamicEvaluation`` adds, after each scored segment s, one gradient step on all parameters with that segment's loss:

    theta_{s+1} = theta_s - lr * g_s                                                             ("sgd")
    theta_{s+1} = theta_s - lr * g_s / (sqrt(MS) + eps) + decay * (theta_0 - theta_s) * RMS_norm     ("rms")

(Krause et al. 2019, "Dynamic Evaluation of Transformer Language Models", sec. 2: RMS-normalised steps with a decay
back to the trained weights theta_0, ``RMS_norm = sqrt(MS) / mean(sqrt(MS))`` per tensor; MS, the mean squared
gradient, comes from training data via ``gradient_statistics`` or, if not given, a running average of the test
gradients.) Every example gets its own copy of the weights, swapped in for each forward (``swapped_parameters``):
the caller's model is never modified.

Works with any causal LM of this package (and any transformers causal LM whose loss takes ``shift_labels`` and
``num_items_in_batch``).
"""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn
from transformers.cache_utils import Cache

from .cache_fwp import CACHE_ARGUMENT, output_cache

Params = Dict[str, torch.Tensor]


@dataclass
class ScoreResult:
    """Summed negative log-likelihood (nats) of ``num_tokens`` scored tokens, wall time, and per-segment sums."""

    nll_sum: float = 0.0
    num_tokens: int = 0
    seconds: float = 0.0
    segment_nll: List[float] = field(default_factory=list)

    @property
    def loss(self) -> float:
        return self.nll_sum / max(self.num_tokens, 1)

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss)

    @property
    def tokens_per_second(self) -> float:
        return self.num_tokens / self.seconds if self.seconds > 0 else float("nan")

    def merge(self, other: "ScoreResult") -> "ScoreResult":
        return ScoreResult(
            self.nll_sum + other.nll_sum, self.num_tokens + other.num_tokens, self.seconds + other.seconds,
            self.segment_nll + other.segment_nll,
        )


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """Runs `model` in eval mode (no dropout) and restores its previous mode afterwards."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


@contextlib.contextmanager
def swapped_parameters(model: nn.Module, params: Optional[Params]) -> Iterator[nn.Module]:
    """Runs `model` with ``params`` (``{name: tensor}``, names as in ``named_parameters()``) in place of its own
    parameters, and puts the originals back afterwards (also on error).

    Replacements follow tensor identity, so every name of a tied parameter, and a module reached from two paths (the
    FWL head's output layer is ``lm_head`` itself), see the same replacement. (``torch.func.functional_call`` does not
    restore a module registered under two paths: it leaves the replacement in the model.)
    """
    if not params:
        yield model
        return
    named = dict(model.named_parameters())
    unknown = sorted(set(params) - set(named))
    if unknown:
        raise ValueError(f"`params` names parameters the model does not have: {unknown[:5]}")
    replacement = {id(named[name]): tensor for name, tensor in params.items()}
    slots = []
    for name, original in model.named_parameters(remove_duplicate=False):
        module_name, _, attr = name.rpartition(".")
        slots.append((model.get_submodule(module_name), attr, original))
    try:
        for module, attr, original in slots:
            module._parameters[attr] = replacement.get(id(original), original)
        yield model
    finally:
        for module, attr, original in slots:
            module._parameters[attr] = original


def segment_loss(
    model: nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    cache: Optional[Cache] = None,
    params: Optional[Params] = None,
) -> Tuple[torch.Tensor, Optional[Cache]]:
    """Summed NLL of ``targets [B, T]`` (-100 ignored) given ``inputs [B, T]`` and a cache; returns (loss, cache).

    Position t of the segment predicts ``targets[:, t]`` (the next token, which may lie in the next segment), so a
    stream cut into segments has every token scored exactly once. ``params`` replaces the model's parameters.
    """
    kwargs = dict(
        input_ids=inputs, labels=inputs, shift_labels=targets, num_items_in_batch=1, use_cache=True, **{CACHE_ARGUMENT: cache}
    )
    if getattr(model, "loss_covers_all_positions", False):
        kwargs["logits_to_keep"] = 1  # the loss does not need [B, T, V] logits (Transformer-XL's adaptive softmax)
    with swapped_parameters(model, params):
        out = model(**kwargs)
    return out.loss, output_cache(out)


def _segments(num_tokens: int, segment_length: int) -> Iterator[tuple]:
    for start in range(0, num_tokens - 1, segment_length):
        yield start, min(start + segment_length, num_tokens - 1)


class DynamicEvaluation:
    """Gradient steps on the test stream (Krause et al.), with a private copy of the weights per example.

    Args:
        lr: step size eta.
        method: "sgd" (plain step) or "rms" (RMS-normalised step with decay to the trained weights).
        decay: lambda of the "rms" rule (0 disables the decay).
        eps: epsilon of the RMS normalisation.
        gradient_stats: ``{parameter name: mean squared gradient}`` from training data (``gradient_statistics``);
            None with "rms": a running average of the test gradients (``beta``).
        parameters: names of the parameters to adapt (None: every parameter that requires grad).
    """

    def __init__(
        self,
        lr: float = 1e-4,
        method: str = "sgd",
        decay: float = 0.0,
        eps: float = 1e-5,
        gradient_stats: Optional[Params] = None,
        beta: float = 0.9,
        parameters: Optional[List[str]] = None,
    ) -> None:
        if method not in ("sgd", "rms"):
            raise ValueError(f"`method` must be 'sgd' or 'rms', got {method!r}")
        if lr < 0:
            raise ValueError(f"`lr` must be >= 0, got {lr}")
        self.lr, self.method, self.decay, self.eps = lr, method, decay, eps
        self.gradient_stats, self.beta, self.parameters = gradient_stats, beta, parameters

    def initial_params(self, model: nn.Module) -> Params:
        """A private, trainable copy of the adapted parameters (the model's own tensors are never touched)."""
        names = self.parameters
        params = {}
        for name, p in model.named_parameters():
            if (names is None and p.requires_grad) or (names is not None and name in names):
                params[name] = p.detach().clone().requires_grad_(True)
        if names is not None and set(names) - set(params):
            raise ValueError(f"`parameters` names unknown parameters: {sorted(set(names) - set(params))}")
        return params

    @torch.no_grad()
    def step(self, params: Params, grads: Dict[str, Optional[torch.Tensor]], theta0: Params, ms: Params) -> None:
        for name, p in params.items():
            g = grads.get(name)
            if g is None:
                continue
            if self.method == "sgd":
                p.sub_(self.lr * g)
                continue
            if self.gradient_stats is not None:
                rms = self.gradient_stats[name].to(p.device).sqrt()
            else:
                ms[name] = self.beta * ms[name] + (1 - self.beta) * g * g if name in ms else g * g
                rms = ms[name].sqrt()
            p.sub_(self.lr * g / (rms + self.eps))
            if self.decay:
                p.add_(self.decay * (theta0[name] - p) * (rms / rms.mean().clamp_min(self.eps)))


def score_segments(
    model: nn.Module, input_ids: torch.Tensor, segment_length: int, dynamic: Optional[DynamicEvaluation] = None
) -> Iterator[Tuple[float, int, float]]:
    """``score_stream`` one segment at a time: yields ``(summed NLL, tokens scored, seconds)`` of every segment, in order
    (rows one after the other with `dynamic`). The seconds cover the segment's forward (and dynamic evaluation's
    backward and step; the weight copy of a row counts towards its first segment). Benchmarks advance several of
    these generators in turn, so that load on a shared machine hits every model at the same moments.
    """
    if input_ids.dim() != 2 or input_ids.shape[1] < 2:
        raise ValueError(f"`input_ids` must be [batch, >= 2 tokens], got {tuple(input_ids.shape)}")
    if segment_length < 1:
        raise ValueError(f"`segment_length` must be >= 1, got {segment_length}")
    device = next(model.parameters()).device
    input_ids = input_ids.to(device)
    with eval_mode(model):
        rows = [input_ids] if dynamic is None else [row[None] for row in input_ids]
        for ids in rows:
            start_time = time.perf_counter()
            params = dynamic.initial_params(model) if dynamic is not None else None
            theta0 = {n: p.detach().clone() for n, p in params.items()} if dynamic is not None and dynamic.decay else {}
            ms: Params = {}
            cache = None
            for start, end in _segments(ids.shape[1], segment_length):
                inputs, targets = ids[:, start:end], ids[:, start + 1 : end + 1]
                with torch.set_grad_enabled(dynamic is not None):
                    loss, cache = segment_loss(model, inputs, targets, cache, params)
                if dynamic is not None and dynamic.lr > 0:
                    names = list(params)
                    grads = torch.autograd.grad(loss / targets.numel(), [params[n] for n in names], allow_unused=True)
                    dynamic.step(params, dict(zip(names, grads)), theta0, ms)
                nll = float(loss.detach())
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                seconds = time.perf_counter() - start_time
                yield nll, targets.numel(), seconds
                start_time = time.perf_counter()


def score_stream(
    model: nn.Module, input_ids: torch.Tensor, segment_length: int, dynamic: Optional[DynamicEvaluation] = None
) -> ScoreResult:
    """Scores every token of ``input_ids [B, N]`` but the first, in segments of `segment_length`, carrying the cache.

    Without `dynamic` the rows run as one batch; with it every row runs alone with its own weight copy (per-example
    adaptation, as in Krause et al.). The model runs in eval mode (restored afterwards) and is never modified.
    """
    result = ScoreResult()
    for nll, num_tokens, seconds in score_segments(model, input_ids, segment_length, dynamic):
        result.segment_nll.append(nll)
        result.nll_sum += nll
        result.num_tokens += num_tokens
        result.seconds += seconds
    return result


def gradient_statistics(model: nn.Module, input_ids: torch.Tensor, segment_length: int, max_segments: int = 100) -> Params:
    """Mean squared gradient of every parameter over training segments (Krause et al. 2019's MS for "rms"), with
    the cache carried as at test time. The model's parameters are not changed (gradients go to a private copy)."""
    evaluation = DynamicEvaluation(lr=0.0)
    params = evaluation.initial_params(model)
    sums = {n: torch.zeros_like(p) for n, p in params.items()}
    count = 0
    with eval_mode(model):
        for row in input_ids:
            cache = None
            for start, end in _segments(row.shape[0], segment_length):
                if count >= max_segments:
                    break
                inputs, targets = row[None, start:end], row[None, start + 1 : end + 1]
                loss, cache = segment_loss(model, inputs, targets, cache, params)
                grads = torch.autograd.grad(loss / targets.numel(), list(params.values()), allow_unused=True)
                for name, g in zip(params, grads):
                    if g is not None:
                        sums[name] += g.detach() ** 2
                count += 1
    return {n: s / max(count, 1) for n, s in sums.items()}
