// fwp_kernels: out = x W^T (+ b) for a few rows of x (decoding: one token per sequence), reading W once.
//
// Decoding a language model is memory-bound: each token reads every weight once, and time per token is bounded by
// "bytes of weights / memory bandwidth". torch's F.linear with one row of input reaches about half of this machine's
// read bandwidth in float32 (MKL's sgemm on an AMD CPU) and less in bfloat16 (benchmarks/bench_cpu.py, "linear_rows",
// prints both beside this kernel and x.sum()).
// Here the rows of W are split over the threads (parallel_rows: a share each, then what is left of the others');
// every row is streamed once, with independent sums for the vector unit, with x (a few KB) in L1. float32 W
// accumulates in float32;
// bfloat16 W is widened to float32 on the fly (a shift: bf16 is the upper half of a float32), or multiplied in pairs
// by AVX-512 BF16's dot product where the CPU has it, and accumulates in float32, the output rounded to bfloat16
// once, as oneDNN's bf16 matmul does.
//
// The other per-token ops of a decode step live here too (short_conv_step, normalize_rows): each is a few KB of work
// that torch runs as 5-9 small ops at 3-5 us each, a few hundred us per layer of a 1.3B Delta Net in all; here one
// pass each, with the same arithmetic as modeling_fwp's torch code (float32 sums; the convolution float64 for
// float64, the norms float32 for every dtype, as their x.float()).
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/OpMathType.h>
#include <ATen/Dispatch.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <mutex>
#include <string>
#include <type_traits>
#include <unordered_map>
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

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
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

// Each row is streamed on its own with two vector sums in flight: one memory stream per core, which the hardware
// prefetcher follows best (four rows side by side reached 70% of x.sum()'s read bandwidth on one thread here; one
// row, 90%: measured 2026-11-26, bfloat16 14.4 -> 24.5 GB/s). Two sums rather than four (2026-12-04, Zen 4,
// benchmarks/results/bench_stream_builds_two_sums.json, weights from memory: one row of x 1.06-1.21x faster in
// bfloat16 and 1.01-1.11x in float32 at 1 and 2 threads, two rows 0.97-1.11x): the loads issued at the pace of two
// chains of dependent sums leave the prefetcher ahead of them. One sum was faster still from memory (bfloat16
// 1.11-1.17x), but 0.6-0.8x where the weights sat in the L3 (its chain of vdpbf16ps latencies then bounds it).
// No software prefetch in the AVX-512 loops (the AVX2 ones below have it: Zen 1's prefetcher needed it): float32
// prefetched W 2 KB ahead from 2026-11-26 (then 73-76% -> 80-85% of x.sum() on one thread, noisy), but on the Zen 4
// EPYC of 2026-11-29 it cost 10-15% at one thread (8 weights 5632 x 2048, GB/s, median of 9-15 shuffled rounds,
// side by side: 21.6 / 21.0 / 20.5 with it, 25.3 / 23.8 / 22.8 without; 1 KB, 4 KB and 8 KB ahead or NTA between
// the two), 0-12% at two.
#if defined(__AVX512F__)
inline float dot_avx512(int64_t K, const float* w, const float* x) {
  __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 32 <= K; j += 32) {
    s0 = _mm512_fmadd_ps(_mm512_loadu_ps(w + j), _mm512_loadu_ps(x + j), s0);
    s1 = _mm512_fmadd_ps(_mm512_loadu_ps(w + j + 16), _mm512_loadu_ps(x + j + 16), s1);
  }
  for (; j + 16 <= K; j += 16) s0 = _mm512_fmadd_ps(_mm512_loadu_ps(w + j), _mm512_loadu_ps(x + j), s0);
  float tail = 0;
  for (; j < K; ++j) tail += w[j] * x[j];
  return _mm512_reduce_add_ps(_mm512_add_ps(s0, s1)) + tail;
}
#endif

#if defined(__AVX512BF16__)
// bfloat16 x and W with AVX-512 BF16: vdpbf16ps multiplies 32 bf16 pairs exactly and adds them to 16 float32 sums in
// one instruction, instead of widening every weight first (which left one thread compute-bound).
inline __m512bh load_bf16(const c10::BFloat16* p) { return (__m512bh)_mm512_loadu_si512(p); }

inline float dot_avx512(int64_t K, const c10::BFloat16* w, const c10::BFloat16* x) {
  __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 64 <= K; j += 64) {
    s0 = _mm512_dpbf16_ps(s0, load_bf16(w + j), load_bf16(x + j));
    s1 = _mm512_dpbf16_ps(s1, load_bf16(w + j + 32), load_bf16(x + j + 32));
  }
  for (; j + 32 <= K; j += 32) s0 = _mm512_dpbf16_ps(s0, load_bf16(w + j), load_bf16(x + j));
  float tail = 0;
  for (; j < K; ++j) tail += widen(w[j]) * widen(x[j]);
  return _mm512_reduce_add_ps(_mm512_add_ps(s0, s1)) + tail;
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// AVX2 with FMA (Zen 1-3, Intel's cores without AVX-512): two sums in flight for float32 as above, four for
// bfloat16 (its loop issues more per weight), and W prefetched 1 KB ahead, unlike the AVX-512 loops. Side by side
// in one process (2026-12-07, AMD EPYC family 23 model 1 (Zen 1), 180 MB of weights, medians of 11 rounds, both
// builds with -mprefer-vector-width=256; benchmarks/results/bench_stream_builds_zen1_avx2.json) against the
// vectorised dot_portable: float32 1.14-1.19x faster for one row of x and 1.27-1.44x for two, bfloat16 1.24-1.39x
// and 1.30-1.54x, at 1 and 2 threads; one float32 row then reads at 1.01-1.04x x.sum()'s rate. Without the prefetch
// (a run before it, bench_stream_builds_zen1_avx2_no_prefetch.json): 1.03-1.11x, 1.25-1.27x, 1.13-1.23x,
// 1.26-1.48x; 512 B and 2 KB ahead as 1 KB within the noise. Decoding the 1.3B Delta Net shape (benchmarks/
// bench_decode_builds.py, bench_decode_builds_zen1_avx2.json, against the build before these loops and the width
// flag): float32 1.32x faster at 1 thread and 1.25x at 2, bfloat16 1.54x and 1.45x.
constexpr int64_t kPrefetchBytes = 1024;

