"""Model cards filled from a saved folder and the results JSON a training or evaluation script wrote.

The YAML metadata is built with huggingface_hub's ``ModelCardData`` (library, pipeline tag, license, tags, base
model, datasets, and a model-index of evaluation results); the body is the family's Jinja template in
``model_cards/templates`` (each extends ``base.md.j2``). Every number in a card is read from a file: ``config.json``,
the safetensors headers, and the results JSON. A card generated without results says so and reports no numbers.

Results JSON (the keys ``training/demo.py`` writes; other scripts use the same names):

- ``model``: ``parameters`` (count), ``class``.
- ``data``: the training data as the run used it: ``source`` (the corpus file) or ``train_file`` /
  ``validation_file``, ``dataset`` (optional: a Hub dataset id, or ``{"type", "name",
  "config"}``), ``splits``, ``tokenizer``, ``train_tokens``.
- ``training``: scalar hyperparameters and measurements (``steps``, ``batch_size``, ``block_size``, ``peak_lr``,
  ``seconds``, ...). ``args``: the script's command line. ``environment``: library versions and machine.
- ``evaluation``: one entry or a list of entries, each with the metrics of this model (``perplexity``, ``loss``,
  ``bits_per_character``, ``bits_per_byte``, ``accuracy``), ``split``, ``scored_tokens``, ``segment_tokens``,
  optionally ``name``, ``source`` (the evaluated file), ``dataset`` (as in ``data``) and ``method`` (a sentence on how
  the numbers were measured).
  Reference values of other models (``references``: ``{label: value}``, or keys ending in ``_perplexity`` /
  ``_loss`` such as ``unigram_perplexity``) are shown in the card, never reported as this model's results; this
  model's numbers on subsets or under other protocols (``breakdown``: ``{label: value}``) are shown but kept out of
  the model-index.
- ``base_model``: (optional) Hub id of the pretrained model an FWL was fine-tuned from (the model's own record,
  ``config.json``'s ``base_model_id``, written when the base was loaded, is read first).

Claims about the model itself are measured, not assumed: :func:`card_for_folder` loads the model and measures its
generation cache after a short and a long prompt (:func:`measure_cache`), and an instruction-tuned base is detected
from its recorded names (:func:`instruction_tuned_name`).

The other scripts' files (``finetune_fwl.py``, ``eval_lm.py``, ``train_transfo_xl.py``) are read through
``model_cards.readers``, which maps them onto this layout.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import jinja2
from huggingface_hub import EvalResult, ModelCard, ModelCardData
from huggingface_hub.repocard_data import model_index_to_eval_results

from modeling_fwp.families import FAMILIES as MODEL_FAMILIES
from modeling_fwp.families import FWL_CARD_SUFFIX

from .readers import ResultsSource, read_results

TEMPLATES_DIR = Path(__file__).parent / "templates"
NO_RESULTS_NOTE = (
    "No evaluation results were supplied when this card was generated, so it reports no numbers. "
    "Regenerate it with the results JSON of an evaluation run (`python -m model_cards card FOLDER --results FILE`)."
)
LIBRARY_NAME = "transformers"
PIPELINE_TAG = "text-generation"
DEFAULT_LICENSE = "apache-2.0"
TASK_NAME = "Causal language modeling"
# Metrics of this model that go into the model-index: results key -> (metric type, display name).
METRICS: Dict[str, Tuple[str, str]] = {
    "perplexity": ("perplexity", "Perplexity"),
    "loss": ("loss", "Cross-entropy (nats/token)"),
    "bits_per_character": ("bpc", "Bits per character"),
    "bits_per_byte": ("bpb", "Bits per byte"),
    "accuracy": ("accuracy", "Accuracy"),
}
REFERENCE_SUFFIXES = ("_perplexity", "_loss")
ResultsArg = Union[None, ResultsSource, Sequence[ResultsSource]]  # one or several results files / dicts


@dataclass(frozen=True)
class Family:
    """How a model family is described: its name, the paper's nomenclature, template, tags and references.

    ``slow_net``, ``update_rule`` and ``fast_net`` are format strings over the config (``{version}``).
    """

    title: str
    template: str
    slow_net: str
    update_rule: str
    fast_net: str
    tags: Tuple[str, ...]
    citations: Tuple[str, ...]


@dataclass(frozen=True)
class CardStyle:
    """The presentation of a family's card: its Jinja template (in ``templates/``) and Hub tags."""

    template: str
    tags: Tuple[str, ...]


