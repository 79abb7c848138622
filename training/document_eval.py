"""Whole-document evaluation, where fast weights matter (Clark et al. 2022 sec. 3, Fig. 2): every held-out document
is scored from its first token to its end (up to ``--max_length`` tokens), in segments of ``--segment_length`` with
the model's cache carried from one segment to the next (keys and values, fast weights, the FWL's running update) and
detached, batch 1, every token but the first scored once. Reported: perplexity overall, by position in the document,
by how often the target occurred earlier in the document (first vs repeated), and by its frequency in the training
split (rare tokens), and scoring tokens/s; with a plot of the per-token NLL change against the base model.

Methods, each with its step size chosen on the valid split only (lowest perplexity on ``--valid_documents``
documents of it), then used on ``--split``:

- ``base``: the model as it is;
- ``test_time_fwl``: the test-time-only FWL (Clark et al. Table 2; ``training.test_time_fwl``): the untouched model's
  output side made fast (an untied copy of the output embedding and an output bias; ``--fwl_fast_parameters`` adds
  the final norm's gain), one global step size; ``test_time_fwl_seen``: the same with its fast update on the rows of
  the document's tokens so far only (``fwl_fast_vocabulary="seen"``: far fewer rows in its products);
- ``dynamic``: dynamic evaluation (Krause et al. 2019; ``training.dynamic_eval``) of every parameter (or those of
  ``--dynamic_eval_params``), SGD or RMS steps after every segment;
- ``dynamic_output``: dynamic evaluation of the output side (final norm and an untied copy of the output embedding),
  the test-time FWL's slower, sequential counterpart;

and on two more model folders, for issue 17 item 4's one table (``--one_table``: exactly its rows, ``ONE_TABLE``):
``finetuned`` (2), the base fine-tuned without FWL (``--finetuned_model``), with ``finetuned_dynamic`` (dynamic
evaluation of (2)) and ``finetuned_test_time_fwl`` (the test-time FWL on (2)); ``fwl`` (3), the fine-tuned FWL model
(``--fwl_model``, its learned step sizes as they are) and ``fwl_slow_only`` (3'), the same model with its fast updates
off (``FWLHead.slow_only``); ``fwl_seen``, not in the one table, is (3) with its fast update on the seen rows only
(the saved config's ``fwl_fast_vocabulary`` set to "seen" at load: an approximation of what it was trained with,
far cheaper). With the rows present, ``goal_summary`` checks issue 17's two goals (met / not met).

    python -m training.document_eval --model_name_or_path checkpoints/smollm2-135m --data_dir data/wiki --split test \\
        --methods base test_time_fwl dynamic --results_file docs/results/document_eval_wiki.json
        # or: fwp-document-eval ...
    python -m training.document_eval --one_table --finetuned_model outputs/fwl/base_finetuned/final \\
        --fwl_model outputs/fwl/base_fwl/final --results_file docs/results/one_table.json
"""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import contextlib  # noqa: E402
import logging  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import (TYPE_CHECKING, Any, Callable, ContextManager, Dict, List, Literal, Mapping, Optional,  # noqa: E402
                    Sequence, Tuple)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from modeling_fwp.cache_fwp import CACHE_ARGUMENT, output_cache  # noqa: E402

from .arguments import ParsedArguments, parse_arguments, require_positive  # noqa: E402
from .dynamic_eval import DynamicEvaluation, detach_cache, eval_mode, swapped_parameters  # noqa: E402

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger("training.document_eval")

# Bucket edges (lower bounds): the target's position in its document, how often it occurred earlier in the
# document, and how often it occurs in the training split (Clark et al. Fig. 2's three panels).
POSITION_BUCKETS = (0, 128, 256, 512, 1024, 2048)
PRIOR_BUCKETS = (0, 1, 2, 5)
FREQUENCY_BUCKETS = (0, 10, 100, 1000, 10000)
RARE_BELOW = 100  # "rare": fewer training-split occurrences than this
METHODS = ("base", "test_time_fwl", "test_time_fwl_seen", "dynamic", "dynamic_output", "finetuned",
           "finetuned_dynamic", "finetuned_test_time_fwl", "fwl", "fwl_slow_only", "fwl_seen")
