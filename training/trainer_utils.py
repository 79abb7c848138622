"""Trainer pieces the scripts share: parameter groups, a wall-clock budget with its cosine schedule, carried state.

- :func:`build_optimizer`: Trainer's optimizer (``--optim``, ``--adam_beta1/2``, ``--adam_epsilon``) over
  :func:`parameter_groups`: weight decay on matrices only, and a learning rate per group of parameters (an FWL head
  trained faster than the pretrained model it sits on).
- :class:`WallClockBudget` and :func:`budget_schedule`: training for a number of minutes rather than steps; the
  schedule is transformers' ``cosine_with_min_lr`` whose end moves with the estimate of the steps that fit. With a
  fixed ``--max_steps`` Trainer's own ``--lr_scheduler_type`` runs instead and the budget only stops.
- :class:`InOrderTrainer`: the train set read in order (parallel streams), each segment from an empty state.
- :class:`StateCarryingTrainer`: full-context training, the state carried from one segment to the next
  (truncated back-propagation through time).
- :class:`KeepFreedCpuMemory` and :func:`keep_freed_cpu_memory`: glibc's malloc told to keep the memory a training
  step frees, so that the next step does not fault it in again page by page (CPU training).
"""
from __future__ import annotations

import ctypes
import math
import os
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import datasets
import torch
from torch.utils.data import SequentialSampler
from transformers import Trainer, TrainerCallback, TrainingArguments

from modeling_fwp.cache_fwp import output_cache

from .dynamic_eval import detach_cache

# "as many steps as the budget allows": the step limit Trainer is given when the wall-clock budget decides
BUDGET_MAX_STEPS = 1_000_000_000

LearningRates = Sequence[Tuple[Callable[[str], bool], float]]


# --------------------------------------------------------------------------------------------------
# The process's allocator on CPU
# --------------------------------------------------------------------------------------------------

# glibc's mallopt parameters, the environment variable that sets each one at start-up, and the value given: freed blocks
# up to 2 GB come from the heap (M_MMAP_THRESHOLD: an mmap'd block is unmapped when freed), the heap's free top is
# given back only beyond 2 GB (M_TRIM_THRESHOLD), and the heap grows 1 GB of address space at a time (M_TOP_PAD;
# pages are only faulted in where written). mallopt takes an int: 2**31 - 1 is its largest value.
KEEP_FREED_MALLOPT = ((-1, "MALLOC_TRIM_THRESHOLD_", 2**31 - 1), (-2, "MALLOC_TOP_PAD_", 1 << 30),
                      (-3, "MALLOC_MMAP_THRESHOLD_", 2**31 - 1))
_kept_freed = False


def keep_freed_cpu_memory() -> bool:
    """Tells glibc's malloc to keep the memory the process frees (``mallopt``, KEEP_FREED_MALLOPT), once per process.

    A CPU training step frees and allocates the same large activations every step; as glibc ships, each freed block
    above its mmap threshold goes back to the system, and the next step's tensor of that size is faulted in again page
    by page (``benchmarks/bench_cpu_allocator.py``: 440k-530k page faults, about 2 GB, per step of bench_training's
    Delta Net; with these settings the step was 1.24x / 1.18x faster at 1 / 2 threads and the process's peak resident
    memory 1.29x / 1.22x larger: freed blocks stay with the process, and not every one fits the next request of its
    size). Nothing is changed, and False returned, where FWP_KEEP_FREED_MEMORY=0, where the process has chosen already
    (any of the MALLOC_*_ variables or GLIBC_TUNABLES set, or an allocator preloaded: LD_PRELOAD naming a malloc) or
    where the C library is not glibc; True once the settings are in force."""
    global _kept_freed
    if _kept_freed:
        return True
    chosen = [name for _, name, _ in KEEP_FREED_MALLOPT if name in os.environ]
    preloaded = "malloc" in os.environ.get("LD_PRELOAD", "")
    if os.environ.get("FWP_KEEP_FREED_MEMORY") == "0" or chosen or "GLIBC_TUNABLES" in os.environ or preloaded:
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # glibc's own symbol: another C library has a mallopt of other parameters
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    _kept_freed = all(mallopt(param, value) == 1 for param, _, value in KEEP_FREED_MALLOPT)
    return _kept_freed


class KeepFreedCpuMemory(TrainerCallback):
    """At the start of training on CPU, :func:`keep_freed_cpu_memory` (the scripts' Trainers all carry it; on other
    devices it does nothing). ``kept`` says whether the settings are in force."""

    def __init__(self) -> None:
        self.kept = False

    def on_train_begin(self, args, state, control, **kwargs):
        if args.device.type == "cpu":
            self.kept = keep_freed_cpu_memory()


