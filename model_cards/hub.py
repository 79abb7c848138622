"""Publishing fast-weight models on the Hugging Face Hub: exports, model cards and uploads.

An export is a folder that loads anywhere transformers 5 runs:

- ``config.json`` (with ``auto_map``), ``generation_config.json``, ``model.safetensors``;
- the modeling code and a pure-PyTorch copy of ``fwp_kernels`` (written by ``save_pretrained``, see
  ``modeling_fwp.remote_code``), so ``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`` works
  without the ``modeling_fwp`` package;
- the tokenizer, when given;
- the results files of the runs (when given) and ``README.md``, this project's model card filled from them
  (:mod:`model_cards.generator`).

Uploads are thin calls into ``huggingface_hub`` (``create_repo`` + ``upload_folder``) and can be dry runs that only
list the files. The training scripts reach them through ``training.hub_options`` (Trainer's ``--push_to_hub`` options),
not through ``TrainingArguments(push_to_hub=True)``, whose upload replaces the card with Trainer's generic one.

Importing this module registers it as ``modeling_fwp``'s publisher (``modeling_fwp.pretrained.register_publisher``):
from then on the models' ``save_pretrained`` writes this project's card and their ``push_to_hub`` lands in
:func:`push_to_hub`. (``modeling_fwp`` never imports this package; this module is never copied into exports.)
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from huggingface_hub import HfApi
from huggingface_hub.utils import filter_repo_objects
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

import modeling_fwp
from modeling_fwp.pretrained import register_publisher

from .generator import card_for_folder, validate_card

CARD_NAME = "README.md"
RESULTS_NAME = "results.json"
# Never uploaded: caches and bytecode (the same patterns filter the dry-run listing and the upload).
IGNORE_PATTERNS = ["__pycache__/*", "*/__pycache__/*", "*.pyc", ".cache/*", ".git/*", ".ipynb_checkpoints/*"]
Results = Union[None, str, os.PathLike, Mapping[str, Any], Sequence[Union[str, os.PathLike, Mapping[str, Any]]]]


def registered_families() -> Dict[str, Tuple[type, type]]:
    """Every model family this package registers: ``model_type -> (config class, causal LM class)``.

    Read from the Auto registries (model types ``fwp_*``, DESIGN.md), so families added later are included without
    being listed here.
    """
    families = {}
    for model_type in CONFIG_MAPPING.keys():
        if not model_type.startswith("fwp_"):
            continue
        config_cls = CONFIG_MAPPING[model_type]
        if not config_cls.__module__.startswith(f"{modeling_fwp.__name__}."):
            continue
        if config_cls in AutoModelForCausalLM._model_mapping:
            families[model_type] = (config_cls, AutoModelForCausalLM._model_mapping[config_cls])
    return families


def write_model_card(
    folder: Union[str, os.PathLike], results: Results = None, *, overwrite: bool = True, **card_options: Any
) -> Path:
    """Writes ``README.md`` into a saved model folder: :func:`model_cards.card_for_folder` (validated) from its
    ``config.json``, weights and ``results``. Returns the card's path (unchanged if it exists and not ``overwrite``).

    ``card_options``: ``repo_id``, ``model_name``, ``license``, ``datasets``, ``base_model``, ``language``, ``tags``,
    ``model`` and ``measure``: the cache is measured only when asked (``measure=True``; :func:`export_for_hub` and
    the CLI ask): the card ``save_pretrained`` writes must not load the model again nor run it (under FSDP only the
    main process saves), so it makes no cache claim.
    """
    card_options.setdefault("measure", False)
    path = Path(folder) / CARD_NAME
    if path.exists() and not overwrite:
        return path
    card = validate_card(card_for_folder(folder, results, **card_options))
    card.save(path)
    return path


def attach_results(folder: Union[str, os.PathLike], results: Results, **card_options: Any) -> Path:
    """Copies the results files (or dicts, as ``results.json``) into a model folder and writes the card from them,
    so that the numbers and the files they come from travel together. Returns the card's path.

    ``results``: a results JSON path or dict, or a list of them (e.g. a training log and an evaluation), as written
    by the ``training/`` scripts (``model_cards.readers``); None writes a card that says it has no numbers.
    """
    folder = Path(folder)
    single = isinstance(results, (str, os.PathLike, Mapping))
    sources = [] if results is None else [results] if single else list(results)
    shipped: List[Path] = []
    for index, source in enumerate(sources):
        target = folder / (RESULTS_NAME if isinstance(source, Mapping) else Path(source).name)
        if target in shipped:
            target = target.with_name(f"{target.stem}_{index}{target.suffix}")
        if isinstance(source, Mapping):
            target.write_text(json.dumps(source, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        elif not (target.exists() and target.samefile(source)):
            shutil.copyfile(source, target)
        shipped.append(target)
    return write_model_card(folder, shipped or None, overwrite=True, **card_options)


def export_for_hub(
    model: PreTrainedModel,
    tokenizer: Any = None,
    out_dir: Union[str, os.PathLike] = "hub_export",
    *,
    results: Results = None,
    save_kwargs: Optional[Dict[str, Any]] = None,
    **card_options: Any,
) -> Path:
    """Writes a self-contained Hub folder for ``model``: weights, config, code, ``tokenizer`` (when given), the
    results files (when given) and a model card filled from those results.

    Args:
        model: any model of ``modeling_fwp`` (``FastWeightHubMixin`` writes the code with the weights).
        tokenizer: saved next to the model when given.
        out_dir: the folder (created).
        results: the results JSON(s) (paths or dicts) of the runs that trained and evaluated ``model``; None: a
            card that says it has no numbers.
        save_kwargs: passed to ``model.save_pretrained`` (``max_shard_size``, ...).
        card_options: passed to the card (``repo_id``, ``license``, ``datasets``, ``base_model``, ``tags``,
            ``results_model`` for an eval_lm file covering several models, ...).
    Returns:
        ``out_dir`` as a ``Path``.
    """
    out = Path(out_dir)
    model.save_pretrained(out, **(save_kwargs or {}))
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    card_options.setdefault("model", model)  # the card measures this model's cache instead of loading the folder
    card_options.setdefault("measure", True)
    attach_results(out, results, **card_options)
    return out


def check_export(folder: Union[str, os.PathLike]) -> List[str]:
    """Checks that a folder is a complete export and returns the files an upload would send (sorted, relative).

    Raises ``ValueError`` naming what is missing: ``config.json`` with an ``auto_map``, the modules it names,
    safetensors weights (no pickles), and a valid model card.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"`folder` must be a saved model folder, got {folder} (not a directory)")
    files = sorted(
        filter_repo_objects(
            (p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()),
            ignore_patterns=IGNORE_PATTERNS,
        )
    )
    problems = []
    config = json.loads((folder / "config.json").read_text(encoding="utf-8")) if "config.json" in files else None
    if config is None:
        problems.append("no config.json")
    elif not config.get("auto_map"):
        problems.append("config.json has no auto_map (save the model with this package's save_pretrained)")
    else:
        modules = {reference.split(".")[0] + ".py" for reference in config["auto_map"].values()}
        problems += [f"auto_map names {m}, which is missing" for m in sorted(modules - set(files))]
    if not any(f.endswith(".safetensors") for f in files):
        problems.append("no safetensors weights")
    pickles = [f for f in files if f.endswith((".bin", ".pt", ".pth", ".pkl", ".ckpt"))]
    if pickles:
        problems.append(f"pickled files {pickles} (publish safetensors only)")
    if CARD_NAME not in files:
        problems.append(f"no {CARD_NAME} (write one with write_model_card or `python -m model_cards card`)")
    else:
        try:
            validate_card((folder / CARD_NAME).read_text(encoding="utf-8"))
        except ValueError as error:
            problems.append(str(error))
    if problems:
        raise ValueError(f"{folder} is not ready for the Hub: " + "; ".join(problems))
    return files


