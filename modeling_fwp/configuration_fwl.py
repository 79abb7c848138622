"""Configuration of ``FWLForCausalLM``: a Fast Weight Layer head (Clark et al. 2022) on any causal LM.

``FWLHeadConfigMixin`` is the FWL's own block of fields, shared by ``FWLConfig`` and ``TransfoXLConfig`` (one set of
names and defaults, one validation).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from transformers import AutoConfig, PreTrainedConfig
from transformers.configuration_utils import SubConfigSpec

from .configuration_fwp import check_sizes

KERNEL_MODES = ("auto", "recurrent", "chunk")
GRADIENT_DTYPES = (None, "bfloat16", "float16", "float32", "float64")
# Which vocabulary rows the output layer's fast update may change: all (the paper), or those of the tokens seen so far.
FAST_VOCABULARIES = ("full", "seen")
# Where the per-token gradients of the fast update are taken: at the slow weights (the paper), or at the fast weights
# the update has reached by the start of the token's segment (``fwl_segment_length``).
GRADIENT_POINTS = ("slow", "segment_start")

# The parameters of the FWL's MLP and LayerNorm (everything before the output layer).
HIDDEN_PARAMETERS = (
    "up_proj.weight",
    "up_proj.bias",
    "down_proj.weight",
    "down_proj.bias",
    "norm.weight",
    "norm.bias",
)
# Every name that can get fast weights: the hidden parameters and a dense output layer's E, E's bias and c.
FAST_PARAMETER_NAMES = HIDDEN_PARAMETERS + ("output_embedding.weight", "output_embedding.bias", "output_bias")
# The paper's default: every parameter of the FWL's MLP and LayerNorm gets fast weights; the output embedding E
# (shared with the base model) and the output bias c stay slow. ``["output_bias"]`` is the paper's "bias only"
# ablation.
DEFAULT_FAST_PARAMETERS = HIDDEN_PARAMETERS
# ``fwl_head_type="output"``: the FWL is the base model's own output side, made fast: its final norm's gain, an
# untied copy of its output embedding E and a fresh output bias c (test-time-only FWL, Clark et al. 2022 Table 2).
OUTPUT_SIDE_FAST_PARAMETERS = ("norm.weight", "output_embedding.weight", "output_bias")
HEAD_TYPES = ("mlp", "output")


@dataclass(kw_only=True)
class FWLHeadConfigMixin:
    r"""The fields of a Fast Weight Layer head (Clark et al., EMNLP 2022), shared by every config that has one.

    Args:
        fwl_intermediate_size: width of the FWL's hidden layer (U is ``[hidden_size, fwl_intermediate_size]``).
            None: the model's ``hidden_size``.
        fwl_fast_parameters: names (as in ``fwl_head.slow.named_parameters()``) that get fast weights: any of
            ``up_proj.weight`` (U), ``up_proj.bias`` (a), ``down_proj.weight`` (W), ``down_proj.bias`` (b),
            ``norm.weight``, ``norm.bias`` (the LayerNorm gain and bias) and, with a dense output layer,
            ``output_embedding.weight`` (E), ``output_embedding.bias``, ``output_bias`` (c). None: the MLP and
            LayerNorm parameters (the paper's default).
        fwl_output_bias: give the head its own output bias c (initialised to zero; dense output layers only).
        fwl_residual: the output layer reads ``h + f(h)`` instead of ``f(h)``. With it the LayerNorm gain starts at
            zero, so a freshly attached head reproduces the base model's outputs exactly (fine-tuning a pretrained
            model for few steps); without it (the paper's form) the gain starts at one.
        fwl_step_size_init: initial value of every learned step size alpha (alpha = softplus(raw) > 0).
        fwl_decay_init: None (no decay: the fast update keeps growing over the whole text) or the initial learned
            decay gamma in (0, 1) of the carried update at segment boundaries, ``Delta <- gamma Delta +
            stopgrad(sum of the segment's gradients)`` (Clark et al. sec. 3; gamma = sigmoid(raw), one per fast
            parameter).
        fwl_segment_length: with a decay, the carried update decays once per this many tokens (at the start of the
            first forward call that begins at or past the boundary); None: once per forward call that continues from
            a cache (one call = one segment, the papers' evaluation protocol). With
            ``fwl_gradient_point="segment_start"``: the length of the segments whose starts are the gradient points
            (counted in positions from the start of the text, however the text is split into forward calls; left
            padding counts, so padding by a multiple of the segment length leaves the results unchanged).
        fwl_layer_norm_eps: epsilon of the FWL LayerNorm.
        fwl_kernel_mode, fwl_chunk_size: forwarded to ``fwp_kernels.linear_attention`` (the chunk size changes the
            results only by float rounding).
        fwl_gradient_dtype: None (exact) or a dtype name ("bfloat16") in which the vocabulary-sized part of the
            per-token gradients is computed (slow logits, softmax, dlogits E): an approximation of the fast weight
            update that runs about 2.5x faster on CPUs with bf16 matrix units (dense output layers only).
        fwl_gradient_point: "slow" (the paper: every per-token gradient at the slow weights) or "segment_start":
            the gradient of position j taken at the fast weights as of the start of j's segment (the slow weights
            minus alpha times the gradients of every earlier segment), so that the fast weights keep accumulating
            across segments as dynamic evaluation's do; within a segment the paper's update. Not in Clark et al.;
            needs ``fwl_segment_length`` and only output-layer parameters fast (E, its bias, c), without decay or
            ``fwl_gradient_dtype``; with ``fwl_fast_vocabulary="seen"`` each gradient at the segment start is kept
            on the seen rows as with the paper's point. Costs one more vocabulary-sized product per
            position (the read of the segment start's sums) in calls that do not begin a segment; in those that do
            (scoring in calls of ``fwl_segment_length``) the fast pass shares it.
        fwl_fast_vocabulary: "full" (the paper: dCE/dz over the whole vocabulary) or "seen": the output layer's
            per-token gradient kept on the rows of the tokens seen so far only (position j, whose label is
            x_{j+1}, updates the rows of x_0 .. x_{j+1}; padding counts as no token): the fast E and output biases
            then change only where the text has been, and their products touch only those rows (a few thousand of
            a 49,152-token vocabulary in a long document). Not in Clark et al.: an approximation that keeps the
            update's push towards repeated tokens and drops its push away from unseen ones. The hidden layer's
            gradients stay exact.
    """

    fwl_intermediate_size: Optional[int] = None
    fwl_fast_parameters: Optional[list[str]] = None
    fwl_output_bias: bool = True
    fwl_residual: bool = False
    fwl_step_size_init: float = 1e-3
    fwl_decay_init: Optional[float] = None
    fwl_segment_length: Optional[int] = None
    fwl_layer_norm_eps: float = 1e-5
    fwl_kernel_mode: str = "auto"
    fwl_chunk_size: int = 256
    fwl_gradient_dtype: Optional[str] = None
    fwl_fast_vocabulary: str = "full"
    fwl_gradient_point: str = "slow"

    def resolve_fwl_fields(self, hidden_size: int) -> None:
        """Fills the None defaults that depend on the model (``fwl_intermediate_size``, ``fwl_fast_parameters``) and
        validates every FWL field; a bad value raises a ValueError (TypeError for a wrong type) naming the field."""
        if self.fwl_intermediate_size is None:
            self.fwl_intermediate_size = hidden_size
        if self.fwl_fast_parameters is None:
            self.fwl_fast_parameters = list(DEFAULT_FAST_PARAMETERS)
        names = self.fwl_fast_parameters
        if isinstance(names, str) or not all(isinstance(name, str) for name in names):
            raise TypeError(f"`fwl_fast_parameters` must be a list of parameter names, got {names!r}")
        self.fwl_fast_parameters = list(names)
        unknown = [name for name in names if name not in FAST_PARAMETER_NAMES]
        if unknown:
            raise ValueError(
                f"`fwl_fast_parameters` names {unknown}, which are not FWL parameters; known: "
                f"{list(FAST_PARAMETER_NAMES)}"
            )
        if len(set(names)) != len(names):
            raise ValueError(f"`fwl_fast_parameters` lists a name twice: {names}")
        checks = {
            "fwl_intermediate_size": (self.fwl_intermediate_size >= 1, ">= 1"),
            "fwl_step_size_init": (self.fwl_step_size_init > 0, "> 0 (step sizes are positive)"),
            "fwl_decay_init": (self.fwl_decay_init is None or 0.0 < self.fwl_decay_init < 1.0, "None or in (0, 1)"),
            "fwl_segment_length": (self.fwl_segment_length is None or self.fwl_segment_length >= 1, "None or >= 1"),
            "fwl_layer_norm_eps": (self.fwl_layer_norm_eps > 0, "> 0"),
            "fwl_kernel_mode": (self.fwl_kernel_mode in KERNEL_MODES, f"one of {KERNEL_MODES}"),
            "fwl_chunk_size": (self.fwl_chunk_size >= 1, ">= 1"),
            "fwl_gradient_dtype": (self.fwl_gradient_dtype in GRADIENT_DTYPES, f"one of {GRADIENT_DTYPES}"),
            "fwl_fast_vocabulary": (self.fwl_fast_vocabulary in FAST_VOCABULARIES, f"one of {FAST_VOCABULARIES}"),
            "fwl_gradient_point": (self.fwl_gradient_point in GRADIENT_POINTS, f"one of {GRADIENT_POINTS}"),
        }
        for field, (valid, requirement) in checks.items():
            if not valid:
                raise ValueError(f"`{field}` must be {requirement}, got {getattr(self, field)!r}")
        segments = self.fwl_decay_init is not None or self.fwl_gradient_point == "segment_start"
        if self.fwl_segment_length is not None and not segments:
            raise ValueError("`fwl_segment_length` sets where the carried update decays or where the gradients are "
                             "taken: it needs `fwl_decay_init` or `fwl_gradient_point='segment_start'`")
        if self.fwl_gradient_point == "segment_start" and self.fwl_segment_length is None:
            raise ValueError("`fwl_gradient_point='segment_start'` needs `fwl_segment_length` (tokens per segment)")


class FWLConfig(FWLHeadConfigMixin, PreTrainedConfig):
    r"""Configuration of a Fast Weight Layer head on a causal LM (Clark et al., EMNLP 2022, sec. 2).

    The head computes ``f(h) = LayerNorm(ReLU(h U + a)^2 W + b)`` and ``logits = f(h) E^T + c`` on the base model's
    last hidden states ``h``, where E is the base model's output embedding, and updates its fast parameters at
    every position with a learned-step-size gradient step on the losses of all earlier positions.

    Args:
        text_config: config of the wrapped causal LM (any ``AutoModelForCausalLM`` architecture; a dict with a
            ``model_type`` or a config instance).
        fwl_*: the FWL head's fields (``FWLHeadConfigMixin``).
        initializer_range: std of the normal initialisation of U and W.
        base_model_id: the base model's Hub id, recorded by ``from_base_pretrained`` (see :func:`base_model_hub_id`).
        fwl_head_type: "mlp" (the paper's FWL: a fresh MLP and LayerNorm before the base's output embedding) or
            "output" (no new layer: the base model's final norm moves into the head and the head gets an untied copy
            of the output embedding, so that the wrapped model starts exactly at its base; the fast parameters
            default to ``OUTPUT_SIDE_FAST_PARAMETERS``; ``fwl_intermediate_size`` and ``fwl_residual`` are unused).
            With "output" and the step sizes set (``training.test_time_fwl``), an untrained pretrained model gets the
            FWL's fast update at inference: the test-time-only FWL.
    """

    model_type = "fwp_fwl"
    keys_to_ignore_at_inference = ["cache", "past_key_values"]
    sub_configs_defaults = {"text_config": SubConfigSpec(config_class=AutoConfig, model_type="llama")}

    text_config: dict | PreTrainedConfig | None = None
    initializer_range: float = 0.02
    # The base model's Hub id as recorded when it was loaded (``FWLForCausalLM.from_base_pretrained``): model cards
    # name it; None for a base read from a local folder that records no Hub id.
    base_model_id: str | None = None
    fwl_head_type: str = "mlp"

    use_cache: bool = True
    # The FWL head always reuses the base model's output embedding: declared tied so that save_pretrained
    # stores it once.
    tie_word_embeddings: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        text = self.text_config
        check_sizes(text, ("vocab_size", "hidden_size"), owner="text_config.")
        if self.fwl_head_type not in HEAD_TYPES:
            raise ValueError(f"`fwl_head_type` must be one of {HEAD_TYPES}, got {self.fwl_head_type!r}")
        if self.fwl_head_type == "output":
            if self.fwl_fast_parameters is None:
                self.fwl_fast_parameters = list(OUTPUT_SIDE_FAST_PARAMETERS)
            if self.fwl_residual:
                raise ValueError("`fwl_residual` adds h to the FWL's MLP output; `fwl_head_type='output'` has no MLP")
        self.resolve_fwl_fields(text.hidden_size)
        # Generation reads the special tokens from the top-level config: take the base model's.
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            if getattr(self, name) is None:
                setattr(self, name, getattr(text, name, None))

    @property
    def vocab_size(self) -> int:
        return self.text_config.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.text_config.hidden_size
