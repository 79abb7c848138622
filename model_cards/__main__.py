"""Command line: ``python -m model_cards {card,export,push,validate} ...``.

    card FOLDER [--results R.json ...]        write FOLDER/README.md from config.json (+ measured results)
    export MODEL_DIR OUT_DIR [--results R]    load a saved model (+ tokenizer) and write a self-contained Hub folder
                                              (the results files are copied in and cited by the card)
    push FOLDER --repo-id USER/NAME [--dry-run] [--results R]
                                              upload a Hub folder (code, weights, this card); --dry-run lists files
    validate FOLDER_OR_README                 parse a card back and check its metadata

--results takes the JSON of training/demo.py, finetune_fwl.py, eval_lm.py (--output) or train_transfo_xl.py
(train_log.json), and may be repeated (e.g. a training log and an evaluation).

``card``, ``export`` and ``push --results`` take the card options --repo-id, --model-name, --license, --dataset
(repeatable Hub dataset id), --base-model, --language, --tag, --results-model.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

from . import hub
from .generator import DEFAULT_LICENSE, card_for_folder, validate_card


def _add_card_options(parser: argparse.ArgumentParser, repo_id_required: bool = False) -> None:
    parser.add_argument(
        "--results", action="append", help="results JSON written by a training / evaluation script (repeatable)"
    )
    parser.add_argument("--results-model", help="the evaluated model's folder, for an eval_lm file with several")
    parser.add_argument("--repo-id", required=repo_id_required, help="Hub repo id (user/name)")
    parser.add_argument("--model-name", help="card title and model-index name (default: the repo name)")
    parser.add_argument("--license", default=DEFAULT_LICENSE, help=f"license id (default {DEFAULT_LICENSE})")
    parser.add_argument("--dataset", action="append", dest="datasets", help="Hub dataset id of the training data")
    parser.add_argument("--base-model", help="Hub id of the pretrained base (FWL fine-tunes)")
    parser.add_argument("--language", action="append", help="language code of the training data, e.g. en")
    parser.add_argument("--tag", action="append", dest="tags", default=[], help="an extra tag")
    parser.add_argument("--no-measure", dest="measure", action="store_false",
                        help="do not load the model to measure its generation cache (the card then makes no claim)")


def _card_options(args: argparse.Namespace) -> Dict[str, Any]:
    return dict(
        repo_id=args.repo_id, model_name=args.model_name, license=args.license, datasets=args.datasets,
        base_model=args.base_model, language=args.language, tags=tuple(args.tags), measure=args.measure,
        **({"results_model": args.results_model} if args.results_model else {}),
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m model_cards", description="Model cards and Hub uploads for fast-weight models.",
        epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)

    card = commands.add_parser("card", help="write a model card into a saved model folder")
    card.add_argument("folder", help="folder with config.json (and weights)")
    card.add_argument("--output", help="where to write the card (default FOLDER/README.md; '-' prints it)")
    _add_card_options(card)

    export = commands.add_parser("export", help="write a self-contained Hub folder from a saved model")
    export.add_argument("model_dir", help="folder saved with save_pretrained (weights, config, tokenizer)")
    export.add_argument("out_dir", help="the Hub folder to write")
    _add_card_options(export)

    push = commands.add_parser("push", help="upload a Hub folder with huggingface_hub")
    push.add_argument("folder", help="a folder written by export / export_for_hub")
    push.add_argument("--dry-run", action="store_true", help="list the files that would be uploaded, upload nothing")
    push.add_argument("--private", action="store_true", default=None, help="create the repo private")
    push.add_argument("--token", help="Hub token (default: the stored login)")
    push.add_argument("--commit-message", help="commit message")
    _add_card_options(push, repo_id_required=True)

    validate = commands.add_parser("validate", help="check a model card")
    validate.add_argument("path", help="a README.md or a folder holding one")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "card":
        card = validate_card(card_for_folder(args.folder, args.results, **_card_options(args)))
        if args.output == "-":
            print(str(card))
        else:
            output = Path(args.output or Path(args.folder) / "README.md")
            card.save(output)
            print(f"wrote {output}")
    elif args.command == "validate":
        path = Path(args.path)
        path = path / "README.md" if path.is_dir() else path
        card = validate_card(path.read_text(encoding="utf-8"))
        results = card.data.eval_results or []
        print(f"{path}: valid ({len(results)} model-index results)")
    elif args.command == "export":
        model, tokenizer = hub.load_for_export(args.model_dir)
        out = hub.export_for_hub(model, tokenizer, args.out_dir, results=args.results, **_card_options(args))
        print(f"wrote {out}")
    else:
        if args.results is not None:
            hub.attach_results(args.folder, args.results, **_card_options(args))
        hub.push_folder(
            args.folder, args.repo_id, token=args.token, private=args.private,
            commit_message=args.commit_message, dry_run=args.dry_run,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
