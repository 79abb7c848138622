"""The papers' synthetic tasks as seeded ``datasets``, trained with ``Trainer`` on any model of this package or on a
softmax-attention baseline (``LlamaForCausalLM`` of the same size).

Tasks (every example is a token sequence; the loss is on the answer tokens only, ``labels = -100`` elsewhere):

- ``retrieval`` (Schlag et al. 2021 sec. 6.1, setting 1): S key-value pairs (one token ``k3:v7`` each), keys drawn
  without replacement from ``num_keys`` keys, values from ``num_values`` values, then ``?`` and one of the S keys as
  query; predict its value.
  Capacity experiment: final loss against S for each model (the paper: linear attention fails once S > d_dot,
  the delta rule keeps working).
- ``retrieval_replace`` (setting 2): ``num_pairs`` (40) pairs whose keys are drawn with replacement from
  ``num_keys`` (20) keys; the query is a key that occurs; predict its latest value.
- ``code`` (Irie et al. 2021 appendix B.1): programs over 3 or 5 variables of assignments ``x = 3 ;``,
  increments ``x ++ ;`` / ``x -- ;``, conditionals ``if x > 3 : x -- ;`` and ``print x ;`` statements; predict
  every printed value (in -8..16, one token each), which the input never shows.
- ``listops`` (Irie et al. 2021 sec. 4.3, appendix B.3): a prefix ListOps expression of nesting depth exactly ``depth``
  (10) over MIN, MAX, MED (lower median) and SM (sum modulo 10) on digits; predict its value.

    python -m training.synthetic --task retrieval --model_type delta_net linear_transformer llama \\
        --num_pairs 20 40 80 --d_key 16 --max_steps 2000 --output_dir outputs/synthetic

Schlag et al. 2021's own setup of the retrieval experiment (one fast-weight memory between a key/value encoder and
the value read-out, no LM around it: ``training/associative_retrieval.py``) runs through this CLI too, with
``--task capacity`` (setting 1) or ``--task update_rules`` (setting 2); the other arguments are that module's::

    python -m training.synthetic --task capacity --memory linear dpfp1 softmax --num_keys 8 16 32 --d_key 16

(``OMP_NUM_THREADS=1`` is much faster for these tiny models on a busy CPU.)

Writes ``<output_dir>/<task>.json`` (final train loss and held-out answer accuracy per model and setting),
``<output_dir>/<task>.md`` (the accuracy table, token and sequence level) and, when matplotlib is installed,
``<output_dir>/<task>.png`` (retrieval: final loss against the swept setting, one line per model; code and ListOps:
training curves). Long runs can save Trainer checkpoints (``--save_strategy steps --save_steps N``, the latest one kept,
under ``<output_dir>/trainer/<model>_<setting>/``); the same command with ``--resume_from_checkpoint latest``
continues each run from its latest checkpoint, with the same data and the same result as an uninterrupted run. The
training examples are written to ``<output_dir>/data/`` (Arrow files, memory-mapped; reused by the other models of the
command and by ``--resume``).
The JSON starts with the run's record (command, versions, machine, git commit, load average before and after:
``training.result_file``); ``--results_file docs/results/<name>.json`` writes the same JSON there too, to be committed
as the source of the figures quoted in docs/RESULTS.md (``outputs/`` is not kept).

Options: the task and its sweep, the models' size, and every ``TrainingArguments`` option (``--learning_rate``,
``--max_steps``, ``--per_device_train_batch_size``, ``--bf16``, ...); ``--help`` lists them with their defaults.
"""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import copy  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple  # noqa: E402

import datasets  # noqa: E402
import pyarrow.compute as pc  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from datasets.arrow_writer import ArrowWriter  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments, set_seed  # noqa: E402

import modeling_fwp  # noqa: E402,F401  (registers the Auto classes)
from modeling_fwp.families import FAMILIES  # noqa: E402

