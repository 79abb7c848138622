"""Convert a transformers-4 Transformer-XL checkpoint (``transfo-xl-wt103`` style) into ``TransfoXLForCausalLM``.

Input folder: ``config.json`` (transformers-4 ``TransfoXLConfig``) and ``pytorch_model.bin`` (a plain state dict, read
with ``torch.load(weights_only=True)``: nothing but tensors is ever unpickled) or ``model.safetensors``; optionally a
vocabulary for the word-level tokenizer (see ``load_vocabulary``). Output folder: ``config.json`` (model type
``fwp_transfo_xl``), ``model.safetensors``, and, when a vocabulary was found, ``tokenizer.json`` +
``tokenizer_config.json`` (a ``PreTrainedTokenizerFast`` over a ``tokenizers`` WordLevel model).

Key layout (transformers 4 -> here)::

    transformer.word_emb.emb_layers.{i}.weight        model.word_embeddings.layers.{i}.weight
    transformer.word_emb.emb_projs.{i}                model.word_embeddings.projections.{i}.weight
    transformer.layers.{l}.dec_attn.qkv_net.weight    model.layers.{l}.attention.qkv_proj.weight
    transformer.layers.{l}.dec_attn.r_net.weight      model.layers.{l}.attention.pos_proj.weight
    transformer.layers.{l}.dec_attn.o_net.weight      model.layers.{l}.attention.o_proj.weight
    transformer.layers.{l}.dec_attn.layer_norm.*      model.layers.{l}.attention_norm.*
    transformer.layers.{l}.dec_attn.r_{w,r}_bias      model.layers.{l}.attention.r_{w,r}_bias     (untie_r)
    transformer.r_{w,r}_bias  [H, Dh]                 model.r_{w,r}_bias (shared) / every layer's (untie_r)
    transformer.r_{w,r}_bias  [L, H, Dh]              model.layers.{l}.attention.r_{w,r}_bias      (TF-era layout)
    transformer.layers.{l}.pos_ff.CoreNet.0.*         model.layers.{l}.feed_forward.up_proj.*
    transformer.layers.{l}.pos_ff.CoreNet.3.*         model.layers.{l}.feed_forward.down_proj.*
    transformer.layers.{l}.pos_ff.layer_norm.*        model.layers.{l}.ff_norm.*
    transformer.pos_emb.inv_freq                      (dropped: recomputed)
    crit.cluster_weight / crit.cluster_bias           lm_head.cluster_weight / lm_head.cluster_bias
    crit.out_layers.{i}.weight / .bias                lm_head.layers.{i}.weight / .bias
    crit.out_projs.{i}                                lm_head.projections.{i}.weight

Tied tensors (``tie_weight`` -> cluster weights, ``tie_projs`` -> projections) are stored once, as transformers 4 used
them after ``tie_weights()`` (the input embedding's copy wins).
"""
from __future__ import annotations

import json
import logging
import pickle
import re
from pathlib import Path
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Union

import torch

from .configuration_transfo_xl import TransfoXLConfig
from .modeling_transfo_xl import TransfoXLForCausalLM

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

PathLike = Union[str, Path]

# transformers-4 config.json key -> TransfoXLConfig field
_CONFIG_KEYS = {
    "vocab_size": "vocab_size",
    "n_token": "vocab_size",
    "cutoffs": "cutoffs",
    "d_model": "hidden_size",
    "d_embed": "embedding_size",
    "n_head": "num_attention_heads",
    "d_head": "head_dim",
    "d_inner": "intermediate_size",
    "n_layer": "num_hidden_layers",
    "div_val": "div_val",
    "pre_lnorm": "pre_lnorm",
    "mem_len": "mem_len",
    "clamp_len": "clamp_len",
    "same_length": "same_length",
    "untie_r": "untie_r",
    "dropout": "hidden_dropout",
    "dropatt": "attention_dropout",
    "layer_norm_epsilon": "layer_norm_eps",
    "init_std": "initializer_range",
    "proj_init_std": "proj_init_std",
    "tie_weight": "tie_word_embeddings",
    "tie_word_embeddings": "tie_word_embeddings",
    "eos_token_id": "eos_token_id",
    "bos_token_id": "bos_token_id",
    "pad_token_id": "pad_token_id",
}
# Per-layer renames inside transformer.layers.{l}.
_LAYER_KEYS = {
    "dec_attn.qkv_net.weight": "attention.qkv_proj.weight",
    "dec_attn.r_net.weight": "attention.pos_proj.weight",
    "dec_attn.o_net.weight": "attention.o_proj.weight",
    "dec_attn.layer_norm.weight": "attention_norm.weight",
    "dec_attn.layer_norm.bias": "attention_norm.bias",
    "pos_ff.CoreNet.0.weight": "feed_forward.up_proj.weight",
    "pos_ff.CoreNet.0.bias": "feed_forward.up_proj.bias",
    "pos_ff.CoreNet.3.weight": "feed_forward.down_proj.weight",
    "pos_ff.CoreNet.3.bias": "feed_forward.down_proj.bias",
    "pos_ff.layer_norm.weight": "ff_norm.weight",
    "pos_ff.layer_norm.bias": "ff_norm.bias",
}
VOCABULARY_FILES = ("idx2sym.json", "vocab.json", "vocab.txt", "idx2sym.txt")


