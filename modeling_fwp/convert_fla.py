"""Convert a flash-linear-attention (fla 0.6) ``delta_net`` or ``gated_deltanet`` checkpoint into this package's models.

Input: a folder as fla's ``save_pretrained`` (or the Hub) has it: ``config.json`` (model type "delta_net" or
"gated_deltanet") and ``model.safetensors`` or shards with ``model.safetensors.index.json``; tokenizer files and a
README are copied / read when present. Output: a folder ``AutoModelForCausalLM.from_pretrained`` loads as
``DeltaNetForCausalLM`` / ``GatedDeltaNetForCausalLM`` (with this package, or with ``trust_remote_code=True`` from the
code saved beside the weights), in the checkpoint's dtype or the one asked for. The config records where the weights
came from (``pretrained_source``), which ``model_cards`` states on the card.

fla's layer, read from fla 0.6.0 (``fla/layers/delta_net.py``, ``fla/layers/gated_deltanet.py``) -> our options:

    q_proj, k_proj, v_proj (no bias)                 the same names; head_dim = hidden * expand_k / heads
    {q,k,v}_conv1d: ShortConvolution, no bias        short_conv_size = conv_size (SiLU on q, k only for qk_activation
                                                     "silu": our feature_map "silu" after the convolution)
    v: SiLU always (after the convolution)           value_activation = "silu"
    qk_activation silu / relu / elu (ELU+1) / identity   feature_map of the same name
    qk_norm "l2" (in the kernel: x / sqrt(|x|^2 + 1e-6)) qk_l2_normalization; "sum" (L1, for non-negative maps):
                                                     sum_normalization
    q scaled by head_k_dim^-1/2 (the kernel's default)   query_scaling
    b_proj (no bias), sigmoid, x2 with allow_neg_eigval  beta_proj, beta_bias=False, allow_neg_eigval
    o_norm: RMSNorm per head (always), gated with use_gate (g_proj, swish)   output_norm, output_gate
    attn_norm / mlp_norm / norm: RMSNorm(norm_eps)   norm_type="rms_norm", layer_norm_eps = norm_eps
    mlp: gate_proj, up_proj, down_proj, swish, no bias   feed_forward_type="swiglu"; intermediate_size as fla rounds
                                                     it (2/3 * hidden_ratio * hidden, up to a multiple of 256)
    Gated DeltaNet: a_proj, A_log, dt_bias, num_v_heads, head_v_dim = head_dim * expand_v   the same names / fields

Key renames (``model.`` prefixes kept)::

    model.embeddings                       model.embed_tokens
    model.layers.{l}.attn_norm             model.layers.{l}.fast_weight_norm
    model.layers.{l}.attn.b_proj           model.layers.{l}.fast_weight.beta_proj
    model.layers.{l}.attn.*                model.layers.{l}.fast_weight.*
    model.layers.{l}.mlp_norm              model.layers.{l}.ff_norm
    model.layers.{l}.mlp.*                 model.layers.{l}.feed_forward.*

Refused with a ValueError naming the field: hybrid attention layers (``attn``), ``attnres_block_size``,
``use_beta=False``, ``hidden_act`` other than swish, a short convolution with bias, ``qk_norm="sum"`` with a feature
map that can be negative.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Dict, Optional, Union

import torch
from safetensors import safe_open

from .configuration_fwp import DeltaNetConfig, FastWeightConfig, GatedDeltaNetConfig
from .modeling_fwp import DeltaNetForCausalLM, FastWeightForCausalLM, GatedDeltaNetForCausalLM

PathLike = Union[str, Path]

FLA_VERSION = "0.6.0"
FLA_LICENSE = "mit"  # flash-linear-attention's own license, under which fla-hub publishes its checkpoints
FLA_HUB_OWNER = "fla-hub"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "generation_config.json")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_KEY_RENAMES = (
    (r"^model\.embeddings\.", "model.embed_tokens."),
    (r"^model\.layers\.(\d+)\.attn_norm\.", r"model.layers.\1.fast_weight_norm."),
    (r"^model\.layers\.(\d+)\.attn\.b_proj\.", r"model.layers.\1.fast_weight.beta_proj."),
    (r"^model\.layers\.(\d+)\.attn\.", r"model.layers.\1.fast_weight."),
    (r"^model\.layers\.(\d+)\.mlp_norm\.", r"model.layers.\1.ff_norm."),
    (r"^model\.layers\.(\d+)\.mlp\.", r"model.layers.\1.feed_forward."),
)
_QK_ACTIVATIONS = {"silu": "silu", "relu": "relu", "elu": "elu", "identity": "identity"}
_GATE_ACTIVATIONS = {"swish": "silu", "silu": "silu", "sigmoid": "sigmoid"}


def fla_intermediate_size(fla: dict) -> int:
    """fla's ``GatedMLP`` width: ``intermediate_size``, else 2/3 of ``hidden_ratio`` (default 4) times the hidden size,
    rounded up to a multiple of 256."""
    if fla.get("intermediate_size") is not None:
        return int(fla["intermediate_size"])
    ratio = fla.get("hidden_ratio") or 4
    size = int(fla["hidden_size"] * ratio * 2 / 3)
    return 256 * ((size + 255) // 256)


def _refuse_unsupported(fla: dict) -> None:
    checks = (
        ("attn", fla.get("attn") is None, "hybrid attention layers are not converted"),
        ("attnres_block_size", fla.get("attnres_block_size") is None, "attention residuals are not converted"),
        ("use_beta", fla.get("use_beta", True), "a Delta Net without beta is not converted"),
        ("hidden_act", fla.get("hidden_act", "swish") == "swish", "only the SwiGLU MLP ('swish') is converted"),
        ("conv_bias", not fla.get("conv_bias", False), "the short convolution has no bias here"),
    )
    for name, ok, why in checks:
        if not ok:
            raise ValueError(f"fla config field `{name}`={fla.get(name)!r}: {why}")


def _common_fields(fla: dict) -> dict:
    """The fields both fla families share, as our config's."""
    return dict(
        vocab_size=fla["vocab_size"], hidden_size=fla["hidden_size"], num_hidden_layers=fla["num_hidden_layers"],
        num_attention_heads=fla["num_heads"], intermediate_size=fla_intermediate_size(fla), hidden_act="silu",
        layer_norm_eps=fla.get("norm_eps", 1e-6), norm_type="rms_norm", feed_forward_type="swiglu",
        short_conv_size=fla.get("conv_size", 4) if fla.get("use_short_conv", True) else 0, value_activation="silu",
        query_scaling=True, beta_bias=False, allow_neg_eigval=bool(fla.get("allow_neg_eigval", False)),
        output_norm=True, tie_word_embeddings=bool(fla.get("tie_word_embeddings", False)),
        initializer_range=fla.get("initializer_range", 0.02), update_rule="delta", attention_normalization=False,
        pad_token_id=fla.get("pad_token_id"), bos_token_id=fla.get("bos_token_id"),
        eos_token_id=fla.get("eos_token_id"),
    )


