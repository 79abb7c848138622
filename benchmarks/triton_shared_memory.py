"""Shared memory per block of each Triton chunk kernel of fwp_kernels, compiled ahead of time for a GPU architecture
(no GPU needed: Triton compiles with its bundled ptxas), at the key head sizes of the pretrained models, for each
software-pipelining depth (``num_stages``) the launches fall back to (``triton_chunk.launch``), against the
architecture's limit.

Why: on an H100 (2026-11-27, benchmarks/results/gpu_check_h100/) the delta rule's scan kernel at head size 128 (fla's
1.3B Delta Net) asked for 262,144 bytes of shared memory with Triton's default pipelining, over the H100's 232,448,
and failed to launch; this script gives the same 262,144 offline, so the fallback can be checked without a GPU.

    python benchmarks/triton_shared_memory.py            # sm_90 (H100/H200) and sm_80 (A100); about 15 minutes

The sizes depend on Triton's version (the H100 run had Triton 3.6; `PYTHONPATH=<a folder with triton 3.6>` runs the
script with it); the file records the version.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Dict, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from fwp_kernels import triton_chunk, triton_gated_chunk  # noqa: E402
from training.result_file import RunRecord  # noqa: E402

# The opt-in shared memory per block (bytes): sm_90 H100 / H200, sm_80 A100, sm_86 / sm_89 (RTX 30 / 40, L4, A10).
LIMITS = {90: 232448, 80: 166912, 89: 101376}
# Pointers that hold the inputs' dtype (the rest are float32 buffers: W, U, gamma, states)
INPUT_POINTERS = {"q_ptr", "k_ptr", "v_ptr", "o_ptr", "beta_ptr", "g_ptr"}
KERNELS = {
    "delta wy": (triton_chunk._wy_kernel, {}),
    "delta scan": (triton_chunk._scan_kernel, {"IS_DELTA": True, "HAS_S0": True}),
    "sum scan": (triton_chunk._scan_kernel, {"IS_DELTA": False, "HAS_S0": True}),
    "gated wy": (triton_gated_chunk._gated_wy_kernel, {}),
    "gated scan": (triton_gated_chunk._gated_scan_kernel, {"HAS_S0": True}),
}


def shared_bytes(kernel, constexprs: Dict, arch: int, dtype: str, num_stages: Optional[int]) -> int:
    """Bytes of shared memory `kernel` (a ``triton.jit`` function) needs, compiled for ``sm_<arch>``."""
    signature = {}
    for param in kernel.params:
        if param.is_constexpr:
            signature[param.name] = "constexpr"
        elif param.name.endswith("_ptr"):
            signature[param.name] = f"*{dtype}" if param.name in INPUT_POINTERS else "*fp32"
        else:
            signature[param.name] = "i32"
    # What a launch with PyTorch's tensors and lengths divisible by 16 specializes on: 16-byte aligned pointers and
    # ints that are multiples of 16 (Triton then copies tiles asynchronously, which takes more shared memory).
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(signature) if signature[name] != "constexpr"}
    options = {} if num_stages is None else {"num_stages": num_stages}
    compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=GPUTarget("cuda", arch, 32),
                              options=options)
    return compiled.metadata.shared


def tiles(K: int, V: int, chunk_size: int = 64) -> Dict[str, int]:
    """The constexprs the launch wrappers pass for heads K x V (``triton_chunk._forward_buffers``)."""
    q, v = torch.empty(1, 1, 2, K, device="meta"), torch.empty(1, 1, 2, V, device="meta")
    C, (BC, BK, BV), *_ = triton_chunk._forward_buffers(q, v, None, chunk_size)
    return dict(K=K, V=V, C=C, BC=BC, BK=BK, BV=BV)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--archs", type=int, nargs="+", default=[90, 80])
    parser.add_argument("--head_sizes", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "triton_shared_memory.json"))
    args = parser.parse_args(argv)
    record = RunRecord.start("python benchmarks/triton_shared_memory.py", argv)
    rows = []
    for arch in args.archs:
        for K in args.head_sizes:
            for name, (kernel, flags) in KERNELS.items():
                constexprs = {**tiles(K, max(K, 64)), **flags}
                constexprs = {n: x for n, x in constexprs.items() if n in {p.name for p in kernel.params}}
                for num_stages in triton_chunk.STAGE_FALLBACK:
                    started = time.perf_counter()
                    used = shared_bytes(kernel, constexprs, arch, args.dtype, num_stages)
                    row = dict(arch=arch, head_size=K, kernel=name, num_stages=num_stages, shared_bytes=used,
                               limit=LIMITS[arch], fits=used <= LIMITS[arch],
                               compile_s=round(time.perf_counter() - started, 1))
                    rows.append(row)
                    print(row, flush=True)
                    if row["fits"]:  # what the launch runs: the first depth of the fallback that fits
                        break
    record.write(args.out, {"triton": triton.__version__, "dtype": args.dtype, "rows": rows})
    unfit = [(r["arch"], r["head_size"], r["kernel"]) for r in rows
             if r["num_stages"] == triton_chunk.STAGE_FALLBACK[-1] and not r["fits"]]
    print(f"wrote {args.out}; fit at no depth (these run the PyTorch chunk kernel): {unfit or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