from . import associative_retrieval, latest_checkpoint, plots  # noqa: E402
from .arguments import ParsedArguments, parse_arguments, parse_overrides, require_positive  # noqa: E402
from .result_file import RunRecord  # noqa: E402
from .trainer_utils import KeepFreedCpuMemory  # noqa: E402

logger = logging.getLogger("training.synthetic")

IGNORE_INDEX = -100


# --------------------------------------------------------------------------------------------------
# Vocabulary
# --------------------------------------------------------------------------------------------------


@dataclass
class Vocabulary:
    """Symbol <-> id table of a task. Id 0 is padding."""

    symbols: List[str]

    def __post_init__(self) -> None:
        self.index = {s: i for i, s in enumerate(self.symbols)}
        if len(self.index) != len(self.symbols):
            raise ValueError("Vocabulary: symbols must be unique")

    def encode(self, tokens: List[str]) -> List[int]:
        return [self.index[t] for t in tokens]

    def decode(self, ids: List[int]) -> List[str]:
        return [self.symbols[i] for i in ids]

    def __len__(self) -> int:
        return len(self.symbols)


# --------------------------------------------------------------------------------------------------
# Task generators: each yields (tokens, answers), answers a list of (p, symbol): the model predicts `symbol` from
# tokens[:p] (the label at position p). In the retrieval and ListOps tasks the symbol is tokens[p] itself; in code
# execution it is not part of the input (the program never shows what it prints).
# --------------------------------------------------------------------------------------------------


def key_symbol(i: int) -> str:
    return f"k{i}"


def value_symbol(i: int) -> str:
    return f"v{i}"


def pair_symbol(key: int, value: int) -> str:
    return f"k{key}:v{value}"


def retrieval_example(rng: np.random.Generator, num_pairs: int, num_keys: int, num_values: int,
                      replace: bool) -> Tuple[List[str], List[Tuple[int, str]]]:
    """``k3:v7 k1:v2 ... ? k3 -> v7``: S key-value pairs, one token each (key and value are given at the same step,
    as in Schlag et al. 2021 sec. 6.1, where the layer receives the key and value vectors directly), then ``?`` and
    the query key; the answer is its value. Setting 1: keys without replacement; setting 2 (`replace`): with
    replacement, the answer is the latest value of the queried key."""
    if not replace and num_pairs > num_keys:
        raise ValueError(f"`num_pairs` ({num_pairs}) must be <= `num_keys` ({num_keys}) without replacement")
    keys = rng.choice(num_keys, size=num_pairs, replace=replace)
    values = rng.integers(0, num_values, size=num_pairs)
    query = int(keys[rng.integers(0, num_pairs)])
    latest = {int(k): int(v) for k, v in zip(keys, values)}
    tokens = [pair_symbol(int(k), int(v)) for k, v in zip(keys, values)]
    tokens += ["?", key_symbol(query), value_symbol(latest[query])]
    return tokens, [(len(tokens) - 1, tokens[-1])]


CODE_MIN_VALUE, CODE_MAX_VALUE = -8, 16  # variables stay in this range (Irie et al. 2021, appendix B.1)


