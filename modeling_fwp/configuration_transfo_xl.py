"""Configuration of Transformer-XL (Dai et al. 2019), optionally with a Fast Weight Layer head (Clark et al. 2022).

transformers removed its Transformer-XL after 4.35; this is a rebuild for transformers 5 under the model type
``fwp_transfo_xl``. Field names follow transformers' conventions (``hidden_size`` for d_model, ...); the old names
are accepted as aliases through ``attribute_map`` (``d_model``, ``n_layer``, ``n_head``, ``d_head``, ``d_inner``,
``d_embed``, ``n_token``, ``tie_weight``, ``dropatt``, ``layer_norm_epsilon``).
"""
from __future__ import annotations

from transformers import PreTrainedConfig

from .configuration_fwl import HIDDEN_PARAMETERS, FWLHeadConfigMixin
from .configuration_fwp import SIZE_FIELDS, check_sizes


class TransfoXLConfig(FWLHeadConfigMixin, PreTrainedConfig):
    r"""Transformer-XL with relative positional attention, segment memories, adaptive input and projected adaptive
    softmax (Dai et al., ACL 2019), and an optional Fast Weight Layer head (Clark et al., EMNLP 2022, sec. 3).

    Defaults are those of transfo-xl-wt103 (18 layers, d_model 1024, 267735-word vocabulary).

    Args:
        vocab_size: number of tokens V.
        cutoffs: adaptive softmax / input cluster boundaries, increasing in ``(0, V)``: cluster 0 (the head, the most
            frequent words) is ``[0, cutoffs[0])``, cluster i is ``[cutoffs[i-1], cutoffs[i])``, the last ends at V.
            Ids are assumed sorted by frequency. ``[]``: a plain (projected) softmax.
        hidden_size (d_model), embedding_size (d_embed, None: hidden_size), num_attention_heads (n_head),
        head_dim (d_head), intermediate_size (d_inner), num_hidden_layers (n_layer): the usual sizes.
        div_val: cluster i uses embeddings of size ``embedding_size // div_val**i`` (Baevski & Auli 2019).
        tie_word_embeddings: share the adaptive softmax's cluster weights with the adaptive input embeddings.
        tie_projs: per cluster, share the softmax projection with the input embedding's projection (None:
            ``[False] + [True] * len(cutoffs)``, wt103's ``proj_share_all_but_first``).
        pre_lnorm: pre-LayerNorm blocks (LayerNorm applied to [memory; segment] before attention and to the input of
            the feed-forward) instead of the default post-LayerNorm.
        mem_len: number of past hidden states kept per layer as memory (the cache; bounded, constant size).
        clamp_len: relative distances beyond this use the embedding of ``clamp_len`` (<= 0: no clamping).
        same_length: every query attends to exactly ``mem_len`` keys (itself and the ``mem_len - 1`` before it) once
            that many exist, as in the paper's evaluation; requires ``mem_len >= 1``.
        untie_r: one pair of position biases (u = r_w_bias, v = r_r_bias) per layer instead of one shared pair.
        hidden_dropout (dropout), attention_dropout (dropatt): dropout rates.
        initializer_range, proj_init_std: std of the normal initialisation of weights and of the projections.

    Fast Weight Layer (``use_fwl=True``): the FWL head of ``modeling_fwp.fwl`` on the last hidden states, with the
    adaptive softmax as its output layer, and the paper's segment recurrence of the running update
    ``Delta <- gamma * Delta + stopgrad(sum of the segment's gradients)`` (learned gamma per fast parameter).
        fwl_*: the FWL head's fields (``FWLHeadConfigMixin``), with two defaults of their own: ``fwl_decay_init``
            0.9 (the segment decay is on) and ``fwl_output_bias`` False (the adaptive softmax has its biases; an
            extra c is unsupported, as are fast output parameters and ``fwl_gradient_dtype``).
    """

    model_type = "fwp_transfo_xl"
    keys_to_ignore_at_inference = ["cache", "past_key_values"]
    attribute_map = {
        "d_model": "hidden_size",
        "d_embed": "embedding_size",
        "n_layer": "num_hidden_layers",
        "n_head": "num_attention_heads",
        "d_head": "head_dim",
        "d_inner": "intermediate_size",
        "n_token": "vocab_size",
        "tie_weight": "tie_word_embeddings",
        "dropout": "hidden_dropout",
        "dropatt": "attention_dropout",
        "layer_norm_epsilon": "layer_norm_eps",
    }

    vocab_size: int = 267735
    cutoffs: list[int] | None = None
    hidden_size: int = 1024
    embedding_size: int | None = None
    num_attention_heads: int = 16
    head_dim: int = 64
    intermediate_size: int = 4096
    num_hidden_layers: int = 18
    div_val: int = 4
    tie_projs: list[bool] | None = None
    pre_lnorm: bool = False
    mem_len: int = 1600
    clamp_len: int = 1000
    same_length: bool = True
    untie_r: bool = True
    hidden_act: str = "relu"
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.0
    layer_norm_eps: float = 1e-5
    initializer_range: float = 0.02
    proj_init_std: float = 0.01

    use_fwl: bool = False
    # FWLHeadConfigMixin's fields; these two defaults differ: the decay is part of the Transformer-XL FWL (Clark et al.
    # sec. 3), and the adaptive softmax output layer has no room for an extra bias c.
    fwl_decay_init: float | None = 0.9
    fwl_output_bias: bool = False

    use_cache: bool = True
    tie_word_embeddings: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = 0

    def __post_init__(self, **kwargs):
        for old_name in [k for k in kwargs if k in self.attribute_map]:  # old spellings, before validation
            setattr(self, old_name, kwargs.pop(old_name))
        check_sizes(self, SIZE_FIELDS)
        if self.cutoffs is None:
            self.cutoffs = [20000, 40000, 200000] if self.vocab_size > 200000 else []
        if "proj_share_all_but_first" in kwargs:  # transformers-4 spelling of tie_projs
            share = kwargs.pop("proj_share_all_but_first")
            if self.tie_projs is None:
                self.tie_projs = [False] + [bool(share)] * len(self.cutoffs)
        self.cutoffs = [int(c) for c in self.cutoffs]
        if any(not 0 < c < self.vocab_size for c in self.cutoffs) or self.cutoffs != sorted(set(self.cutoffs)):
            raise ValueError(
                f"`cutoffs` must be strictly increasing values in (0, vocab_size={self.vocab_size}), got {self.cutoffs}"
            )
        if self.embedding_size is None:
            self.embedding_size = self.hidden_size
        if self.tie_projs is None:
            self.tie_projs = [False] + [True] * len(self.cutoffs)
        self.tie_projs = [bool(t) for t in self.tie_projs]
        if len(self.tie_projs) != len(self.cutoffs) + 1:
            raise ValueError(
                f"`tie_projs` needs one entry per cluster (len(cutoffs) + 1 = {len(self.cutoffs) + 1}), got "
                f"{self.tie_projs}"
            )
        if self.div_val < 1:
            raise ValueError(f"`div_val` must be >= 1, got {self.div_val}")
        if self.div_val > 1 and self.embedding_size // self.div_val ** len(self.cutoffs) < 1:
            raise ValueError(
                f"`embedding_size` ({self.embedding_size}) // div_val ** len(cutoffs) ({self.div_val}**"
                f"{len(self.cutoffs)}) must be >= 1: the last cluster would have no embedding dimensions"
            )
        check_sizes(self, ("head_dim", "embedding_size"))
        if self.mem_len < 0:
            raise ValueError(f"`mem_len` must be >= 0, got {self.mem_len}")
        if self.same_length and self.mem_len < 1:
            raise ValueError("`same_length=True` limits attention to `mem_len` keys: it needs `mem_len` >= 1")
        if self.use_fwl:
            self.resolve_fwl_fields(self.hidden_size)
            self._check_adaptive_softmax_fwl()
        super().__post_init__(**kwargs)

    def _check_adaptive_softmax_fwl(self) -> None:
        """What the adaptive softmax output layer of the FWL does not support (its output layer stays slow)."""
        not_hidden = [name for name in self.fwl_fast_parameters if name not in HIDDEN_PARAMETERS]
        if not_hidden:
            raise ValueError(
                f"`fwl_fast_parameters` may only name the FWL's own parameters {list(HIDDEN_PARAMETERS)} with the "
                f"adaptive softmax (its output layer stays slow), got {not_hidden}"
            )
        if self.fwl_output_bias:
            raise ValueError("`fwl_output_bias` must be False: the adaptive softmax output layer has its own biases")
        if self.fwl_gradient_dtype is not None:
            raise ValueError(
                "`fwl_gradient_dtype` must be None with the adaptive softmax output layer, got "
                f"{self.fwl_gradient_dtype!r}"
            )