# Issue 17 item 4's one table, in its order: (1), (2), (2) + dynamic evaluation, (3), (3'), test-time FWL on (2),
# on (1).
ONE_TABLE = ("base", "finetuned", "finetuned_dynamic", "fwl", "fwl_slow_only", "finetuned_test_time_fwl",
             "test_time_fwl")
ROW_LABELS = {
    "base": "(1) base", "test_time_fwl": "test-time FWL on (1)", "test_time_fwl_seen": "test-time FWL (1), seen",
    "dynamic": "(1) + dynamic eval.",
    "dynamic_output": "(1) + dyn. eval. output", "finetuned": "(2) fine-tuned, no FWL",
    "finetuned_dynamic": "(2) + dynamic eval.", "finetuned_test_time_fwl": "test-time FWL on (2)",
    "fwl": "(3) fine-tuned FWL", "fwl_slow_only": "(3') its slow head alone", "fwl_seen": "(3), seen rows",
}
# Which model folder each method starts from (an option of DocumentEvalArguments), and what it does to that model.
METHOD_SOURCE = {"base": "model_name_or_path", "test_time_fwl": "model_name_or_path",
                 "test_time_fwl_seen": "model_name_or_path", "dynamic": "model_name_or_path",
                 "dynamic_output": "model_name_or_path", "finetuned": "finetuned_model",
                 "finetuned_dynamic": "finetuned_model", "finetuned_test_time_fwl": "finetuned_model",
                 "fwl": "fwl_model", "fwl_slow_only": "fwl_model", "fwl_seen": "fwl_model"}
METHOD_KIND = {"base": "plain", "finetuned": "plain", "fwl": "plain", "fwl_slow_only": "slow_only", "fwl_seen": "seen",
               "test_time_fwl": "test_time_fwl", "test_time_fwl_seen": "test_time_fwl",
               "finetuned_test_time_fwl": "test_time_fwl", "dynamic": "dynamic",
               "finetuned_dynamic": "dynamic", "dynamic_output": "dynamic_output"}
# Issue 17's goals: the trained FWL's gain over (2) >= half of dynamic evaluation's, at <= 1.2x the base's scoring
# time; the test-time FWL on the untouched base: a gain at <= 1.15x the base's time.
MIN_GAIN_SHARE = 0.5
MAX_FWL_TIME = 1.2
MAX_TEST_TIME_FWL_TIME = 1.15


@dataclass
class TokenScores:
    """Per-token results of scoring documents (flat over documents, ``[N]`` arrays): ``nll`` (nats), ``position``
    (index of the target in its document, >= 1), ``prior`` (occurrences of the target earlier in its document),
    ``frequency`` (occurrences in the training split, -1 if unknown); ``seconds`` of scoring."""

    nll: np.ndarray
    position: np.ndarray
    prior: np.ndarray
    frequency: np.ndarray
    seconds: float

    @classmethod
    def concat(cls, parts: Sequence["TokenScores"]) -> "TokenScores":
        fields = ("nll", "position", "prior", "frequency")
        arrays = {f: np.concatenate([getattr(p, f) for p in parts]) for f in fields}
        return cls(**arrays, seconds=sum(p.seconds for p in parts))

    def summary(self) -> Dict[str, Any]:
        """Perplexity and token count overall, of first / repeated targets, of rare ones, and per bucket."""

        def ppl(mask: np.ndarray) -> Dict[str, Any]:
            n = int(mask.sum())
            return {"perplexity": round(math.exp(float(self.nll[mask].mean())), 4) if n else None, "tokens": n}

        def buckets(values: np.ndarray, edges: Sequence[int]) -> Dict[str, Any]:
            bounds = list(edges) + [None]
            return {
                f"{lo}-{'' if hi is None else hi - 1}": ppl((values >= lo) & (values < hi if hi is not None else True))
                for lo, hi in zip(bounds[:-1], bounds[1:])
            }

        everything = np.ones_like(self.nll, dtype=bool)
        n = int(everything.sum())
        known = self.frequency >= 0
        return {
            **ppl(everything),
            "loss": round(float(self.nll.mean()), 6),
            "seconds": round(self.seconds, 2),
            "tokens_per_second": round(n / self.seconds, 1) if self.seconds > 0 else None,
            "first": ppl(self.prior == 0),
            "repeated": ppl(self.prior > 0),
            "rare": ppl(known & (self.frequency < RARE_BELOW)),
            "by_position": buckets(self.position, POSITION_BUCKETS),
            "by_prior_occurrences": buckets(self.prior, PRIOR_BUCKETS),
            "by_train_frequency": buckets(np.where(known, self.frequency, -1), FREQUENCY_BUCKETS),
        }


