"""Trainer's Hub options for the training scripts: ``--push_to_hub`` and friends, acted on with this project's export.

Training scripts parse Trainer's Hub options (``--push_to_hub``, ``--hub_model_id``, ``--hub_private_repo``,
``--hub_token``, ``--hub_revision``) with ``TrainingArguments``, plus ``--hub_dry_run``
(``training.arguments.HubExportArguments``), take them out of Trainer's hands with :func:`hub_request` and act on
them with :func:`push_if_requested`: a ``model_cards.hub.export_for_hub`` folder (weights, code, tokenizer, results and
this project's card) uploaded by ``model_cards.hub.push_folder``, not ``TrainingArguments(push_to_hub=True)``, whose
upload replaces the card with Trainer's generic one.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Optional, Union

from huggingface_hub import HfApi
from huggingface_hub.utils import HFValidationError, validate_repo_id
from transformers import PreTrainedModel

from model_cards.hub import RESULTS_NAME, Results, export_for_hub, push_folder

EXPORT_DIR_NAME = "hub_export"  # the folder push_if_requested writes under a script's output directory
HUB_FIELDS = ("push_to_hub", "hub_model_id", "hub_private_repo", "hub_token", "hub_revision", "hub_dry_run")


@dataclass
class HubRequest:
    """What a training script's run asks of the Hub: Trainer's Hub options plus ``--hub_dry_run``."""

    push_to_hub: bool = False
    hub_model_id: Optional[str] = None
    hub_private_repo: Optional[bool] = None
    hub_token: Optional[str] = None
    hub_revision: Optional[str] = None
    hub_dry_run: bool = False

    def __post_init__(self) -> None:
        if self.hub_model_id is not None:
            try:
                validate_repo_id(self.hub_model_id)
            except HFValidationError as error:
                raise ValueError(
                    f"--hub_model_id: expected a Hub repo id like 'user/model-name', got {self.hub_model_id!r}: {error}"
                ) from error


def hub_request(args: Any) -> HubRequest:
    """The :class:`HubRequest` of parsed arguments holding ``TrainingArguments`` and ``HubExportArguments``
    (``training.arguments``), and Trainer's own upload turned off: ``TrainingArguments(push_to_hub=True)`` would
    push Trainer's checkpoints with its generic card; :func:`push_if_requested` uploads this project's export."""
    request = HubRequest(**{name: getattr(args, name) for name in HUB_FIELDS})
    args.training.push_to_hub = False
    return request


def push_if_requested(
    args: Any,
    model: PreTrainedModel,
    tokenizer: Any,
    output_dir: Union[str, os.PathLike],
    *,
    results: Results = None,
    **card_options: Any,
) -> Optional[Union[List[str], Any]]:
    """Acts on a :class:`HubRequest` at the end of a training script (main process only).

    Without ``--push_to_hub`` or ``--hub_dry_run`` it does nothing and returns None. Otherwise it writes
    ``<output_dir>/hub_export`` (``model_cards.hub.export_for_hub``: weights, config, code, ``tokenizer``, the
    results files and the card filled from them; a previous export there is replaced) and uploads it
    (``model_cards.hub.push_folder``), or with ``--hub_dry_run`` prints and returns the file list.

    Args:
        args: a :class:`HubRequest` (:func:`hub_request`), or any object with its attributes.
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
    missing = [name for name in HUB_FIELDS if not hasattr(args, name)]
    if missing:
        raise ValueError(f"`args` must be a HubRequest (training.hub_options.hub_request); it has no {missing}")
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