def config_from_fla(fla: dict) -> FastWeightConfig:
    """Our ``DeltaNetConfig`` / ``GatedDeltaNetConfig`` for an fla ``config.json`` (a dict)."""
    model_type = fla.get("model_type")
    if model_type not in ("delta_net", "gated_deltanet"):
        raise ValueError(f"`model_type` of the fla config must be 'delta_net' or 'gated_deltanet', got {model_type!r}")
    _refuse_unsupported(fla)
    fields = _common_fields(fla)
    heads = fla["num_heads"]
    if model_type == "gated_deltanet":
        head_dim = fla.get("head_dim", 256)
        value_head_dim = head_dim * fla.get("expand_v", 2.0)
        if value_head_dim != int(value_head_dim):
            raise ValueError(f"fla config field `expand_v`={fla.get('expand_v')!r}: head_dim * expand_v not an integer")
        activation = fla.get("output_gate_activation", "swish")
        if activation not in _GATE_ACTIVATIONS:
            raise ValueError(f"fla config field `output_gate_activation`={activation!r}: not one of "
                             f"{list(_GATE_ACTIVATIONS)}")
        return GatedDeltaNetConfig(
            **fields, head_dim=head_dim, value_head_dim=int(value_head_dim),
            num_v_heads=fla.get("num_v_heads") or heads,
            feature_map="silu", qk_l2_normalization=True, sum_normalization=False,
            output_gate=bool(fla.get("use_gate", True)), output_gate_activation=_GATE_ACTIVATIONS[activation],
        )
    key_dim, value_dim = fla["hidden_size"] * fla.get("expand_k", 1.0), fla["hidden_size"] * fla.get("expand_v", 1.0)
    if key_dim % heads or value_dim % heads or key_dim != int(key_dim) or value_dim != int(value_dim):
        raise ValueError(f"fla config fields `expand_k`/`expand_v`: {key_dim} and {value_dim} must divide by num_heads "
                         f"{heads}")
    activation, qk_norm = fla.get("qk_activation", "silu"), fla.get("qk_norm", "l2")
    if activation not in _QK_ACTIVATIONS or qk_norm not in ("l2", "sum"):
        raise ValueError(f"fla config fields `qk_activation`={activation!r} / `qk_norm`={qk_norm!r}: not converted")
    if qk_norm == "sum" and activation not in ("relu", "elu"):
        raise ValueError(f"fla config field `qk_norm`='sum' with qk_activation={activation!r} (can be negative): our "
                         f"sum normalisation needs a non-negative feature map")
    return DeltaNetConfig(
        **fields, head_dim=int(key_dim) // heads, value_head_dim=int(value_dim) // heads,
        feature_map=_QK_ACTIVATIONS[activation], qk_l2_normalization=qk_norm == "l2",
        sum_normalization=qk_norm == "sum", output_gate=bool(fla.get("use_gate", False)),
    )


def rename_key(key: str) -> str:
    """fla's parameter name -> ours (see the module docstring)."""
    for pattern, replacement in _KEY_RENAMES:
        new, count = re.subn(pattern, replacement, key)
        if count:
            return new
    return key