def code_example(rng: np.random.Generator, num_variables: int,
                 num_statements: int) -> Tuple[List[str], List[Tuple[int, str]]]:
    """A program of `num_statements` statements over `num_variables` variables, the code execution task
    of Irie et al. 2021 (appendix B.1, after Fan et al. 2020). Statements, drawn uniformly:

        x = 7 ;           assignment of a constant in 0..9 (the first statement is one)
        x ++ ;  x -- ;    increment / decrement of an assigned variable (flipped when it would leave [-8, 16])
        print x ;         of an assigned variable: the model must output its value (the last statement is one)
        if x > 3 : S      (or ``<``) S one of the statements above, run only when the condition holds

    The printed values are the answers, predicted right after each ``print x ;``; they are never part of the input
    (the label at that position is the value, the input is the next statement's first token, or ``<eos>`` at the end).
    """
    names = [chr(ord("a") + i) for i in range(num_variables)]
    env: Dict[str, int] = {}
    tokens: List[str] = []
    printed: List[Tuple[int, str]] = []  # (index of the print's ";", value)

    def simple(kind: int, run: bool) -> None:
        if kind == 0 or not env:  # assignment (the only statement possible before any variable exists)
            name, value = names[int(rng.integers(num_variables))], int(rng.integers(10))
            tokens.extend([name, "=", str(value), ";"])
            if run:
                env[name] = value
        elif kind == 1:  # increment / decrement, kept inside the value range
            name = sorted(env)[int(rng.integers(len(env)))]
            step = 1 if rng.integers(2) else -1
            if not CODE_MIN_VALUE <= env[name] + step <= CODE_MAX_VALUE:
                step = -step
            tokens.extend([name, "++" if step > 0 else "--", ";"])
            if run:
                env[name] += step
        else:  # print
            name = sorted(env)[int(rng.integers(len(env)))]
            tokens.extend(["print", name, ";"])
            if run:
                printed.append((len(tokens) - 1, str(env[name])))

    for step in range(num_statements):
        kind = 0 if step == 0 else 2 if step == num_statements - 1 else int(rng.integers(4))
        if kind == 3:  # conditional: a comparison of an assigned variable, then one simple statement
            name, op, bound = (sorted(env)[int(rng.integers(len(env)))], "<>"[int(rng.integers(2))],
                               int(rng.integers(10)))
            tokens.extend(["if", name, op, str(bound), ":"])
            holds = env[name] < bound if op == "<" else env[name] > bound
            simple(int(rng.integers(3)), run=holds)
        else:
            simple(kind, run=True)
    tokens.append("<eos>")
    return tokens, [(at + 1, value) for at, value in printed]


LISTOPS_OPERATORS = ("MIN", "MAX", "MED", "SM")


