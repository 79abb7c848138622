"""The base of every model of this package: self-contained saves, safe loading, and the publishing hook.

``StatefulPreTrainedModel`` (``FastWeightHubMixin`` + ``PreTrainedModel``) is what every family's
``PreTrainedModel`` subclass derives from. ``FastWeightHubMixin`` changes three things of
``transformers.PreTrainedModel``:

- ``save_pretrained`` also writes the modeling code and an ``auto_map`` into ``config.json``
  (``remote_code.save_remote_code``), so the folder loads with ``trust_remote_code=True`` without this package.
- ``from_pretrained`` never unpickles arbitrary objects (``weights_only=False`` is refused; transformers'
  ``weights_only=True`` load errors are re-raised with the file and the remedy), checks safetensors files before
  loading and names the file and the problem when one is truncated or corrupted, and re-enables the recurrent
  state for generation in checkpoints saved by ``Trainer`` (``use_cache: false``).
- Publishing is not model code: model cards and checked uploads live in the ``model_cards`` package, which
  registers itself here (:func:`register_publisher`) when imported. With a publisher registered,
  ``save_pretrained`` also writes a model card (``README.md``, kept if the folder has one) and ``push_to_hub``
  uploads the folder with that card; without one, ``push_to_hub`` is transformers' (whose card is generic).

This module is part of every export, so it imports only the standard library and what a plain transformers
install has, and never the publishing package.
"""
from __future__ import annotations

import os
import pickle
import re
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Protocol, Union

import torch
from safetensors import SafetensorError
from transformers import PreTrainedModel
from transformers.utils import logging

from .remote_code import check_weight_files, save_remote_code

logger = logging.get_logger(__name__)

# Where the installed package keeps the registered publisher (a copy of this module loaded from a saved folder with
# trust_remote_code looks there too).
INSTALLED_MODULE = "modeling_fwp.pretrained"


class Publisher(Protocol):
    """What ``FastWeightHubMixin`` asks of the publishing package (``model_cards.hub`` is one)."""

    def write_model_card(self, folder: Union[str, os.PathLike], results: Any = None, *, overwrite: bool = True) -> Path:
        """Writes ``folder/README.md`` from the saved ``config.json`` (and ``results``); returns its path."""

    def push_folder(self, folder: Union[str, os.PathLike], repo_id: str, **kwargs: Any) -> Any:
        """Checks a saved folder and uploads it to the Hub repo ``repo_id``."""

    def push_to_hub(self, model: PreTrainedModel, repo_id: str, **kwargs: Any) -> Any:
        """Saves ``model`` with its card into a temporary folder and uploads it."""


_PUBLISHER: Optional[Publisher] = None


def register_publisher(publisher: Optional[Publisher]) -> None:
    """Makes ``publisher`` write the model card of every ``save_pretrained`` and carry out ``push_to_hub`` (None:
    none, transformers' behaviour). The publishing package calls this when imported."""
    global _PUBLISHER
    _PUBLISHER = publisher


def registered_publisher() -> Optional[Publisher]:
    """The publisher registered with the installed package, else with this module (None: none)."""
    installed = sys.modules.get(INSTALLED_MODULE)
    return getattr(installed, "_PUBLISHER", None) if installed is not None else _PUBLISHER