# --------------------------------------------------------------------------------------------------
# Optimizer
# --------------------------------------------------------------------------------------------------


def parameter_groups(
    model: torch.nn.Module, learning_rate: float, weight_decay: float, learning_rates: LearningRates = ()
) -> List[Dict[str, Any]]:
    """The optimizer's parameter groups of `model`'s trainable parameters.

    Weight decay applies to matrices only (``dim >= 2``): not to biases, normalisation gains or scalars such as the
    FWL's step sizes. A parameter's learning rate is that of the first ``(matches, lr)`` of `learning_rates` whose
    ``matches(name)`` holds, else `learning_rate`. A tensor shared by two modules (tied embeddings) is listed once,
    under the name ``named_parameters`` gives it first.
    """
    groups: Dict[Tuple[float, float], List[torch.nn.Parameter]] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        lr = next((rate for matches, rate in learning_rates if matches(name)), learning_rate)
        groups.setdefault((lr, weight_decay if param.dim() >= 2 else 0.0), []).append(param)
    return [{"params": params, "lr": lr, "weight_decay": decay} for (lr, decay), params in groups.items()]


def build_optimizer(
    model: torch.nn.Module, args: TrainingArguments, learning_rates: LearningRates = ()
) -> torch.optim.Optimizer:
    """Trainer's optimizer for `args` (``--optim`` and its options) over :func:`parameter_groups` with
    ``args.learning_rate`` and ``args.weight_decay``."""
    optimizer_cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
    groups = parameter_groups(model, args.learning_rate, args.weight_decay, learning_rates)
    return optimizer_cls(groups, **kwargs)


# --------------------------------------------------------------------------------------------------
# Wall-clock budget
# --------------------------------------------------------------------------------------------------


class WallClockBudget(TrainerCallback):
    """Stops training at `budget_s` seconds and keeps `total_steps` an estimate of the steps that fit.

    The estimate uses the mean step time from step 1 on (step 0 carries one-time warm-up costs).
    With `fixed_steps`, `total_steps` is that number and only the deadline can stop earlier.
    """

    def __init__(self, budget_s: float, fixed_steps: Optional[int] = None) -> None:
        if budget_s <= 0:
            raise ValueError(f"`budget_s` must be positive, got {budget_s}")
        self.budget_s = budget_s
        self.fixed_steps = fixed_steps
        self.total_steps = fixed_steps or BUDGET_MAX_STEPS
        self.start = self.first_step_end = None
        self.elapsed = 0.0
        self.stopped_by_budget = False

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        now = time.perf_counter()
        self.elapsed = now - self.start
        step = state.global_step
        if step == 1:
            self.first_step_end = now
        elif step > 1 and self.fixed_steps is None:
            per_step = (now - self.first_step_end) / (step - 1)
            self.total_steps = step + max(0, int((self.budget_s - self.elapsed) / per_step))
        if self.elapsed >= self.budget_s or step >= self.total_steps:
            control.should_training_stop = True
            # a time-limited run always ends by its budget (total_steps is the estimate of the steps that fit, which
            # reaches the current step as the deadline comes); a fixed-step run only when the deadline comes first
            self.stopped_by_budget = self.fixed_steps is None or step < self.total_steps
        return control


