"""Train a small word-level Transformer-XL (optionally with a Fast Weight Layer) on the offline Wikipedia text.

The papers' recipe at toy scale, on CPU (Dai et al. 2019 sec. 3.2; Clark et al. 2022 sec. 3):
- a word-level vocabulary from the train split (words seen at least --min_count times, sorted by frequency, so that
  the adaptive softmax's head cluster holds the frequent words), as a ``tokenizers`` WordLevel tokenizer;
- the train split as one token stream (each document followed by ``<eos>``) cut into --batch_size parallel streams;
  consecutive segments of --segment_length tokens continue each stream, with the memories (and the FWL's decayed
  running update) carried from one segment to the next and gradients stopped at segment boundaries;
- AdamW, linear warm-up then cosine decay, gradient clipping at 0.25, for --minutes or --max_steps.

``python -m training.train_transfo_xl --output_dir outputs/transfo_xl [--use_fwl] [--minutes 3]`` writes the model and
tokenizer (``save_pretrained``) and ``train_log.json``.

Continued training: ``--init_from DIR`` starts from a model saved by this script (its architecture, tokenizer and
weights; ``--use_fwl`` attaches a new FWL head, ``--fwl_residual`` one that starts as the identity) and continues the
data streams where that run stopped (``--start_segment``, default: the steps of DIR's ``train_log.json``). Continuing
the base model and attaching the FWL from the same checkpoint, for the same steps on the same data, compares the two
at equal training (``benchmarks/bench_transfo_xl.py``).
"""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402
from collections import Counter  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Dict, List, Optional  # noqa: E402

import torch  # noqa: E402

import model_cards  # noqa: E402,F401  (registers the card publisher: the saved model gets this project's card)
from modeling_fwp import TransfoXLConfig, TransfoXLForCausalLM  # noqa: E402
from modeling_fwp.cache_fwp import output_cache  # noqa: E402
from modeling_fwp.convert_transfo_xl import build_word_level_tokenizer  # noqa: E402

logger = logging.getLogger("training.train_transfo_xl")

SPECIALS = ["<eos>", "<unk>"]


def read_documents(path: Path) -> List[str]:
    """Documents of a prepared split (``training.data`` layout: blocks separated by blank lines)."""
    text = Path(path).read_text(encoding="utf-8")
    return [block.strip() for block in text.split("\n\n") if block.strip()]


def build_word_vocabulary(documents: List[str], min_count: int = 3, max_size: Optional[int] = None) -> List[str]:
    """``<eos>``, ``<unk>``, then the words seen at least `min_count` times, most frequent first (ties by first
    occurrence), with the same word splitting as ``build_word_level_tokenizer(split_punctuation=True)``."""
    from tokenizers import pre_tokenizers

    split = pre_tokenizers.Whitespace()
    counts: Counter = Counter()
    for doc in documents:
        counts.update(word for word, _ in split.pre_tokenize_str(doc))
    words = [w for w, c in counts.most_common() if c >= min_count and w not in SPECIALS]
    return SPECIALS + words[: None if max_size is None else max_size - len(SPECIALS)]


def encode_stream(tokenizer, documents: List[str]) -> torch.Tensor:
    """One stream of ids: every document followed by ``<eos>``."""
    ids: List[int] = []
    for doc in documents:
        ids.extend(tokenizer(doc, add_special_tokens=False).input_ids + [tokenizer.eos_token_id])
    return torch.tensor(ids, dtype=torch.long)