_FWP_TAGS = ("fast-weights", "linear-attention")
_FAST_WEIGHT_TRANSFORMER = "fast_weight_transformer.md.j2"
_RECURRENT_FWP = "recurrent_fwp.md.j2"
_TRANSFO_XL = "transfo_xl_fwl.md.j2"
# Keyed by the card keys of modeling_fwp.families (the architecture name without its head suffix); the model facts
# (title, the paper's naming, citations) come from that table. A family without a style here has no card, which
# tests/test_families.py reports.
CARD_STYLES: Dict[str, CardStyle] = {
    "LinearTransformer": CardStyle(_FAST_WEIGHT_TRANSFORMER, _FWP_TAGS + ("linear-transformer",)),
    "DeltaNet": CardStyle(_FAST_WEIGHT_TRANSFORMER, _FWP_TAGS + ("delta-net",)),
    "GatedDeltaNet": CardStyle(_FAST_WEIGHT_TRANSFORMER, _FWP_TAGS + ("gated-delta-net", "delta-net")),
    "DeltaMLP": CardStyle(_RECURRENT_FWP, _FWP_TAGS + ("delta-mlp", "recurrent-fwp")),
    "DeltaDeltaNet": CardStyle(_RECURRENT_FWP, _FWP_TAGS + ("delta-delta-net", "recurrent-fwp")),
    "DeltaRNN": CardStyle(_RECURRENT_FWP, _FWP_TAGS + ("delta-rnn", "recurrent-fwp")),
    "DeltaLSTM": CardStyle(_RECURRENT_FWP, _FWP_TAGS + ("delta-lstm", "recurrent-fwp")),
    "RecurrentDeltaNet": CardStyle(_RECURRENT_FWP, _FWP_TAGS + ("recurrent-delta-net", "recurrent-fwp")),
    "TransfoXL": CardStyle(_TRANSFO_XL, ("transformer-xl",)),
    "TransfoXL" + FWL_CARD_SUFFIX: CardStyle(_TRANSFO_XL, _FWP_TAGS + ("transformer-xl", "fast-weight-layers")),
    "FWL": CardStyle("fwl.md.j2", _FWP_TAGS + ("fast-weight-layers",)),
}


def _families() -> Dict[str, Family]:
    """Card key -> :class:`Family`: the facts of ``modeling_fwp.families.FAMILIES`` with their ``CARD_STYLES``."""
    families = {}
    for spec in MODEL_FAMILIES:
        for key, facts in spec.card_facts().items():
            style = CARD_STYLES.get(key)
            if style is not None:
                families[key] = Family(facts.title, style.template, facts.slow_net, facts.update_rule,
                                       facts.fast_net, style.tags, facts.citations)
    return families


FAMILIES: Dict[str, Family] = _families()
_HEAD_SUFFIXES = ("ForCausalLM", "LMHeadModel", "Model")
# Config fields shown in the card, in this order, when present.
CONFIG_FIELDS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim", "intermediate_size",
    "update_rule", "feature_map", "dpfp_nu", "favor_features", "sum_normalization", "attention_normalization",
    "position_embedding_type", "version", "fast_net_depth", "fast_net_activation", "mem_len", "clamp_len", "cutoffs",
    "use_fwl", "fwl_intermediate_size", "fwl_fast_parameters", "fwl_step_size_init", "fwl_residual", "fwl_output_bias",
    "tie_word_embeddings",
)
_ONLY_WITH = {"dpfp_nu": ("feature_map", "dpfp"), "favor_features": ("feature_map", "favor")}
FEATURE_MAPS = {
    "elu": "ELU + 1 (Katharopoulos et al. 2020)",
    "dpfp": "DPFP-{dpfp_nu} (Schlag et al. 2021, eq. 37; dimension 2 x head_dim x {dpfp_nu})",
    "favor": "FAVOR+ with m = {favor_features} random features, dimension 2m (Schlag et al. 2021, eqs. 31-32)",
    "relu": "ReLU",
    "identity": "identity (phi(x) = x)",
    "silu": "SiLU (as flash-linear-attention's Delta Nets)",
    "softmax": "softmax (applied inside the recurrence, as in Irie et al. 2021)",
}


