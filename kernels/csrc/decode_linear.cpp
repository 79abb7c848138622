// fwp_kernels: out = x W^T (+ b) for a few rows of x (decoding: one token per sequence), reading W once.
//
// Decoding a language model is memory-bound: each token reads every weight once, and time per token is bounded by
// "bytes of weights / memory bandwidth". torch's F.linear with one row of input reaches about half of this machine's
// read bandwidth in float32 (MKL's sgemm on an AMD CPU) and less in bfloat16 (benchmarks/bench_cpu.py, "linear_rows",
// prints both beside this kernel and x.sum()).
// Here the rows of W are split over the threads; every task streams its rows once, each with independent sums for
// the vector unit, with x (a few KB) in L1. float32 W accumulates in float32;
// bfloat16 W is widened to float32 on the fly (a shift: bf16 is the upper half of a float32), or multiplied in pairs
// by AVX-512 BF16's dot product where the CPU has it, and accumulates in float32, the output rounded to bfloat16
// once, as oneDNN's bf16 matmul does.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

// The ops' namespace: fwp_dense_<build key> when cpp_build compiles this file (-DFWP_OP_NAMESPACE), one
// per build, so that builds of different sources (the package's, a saved model folder's older copy) load side by
// side in one process (two TORCH_LIBRARY blocks of one namespace abort it).
#ifndef FWP_OP_NAMESPACE
#define FWP_OP_NAMESPACE fwp_dense
#endif
// TORCH_LIBRARY pastes its argument unexpanded: one more macro level expands FWP_OP_NAMESPACE first.
#define FWP_TORCH_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define FWP_TORCH_LIBRARY_IMPL(ns, key, m) TORCH_LIBRARY_IMPL(ns, key, m)

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

inline float widen(float x) { return x; }
inline float widen(c10::BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// One row of W against one row of x, float32 sums. The portable loop; the AVX-512 ones below replace it where the
// kernel is built for a CPU that has them.
template <typename W>
inline float dot_portable(int64_t K, const W* w, const float* x) {
  float s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t j = 0; j < K; ++j) s += widen(w[j]) * x[j];
  return s;
}

// Each row is streamed on its own with four vector sums in flight: one memory stream per core, which the hardware
// prefetcher follows best (four rows side by side reached 70% of x.sum()'s read bandwidth on one thread here; one
// row, 90%: measured 2026-11-26, bfloat16 14.4 -> 24.5 GB/s). float32 also prefetches 2 KB ahead (73-76% -> 80-85% of
// x.sum() on one thread, noisy).
#if defined(__AVX512F__)
inline float dot_avx512(int64_t K, const float* w, const float* x) {
  __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps(), s2 = _mm512_setzero_ps(), s3 = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 64 <= K; j += 64) {
    for (int l = 0; l < 4; ++l) _mm_prefetch(reinterpret_cast<const char*>(w + j + 512 + 16 * l), _MM_HINT_T0);
    s0 = _mm512_fmadd_ps(_mm512_loadu_ps(w + j), _mm512_loadu_ps(x + j), s0);
    s1 = _mm512_fmadd_ps(_mm512_loadu_ps(w + j + 16), _mm512_loadu_ps(x + j + 16), s1);
    s2 = _mm512_fmadd_ps(_mm512_loadu_ps(w + j + 32), _mm512_loadu_ps(x + j + 32), s2);
    s3 = _mm512_fmadd_ps(_mm512_loadu_ps(w + j + 48), _mm512_loadu_ps(x + j + 48), s3);
  }
  for (; j + 16 <= K; j += 16) s0 = _mm512_fmadd_ps(_mm512_loadu_ps(w + j), _mm512_loadu_ps(x + j), s0);
  float tail = 0;
  for (; j < K; ++j) tail += w[j] * x[j];
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3))) + tail;
}
#endif

#if defined(__AVX512BF16__)
// bfloat16 x and W with AVX-512 BF16: vdpbf16ps multiplies 32 bf16 pairs exactly and adds them to 16 float32 sums in
// one instruction, instead of widening every weight first (which left one thread compute-bound).
inline __m512bh load_bf16(const c10::BFloat16* p) { return (__m512bh)_mm512_loadu_si512(p); }

