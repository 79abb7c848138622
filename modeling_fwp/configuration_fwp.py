"""Configurations of the fast-weight language models.

One config family shares every field of the LM backbone; each model differs only in its
fast-weight layer (``update_rule``, feature map, normalisation, and for the recurrent FWPs the cell).
"""
from __future__ import annotations

from typing import Iterable

from transformers import PreTrainedConfig

FEATURE_MAPS = ("elu", "dpfp", "favor", "relu", "identity", "silu")
NON_NEGATIVE_FEATURE_MAPS = ("elu", "dpfp", "favor", "relu", "softmax")  # "silu" and "identity" can be negative
UPDATE_RULES = ("sum", "delta")
POSITION_EMBEDDINGS = ("none", "sinusoidal", "learned")
KERNEL_MODES = ("auto", "recurrent", "chunk")  # the modes of the outer-product rules (delta_rule, linear_attention)
SCAN_KERNEL_MODES = ("auto", "recurrent", "fused")  # the modes of the recurrent FWPs' scans (fwp_kernels.dispatch)
FAST_NET_ACTIVATIONS = ("softmax", "feature_map")  # the Delta MLP's f (Irie et al. 2021, eq. 13)
VALUE_ACTIVATIONS = ("identity", "silu")
OUTPUT_GATE_ACTIVATIONS = ("silu", "sigmoid")
NORM_TYPES = ("layer_norm", "rms_norm")
FEED_FORWARD_TYPES = ("mlp", "swiglu")
# Fields of the "linear" fast-weight layer's modern options (their FastWeightConfig defaults: the papers' layer). The
# recurrent FWPs' layers do not implement them.
LINEAR_LAYER_OPTIONS = (
    "short_conv_size", "value_activation", "qk_l2_normalization", "query_scaling", "beta_bias", "allow_neg_eigval",
    "output_norm", "output_gate", "value_head_dim",
)
SIZE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def check_sizes(config: PreTrainedConfig, names: Iterable[str], owner: str = "") -> None:
    """Raises a ValueError naming the field unless each of ``config.<name>`` (``names``) is an int >= 1 (a size of 0
    builds empty tensors that fail much later, or not at all). ``owner`` prefixes the name (``"text_config."``)."""
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"`{owner}{name}` must be an int >= 1, got {value!r}")