# ---------------------------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------------------------


def family_key(config: Mapping[str, Any]) -> str:
    """The ``FAMILIES`` key of a config dict (from its ``architectures``; Transformer-XL splits on ``use_fwl``)."""
    architectures = config.get("architectures") or []
    if not architectures:
        raise ValueError("config.json has no `architectures`: save the model with save_pretrained first")
    name = architectures[0]
    for suffix in _HEAD_SUFFIXES:
        if name.endswith(suffix) and name != suffix:
            name = name[: -len(suffix)]
            break
    if config.get("use_fwl") and name + FWL_CARD_SUFFIX in FAMILIES:
        name += FWL_CARD_SUFFIX
    if name not in FAMILIES:
        raise ValueError(f"No model card template for architecture {architectures[0]!r}; known: {sorted(FAMILIES)}")
    return name


def _format(template: str, values: Mapping[str, Any]) -> str:
    try:
        return template.format(**values)
    except (KeyError, IndexError):
        return re.sub(r"\s*\([^()]*\{[^()]*\}[^()]*\)", "", template)  # drop a parenthesis whose field is unknown


def count_parameters(folder: Union[str, os.PathLike]) -> Optional[int]:
    """Number of stored weight values in a folder's safetensors files (tied weights are stored once)."""
    from safetensors import safe_open

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                total += math.prod(f.get_slice(name).get_shape())
    return total


# ---------------------------------------------------------------------------------------------------------------
# Evaluation results
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Evaluation:
    """One evaluation of this model: its metrics (model-index), reference values and how it was measured."""

    dataset_type: str
    dataset_name: str
    dataset_config: Optional[str]
    split: Optional[str]
    metrics: List[Tuple[str, str, float]]  # (metric type, display name, value)
    references: List[Tuple[str, float]] = field(default_factory=list)
    breakdown: List[Tuple[str, float]] = field(default_factory=list)
    name: Optional[str] = None
    method: str = ""

    def eval_results(self) -> List[EvalResult]:
        return [
            EvalResult(
                task_type=PIPELINE_TAG, task_name=TASK_NAME, dataset_type=self.dataset_type,
                dataset_name=self.dataset_name, dataset_config=self.dataset_config, dataset_split=self.split,
                metric_type=metric_type, metric_name=metric_name, metric_value=value,
            )
            for metric_type, metric_name, value in self.metrics
        ]


def _dataset(entry: Mapping[str, Any], data: Mapping[str, Any]) -> Tuple[str, str, Optional[str]]:
    dataset = entry.get("dataset") or data.get("dataset")
    if isinstance(dataset, Mapping):
        if "type" not in dataset:
            raise ValueError(f"an evaluation `dataset` dict needs a `type` (Hub dataset id), got {dict(dataset)}")
        return str(dataset["type"]), str(dataset.get("name", dataset["type"])), dataset.get("config")
    if isinstance(dataset, str):
        return dataset, dataset, None
    source = entry.get("source") or data.get("source")  # the evaluated file, else the corpus
    if source:
        base = Path(str(source)).name
        return base, f"{base} (local corpus)", None
    raise ValueError(
        "the results do not say which data the evaluation used: add `data.source`, `data.dataset`, or a `source` "
        "or `dataset` to the evaluation entry"
    )


