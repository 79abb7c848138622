"""A fast-weight recurrent core with the interface of ``torch.nn.LSTM``, for agents (Irie et al. 2021, sec. 4.4).

Irie et al. replace the LSTM core of IMPALA agents by a Recurrent Delta Net or a Delta RNN (2 layers, d 128, 4 heads,
feed-forward 512; appendix C). :class:`FastWeightRecurrentCore` is that core for every fast-weight family of this
package (Delta Net, Delta RNN, Delta LSTM, Recurrent Delta Net, and the others): the stack of the causal LMs'
pre-LN blocks and final LayerNorm without the token embedding, called as an LSTM is::

    lstm = torch.nn.LSTM(input_size, hidden_size)             core = FastWeightRecurrentCore.from_family(
                                                                  "recurrent_delta_net", input_size, hidden_size)
    y, (h, c) = lstm(x, (h, c))                               y, state = core(x, state)            # x [T, B, D_in]
    zeros = (torch.zeros(L, B, H), torch.zeros(L, B, H))      state = core.initial_state(B)        # or None

Differences from ``nn.LSTM``: the state is a tuple of batch-first tensors (batch dimension 0, where the LSTM's h
and c have it at 1), named by ``core.state_names``; ``reset [T, B]`` zeroes a row's state before the step where it
is 1 (an episode boundary), which an LSTM leaves to its caller. As with the LSTM, the returned state is not detached:
detach it between truncated-backpropagation spans. Underneath run the layers' kernels (``fwp_kernels``: the chunkwise
delta rule, the fused scans), over whole stretches between resets.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .configuration_fwp import FastWeightConfig
from .feature_maps import FeatureMap
from .modeling_fwp import FastWeightBlock

CoreState = Tuple[torch.Tensor, ...]


class FastWeightRecurrentCore(nn.Module):
    """``core(x [T, B, input_size], state, reset [T, B]) -> (y [T, B, hidden_size], state)``.

    The layers are ``FastWeightModel``'s (same module names: ``layers.{i}``, ``norm``), so a trained model's blocks
    load into a core with ``load_state_dict``. An input of another width than ``config.hidden_size`` is projected by
    ``input_proj`` first (``nn.LSTM`` has input_size != hidden_size as well). FAVOR+ features are redrawn at a
    training call that starts from no state, as in the language models (a carried state was written with the old
    features).

    Args:
        config: a fast-weight family's config (``hidden_size``, ``num_hidden_layers``, heads, the layer's knobs);
            ``vocab_size`` is not used. Absolute position embeddings are refused (positions restart with episodes).
        input_size: the width of x; None: ``config.hidden_size``.
        batch_first: x and y are ``[B, T, *]`` and reset ``[B, T]``, as ``nn.LSTM(batch_first=True)``.
    """

    def __init__(self, config: FastWeightConfig, input_size: Optional[int] = None, batch_first: bool = False) -> None:
        super().__init__()
        if not isinstance(config, FastWeightConfig):
            raise TypeError(f"`config` must be a FastWeightConfig (a fast-weight family's), "
                            f"got {type(config).__name__}")
        if config.position_embedding_type != "none":
            raise ValueError("`position_embedding_type` must be 'none' for a recurrent core (positions restart at "
                             f"every episode), got {config.position_embedding_type!r}")
        self.config = config
        self.input_size = config.hidden_size if input_size is None else input_size
        self.hidden_size = config.hidden_size
        self.batch_first = batch_first
        self.input_proj = nn.Linear(self.input_size, self.hidden_size) if self.input_size != self.hidden_size else None
        self.layers = nn.ModuleList(FastWeightBlock(config, i) for i in range(config.num_hidden_layers))
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self._state_names: Optional[List[Tuple[int, str]]] = None

    @classmethod
    def from_family(
        cls, family: str, input_size: int, hidden_size: int, num_layers: int = 1, batch_first: bool = False,
        **config_kwargs,
    ) -> "FastWeightRecurrentCore":
        """A core built like ``nn.LSTM(input_size, hidden_size, num_layers)``: `family` is a short name of the family
        table (``"delta_net"``, ``"delta_rnn"``, ``"delta_lstm"``, ``"recurrent_delta_net"``, ...), `config_kwargs`
        the family config's other fields (``num_attention_heads``, ``intermediate_size``, ``version``, ...)."""
        from .families import FAMILIES

        configs = {spec.name: spec.config_class for spec in FAMILIES if spec.fast_weight_layer is not None}
        if family not in configs:
            raise ValueError(f"`family` must be one of {sorted(configs)}, got {family!r}")
        config = configs[family](hidden_size=hidden_size, num_hidden_layers=num_layers, **config_kwargs)
        return cls(config, input_size=input_size, batch_first=batch_first)

    @property
    def state_names(self) -> List[Tuple[int, str]]:
        """``(layer index, state name)`` of each tensor of a state tuple, in order (e.g. ``(0, "fast_weight")``)."""
        if self._state_names is None:
            self.initial_state(1)
        return list(self._state_names)

    @torch.no_grad()
    def initial_state(self, batch_size: int, device: Optional[torch.device] = None) -> CoreState:
        """The zero state of `batch_size` rows: what ``state=None`` means, as explicit tensors (for rollout buffers)."""
        param = next(self.parameters())
        x = torch.zeros(1, batch_size, self.input_size, device=device or param.device, dtype=param.dtype)
        _, state = self._run(self._project(x).transpose(0, 1), [None] * len(self.layers))
        return tuple(torch.zeros_like(t) for t in self._flatten(state))

    def forward(
        self, x: torch.Tensor, state: Optional[Sequence[torch.Tensor]] = None, reset: Optional[torch.Tensor] = None
    ) -> Tuple[torch.Tensor, CoreState]:
        """
        Args:
            x: ``[T, B, input_size]`` (``[B, T, input_size]`` with ``batch_first``).
            state: the tuple a previous call returned (or ``initial_state``), or None (zeros).
            reset: ``[T, B]`` (``[B, T]`` with ``batch_first``), bool or 0/1: where 1, that row's state is zeroed
                before step t (the step is the first of a new episode).
        Returns:
            ``(y [T, B, hidden_size], state)``: the outputs of every step and the state after the last one.
        """
        if self.batch_first:
            x = x.transpose(0, 1)
            reset = reset.transpose(0, 1) if reset is not None else None
        if x.dim() != 3 or x.shape[-1] != self.input_size:
            raise ValueError(f"`x` must be [T, B, input_size={self.input_size}], got {tuple(x.shape)}")
        T, B, _ = x.shape
        if reset is not None and tuple(reset.shape) != (T, B):
            raise ValueError(f"`reset` must be [T, B] = {(T, B)}, got {tuple(reset.shape)}")
        states = self._unflatten(state, B)
        if self.training and state is None:
            for module in self.modules():  # FAVOR+: new random features for a new stream (Schlag et al. sec. 5.3)
                if isinstance(module, FeatureMap):
                    module.redraw()
        h = self._project(x).transpose(0, 1)  # [B, T, D]
        outputs = []
        for start, end in self._stretches(reset, T):
            if reset is not None:
                states = [self._zero_rows(s, reset[start]) for s in states]
            y, states = self._run(h[:, start:end], states)
            outputs.append(y)
        y = torch.cat(outputs, dim=1)
        return (y if self.batch_first else y.transpose(0, 1)), self._flatten(states)

    # -----------------------------------------------------------------------------------------------------------

    def _project(self, x: torch.Tensor) -> torch.Tensor:
        return self.input_proj(x) if self.input_proj is not None else x

    def _run(self, h: torch.Tensor, states: List[Optional[Dict[str, torch.Tensor]]]):
        """The blocks over ``h [B, T, D]`` from per-layer states; returns ``(norm(h), new states)``."""
        new_states = []
        for block, state in zip(self.layers, states):
            h, new_state = block(h, state=state)
            new_states.append(new_state)
        return self.norm(h), new_states

    @staticmethod
    def _stretches(reset: Optional[torch.Tensor], T: int) -> List[Tuple[int, int]]:
        """``[start, end)`` stretches of steps, each starting at 0 or at a step where some row resets."""
        if reset is None:
            return [(0, T)]
        starts = [0] + [t for t in torch.nonzero(reset.bool().any(dim=1)).flatten().tolist() if t > 0]
        return list(zip(starts, starts[1:] + [T]))

    @staticmethod
    def _zero_rows(state: Optional[Dict[str, torch.Tensor]], reset_t: torch.Tensor):
        """`state` with the rows where ``reset_t [B]`` is 1 set to zero (None stays None: it is zero already)."""
        if state is None or not bool(reset_t.any()):
            return state
        keep = ~reset_t.bool()
        return {name: t * keep.view(-1, *([1] * (t.dim() - 1))).to(t.dtype) for name, t in state.items()}

    def _flatten(self, states: List[Dict[str, torch.Tensor]]) -> CoreState:
        if self._state_names is None:
            self._state_names = [(i, name) for i, state in enumerate(states) for name in sorted(state)]
        return tuple(states[i][name] for i, name in self._state_names)

    def _unflatten(self, state: Optional[Sequence[torch.Tensor]], batch_size: int):
        """Per-layer state dicts (None for each layer when `state` is None)."""
        if state is None:
            return [None] * len(self.layers)
        names = self.state_names
        if not isinstance(state, (tuple, list)) or len(state) != len(names):
            raise ValueError(f"`state` must be a tuple of {len(names)} tensors (core.state_names), got "
                             f"{type(state).__name__} of {len(state) if isinstance(state, (tuple, list)) else '?'}")
        states: List[Dict[str, torch.Tensor]] = [{} for _ in self.layers]
        for (i, name), tensor in zip(names, state):
            if not isinstance(tensor, torch.Tensor) or tensor.shape[0] != batch_size:
                raise ValueError(f"`state` entry {name!r} of layer {i} must be a tensor with batch size {batch_size} "
                                 f"first, got {getattr(tensor, 'shape', type(tensor))}")
            states[i][name] = tensor
        return states