def listops_value(op: str, args: List[int]) -> int:
    if op == "MIN":
        return min(args)
    if op == "MAX":
        return max(args)
    if op == "MED":
        return sorted(args)[(len(args) - 1) // 2]
    if op == "SM":
        return sum(args) % 10
    raise ValueError(f"unknown ListOps operator {op!r}")


def listops_example(rng: np.random.Generator, depth: int, max_args: int) -> Tuple[List[str], List[Tuple[int, str]]]:
    """``[ OP a b [ OP c d ] ... ] = value``: a random prefix expression whose nesting depth is exactly `depth`."""

    def build(level: int) -> Tuple[List[str], int]:
        op = LISTOPS_OPERATORS[int(rng.integers(len(LISTOPS_OPERATORS)))]
        n = int(rng.integers(2, max_args + 1))
        nested = int(rng.integers(n)) if level < depth else -1  # one argument goes one level deeper
        tokens, values = ["[", op], []
        for i in range(n):
            if i == nested or (level < depth and rng.random() < 0.15):
                sub, value = build(level + 1)
            else:
                value = int(rng.integers(10))
                sub = [str(value)]
            tokens += sub
            values.append(value)
        return tokens + ["]"], listops_value(op, values)

    tokens, value = build(1)
    tokens += ["=", str(value)]
    return tokens, [(len(tokens) - 1, tokens[-1])]


# --------------------------------------------------------------------------------------------------
# Tasks
# --------------------------------------------------------------------------------------------------


@dataclass
class TaskSpec:
    """A task: its vocabulary, a generator of examples, and the swept setting (for the plot's x axis)."""

    name: str
    vocabulary: Vocabulary
    make: Callable[[np.random.Generator], Tuple[List[str], List[Tuple[int, str]]]]
    setting: Dict[str, Any] = field(default_factory=dict)

    @property
    def setting_label(self) -> str:
        """The setting in file names: ``num_variables3_num_statements30``."""
        return "_".join(f"{key}{value}" for key, value in self.setting.items())


def build_task(task: str, **options: Any) -> TaskSpec:
    """The `task` with its options (see ``parse_args`` for defaults). Unknown options raise ``ValueError``."""
    specials = ["<pad>", "?", "=", ";", "+", "-", "print", "[", "]"]
    if task in ("retrieval", "retrieval_replace"):
        replace = task == "retrieval_replace"
        num_pairs = options.pop("num_pairs", 40 if replace else 20)
        num_keys = options.pop("num_keys", 20 if replace else max(num_pairs, 26))
        num_values = options.pop("num_values", 10)
        if not replace and num_pairs > num_keys:
            raise ValueError(f"`num_pairs` ({num_pairs}) must be <= `num_keys` ({num_keys}): setting 1 draws the keys "
                             "without replacement")
        vocab = Vocabulary(specials + [key_symbol(i) for i in range(num_keys)]
                           + [value_symbol(i) for i in range(num_values)]
                           + [pair_symbol(k, v) for k in range(num_keys) for v in range(num_values)])
        make = lambda rng: retrieval_example(rng, num_pairs, num_keys, num_values, replace)  # noqa: E731
        setting = {"num_pairs": num_pairs, "num_keys": num_keys, "num_values": num_values}
    elif task == "code":
        num_variables = options.pop("num_variables", 3)
        num_statements = options.pop("num_statements", 30)
        if not 1 <= num_variables <= 26:
            raise ValueError(f"`num_variables` must be in 1..26, got {num_variables}")
        if num_statements < 2:
            raise ValueError(f"`num_statements` must be >= 2 (an assignment first, a print last), got {num_statements}")
        names = [chr(ord("a") + i) for i in range(num_variables)]
        values = [str(v) for v in range(CODE_MIN_VALUE, CODE_MAX_VALUE + 1)]
        vocab = Vocabulary(specials + ["if", "<", ">", ":", "++", "--", "<eos>"] + names + values)
        make = lambda rng: code_example(rng, num_variables, num_statements)  # noqa: E731
        setting = {"num_variables": num_variables, "num_statements": num_statements}
    elif task == "listops":
        depth = options.pop("depth", 10)
        max_args = options.pop("max_args", 3)
        vocab = Vocabulary(specials + list(LISTOPS_OPERATORS) + [str(i) for i in range(10)])
        make = lambda rng: listops_example(rng, depth, max_args)  # noqa: E731
        setting = {"depth": depth, "max_args": max_args}
    else:
        raise ValueError(f"`task` must be one of {TASKS}, got {task!r}")
    if options:
        raise ValueError(f"options {sorted(options)} do not apply to task {task!r}")
    return TaskSpec(task, vocab, make, setting)


TASKS = ("retrieval", "retrieval_replace", "code", "listops")


def generate_examples(spec: TaskSpec, num_examples: int, seed: int) -> Iterator[Dict[str, List[int]]]:
    """`num_examples` examples from a numpy RNG seeded with `seed`: ``input_ids`` and ``labels`` (the answer ids at
    the answer positions, -100 elsewhere), unpadded."""
    rng = np.random.default_rng(seed)
    for _ in range(num_examples):
        tokens, answers = spec.make(rng)
        ids = spec.vocabulary.encode(tokens)
        labels = [IGNORE_INDEX] * len(ids)
        for p, symbol in answers:
            labels[p] = spec.vocabulary.index[symbol]
        yield {"input_ids": ids, "labels": labels}


EXAMPLE_FEATURES = datasets.Features(
    {"input_ids": datasets.Sequence(datasets.Value("int32")), "labels": datasets.Sequence(datasets.Value("int32"))}
)


def make_dataset(
    spec: TaskSpec, num_examples: int, seed: int, cache_dir: Optional[os.PathLike] = None
) -> datasets.Dataset:
    """A ``datasets.Dataset`` of `num_examples` examples of the task (deterministic in `seed`).

    Without `cache_dir` the examples are held in memory. With it they are written in batches to an Arrow file in
    `cache_dir` (named by the task, its setting, the seed and the count) and memory-mapped, so a training set of
    millions of programs costs disk instead of memory. A later call reuses a file with the right number of rows whose
    first row is this generator's first example (a changed generator regenerates it)."""
    if cache_dir is None:
        rows = list(generate_examples(spec, num_examples, seed))
        columns = {key: [r[key] for r in rows] for key in EXAMPLE_FEATURES}
        return datasets.Dataset.from_dict(columns, features=EXAMPLE_FEATURES)
    path = Path(cache_dir) / f"{spec.name}_{spec.setting_label}_seed{seed}_n{num_examples}.arrow"
    if path.exists():
        cached = datasets.Dataset.from_file(str(path))
        first = next(generate_examples(spec, 1, seed), None)
        if len(cached) == num_examples and (num_examples == 0 or cached[0] == first):
            return cached
        logger.info("%s does not hold this generator's examples: regenerating it", path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + f".{os.getpid()}.partial")
    with ArrowWriter(path=str(partial), features=EXAMPLE_FEATURES, writer_batch_size=10_000) as writer:
        for example in generate_examples(spec, num_examples, seed):
            writer.write(example)
        writer.finalize()
    os.replace(partial, path)  # atomic: a concurrent or interrupted run never reads a half-written file
    return datasets.Dataset.from_file(str(path))


def pad_collator(batch: List[Dict[str, Any]]) -> Dict[str, torch.Tensor]:
    """Right-pads ``input_ids`` with 0 and ``labels`` with -100. The models are causal, so padding after the answer
    cannot change it; no attention mask is passed (recurrent models would otherwise need one)."""
    length = max(len(b["input_ids"]) for b in batch)
    ids = torch.zeros(len(batch), length, dtype=torch.long)
    labels = torch.full((len(batch), length), IGNORE_INDEX, dtype=torch.long)
    for i, b in enumerate(batch):
        n = len(b["input_ids"])
        ids[i, :n] = torch.as_tensor(b["input_ids"])
        labels[i, :n] = torch.as_tensor(b["labels"])
    return {"input_ids": ids, "labels": labels}


# --------------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------------

# Short name -> model type: every family of modeling_fwp.families with a fast-weight layer, and the baseline.
MODEL_TYPES = {spec.name: spec.model_type for spec in FAMILIES if spec.fast_weight_layer is not None}
MODEL_TYPES["llama"] = "llama"


def build_model(name: str, vocab_size: int, hidden_size: int, num_layers: int, num_heads: int,
                max_length: int, overrides: Optional[Dict[str, Any]] = None) -> torch.nn.Module:
    """A causal LM of the given size: one of ours (by short name, ``MODEL_TYPES``) or the softmax-attention baseline
    ``llama`` (LlamaForCausalLM with the same hidden size, layers, heads and feed-forward size)."""
    if name not in MODEL_TYPES:
        raise ValueError(f"`model` must be one of {sorted(MODEL_TYPES)}, got {name!r}")
    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
                  num_attention_heads=num_heads, intermediate_size=4 * hidden_size, tie_word_embeddings=True,
                  pad_token_id=0)
    if name == "llama":
        extra = dict(num_key_value_heads=num_heads, max_position_embeddings=max(max_length, 64))
        # The fast-weight models take `feature_map` etc.; the baseline only the size fields.
        extra.update({k: v for k, v in (overrides or {}).items() if k in ("head_dim", "rope_theta")})
    else:
        extra = dict(overrides or {})
    config = AutoConfig.for_model(MODEL_TYPES[name], **common, **extra)
    return AutoModelForCausalLM.from_config(config)