def _dataset_ids(dataset: Any) -> List[str]:
    """Hub dataset ids a results ``data.dataset`` declares (a local ``source`` file is not one)."""
    if isinstance(dataset, Mapping):
        return [str(dataset["type"])] if "type" in dataset else []
    return [d for d in _as_list(dataset) if isinstance(d, str)]


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _method(entry: Mapping[str, Any]) -> str:
    """A sentence on how the entry's numbers were measured, from its own fields only."""
    parts = []
    loss, perplexity = entry.get("loss"), entry.get("perplexity")
    scope = ""
    if entry.get("scored_tokens"):
        scope += f" over the {entry['scored_tokens']:,} predicted tokens"
    if entry.get("split"):
        scope += f" of the {entry['split']} split"
    if entry.get("segment_tokens"):
        scope += f", read in segments of {entry['segment_tokens']} tokens"
    if _is_number(loss):
        parts.append(f"Loss is the token-weighted mean next-token cross-entropy in nats{scope}.")
    if _is_number(loss) and _is_number(perplexity) and math.isclose(math.exp(loss), perplexity, rel_tol=1e-6):
        parts.append("Perplexity is exp(loss).")
    if entry.get("method"):
        parts.append(str(entry["method"]))
    return " ".join(parts)


def _labelled(values: Any) -> List[Tuple[str, float]]:
    return [(str(k), float(v)) for k, v in (values or {}).items() if _is_number(v)]


def evaluations(results: Optional[Mapping[str, Any]]) -> List[Evaluation]:
    """The evaluation entries of a results dict (see the module docstring); [] without results."""
    if not results or not results.get("evaluation"):
        return []
    entries = results["evaluation"]
    entries = [entries] if isinstance(entries, Mapping) else list(entries)
    data = results.get("data") or {}
    found = []
    for entry in entries:
        metrics = [(*METRICS[key], float(entry[key])) for key in METRICS if _is_number(entry.get(key))]
        if not metrics:
            raise ValueError(f"an evaluation entry has none of the metrics {sorted(METRICS)}: {dict(entry)}")
        references = [
            (key.replace("_", " "), float(value)) for key, value in entry.items()
            if key.endswith(REFERENCE_SUFFIXES) and _is_number(value)
        ] + _labelled(entry.get("references"))
        dataset_type, dataset_name, dataset_config = _dataset(entry, data)
        found.append(
            Evaluation(
                dataset_type=dataset_type, dataset_name=dataset_name, dataset_config=dataset_config,
                split=entry.get("split"), metrics=metrics, references=references,
                breakdown=_labelled(entry.get("breakdown")), name=entry.get("name"), method=_method(entry),
            )
        )
    return found


def _scalars(section: Any) -> List[Tuple[str, Any]]:
    if not isinstance(section, Mapping):
        return []
    return [(k, v) for k, v in section.items() if v is not None and isinstance(v, (str, int, float, bool))]


def format_value(value: Any) -> str:
    """A value for the card body: floats to 4 significant digits (the model-index keeps full precision), ints with
    thousands separators, absolute local paths as their file name (the directory means nothing on the Hub)."""
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-3):
            return f"{value:.3e}"
        return f"{value:.4g}" if abs(value) < 1000 else f"{value:,.1f}"
    if isinstance(value, str) and os.path.isabs(value):
        return Path(value).name
    return str(value)


# Config fields that must agree between config.json and the config a results JSON recorded for its model.
IDENTITY_FIELDS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                   "intermediate_size")


def check_results_match(config: Mapping[str, Any], results: Optional[Mapping[str, Any]]) -> None:
    """Raises ``ValueError`` when ``results`` recorded a model config (``model.config``) that is not this one."""
    recorded = ((results or {}).get("model") or {}).get("config")
    if not isinstance(recorded, Mapping):
        return
    differing = [
        f"{name} {recorded[name]!r} != {config[name]!r}"
        for name in IDENTITY_FIELDS
        if name in recorded and name in config and recorded[name] != config[name]
    ]
    if differing:
        raise ValueError(
            f"The results describe a different model than this config.json ({'; '.join(differing)}): refusing to "
            "attach its numbers"
        )


# ---------------------------------------------------------------------------------------------------------------
# Measured claims
# ---------------------------------------------------------------------------------------------------------------

CACHE_PROMPT_LENGTHS = (16, 256)  # prompt lengths at which the generation cache is measured


