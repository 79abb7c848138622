"""The project's main job: train a small Delta Net from scratch on real Wikipedia text, on CPU.

Steps (`python -m training.demo`, or `make demo`):
1. prepare the embedded offline corpus (`training.data`, gensim's enwiki test dump) into --data_dir;
2. train a byte-level BPE tokenizer on the train split (`training.tokenizer`);
3. tokenize documents (each followed by `<|endoftext|>`), concatenate and cut into fixed
   --block_size segments (no padding);
4. train `DeltaNetForCausalLM` (DPFP-1 feature map, delta rule) with transformers' Trainer for a
   wall-clock budget (--max_train_minutes): the cosine learning-rate schedule re-estimates the number of steps
   that fit from the measured step time, and a callback stops at the budget (`training.trainer_utils`); with
   --max_steps, Trainer's own schedule over those steps (the budget still stops);
5. validation perplexity: exp of the token-weighted mean next-token loss over the whole valid split
   (cut into --block_size segments, each read from an empty state), next to a unigram baseline;
6. sample a continuation of --prompt with `model.generate` (fixed seed, cache on) and check that
   greedy decoding gives the same tokens with and without the cache;
7. save model + tokenizer (`save_pretrained`) to <output_dir>/model, reload them and compare logits;
   write <output_dir>/results.json and print a results table;
8. with --push_to_hub (Trainer's Hub options: --hub_model_id, --hub_private_repo, --hub_token, and --hub_dry_run):
   write <output_dir>/hub_export (weights, code for trust_remote_code, tokenizer, results.json and this project's
   model card filled from it) and upload it (`training.hub_options.push_if_requested`).

Options: the model's size, the data, the sample, and every `TrainingArguments` option (`--learning_rate`,
`--per_device_train_batch_size`, `--bf16`, `--report_to`, ...); `--help` lists them with their defaults.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import copy  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Optional  # noqa: E402

import datasets  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402
from transformers import (  # noqa: E402
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Trainer,
    TrainingArguments,
    default_data_collator,
    set_seed,
)

from .arguments import HubExportArguments, ParsedArguments, parse_arguments, require_positive  # noqa: E402
from .data import load_wiki_splits, prepare_wiki  # noqa: E402
from .hub_options import hub_request, push_if_requested  # noqa: E402
from .result_file import environment  # noqa: E402
from .tokenizer import train_bpe_tokenizer  # noqa: E402
from .trainer_utils import KeepFreedCpuMemory, WallClockBudget, budget_optimizers  # noqa: E402

logger = logging.getLogger("training.demo")


@dataclass
class DemoModelArguments:
    """The Delta Net's size (``DeltaNetConfig`` fields) and its BPE vocabulary."""

    hidden_size: int = field(default=256, metadata={"help": "model width"})
    num_hidden_layers: int = field(default=4, metadata={"help": "layers"})
    num_attention_heads: Optional[int] = field(default=None, metadata={
        "help": "heads; unset: hidden_size // 64, at least 1"})
    intermediate_size: Optional[int] = field(default=None, metadata={
        "help": "feed-forward size; unset: 4 * hidden_size"})
    vocab_size: int = field(default=8192, metadata={"help": "BPE vocabulary size"})


@dataclass
class DemoRunArguments:
    """The corpus, the wall-clock budget, the evaluation and the generated sample."""

    data_dir: str = field(default="data/wiki", metadata={"help": "prepared corpus folder (created if missing)"})
    block_size: int = field(default=256, metadata={"help": "tokens per training segment"})
    max_train_minutes: float = field(default=5.0, metadata={
        "help": "wall-clock training budget in minutes (--max_steps: a fixed number of steps, still capped by it)"})
    max_eval_blocks: Optional[int] = field(default=None, metadata={
        "help": "evaluate only this many valid segments (smoke tests)"})
    prompt: str = field(default="The history of the city", metadata={"help": "prompt of the generated sample"})
    max_new_tokens: int = field(default=60, metadata={"help": "tokens generated after --prompt"})


# This script's choices for Trainer options (shown by --help, overridden like any option); --max_steps -1: as many
# steps as fit in --max_train_minutes.
TRAINING_DEFAULTS = dict(
    output_dir="outputs/demo", per_device_train_batch_size=8, learning_rate=2e-3, warmup_steps=10, weight_decay=0.01,
    adam_beta2=0.98, lr_scheduler_type="cosine", max_grad_norm=1.0, seed=0, logging_steps=10, logging_first_step=True,
    save_strategy="no", use_cpu=not torch.cuda.is_available(), disable_tqdm=True,
)


