"""Long-document scoring with carried state, and dynamic evaluation (Krause et al. 2018; 2019) as a baseline.

``score_stream`` scores token streams segment by segment, carrying each model's cache (Transformer-XL memories, fast
weights, FWL running updates, a softmax model's keys and values) from one segment to the next: the papers' evaluation
protocol (batch 1, every token scored once, predicted from the preceding ones).

``DynamicEvaluation`` adds, after each scored segment s, one gradient step on the adapted parameters (all, or those
named by ``parameters``) with that segment's loss:

    theta_{s+1} = theta_s - lr * g_s                                                             ("sgd")
    theta_{s+1} = theta_s - lr * g_s / (sqrt(MS) + eps) + decay * (theta_0 - theta_s) * RMS_norm     ("rms")

(Krause et al. 2019, "Dynamic Evaluation of Transformer Language Models", sec. 2: RMS-normalised steps with a decay
back to the trained weights theta_0, ``RMS_norm = sqrt(MS) / mean(sqrt(MS))`` per tensor; MS, the mean squared
gradient, comes from training data via ``gradient_statistics`` or, if not given, a running average of the test
gradients.) Every example gets its own copy of the weights, swapped in for each forward (``swapped_parameters``):
the caller's model is never modified. Gradients stop at segment boundaries: the carried cache is detached after every
step (``detach_cache``), as Krause et al. truncate backpropagation at the segment. ``choose_step_size`` picks lr on a
validation stream.

Works with any transformers causal LM whose loss takes ``shift_labels`` and ``num_items_in_batch`` (transformers'
``ForCausalLMLoss``: Llama, GPT-2, ...) and every causal LM of ``modeling_fwp``.
"""
from __future__ import annotations

import contextlib
import fnmatch
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn
from transformers.cache_utils import Cache, CacheLayerMixin

from modeling_fwp import TransfoXLForCausalLM
from modeling_fwp.cache_fwp import CACHE_ARGUMENT, output_cache

Params = Dict[str, torch.Tensor]
logger = logging.getLogger(__name__)

# Step sizes tried on the validation split when none is given (``choose_step_size``): a decade apart, around what
# works for small and pretrained LMs (the "rms" step is in units of the gradient's RMS, so it is a per-weight change).
DEFAULT_STEP_SIZES = {"sgd": (1e-4, 1e-3, 1e-2), "rms": (1e-5, 1e-4, 1e-3)}


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

    @property
    def seconds_per_token(self) -> float:
        return self.seconds / self.num_tokens if self.num_tokens else float("nan")

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


def _detached(value: Any, seen: set) -> Any:
    """``value`` with its tensors detached: containers and cache objects in place, tensors and tuples anew."""
    if isinstance(value, torch.Tensor):
        return value.detach()
    if id(value) in seen:
        return value
    seen.add(id(value))
    if isinstance(value, dict):
        value.update({key: _detached(item, seen) for key, item in value.items()})
    elif isinstance(value, list):
        value[:] = [_detached(item, seen) for item in value]
    elif type(value) is tuple:  # plain tuples only (a named tuple is rebuilt differently)
        return tuple(_detached(item, seen) for item in value)
    elif isinstance(value, (Cache, CacheLayerMixin)):
        for name, item in list(vars(value).items()):
            detached = _detached(item, seen)
            if detached is not item:
                setattr(value, name, detached)
    return value


def detach_cache(cache: Optional[Cache]) -> Optional[Cache]:
    """Detaches, in place, every tensor a cache holds (its layers, nested caches such as an FWL model's
    ``base_cache``, dicts and lists of states) and returns it: the next segment's graph then starts at the cache.

    transformers' ``DynamicCache`` keeps the keys and values of a forward run with gradients enabled attached to that
    forward's graph; the next segment's backward would run into the freed graph ("Trying to backward through the
    graph a second time"). Values are unchanged.
    """
    if cache is not None:
        _detached(cache, set())
    return cache


def untie_output_embedding(model: nn.Module) -> bool:
    """Gives a model whose output embedding shares its tensor with the input embedding (SmolLM2, GPT-2) its own copy
    of it, so that dynamic evaluation of ``lm_head.weight`` adapts the output side only. Returns whether it untied."""
    output, inputs = model.get_output_embeddings(), model.get_input_embeddings()
    if output is None or inputs is None or output.weight is not inputs.weight:
        return False
    output.weight = nn.Parameter(output.weight.detach().clone(), requires_grad=output.weight.requires_grad)
    model.config.tie_word_embeddings = False
    if hasattr(model.config, "get_text_config"):
        model.config.get_text_config().tie_word_embeddings = False
    return True