def cache_nbytes(cache: Any) -> int:
    """Bytes of every distinct tensor a cache object holds, however it nests them (layers, lists, dicts, a base
    model's cache inside an FWL cache)."""
    import torch

    seen, total, pending = set(), 0, [cache]
    while pending:
        item = pending.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, torch.Tensor):
            total += item.numel() * item.element_size()
        elif isinstance(item, Mapping):
            pending.extend(item.values())
        elif isinstance(item, (list, tuple)):
            pending.extend(item)
        elif hasattr(item, "__dict__") and not isinstance(item, type):
            pending.extend(vars(item).values())
    return total


def measure_cache(model: Any, lengths: Sequence[int] = CACHE_PROMPT_LENGTHS) -> Dict[int, int]:
    """``{prompt tokens: bytes of the generation cache}`` after a forward pass over one prompt of each length (fixed
    random token ids; the cache generation continues from)."""
    import torch

    vocab_size = (model.config.vocab_size if hasattr(model.config, "vocab_size")
                  else model.config.get_text_config().vocab_size)
    generator = torch.Generator().manual_seed(0)
    sizes = {}
    was_training = model.training
    model.eval()
    try:
        for length in lengths:
            ids = torch.randint(vocab_size, (1, length), generator=generator).to(model.device)
            with torch.no_grad():
                out = model(input_ids=ids, use_cache=True)
            cache = out.get("cache", None) or out.get("past_key_values", None)
            if cache is None:
                raise ValueError(f"{type(model).__name__} returned no cache with use_cache=True")
            sizes[int(length)] = cache_nbytes(cache)
    finally:
        model.train(was_training)
    return sizes


def _bytes(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def cache_sentence(sizes: Optional[Mapping[int, int]], values: Mapping[str, Any],
                   holds_base_cache: bool) -> Optional[str]:
    """The card's claim about the generation cache, from measured ``sizes`` (None: no claim)."""
    if not sizes:
        return None
    lengths = sorted(sizes)
    measured = ", ".join(f"{_bytes(sizes[n])} after {n} prompt tokens" for n in lengths)
    if len({sizes[n] for n in lengths}) == 1:
        verdict = "it is a recurrent state of constant size, not a key/value cache that grows with the context"
    else:
        verdict = "it grows with the context"
        if holds_base_cache:
            verdict += ": besides the FWL's state it holds the base model's key/value cache"
        elif values.get("mem_len"):
            verdict += f" until it holds `mem_len` = {values['mem_len']} positions per layer, then stays that size"
    return f"Generation cache, measured when this card was generated (batch 1): {measured}; {verdict}."


# ---------------------------------------------------------------------------------------------------------------
# The card
# ---------------------------------------------------------------------------------------------------------------


def _citations(keys: Iterable[str]) -> str:
    text = (TEMPLATES_DIR / "citations.bib").read_text(encoding="utf-8")
    entries = {m.group(1): m.group(0).strip() for m in re.finditer(r"@\w+\{([^,]+),.*?\n\}", text, flags=re.S)}
    missing = [k for k in keys if k not in entries]
    if missing:
        raise KeyError(f"citations.bib has no entry {missing}")
    return "\n\n".join(entries[k] for k in keys)


def _environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES_DIR)), trim_blocks=True, lstrip_blocks=True,
        keep_trailing_newline=True, undefined=jinja2.StrictUndefined,
    )


def _as_list(value: Union[None, str, Sequence[str]]) -> List[str]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def _hub_id(value: Any) -> Optional[str]:
    """``value`` when it looks like a Hub repo id (``owner/name``), else None (local paths, e.g. a converted
    ``checkpoints/smollm2-135m`` folder, are not base models)."""
    if (
        isinstance(value, str) and re.fullmatch(r"[\w.-]+/[\w.-]+", value) and not value.startswith(".")
        and not os.path.exists(value)
    ):
        return value
    return None