def push_folder(
    folder: Union[str, os.PathLike],
    repo_id: str,
    *,
    token: Optional[Union[bool, str]] = None,
    private: Optional[bool] = None,
    commit_message: Optional[str] = None,
    revision: Optional[str] = None,
    create_pr: bool = False,
    dry_run: bool = False,
) -> Union[List[str], Any]:
    """Uploads an export folder to the model repo ``repo_id`` (created if missing) with ``huggingface_hub``.

    The folder is checked first (:func:`check_export`). ``dry_run`` prints and returns the file list without any
    network access; otherwise returns ``HfApi.upload_folder``'s commit info. The folder's own ``README.md`` is the
    card that lands on the Hub.
    """
    if not isinstance(repo_id, str) or not repo_id.strip():
        raise ValueError(f"`repo_id` must be a Hub repo id like 'user/model', got {repo_id!r}")
    files = check_export(folder)
    if dry_run:
        print(f"Dry run: would upload {len(files)} files from {folder} to https://huggingface.co/{repo_id}")
        for name in files:
            print(f"  {name}")
        return files
    api = HfApi(token=token)
    repo = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
    return api.upload_folder(
        repo_id=repo.repo_id, folder_path=str(folder), commit_message=commit_message or "Upload fast-weight model",
        revision=revision, create_pr=create_pr, ignore_patterns=IGNORE_PATTERNS, repo_type="model",
    )


def push_to_hub(
    model: PreTrainedModel,
    repo_id: str,
    *,
    tokenizer: Any = None,
    results: Results = None,
    commit_message: Optional[str] = None,
    private: Optional[bool] = None,
    token: Optional[Union[bool, str]] = None,
    revision: Optional[str] = None,
    create_pr: bool = False,
    max_shard_size: Union[int, str] = "50GB",
    tags: Optional[Sequence[str]] = None,
    dry_run: bool = False,
    **card_options: Any,
) -> Union[List[str], Any]:
    """Exports ``model`` (and ``tokenizer``, ``results``) into a temporary folder and uploads it
    (:func:`export_for_hub` + :func:`push_folder`). ``model.push_to_hub(...)`` of this package's models lands here."""
    with tempfile.TemporaryDirectory() as tmp:
        export_for_hub(
            model, tokenizer, tmp, results=results, save_kwargs={"max_shard_size": max_shard_size},
            repo_id=repo_id, tags=tuple(tags or ()), **card_options,
        )
        return push_folder(
            tmp, repo_id, token=token, private=private, commit_message=commit_message, revision=revision,
            create_pr=create_pr, dry_run=dry_run,
        )


def load_for_export(folder: Union[str, os.PathLike]) -> Tuple[PreTrainedModel, Any]:
    """Loads a saved model (with this package's classes) and its tokenizer, when the folder has one."""
    from transformers import AutoTokenizer

    config = AutoConfig.from_pretrained(folder)
    if config.model_type not in registered_families():
        raise ValueError(f"{folder} holds a {config.model_type!r} model, not one of {sorted(registered_families())}")
    model = AutoModelForCausalLM.from_pretrained(folder)
    has_tokenizer = any(Path(folder, name).is_file() for name in ("tokenizer.json", "tokenizer_config.json"))
    return model, (AutoTokenizer.from_pretrained(folder) if has_tokenizer else None)


register_publisher(sys.modules[__name__])
