"""FastWeightCache: a constant-size recurrent state in place of a growing KV cache.

Each layer keeps a dict of named state tensors (batch first), e.g. the fast weight matrix
``fast_weight [B, H, Dv, Dk]`` and the normaliser ``normalizer [B, H, 1, Dk]``; recurrent FWPs add their
own entries (second fast weight, previous output, cell state). The cache counts the tokens it has seen and
reorders / selects / repeats rows for beam search and batched generation. A fast weight update cannot be undone by
dropping positions, so a cache rolls back (``crop(-n)``, for assisted and prompt-lookup decoding) only while it
records (``activate_past_recording``, see :class:`RollbackMixin`).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Dict, FrozenSet, Iterable, Iterator, List, Mapping, NamedTuple, Optional, Tuple

import torch
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.modeling_outputs import CausalLMOutputWithPast


# transformers 5.24 renamed the cache argument of `forward` and the cache field of model outputs from `past_key_values`
# to `cache` (the old name stays accepted, with a deprecation warning, until 5.40). Our models take both names; this is
# the one the installed transformers uses, for outputs and for calling its models.
CACHE_ARGUMENT = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def resolve_cache_argument(cache: Optional[Cache], past_key_values: Optional[Cache]) -> Optional[Cache]:
    """The cache a caller passed as ``cache`` (transformers >= 5.24) or ``past_key_values`` (the older name)."""
    if past_key_values is None:
        return cache
    if cache is not None and cache is not past_key_values:
        raise ValueError("Pass the cache as `cache` or as `past_key_values` (its older name), not both")
    return past_key_values


def output_cache(outputs: Mapping) -> Optional[Cache]:
    """The cache of a model output, whichever name the installed transformers gives that field."""
    return outputs.get(CACHE_ARGUMENT)


class FastWeightCacheLayer(CacheLayerMixin):
    """One layer's recurrent state: a dict of batch-first tensors and a count of seen tokens.

    ``writable`` names the state tensors that nothing but this layer references, so that their producer may update
    them in place in its next call (the FWL's vocabulary-sized running sum, whose fresh allocation would cost more
    than its update). The producer declares them in ``set_states`` and reads them back with ``producer_states``;
    anything else that reads ``states`` may keep references, so reading it (or replacing it) empties the set. (A call
    interrupted by an exception may leave such a tensor partly updated: start a new cache then.)
    """

    supports_early_init = False
    # A constant-size state: a compiled decode step sees the same shapes at every token.
    is_compileable = True

    def __init__(self, **kwargs) -> None:
        super().__init__()
        self._states: Dict[str, torch.Tensor] = {}
        self.seen_tokens = 0
        self.writable: FrozenSet[str] = frozenset()

    @property
    def states(self) -> Dict[str, torch.Tensor]:
        """The state tensors by name (the reader may keep references: nothing writes them in place afterwards)."""
        self.writable = frozenset()
        return self._states

    @states.setter
    def states(self, states: Dict[str, torch.Tensor]) -> None:
        self._states = states
        self.writable = frozenset()

    def producer_states(self) -> Tuple[Dict[str, torch.Tensor], FrozenSet[str]]:
        """``(a copy of the state dict, the names of its tensors only this layer references)``, for the module that
        wrote them with ``set_states`` and keeps no reference between calls; ``writable`` is left as it is."""
        return dict(self._states), self.writable

    def __repr__(self) -> str:
        shapes = {name: tuple(t.shape) for name, t in self._states.items()}
        return f"{self.__class__.__name__}(seen_tokens={self.seen_tokens}, states={shapes})"

    # The key/value interface of attention caches does not apply to fast weights.
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        raise NotImplementedError("FastWeightCache holds recurrent states, not keys and values: use `set_state`")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, 0

    def set_states(self, states: Dict[str, torch.Tensor], num_new_tokens: int, writable: Iterable[str] = ()) -> None:
        """Replaces the state by the one after `num_new_tokens` more tokens; `writable`: the names of tensors only
        this layer references (see the class docstring)."""
        self._states = dict(states)
        self.seen_tokens += num_new_tokens
        self.writable = frozenset(name for name in writable if name in self._states)

    def get_seq_length(self) -> int:
        return self.seen_tokens

    def get_max_length(self) -> int:
        return -1

    def nbytes(self) -> int:
        """Bytes held by the state tensors."""
        return sum(t.numel() * t.element_size() for t in self._states.values())

    @property
    def batch_size(self) -> int:
        for tensor in self._states.values():
            return tensor.shape[0]
        return -1

    def _map(self, fn) -> None:
        self.states = {name: fn(t) for name, t in self._states.items()}

    def offload(self) -> None:
        self._map(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self) -> None:
        pass

    def reset(self) -> None:
        self.states = {}
        self.seen_tokens = 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map(lambda t: t[indices.to(t.device)])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map(lambda t: t.repeat_interleave(repeats, dim=0))

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError(
            "A FastWeightCacheLayer cannot be cropped by itself: its cache rolls back (RollbackMixin.crop)"
        )


class StateCheckpoint(NamedTuple):
    """What a recording cache keeps of one forward pass: the state before it and how to redo part of it."""

    states: List[Dict[str, torch.Tensor]]  # each layer's state dict (references: nothing writes them in place after)
    seen_tokens: List[int]
    attributes: Dict[str, Any]  # the cache's own per-row bookkeeping (``token_counts``...), also references
    num_tokens: int  # tokens the forward pass wrote
    replay: Callable[[int], None]  # replay(k): runs the forward's first k tokens again, writing this cache


class RollbackMixin:
    """Rollback of a recurrent cache (``crop(-n)``) for assisted and prompt-lookup decoding.

    ``generate``'s assisted mode verifies several draft tokens in one forward pass, then crops the cache back to the
    accepted ones. A recurrent state holds no positions to drop, and our kernels return only the state after the
    last token. Two designs would roll it back: states for every draft position (each kernel returning all its
    intermediate states, or the verification run token by token, which forfeits the one-pass verification that makes
    assisted decoding fast), or a snapshot and a replay. We take the second, generic over whatever tensors a layer
    holds: while recording, each forward pass that writes the cache first calls :meth:`checkpoint`, which keeps
    references to every layer's state dict (a snapshot for free: layers replace their tensors, and reading them
    empties a layer's ``writable``, so nothing writes them in place afterwards) and to the attributes named in
    ``_rollback_attributes``, with a ``replay`` function from the model.
    ``crop(-n)`` restores the checkpoint of the forward pass that holds the n-th last token and replays that pass's
    tokens before it (one batched forward over the accepted tokens, at most one per verification); ``crop(0)``
    (after each verification) drops the checkpoints. Reordering rows (beam search) drops them as well.
    """

    _rollback_attributes: Tuple[str, ...] = ()

    def _init_recording(self) -> None:
        self.record_past = False
        self.recurrent_states_to_keep: Optional[int] = None
        self._checkpoints: List[StateCheckpoint] = []
        self._replaying = False

    def activate_past_recording(self, recurrent_states_to_keep: Optional[int] = None) -> None:
        """Keeps a checkpoint per forward pass from now on, so that ``crop(-n)`` can roll back.

        ``recurrent_states_to_keep`` (transformers >= 5.25 passes the number of draft tokens) tells caches that keep a
        state per position how many to keep. A checkpoint and a replay roll back any number of tokens, so here it
        changes nothing; it is kept as ``self.recurrent_states_to_keep``.
        """
        if recurrent_states_to_keep is not None and (
                isinstance(recurrent_states_to_keep, bool) or not isinstance(recurrent_states_to_keep, int)
                or recurrent_states_to_keep < 0):
            raise ValueError(
                f"`recurrent_states_to_keep` must be a non-negative int or None, got {recurrent_states_to_keep!r}"
            )
        self.record_past = True
        self.recurrent_states_to_keep = recurrent_states_to_keep

    @property
    def is_croppable(self) -> bool:
        return self.record_past

    def checkpoint(self, num_tokens: int, replay: Callable[[int], None]) -> None:
        """Called by a model before a forward pass writes ``num_tokens`` tokens (no-op unless recording)."""
        if not self.record_past or self._replaying:
            return
        self._checkpoints.append(StateCheckpoint(
            states=[dict(layer.states) for layer in self.layers],  # reading `states` ends in-place updates
            seen_tokens=[layer.seen_tokens for layer in self.layers],
            attributes={name: getattr(self, name) for name in self._rollback_attributes},
            num_tokens=num_tokens,
            replay=replay,
        ))

    def _restore(self, checkpoint: StateCheckpoint) -> None:
        for layer, states, seen in zip(self.layers, checkpoint.states, checkpoint.seen_tokens):
            layer.states, layer.seen_tokens = dict(states), seen
        for name, value in checkpoint.attributes.items():
            setattr(self, name, value)

    @contextmanager
    def _replay_mode(self) -> Iterator[None]:
        self._replaying = True
        try:
            yield
        finally:
            self._replaying = False

    def crop(self, tokens_to_remove: int) -> None:
        """Forgets the last ``-tokens_to_remove`` tokens (transformers' convention: a negative count; 0 commits).

        Raises:
            ValueError: a positive count, a cache that does not record, or more tokens than were recorded.
        """
        if tokens_to_remove > 0:
            raise ValueError(
                f"{type(self).__name__} cannot be cropped to a length ({tokens_to_remove}): pass minus the number of "
                "tokens to remove"
            )
        remove = -tokens_to_remove
        if remove and not self.record_past:
            raise ValueError(
                f"{type(self).__name__} cannot be cropped unless it records its past: fast weights are a running sum "
                "of updates, so earlier states cannot be recovered by dropping positions. Call "
                "`activate_past_recording()` before the forward passes to roll back (generate's assisted decoding does)"
            )
        recorded = sum(checkpoint.num_tokens for checkpoint in self._checkpoints)
        if remove > recorded:
            raise ValueError(
                f"`crop({tokens_to_remove})` asks to remove {remove} tokens, but {type(self).__name__} recorded only "
                f"the last {recorded} since the previous crop"
            )
        while remove > 0:
            checkpoint = self._checkpoints.pop()
            self._restore(checkpoint)
            if checkpoint.num_tokens > remove:
                with self._replay_mode():
                    checkpoint.replay(checkpoint.num_tokens - remove)
            remove -= min(remove, checkpoint.num_tokens)
        self._checkpoints.clear()

    def _drop_checkpoints(self) -> None:
        self._checkpoints.clear()


class FastWeightCache(RollbackMixin, Cache):
    """Per-layer recurrent state of a fast-weight model (transformers ``Cache``), constant in sequence length.

    ``get_state(layer_idx) -> dict | None`` returns the state to continue from; ``set_state(layer_idx, state,
    num_new_tokens)`` stores a layer's final state. ``token_counts`` (``[B]``, long) counts the non-padding
    tokens of each row (used for absolute positions under left padding).
    """

    _rollback_attributes = ("token_counts",)

    def __init__(self, num_hidden_layers: int) -> None:
        super().__init__(layers=[FastWeightCacheLayer() for _ in range(num_hidden_layers)])
        self.token_counts: Optional[torch.Tensor] = None
        self._init_recording()

    @property
    def is_compileable(self) -> bool:
        # recording appends checkpoints holding Python callables: decode eagerly then (as transformers' linear layers)
        return not self.record_past and super().is_compileable

    def get_state(self, layer_idx: int) -> Optional[Dict[str, torch.Tensor]]:
        states = self.layers[layer_idx].states
        return dict(states) if states else None

    def set_state(self, layer_idx: int, state: Dict[str, torch.Tensor], num_new_tokens: int) -> None:
        self.layers[layer_idx].set_states(state, num_new_tokens)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        if layer_idx >= len(self.layers):
            return 0
        return self.layers[layer_idx].get_seq_length()

    def count_tokens(self, token_mask: Optional[torch.Tensor], batch_size: int, seq_len: int,
                     device: torch.device) -> None:
        """Adds each row's real (non-padding) tokens of this call (``token_mask [B, T]``, None: all ``seq_len``) to
        ``token_counts [B]``."""
        new_tokens = token_mask.sum(-1).long() if token_mask is not None else torch.full(
            (batch_size,), seq_len, dtype=torch.long, device=device
        )
        self.token_counts = new_tokens if self.token_counts is None else self.token_counts + new_tokens

    @property
    def batch_size(self) -> int:
        if self.token_counts is not None:
            return self.token_counts.shape[0]
        return super().batch_size

    def nbytes(self) -> int:
        """Bytes held by all state tensors (constant in the number of tokens seen)."""
        total = sum(layer.nbytes() for layer in self.layers)
        if self.token_counts is not None:
            total += self.token_counts.numel() * self.token_counts.element_size()
        return total

    def detach_(self) -> "FastWeightCache":
        """Stops gradients at the segment boundary (truncated backpropagation through time)."""
        for layer in self.layers:
            layer._map(lambda t: t.detach())
        return self

    def _map_counts(self, fn) -> None:
        if self.token_counts is not None:
            self.token_counts = fn(self.token_counts)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self._map_counts(lambda t: t.index_select(0, beam_idx.to(t.device)))
        self._drop_checkpoints()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self._map_counts(lambda t: t[indices.to(t.device)])
        self._drop_checkpoints()

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self._map_counts(lambda t: t.repeat_interleave(repeats, dim=0))
        self._drop_checkpoints()

    def reset(self) -> None:
        super().reset()
        self.token_counts = None
        self._drop_checkpoints()