inline float reduce_avx2(__m256 s) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

inline float dot_avx2(int64_t K, const float* w, const float* x) {
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= K; j += 16) {
    _mm_prefetch(reinterpret_cast<const char*>(w + j) + kPrefetchBytes, _MM_HINT_T0);
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + j), _mm256_loadu_ps(x + j), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + j + 8), _mm256_loadu_ps(x + j + 8), s1);
  }
  for (; j + 8 <= K; j += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + j), _mm256_loadu_ps(x + j), s0);
  float tail = 0;
  for (; j < K; ++j) tail += w[j] * x[j];
  return reduce_avx2(_mm256_add_ps(s0, s1)) + tail;
}

// bfloat16 W: a bfloat16 is the upper half of a float32, so the 8 32-bit lanes of 16 weights hold two float32s
// each, the even-numbered weight shifted down by 16 bits and the odd one under the low 16 bits: a shift and an AND
// (no shuffles: Zen 1 runs two per cycle, four per 16 weights with unpacklo/hi, which bound the loop there). x comes
// widened in the same order (dot_operand below: per block of 16, its 8 even entries, then its 8 odd ones).
inline float dot_avx2(int64_t K, const c10::BFloat16* w, const float* x) {
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps(), s2 = _mm256_setzero_ps(), s3 = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 32 <= K; j += 32) {
    _mm_prefetch(reinterpret_cast<const char*>(w + j) + kPrefetchBytes, _MM_HINT_T0);
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j + 16));
    s0 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(a, 16)), _mm256_loadu_ps(x + j), s0);
    s1 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(a, high)), _mm256_loadu_ps(x + j + 8), s1);
    s2 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(b, 16)), _mm256_loadu_ps(x + j + 16), s2);
    s3 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(b, high)), _mm256_loadu_ps(x + j + 24), s3);
  }
  for (; j + 16 <= K; j += 16) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j));
    s0 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(a, 16)), _mm256_loadu_ps(x + j), s0);
    s1 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(a, high)), _mm256_loadu_ps(x + j + 8), s1);
  }
  float tail = 0;
  for (; j < K; ++j) tail += widen(w[j]) * x[j];  // the last K % 16 entries of x in their own order
  return reduce_avx2(_mm256_add_ps(_mm256_add_ps(s0, s2), _mm256_add_ps(s1, s3))) + tail;
}
constexpr bool kSplitBfloat16Operand = true;
#else
constexpr bool kSplitBfloat16Operand = false;
#endif

// w . x for one row of W: `xs` is x widened to float32, `xw` x in W's dtype.
template <typename W>
inline float row_dot(int64_t K, const W* w, const float* xs, const W* xw) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<W, c10::BFloat16>) return dot_avx512(K, w, xw);
#endif
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<W, float>) return dot_avx512(K, w, xs);
#elif defined(__AVX2__) && defined(__FMA__)
  return dot_avx2(K, w, xs);
#endif
  (void)xw;
  return dot_portable<W>(K, w, xs);
}

// x [M, K] as row_dot reads it: widened to float32; where W is bfloat16 on an AVX2 build, each block of 16 entries
// of a row in dot_avx2's order (its even entries, then its odd ones; the last K % 16 as they are). A few KB, once.
at::Tensor dot_operand(const at::Tensor& x) {
  at::Tensor xs = x.to(at::kFloat).contiguous();
  if (!kSplitBfloat16Operand || x.scalar_type() != at::kBFloat16) return xs;
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor split = xs.clone();
  const float* from = xs.data_ptr<float>();
  float* to = split.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = 0; j + 16 <= K; j += 16)
      for (int64_t i = 0; i < 8; ++i) {
        to[m * K + j + i] = from[m * K + j + 2 * i];
        to[m * K + j + 8 + i] = from[m * K + j + 2 * i + 1];
      }
  return split;
}

// Rows n0..n1 of the output for every row of x: xs [M, K] float32 (xw: the same in W's dtype), W [N, K], bias [N] or
// null, out [M, ldo] (column n of out is W's row n).
template <typename W>
void output_rows(int64_t n0, int64_t n1, int64_t M, int64_t K, int64_t ldo, const float* xs, const W* xw, const W* w,
                 const W* bias, W* out) {
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t m = 0; m < M; ++m)  // the row of W stays in L1 for the other rows of x
      out[m * ldo + n] =
          static_cast<W>(row_dot<W>(K, w + n * K, xs + m * K, xw + m * K) + (bias ? widen(bias[n]) : 0.f));
}

// Rows of W (about 256 KB of weights) per grab of parallel_rows: enough work to pay for a thread and an atomic add.
inline int64_t rows_per_task(int64_t K, int64_t element_size) {
  return std::max<int64_t>(4, (256 << 10) / std::max<int64_t>(1, K * element_size));
}

// f(n0, n1) over the rows [0, N) of a streaming pass, on the threads torch is given: thread t streams its own share
// (rows N t / T to N (t + 1) / T, one memory stream) in grabs of `grain` rows, then takes grabs from the front of the
// shares not yet done, so that a thread that finishes first helps the other instead of waiting for it (at::parallel_for
// hands each thread one fixed share). Any thread may compute any row: the same sums either way. Measured 2026-12-02
// (Zen 5 VM, the 1.3B Delta Net's decode, bfloat16, 2 threads, against the fixed shares, side by side in one process,
// 30 steps each, five processes): 1.01x, 1.08x, 0.99x, 1.12x, 1.04x faster; the gains in the VM's fast state, where
// one thread of a pass ran up to 45% behind the other after a serial phase (by hand, per-thread clocks: 175 against
// 120 us for the two halves of a 2048 x 2048 weight), none in its slow one, where the halves end within 2-4%.
template <typename F>
void parallel_rows(int64_t N, int64_t grain, const F& f) {
  const int64_t T = std::min<int64_t>(at::get_num_threads(), (N + grain - 1) / grain);
  if (T <= 1 || at::in_parallel_region()) return f(0, N);
  struct alignas(64) Front {  // a cache line each: the threads' grabs do not contend for one line
    std::atomic<int64_t> next;
  };
  std::vector<Front> front(T);
  for (int64_t t = 0; t < T; ++t) front[t].next = N * t / T;
  at::parallel_for(0, T, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t d = 0; d < T; ++d) {  // its own share first, then the others' in turn
        const int64_t share = (t + d) % T, last = N * (share + 1) / T;
        for (int64_t n0; (n0 = front[share].next.fetch_add(grain)) < last;) f(n0, std::min(n0 + grain, last));
      }
    }
  });
}

