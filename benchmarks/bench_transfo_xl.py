"""Scoring speed and perplexity: Transformer-XL, Transformer-XL + FWL, Transformer-XL + dynamic evaluation.

Clark et al. 2022 (table 4, one V100, WikiText-103 Transformer-XL): 1575 tok/s base, 1340 tok/s with the FWL,
510 tok/s with dynamic evaluation. Targets here: the FWL at most 1.20x slower than the base model, dynamic
evaluation at least 2.5x slower than the FWL. All three score the same text with the papers' protocol (batch 1,
segments of --segment_length tokens, memories / fast-weight state carried; ``training.dynamic_eval``).

Models (``training.train_transfo_xl``, word level, offline Wikipedia text, 1 thread): a Transformer-XL shaped like a
scaled-down version of the paper's 16-layer d=410 model (default 12 layers, d=256, pre-LayerNorm) is pretrained for
--train_minutes; from that checkpoint, for the same --continue_steps on the same data, (a) the base model continues
training ("transfo_xl") and (b) a residual FWL head (``fwl_residual``: it starts as the identity) is attached and the
whole model trains with it ("transfo_xl_fwl"). Both thus have the same training steps; dynamic evaluation runs on (a).
With --tiny_dir, a model pair trained earlier (e.g. the 4-layer d=128 models of the first session) is measured in the
same rounds and reported separately, labelled. Speeds are measured in --rounds interleaved rounds; each run's tokens/s
are kept per round with their median and best, and as the per-segment floor (the sum over segments of each segment's
fastest time). The slowdowns are given from the median rounds (the headline; the targets are judged on them), from the
best rounds and from the floors. Results go to benchmarks/results/bench_transfo_xl.json, with the run's command,
versions and load average before, before scoring and after (``"run"``, ``training.result_file``).

    python benchmarks/bench_transfo_xl.py [--train_minutes 12] [--continue_steps 100] [--reuse] [--max_tokens 4096]
"""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from modeling_fwp import TransfoXLForCausalLM  # noqa: E402
from training import train_transfo_xl as txl  # noqa: E402
from training.dynamic_eval import DynamicEvaluation, ScoreResult, score_segments, score_stream  # noqa: E402
from training.result_file import RunRecord, load_average, summarize  # noqa: E402

PAPER_V100 = {"transfo_xl": 1575.0, "transfo_xl_fwl": 1340.0, "transfo_xl_dynamic_eval": 510.0}
TARGETS = {"fwl_slowdown_at_most": 1.20, "dynamic_eval_vs_fwl_slowdown_at_least": 2.5}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data_dir", default=str(ROOT / "data" / "wiki"))
    p.add_argument("--work_dir", default=str(ROOT / "outputs" / "bench_transfo_xl"))
    p.add_argument("--output", default=str(ROOT / "benchmarks" / "results" / "bench_transfo_xl.json"))
    p.add_argument("--train_minutes", type=float, default=12.0, help="pretraining budget of the shared checkpoint")
    p.add_argument("--continue_steps", type=int, default=100, help="steps of (a) base and (b) +FWL from the checkpoint")
    p.add_argument("--continue_lr", type=float, default=3e-4)
    p.add_argument("--fwl_lr_scale", type=float, default=10.0, help="learning rate factor of the new FWL parameters")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden_size", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--batch_size", type=int, default=8, help="training streams")
    p.add_argument("--lr", type=float, default=1e-3, help="pretraining peak learning rate")
    p.add_argument("--random_init", action="store_true", help="skip training (speed only; perplexities meaningless)")
    p.add_argument("--reuse", action="store_true", help="reuse models already trained in --work_dir")
    p.add_argument("--tiny_dir", default=None, help="folder with transfo_xl/ and transfo_xl_fwl/ of a second, smaller "
                   "model pair, measured in the same rounds and reported separately")
    p.add_argument("--segment_length", type=int, default=64)
    p.add_argument("--max_tokens", type=int, default=4096, help="test tokens scored per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dynamic_lr", type=float, nargs="+", default=[3e-4, 1e-3, 3e-3], help="chosen on valid")
    p.add_argument("--threads", type=int, default=1, help="1 by default: the 2-core machine is shared, and 2-thread "
                   "OpenMP regions stall under other processes' load")
    return p.parse_args(argv)