# --------------------------------------------------------------------------------------------------
# Training and evaluation
# --------------------------------------------------------------------------------------------------


@torch.no_grad()
def answer_metrics(model: torch.nn.Module, dataset: datasets.Dataset, batch_size: int = 64) -> Dict[str, float]:
    """Mean cross entropy and accuracy over the answer tokens of `dataset` (token level), and the fraction of
    examples whose answers are all right (sequence level; the same as token level for one answer per example)."""
    model.eval()
    total_loss, correct, count, sequences_correct = 0.0, 0, 0, 0
    for start in range(0, len(dataset), batch_size):
        batch = pad_collator([dataset[i] for i in range(start, min(start + batch_size, len(dataset)))])
        logits = model(input_ids=batch["input_ids"]).logits[:, :-1].float()
        labels = batch["labels"][:, 1:]
        mask = labels != IGNORE_INDEX
        right = (logits.argmax(-1) == labels) & mask
        total_loss += torch.nn.functional.cross_entropy(logits[mask], labels[mask], reduction="sum").item()
        correct += int(right.sum())
        count += int(mask.sum())
        sequences_correct += int((right.sum(-1) == mask.sum(-1)).sum())
    return {"loss": total_loss / max(count, 1), "accuracy": correct / max(count, 1), "answers": count,
            "sequence_accuracy": sequences_correct / max(len(dataset), 1)}


