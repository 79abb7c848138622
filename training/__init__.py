"""Training scripts built on transformers' Trainer: offline data, tokenizers and the demo job.

- `training.data`: the embedded Wikipedia corpus (from gensim's test data) as clean text splits.
- `training.tokenizer`: a byte-level BPE trained on the train split, and GPT-2's BPE from local files.
- `training.demo`: a small Delta Net trained from scratch (`python -m training.demo`, `make demo-delta-net`).
- `training.arguments`: the scripts' command lines (`HfArgumentParser` with `TrainingArguments`);
  `training.trainer_utils`: the Trainer pieces they share; `training.cli`: the installed commands (`fwp-train-lm`, ...).

Installed, this package is `fwp_training` (setup.cfg); its modules import each other relatively, so both names work.
"""
import os
from typing import Optional, Union


def latest_checkpoint(directory: Union[str, os.PathLike]) -> Optional[str]:
    """The newest Trainer checkpoint (``checkpoint-<step>``) under `directory` (a path), None when there is none or
    the directory does not exist: what ``trainer.train(resume_from_checkpoint=...)`` continues from."""
    from pathlib import Path

    from transformers.trainer_utils import get_last_checkpoint

    return get_last_checkpoint(str(directory)) if Path(directory).is_dir() else None


def leave_process_group() -> None:
    """End of a script under `accelerate launch`: every rank waits for the others (rank 0 may still be generating,
    writing results or pushing), then leaves the gloo/NCCL group. A rank whose interpreter exits while the group is
    alive can abort in the backend's teardown ("terminate called without an active exception"), failing the launch
    even though the work is done. Does nothing in a single process."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
