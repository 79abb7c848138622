"""Train and score the fast-weight encoder-decoder (Schlag et al. 2021 sec. 6.2) on English -> German translation.

The paper trains on WMT14 En-De, which does not install offline here. What does (``--task gettext``, the default;
training/gettext_corpus.py): the German gettext catalogs of this machine's Debian packages, the English messages of
51 packages (postgresql, git, iso-codes, gtk, krb5, libc, glib, coreutils, dpkg, ...) and their German
translations: 34,061 pairs after the corpus's stated cleaning (about 0.55 M tokens of training text), split by a
hash of the English side, a joint BPE trained on the training split. Software messages, not news: short, repetitive,
with format strings.

``--task cipher`` is the synthetic alternative kept from before the corpus was found, a **reversing word cipher**: a
source sentence is ``min_len .. max_len`` words drawn uniformly from ``num_words`` source words ``s0 .. s{V-1}``; its
translation is the same sentence in reverse order with every word replaced through a fixed random one-to-one
dictionary into target words ``t0 .. t{V-1}`` (seeded by ``task_seed``). At ``--num_words 16 --max_len 6`` ELU/sum
and the softmax baseline both reach BLEU 100 in 40 s; at ``--num_words 32 --max_len 25`` neither learned anything
in 3,000 steps (measured 2026-11-26): it does not separate the models.

Models: ``--model fwp`` (``FastWeightSeq2SeqForConditionalGeneration``: ``--feature_map``, ``--update_rule``,
``--cross_attention``, ``--d_dot``; d_dot sets FAVOR+'s m = d_dot / 2 or DPFP's nu = d_dot / (2 head_dim), Table 6)
or ``--model softmax`` (transformers' ``BartForConditionalGeneration`` of the same size: softmax attention
everywhere, the paper's "Standard" row; learned positions where ours are sinusoidal). Scores: corpus BLEU and chrF
(sacrebleu's defaults, extra ``mt``) of beam-search translations of the validation and test sets against the
catalogs' own text, and exact-match accuracy.

    python -m training.train_seq2seq --feature_map dpfp --d_dot 128 --output_dir outputs/mt --max_steps 1500

The paper's Table 1 at this machine's scale (d 128, 4 heads of d_key 32, 2 + 2 layers; d_dot 32 / 128 / 256 =
1 / 4 / 8 d_key as the paper's 64 / 256 / 512 with d_key 64) is ``docs/results/mt_gettext/run.sh``; its table is in
docs/RESULTS.md.

Writes ``<output_dir>/results.json`` (the run's provenance, the corpus manifest, arguments, parameter count, losses,
validation and test BLEU / chrF) and, for the gettext task, the model and its tokenizer under ``<output_dir>/final``
(``AutoModelForSeq2SeqLM`` / ``AutoTokenizer``).
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Literal, Optional, Sequence

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import (  # noqa: E402
    BartConfig, BartForConditionalGeneration, PreTrainedModel, Seq2SeqTrainer, Seq2SeqTrainingArguments,
)

from modeling_fwp import FastWeightSeq2SeqConfig, FastWeightSeq2SeqForConditionalGeneration  # noqa: E402

from .arguments import ParsedArguments, parse_arguments  # noqa: E402
from .trainer_utils import KeepFreedCpuMemory  # noqa: E402

PAD, BOS, EOS = 0, 1, 2
SPECIALS = ["<pad>", "<s>", "</s>"]


@dataclass
class ModelArguments:
    """The model trained: the fast-weight encoder-decoder or the softmax baseline, and their size."""

    model: Literal["fwp", "softmax"] = field(default="fwp", metadata={
        "help": "fwp: FastWeightSeq2SeqForConditionalGeneration; softmax: a BART of the same size"})
    feature_map: Literal["elu", "dpfp", "favor", "relu", "identity"] = field(default="elu", metadata={
        "help": "fwp: the feature map phi"})
    update_rule: Literal["sum", "delta"] = field(default="sum", metadata={"help": "fwp: the decoder's update rule"})
    cross_attention: Literal["linear", "softmax"] = field(default="linear", metadata={
        "help": "fwp: linear (fast-weight) or softmax cross-attention"})
    d_dot: int = field(default=0, metadata={
        "help": "fwp: the feature dimension (Table 6); 0: the map's own (elu: head_dim; favor: 2 * 64; dpfp: 2 * "
                "head_dim)"})
    hidden_size: int = field(default=64, metadata={"help": "model width"})
    num_attention_heads: int = field(default=4, metadata={"help": "heads per attention layer"})
    num_layers: int = field(default=2, metadata={"help": "encoder layers, and as many decoder layers"})
    intermediate_size: int = field(default=256, metadata={"help": "feed-forward width"})
    dropout: float = field(default=0.0, metadata={"help": "dropout probability"})


@dataclass
class TaskArguments:
    """The data (the gettext corpus or the reversing word cipher, module docstring) and the scoring."""

    task: Literal["gettext", "cipher"] = field(default="gettext", metadata={
        "help": "gettext: English -> `language` messages of the installed Debian catalogs "
                "(training/gettext_corpus.py); "
                "cipher: the reversing word cipher"})
    language: str = field(default="de", metadata={"help": "gettext: the target language's locale name"})
    locale_dir: str = field(default="/usr/share/locale", metadata={"help": "gettext: where the catalogs lie"})
    vocab_size: int = field(default=8000, metadata={"help": "gettext: the joint BPE's vocabulary size"})
    max_tokens: int = field(default=48, metadata={
        "help": "gettext: pairs longer than this many BPE tokens on either side are dropped (and counted)"})
    num_words: int = field(default=32, metadata={"help": "cipher: source (and target) vocabulary size V"})
    min_len: int = field(default=3, metadata={"help": "cipher: shortest sentence, in words"})
    max_len: int = field(default=10, metadata={"help": "cipher: longest sentence, in words"})
    train_examples: int = field(default=20000, metadata={"help": "cipher: training sentences"})
    eval_examples: int = field(default=500, metadata={
        "help": "validation and test sentences scored (each; gettext: a fixed random subset of the split, 0: all)"})
    task_seed: int = field(default=1234, metadata={"help": "seed of the cipher's dictionary and of the scored subset"})
    num_beams: int = field(default=4, metadata={"help": "beam size of the scored translations"})
    eval_batch_size: int = field(default=100, metadata={"help": "sentences per generate call when scoring"})


class CipherTask:
    """The reversing word cipher: vocabulary ``SPECIALS + s0..s{V-1} + t0..t{V-1}`` (one token per word)."""

    name = "reversing word cipher (training/train_seq2seq.py docstring)"

    def __init__(self, args: TaskArguments) -> None:
        if not 1 <= args.min_len <= args.max_len:
            raise ValueError(f"need 1 <= min_len <= max_len, got {args.min_len}, {args.max_len}")
        self.args = args
        generator = torch.Generator().manual_seed(args.task_seed)
        self.dictionary = torch.randperm(args.num_words, generator=generator)  # source word i -> target word
        self.vocab = SPECIALS + [f"s{i}" for i in range(args.num_words)] + [f"t{i}" for i in range(args.num_words)]
        self.vocab_size, self.max_tokens, self.manifest = len(self.vocab), args.max_len, None

    def sample(self, count: int, seed: int) -> List[Dict[str, torch.Tensor]]:
        generator = torch.Generator().manual_seed(self.args.task_seed * 1000 + seed)
        lengths = torch.randint(self.args.min_len, self.args.max_len + 1, (count,), generator=generator)
        examples = []
        for length in lengths.tolist():
            words = torch.randint(0, self.args.num_words, (length,), generator=generator)
            source = words + len(SPECIALS)
            target = self.dictionary[words.flip(0)] + len(SPECIALS) + self.args.num_words
            labels = torch.cat([target, torch.tensor([EOS])])
            examples.append({"input_ids": source, "labels": labels, "reference": self.decode(labels.tolist())})
        return examples

    def split(self, name: str) -> List[Dict[str, torch.Tensor]]:
        """The training sentences, or the scored validation / test sentences (independent draws)."""
        if name == "train":
            return self.sample(self.args.train_examples, seed=0)
        return self.sample(self.args.eval_examples, seed={"valid": 1, "test": 2}[name])

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(self.vocab[i] for i in ids if i >= len(SPECIALS))


class GettextTask:
    """English -> ``language`` translation of the installed gettext catalogs (training/gettext_corpus.py)."""

    name = "gettext catalogs (training/gettext_corpus.py)"

    def __init__(self, args: TaskArguments) -> None:
        from .gettext_corpus import build_splits

        self.args = args
        self.corpus = build_splits(args.locale_dir, args.language, args.vocab_size, args.max_tokens)
        self.vocab_size, self.max_tokens = self.corpus.tokenizer.get_vocab_size(), args.max_tokens
        self.manifest = self.corpus.manifest

    def split(self, name: str) -> List[Dict[str, torch.Tensor]]:
        """Every training pair, or ``eval_examples`` validation / test pairs (a fixed random subset; 0: all)."""
        rows = list(zip(self.corpus.pairs[name], self.corpus.texts[name]))
        if name != "train" and 0 < self.args.eval_examples < len(rows):
            order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(self.args.task_seed))
            rows = [rows[i] for i in sorted(order[:self.args.eval_examples].tolist())]
        return [{"input_ids": torch.tensor(source), "labels": torch.tensor(target + [EOS]), "reference": text[1]}
                for (source, target), text in rows]

    def decode(self, ids: Sequence[int]) -> str:
        return self.corpus.tokenizer.decode([i for i in ids if i >= len(SPECIALS)])

    def save_tokenizer(self, folder: str) -> None:
        """The BPE as a ``PreTrainedTokenizerFast`` beside the model, so ``AutoTokenizer`` loads the pair."""
        from transformers import PreTrainedTokenizerFast

        PreTrainedTokenizerFast(tokenizer_object=self.corpus.tokenizer, pad_token="<pad>", bos_token="<s>",
                                eos_token="</s>", unk_token="<unk>").save_pretrained(folder)


def collate(examples: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    """Right-pads sources with ``PAD`` (and an attention mask) and labels with -100."""
    batch = {}
    for key, fill in (("input_ids", PAD), ("labels", -100)):
        rows = [e[key] for e in examples]
        batch[key] = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=fill)
    batch["attention_mask"] = (torch.arange(batch["input_ids"].shape[1])[None]
                               < torch.tensor([len(e["input_ids"]) for e in examples])[:, None]).long()
    return batch


def build_model(args: ModelArguments, vocab_size: int, max_len: int) -> PreTrainedModel:
    """The fast-weight model of the arguments, or the softmax baseline (BART) of the same size."""
    common = dict(vocab_size=vocab_size, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS,
                  decoder_start_token_id=PAD)
    if args.model == "softmax":
        return BartForConditionalGeneration(BartConfig(
            d_model=args.hidden_size, encoder_layers=args.num_layers, decoder_layers=args.num_layers,
            encoder_attention_heads=args.num_attention_heads, decoder_attention_heads=args.num_attention_heads,
            encoder_ffn_dim=args.intermediate_size, decoder_ffn_dim=args.intermediate_size, dropout=args.dropout,
            max_position_embeddings=max_len + 8, forced_eos_token_id=None, **common))
    if args.model != "fwp":
        raise ValueError(f"`model` must be 'fwp' or 'softmax', got {args.model!r}")
    head_dim = args.hidden_size // args.num_attention_heads
    maps = {}
    if args.d_dot and args.feature_map == "favor":
        maps["favor_features"] = args.d_dot // 2
    elif args.d_dot and args.feature_map == "dpfp":
        maps["dpfp_nu"] = args.d_dot // (2 * head_dim)
    elif args.d_dot and args.d_dot != head_dim:
        raise ValueError(f"`d_dot` of feature_map {args.feature_map!r} is head_dim = {head_dim}, got {args.d_dot}")
    config = FastWeightSeq2SeqConfig(
        hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads, num_hidden_layers=args.num_layers,
        intermediate_size=args.intermediate_size, hidden_dropout=args.dropout, feature_map=args.feature_map,
        update_rule=args.update_rule, cross_attention=args.cross_attention, **maps, **common)
    if args.d_dot and config.feature_dim != args.d_dot:
        raise ValueError(f"`d_dot` {args.d_dot} is not reachable with {args.feature_map!r} (got {config.feature_dim})")
    return FastWeightSeq2SeqForConditionalGeneration(config)


@torch.no_grad()
def score(
    model: PreTrainedModel, task: CipherTask, examples: Sequence[Dict[str, Any]], num_beams: int, batch_size: int
) -> Dict[str, float]:
    """Beam-search translations of ``examples``: corpus BLEU and chrF (sacrebleu) and exact-match accuracy."""
    import sacrebleu

    model.eval()
    hypotheses, references = [], []
    for start in range(0, len(examples), batch_size):
        batch = collate(examples[start:start + batch_size])
        out = model.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                             num_beams=num_beams, max_new_tokens=task.max_tokens + 2, do_sample=False)
        hypotheses += [task.decode(row.tolist()) for row in out]
        references += [e["reference"] for e in examples[start:start + batch_size]]
    return {
        "bleu": sacrebleu.corpus_bleu(hypotheses, [references]).score,
        "chrf": sacrebleu.corpus_chrf(hypotheses, [references]).score,
        "exact_match": sum(h == r for h, r in zip(hypotheses, references)) / len(references),
        "example": {"hypothesis": hypotheses[0], "reference": references[0]},
    }


def parse_args(argv: Optional[List[str]] = None) -> ParsedArguments:
    """The command line: the model, the task and every ``Seq2SeqTrainingArguments`` option (``--help``: defaults)."""
    return parse_arguments((ModelArguments, TaskArguments, Seq2SeqTrainingArguments), argv, description=__doc__,
                           defaults={"output_dir": "outputs/mt"})


def main(argv: Optional[List[str]] = None) -> Dict:
    """Trains on the task, scores valid and test, writes ``<output_dir>/results.json`` (with the run's provenance)
    and, for the gettext corpus, the model and its tokenizer under ``<output_dir>/final``; returns the results."""
    from .result_file import RunRecord

    record = RunRecord.start("python -m training.train_seq2seq", argv)
    model_args, task_args, training_args = parse_args(argv).groups
    task = GettextTask(task_args) if task_args.task == "gettext" else CipherTask(task_args)
    torch.manual_seed(training_args.seed)
    model = build_model(model_args, task.vocab_size, task.max_tokens)
    trainer = Seq2SeqTrainer(model=model, args=training_args, data_collator=collate, train_dataset=task.split("train"),
                             callbacks=[KeepFreedCpuMemory()])
    train = trainer.train()
    results = {
        "task": task.name, "corpus": task.manifest,
        "args": {"model": asdict(model_args), "task": asdict(task_args),
                 "training": {k: getattr(training_args, k) for k in ("max_steps", "num_train_epochs", "learning_rate",
                                                                     "per_device_train_batch_size", "seed")}},
        "parameters": sum(p.numel() for p in model.parameters()),
        "train_loss": train.training_loss,
        "train_seconds": train.metrics.get("train_runtime"),
        "loss_curve": [e["loss"] for e in trainer.state.log_history if "loss" in e],
        **{split: score(model, task, task.split(split), task_args.num_beams, task_args.eval_batch_size)
           for split in ("valid", "test")},
    }
    if isinstance(task, GettextTask):
        trainer.save_model(str(Path(training_args.output_dir, "final")))
        task.save_tokenizer(str(Path(training_args.output_dir, "final")))
    record.write(Path(training_args.output_dir, "results.json"), results)
    print(json.dumps({k: results[k] for k in ("parameters", "train_loss", "valid", "test")}, default=str))
    return results


if __name__ == "__main__":
    main()
