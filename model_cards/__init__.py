"""Model cards for fast-weight checkpoints: a template per model family, filled from measured results.

- :func:`build_card` / :func:`card_for_folder`: a ``huggingface_hub.ModelCard`` from ``config.json`` and a results
  JSON (what the training and evaluation scripts write; see :mod:`model_cards.generator` for the keys).
- :func:`validate_card`: parses a card back and checks its metadata and model-index.
- :func:`read_results`: the results files of ``training/`` scripts (demo, finetune_fwl, eval_lm, train_transfo_xl)
  in the card's layout (:mod:`model_cards.readers`).
- :mod:`model_cards.hub`: self-contained Hub exports (weights, code, tokenizer, results files and the card), checks
  and uploads. Importing ``model_cards`` registers it as ``modeling_fwp``'s publisher, so that the models'
  ``save_pretrained`` writes this project's card and their ``push_to_hub`` uploads it.
- ``python -m model_cards {card,export,push,validate} ...``: the command line (``--help``).
"""
from .generator import (
    FAMILIES,
    NO_RESULTS_NOTE,
    Evaluation,
    Family,
    build_card,
    card_for_folder,
    count_parameters,
    evaluations,
    family_key,
    validate_card,
)
from .readers import read_results
from . import hub  # registers model_cards.hub as modeling_fwp's publisher

__all__ = [
    "FAMILIES",
    "NO_RESULTS_NOTE",
    "Evaluation",
    "Family",
    "build_card",
    "card_for_folder",
    "count_parameters",
    "evaluations",
    "family_key",
    "hub",
    "read_results",
    "validate_card",
]