def transfo_xl_config_from_legacy(legacy: dict) -> TransfoXLConfig:
    """Builds a ``TransfoXLConfig`` from a transformers-4 ``config.json`` dict (old or new key spellings).

    transformers 4 derived ``tie_projs`` from ``proj_share_all_but_first`` (default True) whatever ``tie_projs`` said;
    so does this. Raises ValueError for variants transformers 4 did not implement either (attn_type != 0, sampled
    softmax).
    """
    if legacy.get("attn_type", 0) != 0:
        raise ValueError(f"Only attn_type 0 (relative positional attention) is supported, got {legacy['attn_type']}")
    if legacy.get("sample_softmax", -1) > 0:
        raise ValueError(f"The sampled softmax is not supported, got sample_softmax={legacy['sample_softmax']}")
    kwargs = {field: legacy[key] for key, field in _CONFIG_KEYS.items() if key in legacy}
    cutoffs = list(kwargs.get("cutoffs", [20000, 40000, 200000]))
    kwargs["cutoffs"] = cutoffs
    share = legacy.get("proj_share_all_but_first", True if "tie_projs" not in legacy else None)
    kwargs["tie_projs"] = [False] + [bool(share)] * len(cutoffs) if share is not None else list(legacy["tie_projs"])
    ignored = sorted(set(legacy) - set(_CONFIG_KEYS) - {"proj_share_all_but_first", "tie_projs"})
    if ignored:
        logger.info("transformers-4 config keys not used by TransfoXLConfig: %s", ignored)
    return TransfoXLConfig(**kwargs)


def load_legacy_state_dict(src_dir: PathLike) -> Dict[str, torch.Tensor]:
    """Reads ``model.safetensors`` or ``pytorch_model.bin`` from `src_dir`. The ``.bin`` goes through
    ``torch.load(weights_only=True)``: a file holding anything but tensors and plain containers is refused."""
    src_dir = Path(src_dir)
    if (src_dir / "model.safetensors").is_file():
        from safetensors.torch import load_file

        return load_file(str(src_dir / "model.safetensors"))
    path = src_dir / "pytorch_model.bin"
    if not path.is_file():
        raise FileNotFoundError(f"{src_dir} holds neither pytorch_model.bin nor model.safetensors")
    try:
        state_dict = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise ValueError(
            f"{path} holds objects other than tensors; it is refused rather than unpickled (only "
            f"torch.load(weights_only=True) is used). Re-save it as a plain state dict in a trusted environment. "
            f"Loader message: {str(err).splitlines()[0] if str(err) else err!r}"
        ) from None
    if not isinstance(state_dict, dict) or not all(isinstance(v, torch.Tensor) for v in state_dict.values()):
        raise ValueError(f"{path} must hold a flat state dict {{name: tensor}}, got {type(state_dict).__name__}")
    return state_dict


def _position_bias_keys(name: str, tensor: torch.Tensor, config: TransfoXLConfig) -> Dict[str, torch.Tensor]:
    """Model-level ``r_w_bias`` / ``r_r_bias``: shared, or one per layer (untie_r), from ``[H, Dh]`` or
    ``[L, H, Dh]``."""
    shape = (config.num_attention_heads, config.head_dim)
    if tuple(tensor.shape) == (config.num_hidden_layers, *shape):
        if not config.untie_r:
            raise ValueError(f"`transformer.{name}` holds one bias per layer, but the config has untie_r=False")
        return {f"model.layers.{l}.attention.{name}": tensor[l] for l in range(config.num_hidden_layers)}
    if tuple(tensor.shape) != shape:
        raise ValueError(f"`transformer.{name}` must be {shape} or {(config.num_hidden_layers, *shape)}, "
                         f"got {tuple(tensor.shape)}")
    if config.untie_r:
        return {f"model.layers.{l}.attention.{name}": tensor for l in range(config.num_hidden_layers)}
    return {f"model.{name}": tensor}


