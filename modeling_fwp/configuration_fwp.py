"""Configurations of the fast-weight language models.

One config family shares every field of the LM backbone; each model differs only in its
fast-weight layer (``update_rule``, feature map, normalisation, and for the recurrent FWPs the cell).
"""
from __future__ import annotations

from transformers import PreTrainedConfig

FEATURE_MAPS = ("elu", "dpfp", "favor", "relu", "identity")
UPDATE_RULES = ("sum", "delta")
POSITION_EMBEDDINGS = ("none", "sinusoidal", "learned")
KERNEL_MODES = ("auto", "recurrent", "chunk")


class FastWeightConfig(PreTrainedConfig):
    r"""Shared configuration of the fast-weight causal LMs (pre-LN blocks: fast-weight layer + feed-forward).

    Fast-weight layer knobs (Schlag, Irie, Schmidhuber 2021):
        update_rule: "sum" (linear attention, eq. 5) or "delta" (eqs. 17-20).
        feature_map: "elu" (ELU+1), "dpfp" (eq. 37, dimension 2 * head_dim * dpfp_nu), "favor" (FAVOR+ with
            ``favor_features`` positive random features), "relu" or "identity".
        dpfp_nu: DPFP's nu, in 1 .. head_dim // 2 - 1.
        favor_features: m, the number of FAVOR+ random features (redrawn every training batch, fixed and saved
            with the model for evaluation).
        sum_normalization: phi(x) / sum_i phi(x)_i for keys and queries (eq. 29). None: on for the delta rule with
            a non-negative feature map, off otherwise.
        attention_normalization: divide the output by z_t . phi(q_t), z_t = sum_{s<=t} phi(k_s) (eqs. 26-28).
            None: on for the sum rule with a non-negative feature map, off otherwise.
        position_embedding_type: "none" (the papers' default), "sinusoidal" or "learned" absolute positions.
        kernel_mode, chunk_size: forwarded to ``fwp_kernels``.
    """

    model_type = "fwp_fast_weight"
    keys_to_ignore_at_inference = ["past_key_values"]

    vocab_size: int = 32000
    hidden_size: int = 256
    intermediate_size: int = 1024
    num_hidden_layers: int = 4
    num_attention_heads: int = 8
    head_dim: int | None = None
    hidden_act: str = "relu"
    layer_norm_eps: float = 1e-5
    hidden_dropout: float = 0.0
    initializer_range: float = 0.02
    position_embedding_type: str = "none"
    max_position_embeddings: int = 4096

    update_rule: str = "delta"
    feature_map: str = "elu"
    dpfp_nu: int = 1
    favor_features: int = 64
    sum_normalization: bool | None = None
    attention_normalization: bool | None = None
    kernel_mode: str = "auto"
    chunk_size: int = 64

    use_cache: bool = True
    tie_word_embeddings: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self, **kwargs):
        if self.num_attention_heads < 1:
            raise ValueError(f"`num_attention_heads` must be >= 1, got {self.num_attention_heads}")
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads != 0:
                raise ValueError(
                    f"`hidden_size` ({self.hidden_size}) must be divisible by `num_attention_heads` "
                    f"({self.num_attention_heads}), or set `head_dim` explicitly"
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        for name, value, allowed in (
            ("update_rule", self.update_rule, UPDATE_RULES),
            ("feature_map", self.feature_map, FEATURE_MAPS),
            ("position_embedding_type", self.position_embedding_type, POSITION_EMBEDDINGS),
            ("kernel_mode", self.kernel_mode, KERNEL_MODES),
        ):
            if value not in allowed:
                raise ValueError(f"`{name}` must be one of {allowed}, got {value!r}")
        if self.feature_map == "dpfp" and not 1 <= self.dpfp_nu <= self.head_dim // 2 - 1:
            raise ValueError(
                f"`dpfp_nu` must be in 1..head_dim // 2 - 1 = 1..{self.head_dim // 2 - 1} for head_dim "
                f"{self.head_dim}, got {self.dpfp_nu}"
            )
        if self.feature_map == "favor" and self.favor_features < 1:
            raise ValueError(f"`favor_features` must be >= 1, got {self.favor_features}")
        if self.chunk_size < 1:
            raise ValueError(f"`chunk_size` must be >= 1, got {self.chunk_size}")
        non_negative = self.feature_map != "identity"
        if self.sum_normalization is None:
            self.sum_normalization = non_negative and self.update_rule == "delta"
        if self.attention_normalization is None:
            self.attention_normalization = non_negative and self.update_rule == "sum"
        for name in ("sum_normalization", "attention_normalization"):
            if getattr(self, name) and not non_negative:
                raise ValueError(f"`{name}` needs a non-negative feature map, got feature_map='identity'")
        super().__post_init__(**kwargs)

    @property
    def feature_dim(self) -> int:
        """Dimension of phi(k): what the fast weight matrix is indexed by (its Dk)."""
        if self.feature_map == "dpfp":
            return 2 * self.head_dim * self.dpfp_nu
        if self.feature_map == "favor":
            return self.favor_features
        return self.head_dim


class LinearTransformerConfig(FastWeightConfig):
    """Linear Transformer (Katharopoulos et al. 2020): sum update rule, ELU+1, attention normalisation."""

    model_type = "fwp_linear_transformer"
    update_rule: str = "sum"


class DeltaNetConfig(FastWeightConfig):
    """Delta Net (Schlag et al. 2021): delta update rule with beta = sigmoid(W_beta x), sum normalisation."""

    model_type = "fwp_delta_net"
    update_rule: str = "delta"