// linear_rows_grouped's pass: the stacked rows n0..n1 of all weights, each range within one weight by output_rows;
// W_g's outputs go to outs[g] (rows of ldo[g] entries).
template <typename W>
void stacked_rows(at::TensorList weights, const std::vector<int64_t>& first_row, int64_t M, int64_t K,
                  const at::Tensor& xs, const at::Tensor& x, const std::vector<W*>& outs,
                  const std::vector<int64_t>& ldo) {
  const int64_t N = first_row.back();
  parallel_rows(N, rows_per_task(K, sizeof(W)), [&](int64_t n0, int64_t n1) {
    for (size_t g = 0; g < weights.size(); ++g) {
      const int64_t lo = std::max(n0, first_row[g]), hi = std::min(n1, first_row[g + 1]);
      if (lo >= hi) continue;
      output_rows<W>(lo - first_row[g], hi - first_row[g], M, K, ldo[g], xs.data_ptr<float>(), x.data_ptr<W>(),
                     weights[g].data_ptr<W>(), nullptr, outs[g]);
    }
  });
}

void check_cpu_contiguous(const char* op, std::initializer_list<const at::Tensor*> tensors, at::ScalarType dtype) {
  for (const at::Tensor* t : tensors) {
    TORCH_CHECK(t->is_contiguous() && t->device().is_cpu() && t->scalar_type() == dtype, "fwp_dense.", op,
                ": contiguous CPU tensors of one dtype expected");
  }
}

// x [M, K], weight [N, K], bias [N] or None, out [M, N]; one dtype (float32 or bfloat16), contiguous.
void linear_rows(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                 const at::Tensor& out) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "fwp_dense.linear_rows: x must be [M, K] and weight [N, K]");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == M && out.size(1) == N, "fwp_dense.linear_rows: out must be [M, N]");
  check_cpu_contiguous("linear_rows", {&x, &weight, &out}, weight.scalar_type());
  if (bias.has_value()) {
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == N && bias->scalar_type() == weight.scalar_type(),
                "fwp_dense.linear_rows: bias must be [N] in the weight's dtype");
  }
  const at::Tensor xs = dot_operand(x);
  const int64_t grain = rows_per_task(K, weight.element_size());
  AT_DISPATCH_SWITCH(weight.scalar_type(), "linear_rows",
    AT_DISPATCH_CASE(at::kFloat, [&] {
      const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
      parallel_rows(N, grain, [&](int64_t n0, int64_t n1) {
        output_rows<float>(n0, n1, M, K, N, xs.data_ptr<float>(), x.data_ptr<float>(), weight.data_ptr<float>(), b,
                           out.data_ptr<float>());
      });
    })
    AT_DISPATCH_CASE(at::kBFloat16, [&] {
      using W = c10::BFloat16;
      const W* b = bias.has_value() ? bias->data_ptr<W>() : nullptr;
      parallel_rows(N, grain, [&](int64_t n0, int64_t n1) {
        output_rows<W>(n0, n1, M, K, N, xs.data_ptr<float>(), x.data_ptr<W>(), weight.data_ptr<W>(), b,
                       out.data_ptr<W>());
      });
    }));
}

// stacked_rows into one out [M, N] (W_g's outputs in its columns first_row[g] onwards).
template <typename W>
void grouped_into(at::TensorList weights, const std::vector<int64_t>& first_row, int64_t M, int64_t K,
                  const at::Tensor& xs, const at::Tensor& x, const at::Tensor& out) {
  std::vector<W*> outs;
  for (size_t g = 0; g + 1 < first_row.size(); ++g) outs.push_back(out.data_ptr<W>() + first_row[g]);
  stacked_rows<W>(weights, first_row, M, K, xs, x, outs, std::vector<int64_t>(outs.size(), first_row.back()));
}

// The checks of `op`'s x [M, K] (contiguous, float32 or bfloat16) and weights [N_g, K] (contiguous, x's dtype; at
// least one); returns each weight's first row in the weights' stacked rows, their total last.
std::vector<int64_t> stacked_first_rows(const char* op, const at::Tensor& x, at::TensorList weights) {
  TORCH_CHECK(x.dim() == 2 && !weights.empty(), "fwp_dense.", op, ": x must be [M, K], with weights");
  check_cpu_contiguous(op, {&x}, x.scalar_type());
  std::vector<int64_t> first_row{0};
  for (const at::Tensor& w : weights) {
    TORCH_CHECK(w.dim() == 2 && w.size(1) == x.size(1), "fwp_dense.", op, ": every weight must be [N_g, K]");
    check_cpu_contiguous(op, {&w}, x.scalar_type());
    first_row.push_back(first_row.back() + w.size(0));
  }
  return first_row;
}

// x [M, K] against weights W_1 .. W_G ([N_g, K], no bias; e.g. a layer's q, k, v and beta projections of one
// input): out [M, N_1 + ... + N_G], W_g's outputs in its columns N_1 + ... + N_{g-1} onwards. One parallel pass over
// the rows of all weights (one op call and one wait for the threads instead of G).
void linear_rows_grouped(const at::Tensor& x, at::TensorList weights, const at::Tensor& out) {
  const std::vector<int64_t> first_row = stacked_first_rows("linear_rows_grouped", x, weights);
  const int64_t M = x.size(0), K = x.size(1), N = first_row.back();
  TORCH_CHECK(out.dim() == 2 && out.size(0) == M && out.size(1) == N,
              "fwp_dense.linear_rows_grouped: out must be [M, sum of the weights' rows]");
  check_cpu_contiguous("linear_rows_grouped", {&out}, x.scalar_type());
  const at::Tensor xs = dot_operand(x);
  AT_DISPATCH_SWITCH(x.scalar_type(), "linear_rows_grouped",
    AT_DISPATCH_CASE(at::kFloat, [&] { grouped_into<float>(weights, first_row, M, K, xs, x, out); })
    AT_DISPATCH_CASE(at::kBFloat16, [&] { grouped_into<c10::BFloat16>(weights, first_row, M, K, xs, x, out); }));
}

