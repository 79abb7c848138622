"""CUDA: the Triton kernels compiled for a GPU at the pretrained models' head sizes, every model family on CUDA tensors
(the kernels that ``mode="auto"`` takes there), and flash-linear-attention's own GPU kernels and models beside ours.
Every test here skips without a CUDA device (CI and this project's machine have none). ``bash
benchmarks/gpu_check.sh`` runs them on a GPU, then ``benchmarks/bench_gpu.py``; what ran on a lent H100 (2026-11-27),
and what did not, is in benchmarks/results/gpu_check_h100/README.md.

References: the float64 step loops on the same GPU (kernels), the same model on the CPU (models), fla 0.6's chunk
kernels and models, when fla is installed (it is no dependency of this project)."""
from __future__ import annotations

import pytest
import torch

from fwp_kernels import chunk, rfwp_scan
from fwp_kernels.dispatch import RECURRENCES, select_kernel
from modeling_fwp import DeltaLSTMConfig, DeltaNetConfig, GatedDeltaNetConfig
from modeling_fwp.cache_fwp import output_cache

from conftest import FIXTURES, relative_error, tiny_model
from test_kernels import (GATES, RECURRENCE, RULE_FUNCTIONS, RULES, TOL, make_inputs, outputs_and_grads, positional,
                          reference, rel_err)
from test_padding import FAST_WEIGHT_VARIANTS, check_continued_chunk, check_padded_rows, make_model
from test_rfwp import KINDS, padding_mask, scan_inputs, variant_id
from test_rfwp import outputs_and_grads as scan_outputs_and_grads

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA = torch.device("cuda")
# The Triton kernels' tolerance on a GPU: the CPU bounds of test_kernels (float32 2e-5: tl.dot runs in IEEE fp32,
# input_precision="ieee", no TF32), bfloat16 as the interpreter's (u = 3.9e-3; x2.5 margin over 2u). Measured on an
# H100 at T = 1, head size 64: 1.5e-7 (fp32), 2.2e-3 (bf16).
CUDA_TOL = TOL
# fla against the float64 step loop: its float32 kernels may multiply in TF32 (u = 4.9e-4) on a GPU; not measured
# before these tests first ran (bench_gpu records the errors).
FLA_TOL = {torch.float32: 5e-3, torch.bfloat16: 3e-2}
# Whole models (prefill, then decoding) against ours in float32: in bfloat16 the fixtures' logits moved by up to 0.037
# (ours) and 0.056 (fla) on the H100 (2 layers, random weights); a wrong conversion moves them by order one.
FLA_MODEL_TOL = {torch.float32: 5e-3, torch.bfloat16: 0.1}
# The Triton module of each rule of test_kernels on CUDA.
TRITON_MODULE = {"delta": "triton_chunk", "sum": "triton_chunk", "gated": "triton_gated_chunk"}
# (T, Dk, Dv): a partial last chunk; fla's 1.3B Delta Net heads (2048 / 16 = 128); the Gated DeltaNet's wide heads
MODEL_SHAPES = [(1, 64, 64), (333, 128, 128), (1024, 128, 128), (300, 256, 512)]


@pytest.fixture(autouse=True)
def _release_cached_gpu_memory():
    """Each test hands its cached GPU memory back: pytest-xdist runs several processes on the one GPU, and
    PyTorch's caching allocator keeps each process's peak (up to 10 GiB here: the float64 step loops' autograd at
    T = 1024, head size 128); on the H100, 12 such processes ran it out of memory."""
    yield
    torch.cuda.empty_cache()


def _on(device, inputs):
    return {n: None if x is None else x.detach().to(device).requires_grad_() for n, x in inputs.items()}


