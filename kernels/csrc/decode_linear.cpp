// fwp_kernels: out = x W^T (+ b) for a few rows of x (decoding: one token per sequence), reading W once.
//
// Decoding a language model is memory-bound: each token reads every weight once, and time per token is bounded by
// "bytes of weights / memory bandwidth". torch's F.linear with one row of input reaches about half of this machine's
// read bandwidth in float32 (MKL's sgemm on an AMD CPU) and less in bfloat16 (benchmarks/bench_cpu.py prints both).
// Here the rows of W are split over the threads; every task streams its rows once, four at a time, so that each
// dot product has independent sums for the vector unit, with x (a few KB) in L1. float32 W accumulates in float32;
// bfloat16 W is widened to float32 on the fly (a shift: bf16 is the upper half of a float32) and accumulates in
// float32, the output rounded to bfloat16 once, as oneDNN's bf16 matmul does.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

inline float widen(float x) { return x; }
inline float widen(c10::BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Four rows of W [.., K] against one row of x (float32, K): four dot products at once.
template <typename W>
inline void four_dots(int64_t K, const W* w, const float* x, float* out4) {
  const W *w0 = w, *w1 = w + K, *w2 = w + 2 * K, *w3 = w + 3 * K;
  float s0 = 0, s1 = 0, s2 = 0, s3 = 0;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
  for (int64_t j = 0; j < K; ++j) {
    const float xj = x[j];
    s0 += widen(w0[j]) * xj;
    s1 += widen(w1[j]) * xj;
    s2 += widen(w2[j]) * xj;
    s3 += widen(w3[j]) * xj;
  }
  out4[0] = s0;
  out4[1] = s1;
  out4[2] = s2;
  out4[3] = s3;
}

template <typename W>
inline float one_dot(int64_t K, const W* w, const float* x) {
  float s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t j = 0; j < K; ++j) s += widen(w[j]) * x[j];
  return s;
}

// Rows n0..n1 of the output for every row of x: xs [M, K] float32, W [N, K], bias [N] or null, out [M, N].
template <typename W>
void output_rows(int64_t n0, int64_t n1, int64_t M, int64_t K, int64_t N, const float* xs, const W* w, const W* bias,
                 W* out) {
  float sums[4];
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) {
    for (int64_t m = 0; m < M; ++m) {  // the four rows of W stay in L1 for the other rows of x
      four_dots<W>(K, w + n * K, xs + m * K, sums);
      for (int r = 0; r < 4; ++r) out[m * N + n + r] = static_cast<W>(sums[r] + (bias ? widen(bias[n + r]) : 0.f));
    }
  }
  for (; n < n1; ++n)
    for (int64_t m = 0; m < M; ++m)
      out[m * N + n] = static_cast<W>(one_dot<W>(K, w + n * K, xs + m * K) + (bias ? widen(bias[n]) : 0.f));
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
        output_rows<float>(n0, n1, M, K, N, xs.data_ptr<float>(), weight.data_ptr<float>(), b, out.data_ptr<float>());
      });
    })
    AT_DISPATCH_CASE(at::kBFloat16, [&] {
      using W = c10::BFloat16;
      const W* b = bias.has_value() ? bias->data_ptr<W>() : nullptr;
      at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
        output_rows<W>(n0, n1, M, K, N, xs.data_ptr<float>(), weight.data_ptr<W>(), b, out.data_ptr<W>());
      });
    }));
}

}  // namespace

TORCH_LIBRARY(fwp_dense, m) {
  m.def("linear_rows(Tensor x, Tensor weight, Tensor? bias, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(fwp_dense, CPU, m) { m.impl("linear_rows", &linear_rows); }