// x [M, K] against weights [N_g, K] (no bias) into outs[g] [M, N_g] (contiguous, x's dtype): bfloat16 in one pass
// over all their rows (linear_rows_grouped's), float32 one pass per weight (kernels/dense.py's dense_linears: its
// grouped pass decoded the 1.3B Delta Net more slowly). The same sums as linear_rows either way.
void linear_rows_into(const at::Tensor& x, at::TensorList weights, at::TensorList outs) {
  const std::vector<int64_t> first_row = stacked_first_rows("linear_rows_into", x, weights);
  TORCH_CHECK(outs.size() == weights.size(), "fwp_dense.linear_rows_into: one out per weight");
  std::vector<int64_t> ldo;
  for (size_t g = 0; g < weights.size(); ++g) {
    TORCH_CHECK(outs[g].dim() == 2 && outs[g].size(0) == x.size(0) && outs[g].size(1) == weights[g].size(0),
                "fwp_dense.linear_rows_into: every out must be [M, N_g]");
    check_cpu_contiguous("linear_rows_into", {&outs[g]}, x.scalar_type());
    ldo.push_back(weights[g].size(0));
  }
  if (x.scalar_type() == at::kFloat) {
    for (size_t g = 0; g < weights.size(); ++g) linear_rows(x, weights[g], std::nullopt, outs[g]);
    return;
  }
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "fwp_dense.linear_rows_into: float32 or bfloat16 rows expected");
  using W = c10::BFloat16;
  std::vector<W*> pointers;
  for (const at::Tensor& o : outs) pointers.push_back(o.data_ptr<W>());
  stacked_rows<W>(weights, first_row, x.size(0), x.size(1), dot_operand(x), x, pointers, ldo);
}

// short_conv_step's loop over the B x C channels (a few thousand: one thread), of width kWidth (0: `width`).
template <typename T, typename Acc, int64_t kWidth>
void conv_channels(int64_t B, int64_t C, int64_t width, const T* x, const T* cache, const T* weight, T* y,
                   T* new_cache) {
  const int64_t K = kWidth > 0 ? kWidth : width;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t c = 0; c < C; ++c) {
      const int64_t r = b * C + c;
      const T* before = cache + r * (K - 1);
      const T* w = weight + c * K;
      Acc s = 0;  // each tap one fused multiply-add, as conv_positions adds it
      for (int64_t i = 0; i < K - 1; ++i) s = std::fma(static_cast<Acc>(before[i]), static_cast<Acc>(w[i]), s);
      s = std::fma(static_cast<Acc>(x[r]), static_cast<Acc>(w[K - 1]), s);
      y[r] = static_cast<T>(s);
      for (int64_t i = 0; i + 1 < K - 1; ++i) new_cache[r * (K - 1) + i] = before[i + 1];
      new_cache[r * (K - 1) + K - 2] = x[r];
    }
  }
}

// short_conv_step's and short_conv's arguments: x [B, C] (dims 2) or [B, T, C] (dims 3), weight [C, K] with K >= 2,
// cache and new_cache [B, C, K - 1], y like x; one dtype, contiguous CPU tensors.
void check_convolution(const char* op, int64_t dims, const at::Tensor& x, const at::Tensor& cache,
                       const at::Tensor& weight, const at::Tensor& y, const at::Tensor& new_cache) {
  TORCH_CHECK(x.dim() == dims && weight.dim() == 2 && weight.size(0) == x.size(-1) && weight.size(1) >= 2, "fwp_dense.",
              op, ": x must be ", dims == 2 ? "[B, C]" : "[B, T, C]", " and weight [C, K] with K >= 2");
  const int64_t B = x.size(0), C = x.size(-1), K = weight.size(1);
  for (const at::Tensor* t : {&cache, &new_cache}) {
    TORCH_CHECK(t->dim() == 3 && t->size(0) == B && t->size(1) == C && t->size(2) == K - 1, "fwp_dense.", op,
                ": cache and new_cache must be [B, C, K - 1]");
  }
  TORCH_CHECK(y.sizes() == x.sizes(), "fwp_dense.", op, ": y must be shaped like x");
  check_cpu_contiguous(op, {&x, &cache, &weight, &y, &new_cache}, x.scalar_type());
}

// One position of a depthwise causal convolution of width K per channel (modeling_fwp's CausalConv1d):
// y[b, c] = sum_i weight[c, i] window[b, c, i], window = [cache[b, c, :], x[b, c]] (the K - 1 inputs before, then
// this one), sums in order i = 0..K-1 in float32 (float64 for float64); new_cache = window[..., 1:].
// x [B, C], cache [B, C, K - 1], weight [C, K], y [B, C], new_cache [B, C, K - 1]; one dtype, contiguous.
void short_conv_step(const at::Tensor& x, const at::Tensor& cache, const at::Tensor& weight, const at::Tensor& y,
                     const at::Tensor& new_cache) {
  check_convolution("short_conv_step", 2, x, cache, weight, y, new_cache);
  const int64_t B = x.size(0), C = x.size(1), K = weight.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "short_conv_step", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t *xp = x.data_ptr<scalar_t>(), *cp = cache.data_ptr<scalar_t>(), *wp = weight.data_ptr<scalar_t>();
    scalar_t *yp = y.data_ptr<scalar_t>(), *np = new_cache.data_ptr<scalar_t>();
    if (K == 4) {  // flash-linear-attention's width: a constant, so that the compiler unrolls the window
      conv_channels<scalar_t, acc_t, 4>(B, C, 4, xp, cp, wp, yp, np);
    } else {
      conv_channels<scalar_t, acc_t, 0>(B, C, K, xp, cp, wp, yp, np);
    }
  });
}