def measure(runs: dict, ids: torch.Tensor, segment_length: int, rounds: int):
    """--rounds rounds; within a round every run advances one segment in turn (``score_segments``), so that a burst of
    load on the shared machine hits all of them alike. Returns ({name: [tok/s per round]}, {name: tok/s from the
    per-segment minimum over the rounds}, {name: ScoreResult of the last round})."""
    for model, dynamic in runs.values():  # warm-up: first calls allocate and pick kernels
        score_stream(model, ids[:, : 2 * segment_length + 1], segment_length, dynamic=dynamic)
    speeds, segment_seconds, results = {name: [] for name in runs}, {name: [] for name in runs}, {}
    for _ in range(rounds):
        streams = {name: score_segments(model, ids, segment_length, dynamic) for name, (model, dynamic) in runs.items()}
        round_results = {name: ScoreResult() for name in runs}
        seconds = {name: [] for name in runs}
        while streams:
            for name in list(streams):
                step = next(streams[name], None)
                if step is None:
                    del streams[name]
                    continue
                nll, num_tokens, sec = step
                result = round_results[name]
                result.nll_sum, result.num_tokens, result.seconds = (result.nll_sum + nll,
                                                                     result.num_tokens + num_tokens,
                                                                     result.seconds + sec)
                result.segment_nll.append(nll)
                seconds[name].append(sec)
        for name, result in round_results.items():
            speeds[name].append(result.tokens_per_second)
            segment_seconds[name].append(seconds[name])
        results = round_results
    floor = {name: results[name].num_tokens / sum(min(per_round) for per_round in zip(*segment_seconds[name]))
             for name in runs}
    return speeds, floor, results


def ratios(speeds: dict) -> dict:
    """Slowdowns from ``{name: tok/s}``."""
    best = speeds
    return {
        "fwl_slowdown_vs_transfo_xl": round(best["transfo_xl"] / best["transfo_xl_fwl"], 4),
        "dynamic_eval_slowdown_vs_fwl": round(best["transfo_xl_fwl"] / best["transfo_xl_dynamic_eval"], 4),
        "dynamic_eval_slowdown_vs_transfo_xl": round(best["transfo_xl"] / best["transfo_xl_dynamic_eval"], 4),
    }