def encode_documents(
    tokenizer: PreTrainedTokenizerBase, documents: Sequence[str], max_length: Optional[int]
) -> List[torch.Tensor]:
    """Each document's ids followed by the tokenizer's eos (``[n]`` long tensors), cut to `max_length` tokens."""
    out = []
    for doc in documents:
        ids = tokenizer(doc, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        out.append(torch.tensor(ids[:max_length] if max_length else ids, dtype=torch.long))
    return out


def train_token_counts(tokenizer: PreTrainedTokenizerBase, documents: Sequence[str]) -> np.ndarray:
    """``[vocab]`` occurrences of every token id in `documents` (the training split): rare-token buckets."""
    counts = np.zeros(len(tokenizer), dtype=np.int64)
    for ids in tokenizer(list(documents), add_special_tokens=False).input_ids:
        np.add.at(counts, np.asarray(ids, dtype=np.int64), 1)
    return counts


def prior_occurrences(ids: torch.Tensor) -> np.ndarray:
    """``[n]`` ids -> ``[n - 1]``: how often target ``ids[t + 1]`` occurred in ``ids[: t + 1]``."""
    seen: Dict[int, int] = {}
    values = ids.tolist()
    seen[values[0]] = 1
    out = np.zeros(len(values) - 1, dtype=np.int64)
    for t, token in enumerate(values[1:]):
        out[t] = seen.get(token, 0)
        seen[token] = out[t] + 1
    return out


def segment_nll(
    model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, cache: Any, params: Optional[Dict[str, torch.Tensor]]
) -> Tuple[torch.Tensor, Any]:
    """``[T]`` NLL of ``targets [1, T]`` given ``inputs [1, T]`` and the carried cache (``params`` swapped in);
    returns (nll, the cache after the segment). The model gets ``input_ids`` (the FWL learns from them)."""
    with swapped_parameters(model, params):
        out = model(input_ids=inputs, use_cache=True, **{CACHE_ARGUMENT: cache})
    logits = out.logits[0].float()
    return F.cross_entropy(logits, targets[0], reduction="none"), output_cache(out)


def score_document(
    model: nn.Module, ids: torch.Tensor, segment_length: int, dynamic: Optional[DynamicEvaluation] = None
) -> np.ndarray:
    """``[n - 1]`` NLL of every token of one document ``ids [n]`` but the first, in segments with the cache carried
    and detached; with `dynamic`, a gradient step on the segment's mean loss after scoring it (a private weight copy,
    fresh for every document; the model is never modified)."""
    if ids.dim() != 1 or ids.numel() < 2:
        raise ValueError(f"`ids` must be one document of >= 2 tokens, got shape {tuple(ids.shape)}")
    if segment_length < 1:
        raise ValueError(f"`segment_length` must be >= 1, got {segment_length}")
    ids = ids.to(next(model.parameters()).device)[None]
    params = dynamic.initial_params(model) if dynamic is not None else None
    theta0 = {n: p.detach().clone() for n, p in params.items()} if dynamic is not None and dynamic.decay else {}
    ms: Dict[str, torch.Tensor] = {}
    cache, parts = None, []
    for start in range(0, ids.shape[1] - 1, segment_length):
        end = min(start + segment_length, ids.shape[1] - 1)
        inputs, targets = ids[:, start:end], ids[:, start + 1 : end + 1]
        with torch.set_grad_enabled(dynamic is not None):
            nll, cache = segment_nll(model, inputs, targets, cache, params)
        if dynamic is not None:
            if dynamic.lr > 0:
                names = list(params)
                grads = torch.autograd.grad(nll.mean(), [params[n] for n in names], allow_unused=True)
                dynamic.step(params, dict(zip(names, grads)), theta0, ms)
            cache = detach_cache(cache)  # the next segment's gradient stops here (Krause et al.)
        parts.append(nll.detach().cpu().double().numpy())
    return np.concatenate(parts)


def score_documents(
    model: nn.Module,
    documents: Sequence[torch.Tensor],
    segment_length: int,
    dynamic: Optional[DynamicEvaluation] = None,
    train_counts: Optional[np.ndarray] = None,
    label: str = "scoring",
) -> TokenScores:
    """Scores every document (``score_document``) with a labelled progress bar over tokens; returns the per-token
    results with their position, prior occurrences and training-split frequency."""
    from tqdm.auto import tqdm

    parts = []
    with eval_mode(model), tqdm(total=sum(d.numel() - 1 for d in documents), desc=label, unit="tok",
                                leave=False) as bar:
        for ids in documents:
            started = time.perf_counter()
            nll = score_document(model, ids, segment_length, dynamic)
            seconds = time.perf_counter() - started
            targets = ids[1:].numpy()
            frequency = train_counts[targets] if train_counts is not None else np.full(len(targets), -1)
            parts.append(TokenScores(nll, np.arange(1, len(ids)), prior_occurrences(ids), frequency, seconds))
            bar.update(len(targets))
    return TokenScores.concat(parts)


def choose_on_valid(
    score: Callable[[float], TokenScores], candidates: Sequence[float], name: str
) -> Tuple[float, Dict[str, float]]:
    """The candidate step size with the lowest perplexity under `score` (scoring valid documents), and
    ``{step size: valid perplexity}``; a best value at an edge of the grid is logged (widen the grid)."""
    candidates = [float(c) for c in candidates]
    if not candidates:
        raise ValueError(f"{name}: give at least one step size")
    if len(candidates) == 1:
        return candidates[0], {}
    tried = {c: math.exp(float(score(c).nll.mean())) for c in candidates}
    best = min(tried, key=tried.get)
    if best in (min(candidates), max(candidates)):
        logger.warning("%s: the best step size %g on valid is at the edge of the grid %s", name, best, candidates)
    logger.info("%s: valid perplexity by step size %s -> %g", name, {f"{k:g}": round(v, 3) for k, v in tried.items()},
                best)
    return best, {f"{k:g}": round(v, 4) for k, v in tried.items()}


def nll_change_by_bucket(results: Dict[str, Dict[str, Any]],
                         reference: str = "base") -> Dict[str, Dict[str, Dict[str, float]]]:
    """``{method: {panel: {bucket: change of mean NLL against `reference`}}}`` (negative = better), the data of Clark
    et al. Fig. 2, from the summaries' perplexities (log of their ratio)."""
    panels = ("by_position", "by_prior_occurrences", "by_train_frequency")
    out: Dict[str, Dict[str, Dict[str, float]]] = {}
    ref = results[reference]["summary"]
    for method, result in results.items():
        if method == reference:
            continue
        summary = result["summary"]
        out[method] = {
            panel: {
                bucket: round(math.log(summary[panel][bucket]["perplexity"] / ref[panel][bucket]["perplexity"]), 5)
                for bucket in ref[panel]
                if ref[panel][bucket]["perplexity"] and summary[panel][bucket]["perplexity"]
            }
            for panel in panels
        }
    return out


# ---------------------------------------------------------------------------------------------------------------
# The methods and the command line
# ---------------------------------------------------------------------------------------------------------------


def output_side_parameter_names(model: nn.Module) -> List[str]:
    """Names of the final norm's and the output embedding's parameters of a causal LM (what ``test_time_fwl``
    makes fast): dynamic evaluation of the same parameters."""
    from modeling_fwp.modeling_fwl import FINAL_NORM_NAMES

    decoder = model.base_model
    norm = next((getattr(decoder, n) for n in FINAL_NORM_NAMES if isinstance(getattr(decoder, n, None), nn.Module)),
                None)
    if norm is None:
        raise ValueError(f"{type(decoder).__name__} has no final norm among {FINAL_NORM_NAMES}")
    wanted = {id(p) for p in list(norm.parameters()) + list(model.get_output_embeddings().parameters())}
    return [name for name, p in model.named_parameters() if id(p) in wanted]


@dataclass
class MethodSetup:
    """One method ready to score: its `model`, ``configure(step size)`` -> the dynamic evaluation to run (or None,
    setting a test-time FWL's global step size as a side effect), the step sizes to try on valid (``[None]``: none),
    the `context` every scoring pass runs in (the FWL's ``slow_only`` for (3')), and the adapted `parameters`."""

    model: nn.Module
    configure: Callable[[Optional[float]], Optional[DynamicEvaluation]]
    candidates: List[Optional[float]]
    context: Callable[[], ContextManager] = contextlib.nullcontext
    parameters: Optional[Any] = None


def method_source(method: str, args: ParsedArguments) -> str:
    """The model folder `method` starts from (``--model_name_or_path``, ``--finetuned_model`` or ``--fwl_model``);
    ValueError naming the option when it is unset."""
    if method not in METHOD_SOURCE:
        raise ValueError(f"unknown method {method!r}; known: {METHODS}")
    option = METHOD_SOURCE[method]
    path = getattr(args, option)
    if not path:
        raise ValueError(f"method {method!r} needs `--{option}` (a model folder), which is unset")
    return path


def load_fwl_model(path: str, option: str, fast_vocabulary: Optional[str] = None) -> nn.Module:
    """The FWL model saved at `path`, in eval mode; with `fast_vocabulary` ("seen": its fast update on the seen rows
    only) that setting replaces the saved config's ``fwl_fast_vocabulary`` before the weights load. ValueError naming
    `option` for a model without an FWL head."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    if fast_vocabulary is not None:
        if not hasattr(config, "fwl_fast_vocabulary"):
            raise ValueError(f"`{option}` {path} has no FWL head ({type(config).__name__}); "
                             f"fwl_fast_vocabulary={fast_vocabulary!r} needs one")
        config.fwl_fast_vocabulary = fast_vocabulary
    model = AutoModelForCausalLM.from_pretrained(path, config=config).eval()
    if not hasattr(model, "fwl_head"):
        raise ValueError(f"`{option}` {path} has no FWL head ({type(model).__name__}): an FWL model is needed")
    return model


def build_method(method: str, args: ParsedArguments) -> MethodSetup:
    """The model of `method` (from its folder, ``method_source``) with what it changes at test time."""
    from transformers import AutoModelForCausalLM

    from .dynamic_eval import DEFAULT_STEP_SIZES, untie_output_embedding
    from .test_time_fwl import DEFAULT_STEP_SIZES as FWL_STEP_SIZES
    from .test_time_fwl import build_test_time_fwl, set_global_step_size

    path, kind = method_source(method, args), METHOD_KIND[method]
    if kind == "test_time_fwl":
        segment_start = args.fwl_gradient_point == "segment_start"
        model = build_test_time_fwl(path, fast_parameters=args.fwl_fast_parameters,
                                    fast_vocabulary="seen" if method.endswith("_seen") else "full",
                                    gradient_point=args.fwl_gradient_point,
                                    segment_length=(args.fwl_segment_length or args.segment_length) if segment_start
                                    else None)
        return MethodSetup(model, lambda alpha: set_global_step_size(model.fwl_head, alpha),
                           list(args.fwl_step_sizes or FWL_STEP_SIZES))
    if kind in ("seen", "slow_only"):
        model = load_fwl_model(path, f"--{METHOD_SOURCE[method]}", "seen" if kind == "seen" else None)
        context = model.fwl_head.slow_only if kind == "slow_only" else contextlib.nullcontext
        return MethodSetup(model, lambda _: None, [None], context=context)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    if kind == "plain":
        return MethodSetup(model, lambda _: None, [None])
    parameters = args.dynamic_eval_params
    if kind == "dynamic_output":
        untie_output_embedding(model)
        parameters = output_side_parameter_names(model)
    options = dict(method=args.dynamic_method, parameters=parameters)
    candidates = list(args.dynamic_lr or DEFAULT_STEP_SIZES[args.dynamic_method])
    return MethodSetup(model, lambda lr: DynamicEvaluation(lr, **options), candidates,
                       parameters=(args.dynamic_eval_params or "all") if kind == "dynamic" else parameters)


def evaluate_method(method: str, args: ParsedArguments, valid: List[torch.Tensor], test: List[torch.Tensor],
                    counts: Optional[np.ndarray]) -> Dict[str, Any]:
    """One method: its step size chosen on the valid documents, then its scores on the test documents."""
    setup = build_method(method, args)

    def score(step: Optional[float], documents: List[torch.Tensor], label: str) -> TokenScores:
        with setup.context():
            return score_documents(setup.model, documents, args.segment_length, setup.configure(step), counts, label)

    score(setup.candidates[0], [test[0][: args.segment_length + 1]], f"{method} warm-up")  # untimed first-call set-up
    step, tried = None, {}
    if setup.candidates != [None]:
        step, tried = choose_on_valid(lambda s: score(s, valid, f"{method} valid, step {s:g}"), setup.candidates,
                                      method)
    scores = score(step, test, f"{method} {args.split}")
    return {"step_size": step, "valid_perplexity_by_step_size": tried, "summary": scores.summary(),
            "parameters": setup.parameters, "model": method_source(method, args)}


@dataclass
class DocumentEvalArguments:
    """The model, the documents and the protocol."""

    model_name_or_path: str = field(default="checkpoints/smollm2-135m", metadata={"help": "a causal LM folder: (1)"})
    finetuned_model: Optional[str] = field(default=None, metadata={
        "help": "(2): the base fine-tuned without FWL (finetune_fwl's <output_dir>/base_finetuned/final), for the "
                "finetuned* methods"})
    fwl_model: Optional[str] = field(default=None, metadata={
        "help": "(3): the fine-tuned FWL model (finetune_fwl's <output_dir>/base_fwl/final), for fwl, fwl_slow_only, "
                "fwl_seen"})
    one_table: bool = field(default=False, metadata={
        "help": "score exactly issue 17 item 4's rows (base finetuned finetuned_dynamic fwl fwl_slow_only "
                "finetuned_test_time_fwl test_time_fwl) instead of --methods; needs --finetuned_model and --fwl_model"})
    data_dir: str = field(default="data/wiki", metadata={
        "help": "a corpus of train/valid/test.txt (data/wiki, data/austen)"})
    split: Literal["valid", "test"] = field(default="test", metadata={"help": "the split scored"})
    methods: List[str] = field(default_factory=lambda: ["base", "test_time_fwl", "dynamic"], metadata={
        "help": "the methods compared", "choices": METHODS})
    max_documents: Optional[int] = field(default=None, metadata={
        "help": "score the first N documents of --split; unset: all"})
    valid_documents: int = field(default=2, metadata={"help": "valid documents for choosing step sizes"})
    max_length: int = field(default=4096, metadata={"help": "tokens per document (longer ones are cut)"})
    segment_length: int = field(default=128, metadata={"help": "tokens per segment (the cache is carried across)"})
    train_documents: int = field(default=2000, metadata={"help": "training documents counted for rare tokens"})
    threads: Optional[int] = field(default=None, metadata={"help": "torch threads; unset: torch's"})
    results_file: Optional[str] = field(default=None, metadata={"help": "write the results as JSON here (with the "
                                                                        "run record)"})
    plot: Optional[str] = field(default=None, metadata={
        "help": "PNG of the NLL change by bucket (Clark et al. Fig. 2)"})


@dataclass
class StepSizeArguments:
    """The step sizes tried on valid and what the adapting methods change."""

    fwl_step_sizes: Optional[List[float]] = field(default=None, metadata={
        "help": "test-time FWL: global alphas to try; unset: training.test_time_fwl's"})
    fwl_fast_parameters: Optional[List[str]] = field(default=None, metadata={
        "help": "test-time FWL: fast output-side parameters; unset: output_embedding.weight output_bias "
                "(training.test_time_fwl.TEST_TIME_FAST_PARAMETERS; norm.weight adds the final norm's gain)"})
    fwl_gradient_point: Literal["slow", "segment_start"] = field(default="slow", metadata={
        "help": "test-time FWL: where its per-token gradients are taken: at the slow weights (Clark et al.) or at the "
                "fast weights of each segment's start (modeling_fwp's fwl_gradient_point)"})
    fwl_segment_length: Optional[int] = field(default=None, metadata={
        "help": "test-time FWL with --fwl_gradient_point segment_start: its segment length; unset: --segment_length"})
    dynamic_lr: Optional[List[float]] = field(default=None, metadata={
        "help": "dynamic evaluation: step sizes to try; unset: training.dynamic_eval's for the update chosen"})
    dynamic_method: Literal["sgd", "rms"] = field(default="sgd", metadata={"help": "dynamic evaluation's update"})
    dynamic_eval_params: Optional[List[str]] = field(default=None, metadata={
        "help": "method dynamic: adapt only these parameters (names or fnmatch globs); unset: all"})


def parse_args(argv: Optional[List[str]] = None) -> ParsedArguments:
    """The command line (``--help``: every option with its default); ValueError names a bad option."""
    args = parse_arguments((DocumentEvalArguments, StepSizeArguments), argv, description=__doc__)
    require_positive(args, ("max_documents", "valid_documents", "max_length", "segment_length", "train_documents",
                            "threads", "fwl_segment_length"))
    if args.one_table:
        args.methods = list(ONE_TABLE)
    if len(set(args.methods)) != len(args.methods):
        raise ValueError(f"`--methods` lists a method twice: {args.methods}")
    for method in args.methods:
        method_source(method, args)  # ValueError naming a model-folder option a method needs
    return args


def report(results: Dict[str, Dict[str, Any]]) -> str:
    """The comparison table: perplexity (all, first, repeated, rare), tokens/s, and both relative to base."""
    base = results.get("base", {}).get("summary")
    lines = [f"  {'method':<27}{'step':>8}{'ppl':>9}{'first':>9}{'repeat':>9}{'rare':>9}{'tok/s':>8}{'ppl/base':>10}"
             f"{'time/base':>10}"]
    for method, result in results.items():
        s = result["summary"]
        step = "" if result["step_size"] is None else f"{result['step_size']:.0e}"
        rel = time_rel = ""
        if base:
            rel = f"{s['perplexity'] / base['perplexity']:.4f}"
            time_rel = f"{base['tokens_per_second'] / s['tokens_per_second']:.2f}x"
        lines.append(f"  {ROW_LABELS.get(method, method):<27}{step:>8}{s['perplexity']:>9.3f}"
                     f"{s['first']['perplexity']:>9.3f}{s['repeated']['perplexity']:>9.3f}"
                     f"{s['rare']['perplexity'] or float('nan'):>9.3f}"
                     f"{s['tokens_per_second']:>8.1f}{rel:>10}{time_rel:>10}")
    return "\n".join(lines)


def time_vs_base(summaries: Mapping[str, Mapping[str, Any]], method: str) -> float:
    """`method`'s scoring time over the base's on the same tokens (ratio of their tokens/s)."""
    return summaries["base"]["tokens_per_second"] / summaries[method]["tokens_per_second"]


def goal_summary(summaries: Mapping[str, Mapping[str, Any]]) -> Dict[str, Dict[str, Any]]:
    """Issue 17's two goals, from the rows' summaries ``{method: {"perplexity", "tokens_per_second", ...}}``.

    - ``trained_fwl`` (needs base, finetuned, finetuned_dynamic, fwl): gain ratio = (ppl(2) - ppl(3)) /
      (ppl(2) - ppl((2) + dynamic evaluation)); met when (3) gains over (2) and its gain is at least
      ``MIN_GAIN_SHARE`` of dynamic evaluation's (with no dynamic-evaluation gain the ratio is None and any gain of
      (3) suffices), and (3)'s scoring time is at most ``MAX_FWL_TIME`` x the base's.
    - ``test_time_fwl_on_base`` (needs base, test_time_fwl): met when it lowers the base's perplexity at no more than
      ``MAX_TEST_TIME_FWL_TIME`` x the base's time.

    A goal whose rows are missing is left out. Times are ratios of tokens/s (one pass each: noisy on a shared machine).
    """
    ppl = {method: float(s["perplexity"]) for method, s in summaries.items()}
    goals: Dict[str, Dict[str, Any]] = {}
    if {"base", "finetuned", "finetuned_dynamic", "fwl"} <= set(summaries):
        gain, dynamic_gain = ppl["finetuned"] - ppl["fwl"], ppl["finetuned"] - ppl["finetuned_dynamic"]
        ratio = gain / dynamic_gain if dynamic_gain > 0 else None
        time_ratio = time_vs_base(summaries, "fwl")
        goals["trained_fwl"] = {
            "goal": f"(3) gains over (2) >= {MIN_GAIN_SHARE:g} x what (2) + dynamic evaluation gains, at <= "
                    f"{MAX_FWL_TIME:g}x the base's scoring time",
            "gain_over_finetuned": round(gain, 4), "dynamic_gain_over_finetuned": round(dynamic_gain, 4),
            "gain_ratio": None if ratio is None else round(ratio, 4), "time_vs_base": round(time_ratio, 3),
            "met": bool(gain > 0 and gain >= MIN_GAIN_SHARE * dynamic_gain and time_ratio <= MAX_FWL_TIME),
        }
    for method, variant in (("test_time_fwl", ""), ("test_time_fwl_seen", " (its update on the seen rows only)")):
        if {"base", method} <= set(summaries):
            gain, time_ratio = ppl["base"] - ppl[method], time_vs_base(summaries, method)
            goals[f"{method}_on_base"] = {
                "goal": f"test-time FWL{variant} on the untouched base: a gain at <= {MAX_TEST_TIME_FWL_TIME:g}x the "
                        "base's time",
                "gain_over_base": round(gain, 4), "ppl_ratio": round(ppl[method] / ppl["base"], 4),
                "time_vs_base": round(time_ratio, 3), "met": bool(gain > 0 and time_ratio <= MAX_TEST_TIME_FWL_TIME),
            }
    return goals


def goal_report(goals: Mapping[str, Mapping[str, Any]]) -> str:
    """One line per goal of ``goal_summary``: its figures and met / not met."""
    lines = []
    for name, goal in goals.items():
        if name == "trained_fwl":
            ratio = ("n/a (dynamic evaluation gains nothing)" if goal["gain_ratio"] is None
                     else f"{goal['gain_ratio']:.3f}")
            figures = (f"gain over (2) {goal['gain_over_finetuned']:+.3f} ppl vs dynamic evaluation's "
                       f"{goal['dynamic_gain_over_finetuned']:+.3f}: ratio {ratio}")
        else:
            figures = f"gain over (1) {goal['gain_over_base']:+.3f} ppl (ratio {goal['ppl_ratio']:.4f})"
        lines.append(f"  {'MET' if goal['met'] else 'NOT MET'}: {goal['goal']}\n      {figures}; time "
                     f"{goal['time_vs_base']:.2f}x the base's")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    from transformers import AutoTokenizer

    from .result_file import RunRecord
    from .train_transfo_xl import read_documents

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    args = parse_args(argv)
    record = RunRecord.start("python -m training.document_eval", argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    data = Path(args.data_dir)
    test = encode_documents(tokenizer, read_documents(data / f"{args.split}.txt")[: args.max_documents],
                            args.max_length)
    valid = encode_documents(tokenizer, read_documents(data / "valid.txt")[: args.valid_documents], args.max_length)
    counts = train_token_counts(tokenizer, read_documents(data / "train.txt")[: args.train_documents])
    results = {method: evaluate_method(method, args, valid, test, counts) for method in args.methods}
    table = report(results)
    tokens = results[args.methods[0]]["summary"]["tokens"]
    print(f"\n{args.data_dir} {args.split}: {len(test)} documents, {tokens} tokens scored (segments of "
          f"{args.segment_length}, cache carried; step sizes chosen on {len(valid)} valid documents)\n{table}")
    out = {"settings": args.record(), "documents": len(test), "results": results}
    goals = goal_summary({method: result["summary"] for method, result in results.items()})
    if goals:
        out["goals"] = goals
        print("\nIssue 17's goals (step sizes chosen on valid; times of one pass each, rough on a shared machine: "
              f"benchmarks/bench_test_time_fwl.py times them in interleaved rounds):\n{goal_report(goals)}")
    if "base" in results:
        out["nll_change_vs_base"] = nll_change_by_bucket(results)
    if args.plot and "base" in results and len(results) > 1:
        from .plots import plot_nll_change

        path = plot_nll_change(out["nll_change_vs_base"], Path(args.plot),
                               f"{args.model_name_or_path} on {args.data_dir} {args.split}")
        if path:
            print(f"plot: {path}")
    if args.results_file:
        record.write(args.results_file, out)
        print(f"results: {args.results_file}")
    return out


if __name__ == "__main__":
    main()
