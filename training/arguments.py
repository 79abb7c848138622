"""Command-line arguments of the scripts: transformers' ``HfArgumentParser`` over small dataclasses.

Scripts that train parse ``TrainingArguments`` next to their own dataclasses, so every Trainer flag works
(``--bf16``, ``--report_to``, ``--save_total_limit``, ``--gradient_checkpointing``, ...); the other scripts parse
their own dataclasses only. Options carry the names of transformers' example scripts (``--model_name_or_path``,
``--dataset_name`` / ``--dataset_config_name`` / ``--train_file`` / ``--validation_file``, ``--block_size``,
``--learning_rate``, ``--max_steps``, ``--per_device_train_batch_size``, ``--output_dir``, ``--seed``) and ``--help``
shows every default. A script's own defaults for Trainer options (its learning rate, schedule, output folder) are
parser defaults: shown by ``--help``, and overridden like any other option.

:func:`parse_arguments` returns a :class:`ParsedArguments`, read as one namespace (``args.block_size``,
``args.learning_rate``) with each group at hand (``args.training`` is the ``TrainingArguments``).
"""
from __future__ import annotations

import argparse
import dataclasses
import enum
import json
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Type

from transformers import HfArgumentParser, TrainingArguments

# Values never written into results files (which are uploaded with the model).
SECRET_ARGUMENTS = frozenset({"hub_token"})
# TrainingArguments fields recorded in results files even when they keep transformers' default.
RECORDED_TRAINING_FIELDS = (
    "output_dir", "max_steps", "per_device_train_batch_size", "gradient_accumulation_steps", "learning_rate",
    "lr_scheduler_type", "warmup_steps", "weight_decay", "max_grad_norm", "seed",
)


@dataclass
class DataArguments:
    """Where the training text comes from (the options of transformers' ``run_clm.py``)."""

    dataset_name: Optional[str] = field(
        default=None, metadata={"help": "a datasets.load_dataset name (e.g. wikitext)"})
    dataset_config_name: Optional[str] = field(
        default=None, metadata={"help": "its configuration (e.g. wikitext-103-raw-v1)"})
    text_column: str = field(default="text", metadata={"help": "the dataset's text column"})
    train_file: Optional[str] = field(
        default=None, metadata={"help": "a local text file to train on (documents separated by blank lines)"})
    validation_file: Optional[str] = field(default=None, metadata={"help": "a local text file to evaluate on"})

    def __post_init__(self) -> None:
        if self.dataset_name and self.train_file:
            raise ValueError("give either --dataset_name or --train_file, not both")


@dataclass
class HubExportArguments:
    """Trainer's Hub options (``--push_to_hub``, ``--hub_model_id``, ...) act on this project's export; plus this."""

    hub_dry_run: bool = field(
        default=False,
        metadata={"help": "write <output_dir>/hub_export and list the files an upload would send; upload nothing"})


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every default in ``--help``, and the script's docstring laid out as written."""


class ParsedArguments:
    """The dataclasses parsed from one command line, read as one namespace.

    ``args.name`` is the field of the first group that has it (groups do not share option names:
    ``HfArgumentParser`` refuses duplicates); setting ``args.name`` sets it in that group.
    """

    def __init__(self, groups: Sequence[Any]) -> None:
        object.__setattr__(self, "groups", tuple(groups))

    def _owner(self, name: str) -> Any:
        for group in self.groups:
            if name in {f.name for f in dataclasses.fields(group)}:
                return group
        raise AttributeError(f"no argument named {name!r} in {[type(g).__name__ for g in self.groups]}")

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self._owner(name), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._owner(name), name, value)

    def get(self, kind: Type) -> Any:
        """The parsed group of dataclass `kind` (None when the parser had none)."""
        return next((g for g in self.groups if isinstance(g, kind)), None)

    @property
    def training(self) -> TrainingArguments:
        found = self.get(TrainingArguments)
        if found is None:
            raise AttributeError("these arguments hold no TrainingArguments")
        return found

    def record(self) -> Dict[str, Any]:
        """The arguments as a JSON-ready dict for results files: every field of the script's own groups, the
        ``TrainingArguments`` that differ from transformers' defaults (plus ``RECORDED_TRAINING_FIELDS``), no
        secrets (``hub_token``)."""
        record: Dict[str, Any] = {}
        for group in self.groups:
            values = _training_record(group) if isinstance(group, TrainingArguments) else dataclasses.asdict(group)
            record.update({k: _plain(v) for k, v in values.items() if k not in SECRET_ARGUMENTS})
        return record