def _base_model(key: str, base_model: Optional[str], results: Any, config: Mapping[str, Any]):
    """``(base_model Hub id or None, the card's sentence naming it)``: the argument, else the Hub id the model recorded
    when its base was loaded (``base_model_id``), else the results' ``base_model``, each when it is a Hub id. Never
    a local path: ``text_config._name_or_path`` is the folder the base was read from, on the machine it was read on."""
    base_model = (_hub_id(base_model) or _hub_id(config.get("base_model_id"))
                  or _hub_id((results or {}).get("base_model")))
    if key == "FWL" and base_model is None:
        text_type = (config.get("text_config") or {}).get("model_type", "unknown")
        return None, f"a pretrained `{text_type}` model (its Hub id was not recorded)"
    return base_model, (f"[`{base_model}`](https://huggingface.co/{base_model})" if base_model else None)


# A Hub name that says the model was tuned to follow instructions or chat (SmolLM2-135M-Instruct, Llama-2-7b-chat,
# gemma-2b-it, zephyr-7b-sft / -dpo).
_INSTRUCTION_TUNED = re.compile(r"instruct|chat|(?:^|[-_])(?:it|sft|dpo|rlhf)(?:$|[-_])", re.IGNORECASE)


def instruction_tuned_name(*names: Optional[str]) -> Optional[str]:
    """The first of ``names`` (the base's Hub id, the names its config records) that marks an instruction-tuned or
    chat model, else None."""
    for name in names:
        if isinstance(name, str) and _INSTRUCTION_TUNED.search(name.rsplit("/", 1)[-1]):
            return name
    return None


def _config_rows(values: Mapping[str, Any]) -> List[Tuple[str, str]]:
    """The card's configuration table: each of ``CONFIG_FIELDS`` that is set (and applies), formatted."""
    return [
        (name, format_value(values[name])) for name in CONFIG_FIELDS
        if values.get(name) is not None
        and (name not in _ONLY_WITH or values.get(_ONLY_WITH[name][0]) == _ONLY_WITH[name][1])
    ]


def _layer_options(values: Mapping[str, Any]) -> List[str]:
    """Sentences on the options beyond the papers' layer that a config sets (later Delta Nets, converted
    flash-linear-attention checkpoints)."""
    found = []
    if values.get("short_conv_size"):
        found.append(f"a causal depthwise convolution of width {values['short_conv_size']} (no bias) "
                     "on each of q, k, v after its projection")
    if values.get("value_activation") == "silu":
        found.append("SiLU on the values")
    if values.get("qk_l2_normalization"):
        found.append("queries and keys L2-normalised per head after phi")
    if values.get("query_scaling"):
        found.append("queries scaled by d_k^-1/2")
    if values.get("update_rule") == "delta" and values.get("beta_bias") is False:
        found.append("beta without bias")
    if values.get("allow_neg_eigval"):
        found.append("beta doubled, in (0, 2)")
    if values.get("output_norm"):
        gate = f", gated by {values.get('output_gate_activation', 'silu')}(W_g x)" if values.get("output_gate") else ""
        found.append(f"an RMSNorm over each head's output{gate}")
    if (values.get("num_v_heads") or 0) > (values.get("num_attention_heads") or 0):
        found.append(f"{values['num_v_heads']} value heads sharing {values['num_attention_heads']} query/key heads")
    if values.get("feed_forward_type") == "swiglu":
        found.append("a SwiGLU feed-forward without biases")
    return found


def _formatted_rows(section: Any) -> List[Tuple[str, str]]:
    """``(key, formatted value)`` of a results section's scalars."""
    return [(k, format_value(v)) for k, v in _scalars(section)]


def _evaluation_metadata(evals: Sequence[Any]) -> Dict[str, Any]:
    """The card metadata's ``metrics`` and ``eval_results`` (None when there are none) from the evaluations."""
    return {"metrics": sorted({m[0] for e in evals for m in e.metrics}) or None,
            "eval_results": [r for e in evals for r in e.eval_results()] or None}


