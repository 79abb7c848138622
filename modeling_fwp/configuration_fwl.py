"""Configuration of ``FWLForCausalLM``: a Fast Weight Layer head (Clark et al. 2022) on any causal LM."""
from __future__ import annotations

from transformers import AutoConfig, PreTrainedConfig
from transformers.configuration_utils import SubConfigSpec

KERNEL_MODES = ("auto", "recurrent", "chunk")
GRADIENT_DTYPES = (None, "bfloat16", "float16", "float32", "float64")

# The paper's default: every parameter of the FWL's MLP and LayerNorm gets fast weights; the output embedding E
# (shared with the base model) and the output bias c stay slow. ``["output_bias"]`` is the paper's "bias only"
# ablation.
DEFAULT_FAST_PARAMETERS = (
    "up_proj.weight",
    "up_proj.bias",
    "down_proj.weight",
    "down_proj.bias",
    "norm.weight",
    "norm.bias",
)


class FWLConfig(PreTrainedConfig):
    r"""Configuration of a Fast Weight Layer head on a causal LM (Clark et al., EMNLP 2022, sec. 2).

    The head computes ``f(h) = LayerNorm(ReLU(h U + a)^2 W + b)`` and ``logits = f(h) E^T + c`` on the base model's
    last hidden states ``h``, where E is the base model's output embedding, and updates its fast parameters at
    every position with a learned-step-size gradient step on the losses of all earlier positions.

    Args:
        text_config: config of the wrapped causal LM (any ``AutoModelForCausalLM`` architecture; a dict with a
            ``model_type`` or a config instance).
        fwl_intermediate_size: width of the FWL's hidden layer (the paper's U is ``[hidden_size, fwl_intermediate_size]``).
            None: the base model's ``hidden_size``.
        fwl_fast_parameters: names (as in ``FWLForCausalLM.fwl_head.slow.named_parameters()``) that get fast
            weights: any of ``up_proj.weight`` (U), ``up_proj.bias`` (a), ``down_proj.weight`` (W), ``down_proj.bias``
            (b), ``norm.weight``, ``norm.bias`` (the LayerNorm gain and bias), ``output_embedding.weight`` (E),
            ``output_bias`` (c). None: the MLP and LayerNorm parameters (the paper's default).
        fwl_output_bias: give the head its own output bias c (initialised to zero).
        fwl_residual: ``logits = (h + f(h)) E^T + c`` instead of ``f(h) E^T + c``. With it the LayerNorm gain starts at
            zero, so a freshly attached head reproduces the base model's logits exactly (useful when fine-tuning a
            pretrained model for few steps); without it (the paper's form) the gain starts at one.
        fwl_step_size_init: initial value of every learned step size alpha (alpha = softplus(raw) > 0).
        fwl_layer_norm_eps: epsilon of the FWL LayerNorm.
        fwl_kernel_mode, fwl_chunk_size: forwarded to ``fwp_kernels.linear_attention``.
        fwl_gradient_dtype: None (exact) or a dtype name ("bfloat16") in which the vocabulary-sized part of the per-token
            gradients is computed (slow logits, softmax, dlogits E): an approximation of the fast weight update that
            runs about 2.5x faster on CPUs with bf16 matrix units; the output logits keep the model's dtype.
        initializer_range: std of the normal initialisation of U and W.
    """

    model_type = "fwp_fwl"
    keys_to_ignore_at_inference = ["cache", "past_key_values"]
    sub_configs_defaults = {"text_config": SubConfigSpec(config_class=AutoConfig, model_type="llama")}

    text_config: dict | PreTrainedConfig | None = None
    fwl_intermediate_size: int | None = None
    fwl_fast_parameters: list[str] | None = None
    fwl_output_bias: bool = True
    fwl_residual: bool = False
    fwl_step_size_init: float = 1e-3
    fwl_layer_norm_eps: float = 1e-5
    fwl_kernel_mode: str = "auto"
    fwl_chunk_size: int = 256
    fwl_gradient_dtype: str | None = None
    initializer_range: float = 0.02

    use_cache: bool = True
    # The FWL head always reuses the base model's output embedding: declared tied so that save_pretrained stores it once.
    tie_word_embeddings: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        text = self.text_config
        if self.fwl_intermediate_size is None:
            self.fwl_intermediate_size = text.hidden_size
        if self.fwl_fast_parameters is None:
            self.fwl_fast_parameters = list(DEFAULT_FAST_PARAMETERS)
        if isinstance(self.fwl_fast_parameters, str) or not all(isinstance(n, str) for n in self.fwl_fast_parameters):
            raise TypeError(f"`fwl_fast_parameters` must be a list of parameter names, got {self.fwl_fast_parameters!r}")
        self.fwl_fast_parameters = list(self.fwl_fast_parameters)
        if self.fwl_intermediate_size < 1:
            raise ValueError(f"`fwl_intermediate_size` must be >= 1, got {self.fwl_intermediate_size}")
        if not self.fwl_step_size_init > 0:
            raise ValueError(f"`fwl_step_size_init` must be > 0 (step sizes are positive), got {self.fwl_step_size_init}")
        if self.fwl_kernel_mode not in KERNEL_MODES:
            raise ValueError(f"`fwl_kernel_mode` must be one of {KERNEL_MODES}, got {self.fwl_kernel_mode!r}")
        if self.fwl_gradient_dtype not in GRADIENT_DTYPES:
            raise ValueError(f"`fwl_gradient_dtype` must be one of {GRADIENT_DTYPES}, got {self.fwl_gradient_dtype!r}")
        if self.fwl_chunk_size < 1:
            raise ValueError(f"`fwl_chunk_size` must be >= 1, got {self.fwl_chunk_size}")
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
