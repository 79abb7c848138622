"""Assisted and prompt-lookup decoding vs plain greedy decoding: ms per generated token, same tokens, acceptance.

A model (a saved folder, ``--model``; by default a random Delta Net, whose drafts are mostly rejected: pass a trained
model for meaningful figures) continues a prompt that repeats itself (``--prompt_file`` or random token ids repeated),
greedily: plain, with prompt lookup (``prompt_lookup_num_tokens``) and, with ``--assistant``, with that assistant
model. Each run must give the plain run's tokens. Rolled-back tokens (``crop(-n)`` of the recording caches) show how
many drafts were rejected. Runs are repeated ``--repeats`` times, interleaved.

    python benchmarks/bench_assisted.py [--model DIR] [--assistant DIR] [--prompt_file FILE --tokenizer DIR]
                                        [--new_tokens 64] [--lookup 10] [--repeats 3] [--threads N] [--out PATH]
    python benchmarks/bench_assisted.py --quick   # a tiny random model, few tokens: checks that the script runs

Writes benchmarks/results/bench_assisted.json (``--quick``: nothing unless ``--out`` is given).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from modeling_fwp import DeltaNetConfig  # noqa: E402
from modeling_fwp.cache_fwp import RollbackMixin  # noqa: E402
from training.result_file import RunRecord, summarize  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402


class CropCounter:
    """Counts the tokens rolled back (``crop(-n)`` of every recording cache: the model's rejected drafts and the
    assistant's own rollbacks) while active."""

    def __init__(self) -> None:
        self.rejected = 0
        self._crop = RollbackMixin.crop

    def __enter__(self) -> "CropCounter":
        counter, crop = self, self._crop

        def counting_crop(cache, tokens_to_remove):
            counter.rejected += -tokens_to_remove
            return crop(cache, tokens_to_remove)

        RollbackMixin.crop = counting_crop
        return self

    def __exit__(self, *exc) -> None:
        RollbackMixin.crop = self._crop


def load_model(path, vocab: int, hidden: int, layers: int):
    if path:
        return AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True).eval()
    torch.manual_seed(0)
    config = DeltaNetConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                            num_attention_heads=max(1, hidden // 32), intermediate_size=4 * hidden)
    return AutoModelForCausalLM.from_config(config).eval()


def prompt_ids(args, vocab: int) -> torch.Tensor:
    if args.prompt_file:
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model, trust_remote_code=True)
        return tokenizer(Path(args.prompt_file).read_text(encoding="utf-8"), return_tensors="pt").input_ids
    part = torch.randint(3, vocab, (1, args.prompt_tokens // 2), generator=torch.Generator().manual_seed(0))
    return torch.cat([part, part], dim=1)


@torch.inference_mode()
def timed_generate(model, ids: torch.Tensor, new_tokens: int, **drafts) -> tuple:
    """(sequences, seconds per new token, tokens rolled back)."""
    settings = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    with CropCounter() as counter:
        t0 = time.perf_counter()
        out = model.generate(ids, **settings, **drafts)
        elapsed = time.perf_counter() - t0
    return out, elapsed / new_tokens, counter.rejected


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", default=None, help="saved model folder (default: a random Delta Net)")
    parser.add_argument("--assistant", default=None, help="saved assistant model folder (same vocabulary)")
    parser.add_argument("--prompt_file", default=None)
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder for --prompt_file (default: --model)")
    parser.add_argument("--prompt_tokens", type=int, default=256, help="random prompt length (no --prompt_file)")
    parser.add_argument("--new_tokens", type=int, default=64)
    parser.add_argument("--lookup", type=int, default=10, help="prompt_lookup_num_tokens")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--quick", action="store_true", help="tiny random model, few tokens")
    parser.add_argument("--out", default=None, help="result file (default benchmarks/results/bench_assisted.json)")
    args = parser.parse_args()
    if args.quick:
        args.hidden, args.layers, args.vocab, args.prompt_tokens, args.new_tokens, args.repeats = 32, 1, 64, 16, 6, 1
    out_path = args.out or (None if args.quick else str(Path(__file__).parent / "results" / "bench_assisted.json"))
    torch.set_num_threads(args.threads)
    record = RunRecord.start("python benchmarks/bench_assisted.py")
    model = load_model(args.model, args.vocab, args.hidden, args.layers)
    ids = prompt_ids(args, model.config.get_text_config().vocab_size)
    modes = {"greedy": {}, "prompt_lookup": {"prompt_lookup_num_tokens": args.lookup}}
    if args.assistant:
        modes["assistant"] = {"assistant_model": load_model(args.assistant, args.vocab, args.hidden, args.layers)}
    times = {mode: [] for mode in modes}
    same, rejected = {mode: True for mode in modes}, {mode: 0 for mode in modes}
    reference = None
    for _ in range(args.repeats):
        for mode, drafts in modes.items():
            out, per_token, rejects = timed_generate(model, ids, args.new_tokens, **drafts)
            reference = out if reference is None else reference
            same[mode] &= bool(torch.equal(out, reference))
            times[mode].append(per_token)
            rejected[mode] += rejects
    results = {"model": args.model or f"random DeltaNet d={args.hidden} L={args.layers} V={args.vocab}",
               "assistant": args.assistant, "prompt_tokens": ids.shape[1], "new_tokens": args.new_tokens,
               "lookup": args.lookup, "threads": torch.get_num_threads(), "modes": {}}
    greedy_ms = summarize(times["greedy"])["median"] * 1e3
    print(f"prompt {ids.shape[1]} tokens, {args.new_tokens} new, {torch.get_num_threads()} threads; ms/token median")
    for mode in modes:
        ms = summarize(times[mode])["median"] * 1e3
        results["modes"][mode] = dict(ms_per_token=ms, speedup=greedy_ms / ms, same_tokens=same[mode],
                                      rolled_back_tokens_per_run=rejected[mode] / args.repeats,
                                      ms_per_token_all=[t * 1e3 for t in times[mode]])
        print(f"{mode:14s} {ms:9.3f} ms/token  x{greedy_ms / ms:5.2f}  same tokens: {same[mode]}  rolled back per "
              f"run: {rejected[mode] / args.repeats:.1f}")
    if out_path:
        print(f"wrote {record.write(out_path, results)}")


if __name__ == "__main__":
    main()