def triton_errors(rule: str, T: int, Dk: int, Dv: int, dtype: torch.dtype, B: int = 2, H: int = 2) -> dict:
    """{output or gradient: relative error} of mode "chunk" on CUDA (the Triton chunk kernel below head width
    ``chunk.CUDA_TORCH_CHUNK_MIN_WIDTH``; backward in PyTorch) against the float64 step loop on the same rounded
    inputs, run on the host (``test_kernels.reference``): its autograd held up to 10 GiB of GPU memory per process at
    T = 1,024, head size 128, and 8 to 12 such processes ran the H100 out of memory (runs 3 and 4)."""
    host_inputs = make_inputs(rule, B, H, T, Dk, Dv, dtype, seed=T + Dk)
    expected = reference(rule, host_inputs)
    got = outputs_and_grads(rule, _on(CUDA, host_inputs), mode="chunk")
    return {n: rel_err(got[n].cpu(), expected[n]) for n in expected}


@pytest.mark.parametrize("rule", RULES)
def test_chunk_mode_on_cuda_is_the_triton_kernel_below_head_width_64(rule):
    for T in (8, 4096):
        kernel = select_kernel(RECURRENCES[RECURRENCE[rule]], "auto", T, CUDA)
        assert kernel.for_width(32).__module__ == f"fwp_kernels.{TRITON_MODULE[rule]}", (T, kernel)
        for width in (64, 128):
            assert kernel.for_width(width).__module__ == f"fwp_kernels.{RECURRENCE[rule]}_kernels", (T, width, kernel)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("T,Dk,Dv", MODEL_SHAPES, ids=lambda x: str(x))
@pytest.mark.parametrize("rule", RULES)
def test_triton_chunk_matches_step_loop_at_model_head_sizes(rule, T, Dk, Dv, dtype, monkeypatch):
    """The Triton kernels at every head size, the wide ones too (mode "chunk" runs the PyTorch kernels there by
    default, ``chunk.CUDA_TORCH_CHUNK_MIN_WIDTH``: lifted here): their launch's fallback to fewer pipelining stages."""
    if rule != "gated" and Dv == 512:
        pytest.skip("the wide value heads are the Gated DeltaNet's")
    monkeypatch.setattr(chunk, "CUDA_TORCH_CHUNK_MIN_WIDTH", 1 << 30)
    errors = triton_errors(rule, T, Dk, Dv, dtype)
    print(f"\nrelative errors {rule} T={T} Dk={Dk} Dv={Dv} {dtype}: {errors}")
    assert max(errors.values()) < CUDA_TOL[dtype], errors


@pytest.mark.parametrize("kind", KINDS)
def test_triton_scans_match_step_loop_on_cuda(kind):
    """The recurrent FWP scans (Irie et al. 2021), fused in Triton on CUDA, against their step loop on CUDA, with a
    left-padded row, at the paper's head size 16."""
    assert rfwp_scan._backend(CUDA).__name__ == "fwp_kernels.triton_rfwp"
    x = _on(CUDA, scan_inputs(kind, B=2, H=3, T=70, D=16))
    mask = padding_mask(2, 70).to(CUDA)
    expected = scan_outputs_and_grads(kind, x, "recurrent", mask)
    got = scan_outputs_and_grads(kind, x, "fused", mask)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("variant", FAST_WEIGHT_VARIANTS, ids=variant_id)