class FastWeightConfig(PreTrainedConfig):
    r"""Shared configuration of the fast-weight causal LMs (pre-LN blocks: fast-weight layer + feed-forward).

    Fast-weight layer knobs (Schlag, Irie, Schmidhuber 2021):
        update_rule: "sum" (linear attention, sec. 3.2, eq. 17) or "delta" (sec. 4.2, eqs. 20-25).
        feature_map: "elu" (ELU+1, eq. 30), "dpfp" (eq. 37, dimension 2 * head_dim * dpfp_nu), "favor" (FAVOR+,
            eqs. 31-32: ``h(x) / sqrt(m) [exp(R x); exp(-R x)]``, dimension d_dot = 2 * favor_features), "relu" or
            "identity".
        dpfp_nu: DPFP's nu, in 1 .. head_dim // 2 - 1.
        favor_features: m, the number of FAVOR+ random features: the rows of R [m, head_dim], drawn from N(0, I)
            (sec. 5.3; redrawn every training batch, fixed and saved with the model for evaluation). d_dot = 2 m.
        sum_normalization: phi(x) / sum_i phi(x)_i for keys and queries (eq. 29). None: on for the delta rule with
            a non-negative feature map, off otherwise.
        attention_normalization: divide the output by z_t . phi(q_t), z_t = sum_{s<=t} phi(k_s) (sum rule: eqs.
            18-19; delta rule: eqs. 26-28, where the retrieved value is divided by z_{t-1} . phi(k_t) as well).
            None: on for the sum rule with a non-negative feature map, off otherwise.
        position_embedding_type: "none" (the papers' default), "sinusoidal" or "learned" absolute positions.
        kernel_mode: the ``fwp_kernels`` mode of the layer's recurrences: "auto" (the fastest for the device and
            length), "recurrent" (the step loops, the reference) or the family's parallel mode: "chunk" for the
            outer-product rules, "fused" for the recurrent FWPs' scans (``kernel_modes`` lists a family's values).
        chunk_size: the chunk length of the chunkwise outer-product rules.

    Fields a family never reads are refused, so that no setting is silently ignored: each family lists them in
    ``unused_fields`` with the values it still accepts (the defaults, which saved configs hold), and a field that
    only another family declares (``version``, ``fast_net_depth``, ...) raises. ``dpfp_nu`` and ``favor_features``
    are read only with their feature map; they stay accepted with the others, so a config can switch maps.

    Options of later Delta Nets (Yang et al. 2024, "Parallelizing Linear Transformers with the Delta Rule over
    Sequence Length", as flash-linear-attention builds them; the defaults are the papers' layer above):
        short_conv_size: kernel size of a causal depthwise convolution (no bias) on each of q, k, v after its
            projection (0: none). Its last ``short_conv_size - 1`` inputs are kept in the cache.
        feature_map "silu": phi = SiLU (not non-negative: no sum or attention normalisation).
        value_activation: "identity" (the papers) or "silu", applied to v (after the convolution).
        qk_l2_normalization: q and k divided by their L2 norm per head, ``x / sqrt(|x|^2 + 1e-6)``, after phi.
        query_scaling: q multiplied by ``feature_dim ** -0.5``.
        beta_bias: whether ``beta = sigmoid(W_beta x + b)`` has the bias b (eq. 21 has none; our default keeps it).
        allow_neg_eigval: beta doubled (in (0, 2): Grazzi et al. 2025, negative eigenvalues of the transition).
        output_norm: an RMSNorm (eps ``layer_norm_eps``) over each head's output ``W_t phi(q_t)``.
        output_gate: with output_norm, ``rms(o) * w * act(W_g x)`` with ``output_gate_activation`` ("silu").
        value_head_dim: the value (and output) dimension per head (None: head_dim).

    Blocks:
        norm_type: "layer_norm" (the papers) or "rms_norm" (weight only) for the blocks' and the final norm.
        feed_forward_type: "mlp" (``W_2 act(W_1 x + b_1) + b_2``) or "swiglu" (``W_d (act(W_g x) * W_u x)``, no
            biases, act = ``hidden_act``).
    """

    model_type = "fwp_fast_weight"
    keys_to_ignore_at_inference = ["cache", "past_key_values"]
    # Class attributes, not config fields: the feature maps and kernel modes this family's fast-weight layer
    # implements, and the fields it never reads -> the values accepted for them (see the docstring).
    supported_feature_maps = FEATURE_MAPS
    kernel_modes = KERNEL_MODES
    unused_fields = {}

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

    short_conv_size: int = 0
    value_activation: str = "identity"
    qk_l2_normalization: bool = False
    query_scaling: bool = False
    beta_bias: bool = True
    allow_neg_eigval: bool = False
    output_norm: bool = False
    output_gate: bool = False
    output_gate_activation: str = "silu"
    value_head_dim: int | None = None
    norm_type: str = "layer_norm"
    feed_forward_type: str = "mlp"

    # Where converted weights came from (modeling_fwp.convert_fla): repo_id, revision, path, library, model_type,
    # license, license_source, conversion. None for models of this package.
    pretrained_source: dict | None = None

    use_cache: bool = True
    tie_word_embeddings: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self, **kwargs):
        self._check_family_fields(kwargs)
        check_sizes(self, SIZE_FIELDS + ("max_position_embeddings",))
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads != 0:
                raise ValueError(
                    f"`hidden_size` ({self.hidden_size}) must be divisible by `num_attention_heads` "
                    f"({self.num_attention_heads}), or set `head_dim` explicitly"
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        check_sizes(self, ("head_dim",))
        fixed = type(self).__dict__.get("update_rule")  # the family's own rule, where its class declares one
        if type(self) is not FastWeightConfig and isinstance(fixed, str) and self.update_rule != fixed:
            raise ValueError(
                f"`update_rule` is {fixed!r} for {type(self).__name__} (the family decides it), "
                f"got {self.update_rule!r}"
            )
        for name, value, allowed in (
            ("update_rule", self.update_rule, UPDATE_RULES),
            ("feature_map", self.feature_map, self.supported_feature_maps),
            ("position_embedding_type", self.position_embedding_type, POSITION_EMBEDDINGS),
            ("kernel_mode", self.kernel_mode, self.kernel_modes),
            ("value_activation", self.value_activation, VALUE_ACTIVATIONS),
            ("output_gate_activation", self.output_gate_activation, OUTPUT_GATE_ACTIVATIONS),
            ("norm_type", self.norm_type, NORM_TYPES),
            ("feed_forward_type", self.feed_forward_type, FEED_FORWARD_TYPES),
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
        self._check_layer_options()
        non_negative = self.feature_map in NON_NEGATIVE_FEATURE_MAPS
        if self.sum_normalization is None:
            self.sum_normalization = non_negative and self.update_rule == "delta"
        if self.attention_normalization is None:
            self.attention_normalization = non_negative and self.update_rule == "sum"
        for name in ("sum_normalization", "attention_normalization"):
            if getattr(self, name) and not non_negative:
                raise ValueError(f"`{name}` needs a non-negative feature map, got feature_map={self.feature_map!r}")
        if self.qk_l2_normalization and self.sum_normalization:
            raise ValueError("`qk_l2_normalization` and `sum_normalization` exclude each other: set one of them")
        super().__post_init__(**kwargs)

    def _check_family_fields(self, extra: dict) -> None:
        """``ValueError`` naming the field for a value of ``unused_fields`` the family does not accept, or for a
        field of another family among the `extra` keyword arguments (which transformers would keep unread)."""
        family = type(self).__name__
        for name, accepted in self.unused_fields.items():
            if getattr(self, name) not in accepted:
                raise ValueError(f"`{name}` is not used by {family}: it accepts only {accepted} (the default), "
                                 f"got {getattr(self, name)!r}")
        foreign = sorted(set(extra) & (_family_field_names() - _field_names(type(self))))
        if foreign:
            raise ValueError(f"`{foreign[0]}` is a field of another fast-weight family, not used by {family}")

    def _check_layer_options(self) -> None:
        """Types and ranges of the later Delta Nets' options (see the class docstring)."""
        if (not isinstance(self.short_conv_size, int) or isinstance(self.short_conv_size, bool)
                or self.short_conv_size < 0):
            raise ValueError(f"`short_conv_size` must be an int >= 0 (0: no convolution), got {self.short_conv_size!r}")
        for name in ("qk_l2_normalization", "query_scaling", "beta_bias", "allow_neg_eigval", "output_norm",
                     "output_gate"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"`{name}` must be a bool, got {getattr(self, name)!r}")
        if self.allow_neg_eigval and self.update_rule != "delta":
            raise ValueError("`allow_neg_eigval` doubles the delta rule's beta: it needs update_rule='delta'")
        if self.output_gate and not self.output_norm:
            raise ValueError("`output_gate` gates the output RMSNorm: it needs `output_norm=True`")
        if self.value_head_dim is None:
            self.value_head_dim = self.head_dim
        if not isinstance(self.value_head_dim, int) or self.value_head_dim < 1:
            raise ValueError(f"`value_head_dim` must be an int >= 1 (or None: head_dim), got {self.value_head_dim!r}")

    @property
    def feature_dim(self) -> int:
        """Dimension of phi(k): what the fast weight matrix is indexed by (its Dk)."""
        if self.feature_map == "dpfp":
            return 2 * self.head_dim * self.dpfp_nu
        if self.feature_map == "favor":
            return 2 * self.favor_features  # eq. 32: [exp(R x); exp(-R x)]
        return self.head_dim


def _field_names(cls: type) -> set:
    """The config fields (annotated class attributes) `cls` declares or inherits."""
    return {name for klass in cls.__mro__ for name in vars(klass).get("__annotations__", {})}


def _family_field_names() -> set:
    """The fields declared by any fast-weight family's config (``version``, ``fast_net_depth``, ...)."""
    names, pending = set(), list(FastWeightConfig.__subclasses__())
    while pending:
        cls = pending.pop()
        names |= set(vars(cls).get("__annotations__", {}))
        pending.extend(cls.__subclasses__())
    return names


class LinearTransformerConfig(FastWeightConfig):
    """Linear Transformer (Katharopoulos et al. 2020): sum update rule, ELU+1, attention normalisation."""

    model_type = "fwp_linear_transformer"
    update_rule: str = "sum"


class DeltaNetConfig(FastWeightConfig):
    """Delta Net (Schlag et al. 2021): delta update rule with beta = sigmoid(W_beta x), sum normalisation."""

    model_type = "fwp_delta_net"
    update_rule: str = "delta"


class GatedDeltaNetConfig(FastWeightConfig):
    r"""Gated DeltaNet (Yang, Kautz, Hatamizadeh 2025, sec. 3): the delta rule with a decay ``a_t = exp(g_t)`` of the
    fast weight before each update, ``g_t = -exp(A_log) * softplus(W_a x_t + dt_bias)`` per value head. The defaults
    are flash-linear-attention's GatedDeltaNet layer and blocks: short convolution (4) on q, k, v, SiLU, L2-normalised
    and scaled q and k, beta without bias, gated output RMSNorm, RMSNorm blocks, SwiGLU, untied embeddings.

    Args:
        num_v_heads: value heads (None: num_attention_heads), a multiple of num_attention_heads; value head j reads
            query/key head ``j // (num_v_heads / num_attention_heads)``. fla's ``expand_v`` is
            ``value_head_dim / head_dim``.
    """

    model_type = "fwp_gated_delta_net"
    fast_weight_layer = "gated_delta"
    update_rule: str = "delta"
    num_v_heads: int | None = None
    feature_map: str = "silu"
    short_conv_size: int = 4
    value_activation: str = "silu"
    qk_l2_normalization: bool = True
    query_scaling: bool = True
    beta_bias: bool = False
    output_norm: bool = True
    output_gate: bool = True
    norm_type: str = "rms_norm"
    feed_forward_type: str = "swiglu"
    hidden_act: str = "silu"
    layer_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        if self.num_v_heads is None:
            self.num_v_heads = self.num_attention_heads
        if not isinstance(self.num_v_heads, int) or self.num_v_heads % self.num_attention_heads:
            raise ValueError(f"`num_v_heads` must be a multiple of num_attention_heads ({self.num_attention_heads}), "
                             f"got {self.num_v_heads!r}")
        if self.attention_normalization:
            raise ValueError("`attention_normalization` is not supported by GatedDeltaNetConfig")


class RecurrentFastWeightConfig(FastWeightConfig):
    r"""Shared base of the recurrent Fast Weight Programmers' configs (Irie, Schlag, Csordas, Schmidhuber 2021).

    The paper's Table 1 names each model by its slow net (feedforward / recurrent), update rule (always the delta
    rule here) and fast net (linear, MLP, RNN, LSTM, Delta Net). Feature map and sum normalisation apply to the
    keys/queries of the feedforward fast weights (the paper: ELU+1 with sum normalisation); the activations inside
    the recurrences are the paper's (softmax, tanh, sigmoid). Attention normalisation is not used by these models.

    Subclasses declare ``versions`` (the allowed values of their ``version`` field) when they have versions.
    """

    model_type = "fwp_recurrent_fast_weight"
    versions = ()  # class attribute, not a config field

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        if self.update_rule != "delta":
            raise ValueError(f"`update_rule` must be 'delta' for {type(self).__name__} (the paper's RFWPs), "
                             f"got {self.update_rule!r}")
        if self.attention_normalization:
            raise ValueError(f"`attention_normalization` is not supported by {type(self).__name__}")
        for name in LINEAR_LAYER_OPTIONS:  # at FastWeightConfig's default (value_head_dim: resolved to head_dim)
            allowed = self.head_dim if name == "value_head_dim" else getattr(FastWeightConfig, name)
            if getattr(self, name) != allowed:
                raise ValueError(f"`{name}` is an option of the Linear Transformer / Delta Net layer, not supported by "
                                 f"{type(self).__name__}: leave it at {allowed!r}, got {getattr(self, name)!r}")
        if self.head_dim < 2:
            raise ValueError(
                f"`head_dim` must be >= 2 for {type(self).__name__}: its recurrent keys are softmaxes over head_dim "
                f"entries, got {self.head_dim} (hidden_size={self.hidden_size}, "
                f"num_attention_heads={self.num_attention_heads})"
            )
        if self.versions and getattr(self, "version", None) not in self.versions:
            raise ValueError(f"`version` must be one of {self.versions} for {type(self).__name__}, "
                             f"got {getattr(self, 'version', None)!r}")


class DeltaMLPConfig(RecurrentFastWeightConfig):
    r"""Delta MLP (Irie et al. 2021, sec. 3.1, eqs. 13-14; appendix A.2): feedforward slow net, delta rule, fast net
    a residual MLP of `fast_net_depth` blocks, each two delta-rule fast weight matrices (head_dim -> 4 head_dim ->
    head_dim) with a slow LayerNorm.

    Args:
        fast_net_depth: the number of blocks K (appendix A.2's versions A and B: 4 and 2).
        fast_net_activation: f of eq. 13, applied to every input of a fast weight matrix (its query):
            "softmax" (default): the paper's choice (sec. 3.1: "we apply the softmax activation f to the vectors to
            be used as a query", positive and summing to one as the delta rule needs). Keys still go through the
            config's feature map, which must then keep head_dim (elu, relu or identity; the paper assumes
            phi: R^d_key -> R^d_key, sec. 2.2).
            "feature_map": the config's feature map and sum normalisation (ELU+1 then sum normalisation by
            default), what the official code (IDSIA/recurrent-fwp, ``CudaDeepFastNetLayer``) applies instead of
            the softmax; it takes every feature map.
            The default is the paper's: no pretrained Delta MLP checkpoint exists whose behaviour it would change.
    """

    model_type = "fwp_delta_mlp"
    fast_weight_layer = "delta_mlp"
    fast_net_depth: int = 1
    fast_net_activation: str = "softmax"

    def __post_init__(self, **kwargs):
        if not isinstance(self.fast_net_depth, int) or self.fast_net_depth < 1:
            raise ValueError(f"`fast_net_depth` must be an int >= 1, got {self.fast_net_depth!r}")
        if self.fast_net_activation not in FAST_NET_ACTIVATIONS:
            raise ValueError(
                f"`fast_net_activation` must be one of {FAST_NET_ACTIVATIONS}, got {self.fast_net_activation!r}"
            )
        super().__post_init__(**kwargs)
        if self.fast_net_activation == "softmax" and self.feature_dim != self.head_dim:
            raise ValueError(
                f"`fast_net_activation`='softmax' reads the fast weights with head_dim-sized queries, so "
                f"`feature_map` must keep head_dim (elu, relu or identity), got {self.feature_map!r} (dimension "
                f"{self.feature_dim}); use fast_net_activation='feature_map' with it"
            )


class DeltaDeltaNetConfig(RecurrentFastWeightConfig):
    """Delta-Delta Net (appendix A.3): a Delta Net whose slow net delta-programs a fast net that produces the
    queries, keys, values and beta of a second Delta Net."""

    model_type = "fwp_delta_delta_net"
    fast_weight_layer = "delta_delta_net"


class DeltaRNNConfig(RecurrentFastWeightConfig):
    """Delta RNN (eq. 12, version B; eq. 19, version A): y_t = W_t q_t + R_t f(y_{t-1}), f = softmax, with a second
    delta-rule fast weight R_t programmed by its own slow keys/values/betas.

    ``kernel_mode``: W runs the delta rule, R the scan; "chunk" makes W chunkwise, "fused" the scan compiled, each
    leaving the other recurrence on "auto".
    """

    model_type = "fwp_delta_rnn"
    fast_weight_layer = "delta_rnn"
    kernel_modes = ("auto", "recurrent", "chunk", "fused")
    versions = ("A", "B")
    version: str = "B"


class DeltaLSTMConfig(RecurrentFastWeightConfig):
    """Delta LSTM (appendix A.2, eqs. 20-40, versions A-D; D is the paper's main model): six delta-rule fast
    weight matrices (feedforward and recurrent, for the input gate, update and output gate), tied input/forget gate.

    ``kernel_mode``: as the Delta RNN's ("chunk": the feedforward fast weights chunkwise; "fused": the scan compiled).
    """

    model_type = "fwp_delta_lstm"
    fast_weight_layer = "delta_lstm"
    kernel_modes = ("auto", "recurrent", "chunk", "fused")
    versions = ("A", "B", "C", "D")
    version: str = "D"


class RecurrentDeltaNetConfig(RecurrentFastWeightConfig):
    """Recurrent Delta Net (eqs. 15-18): the slow net's keys, queries, values and betas also read tanh(y_{t-1})
    through per-head slow recurrent matrices; keys and queries are softmaxes (the only feature map it takes).

    Its only recurrence is one scan (``fwp_kernels.recurrent_delta_rule``), so ``kernel_mode`` is "auto",
    "recurrent" or "fused" ("chunk": it has no chunkwise form), and it builds no feature map. Unused, accepted only
    at their defaults: ``chunk_size`` (64), ``dpfp_nu`` (1), ``favor_features`` (64) and ``sum_normalization``
    (None or True: a softmax is sum-normalised by construction, eq. 29 applied to exp; False cannot hold).
    """

    model_type = "fwp_recurrent_delta_net"
    fast_weight_layer = "recurrent_delta_net"
    supported_feature_maps = ("softmax",)
    kernel_modes = SCAN_KERNEL_MODES
    unused_fields = {"chunk_size": (64,), "dpfp_nu": (1,), "favor_features": (64,), "sum_normalization": (None, True)}
    feature_map: str = "softmax"