def load_fla_state_dict(src: PathLike) -> Dict[str, torch.Tensor]:
    """Every tensor of ``model.safetensors`` or of the shards ``model.safetensors.index.json`` lists."""
    src = Path(src)
    index = src / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (src / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise ValueError(f"`src_dir` ({src}) has no model.safetensors nor model.safetensors.index.json (only "
                         f"safetensors checkpoints are converted)")
    state = {}
    for name in files:
        with safe_open(src / name, framework="pt") as handle:
            state.update({key: handle.get_tensor(key) for key in handle.keys()})
    return state


def _readme_license(src: Path) -> Optional[str]:
    """The ``license:`` of the README's YAML front matter, when there is one."""
    readme = src / "README.md"
    if not readme.is_file():
        return None
    match = re.match(r"^---\s*\n(.*?)\n---", readme.read_text(encoding="utf-8", errors="replace"), re.S)
    found = re.search(r"^license:\s*['\"]?([^\s'\"]+)", match.group(1), re.M) if match else None
    return found.group(1) if found else None


def _hub_location(src: Path) -> tuple:
    """``(repo id, revision)`` when ``src`` is a snapshot of the Hugging Face cache
    (``models--owner--name/snapshots/<revision>``), else ``(None, None)``."""
    parts = src.resolve().parts
    for i, part in enumerate(parts[:-2]):
        if part.startswith("models--") and parts[i + 1] == "snapshots":
            return part[len("models--"):].replace("--", "/"), parts[i + 2]
    return None, None


def source_record(src: Path, fla: dict, repo_id: Optional[str], dtype: torch.dtype) -> dict:
    """What ``config.pretrained_source`` records: where the weights came from, their license and where that license
    was found (``license_source``, a phrase the card prints after the license), how they were converted."""
    cached_repo, revision = _hub_location(src)
    repo_id = repo_id or cached_repo
    license_name, license_source = _readme_license(src), "as stated in the README of the weights' repository"
    if license_name is None and fla.get("license"):
        license_name, license_source = str(fla["license"]), "as stated in the config.json of the weights' repository"
    if license_name is None and repo_id and repo_id.split("/")[0] == FLA_HUB_OWNER:
        license_name, license_source = FLA_LICENSE, (
            "not stated by the weights' repository; inferred from flash-linear-attention's code license (MIT), as "
            "fla-hub publishes fla's models")
    return {
        "repo_id": repo_id, "revision": revision, "path": str(src), "library": f"flash-linear-attention {FLA_VERSION}",
        "model_type": fla["model_type"], "license": license_name,
        "license_source": license_source if license_name else None,
        "conversion": f"modeling_fwp.convert_fla.convert_fla_checkpoint (keys renamed, b_proj -> beta_proj; values "
                      f"unchanged{'' if dtype is None else ', cast to ' + str(dtype).replace('torch.', '')})",
    }


def convert_fla_checkpoint(
    src_dir: PathLike, dst_dir: PathLike, dtype: Union[None, str, torch.dtype] = None, repo_id: Optional[str] = None
) -> FastWeightForCausalLM:
    """Converts the fla checkpoint folder ``src_dir`` into ``dst_dir`` (see the module docstring) and returns the model.

    Args:
        src_dir: fla's folder (config.json + safetensors).
        dst_dir: the output folder (created).
        dtype: None keeps the checkpoint's dtype; "float32", "bfloat16", "float16" (or a torch dtype) casts.
        repo_id: the Hub id the weights came from, for the card (found by itself in a Hugging Face cache snapshot).
    """
    src, dst = Path(src_dir), Path(dst_dir)
    if not (src / "config.json").is_file():
        raise ValueError(f"`src_dir` ({src}) has no config.json")
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"`dtype` must be one of {list(DTYPES)} (or None: the checkpoint's), got {dtype!r}")
        dtype = DTYPES[dtype]
    fla = json.loads((src / "config.json").read_text())
    config = config_from_fla(fla)
    state = {rename_key(key): value for key, value in load_fla_state_dict(src).items()}
    floats = [t.dtype for t in state.values() if t.is_floating_point()]
    target = dtype or max(set(floats), key=floats.count)
    state = {key: t.to(target) if t.is_floating_point() else t for key, t in state.items()}
    config.pretrained_source = source_record(src, fla, repo_id, dtype)
    config.dtype = target
    model_class = GatedDeltaNetForCausalLM if isinstance(config, GatedDeltaNetConfig) else DeltaNetForCausalLM
    with torch.device("meta"):
        model = model_class(config)
    if config.tie_word_embeddings:
        state.setdefault("lm_head.weight", state["model.embed_tokens.weight"])
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        raise ValueError(f"`src_dir` ({src}): the checkpoint does not match the converted config: missing {missing}, "
                         f"unexpected {unexpected}")
    if config.tie_word_embeddings:
        model.tie_weights()
    model.eval()
    dst.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dst)
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
    return model


if __name__ == "__main__":
    # The command lives in the scripts' package, which also writes the model card (this package cannot: it never imports
    # model_cards).
    raise SystemExit("use `fwp-convert-fla --src_dir <fla folder> --output_dir <folder>` (from the repository root "
                     "without installing: `python -m training.convert_fla ...`), which also writes the model card")