def _provenance(key: str, config: Mapping[str, Any], values: Mapping[str, Any], results: Optional[Mapping[str, Any]],
                license: Optional[str], base_model: Optional[str],
                ) -> Tuple[Optional[Mapping[str, Any]], str, Optional[str], Optional[str]]:
    """(source of converted weights or None, license, base model Hub id, note on the base) of a card: converted weights
    (``pretrained_source``, modeling_fwp.convert_fla) take their source's license and repo unless given. `values`: the
    config with its text_config's fields."""
    source = values.get("pretrained_source") or None
    if source:
        license = license or source.get("license") or "other"
        base_model = base_model or _hub_id(source.get("repo_id"))
    base_model, base_note = _base_model(key, base_model, results, config)
    return source, license or DEFAULT_LICENSE, base_model, base_note


def build_card(
    config: Mapping[str, Any],
    results: ResultsArg = None,
    *,
    model_name: Optional[str] = None,
    repo_id: Optional[str] = None,
    license: Optional[str] = None,
    datasets: Union[None, str, Sequence[str]] = None,
    base_model: Optional[str] = None,
    language: Union[None, str, Sequence[str]] = None,
    tags: Sequence[str] = (),
    num_parameters: Optional[int] = None,
    has_tokenizer: bool = True,
    results_files: Sequence[str] = (),
    results_model: Optional[Union[str, os.PathLike]] = None,
    cache_sizes: Optional[Mapping[int, int]] = None,
) -> ModelCard:
    """A model card for a model with this ``config`` (a ``config.json`` dict) and measured ``results``.

    Args:
        results: a results JSON path or dict (module docstring; other scripts' files through
            ``model_cards.readers``), or a list of them, or None: the card then says it has no numbers.
        model_name: title and model-index name (default: the name part of ``repo_id``, else the family's title).
        repo_id: the Hub id used in the loading instructions (default: a placeholder path).
        datasets: Hub dataset ids of the training data (default: ``data.dataset`` of the results, when a Hub id).
        license: the card's license (default: for converted weights, the one recorded at conversion, stated by their
            source or (fla-hub) inferred from fla's MIT code license, else "other"; otherwise ``DEFAULT_LICENSE``).
        base_model: Hub id of the base (FWL: default ``base_model_id`` recorded in the config, else the results';
            for converted weights their source repo).
        num_parameters: stored weight count (default: the results' ``model.parameters``).
        results_files: names of the results files shipped next to the card, cited as the numbers' source.
        results_model: for an eval_lm file covering several models, the evaluated model's folder.
        cache_sizes: ``{prompt tokens: bytes}`` of the generation cache (:func:`measure_cache`; None: no claim).
    """
    results = read_results(results, results_model)
    check_results_match(config, results)
    key = family_key(config)
    family = FAMILIES[key]
    text_config = config.get("text_config") or {}
    values = {**text_config, **config}
    evals = evaluations(results)
    data = (results or {}).get("data") or {}
    datasets = _dataset_ids(data.get("dataset")) if datasets is None else datasets
    source, license, base_model, base_note = _provenance(key, config, values, results, license, base_model)
    num_parameters = (((results or {}).get("model") or {}).get("parameters") if num_parameters is None
                      else num_parameters)
    model_name = model_name or (repo_id.split("/")[-1] if repo_id else family.title)
    card_data = ModelCardData(
        model_name=model_name, library_name=LIBRARY_NAME, pipeline_tag=PIPELINE_TAG, license=license,
        language=_as_list(language) or None, tags=list(dict.fromkeys([*family.tags, *tags])), base_model=base_model,
        datasets=_as_list(datasets) or None, **_evaluation_metadata(evals),
    )
    context = dict(
        model_name=model_name,
        family=family,
        slow_net=_format(family.slow_net, values),
        update_rule=_format(family.update_rule, values),
        fast_net=_format(family.fast_net, values),
        feature_map=_format(FEATURE_MAPS.get(values.get("feature_map"), ""), values),
        config=values,
        config_rows=_config_rows(values),
        layer_options=_layer_options(values),
        source=source,
        num_parameters=format_value(num_parameters) if num_parameters else None,
        base_model=base_model,
        base_note=base_note,
        evaluations=evals,
        format_value=format_value,
        no_results_note=NO_RESULTS_NOTE,
        **{f"{part}_rows": _formatted_rows((results or {}).get(part)) for part in ("training", "args", "environment")},
        data_rows=_formatted_rows(data),
        results_files=list(results_files),
        repo=repo_id or "path/to/this/folder",
        has_tokenizer=has_tokenizer,
        instruction_tuned_base=instruction_tuned_name(base_model, config.get("base_model_id"),
                                                      *(text_config.get(k)
                                                        for k in ("source_model_id", "_name_or_path"))),
        cache_note=cache_sentence(cache_sizes, values, key == "FWL"),
        citations=_citations(family.citations),
    )
    body = _environment().get_template(family.template).render(**context)
    return ModelCard(f"---\n{card_data.to_yaml()}\n---\n{body}")