def test_model_on_cuda_matches_cpu_and_its_padding_rules(variant):
    """Every family and variant: logits on CUDA (Triton kernels) equal those on the CPU; padded rows and a padded chunk
    continued from a cache equal each row alone, on CUDA, within the CPU comparison's tolerance. (The CPU tests'
    tighter atol 1e-6 assumes the CPU's summation order: on an H100 the Linear Transformer with DPFP and attention
    normalization, whose denominators can be small, differed from its row alone by 1.8e-6 at 3 of 244 logits.)"""
    model = make_model(variant)
    ids = torch.randint(3, 61, (3, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = model(ids).logits
        model = model.to(CUDA)
        got = model(ids.to(CUDA)).logits.cpu()
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    check_padded_rows(model, tolerance=(1e-4, 1e-5))
    check_continued_chunk(model, tolerance=(1e-4, 1e-5))


@pytest.mark.parametrize(
    "cls,options",
    [(DeltaNetConfig, {"short_conv_size": 4, "qk_l2_normalization": True, "feature_map": "silu"}),
     (GatedDeltaNetConfig, {}), (DeltaLSTMConfig, {})],
    ids=lambda x: getattr(x, "__name__", ""),
)
def test_generate_on_cuda(cls, options):
    """Greedy decoding on CUDA with the recurrent cache: the tokens of the uncached run and of the CPU."""
    model = tiny_model(cls, **options)
    prompt = torch.randint(3, 61, (2, 9), generator=torch.Generator().manual_seed(3))
    kwargs = dict(max_new_tokens=24, do_sample=False, min_new_tokens=24)
    on_cpu = model.generate(prompt, **kwargs)
    model = model.to(CUDA)
    cached = model.generate(prompt.to(CUDA), **kwargs)
    uncached = model.generate(prompt.to(CUDA), use_cache=False, **kwargs)
    assert torch.equal(cached, uncached) and torch.equal(cached.cpu(), on_cpu)


# ---------------------------------------------------------------------------------------------------------------
# flash-linear-attention 0.6 on the GPU: its chunk kernels and its models beside ours


@pytest.fixture(scope="module")
def fla_first_config():
    """fla installed, with Triton's autotuner kept to each kernel's first config for these tests: the results do not
    depend on the tiling it picks, and its search compiles every config of every kernel per dtype (minutes on a GPU).
    bench_gpu times fla with its full search."""
    pytest.importorskip("fla", reason="flash-linear-attention is not installed")
    from triton.runtime.autotuner import Autotuner

    prune = Autotuner.prune_configs
    Autotuner.prune_configs = lambda self, kwargs, *args: self.configs[:1]
    yield
    Autotuner.prune_configs = prune


def fla_kernels() -> dict:
    """rule -> fla's chunk kernel in our layout: ``(q, k, v, *gates, initial_state) -> (o [B, H, T, Dv], final
    [B, H, Dv, Dk])`` (fla: ``[B, T, H, D]`` and states ``[B, H, Dk, Dv]``; scale 1: our q is used as is)."""
    from fla.ops.delta_rule import chunk_delta_rule
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    from fla.ops.linear_attn import chunk_linear_attn

    def adapt(fn, rule, **options):
        def run(q, k, v, *gates, initial_state=None):
            heads_second = lambda x: x.transpose(1, 2).contiguous()  # noqa: E731
            s0 = None if initial_state is None else initial_state.transpose(-1, -2).contiguous()
            named_gates = {name: heads_second(x) for name, x in zip(GATES[rule], gates)}  # beta=, g=
            o, final = fn(*map(heads_second, (q, k, v)), **named_gates, scale=1.0, initial_state=s0,
                          output_final_state=True, **options)
            return o.transpose(1, 2), final.transpose(-1, -2)

        return run

    return {
        "delta": adapt(chunk_delta_rule, "delta"),
        "sum": adapt(chunk_linear_attn, "sum", normalize=False),
        "gated": adapt(chunk_gated_delta_rule, "gated"),
    }


# fla 0.6's chunk_delta_rule asserts "ChunkDeltaRuleFunction does not support float32. Please use bfloat16." (seen on
# the H100, 2026-11-27): its float32 delta rule and its Delta Net models in float32 are not compared.
FLA_REFUSES = {("delta", torch.float32)}


def fla_and_our_errors(rule: str, T: int, Dk: int, Dv: int, dtype: torch.dtype) -> dict:
    """Relative errors of fla's chunk kernel and of ours (o, final state) against the float64 step loop, on CUDA
    (ours only where fla refuses the dtype, ``FLA_REFUSES``)."""
    inputs = _on(CUDA, make_inputs(rule, 2, 4, T, Dk, Dv, dtype, seed=T))
    as64 = {n: None if x is None else x.double() for n, x in inputs.items()}
    with torch.no_grad():
        reference = RULE_FUNCTIONS[rule](*positional(rule, as64), initial_state=as64["initial_state"],
                                         output_final_state=True, mode="recurrent")
        ours = RULE_FUNCTIONS[rule](*positional(rule, inputs), initial_state=inputs["initial_state"],
                                    output_final_state=True, mode="chunk")
        fla = None
        if (rule, dtype) not in FLA_REFUSES:
            fla = fla_kernels()[rule](*positional(rule, inputs), initial_state=inputs["initial_state"])
    return {
        f"{who}_{name}": rel_err(got, ref)
        for who, pair in (("ours", ours), ("fla", fla)) if pair is not None
        for name, got, ref in zip(("o", "final_state"), pair, reference)
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rule", RULES)
def test_fla_chunk_kernels_and_ours_match_the_step_loop(rule, dtype, fla_first_config):
    """Both within the tolerance of our kernels (a wrong layout, scale or gate order in the comparison gives errors of
    order one); fla's own errors are recorded by bench_gpu."""
    errors = fla_and_our_errors(rule, 1000, 128, 128, dtype)
    print(f"\nrelative errors, fla and ours, {rule} {dtype}: {errors}")
    ours = {n: e for n, e in errors.items() if n.startswith("ours")}
    assert max(ours.values()) < CUDA_TOL[dtype], errors
    assert max(errors.values()) < FLA_TOL[dtype], errors


def fla_model_pair(name: str, tmp_path, dtype: torch.dtype = torch.float32, attn_mode: str = "chunk") -> tuple:
    """fla's model of the test fixture `name` (tests/fixtures/fla_0_6) in `attn_mode` (its chunk kernels above 64
    tokens), and ours converted from it, both on CUDA in `dtype`."""
    import fla  # noqa: F401  (registers fla's Auto classes)
    from transformers import AutoModelForCausalLM

    from modeling_fwp import convert_fla_checkpoint

    folder = FIXTURES / "fla_0_6" / name
    theirs = AutoModelForCausalLM.from_pretrained(folder, attn_mode=attn_mode).to(CUDA, dtype).eval()
    convert_fla_checkpoint(folder, tmp_path / name)
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / name).to(CUDA, dtype).eval()
    return theirs, ours


def prefill_then_decode(model, ids: torch.Tensor, ours: bool, prefill: int) -> list:
    """Float32 logits of `model` over ``ids[:, :prefill]`` in one call, then of each later token decoded one at a time
    from the cache (ours: ``cache=``; fla's: ``past_key_values=``, its fused recurrent kernels)."""
    out = model(ids[:, :prefill], use_cache=True)
    logits = [out.logits.float()]
    for t in range(prefill, ids.shape[1]):
        cache = output_cache(out) if ours else out.past_key_values
        out = model(ids[:, t : t + 1], use_cache=True, **({"cache": cache} if ours else {"past_key_values": cache}))
        logits.append(out.logits.float())
    return logits


@pytest.mark.parametrize("name", ["delta_net", "delta_net_gated", "gated_deltanet"])
def test_fla_models_on_cuda_match_ours(name, tmp_path, fla_first_config):
    """fla's DeltaNet / Gated DeltaNet with its GPU kernels (chunk mode over 296 tokens, then 4 cached decoding
    steps) against the same checkpoint converted to ours, on CUDA: in float32 where fla runs it, else (the Delta
    Nets, ``FLA_REFUSES``) both in bfloat16, each against ours in float32."""
    refused = name.startswith("delta_net") and ("delta", torch.float32) in FLA_REFUSES
    dtype = torch.bfloat16 if refused else torch.float32
    theirs, ours = fla_model_pair(name, tmp_path, dtype)
    ids = torch.randint(3, ours.config.vocab_size, (2, 300), generator=torch.Generator().manual_seed(4)).to(CUDA)
    with torch.no_grad():
        got, expected = prefill_then_decode(ours, ids, True, 296), prefill_then_decode(theirs, ids, False, 296)
        reference = expected if dtype == torch.float32 else prefill_then_decode(ours.float(), ids, True, 296)
    errors = {"ours": [relative_error(a, b) for a, b in zip(got, reference)]}
    if dtype != torch.float32:
        errors["fla"] = [relative_error(a, b) for a, b in zip(expected, reference)]
    print(f"\nlogits relative errors (prefill, then 4 decoding steps), {name} in {dtype}, against "
          f"{'fla' if dtype == torch.float32 else 'ours in float32'}: {errors}")
    assert max(max(e) for e in errors.values()) < FLA_MODEL_TOL[dtype], errors