def parse_args(argv: list[str] | None = None) -> ParsedArguments:
    """The command line (``--help``: every option with its default); ValueError names a bad option."""
    args = parse_arguments((DemoModelArguments, DemoRunArguments, TrainingArguments, HubExportArguments), argv,
                           description=__doc__, defaults=TRAINING_DEFAULTS)
    require_positive(args, ("max_train_minutes", "hidden_size", "num_hidden_layers", "vocab_size", "block_size",
                            "per_device_train_batch_size", "learning_rate", "max_new_tokens"),
                     minimum={"block_size": 2})
    if args.max_steps == 0:
        raise ValueError("--max_steps must be positive, or -1 for as many steps as fit in --max_train_minutes")
    return args


# --------------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------------


def tokenize_splits(
    data_dir: Path, tokenizer: PreTrainedTokenizerBase, block_size: int
) -> tuple[datasets.Dataset, list[int], list[int], int]:
    """Return (train segments Dataset with input_ids/labels, train ids, valid ids, train documents).

    Each document is followed by eos; documents are concatenated and cut into `block_size` segments
    (the train remainder is dropped; valid keeps everything for the evaluation).
    """
    raw = load_wiki_splits(data_dir, by="paragraph")
    eos = tokenizer.eos_token_id

    def tokenize(batch: dict[str, list[str]]) -> dict[str, list[list[int]]]:
        return {"input_ids": [ids + [eos] for ids in tokenizer(batch["text"], add_special_tokens=False)["input_ids"]]}

    def group(batch: dict[str, list[list[int]]]) -> dict[str, list[list[int]]]:
        flat = [t for ids in batch["input_ids"] for t in ids]
        n = len(flat) // block_size * block_size
        blocks = [flat[i:i + block_size] for i in range(0, n, block_size)]
        return {"input_ids": blocks, "labels": [list(b) for b in blocks]}

    tokenized = raw.map(tokenize, batched=True, remove_columns=["text"], desc="tokenize")
    # One batch holding the whole split, so that no tokens are lost at batch boundaries.
    train = tokenized["train"].map(group, batched=True, batch_size=len(tokenized["train"]), desc="group")
    train_ids = [t for ids in tokenized["train"]["input_ids"] for t in ids]
    valid_ids = [t for ids in tokenized["valid"]["input_ids"] for t in ids]
    return train.with_format("torch"), train_ids, valid_ids, len(tokenized["train"])


def valid_blocks(ids: list[int], block_size: int, max_blocks: int | None = None) -> list[torch.Tensor]:
    """Cut `ids` into consecutive segments of `block_size` (the last may be shorter, >= 2 tokens)."""
    blocks = [torch.tensor(ids[i:i + block_size]) for i in range(0, len(ids), block_size)]
    blocks = [b for b in blocks if len(b) >= 2]
    return blocks[:max_blocks] if max_blocks else blocks


# --------------------------------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------------------------------


@torch.no_grad()
def evaluate_loss(model: torch.nn.Module, blocks: list[torch.Tensor], batch_size: int) -> tuple[float, int]:
    """Token-weighted mean next-token cross entropy (nats) over `blocks`, and the number of tokens."""
    model.eval()
    total, count = 0.0, 0
    by_length: dict[int, list[torch.Tensor]] = {}
    for b in blocks:
        by_length.setdefault(len(b), []).append(b)
    for same_length in by_length.values():
        for i in range(0, len(same_length), batch_size):
            ids = torch.stack(same_length[i:i + batch_size]).to(model.device)
            logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
            targets = ids[:, 1:]
            total += F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), reduction="sum").item()
            count += targets.numel()
    return total / count, count


def unigram_loss(train_ids: list[int], blocks: list[torch.Tensor], vocab_size: int) -> float:
    """Loss of an add-one-smoothed unigram model from train counts on the tokens `evaluate_loss` scores."""
    counts = torch.bincount(torch.tensor(train_ids), minlength=vocab_size).double() + 1.0
    log_probs = counts.log() - counts.sum().log()
    targets = torch.cat([b[1:] for b in blocks])
    return float(-log_probs[targets].mean())


