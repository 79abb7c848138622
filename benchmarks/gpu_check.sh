#!/usr/bin/env bash
# The GPU checks in one run, for a machine with a CUDA device whose python3 has torch and triton (such as the lent
# H100 of this project's tool library, which has no network): the CUDA tests (tests/test_cuda.py and the compiled
# Triton test of tests/test_kernels.py), then benchmarks/bench_gpu.py. Wheels in .whl/ (flash-linear-attention,
# fla-core, einops, this project's transformers) are installed into /tmp/site first, when there are any.
#
#   OUT=/some/folder bash benchmarks/gpu_check.sh [all|tests|bench] [bench_gpu.py arguments]
#
# TESTS (pytest's arguments) narrows the tests; with `all`, WARM_RULES (e.g. "delta gated sum") starts one process
# per rule beside the tests that compiles bench_gpu's kernel_times kernels (`--compile_only`, the same bench
# arguments) into Triton's disk cache, so that the tests' Triton compiles (CPU-bound) and the benchmark's overlap
# (the H100's third run used it beside 16 test processes: together they ran the GPU out of memory; untried with 8).
# Logs, the junit XML, each test's failure or printed output as soon as it ends (pytest_reports.log) and
# bench_gpu.json land in $OUT (8 files at most come back from a lent machine). `make gpu-wheels` fills .whl/ (on a
# machine with the package index; .whl/ is not committed: add `/.whl/` to .git/info/exclude).
#
# The repository is used in place (no pip install): fwp_kernels is the folder kernels/ under its installed name. The
# C++ CPU kernels are not built (FWP_KERNELS_NO_BUILD=1): the CPU references of the tests take the PyTorch paths.
set -u
STAGE=${1:-all}  # tests, bench or all (the device calls of a lease can run them one after the other)
shift $(( $# > 0 ? 1 : 0 ))
OUT=${OUT:-/tmp/gpu_check}
TEST_TIMEOUT=${TEST_TIMEOUT:-300}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-330}
TESTS=${TESTS:-tests/test_cuda.py tests/test_kernels.py::test_triton_compiled_on_cuda}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH=/tmp/site
fi
mkdir -p /tmp/fwp_packages && ln -sfn "$PWD/kernels" /tmp/fwp_packages/fwp_kernels
export PYTHONPATH="/tmp/fwp_packages:$PWD:${PYTHONPATH:-}" FWP_KERNELS_NO_BUILD=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee "$OUT/nvidia_smi.csv"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, \
'transformers', transformers.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
if [ "$STAGE" = all ]; then
    for rule in ${WARM_RULES:-}; do
        timeout "$TEST_TIMEOUT" python3 benchmarks/bench_gpu.py "$@" --compile_only --sections kernel_times \
            --rules "$rule" --out "/tmp/warm_$rule.json" 2>&1 | sed "s/^/$(date +%T) warm $rule: /" >>"$OUT/warm.log" &
    done
fi
if [ "$STAGE" != bench ]; then
# A hung test fails alone where pytest-timeout is installed; with pytest-xdist the tests run in 8 processes (the lent
# H100's image has both): the H100 runs showed them bound by Triton's compiles (10-40 s per kernel and shape, one
# CPU core each; 30 to 110 s per test). The measured errors print in the summary of passed tests (-rA).
PER_TEST=$(python3 -c "import pytest_timeout" 2>/dev/null && echo --timeout=180)
# 8 processes: 12 ran the H100 out of memory (each one's float64 step loops with autograd); tests/test_cuda.py now
# empties PyTorch's cache after each test as well.
WORKERS=$(python3 -c "import xdist" 2>/dev/null && echo "-n ${PYTEST_WORKERS:-8}")
# shellcheck disable=SC2086  # TESTS and the options are word lists
FWP_REPORT_LOG="$OUT/pytest_reports.log" timeout "$TEST_TIMEOUT" python3 -m pytest -v -p no:cacheprovider -rA \
    --tb=short $PER_TEST $WORKERS --durations=12 \
    --junitxml="$OUT/pytest_cuda.xml" \
    $TESTS 2>&1 \
    | while IFS= read -r line; do printf '%s %s\n' "$(date +%T)" "$line"; done | tee "$OUT/pytest_cuda.log" \
    | grep -v "\[gw[0-9]*\].*PASSED\|^..:..:.. *$"
echo "pytest exit: ${PIPESTATUS[0]}"
fi
[ "$STAGE" = tests ] && exit 0
wait  # the compile-only warm-up processes, if any
timeout "$BENCH_TIMEOUT" python3 benchmarks/bench_gpu.py --out "$OUT/bench_gpu.json" "$@" 2>&1 \
    | while IFS= read -r line; do printf '%s %s\n' "$(date +%T)" "$line"; done | tee "$OUT/bench_gpu.log" \
    | grep -v "Loading weights\|Writing model"
echo "bench_gpu exit: ${PIPESTATUS[0]}"