def budget_schedule(
    optimizer: torch.optim.Optimizer, budget: WallClockBudget, args: TrainingArguments
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up over ``args.warmup_steps`` (a count, or a fraction of the estimated steps), then cosine decay
    to ``min_lr_rate`` (``--lr_scheduler_kwargs '{"min_lr_rate": 0.1}'``, default 0) times each group's rate at
    the budget's current ``total_steps``: transformers' ``cosine_with_min_lr`` with an end that moves."""
    kwargs = args.lr_scheduler_kwargs or {}
    min_lr_rate = float(kwargs.get("min_lr_rate", 0.0)) if isinstance(kwargs, dict) else 0.0

    def factor(step: int) -> float:
        total = max(budget.total_steps, 1)
        warmup = args.get_warmup_steps(total)
        if step < warmup:
            return step / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_lr_rate + (1.0 - min_lr_rate) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def budget_optimizers(
    model: torch.nn.Module, args: TrainingArguments, minutes: float, learning_rates: LearningRates = ()
) -> Tuple[Tuple[torch.optim.Optimizer, Optional[torch.optim.lr_scheduler.LambdaLR]], WallClockBudget]:
    """``(optimizer, scheduler)`` for ``Trainer(optimizers=...)`` and the :class:`WallClockBudget` callback of a run
    limited to `minutes`. ``args.max_steps > 0``: that many steps at most, Trainer's own ``--lr_scheduler_type``
    (the scheduler is None); otherwise as many steps as fit, with :func:`budget_schedule` (``args.max_steps`` is
    set to ``BUDGET_MAX_STEPS`` for Trainer)."""
    budget = WallClockBudget(minutes * 60.0, fixed_steps=args.max_steps if args.max_steps > 0 else None)
    optimizer = build_optimizer(model, args, learning_rates)
    if budget.fixed_steps is not None:
        return (optimizer, None), budget
    args.max_steps = BUDGET_MAX_STEPS
    return (optimizer, budget_schedule(optimizer, budget, args)), budget


# --------------------------------------------------------------------------------------------------
# Carried state
# --------------------------------------------------------------------------------------------------


def segment_dataset(
    ids: torch.Tensor, segment_length: int, num_streams: int = 1, *, next_token_labels: bool = False,
    start_segment: int = 0,
) -> datasets.Dataset:
    """Fixed-length segments (``input_ids``, ``labels``) of the token stream ``ids`` ``[N]``.

    ``num_streams == 1``: segments in stream order. ``num_streams == S``: the stream is cut into S equal parallel
    streams of ``n`` whole segments each (the remainder is dropped) and example ``i * S + s`` is segment ``i`` of
    stream ``s``; read in order with per-process batch size B and S = world_size * B, row b of process p's step i
    then always continues the row of step i - 1 (accelerate hands process p the batches p, p + W, p + 2W, ...).

    Args:
        next_token_labels: also a ``shift_labels`` column ``[L]``: the token after each input position, the next
            segment's first token included (the model then scores every position; plain ``labels`` lose the last).
        start_segment: the streams start at their segment ``start_segment % n`` and wrap around (a run that
            continues another one's data).
    """
    if num_streams < 1:
        raise ValueError(f"`num_streams` must be >= 1, got {num_streams}")
    inputs = ids[:-1] if next_token_labels else ids
    per_stream = inputs.numel() // num_streams // segment_length
    if per_stream == 0:
        raise ValueError(
            f"the train split ({ids.numel()} tokens) is too short for {num_streams} streams of --block_size "
            f"{segment_length}"
        )

    def segments(stream: torch.Tensor) -> torch.Tensor:  # [per_stream * S, L], segment-major
        streams = stream[: num_streams * per_stream * segment_length].view(num_streams, per_stream, segment_length)
        return streams.roll(-(start_segment % per_stream), dims=1).transpose(0, 1).reshape(-1, segment_length)

    columns = {"input_ids": segments(inputs).tolist()}
    columns["labels"] = columns["input_ids"]
    if next_token_labels:
        columns["shift_labels"] = segments(ids[1:]).tolist()
    return datasets.Dataset.from_dict(columns).with_format("torch")


class InOrderTrainer(Trainer):
    """``Trainer`` that reads the train set in order (no shuffling): with ``train_lm.segment_dataset``'s parallel
    streams, row ``b`` of a batch holds the segment after row ``b`` of the previous batch. Each segment still starts
    from an empty state (``train_lm --in_order``: the data order of full-context training without its carried state).
    """

    def _get_train_sampler(self, train_dataset=None) -> SequentialSampler:
        return SequentialSampler(train_dataset if train_dataset is not None else self.train_dataset)


class StateCarryingTrainer(InOrderTrainer):
    """``InOrderTrainer`` that also passes each step's final state (``cache``, detached) to the next step: row ``b``
    of a batch continues row ``b`` of the previous batch (``train_lm.segment_dataset`` with
    ``num_streams = world_size * batch_size``). The state is reset at the start of training and of every epoch.

    Args:
        forward_kwargs: passed to every training forward (e.g. ``{"logits_to_keep": 1}`` for a model whose loss
            does not need the logits, Transformer-XL's adaptive softmax).
    """

    def __init__(self, *args: Any, forward_kwargs: Optional[Dict[str, Any]] = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.carried_state = None
        self.forward_kwargs = dict(forward_kwargs or {})
        self.add_callback(_ResetStateCallback(self))

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if not model.training:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        outputs = model(**inputs, **self.forward_kwargs, cache=self.carried_state, use_cache=True,
                        num_items_in_batch=num_items_in_batch)
        # Stop gradients at the segment boundary; the graph of this step is already built.
        self.carried_state = detach_cache(output_cache(outputs))
        loss = outputs.loss
        if (self.args.average_tokens_across_devices and self.model_accepts_loss_kwargs
                and num_items_in_batch is not None):
            loss = loss * self.accelerator.num_processes  # as Trainer.compute_loss does
        return (loss, outputs) if return_outputs else loss


class _ResetStateCallback(TrainerCallback):
    """Starts every epoch (and a resumed run) from an empty state."""

    def __init__(self, trainer: StateCarryingTrainer) -> None:
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        self.trainer.carried_state = None

    def on_epoch_begin(self, args, state, control, **kwargs):
        self.trainer.carried_state = None