// short_conv's positions [t0, t1) of one sequence: x [T, C] (channels contiguous), cache [C, K - 1] (the K - 1 inputs
// before x), wt [K, C] the weight transposed in Acc; y [T, C]. Each output sums its K taps in order i = 0..K-1 (as
// short_conv_step), over the channels at once; `row` holds C sums. Each tap is one fused multiply-add, spelled out:
// left to the compiler's contraction, an AVX2 build contracted this loop and short_conv_step's differently (outputs
// 1 ulp apart in a third of the channels at B 2, T 300, C 130, K 5, float32; tests/test_dense.py).
template <typename T, typename Acc>
void conv_positions(int64_t t0, int64_t t1, int64_t C, int64_t K, const T* x, const T* cache, const Acc* wt, T* y,
                    Acc* row) {
  for (int64_t t = t0; t < t1; ++t) {
    std::fill(row, row + C, Acc(0));
    for (int64_t i = 0; i < K; ++i) {
      const int64_t p = t - (K - 1) + i;  // the input position of tap i
      const Acc* w = wt + i * C;
      if (p >= 0) {
        const T* in = x + p * C;
#pragma omp simd
        for (int64_t c = 0; c < C; ++c) row[c] = std::fma(static_cast<Acc>(in[c]), w[c], row[c]);
      } else {  // before x: the cache's entry K - 1 + p of every channel
        for (int64_t c = 0; c < C; ++c)
          row[c] = std::fma(static_cast<Acc>(cache[c * (K - 1) + K - 1 + p]), w[c], row[c]);
      }
    }
    for (int64_t c = 0; c < C; ++c) y[t * C + c] = static_cast<T>(row[c]);
  }
}

// A depthwise causal convolution of width K over T positions (modeling_fwp's CausalConv1d over a prefill), channels
// last: y[b, t, c] = sum_i weight[c, i] [cache[b, c, :], x[b, :, c]]_{t + i}, sums in order i = 0..K-1 in float32
// (float64 for float64) as short_conv_step; new_cache[b, c, :] = the last K - 1 inputs of [cache, x]. One pass over x
// where torch's path transposes it, concatenates the cache and convolves channels first (three passes and three
// tensors). x, y [B, T, C], cache, new_cache [B, C, K - 1], weight [C, K]; one dtype, contiguous.
void short_conv(const at::Tensor& x, const at::Tensor& cache, const at::Tensor& weight, const at::Tensor& y,
                const at::Tensor& new_cache) {
  check_convolution("short_conv", 3, x, cache, weight, y, new_cache);
  const int64_t B = x.size(0), T = x.size(1), C = x.size(2), K = weight.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "short_conv", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const at::Tensor wt = weight.to(c10::CppTypeToScalarType<acc_t>::value).t().contiguous();  // [K, C]
    const scalar_t *xp = x.data_ptr<scalar_t>(), *cp = cache.data_ptr<scalar_t>();
    const acc_t* wp = wt.data_ptr<acc_t>();
    scalar_t *yp = y.data_ptr<scalar_t>(), *np = new_cache.data_ptr<scalar_t>();
    at::parallel_for(0, B * T, std::max<int64_t>(1, 16384 / C), [&](int64_t begin, int64_t end) {
      std::vector<acc_t> row(C);
      for (int64_t b = begin / T; b <= (end - 1) / T; ++b) {  // the sequences this task's positions fall in
        const int64_t t0 = std::max(begin - b * T, int64_t(0)), t1 = std::min(end - b * T, T);
        conv_positions(t0, t1, C, K, xp + b * T * C, cp + b * C * (K - 1), wp, yp + b * T * C, row.data());
      }
    });
    for (int64_t b = 0; b < B; ++b) {  // the new cache: entry j is input position T - (K - 1) + j of [cache, x]
      for (int64_t c = 0; c < C; ++c) {
        for (int64_t j = 0; j < K - 1; ++j) {
          const int64_t p = T - (K - 1) + j;
          np[(b * C + c) * (K - 1) + j] = p >= 0 ? xp[(b * T + p) * C + c] : cp[(b * C + c) * (K - 1) + K - 1 + p];
        }
      }
    }
  });
}

// One row of normalize_rows: float32 sums of squares (vector sums), then each element scaled and rounded once.
template <typename T>
void normalize_row(int64_t D, const T* row, const float* gain, float eps, bool mean_square, T* out) {
  float squares = 0;
#pragma omp simd reduction(+ : squares)
  for (int64_t j = 0; j < D; ++j) squares += static_cast<float>(row[j]) * static_cast<float>(row[j]);
  const float scale = 1 / std::sqrt((mean_square ? squares / D : squares) + eps);
  for (int64_t j = 0; j < D; ++j) {
    const float normed = static_cast<float>(row[j]) * scale;
    out[j] = static_cast<T>(gain ? normed * gain[j] : normed);
  }
}

// Each row of x [N, D] scaled to unit RMS (mean_square: x / sqrt(mean(x^2) + eps), times weight [D] if given:
// RMSNorm) or unit L2 norm (x / sqrt(sum(x^2) + eps)), in float32 for every dtype (float64 inputs rounded to float32
// first, as modeling_fwp's x.float() does), rounded once into out.
void normalize_rows(const at::Tensor& x, const std::optional<at::Tensor>& weight, double eps, bool mean_square,
                    const at::Tensor& out) {
  TORCH_CHECK(x.dim() == 2 && out.sizes() == x.sizes(), "fwp_dense.normalize_rows: x and out must be [N, D]");
  const int64_t N = x.size(0), D = x.size(1);
  check_cpu_contiguous("normalize_rows", {&x, &out}, x.scalar_type());
  if (weight.has_value()) {
    TORCH_CHECK(weight->numel() == D && weight->is_contiguous(), "fwp_dense.normalize_rows: weight must be [D]");
  }
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "normalize_rows", [&] {
    const at::Tensor gain = weight.has_value() ? weight->to(at::kFloat).contiguous() : at::Tensor();
    const float* g = weight.has_value() ? gain.data_ptr<float>() : nullptr;
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, N, std::max<int64_t>(1, 32768 / std::max<int64_t>(1, D)), [&](int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n) {
        normalize_row(D, xp + n * D, g, static_cast<float>(eps), mean_square, op + n * D);
      }
    });
  });
}