def convert_state_dict(legacy: Dict[str, torch.Tensor], config: TransfoXLConfig) -> Dict[str, torch.Tensor]:
    """Renames a transformers-4 Transformer-XL state dict to ``TransfoXLForCausalLM``'s keys (tied copies included:
    they are resolved by ``TransfoXLForCausalLM``'s tie mapping). Unknown keys raise a ValueError listing them."""
    out: Dict[str, torch.Tensor] = {}
    unknown: List[str] = []
    per_layer_bias: Dict[str, torch.Tensor] = {}
    for key, tensor in legacy.items():
        name = key[len("transformer.") :] if key.startswith("transformer.") else key
        if m := re.fullmatch(r"word_emb\.emb_layers\.(\d+)\.weight", name):
            out[f"model.word_embeddings.layers.{m[1]}.weight"] = tensor
        elif m := re.fullmatch(r"word_emb\.emb_projs\.(\d+)", name):
            out[f"model.word_embeddings.projections.{m[1]}.weight"] = tensor
        elif m := re.fullmatch(r"layers\.(\d+)\.dec_attn\.(r_w_bias|r_r_bias)", name):
            per_layer_bias[f"model.layers.{m[1]}.attention.{m[2]}"] = tensor
        elif (m := re.fullmatch(r"layers\.(\d+)\.(.+)", name)) and m[2] in _LAYER_KEYS:
            out[f"model.layers.{m[1]}.{_LAYER_KEYS[m[2]]}"] = tensor
        elif name in ("r_w_bias", "r_r_bias"):
            out.update(_position_bias_keys(name, tensor, config))
        elif name == "pos_emb.inv_freq":
            continue  # a buffer of sinusoid frequencies, recomputed
        elif name in ("crit.cluster_weight", "crit.cluster_bias"):
            out[f"lm_head.{name[len('crit.') :]}"] = tensor
        elif m := re.fullmatch(r"crit\.out_layers\.(\d+)\.(weight|bias)", name):
            out[f"lm_head.layers.{m[1]}.{m[2]}"] = tensor
        elif m := re.fullmatch(r"crit\.out_projs\.(\d+)", name):
            out[f"lm_head.projections.{m[1]}.weight"] = tensor
        else:
            unknown.append(key)
    if unknown:
        raise ValueError(f"Unexpected keys in the transformers-4 Transformer-XL checkpoint: {unknown}")
    if config.untie_r:
        out.update(per_layer_bias)  # explicit per-layer biases win over a model-level copy
    # (without untie_r, transformers 4 registered the shared biases in every layer too: duplicates, dropped)
    return out


def convert_transfo_xl_checkpoint(
    src_dir: PathLike, dst_dir: PathLike, vocabulary: Optional[PathLike] = None
) -> TransfoXLForCausalLM:
    """Converts a transformers-4 Transformer-XL folder into one ``AutoModelForCausalLM.from_pretrained`` loads as
    ``TransfoXLForCausalLM``, numerically identical (same tensors, same computation).

    Args:
        src_dir: folder with ``config.json`` and ``pytorch_model.bin`` (or ``model.safetensors``).
        dst_dir: output folder (created): ``config.json``, ``model.safetensors`` and, if a vocabulary is found,
            the tokenizer files.
        vocabulary: a vocabulary file (see ``load_vocabulary``); None looks for ``idx2sym.json``, ``vocab.json``,
            ``vocab.txt`` or ``idx2sym.txt`` in `src_dir`. A ``vocab.pkl`` is never read (pickle).
    Returns:
        the converted ``TransfoXLForCausalLM`` (in eval mode).
    """
    src_dir, dst_dir = Path(src_dir), Path(dst_dir)
    legacy_config = json.loads((src_dir / "config.json").read_text())
    config = transfo_xl_config_from_legacy(legacy_config)
    state_dict = convert_state_dict(load_legacy_state_dict(src_dir), config)

    model = TransfoXLForCausalLM(config)
    tied = model._tie_mapping()
    for target, source in tied.items():
        if source not in state_dict:
            raise ValueError(f"The checkpoint lacks {source!r}, which {target!r} is tied to")
        if target in state_dict and not torch.equal(state_dict[target], state_dict[source]):
            logger.warning(
                "%s differs from %s, to which the config ties it: using %s, as transformers 4 did after tie_weights()",
                target, source, source,
            )
        state_dict[target] = state_dict[source]
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    if missing or unexpected:
        raise ValueError(f"Checkpoint and config disagree: missing keys {missing}, unexpected keys {unexpected}")
    model.eval()
    dst_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dst_dir)

    vocab_path = Path(vocabulary) if vocabulary is not None else _find_vocabulary(src_dir)
    if vocab_path is not None:
        symbols = load_vocabulary(vocab_path)
        if len(symbols) != config.vocab_size:
            raise ValueError(f"{vocab_path} has {len(symbols)} symbols, but the model's vocab_size is "
                             f"{config.vocab_size}")
        build_word_level_tokenizer(symbols).save_pretrained(dst_dir)
    elif (src_dir / "vocab.pkl").exists():
        logger.warning(
            "%s/vocab.pkl is a pickle and is not read. Export its `idx2sym` list in a trusted environment, e.g. "
            "`json.dump(pickle.load(open('vocab.pkl', 'rb'))['idx2sym'], open('idx2sym.json', 'w'))`, and pass it as "
            "`vocabulary=`. The weights were converted without a tokenizer.",
            src_dir,
        )
    return model


