"""torch.compile: every family's forward is one graph, and compiled decoding in `generate` does not recompile per token.

The graph checks use ``fullgraph=True`` (any graph break raises) with a counting backend; logits are compared with
the ``aot_eager`` backend (AOT autograd's functionalised, decomposed graph run op by op). Inductor itself compiles a
tiny model in about 50 s on this CPU: ``benchmarks/bench_compile.py`` checks its logits and tokens and times it.
"""
from __future__ import annotations

import pytest
import torch
from transformers import CompileConfig

from fwp_kernels import dense
from modeling_fwp.cache_fwp import FastWeightCache
from modeling_fwp.configuration_fwp import FastWeightConfig
from modeling_fwp.families import FAMILIES

from conftest import tiny_model
from test_fwl import random_ids, tiny_fwl
from test_transfo_xl import fwl_model, txl_model

FAST_WEIGHT_FAMILIES = [spec.config_class for spec in FAMILIES if issubclass(spec.config_class, FastWeightConfig)]
BUILDERS = {
    **{cls.__name__: (lambda cls=cls: tiny_model(cls, num_hidden_layers=1)) for cls in FAST_WEIGHT_FAMILIES},
    "FWL(Llama)": lambda: tiny_fwl(),
    "TransfoXL": lambda: txl_model(),
    "TransfoXL+FWL": lambda: fwl_model(),
}


class GraphCounter:
    """A dynamo backend (``.backend``) that runs each captured graph as is and counts the graphs (one per compile).

    The backend is a plain function: ``generate`` deep-copies its generation config, compile config included, and a
    function survives a deep copy as itself."""

    def __init__(self) -> None:
        self.captured = []

        def backend(graph_module, example_inputs, **kwargs):
            self.captured.append(graph_module)
            return graph_module.forward

        self.backend = backend

    @property
    def graphs(self) -> int:
        return len(self.captured)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_forward_is_one_graph_with_the_eager_logits(family):
    model = BUILDERS[family]()
    ids = random_ids(2, 4)
    attention_mask = torch.ones_like(ids)
    attention_mask[0, :1] = 0  # left padding: the mask reaches the graph as a tensor
    eager = model(input_ids=ids, attention_mask=attention_mask).logits
    counter = GraphCounter()
    compiled = torch.compile(model, fullgraph=True, backend=counter.backend)  # a graph break raises
    # equal up to rounding: Transformer-XL's adaptive embedding projects every token through every cluster in a graph
    # (a data-dependent gather in eager), which changes float32 results by about 1e-7
    torch.testing.assert_close(compiled(input_ids=ids, attention_mask=attention_mask).logits, eager, rtol=1e-6,
                               atol=1e-6)
    assert counter.graphs == 1


@pytest.mark.parametrize("family", ["DeltaLSTMConfig", "FWL(Llama)"])
def test_aot_compiled_forward_gives_the_eager_logits(family):
    model = BUILDERS[family]()
    ids = random_ids(2, 5)
    eager = model(input_ids=ids).logits
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")(input_ids=ids).logits
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)


def test_compiled_forward_in_generate_does_not_recompile_per_token():
    """A user-compiled forward: prefill, the first decode step and the decode step with a symbolic token count are the
    only graphs, however many tokens follow (per-token recompiles would hit dynamo's recompile limit of 8)."""
    model = tiny_model()
    ids = random_ids(1, 5)
    eager = model.generate(ids, max_new_tokens=16, do_sample=False)
    counter = GraphCounter()
    model.forward = torch.compile(model.forward, fullgraph=True, backend=counter.backend)
    assert torch.equal(model.generate(ids, max_new_tokens=16, do_sample=False), eager)
    assert counter.graphs <= 3
    graphs = counter.graphs
    longer = model.generate(ids, max_new_tokens=24, do_sample=False)
    assert counter.graphs == graphs  # no new graph for more tokens
    assert torch.equal(longer[:, : eager.shape[1]], eager)


@pytest.mark.parametrize("family", ["DeltaNetConfig"])
def test_generate_compiles_decoding_with_a_compile_config(family):
    """``generate(compile_config=...)`` with a ``FastWeightCache`` passed in: generate compiles the decode step itself
    (prefill runs eagerly), keeps the 2-D padding mask, and gives the eager tokens."""
    model = BUILDERS[family]()
    ids = random_ids(1, 5)
    eager = model.generate(ids, max_new_tokens=16, do_sample=False)
    counter = GraphCounter()
    config = CompileConfig(backend=counter.backend, fullgraph=True)
    config._compile_all_devices = True  # generate compiles on accelerators only unless told otherwise
    cache = FastWeightCache(model.config.num_hidden_layers)
    assert cache.is_compileable
    out = model.generate(ids, max_new_tokens=16, do_sample=False, cache=cache, compile_config=config)
    assert torch.equal(out, eager)
    assert 1 <= counter.graphs <= 2  # the first decode step, then one with a symbolic token count


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inference_graph_keeps_the_cpu_kernels(dtype):
    """Outside autograd on CPU a prefill's products take oneDNN's linear and a decode step's the C++ streaming kernels.
    A traced graph keeps both: oneDNN's as ``fwp_kernels::onednn_linear`` (an op of its own: inductor lowers
    ``mkldnn._linear_pointwise`` only for frozen weights, and F.linear to MKL's AVX2 sgemm on AMD CPUs), the C++ ops
    as they are (they only write their ``out`` arguments: torch generates their fake kernels), so that a compiled
    decode step runs them without Python between them."""
    model = BUILDERS["DeltaNetConfig"]().to(dtype)
    ids = random_ids(1, 5)
    targets = {}
    for name, tokens in (("prefill", ids), ("decode", ids[:, :1])):
        counter = GraphCounter()
        compiled = torch.compile(model, fullgraph=True, backend=counter.backend)
        with torch.no_grad():
            torch.testing.assert_close(compiled(input_ids=tokens).logits, model(input_ids=tokens).logits,
                                       rtol=0, atol=0)
        targets[name] = {str(node.target) for graph in counter.captured for node in graph.graph.nodes
                         if node.op == "call_function"}
        torch._dynamo.reset()
    assert not [t for t in targets["prefill"] | targets["decode"] if "mkldnn" in t], targets
    if dense.onednn_matmul_supports(dtype):
        assert any("onednn_linear" in t for t in targets["prefill"]), targets["prefill"]
    if dense._CPU_KERNEL.available():  # the C++ kernel is built
        assert any("fwp_dense" in t and "linear_rows" in t for t in targets["decode"]), targets["decode"]


def test_inductor_compiles_an_inference_forward_and_decode_step():
    """inductor itself (not a test backend) on a no-grad forward and a one-token step: the same logits as eager.
    Its lowering of oneDNN's linear raised a LoweringException for every compiled inference forward on CPU."""
    model = tiny_model(num_hidden_layers=1)
    ids = random_ids(1, 5)
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        for tokens in (ids, ids[:, :1]):
            torch.testing.assert_close(compiled(input_ids=tokens).logits, model(input_ids=tokens).logits,
                                       rtol=1e-5, atol=1e-5)