// A decode step of a pre-norm block with RMSNorms and a SwiGLU feed-forward (modeling_fwp's FastWeightBlock) in two
// calls around its mixing layer (the fast-weight layer's token_step, csrc/chunk_delta.cpp), instead of a dozen op and
// module calls whose Python runs 2-3 times slower in a decode step than alone: the weights streamed between them push
// the interpreter's data out of the caches (1.3B Delta Net, bfloat16, 1 thread: 16-22 ms per token outside the
// kernels, 6.5 ms with the weight reads stubbed out; by hand, 2026-12-01). Each value is the unfused ops' own: the
// same functions (normalize_rows, linear_rows and its grouped pass) and ATen's add, silu and mul.

// The block up to its mixing layer: n = RMSNorm(x) * norm_weight (Zhang and Sennrich 2019), then n W_g^T into
// outs[g] for each projection of the layer (its q, k, v, beta, ...). x [M, D]; norm_weight [D]; weights [N_g, D];
// outs [M, N_g]; x, weights and outs of one dtype, contiguous.
void norm_linear_rows(const at::Tensor& x, const at::Tensor& norm_weight, double eps, at::TensorList weights,
                      at::TensorList outs) {
  const at::Tensor normed = at::empty_like(x);
  normalize_rows(x, norm_weight, eps, /*mean_square=*/true, normed);
  linear_rows_into(normed, weights, outs);
}

// The block after its mixing layer's output `mixed` [M, Dv]: h = x + mixed W_o^T; n = RMSNorm(h) * norm_weight;
// out = h + (SiLU(n W_gate^T) * n W_up^T) W_down^T (SwiGLU, Shazeer 2020). x, out [M, D]; o_weight [D, Dv];
// gate_weight, up_weight [F, D]; down_weight [D, F]; one dtype (norm_weight any), contiguous; no biases.
void swiglu_block_rows(const at::Tensor& x, const at::Tensor& mixed, const at::Tensor& o_weight,
                       const at::Tensor& norm_weight, double eps, const at::Tensor& gate_weight,
                       const at::Tensor& up_weight, const at::Tensor& down_weight, const at::Tensor& out) {
  TORCH_CHECK(x.dim() == 2 && mixed.dim() == 2 && mixed.size(0) == x.size(0) && out.sizes() == x.sizes() &&
                  o_weight.dim() == 2 && o_weight.size(0) == x.size(1) && down_weight.dim() == 2 &&
                  down_weight.size(0) == x.size(1),
              "fwp_dense.swiglu_block_rows: x, out [M, D], mixed [M, Dv], o_weight [D, Dv], down_weight [D, F]");
  const int64_t M = x.size(0);
  at::Tensor update = at::empty({M, x.size(1)}, x.options());
  linear_rows(mixed, o_weight, std::nullopt, update);
  const at::Tensor h = at::add(x, update);
  const at::Tensor normed = at::empty_like(h);
  normalize_rows(h, norm_weight, eps, /*mean_square=*/true, normed);
  const at::Tensor gate = at::empty({M, gate_weight.size(0)}, x.options()), up = at::empty_like(gate);
  linear_rows_into(normed, {gate_weight, up_weight}, {gate, up});
  linear_rows(at::mul(at::silu(gate), up), down_weight, std::nullopt, update);
  at::Tensor result = out;  // (a handle: the op writes out's data)
  at::add_out(result, h, update);
}

// The fast-weight layer's token step (csrc/chunk_delta.cpp's token_step, in the chunk kernel's library), called
// through the dispatcher: its C++ signature, and the handle of the op named `name` (looked up once per name).
using TokenStep = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                       const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                       const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, at::TensorList,
                       at::TensorList, const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, int64_t,
                       int64_t, bool, bool, double, double, double, double, int64_t, at::TensorList,
                       const at::Tensor&, const at::Tensor&);

c10::TypedOperatorHandle<TokenStep> token_step_op(c10::string_view name) {
  static std::mutex mutex;
  static std::unordered_map<std::string, c10::TypedOperatorHandle<TokenStep>> handles;
  const std::string key(name);
  std::lock_guard<std::mutex> lock(mutex);
  auto found = handles.find(key);
  if (found == handles.end()) {
    TORCH_CHECK(key.size() > 12 && key.compare(key.size() - 12, 12, "::token_step") == 0,
                "fwp_dense.block_decode_step: `token_step` must name a token_step op, got ", key);
    auto handle = c10::Dispatcher::singleton().findSchemaOrThrow(key.c_str(), "").typed<TokenStep>();
    found = handles.emplace(key, handle).first;
  }
  return found->second;
}

std::optional<at::Tensor> contiguous_or_none(const std::optional<at::Tensor>& x) {
  return x.has_value() ? std::optional<at::Tensor>(x->contiguous()) : std::nullopt;
}

