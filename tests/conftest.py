import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(2)

# tests/tools holds scripts run by hand (mutation_check.py), not tests
collect_ignore = ["tools"]


def tiny_config(cls=None, **overrides):
    """A small config of any fast-weight family (DeltaNetConfig by default)."""
    from modeling_fwp import DeltaNetConfig

    cls = cls or DeltaNetConfig
    kwargs = dict(
        vocab_size=61, hidden_size=32, num_attention_heads=4, num_hidden_layers=2, intermediate_size=48,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    kwargs.update(overrides)
    return cls(**kwargs)


def tiny_model(cls=None, seed=0, **overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(cls, **overrides)).eval()


@pytest.fixture
def word_tokenizer():
    """A word-level tokenizer over a small vocabulary, built offline."""
    return make_word_tokenizer()


def make_word_tokenizer():
    """The `word_tokenizer` fixture's tokenizer, for module-scoped fixtures."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<s>", "</s>", "<unk>"] + "the a cat dog sat on mat fast weights are programmed by slow nets and read with queries".split()
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def triton_interpreted_results(test_file: str) -> dict:
    """Runs ``python <test_file> --triton-worker`` with ``TRITON_INTERPRET=1`` (Triton kernels on CPU tensors, in a
    fresh process: the interpreter must be chosen before triton is imported) and returns the JSON it prints last.
    Skips when triton is not installed."""
    import importlib.util
    import json
    import subprocess
    import sys

    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    # the worker imports the code under test (this checkout), not whichever copy of the packages is installed
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    proc = subprocess.run([sys.executable, test_file, "--triton-worker"], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.splitlines()[-1])


def accelerate_launch_two_processes(module: str, argv: list, cwd) -> "subprocess.CompletedProcess":
    """Runs ``accelerate launch --multi_gpu --num_processes 2 -m <module> <argv>`` on CPU (torchrun with gloo) on a
    free port, one thread per process, and returns the finished process (its output captured)."""
    import socket
    import subprocess
    import sys
    from pathlib import Path

    launcher = Path(sys.executable).with_name("accelerate")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    with socket.socket() as probe:  # a free port: a fixed one may still be held by an earlier run
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    command = [str(launcher), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
               "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", port,
               "-m", module, *map(str, argv)]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, cwd=cwd)