@torch.no_grad()
def generate_text(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompt: str, max_new_tokens: int, seed: int
) -> dict[str, Any]:
    """Sample a continuation (seeded, cache on) and compare greedy decoding with and without cache."""
    model.eval()
    enc = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).to(model.device)
    n_prompt = enc["input_ids"].shape[1]
    set_seed(seed)
    start = time.perf_counter()
    sampled = model.generate(
        **enc, do_sample=True, top_k=40, temperature=0.8, max_new_tokens=max_new_tokens, use_cache=True,
        pad_token_id=tokenizer.pad_token_id,
    )
    seconds = time.perf_counter() - start
    new_tokens = sampled[0, n_prompt:]
    check_tokens = min(20, max_new_tokens)
    greedy = {
        use_cache: model.generate(
            **enc, do_sample=False, max_new_tokens=check_tokens, min_new_tokens=check_tokens, use_cache=use_cache,
            pad_token_id=tokenizer.pad_token_id,
        )[0, n_prompt:].tolist()
        for use_cache in (True, False)
    }
    return {
        "prompt": prompt,
        "sampling": {"do_sample": True, "top_k": 40, "temperature": 0.8, "seed": seed},
        "text": tokenizer.decode(new_tokens, skip_special_tokens=False),
        "new_tokens": int(new_tokens.numel()),
        "seconds": seconds,
        "tokens_per_second": new_tokens.numel() / seconds if seconds > 0 else None,
        "greedy_text": tokenizer.decode(greedy[True]),
        "greedy_cache_matches_no_cache": greedy[True] == greedy[False],
    }


# --------------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------------


def _load_model_classes():
    try:
        from modeling_fwp import DeltaNetConfig, DeltaNetForCausalLM
    except ImportError as err:  # the package is installed by `make install` (pip install -e .)
        raise ImportError(f"training.demo needs modeling_fwp.DeltaNetConfig/DeltaNetForCausalLM: {err}") from err
    return DeltaNetConfig, DeltaNetForCausalLM