def _plain(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _field_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else None


def _training_record(args: TrainingArguments) -> Dict[str, Any]:
    values = args.to_dict()
    return {
        f.name: values[f.name] for f in dataclasses.fields(args)
        if f.init and f.name in values
        and (f.name in RECORDED_TRAINING_FIELDS or _plain(values[f.name]) != _plain(_field_default(f)))
    }


def parse_overrides(text: Optional[str]) -> Dict[str, Any]:
    """``--config_overrides`` as a dict: a JSON object, or ``key=value`` pairs separated by commas (each value read
    as JSON when it parses, else as a string: ``hidden_size=128,feature_map=dpfp,sum_normalization=false``)."""
    if not text:
        return {}
    text = text.strip()
    if text.startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"--config_overrides is not valid JSON: {err}") from err
        if not isinstance(value, dict):
            raise ValueError(f"--config_overrides must be a JSON object, got {type(value).__name__}")
        return value
    overrides: Dict[str, Any] = {}
    for pair in filter(None, (p.strip() for p in text.split(","))):
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--config_overrides: expected key=value, got {pair!r}")
        try:
            overrides[key.strip()] = json.loads(raw)
        except json.JSONDecodeError:
            overrides[key.strip()] = raw
    return overrides


def build_parser(
    dataclass_types: Iterable[Type], description: Optional[str] = None, defaults: Optional[Mapping[str, Any]] = None
) -> HfArgumentParser:
    """An ``HfArgumentParser`` over `dataclass_types` whose ``--help`` shows every default and `description` as
    written; `defaults` replaces field defaults (a script's own choice for a Trainer option, e.g. its
    ``output_dir``), and ``--help`` shows those."""
    # allow_abbrev=False: a removed option name (--model, --lr) must fail, not match a longer one by its prefix
    parser = HfArgumentParser(list(dataclass_types), description=description, formatter_class=_HelpFormatter,
                              allow_abbrev=False)
    if defaults:
        unknown = sorted(set(defaults) - {action.dest for action in parser._actions})
        if unknown:
            raise ValueError(f"`defaults` names no option of the parser: {unknown}")
        parser.set_defaults(**defaults)
    return parser


def parse_arguments(
    dataclass_types: Iterable[Type],
    argv: Optional[Sequence[str]] = None,
    description: Optional[str] = None,
    defaults: Optional[Mapping[str, Any]] = None,
) -> ParsedArguments:
    """Parses `argv` (default: ``sys.argv[1:]``) into one instance of each of `dataclass_types` (see
    :func:`build_parser`). A value a dataclass refuses raises its ValueError, naming the option."""
    parser = build_parser(dataclass_types, description, defaults)
    return ParsedArguments(parser.parse_args_into_dataclasses(args=None if argv is None else [str(a) for a in argv]))


def require_positive(args: ParsedArguments, names: Iterable[str], minimum: Mapping[str, int] = {}) -> None:
    """ValueError naming the first option of `names` whose value is not positive (or below ``minimum[name]``)."""
    for name in names:
        value, low = getattr(args, name), minimum.get(name)
        if value is not None and (value < low if low is not None else value <= 0):
            bound = f"at least {low}" if low is not None else "positive"
            raise ValueError(f"--{name} must be {bound}, got {value}")