def loss_reads_every_position(model: nn.Module) -> bool:
    """Whether ``model``'s loss uses every position's hidden state whatever ``logits_to_keep`` says, so that a scorer
    can pass ``logits_to_keep=1`` and skip the ``[B, T, V]`` logits: Transformer-XL, whose loss goes through the
    adaptive softmax. Other causal LMs compute the loss from the logits they keep."""
    return isinstance(model, TransfoXLForCausalLM)


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
    (``targets`` is made contiguous: transformers' ``ForCausalLMLoss`` views ``shift_labels``, and a column slice of a
    batch of rows cannot be viewed.)
    """
    kwargs = dict(
        input_ids=inputs, labels=inputs, shift_labels=targets.contiguous(), num_items_in_batch=1, use_cache=True,
        **{CACHE_ARGUMENT: cache},
    )
    if loss_reads_every_position(model):
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
        beta: the running average's decay (MS <- beta MS + (1 - beta) g^2).
        parameters: names or ``fnmatch`` globs of the parameters to adapt (``"lm_head.weight"``,
            ``"model.layers.*.mlp.*"``), matched against every name of a tensor (a tied weight answers to all of
            its names); None: every parameter that requires grad.
    """

    def __init__(
        self,
        lr: float = 1e-4,
        method: str = "sgd",
        decay: float = 0.0,
        eps: float = 1e-5,
        gradient_stats: Optional[Params] = None,
        beta: float = 0.9,
        parameters: Optional[Sequence[str]] = None,
    ) -> None:
        if method not in ("sgd", "rms"):
            raise ValueError(f"`method` must be 'sgd' or 'rms', got {method!r}")
        if lr < 0:
            raise ValueError(f"`lr` must be >= 0, got {lr}")
        if isinstance(parameters, str) or (parameters is not None and not parameters):
            raise ValueError(f"`parameters` must be a non-empty list of names or globs (or None), got {parameters!r}")
        self.lr, self.method, self.decay, self.eps = lr, method, decay, eps
        self.gradient_stats, self.beta = gradient_stats, beta
        self.parameters = None if parameters is None else list(parameters)

    def options(self) -> Dict[str, Any]:
        """Everything but ``lr``, to build the same evaluation with another step size."""
        return dict(method=self.method, decay=self.decay, eps=self.eps, gradient_stats=self.gradient_stats,
                    beta=self.beta, parameters=self.parameters)

    def adapted_names(self, model: nn.Module) -> List[str]:
        """The names (as in ``model.named_parameters()``) of the parameters this evaluation adapts."""
        if self.parameters is None:
            return [name for name, p in model.named_parameters() if p.requires_grad]
        canonical = {id(p): name for name, p in model.named_parameters()}
        chosen, unmatched = set(), []
        for pattern in self.parameters:
            hits = {canonical[id(p)] for name, p in model.named_parameters(remove_duplicate=False)
                    if fnmatch.fnmatchcase(name, pattern)}
            chosen |= hits
            if not hits:
                unmatched.append(pattern)
        if unmatched:
            raise ValueError(f"`parameters` names or globs that match no parameter of the model: {unmatched}")
        return [name for name in canonical.values() if name in chosen]

    def initial_params(self, model: nn.Module) -> Params:
        """A private, trainable copy of the adapted parameters (the model's own tensors are never touched)."""
        named = dict(model.named_parameters())
        return {name: named[name].detach().clone().requires_grad_(True) for name in self.adapted_names(model)}

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
    """``score_stream`` one segment at a time: yields ``(summed NLL, tokens scored, seconds)`` of every segment, in
    order (rows one after the other with `dynamic`). The seconds cover the segment's forward (and dynamic evaluation's
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
                if dynamic is not None:
                    cache = detach_cache(cache)  # the next segment's gradient stops here
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


def gradient_statistics(
    model: nn.Module, input_ids: torch.Tensor, segment_length: int, max_segments: int = 100
) -> Params:
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
                cache = detach_cache(cache)
                count += 1
    return {n: s / max(count, 1) for n, s in sums.items()}


def choose_step_size(
    score: Callable[[DynamicEvaluation], ScoreResult], candidates: Sequence[float], **options: Any
) -> Tuple[float, Dict[float, float]]:
    """The step size among ``candidates`` whose dynamic evaluation scores the lowest perplexity under ``score`` (e.g.
    scoring the validation split), and ``{step size: perplexity}`` of every candidate tried.

    ``options`` are the other ``DynamicEvaluation`` arguments (``method``, ``decay``, ``parameters``...). A single
    candidate is returned without scoring (and an empty dict). A best value at either end of a grid is logged as a
    warning: the grid should be widened.
    """
    candidates = [float(lr) for lr in candidates]
    if not candidates:
        raise ValueError("`candidates` must hold at least one step size")
    if len(candidates) == 1:
        return candidates[0], {}
    tried = {lr: score(DynamicEvaluation(lr, **options)).perplexity for lr in candidates}
    best = min(tried, key=tried.get)
    if best in (min(candidates), max(candidates)):
        logger.warning("dynamic evaluation: the best step size %g is at the edge of the grid %s", best, candidates)
    return best, tried