class FastWeightHubMixin:
    """Self-contained ``save_pretrained``, safe ``from_pretrained`` and card-preserving ``push_to_hub``.

    Put it first in the bases of a family's ``PreTrainedModel`` subclass:
    ``class MyPreTrainedModel(FastWeightHubMixin, PreTrainedModel)``.
    """

    def save_pretrained(self, save_directory: Union[str, os.PathLike], *args: Any, **kwargs: Any) -> None:
        """``PreTrainedModel.save_pretrained`` plus the modeling code and ``auto_map`` (loadable with
        ``trust_remote_code=True`` without this package) and, with a publisher registered, a model card
        (``README.md``, kept if the folder already has one). ``push_to_hub=True`` uploads the folder afterwards
        (with ``repo_id``, ``token``, ``private``, ``commit_message``)."""
        push = kwargs.pop("push_to_hub", False)
        push_kwargs = {key: kwargs.pop(key) for key in ("repo_id", "private", "commit_message") if key in kwargs}
        main_process = kwargs.get("is_main_process", True)
        if main_process:
            save_remote_code(self, save_directory)  # first: it sets config.auto_map, which the config file records
        super().save_pretrained(save_directory, *args, **kwargs)
        if not main_process:
            return
        publisher = registered_publisher()
        if publisher is not None:
            try:
                publisher.write_model_card(save_directory, overwrite=False)
            except (ValueError, KeyError, OSError) as error:  # a card is a courtesy here; the checkpoint is saved
                logger.warning(f"No model card written to {save_directory}: {error}")
        if push:
            repo_id = push_kwargs.pop("repo_id", None) or Path(save_directory).resolve().name
            if publisher is None:
                raise ImportError(
                    "save_pretrained(push_to_hub=True) of a fast-weight model needs the publishing package: "
                    "`import model_cards` first (or use push_to_hub)"
                )
            publisher.push_folder(save_directory, repo_id, token=kwargs.get("token"), **push_kwargs)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: Union[str, os.PathLike, None], *args: Any, **kwargs: Any):
        """``PreTrainedModel.from_pretrained`` that never unpickles arbitrary objects and explains bad weight files.

        Raises:
            ValueError: ``weights_only=False`` was passed.
            OSError: a safetensors file is truncated or corrupted (the message names it).
            pickle.UnpicklingError: a pickled checkpoint holds objects other than tensors.
        """
        if kwargs.get("weights_only", True) is not True:
            raise ValueError(
                "`weights_only` must be True: fast-weight models never unpickle arbitrary objects. Convert trusted "
                "pickled checkpoints to safetensors (torch.load(..., weights_only=True) + save_pretrained)"
            )
        if pretrained_model_name_or_path is not None and os.path.isdir(pretrained_model_name_or_path):
            check_weight_files(Path(pretrained_model_name_or_path, kwargs.get("subfolder") or ""))
        try:
            loaded = super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        except pickle.UnpicklingError as error:
            found = re.search(r"unsupported GLOBAL \S+", str(error), flags=re.IGNORECASE)
            raise pickle.UnpicklingError(
                f"Refusing to load the pickled checkpoint of {pretrained_model_name_or_path}: it holds objects other "
                f"than tensors ({found.group(0) if found else str(error).strip().splitlines()[0]}), and unpickling "
                "them could run arbitrary code. Load only safetensors, or weights-only pickles, from sources you trust"
            ) from None
        except SafetensorError as error:
            raise OSError(
                f"A safetensors weight file of {pretrained_model_name_or_path} is truncated or corrupted ({error}); "
                "re-download or re-save the checkpoint"
            ) from error
        model = loaded[0] if isinstance(loaded, tuple) else loaded  # (model, loading_info) with output_loading_info
        model._enable_generation_cache()
        return loaded

    def _enable_generation_cache(self) -> None:
        """Generation continues from the recurrent state unless a generation config asks otherwise explicitly.

        ``Trainer`` saves ``use_cache: false`` in ``config.json``; a generation config derived from such a config
        (``_from_model_config``) inherits it, and ``generate`` would then re-read the whole prefix at every step.
        """
        generation_config = getattr(self, "generation_config", None)
        if (
            generation_config is not None
            and generation_config.use_cache is False
            and getattr(generation_config, "_from_model_config", False)
        ):
            generation_config.use_cache = True

    def push_to_hub(
        self,
        repo_id: str,
        *,
        tokenizer: Any = None,
        results: Optional[Union[str, os.PathLike, Dict[str, Any]]] = None,
        commit_message: Optional[str] = None,
        private: Optional[bool] = None,
        token: Optional[Union[bool, str]] = None,
        revision: Optional[str] = None,
        create_pr: bool = False,
        max_shard_size: Union[int, str] = "50GB",
        tags: Optional[List[str]] = None,
        dry_run: bool = False,
        **kwargs: Any,
    ) -> Any:
        """Uploads weights, config, code, ``tokenizer`` (when given) and this project's model card (filled from
        ``results``, a results JSON path or dict) with ``huggingface_hub`` (the registered publisher's
        ``push_to_hub``, ``model_cards.hub.push_to_hub``).

        Without a registered publisher (``model_cards`` not imported, or a model loaded with ``trust_remote_code``
        where it is not installed) it falls back to transformers' ``push_to_hub``, whose card is generic.
        """
        publisher = registered_publisher()
        if publisher is None:
            logger.warning("no model card publisher (import model_cards): pushing with transformers' generic card")
            return super().push_to_hub(
                repo_id, commit_message=commit_message, private=private, token=token, revision=revision,
                create_pr=create_pr, max_shard_size=max_shard_size, tags=tags, **kwargs,
            )
        return publisher.push_to_hub(
            self, repo_id, tokenizer=tokenizer, results=results, commit_message=commit_message, private=private,
            token=token, revision=revision, create_pr=create_pr, max_shard_size=max_shard_size, tags=tags,
            dry_run=dry_run,
        )