# ---------------------------------------------------------------------------------------------------------------
# Word-level tokenizer (no pickle)
# ---------------------------------------------------------------------------------------------------------------


def _find_vocabulary(src_dir: Path) -> Optional[Path]:
    for name in VOCABULARY_FILES:
        if (src_dir / name).is_file():
            return src_dir / name
    return None


def load_vocabulary(path: PathLike) -> List[str]:
    """The id -> symbol list of a word-level vocabulary. Accepted formats:

    - ``*.json`` holding a list of symbols (``idx2sym``), an object with an ``idx2sym`` list, or an object
      ``{symbol: id}`` (``sym2idx`` / ``vocab.json``) whose ids are exactly ``0 .. V-1``;
    - any other file: text, one symbol per line, the line number is the id; only the first whitespace-separated
      field counts (so ``symbol count`` lines of the original transformer-xl vocabularies work).
    A pickle (``vocab.pkl``) is refused.
    """
    path = Path(path)
    if path.suffix == ".pkl":
        raise ValueError(f"{path} is a pickle; it is not unpickled. Export its `idx2sym` list to JSON or text first")
    if path.suffix == ".json":
        data = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(data, dict) and "idx2sym" in data:
            data = data["idx2sym"]
        if isinstance(data, dict):
            ids = sorted(data.values())
            if ids != list(range(len(data))):
                raise ValueError(f"{path}: the ids of a {{symbol: id}} vocabulary must be exactly 0..{len(data) - 1}")
            symbols = [None] * len(data)
            for symbol, idx in data.items():
                symbols[idx] = symbol
            return symbols
        if not isinstance(data, list) or not all(isinstance(s, str) for s in data):
            raise ValueError(f"{path}: expected a list of symbols, an `idx2sym` list or a {{symbol: id}} object")
        return list(data)
    symbols = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        fields = line.strip().split()
        if not fields:
            raise ValueError(f"{path}:{number}: empty line (one symbol per line; the line number is the id)")
        symbols.append(fields[0])
    return symbols


def build_word_level_tokenizer(
    symbols: Sequence[str],
    unk_token: str = "<unk>",
    eos_token: Optional[str] = "<eos>",
    lower_case: bool = False,
    split_punctuation: bool = False,
) -> PreTrainedTokenizerFast:
    """A ``PreTrainedTokenizerFast`` over a ``tokenizers`` WordLevel model, ids as in `symbols`, unknown words ->
    `unk_token`; decoding joins words with spaces. Words are split on whitespace only (WikiText-103 is already
    tokenised), or with ``split_punctuation`` also between word characters and punctuation (raw text)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {}
    for idx, symbol in enumerate(symbols):
        if symbol in vocab:
            raise ValueError(f"The vocabulary lists {symbol!r} twice (ids {vocab[symbol]} and {idx})")
        vocab[symbol] = idx
    if unk_token not in vocab:
        raise ValueError(f"The vocabulary has no unknown-word symbol {unk_token!r}")
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=unk_token))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace() if split_punctuation else pre_tokenizers.WhitespaceSplit()
    if lower_case:
        tokenizer.normalizer = normalizers.Lowercase()
    special = {"unk_token": unk_token}
    if eos_token is not None and eos_token in vocab:
        special["eos_token"] = eos_token
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, **special)
