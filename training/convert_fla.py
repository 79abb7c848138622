"""Convert a flash-linear-attention (fla 0.6) ``delta_net`` / ``gated_deltanet`` checkpoint folder into a folder that
``AutoModelForCausalLM.from_pretrained`` loads as this package's model, with its model card (README.md: where the
weights came from, under which license, how they were converted).

    fwp-convert-fla --src_dir path/to/delta_net-1.3B-100B --output_dir delta_net-1.3B \\
        --repo_id fla-hub/delta_net-1.3B-100B          # --dtype float32 to cast
    python -m training.convert_fla ...                 # the same, from the repository root without installing

The conversion itself is ``modeling_fwp.convert_fla_checkpoint``; this command adds the card, which the model
package cannot write (it never imports ``model_cards``; importing ``model_cards`` makes ``save_pretrained`` write one).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

from modeling_fwp.convert_fla import DTYPES


@dataclass
class ConvertFLAArguments:
    """The fla folder read, the folder written, and what the card records."""

    src_dir: str = field(metadata={"help": "fla's checkpoint folder (config.json + safetensors)"})
    output_dir: str = field(metadata={"help": "the folder written (weights, code, tokenizer files, README.md card)"})
    dtype: Optional[str] = field(default=None, metadata={
        "help": "cast the weights to this dtype; unset: keep the checkpoint's", "choices": list(DTYPES)})
    repo_id: Optional[str] = field(default=None, metadata={
        "help": "the Hub id the weights came from, for the card (found by itself in a Hugging Face cache snapshot)"})


def main(argv: Optional[List[str]] = None) -> Path:
    """Converts ``--src_dir`` into ``--output_dir`` with its model card; returns the output folder."""
    import model_cards  # noqa: F401  (registers the publisher: save_pretrained then writes the card)
    from modeling_fwp import convert_fla_checkpoint

    from .arguments import parse_arguments

    args = parse_arguments((ConvertFLAArguments,), argv, description=__doc__)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model = convert_fla_checkpoint(args.src_dir, args.output_dir, dtype=args.dtype, repo_id=args.repo_id)
    folder = Path(args.output_dir)
    print(f"{type(model).__name__}: {sum(p.numel() for p in model.parameters()):,} parameters ({model.config.dtype}) "
          f"written to {folder}, model card {folder / 'README.md'}")
    return folder


if __name__ == "__main__":
    main()