def _format_table(rows: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def build_model(args: ParsedArguments, tokenizer: PreTrainedTokenizerBase) -> torch.nn.Module:
    """A new ``DeltaNetForCausalLM`` (DPFP-1 feature map, delta rule) sized by the arguments, for ``tokenizer``."""
    DeltaNetConfig, DeltaNetForCausalLM = _load_model_classes()
    heads = args.num_attention_heads or max(1, args.hidden_size // 64)
    config = DeltaNetConfig(
        vocab_size=len(tokenizer), hidden_size=args.hidden_size, num_hidden_layers=args.num_hidden_layers,
        num_attention_heads=heads, intermediate_size=args.intermediate_size or 4 * args.hidden_size,
        feature_map="dpfp", dpfp_nu=1, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = DeltaNetForCausalLM(config)
    model.config.use_cache = False  # no state to keep while training
    n_params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    logger.info("DeltaNetForCausalLM: %.2fM parameters (%d layers, hidden %d, %d heads)", n_params / 1e6,
                args.num_hidden_layers, args.hidden_size, heads)
    return model


def build_trainer(
    args: ParsedArguments, model: torch.nn.Module, train_ds: datasets.Dataset, out_dir: Path
) -> tuple[Trainer, WallClockBudget]:
    """The demo's ``Trainer`` (Trainer's optimizer, weight decay on matrices only; warmup + cosine over the wall-clock
    budget, or Trainer's schedule over ``--max_steps``; checkpoints in ``<output_dir>/trainer`` only if asked for
    with ``--save_strategy``) and its budget."""
    training_args = copy.copy(args.training)
    training_args.output_dir = str(out_dir / "trainer")
    optimizers, budget = budget_optimizers(model, training_args, args.max_train_minutes)
    trainer = Trainer(
        model=model, args=training_args, train_dataset=train_ds, data_collator=default_data_collator,
        optimizers=optimizers, callbacks=[budget, KeepFreedCpuMemory()],
    )
    return trainer, budget


def run_training(
    args: ParsedArguments, model: torch.nn.Module, train_ds: datasets.Dataset, out_dir: Path,
    timings: dict[str, float],
) -> dict[str, Any]:
    """Step 4: trains ``model`` within the budget and returns the ``training`` entry of the results."""
    trainer, budget = build_trainer(args, model, train_ds, out_dir)
    t = time.perf_counter()
    train_output = trainer.train()
    timings["train_s"] = time.perf_counter() - t
    if Path(trainer.args.output_dir).is_dir() and not any(Path(trainer.args.output_dir).iterdir()):
        Path(trainer.args.output_dir).rmdir()  # Trainer creates it even with save_strategy="no"
    steps = trainer.state.global_step
    batch_size = args.per_device_train_batch_size * trainer.args.world_size * args.gradient_accumulation_steps
    train_tokens = steps * batch_size * args.block_size
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {
        "steps": steps, "batch_size": batch_size, "block_size": args.block_size, "tokens_seen": train_tokens,
        "epochs": train_tokens / max(1, len(train_ds) * args.block_size), "budget_s": args.max_train_minutes * 60.0,
        "stopped_by_budget": budget.stopped_by_budget, "seconds": timings["train_s"],
        "tokens_per_second": train_tokens / timings["train_s"], "peak_lr": args.learning_rate,
        "mean_train_loss": train_output.training_loss, "last_logged_loss": losses[-1] if losses else None,
        "loss_curve": [{"step": h["step"], "loss": h["loss"]} for h in trainer.state.log_history if "loss" in h],
    }


def save_and_reload(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, model_dir: Path, probe: torch.Tensor, prompt: str
) -> tuple[float, bool]:
    """Saves model and tokenizer, loads them back with the Auto classes and returns (max |logit difference| on
    ``probe [1, T]``, whether the tokenizer round trip of ``prompt`` gives the same ids)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    reloaded = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    reloaded_tok = AutoTokenizer.from_pretrained(model_dir)
    with torch.no_grad():
        reference = model.cpu()(input_ids=probe, use_cache=False).logits
        reload_diff = (reloaded(input_ids=probe, use_cache=False).logits - reference).abs().max().item()
    ids = lambda tok: tok(prompt, add_special_tokens=False)["input_ids"]  # noqa: E731
    return reload_diff, ids(reloaded_tok) == ids(tokenizer)


def summary_rows(args: ParsedArguments, results: dict[str, Any], vocab_size: int, out_dir: Path) -> list:
    """The rows of the table printed at the end, from ``results``."""
    training, evaluation, generation = results["training"], results["evaluation"], results["generation"]
    data, saved, last_loss = results["data"], results["saved"], results["training"]["last_logged_loss"]
    valid_loss, uni_loss = evaluation["loss"], evaluation["unigram_loss"]
    n_params = results["model"]["parameters"]
    return [
        ("model", f"DeltaNetForCausalLM, {n_params / 1e6:.2f}M params, {args.num_hidden_layers} layers x "
                  f"{args.hidden_size}, "
                  "DPFP-1, delta rule"),
        ("data", f"{data['train_documents']} Wikipedia articles, {data['train_tokens']:,} train tokens "
                 f"(BPE {vocab_size})"),
        ("training", f"{training['steps']} steps x {training['batch_size']} x {args.block_size} tokens = "
                     f"{training['tokens_seen']:,} tokens ({training['epochs']:.2f} epochs) in "
                     f"{training['seconds']:.0f} s, {training['tokens_per_second']:.0f} tokens/s"),
        ("train loss", f"last logged {last_loss:.3f}" if last_loss is not None else "n/a"),
        ("valid perplexity", f"{math.exp(valid_loss):.1f} (loss {valid_loss:.3f}, {evaluation['scored_tokens']:,} "
                             f"tokens); unigram baseline {math.exp(uni_loss):.1f}"),
        ("generation", f"{generation['new_tokens']} tokens in {generation['seconds']:.2f} s; greedy cache == no cache: "
                       f"{generation['greedy_cache_matches_no_cache']}"),
        ("reload", f"max |logit diff| {saved['reload_max_abs_logit_diff']:.2e}, tokenizer round trip "
                   f"{saved['tokenizer_roundtrip']}"),
        ("saved", f"{saved['model_dir']} and {out_dir / 'results.json'}"),
    ]


def prepare_tokens(args: ParsedArguments, data_dir: Path, timings: dict[str, float]) -> dict[str, Any]:
    """Steps 1-3: the corpus (prepared unless present), the BPE tokenizer and the tokenized splits."""
    t = time.perf_counter()
    if all((data_dir / f"{s}.txt").is_file() for s in ("train", "valid", "test")):
        logger.info("using the prepared corpus in %s", data_dir)
    else:
        prepare_wiki(data_dir)
    meta_path = data_dir / "meta.json"
    data_meta = json.loads(meta_path.read_text(encoding="utf-8")) if meta_path.is_file() else {}
    timings["prepare_data_s"] = time.perf_counter() - t

    t = time.perf_counter()
    tokenizer = train_bpe_tokenizer(data_dir / "train.txt", vocab_size=args.vocab_size)
    timings["train_tokenizer_s"] = time.perf_counter() - t
    t = time.perf_counter()
    train_ds, train_ids, valid_ids, n_train_docs = tokenize_splits(data_dir, tokenizer, args.block_size)
    eval_blocks = valid_blocks(valid_ids, args.block_size, args.max_eval_blocks)
    timings["tokenize_s"] = time.perf_counter() - t
    logger.info("train: %d tokens -> %d segments of %d; valid: %d tokens", len(train_ids), len(train_ds),
                args.block_size, len(valid_ids))
    if len(train_ds) == 0:
        raise ValueError(f"the train split has fewer than --block_size={args.block_size} tokens")
    return dict(data_meta=data_meta, tokenizer=tokenizer, train_ds=train_ds, train_ids=train_ids, valid_ids=valid_ids,
                n_train_docs=n_train_docs, eval_blocks=eval_blocks)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    hub = hub_request(args)  # acted on by push_if_requested at the end, not by Trainer
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    transformers.logging.set_verbosity_warning()
    transformers.utils.logging.disable_progress_bar()
    datasets.disable_progress_bars()
    out_dir, data_dir = Path(args.output_dir), Path(args.data_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}
    set_seed(args.seed)

    # 1-3. data and tokenizer
    prepared = prepare_tokens(args, data_dir, timings)
    tokenizer, train_ds, eval_blocks = prepared["tokenizer"], prepared["train_ds"], prepared["eval_blocks"]
    train_ids = prepared["train_ids"]

    # 4. model and training
    model = build_model(args, tokenizer)
    n_params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    training = run_training(args, model, train_ds, out_dir, timings)

    # 5. evaluation
    t = time.perf_counter()
    valid_loss, valid_tokens = evaluate_loss(model, eval_blocks, args.per_device_eval_batch_size)
    timings["evaluate_s"] = time.perf_counter() - t
    uni_loss = unigram_loss(train_ids, eval_blocks, len(tokenizer))

    # 6. generation
    model.config.use_cache = True
    model.generation_config.use_cache = True
    t = time.perf_counter()
    generation = generate_text(model, tokenizer, args.prompt, args.max_new_tokens, args.seed)
    timings["generate_s"] = time.perf_counter() - t

    # 7. save, reload, compare
    model_dir = out_dir / "model"
    probe = eval_blocks[0][None, :32]
    reload_diff, tokenizer_roundtrip = save_and_reload(model, tokenizer, model_dir, probe, args.prompt)

    data_meta = prepared["data_meta"]
    results = {
        "model": {"class": type(model).__name__, "parameters": n_params, "config": model.config.to_dict()},
        "data": {"dir": str(data_dir), "source": data_meta.get("source") or str(data_dir),  # no meta.json: the folder
                 "splits": data_meta.get("splits"),
                 "train_documents": prepared["n_train_docs"], "train_tokens": len(train_ids),
                 "valid_tokens": len(prepared["valid_ids"]), "tokenizer": f"byte-level BPE, {len(tokenizer)} tokens"},
        "training": training,
        "evaluation": {
            "split": "valid", "segment_tokens": args.block_size, "scored_tokens": valid_tokens,
            "loss": valid_loss, "perplexity": math.exp(valid_loss),
            "unigram_loss": uni_loss, "unigram_perplexity": math.exp(uni_loss),
        },
        "generation": generation,
        "saved": {"model_dir": str(model_dir), "reload_max_abs_logit_diff": reload_diff,
                  "tokenizer_roundtrip": tokenizer_roundtrip},
        "timings_s": timings,
        "environment": environment(),
        "args": args.record(),
    }
    (out_dir / "results.json").write_text(json.dumps(results, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")

    # 8. Hub export and upload
    pushed = push_if_requested(hub, model, tokenizer, out_dir, results=out_dir / "results.json")

    rows = summary_rows(args, results, len(tokenizer), out_dir)
    if pushed is not None:
        rows.append(("hub", f"{out_dir / 'hub_export'} " + ("listed (dry run)" if hub.hub_dry_run else "uploaded")))
    print("\n=== Delta Net demo ===")
    print(_format_table(rows))
    print(f"\nPrompt: {args.prompt!r}\nSample: {generation['text']!r}\nGreedy: {generation['greedy_text']!r}\n")
    return results


if __name__ == "__main__":
    main()