def shortcut_accuracy(spec: TaskSpec, dataset: datasets.Dataset) -> Optional[float]:
    """Token-level accuracy of a trivial rule on `dataset`, the level a model must pass to show it does the task:

    - code: the printed variable's last assignment in the text (``x = 7``), ignoring ``++``/``--`` and ``if``;
    - listops: the most frequent answer in `dataset` (majority class).

    None for the retrieval tasks (chance is their reference)."""
    if spec.name not in ("code", "listops"):
        return None
    answers = []  # (the example's tokens, position of an answer label, the answer)
    for ex in dataset:
        tokens = spec.vocabulary.decode(list(ex["input_ids"]))
        answers += [(tokens, i, spec.vocabulary.decode([int(label)])[0]) for i, label in enumerate(ex["labels"])
                    if label != IGNORE_INDEX]
    if not answers:
        return None
    if spec.name == "listops":
        values = [value for _, _, value in answers]
        return max(values.count(v) for v in set(values)) / len(values)
    right = 0
    for tokens, at, value in answers:  # tokens[at - 3 : at] is "print x ;"
        name = tokens[at - 2]
        assigned = [tokens[i + 2] for i in range(at - 3) if tokens[i] == name and tokens[i + 1] == "="]
        right += bool(assigned) and assigned[-1] == value
    return right / len(answers)