// A decode step of a whole pre-norm block with RMSNorms and a SwiGLU feed-forward around a fast-weight layer's token
// step, in one call (modeling_fwp's FastWeightBlock, fla's Delta Nets and Gated DeltaNets): norm_linear_rows into the
// layer's projections (q, k, v, then beta's, the output gate's and the decay's at beta_index, gate_index, decay_index,
// -1 where the layer has none), the token step on them (the token_step op named `token_step`, taking the layer's
// parameters, states and options after them as that op does: A_log .. gate_activation, new_conv_states, S_out), then
// swiglu_block_rows into out. Python calls one op per block and token instead of three, and none of the
// allocations, views and contiguity calls between them: a decode step's Python runs 2-3 times slower between the
// weight reads than alone (the norm_linear_rows comment). Each value is the three calls' own. Convolution weights
// [C, 1, K] or [C, K]; convolution states converted to x's dtype and, as S and the optional tensors, made contiguous
// as the layer's Python does for the op.
void block_decode_step(const at::Tensor& x, const at::Tensor& norm_weight, double eps,
                       at::TensorList projection_weights, c10::string_view token_step, int64_t beta_index,
                       int64_t gate_index, int64_t decay_index,
                       const std::optional<at::Tensor>& A_log, const std::optional<at::Tensor>& dt_bias,
                       at::TensorList conv_weights, at::TensorList conv_states, const std::optional<at::Tensor>& S,
                       const std::optional<at::Tensor>& o_norm_weight, int64_t num_heads, int64_t feature_map,
                       bool sum_normalization, bool value_silu, double l2_eps, double query_scale, double beta_scale,
                       double o_norm_eps, int64_t gate_activation, const at::Tensor& o_weight,
                       const at::Tensor& ff_norm_weight, double ff_eps, const at::Tensor& gate_weight,
                       const at::Tensor& up_weight, const at::Tensor& down_weight, at::TensorList new_conv_states,
                       const at::Tensor& S_out, const at::Tensor& out) {
  const int64_t P = static_cast<int64_t>(projection_weights.size());
  TORCH_CHECK(x.dim() == 2 && P >= 3 && o_weight.dim() == 2, "fwp_dense.block_decode_step: x [M, D], at least the q, "
              "k, v projection weights and o_weight [D, Dv] expected");
  int64_t given = 0;  // the optional projections the layer has
  for (int64_t index : {beta_index, gate_index, decay_index}) {
    TORCH_CHECK(index == -1 || (index >= 3 && index < P), "fwp_dense.block_decode_step: a projection index must be -1 "
                "or in [3, ", P, "), got ", index);
    given += index >= 0;
  }
  TORCH_CHECK(P == 3 + given && (beta_index < 0 || (beta_index != gate_index && beta_index != decay_index)) &&
                  (gate_index < 0 || gate_index != decay_index),
              "fwp_dense.block_decode_step: one projection weight each for q, k, v and the indices given");
  const at::Tensor rows = x.contiguous();
  std::vector<at::Tensor> projected;
  for (const at::Tensor& w : projection_weights) projected.push_back(at::empty({x.size(0), w.size(0)}, x.options()));
  norm_linear_rows(rows, norm_weight, eps, projection_weights, projected);
  auto output = [&](int64_t index) { return index < 0 ? std::nullopt : std::optional<at::Tensor>(projected[index]); };
  std::vector<at::Tensor> weights, states;
  for (const at::Tensor& w : conv_weights) weights.push_back(w.dim() == 3 ? w.reshape({w.size(0), -1}) : w);
  for (const at::Tensor& s : conv_states) states.push_back(s.to(x.scalar_type()).contiguous());
  const at::Tensor mixed = at::empty({x.size(0), o_weight.size(1)}, x.options());
  token_step_op(token_step).call(projected[0], projected[1], projected[2], output(beta_index), output(decay_index),
                                 A_log, dt_bias, output(gate_index), weights, states, contiguous_or_none(S),
                                 contiguous_or_none(o_norm_weight), num_heads, feature_map, sum_normalization,
                                 value_silu, l2_eps, query_scale, beta_scale, o_norm_eps, gate_activation,
                                 new_conv_states, S_out, mixed);
  swiglu_block_rows(rows, mixed, o_weight, ff_norm_weight, ff_eps, gate_weight, up_weight, down_weight, out);
}

// Large CPU buffers kept for reuse while a model runs (reuse_buffers_enter / reuse_buffers_exit). A forward over many
// positions allocates and frees tensors of a few MB to a few hundred MB, the same sizes in every layer. glibc returns
// them to the system when they are freed (fresh mappings above its mmap threshold, a trimmed heap top below it), so
// every new one is faulted in again page by page: on this VM about 1 ms per MB, a third of the 1.3B Delta Net's float32
// prefill of 2,048 tokens (a 16 MB RMSNorm output 17.7 ms where the same op on reused memory takes 1.6 ms, profiled by
// hand, 2026-11-29). The first enter installs this allocator as c10's CPU allocator for good: oneDNN (through ideep)
// takes buffers with the CPU allocator's raw_allocate and returns them, maybe much later, with whatever allocator is
// installed then, so swapping allocators back and forth paired one allocator's pointers with the other's deleter (a
// double free in about one of eight runs of three threads' concurrent forwards). Outside every scope it is c10's
// (c10::alloc_cpu / free_cpu, reported to the profiler as c10's); inside one, a freed block of at least
// kMinReusedBytes goes to a free list by its size (up to kMaxCachedBytes in all) and the next request of that size
// takes it back, pages still mapped; the last exit frees the kept blocks. Blocks are plain c10::alloc_cpu pointers (any
// deleter may free them); `large` knows the sizes of ours, so the raw deleter also takes pointers c10's own allocator
// handed out before the install.
namespace buffers {

constexpr size_t kMinReusedBytes = size_t(1) << 20;
constexpr size_t kRoundBytes = size_t(64) << 10;  // sizes rounded up to 64 KB, so that near sizes share a list
constexpr size_t kMaxCachedBytes = size_t(2) << 30;

void release(void* data);
void release_small(void* data);

struct ReusingAllocator final : at::Allocator {
  std::mutex mutex;
  std::unordered_map<void*, size_t> large;                     // our blocks of >= kMinReusedBytes: their sizes
  std::unordered_map<size_t, std::vector<void*>> free_blocks;  // the kept ones by size
  size_t cached_bytes = 0;
  int64_t depth = 0, reused = 0;
  bool installed = false;  // whether c10 took it (SetCPUAllocator ignores an allocator of lower priority)