def load_pair(directory: Path):
    """(base, FWL model, tokenizer, their train logs) saved in ``directory/transfo_xl`` and
    ``directory/transfo_xl_fwl``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    models = [AutoModelForCausalLM.from_pretrained(directory / name).eval()
              for name in ("transfo_xl", "transfo_xl_fwl")]
    logs = {name: json.loads((directory / name / "train_log.json").read_text())
            for name in ("transfo_xl", "transfo_xl_fwl")}
    return (*models, AutoTokenizer.from_pretrained(directory / "transfo_xl"), logs)


def prepare_models(args, work: Path):
    """Pretrains the shared checkpoint, then continues it (a) as the base model and (b) with an FWL for the same steps;
    returns (base, fwl, tokenizer, training info). --reuse skips every stage whose folder is already saved."""
    pretrained, base_dir, fwl_dir = work / "pretrained", work / "transfo_xl", work / "transfo_xl_fwl"
    common = ["--data_dir", args.data_dir, "--threads", str(args.threads), "--per_device_train_batch_size",
              str(args.batch_size), "--hidden_dropout", "0.0", "--block_size", str(args.segment_length)]
    done = lambda d: args.reuse and (d / "config.json").exists()  # noqa: E731
    if not done(pretrained):
        txl.main(common + ["--output_dir", str(pretrained), "--max_train_minutes", str(args.train_minutes),
                           "--num_hidden_layers", str(args.layers), "--hidden_size", str(args.hidden_size),
                           "--num_attention_heads", str(args.heads), "--pre_lnorm", "--learning_rate", str(args.lr),
                           "--warmup_steps", "30"]
                 + (["--max_steps", "0"] if args.random_init else []))
    steps = "0" if args.random_init else str(args.continue_steps)
    cont = common + ["--model_name_or_path", str(pretrained), "--max_steps", steps, "--max_train_minutes", "600",
                     "--learning_rate", str(args.continue_lr), "--warmup_steps", "10"]
    if not done(base_dir):
        txl.main(cont + ["--output_dir", str(base_dir)])
    if not done(fwl_dir):
        txl.main(cont + ["--output_dir", str(fwl_dir), "--use_fwl", "--fwl_residual", "--fwl_learning_rate",
                         str(args.fwl_lr_scale * args.continue_lr)])
    base, fwl, tokenizer, logs = load_pair(work)
    pre_log = json.loads((pretrained / "train_log.json").read_text())
    return base, fwl, tokenizer, {"trained": not args.random_init, "pretrained": pre_log, **logs}


def report_rows(results: dict, speeds: dict, floor: dict, with_paper: bool = True) -> dict:
    rows = {}
    for name, result in results.items():
        summary = summarize(speeds[name], best="max")
        rows[name] = {
            "perplexity": round(result.perplexity, 2),
            "tokens_scored": result.num_tokens,
            "tokens_per_second_segment_floor": round(floor[name], 1),
            "tokens_per_second_best": round(summary["best"], 1),
            "tokens_per_second_median": round(summary["median"], 1),
            "tokens_per_second_rounds": [round(s, 1) for s in speeds[name]],
        }
        if with_paper:
            rows[name]["paper_v100_tokens_per_second"] = PAPER_V100[name]
    return rows


def config_summary(config) -> dict:
    return {k: v for k, v in config.to_dict().items() if k in (
        "vocab_size", "cutoffs", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
        "intermediate_size", "div_val", "mem_len", "same_length", "pre_lnorm", "fwl_residual")}


def tiny_report(args, runs: dict, speeds: dict, floor: dict, results: dict, tiny_logs: dict, lr_tried: dict) -> dict:
    """The second, smaller model pair's rows (``--tiny_dir``), measured in the same rounds."""
    main_names = ("transfo_xl", "transfo_xl_fwl", "transfo_xl_dynamic_eval")
    tiny_speeds = {n: speeds[f"tiny/{n}"] for n in main_names}
    tiny_summaries = {n: summarize(s, best="max") for n, s in tiny_speeds.items()}
    tiny_base, tiny_dynamic = runs["tiny/transfo_xl"][0], runs["tiny/transfo_xl_dynamic_eval"][1]
    return {
        "models": f"a second, smaller pair trained earlier ({args.tiny_dir}); FWL trained from scratch for the base's "
                  "steps, not from a shared checkpoint",
        "config": config_summary(tiny_base.config),
        "parameters": sum(p.numel() for p in tiny_base.parameters()),
        "dynamic_eval": {"method": "sgd", "lr": tiny_dynamic.lr, "lr_on_valid": lr_tried},
        "results": report_rows({n: results[f"tiny/{n}"] for n in main_names}, tiny_speeds,
                               {n: floor[f"tiny/{n}"] for n in main_names}, with_paper=False),
        "ratios_median_round": ratios({n: s["median"] for n, s in tiny_summaries.items()}),
        "ratios_best_round": ratios({n: s["best"] for n, s in tiny_summaries.items()}),
        "ratios": ratios({n: floor[f"tiny/{n}"] for n in main_names}),
        "training": {n: {k: v for k, v in log.items() if k in ("steps", "seconds", "tokens", "final_train_loss")}
                     for n, log in tiny_logs.items()},
    }


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    record = RunRecord.start("python benchmarks/bench_transfo_xl.py", argv)
    data_dir = Path(args.data_dir)
    if not (data_dir / "test.txt").exists():
        from training.data import prepare_wiki

        prepare_wiki(data_dir)
    base, fwl, tokenizer, training = prepare_models(args, Path(args.work_dir))
    test = txl.encode_stream(tokenizer, txl.read_documents(data_dir / "test.txt"))[: args.max_tokens][None]
    valid = txl.encode_stream(tokenizer, txl.read_documents(data_dir / "valid.txt"))[: args.max_tokens // 4][None]

    def choose_lr(model) -> tuple:  # dynamic evaluation's step size: the best of --dynamic_lr on a valid slice
        tried = {lr: score_stream(model, valid, args.segment_length, DynamicEvaluation(lr)).perplexity
                 for lr in args.dynamic_lr}
        return min(tried, key=tried.get), {str(k): round(v, 2) for k, v in tried.items()}

    lr, tried = choose_lr(base)
    runs = {
        "transfo_xl": (base, None),
        "transfo_xl_fwl": (fwl, None),
        "transfo_xl_dynamic_eval": (base, DynamicEvaluation(lr)),
    }
    if args.tiny_dir:  # measured in the same interleaved rounds (same load), on the same text
        tiny_base, tiny_fwl, tiny_tokenizer, tiny_logs = load_pair(Path(args.tiny_dir))
        if tiny_tokenizer.get_vocab() != tokenizer.get_vocab():
            raise ValueError(f"`--tiny_dir` {args.tiny_dir}: its tokenizer differs from the main models' one")
        tiny_lr, tiny_tried = choose_lr(tiny_base)
        runs.update({"tiny/transfo_xl": (tiny_base, None), "tiny/transfo_xl_fwl": (tiny_fwl, None),
                     "tiny/transfo_xl_dynamic_eval": (tiny_base, DynamicEvaluation(tiny_lr))})
    load_scoring = load_average()
    speeds, floor, results = measure(runs, test, args.segment_length, args.rounds)
    main_names = ("transfo_xl", "transfo_xl_fwl", "transfo_xl_dynamic_eval")
    summaries = {n: summarize(speeds[n], best="max") for n in main_names}
    medians = {n: s["median"] for n, s in summaries.items()}
    report = {
        "benchmark": "bench_transfo_xl",
        "models": ("trained here on the offline Wikipedia text: a shared pretrained checkpoint, then the same steps "
                   "as (a) base and (b) base + residual FWL" if training["trained"] else "random initialisation"),
        "config": config_summary(base.config),
        "parameters": {"transfo_xl": sum(p.numel() for p in base.parameters()),
                       "transfo_xl_fwl": sum(p.numel() for p in fwl.parameters())},
        "protocol": {"batch_size": 1, "segment_length": args.segment_length, "split": "test", "rounds": args.rounds,
                     "speed": "the runs advance one segment each in turn; headline ratios from the median rounds "
                              "(ratios_median_round, targets judged on them); also from the best rounds and from the "
                              "per-segment floors (ratios: the per-segment minimum over the rounds)"},
        "dynamic_eval": {"method": "sgd", "lr": lr, "lr_on_valid": tried},
        "results": report_rows({n: results[n] for n in main_names}, speeds, floor),
        "ratios_median_round": ratios(medians),
        "ratios_best_round": ratios({n: s["best"] for n, s in summaries.items()}),
        "ratios": {
            **ratios({n: floor[n] for n in main_names}),
            "paper_fwl_slowdown": round(PAPER_V100["transfo_xl"] / PAPER_V100["transfo_xl_fwl"], 3),
            "paper_dynamic_eval_slowdown_vs_fwl": round(PAPER_V100["transfo_xl_fwl"]
                                                        / PAPER_V100["transfo_xl_dynamic_eval"], 3),
        },
        "targets": {
            **TARGETS,  # judged on the unrounded median-round ratios
            "fwl_target_met": medians["transfo_xl"] / medians["transfo_xl_fwl"] <= TARGETS["fwl_slowdown_at_most"],
            "dynamic_eval_target_met": medians["transfo_xl_fwl"] / medians["transfo_xl_dynamic_eval"]
            >= TARGETS["dynamic_eval_vs_fwl_slowdown_at_least"],
        },
        "tiny_model": tiny_report(args, runs, speeds, floor, results, tiny_logs, tiny_tried) if args.tiny_dir else None,
        "training": {name: {k: v for k, v in log.items() if k in (
            "steps", "start_segment", "seconds", "tokens", "final_train_loss", "train_tokens_per_second",
            "learning_rate", "per_device_train_batch_size", "model_name_or_path", "fwl_residual", "fwl_learning_rate")}
            for name, log in training.items() if isinstance(log, dict)},
        "machine": {"device": "cpu", "threads": torch.get_num_threads(), "load_average_before_scoring": load_scoring},
    }
    record.write(args.output, report)
    print_report(report)
    return report


def print_report(report: dict) -> None:
    print(f"{'model':28s} {'ppl':>10s} {'median':>8s} {'best round':>11s} {'tok/s floor':>12s} {'paper V100':>11s}")
    for name, r in report["results"].items():
        print(f"{name:28s} {r['perplexity']:10.2f} {r['tokens_per_second_median']:8.1f} "
              f"{r['tokens_per_second_best']:11.1f} {r['tokens_per_second_segment_floor']:12.1f} "
              f"{r['paper_v100_tokens_per_second']:11.0f}")
    print("median rounds (headline):", json.dumps(report["ratios_median_round"]), "best rounds:",
          json.dumps(report["ratios_best_round"]), "segment floors:", json.dumps(report["ratios"]),
          json.dumps(report["targets"]))
    tiny = report["tiny_model"]
    if tiny is not None:
        print("tiny pair:", json.dumps({n: (r["perplexity"], r["tokens_per_second_median"])
                                        for n, r in tiny["results"].items()}),
              json.dumps(tiny["ratios_median_round"]))


if __name__ == "__main__":
    main()