def default_cutoffs(vocab_size: int) -> List[int]:
    """Head cluster of about the 15% most frequent words, a middle cluster up to 45% (two tails)."""
    cutoffs = [max(2, vocab_size * 15 // 100), max(3, vocab_size * 45 // 100)]
    return [c for c in cutoffs if c < vocab_size]


def small_config(vocab_size: int, args: argparse.Namespace) -> TransfoXLConfig:
    return TransfoXLConfig(
        vocab_size=vocab_size, cutoffs=default_cutoffs(vocab_size), hidden_size=args.hidden_size,
        embedding_size=args.hidden_size, num_attention_heads=args.heads, head_dim=args.hidden_size // args.heads,
        intermediate_size=4 * args.hidden_size, num_hidden_layers=args.layers, div_val=2, tie_projs=None,
        mem_len=args.mem_len, clamp_len=4 * args.mem_len, same_length=True, hidden_dropout=args.dropout,
        attention_dropout=0.0, eos_token_id=0, use_fwl=args.use_fwl, fwl_step_size_init=args.fwl_step_size,
        fwl_segment_length=args.segment_length, fwl_residual=args.fwl_residual, pre_lnorm=args.pre_lnorm,
    )


def continued_model(directory: Path, args: argparse.Namespace):
    """(model, tokenizer, first data segment) to continue the run saved in `directory`: its architecture and weights,
    plus a new FWL head when ``args.use_fwl`` (the only parameters not found in the checkpoint)."""
    from transformers import AutoTokenizer

    saved = TransfoXLForCausalLM.from_pretrained(directory)
    if saved.config.use_fwl and not args.use_fwl:
        raise ValueError(f"`--init_from` {directory} holds an FWL model; continuing it needs --use_fwl")
    fields = {k: v for k, v in saved.config.to_dict().items() if k in TransfoXLConfig.__dataclass_fields__}
    if args.use_fwl and not saved.config.use_fwl:
        fields = {k: v for k, v in fields.items() if not k.startswith("fwl_")}
        fields.update(use_fwl=True, fwl_step_size_init=args.fwl_step_size, fwl_segment_length=args.segment_length,
                      fwl_residual=args.fwl_residual)
    fields["hidden_dropout"] = args.dropout
    model = TransfoXLForCausalLM(TransfoXLConfig(**fields))
    missing, unexpected = model.load_state_dict(saved.state_dict(), strict=False)
    new = [name for name in missing if not name.startswith(("fwl_head.", "fwl_decay."))]
    if new or unexpected:
        raise ValueError(f"`--init_from` {directory} does not match the model: missing {new}, unexpected {unexpected}")
    log_path = directory / "train_log.json"
    log = json.loads(log_path.read_text()) if log_path.exists() else {}
    next_segment = (log.get("start_segment") or 0) + log.get("steps", 0)
    return model, AutoTokenizer.from_pretrained(args.tokenizer or directory), next_segment


def train(
    model: TransfoXLForCausalLM,
    stream: torch.Tensor,
    *,
    batch_size: int,
    segment_length: int,
    lr: float,
    minutes: float,
    max_steps: Optional[int],
    warmup_steps: int,
    log_every: int = 50,
    start_segment: int = 0,
    fwl_lr_scale: float = 1.0,
) -> Dict[str, object]:
    """Truncated BPTT over `batch_size` parallel streams with carried memories, from segment `start_segment` of the
    streams (memories start empty); the FWL's own parameters (``fwl_*``) train at `fwl_lr_scale` times the learning
    rate. Returns a log dict."""
    per_stream = (stream.numel() - 1) // batch_size
    data = stream[: per_stream * batch_size + 1]
    inputs = data[:-1].view(batch_size, per_stream)
    targets = data[1:].view(batch_size, per_stream)
    groups = {(wd, scale): [] for wd in (0.01, 0.0) for scale in (1.0, fwl_lr_scale)}
    for name, p in model.named_parameters():  # shared tensors are listed once, under lm_head
        wd = 0.0 if p.dim() < 2 or "norm" in name or "bias" in name else 0.01
        groups[wd, fwl_lr_scale if name.startswith("fwl_") else 1.0].append(p)
    optimizer = torch.optim.AdamW(
        [{"params": ps, "weight_decay": wd, "lr_scale": scale} for (wd, scale), ps in groups.items() if ps], lr=lr
    )
    budget = minutes * 60
    limit = max_steps if max_steps is not None else 10**9
    expected_steps = limit
    model.train()
    position = (start_segment * segment_length) % max(per_stream - segment_length + 1, 1)
    cache, step, start, losses, history = None, 0, time.perf_counter(), [], []
    while step < limit and time.perf_counter() - start < budget:
        if position + segment_length > per_stream:  # next epoch: restart the streams with empty memories
            cache, position = None, 0
        x = inputs[:, position : position + segment_length]
        y = targets[:, position : position + segment_length]
        position += segment_length
        # learning rate: linear warm-up, then cosine to 10% over the steps that fit (re-estimated from the speed)
        if max_steps is None and step >= 10:
            expected_steps = max(step + 1, int(step * budget / (time.perf_counter() - start)))
        progress = min(1.0, step / max(expected_steps, 1))
        scale = min(1.0, (step + 1) / warmup_steps) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        for group in optimizer.param_groups:
            group["lr"] = lr * scale * group["lr_scale"]
        out = model(x, labels=x, shift_labels=y, cache=cache, use_cache=True, logits_to_keep=1)
        cache = output_cache(out)
        optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
        optimizer.step()
        losses.append(float(out.loss.detach()))
        step += 1
        if step % log_every == 0:
            mean = sum(losses[-log_every:]) / log_every
            history.append({"step": step, "loss": mean, "seconds": round(time.perf_counter() - start, 1)})
            logger.info("step %d  loss %.3f  ppl %.1f  %.0f tok/s", step, mean, math.exp(mean),
                        step * batch_size * segment_length / (time.perf_counter() - start))
    seconds = time.perf_counter() - start
    model.eval()
    return {
        "steps": step, "seconds": round(seconds, 1), "tokens": step * batch_size * segment_length,
        "train_tokens_per_second": round(step * batch_size * segment_length / max(seconds, 1e-9), 1),
        "final_train_loss": sum(losses[-log_every:]) / len(losses[-log_every:]) if losses else None, "history": history,
    }


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data_dir", default="data/wiki")
    p.add_argument("--output_dir", default="outputs/transfo_xl")
    p.add_argument("--tokenizer", default=None, help="a saved tokenizer folder to reuse (default: build from train)")
    p.add_argument("--use_fwl", action="store_true", help="train Transformer-XL + FWL")
    p.add_argument("--fwl_residual", action="store_true", help="FWL reads h + f(h), starting as the identity")
    p.add_argument("--fwl_lr_scale", type=float, default=1.0, help="learning rate factor of the FWL's own parameters")
    p.add_argument("--init_from", default=None, help="continue from a model saved by this script (its architecture)")
    p.add_argument("--start_segment", type=int, default=None,
                   help="first segment of the data streams (default: 0, or the steps of --init_from's run)")
    p.add_argument("--pre_lnorm", action="store_true", help="pre-LayerNorm blocks")
    p.add_argument("--minutes", type=float, default=3.0)
    p.add_argument("--max_steps", type=int, default=None)
    p.add_argument("--min_count", type=int, default=3)
    p.add_argument("--hidden_size", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--segment_length", type=int, default=64)
    p.add_argument("--mem_len", type=int, default=64)
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup_steps", type=int, default=50)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--fwl_step_size", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    return p.parse_args(argv)


def main(argv=None) -> Dict[str, object]:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    data_dir, out = Path(args.data_dir), Path(args.output_dir)
    train_docs = read_documents(data_dir / "train.txt")
    if args.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    else:
        symbols = build_word_vocabulary(train_docs, args.min_count)
        tokenizer = build_word_level_tokenizer(symbols, split_punctuation=True)
    start_segment = args.start_segment or 0
    if args.init_from:
        model, tokenizer, start = continued_model(Path(args.init_from), args)
        start_segment = start if args.start_segment is None else args.start_segment
        config = model.config
    stream = encode_stream(tokenizer, train_docs)
    if not args.init_from:
        config = small_config(len(tokenizer), args)
        model = TransfoXLForCausalLM(config)
    logger.info("vocabulary %d words, cutoffs %s, %.2fM parameters, %d train tokens", len(tokenizer), config.cutoffs,
                sum(p.numel() for p in model.parameters()) / 1e6, stream.numel())
    log = train(model, stream, batch_size=args.batch_size, segment_length=args.segment_length, lr=args.lr,
                minutes=args.minutes, max_steps=args.max_steps, warmup_steps=args.warmup_steps,
                start_segment=start_segment, fwl_lr_scale=args.fwl_lr_scale)
    log.update(vars(args), vocab_size=len(tokenizer), parameters=sum(p.numel() for p in model.parameters()))
    log["start_segment"] = start_segment
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "train_log.json").write_text(json.dumps(log, indent=2) + "\n")
    logger.info("saved %s after %d steps (%.0f s), final train loss %s", out, log["steps"], log["seconds"],
                log["final_train_loss"])
    return log


if __name__ == "__main__":
    main()
