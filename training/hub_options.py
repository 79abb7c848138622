"""Trainer's Hub options for the training scripts: ``--push_to_hub`` and friends, acted on with this project's export.

Training scripts take Trainer's Hub options (``--push_to_hub``, ``--hub_model_id``, ``--hub_private_repo``,
``--hub_token``, ``--hub_revision``, plus ``--hub_dry_run``) from :func:`add_hub_arguments` and act on them with
:func:`push_if_requested`: a ``model_cards.hub.export_for_hub`` folder (weights, code, tokenizer, results and this
project's card) uploaded by ``model_cards.hub.push_folder``, not ``TrainingArguments(push_to_hub=True)``, whose upload
replaces the card with Trainer's generic one.
"""
from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

from huggingface_hub import HfApi
from huggingface_hub.utils import HFValidationError, validate_repo_id
from transformers import PreTrainedModel

from model_cards.hub import RESULTS_NAME, Results, export_for_hub, push_folder

EXPORT_DIR_NAME = "hub_export"  # the folder push_if_requested writes under a script's output directory
# Command-line arguments never written into results files (which are uploaded with the model).
SECRET_ARGUMENTS = frozenset({"hub_token"})


def _hub_repo_id(value: str) -> str:
    """argparse type of ``--hub_model_id``: ``name`` or ``namespace/name``, checked before any training starts."""
    try:
        validate_repo_id(value)
    except HFValidationError as error:
        raise argparse.ArgumentTypeError(f"expected a Hub repo id like 'user/model-name', got {value!r}: {error}")
    return value


def add_hub_arguments(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """Adds the Hub options of ``TrainingArguments`` to a training script's parser, in an argument group.

    ``--push_to_hub``, ``--hub_model_id`` (default: the name of the output directory, in the token's namespace, as
    Trainer does), ``--hub_private_repo``, ``--hub_token`` (default: ``HF_TOKEN`` or the cached login; never
    written to results files, see :func:`args_without_secrets`), ``--hub_revision``, and ``--hub_dry_run`` (export
    and list the files an upload would send, upload nothing). :func:`push_if_requested` acts on them.
    Returns the group.
    """
    group = parser.add_argument_group(
        "Hugging Face Hub", "export the trained model with its code and this project's model card, and upload it"
    )
    group.add_argument("--push_to_hub", action="store_true",
                       help="after training, write <output_dir>/hub_export (model_cards.hub) and upload it")
    group.add_argument("--hub_model_id", type=_hub_repo_id, default=None,
                       help="Hub repo id (user/name); default: the output directory's name in the token's namespace")
    group.add_argument("--hub_private_repo", action="store_true", default=None,
                       help="create the repo private (default: the Hub's default visibility)")
    group.add_argument("--hub_token", default=None,
                       help="Hub token (default: $HF_TOKEN or `hf auth login`); never written to results files")
    group.add_argument("--hub_revision", default=None, help="branch to upload to (default: main)")
    group.add_argument("--hub_dry_run", action="store_true",
                       help="write the export and list the files an upload would send; upload nothing")
    return group


def args_without_secrets(args: argparse.Namespace) -> Dict[str, Any]:
    """``vars(args)`` without the values that must not be written into (uploaded) results files (``hub_token``)."""
    return {key: value for key, value in vars(args).items() if key not in SECRET_ARGUMENTS}


def push_if_requested(
    args: argparse.Namespace,
    model: PreTrainedModel,
    tokenizer: Any,
    output_dir: Union[str, os.PathLike],
    *,
    results: Results = None,
    **card_options: Any,
) -> Optional[Union[List[str], Any]]:
    """Acts on the options of :func:`add_hub_arguments` at the end of a training script (main process only).

    Without ``--push_to_hub`` or ``--hub_dry_run`` it does nothing and returns None. Otherwise it writes
    ``<output_dir>/hub_export`` (``model_cards.hub.export_for_hub``: weights, config, code, ``tokenizer``, the
    results files and the card filled from them; a previous export there is replaced) and uploads it
    (``model_cards.hub.push_folder``), or with ``--hub_dry_run`` prints and returns the file list.

    Args:
        args: the parsed arguments (``push_to_hub``, ``hub_model_id``, ``hub_private_repo``, ``hub_token``,
            ``hub_revision``, ``hub_dry_run``).
        model: the trained model (any of this package's families).
        tokenizer: saved with it (None: no tokenizer files).
        output_dir: the script's output directory; its name is the default repo name.
        results: the results file(s) or dict(s) of the run (``model_cards.readers`` layouts); None:
            ``<output_dir>/results.json`` when it exists, else a card that says it has no numbers.
        card_options: passed to the card (``base_model`` for an FWL fine-tune, ``datasets``, ``license``, ``tags``,
            ``results_model``...).
    Returns:
        None (nothing requested), the file list (dry run) or ``HfApi.upload_folder``'s commit info.
    """
    missing = [name for name in ("push_to_hub", "hub_model_id", "hub_private_repo", "hub_token", "hub_revision",
                                 "hub_dry_run") if not hasattr(args, name)]
    if missing:
        raise ValueError(f"`args` must come from a parser set up with add_hub_arguments; it has no {missing}")
    if not (args.push_to_hub or args.hub_dry_run):
        return None
    output_dir = Path(output_dir)
    repo_id = args.hub_model_id or output_dir.resolve().name
    if "/" not in repo_id and not args.hub_dry_run:  # Trainer's default: the token's namespace
        api = HfApi(token=args.hub_token)
        repo_id = api.create_repo(repo_id, private=args.hub_private_repo, exist_ok=True, repo_type="model").repo_id
    if results is None and (output_dir / RESULTS_NAME).is_file():
        results = output_dir / RESULTS_NAME
    folder = output_dir / EXPORT_DIR_NAME
    if folder.exists():
        shutil.rmtree(folder)  # no stale files (old shards, results) from an earlier export
    export_for_hub(model, tokenizer, folder, results=results, repo_id=repo_id, **card_options)
    return push_folder(
        folder, repo_id, token=args.hub_token, private=args.hub_private_repo, revision=args.hub_revision,
        dry_run=args.hub_dry_run,
    )