def _load(folder: Path) -> Any:
    """The model of a saved folder, with this package's classes (no remote code runs)."""
    import modeling_fwp  # noqa: F401  (registers the fwp_* model types)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder)


def card_for_folder(
    folder: Union[str, os.PathLike], results: ResultsArg = None, *, model: Any = None, measure: bool = True,
    cache_prompt_lengths: Sequence[int] = CACHE_PROMPT_LENGTHS, **options: Any,
) -> ModelCard:
    """:func:`build_card` for a saved model folder: reads ``config.json``, counts the stored weights, notes whether
    a tokenizer is there, cites the results files that lie in the folder, and measures the generation cache of the
    model (`model`, else the folder's model loaded) at ``cache_prompt_lengths``; ``measure=False`` skips it and the card
    makes no cache claim."""
    folder = Path(folder)
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{folder} has no config.json: save the model there with save_pretrained first")
    config = json.loads(config_file.read_text(encoding="utf-8"))
    options.setdefault("results_model", folder)
    read = read_results(results, options["results_model"])
    if options.get("num_parameters") is None and not ((read or {}).get("model") or {}).get("parameters"):
        options["num_parameters"] = count_parameters(folder)
    options.setdefault("has_tokenizer",
                       any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")))
    if measure:
        model = model if model is not None else _load(folder)
        options.setdefault("cache_sizes", measure_cache(model, cache_prompt_lengths))
    sources = ([] if results is None else [results] if isinstance(results, (str, os.PathLike, Mapping))
               else list(results))
    options.setdefault(
        "results_files",
        [Path(s).name for s in sources if not isinstance(s, Mapping) and Path(s).resolve().parent == folder.resolve()],
    )
    return build_card(config, results, **options)


def validate_card(card: Union[ModelCard, str]) -> ModelCard:
    """Parses a card (object or text) back with huggingface_hub and checks the metadata this project promises.

    Raises ``ValueError`` listing every problem: library / pipeline tag / license / tags, a model-index whose
    results lack a task, dataset or finite metric value, or a card without results that does not say so.
    """
    card = ModelCard(str(card))
    data = card.data
    problems = []
    if data.library_name != LIBRARY_NAME:
        problems.append(f"library_name is {data.library_name!r}, expected {LIBRARY_NAME!r}")
    if data.pipeline_tag != PIPELINE_TAG:
        problems.append(f"pipeline_tag is {data.pipeline_tag!r}, expected {PIPELINE_TAG!r}")
    if not data.license:
        problems.append("no license")
    if not data.tags:
        problems.append("no tags")
    model_index = data.to_dict().get("model-index")
    if model_index:
        try:
            name, results = model_index_to_eval_results(model_index)
        except (KeyError, TypeError, ValueError) as error:
            problems.append(f"model-index does not parse: {error!r}")
        else:
            if not name:
                problems.append("model-index has no model name")
            for r in results:
                missing = [f for f in ("task_type", "dataset_type", "dataset_name", "metric_type") if not getattr(r, f)]
                if missing:
                    problems.append(f"model-index result {r.metric_type or '?'} lacks {missing}")
                if not _is_number(r.metric_value):
                    problems.append(f"model-index result {r.metric_type} has a non-numeric value {r.metric_value!r}")
    elif NO_RESULTS_NOTE.split(",")[0] not in card.text:
        problems.append("the card has no model-index and does not say that no results were supplied")
    if problems:
        raise ValueError("Invalid model card: " + "; ".join(problems))
    return card