def train_one(
    spec: TaskSpec, model_name: str, args: ParsedArguments, output_dir: Path, data_dir: Optional[Path] = None
) -> Dict[str, Any]:
    """Trains `model_name` on `spec` for ``args.max_steps`` steps on fresh data and returns its metrics.

    The ``args.max_steps * args.per_device_train_batch_size`` training examples are kept on disk in `data_dir` (see
    :func:`make_dataset`), or in memory when it is None.

    Checkpoints (``--save_strategy steps``) go to `output_dir`; with ``--resume_from_checkpoint latest`` the run
    continues from the latest one there. ``seconds`` is this process's training time."""
    set_seed(args.seed)
    train = make_dataset(spec, args.max_steps * args.per_device_train_batch_size, seed=args.seed, cache_dir=data_dir)
    test = make_dataset(spec, args.eval_examples, seed=args.seed + 1)
    max_length = pc.max(pc.list_value_length(train.data.column("input_ids"))).as_py()
    model = build_model(model_name, len(spec.vocabulary), args.hidden_size, args.num_hidden_layers,
                        args.num_attention_heads, max_length, parse_overrides(args.config_overrides))
    model.config.use_cache = False
    training_args = copy.copy(args.training)
    training_args.output_dir = str(output_dir)
    if training_args.warmup_steps >= 1:  # at most a tenth of the run
        training_args.warmup_steps = min(training_args.warmup_steps, args.max_steps // 10)
    trainer = Trainer(model=model, args=training_args, train_dataset=train, data_collator=pad_collator,
                      callbacks=[KeepFreedCpuMemory()])
    resuming = args.resume_from_checkpoint == "latest"
    resume = latest_checkpoint(output_dir) if resuming else args.resume_from_checkpoint
    if resuming:
        logger.info("%s: %s", output_dir, f"resuming from {resume}" if resume else "no checkpoint, starting")
    start = time.perf_counter()
    trainer.train(resume_from_checkpoint=resume)
    seconds = time.perf_counter() - start
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    final_train = float(np.mean(losses[-3:])) if losses else float("nan")
    metrics = answer_metrics(model, test)
    return {
        "model": model_name, "task": spec.name, **spec.setting,
        "parameters": sum(p.numel() for p in {id(p): p for p in model.parameters()}.values()),
        "steps": args.max_steps, "seed": args.seed, "final_train_loss": final_train, "test_loss": metrics["loss"],
        "test_accuracy": metrics["accuracy"], "test_sequence_accuracy": metrics["sequence_accuracy"],
        "test_answers": metrics["answers"], "shortcut_accuracy": shortcut_accuracy(spec, test), "seconds": seconds,
        "resumed_from": resume,
        "loss_curve": [{"step": h["step"], "loss": h["loss"]} for h in trainer.state.log_history if "loss" in h],
    }


def accuracy_table(rows: List[Dict[str, Any]], x_key: str) -> str:
    """The runs as a markdown table: setting, model, held-out token- and sequence-level accuracy, loss, cost."""
    lines = [f"| {x_key} | model | token accuracy | shortcut rule | sequence accuracy | test loss | steps | seconds |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        shortcut = r.get("shortcut_accuracy")
        lines.append(f"| {r[x_key]} | {r['model']} | {r['test_accuracy']:.3f} | "
                     f"{'-' if shortcut is None else format(shortcut, '.3f')} | {r['test_sequence_accuracy']:.3f} | "
                     f"{r['test_loss']:.3f} | {r['steps']} | {r['seconds']:.0f} |")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------

SWEEPS = {"retrieval": "num_pairs", "retrieval_replace": "num_pairs", "code": "num_variables", "listops": "depth"}


@dataclass
class SyntheticArguments:
    """The task, its sweep (several values: one run per value) and the models trained on it."""

    task: str = field(metadata={"help": "also capacity / update_rules: see training/associative_retrieval.py",
                                "choices": TASKS})
    model_type: List[str] = field(default_factory=lambda: ["linear_transformer", "delta_net"], metadata={
        "help": "the models, each trained in turn", "choices": sorted(MODEL_TYPES)})
    hidden_size: int = field(default=64, metadata={"help": "model width"})
    num_hidden_layers: int = field(default=2, metadata={"help": "layers"})
    num_attention_heads: int = field(default=1, metadata={"help": "heads"})
    d_key: Optional[int] = field(default=None, metadata={
        "help": "per-head key size (head_dim) of the fast-weight models: sets heads = hidden_size // d_key"})
    config_overrides: Optional[str] = field(default=None, metadata={
        "help": "extra config fields for our models (JSON or k=v,...)"})
    eval_examples: int = field(default=500, metadata={"help": "held-out examples scored"})
    results_file: Optional[str] = field(default=None, metadata={
        "help": "also write the result JSON here (e.g. docs/results/code_s30_delta_net.json, to commit)"})
    num_pairs: Optional[List[int]] = field(default=None, metadata={"help": "retrieval: S (pairs per sequence)"})
    num_keys: Optional[int] = field(default=None, metadata={"help": "retrieval: key vocabulary size"})
    num_values: Optional[int] = field(default=None, metadata={"help": "retrieval: value vocabulary size"})
    num_variables: Optional[List[int]] = field(default=None, metadata={"help": "code: 3 or 5 in the paper"})
    num_statements: Optional[int] = field(default=None, metadata={"help": "code: statements per program"})
    depth: Optional[List[int]] = field(default=None, metadata={"help": "listops: nesting depth (10 in the paper)"})
    max_args: Optional[int] = field(default=None, metadata={
        "help": "listops: at most this many arguments per operator (3)"})


# This script's choices for Trainer options (shown by --help, overridden like any option): a constant rate after a
# warm-up of at most a tenth of the run, a log line every twentieth of it, no checkpoints unless asked for.
TRAINING_DEFAULTS = dict(
    output_dir="outputs/synthetic", max_steps=1000, per_device_train_batch_size=32, learning_rate=1e-3,
    lr_scheduler_type="constant_with_warmup", warmup_steps=100, max_grad_norm=1.0, logging_steps=0.05, seed=0,
    save_strategy="no", save_total_limit=1, use_cpu=not torch.cuda.is_available(), remove_unused_columns=False,
    disable_tqdm=True,
)


def parse_args(argv: Optional[List[str]] = None) -> ParsedArguments:
    """The command line (``--help``: every option with its default); ValueError names a bad option."""
    args = parse_arguments((SyntheticArguments, TrainingArguments), argv, description=__doc__,
                           defaults=TRAINING_DEFAULTS)
    require_positive(args, ("max_steps", "per_device_train_batch_size", "hidden_size", "num_hidden_layers",
                            "num_attention_heads", "eval_examples", "d_key"))
    if args.d_key is not None:
        if args.hidden_size % args.d_key:
            raise ValueError(f"--d_key must divide --hidden_size ({args.hidden_size}), got {args.d_key}")
        args.num_attention_heads = args.hidden_size // args.d_key
    parse_overrides(args.config_overrides)  # a malformed value fails before any work
    return args


# options held fixed over a sweep, and the tasks they apply to
FIXED_OPTIONS = {"num_keys": ("retrieval", "retrieval_replace"), "num_values": ("retrieval", "retrieval_replace"),
                 "num_statements": ("code",), "max_args": ("listops",)}


def task_settings(args: ParsedArguments) -> List[Dict[str, Any]]:
    """One options dict per run of the sweep (the swept option's values; the others fixed)."""
    fixed = {}
    for name, tasks in FIXED_OPTIONS.items():
        if getattr(args, name) is not None:
            if args.task not in tasks:
                raise ValueError(f"--{name} does not apply to --task {args.task}")
            fixed[name] = getattr(args, name)
    sweep = SWEEPS[args.task]
    values = getattr(args, sweep)
    for other in set(SWEEPS.values()) - {sweep}:
        if getattr(args, other) is not None:
            raise ValueError(f"--{other} does not apply to --task {args.task}")
    return [dict(fixed)] if values is None else [{**fixed, sweep: v} for v in values]


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--task" in argv and argv.index("--task") + 1 < len(argv):
        at = argv.index("--task")
        if argv[at + 1] in associative_retrieval.SETTINGS:  # the paper's memory-only retrieval experiment
            return associative_retrieval.main([argv[at + 1]] + argv[:at] + argv[at + 2:])
    args = parse_args(argv)
    record = RunRecord.start("python -m training.synthetic", argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    transformers.utils.logging.disable_progress_bar()
    datasets.disable_progress_bars()
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for options in task_settings(args):
        spec = build_task(args.task, **options)
        for model_name in args.model_type:
            run_name = f"{model_name}_{spec.setting_label}"
            row = train_one(spec, model_name, args, out / "trainer" / run_name, data_dir=out / "data")
            logger.info("%s %s %s: final train loss %.3f, test loss %.3f, accuracy %.3f (sequences %.3f) (%.0f s)",
                        args.task, spec.setting, model_name, row["final_train_loss"], row["test_loss"],
                        row["test_accuracy"], row["test_sequence_accuracy"], row["seconds"])
            rows.append(row)
    results = {"task": args.task, "args": args.record(), "results": rows}
    record.write(out / f"{args.task}.json", results, copies=[args.results_file] if args.results_file else [])
    (out / f"{args.task}.md").write_text(accuracy_table(rows, SWEEPS[args.task]), encoding="utf-8")
    if args.task in ("retrieval", "retrieval_replace"):  # the capacity-style sweep
        plot = plots.plot_final_loss(rows, SWEEPS[args.task], out / f"{args.task}.png")
    else:
        plot = plots.plot_training_loss(rows, SWEEPS[args.task], out / f"{args.task}.png", title=f"{args.task}")
    results["plot"] = str(plot) if plot else None
    return results


if __name__ == "__main__":
    main()