  at::DataPtr allocate(size_t n) override {
    if (n < kMinReusedBytes) {
      void* data = c10::alloc_cpu(n);
      c10::profiledCPUMemoryReporter().New(data, n);
      return {data, data, &release_small, at::Device(at::DeviceType::CPU)};
    }
    const size_t total = (n + kRoundBytes - 1) / kRoundBytes * kRoundBytes;
    void* data = nullptr;
    {
      std::lock_guard<std::mutex> lock(mutex);
      auto found = free_blocks.find(total);
      if (found != free_blocks.end() && !found->second.empty()) {
        data = found->second.back();
        found->second.pop_back();
        cached_bytes -= total;
        ++reused;
      }
    }
    if (data == nullptr) {
      data = c10::alloc_cpu(total);
      std::lock_guard<std::mutex> lock(mutex);
      large[data] = total;
    }
    c10::profiledCPUMemoryReporter().New(data, total);
    return {data, data, &release, at::Device(at::DeviceType::CPU)};
  }
  at::DeleterFnPtr raw_deleter() const override { return &release; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  // A block back from its user: one of ours is kept while entered (and there is room); anything else is freed.
  void give_back(void* data) {
    {
      std::lock_guard<std::mutex> lock(mutex);
      auto ours = large.find(data);
      if (ours != large.end()) {
        if (depth > 0 && cached_bytes + ours->second <= kMaxCachedBytes) {
          free_blocks[ours->second].push_back(data);
          cached_bytes += ours->second;
          return;
        }
        large.erase(ours);
      }
    }
    c10::free_cpu(data);
  }
};

ReusingAllocator& reusing_allocator() {
  static ReusingAllocator* allocator = new ReusingAllocator();  // never destroyed: tensors may outlive everything
  return *allocator;
}

void release(void* data) {
  if (data == nullptr) return;
  c10::profiledCPUMemoryReporter().Delete(data);
  reusing_allocator().give_back(data);
}

void release_small(void* data) {
  if (data == nullptr) return;  // (a request of 0 bytes; c10's own deleter returns there too)
  c10::profiledCPUMemoryReporter().Delete(data);
  c10::free_cpu(data);
}

}  // namespace buffers

// Enters the scope in which CPU tensors' large blocks are reused (nested and concurrent scopes counted).
void reuse_buffers_enter() {
  buffers::ReusingAllocator& a = buffers::reusing_allocator();
  std::lock_guard<std::mutex> lock(a.mutex);
  if (!a.installed) {
    c10::SetCPUAllocator(&a, /*priority=*/0);
    a.installed = c10::GetCPUAllocator() == &a;
  }
  ++a.depth;
}

// Leaves it; the last exit frees the kept blocks (the allocator stays: see above).
void reuse_buffers_exit() {
  buffers::ReusingAllocator& a = buffers::reusing_allocator();
  std::vector<void*> blocks;
  {
    std::lock_guard<std::mutex> lock(a.mutex);
    TORCH_CHECK(a.depth > 0, "fwp_dense.reuse_buffers_exit: not entered");
    if (--a.depth > 0) return;
    for (auto& entry : a.free_blocks) {
      for (void* data : entry.second) a.large.erase(data);
      blocks.insert(blocks.end(), entry.second.begin(), entry.second.end());
    }
    a.free_blocks.clear();
    a.cached_bytes = 0;
  }
  for (void* data : blocks) c10::free_cpu(data);
}

// [depth, installed, blocks reused so far, bytes kept now]: for tests.
std::vector<int64_t> reuse_buffers_stats() {
  buffers::ReusingAllocator& a = buffers::reusing_allocator();
  std::lock_guard<std::mutex> lock(a.mutex);
  return {a.depth, a.installed, a.reused, static_cast<int64_t>(a.cached_bytes)};
}

}  // namespace

FWP_TORCH_LIBRARY(FWP_OP_NAMESPACE, m) {
  m.def("linear_rows(Tensor x, Tensor weight, Tensor? bias, Tensor(a!) out) -> ()");
  m.def("linear_rows_grouped(Tensor x, Tensor[] weights, Tensor(a!) out) -> ()");
  m.def("norm_linear_rows(Tensor x, Tensor norm_weight, float eps, Tensor[] weights, Tensor(a!)[] outs) -> ()");
  m.def("swiglu_block_rows(Tensor x, Tensor mixed, Tensor o_weight, Tensor norm_weight, float eps, Tensor gate_weight, "
        "Tensor up_weight, Tensor down_weight, Tensor(a!) out) -> ()");
  m.def("block_decode_step(Tensor x, Tensor norm_weight, float eps, Tensor[] projection_weights, str token_step, "
        "int beta_index, int gate_index, int decay_index, Tensor? A_log, Tensor? dt_bias, Tensor[] conv_weights, "
        "Tensor[] conv_states, Tensor? S, Tensor? o_norm_weight, int num_heads, int feature_map, "
        "bool sum_normalization, bool value_silu, float l2_eps, float query_scale, float beta_scale, float o_norm_eps, "
        "int gate_activation, Tensor o_weight, Tensor ff_norm_weight, float ff_eps, Tensor gate_weight, "
        "Tensor up_weight, Tensor down_weight, Tensor(a!)[] new_conv_states, Tensor(b!) S_out, Tensor(c!) out) -> ()");
  m.def("short_conv_step(Tensor x, Tensor cache, Tensor weight, Tensor(a!) y, Tensor(b!) new_cache) -> ()");
  m.def("short_conv(Tensor x, Tensor cache, Tensor weight, Tensor(a!) y, Tensor(b!) new_cache) -> ()");
  m.def("normalize_rows(Tensor x, Tensor? weight, float eps, bool mean_square, Tensor(a!) out) -> ()");
  m.def("reuse_buffers_enter() -> ()", &reuse_buffers_enter);
  m.def("reuse_buffers_exit() -> ()", &reuse_buffers_exit);
  m.def("reuse_buffers_stats() -> int[]", &reuse_buffers_stats);
}

FWP_TORCH_LIBRARY_IMPL(FWP_OP_NAMESPACE, CPU, m) {
  m.impl("linear_rows", &linear_rows);
  m.impl("linear_rows_grouped", &linear_rows_grouped);
  m.impl("norm_linear_rows", &norm_linear_rows);
  m.impl("swiglu_block_rows", &swiglu_block_rows);
  m.impl("block_decode_step", &block_decode_step);
  m.impl("short_conv_step", &short_conv_step);
  m.impl("short_conv", &short_conv);
  m.impl("normalize_rows", &normalize_rows);
}