# The keyword arguments of transformers' causal-LM loss that a forward takes through ``**kwargs`` and hands to its
# loss: Trainer's ``num_items_in_batch`` (the token count of the whole gradient step), ``ignore_index`` and
# ``shift_labels`` (targets already shifted, e.g. the next segment's first token as the last target).
LOSS_KWARGS = ("num_items_in_batch", "ignore_index", "shift_labels")


def take_loss_kwargs(kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """The :data:`LOSS_KWARGS` among a forward's ``kwargs``, removed from it."""
    return {name: kwargs.pop(name) for name in LOSS_KWARGS if name in kwargs}


def logits_to_keep_index(logits_to_keep: Union[int, torch.Tensor]) -> Union[slice, torch.Tensor]:
    """The index of the positions (dim 1 of ``[B, T, ...]``) a forward's ``logits_to_keep`` keeps: an int n the last n
    (0 all of them), a tensor the positions it lists."""
    if isinstance(logits_to_keep, int):
        return slice(-logits_to_keep, None) if logits_to_keep > 0 else slice(None)
    return logits_to_keep


class StatefulPreTrainedModel(FastWeightHubMixin, PreTrainedModel):
    """Base of every model of this package: it builds its own recurrent ``Cache`` in ``forward`` (generate must not
    create a DynamicCache), rolls that cache back for assisted and prompt-lookup decoding, and exports
    self-contained for the Hub (``FastWeightHubMixin``).

    transformers refuses assisted decoding for models flagged ``_is_stateful`` ("they can't reset to a previous subset
    of generated text"). Ours can: while generate's assisted mode records (``activate_past_recording``), the cache
    keeps a checkpoint per forward pass and ``crop(-n)`` restores one and replays the accepted tokens
    (``cache_fwp.RollbackMixin``). So the flag is False, and generation hands the assisted mode (and an assistant
    model of ours) a recording cache before the first forward pass (``_prepare_cache_for_generation``).
    """

    supports_gradient_checkpointing = True
    _skip_keys_device_placement = ["cache", "past_key_values"]
    _is_stateful = False

    def _empty_cache(self) -> Optional[Any]:
        """A new, empty cache of this model (what ``forward`` creates when given none)."""
        return None

    def _split_dependent_outputs(self) -> Optional[str]:
        """Why this model's outputs depend on how the tokens are split into forward passes (None: they do not).
        Assisted decoding verifies several tokens in one pass, so it cannot reproduce such a model's decoding."""
        return None

    def _prepare_cache_for_generation(self, generation_config: Any, model_kwargs: Dict[str, Any],
                                      generation_mode: Any, *args: Any, **kwargs: Any) -> None:
        """As transformers', plus: in assisted decoding (``assistant_model``, ``prompt_lookup_num_tokens``), and when
        this model drafts for another (``generation_config.is_assistant``), a recording cache (``crop`` rolls it back)
        is created before the first forward pass.

        Raises:
            ValueError: assisted decoding of a model whose outputs depend on how tokens are split into forward passes.
        """
        super()._prepare_cache_for_generation(generation_config, model_kwargs, generation_mode, *args, **kwargs)
        assisted = getattr(generation_mode, "value", generation_mode) == "assisted_generation"
        reason = self._split_dependent_outputs() if assisted else None
        if reason is not None:
            raise ValueError(
                f"Assisted and prompt-lookup decoding verify several tokens in one forward pass, which changes the "
                f"outputs of this {type(self).__name__}: {reason}"
            )
        if model_kwargs.get("cache") is not None or generation_config.use_cache is False:
            return
        if assisted or getattr(generation_config, "is_assistant", False):
            cache = self._empty_cache()
            if cache is not None:
                cache.activate_past_recording()
                model_kwargs["cache"] = cache

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False

    def create_masks_for_generate(self, attention_mask: Optional[Any] = None, **kwargs: Any) -> Optional[Any]:
        """The padding mask as it is: ``generate`` turns a 2-D mask into a 4-D causal one for a compileable cache,
        but a fast-weight model attends to no key sequence and reads the 2-D ``[B, T]`` / ``[B, past + T]`` mask."""
        return attention_mask