inline float dot_avx512(int64_t K, const c10::BFloat16* w, const c10::BFloat16* x) {
  __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps(), s2 = _mm512_setzero_ps(), s3 = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 128 <= K; j += 128) {
    s0 = _mm512_dpbf16_ps(s0, load_bf16(w + j), load_bf16(x + j));
    s1 = _mm512_dpbf16_ps(s1, load_bf16(w + j + 32), load_bf16(x + j + 32));
    s2 = _mm512_dpbf16_ps(s2, load_bf16(w + j + 64), load_bf16(x + j + 64));
    s3 = _mm512_dpbf16_ps(s3, load_bf16(w + j + 96), load_bf16(x + j + 96));
  }
  for (; j + 32 <= K; j += 32) s0 = _mm512_dpbf16_ps(s0, load_bf16(w + j), load_bf16(x + j));
  float tail = 0;
  for (; j < K; ++j) tail += widen(w[j]) * widen(x[j]);
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3))) + tail;
}
#endif

// w . x for one row of W: `xs` is x widened to float32, `xw` x in W's dtype.
template <typename W>
inline float row_dot(int64_t K, const W* w, const float* xs, const W* xw) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<W, c10::BFloat16>) return dot_avx512(K, w, xw);
#endif
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<W, float>) return dot_avx512(K, w, xs);
#endif
  (void)xw;
  return dot_portable<W>(K, w, xs);
}

// Rows n0..n1 of the output for every row of x: xs [M, K] float32 (xw: the same in W's dtype), W [N, K], bias [N] or
// null, out [M, N].
template <typename W>
void output_rows(int64_t n0, int64_t n1, int64_t M, int64_t K, int64_t N, const float* xs, const W* xw, const W* w,
                 const W* bias, W* out) {
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t m = 0; m < M; ++m)  // the row of W stays in L1 for the other rows of x
      out[m * N + n] = static_cast<W>(row_dot<W>(K, w + n * K, xs + m * K, xw + m * K) + (bias ? widen(bias[n]) : 0.f));
}

// x [M, K], weight [N, K], bias [N] or None, out [M, N]; one dtype (float32 or bfloat16), contiguous.
void linear_rows(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                 const at::Tensor& out) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "fwp_dense.linear_rows: x must be [M, K] and weight [N, K]");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == M && out.size(1) == N, "fwp_dense.linear_rows: out must be [M, N]");
  for (const at::Tensor* t : {&x, &weight, &out}) {
    TORCH_CHECK(t->is_contiguous() && t->device().is_cpu() && t->scalar_type() == weight.scalar_type(),
                "fwp_dense.linear_rows: contiguous CPU tensors of one dtype expected");
  }
  if (bias.has_value()) {
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == N && bias->scalar_type() == weight.scalar_type(),
                "fwp_dense.linear_rows: bias must be [N] in the weight's dtype");
  }
  const at::Tensor xs = x.to(at::kFloat).contiguous();  // a few KB: widened once
  // about 256 KB of weights per task: enough work to pay for a thread, many tasks for load balance
  const int64_t grain = std::max<int64_t>(4, (256 << 10) / std::max<int64_t>(1, K * weight.element_size()));
  AT_DISPATCH_SWITCH(weight.scalar_type(), "linear_rows",
    AT_DISPATCH_CASE(at::kFloat, [&] {
      const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
      at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
        output_rows<float>(n0, n1, M, K, N, xs.data_ptr<float>(), x.data_ptr<float>(), weight.data_ptr<float>(), b,
                           out.data_ptr<float>());
      });
    })
    AT_DISPATCH_CASE(at::kBFloat16, [&] {
      using W = c10::BFloat16;
      const W* b = bias.has_value() ? bias->data_ptr<W>() : nullptr;
      at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
        output_rows<W>(n0, n1, M, K, N, xs.data_ptr<float>(), x.data_ptr<W>(), weight.data_ptr<W>(), b,
                       out.data_ptr<W>());
      });
    }));
}

}  // namespace

FWP_TORCH_LIBRARY(FWP_OP_NAMESPACE, m) {
  m.def("linear_rows(Tensor x, Tensor weight, Tensor? bias, Tensor(a!) out) -> ()");
}

FWP_TORCH_LIBRARY_IMPL(FWP_OP_NAMESPACE, CPU, m) { m.impl("linear_rows", &linear_rows); }
