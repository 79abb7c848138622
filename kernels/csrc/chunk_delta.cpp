// Chunkwise fast weights on CPU: the delta rule (Schlag, Irie, Schmidhuber 2021, eqs. 20-25) and the sum
// rule (eq. 17), one (batch, head) sequence per task of at::parallel_for, its chunks in order.
//
// Built on first use by kernels/chunk.py with torch.utils.cpp_extension.load. The derivation, forward and
// backward, is in kernels/README.md ("CPU kernel"). Per chunk of c rows, with the state S [Dv, Dk]
// entering it (y = S q):
//
//   delta rule:  (I + A) U' = diag(beta) (V - K S^T),   A = strictly_lower(diag(beta) K K^T)
//   sum rule:    U' = V
//   both:        O = Q S^T + tril(Q K^T) U',            S <- S + U'^T K
//
// U' (the new values written to the state, "pseudo-values") comes from one triangular solve per chunk (forward
// substitution), so the UT-transform matrix T = (I + A)^-1 and the WY factors are never formed. Each chunk is two
// products on one buffer (chunk_forward_seq, ChunkProducts), computed by a Gemm policy: the BLAS that PyTorch links
// (sgemm_ / dgemm_), or this file's AVX-512 micro-kernel with float32 factors or bfloat16 factors and float32 sums
// ("The products" below; bfloat16 inputs with bfloat16 factors are read in place as pairs); no tensor allocation and
// no dispatcher in the loop. Matrices are row-major; `gemm_rm` maps a row-major product to the column-major BLAS call
// by computing its transpose.
//
// The gated delta rule (Yang et al. 2025) has its section at the end ("namespace gated"): its own chunk loop with the
// same products and substitutions. The Python wrapper allocates every output and passes it in; this file only runs
// loops over raw pointers.

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <new>
#include <type_traits>
#include <vector>
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>  // arch_prctl: the permission to use AMX's tile registers (tiles_usable)
#include <unistd.h>
#endif

namespace {
// 64-byte aligned storage (a cache line, an AVX-512 register, a row of an AMX tile) for the kernels' buffers: a
// std::vector's heap block is only 16-byte aligned, so that the rows of a buffer (the chunk's Z, the packed operands)
// crossed cache lines in most placements, and a build's speed moved with where its buffers fell (two builds side by
// side read 1.17x in one process and 0.91x in the next, by hand). Aligned, against the 16-byte buffers (same bits,
// bench_chunk_builds.py --base 1d860ea, bench_chunk_builds_aligned.json; B1 H8 T4096 D64, Intel Xeon with AMX, 1 / 2
// threads): the bfloat16 forward 1.10-1.13x faster, forward + backward 1.04-1.18x; float32 0.97-1.14x; T = 16
// 0.98-1.05x.
template <typename T>
struct CacheLineAllocator {
  using value_type = T;
  CacheLineAllocator() = default;
  template <typename U>
  CacheLineAllocator(const CacheLineAllocator<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <typename U>
  bool operator==(const CacheLineAllocator<U>&) const { return true; }
  template <typename U>
  bool operator!=(const CacheLineAllocator<U>&) const { return false; }
};
template <typename T>
using Buffer = std::vector<T, CacheLineAllocator<T>>;
}  // namespace

// The ops' namespace: fwp_chunk_<build key> when cpp_build compiles this file (-DFWP_OP_NAMESPACE), one
// per build, so that builds of different sources (the package's, a saved model folder's older copy) load side by
// side in one process (two TORCH_LIBRARY blocks of one namespace abort it).
#ifndef FWP_OP_NAMESPACE
#define FWP_OP_NAMESPACE fwp_chunk
#endif
// TORCH_LIBRARY pastes its argument unexpanded: one more macro level expands FWP_OP_NAMESPACE first.
#define FWP_TORCH_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define FWP_TORCH_LIBRARY_IMPL(ns, key, m) TORCH_LIBRARY_IMPL(ns, key, m)

extern "C" {
// Fortran BLAS, LP64 (32-bit integers), as exported by the BLAS that libtorch_cpu links.
void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k, const float* alpha,
            const float* a, const int* lda, const float* b, const int* ldb, const float* beta, float* c,
            const int* ldc);
void dgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k, const double* alpha,
            const double* a, const int* lda, const double* b, const int* ldb, const double* beta, double* c,
            const int* ldc);
// MKL's per-thread thread count, C interface (returns the previous one; 0 = the global setting). Weak: see
// SequentialBlasInTask. (The lower-case mkl_set_num_threads_local that libtorch_cpu exports is the Fortran one.)
int MKL_Set_Num_Threads_Local(int nt) __attribute__((weak));
}

namespace {

inline void blas_gemm(char ta, char tb, int m, int n, int k, float alpha, const float* a, int lda, const float* b,
                      int ldb, float beta, float* c, int ldc) {
  sgemm_(&ta, &tb, &m, &n, &k, &alpha, a, &lda, b, &ldb, &beta, c, &ldc);
}
inline void blas_gemm(char ta, char tb, int m, int n, int k, double alpha, const double* a, int lda,
                      const double* b, int ldb, double beta, double* c, int ldc) {
  dgemm_(&ta, &tb, &m, &n, &k, &alpha, a, &lda, b, &ldb, &beta, c, &ldc);
}
// Row-major C [m, n] = alpha op(A) op(B) + beta C, with op(A) [m, k] and op(B) [k, n]. A row-major matrix is
// the column-major storage of its transpose, so this is the column-major C^T = op(B)^T op(A)^T.
template <typename T>
inline void gemm_rm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, T alpha, const T* A, int64_t lda,
                    const T* B, int64_t ldb, T beta, T* C, int64_t ldc) {
  blas_gemm(trans_b ? 'T' : 'N', trans_a ? 'T' : 'N', int(n), int(m), int(k), alpha, B, int(ldb), A, int(lda), beta,
            C, int(ldc));
}

// ---------------------------------------------------------------------------------------------------------------
// The products of the chunk loops. Each is gemm_rm's C [m, n] = alpha op(A) op(B) + beta C (beta 0 or 1) on row-major
// float32 (or float64) matrices; a Gemm policy says how it is computed:
//   BlasGemm    the BLAS that PyTorch links (MKL: AVX2 code on AMD CPUs, AVX-512 on Intel's);
//   VectorGemm  a micro-kernel of this file for CPUs with AVX-512 or with AVX2 and FMA (float32), or with AVX-512 BF16
//               (bfloat16 factors, each operand rounded to bfloat16 to nearest even as it is packed, float32 sums: as
//               fla's Triton kernels multiply on a GPU).
template <typename T>
struct BlasGemm {
  void operator()(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, T alpha, const T* A, int64_t lda,
                  const T* B, int64_t ldb, T beta, T* C, int64_t ldc) const {
    gemm_rm<T>(trans_a, trans_b, m, n, k, alpha, A, lda, B, ldb, beta, C, ldc);
  }
};

// Which policy a call of the ops asks for (their `products` argument).
// kTileBfloat16: the bfloat16 factors of kVectorBfloat16 multiplied in AMX's tile registers (tile_gemm).
enum Products : int64_t { kBlas = 0, kVectorFloat32 = 1, kVectorBfloat16 = 2, kTileBfloat16 = 3 };

// sum_j x_j y_j over n elements, summed in vector lanes (in the order the compiler's reduction picks: a serial sum is
// one dependent add per element, which made the backward's row sums and the gated rule's <S, dS'> a sizeable share of
// its time); float32 with AVX-512: the overloads below. dot(n, x, y, z): sum_j x_j (y_j - z_j).
template <typename T>
inline T dot(int64_t n, const T* x, const T* y) {
  T acc = 0;
#pragma omp simd reduction(+ : acc)
  for (int64_t j = 0; j < n; ++j) acc += x[j] * y[j];
  return acc;
}
template <typename T>
inline T dot(int64_t n, const T* x, const T* y, const T* z) {
  T acc = 0;
#pragma omp simd reduction(+ : acc)
  for (int64_t j = 0; j < n; ++j) acc += x[j] * (y[j] - z[j]);
  return acc;
}

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Cache lines a chunk loop asks for ahead of their use (RowsAhead, with the vector products), issued a few at a time,
// before each tile of those products, rather than a chunk's rows at once: a burst of 64-256 lines fills the core's
// miss buffers, and the prefetch that finds none free holds the loop until one drains (by `perf`, B1 H8 T4096 D64,
// float32, 1 thread: 16% of the forward's time on the instructions after its prefetches). 16 lines per tile reach
// every line of a chunk in time at D = 64-128, C = 16-64 (a chunk's rows are 12-16 lines per tile at D = 64); fewer
// fell behind and bunched again (12 per tile: the forward at C = 32 5% slower than with bursts), more per tile stall
// again (20: 3% slower than 16 at C = 16, 32: 8%; by hand, side by side in one process). What a chunk asked for and
// no tile issued goes at once when the next chunk begins (issue_all); what is left when the loop ends is dropped
// (clear). One per thread.
class PacedLines {
 public:
  static constexpr int64_t kPerTile = 16;
  void add(const void* start, int64_t bytes, bool write) {
    if (bytes <= 0) return;
    if (count_ == kRanges) issue(lines_of(ranges_[first_]));  // (not reached: a chunk asks for 10 ranges at most)
    ranges_[(first_ + count_++) % kRanges] = {static_cast<const char*>(start), static_cast<const char*>(start) + bytes,
                                              write};
  }
  // issues up to `lines` of the oldest ranges
  void issue(int64_t lines) {
    while (count_ > 0 && lines > 0) {
      Range& r = ranges_[first_];
      for (; r.at < r.end && lines > 0; r.at += 64, --lines) {
        if (r.write) {
          __builtin_prefetch(r.at, 1);
        } else {
          __builtin_prefetch(r.at, 0);
        }
      }
      if (r.at >= r.end) first_ = (first_ + 1) % kRanges, --count_;
    }
  }
  void issue_all() {
    while (count_ > 0) issue(lines_of(ranges_[first_]));
  }
  void clear() { count_ = 0; }

 private:
  struct Range {
    const char* at = nullptr;
    const char* end = nullptr;
    bool write = false;
  };
  static int64_t lines_of(const Range& r) { return (r.end - r.at + 63) / 64; }
  static constexpr int kRanges = 16;
  Range ranges_[kRanges] = {};
  int first_ = 0, count_ = 0;
};
inline PacedLines& paced_lines() {
  thread_local PacedLines lines;
  return lines;
}

#if defined(__AVX512F__)
#define FWP_VECTOR_PRODUCTS 1
#include <immintrin.h>

// The first min(max(n, 0), 16) of 16 lanes.
inline __mmask16 first_lanes(int64_t n) {
  return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << std::max<int64_t>(n, 0)) - 1);
}

// dot for float32: 16 lanes of fused multiply-adds, then the lanes' sum as a tree (GCC ends the generic one's
// `omp simd` reduction with 16 dependent scalar adds from the stack; by perf, that tail was about an eighth of the
// gated rule's delta_rule_chunk_backward in bfloat16, where each row of a chunk takes one or two dots). Against the
// generic one, on Zen 4: fwd+bwd 1.03x in bfloat16, 0.98-1.01x in float32 (bench_chunk_builds_float32_dot.json).
inline float dot(int64_t n, const float* x, const float* y) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 lanes = first_lanes(n - j);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(lanes, x + j), _mm512_maskz_loadu_ps(lanes, y + j), acc);
  }
  return _mm512_reduce_add_ps(acc);
}
inline float dot(int64_t n, const float* x, const float* y, const float* z) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 lanes = first_lanes(n - j);
    const __m512 difference = _mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, y + j), _mm512_maskz_loadu_ps(lanes, z + j));
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(lanes, x + j), difference, acc);
  }
  return _mm512_reduce_add_ps(acc);
}

// float32 factors: one element of A broadcast against 16 columns of B, fused multiply-add.
struct Float32Factors {
  using Element = float;
  using Vec = __m512;
  static constexpr int64_t kPerStep = 1;  // elements of the inner dimension per step
  static Vec load(const float* b, __mmask16 lanes) { return _mm512_maskz_loadu_ps(lanes, b); }
  static Vec broadcast(const float* a) { return _mm512_set1_ps(*a); }
  static __m512 multiply_add(__m512 acc, Vec a, Vec b) { return _mm512_fmadd_ps(a, b, acc); }
};

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define FWP_NATIVE_BF16 1
using bf16_bits = uint16_t;
// two bfloat16 side by side (read in place from a bfloat16 tensor: 2-byte aligned)
typedef uint32_t pair_bits __attribute__((__may_alias__, __aligned__(2)));

// bfloat16 factors: a pair of A (two steps of the inner dimension) broadcast against 16 column pairs of B, vdpbf16ps.
struct Bfloat16Factors {
  using Element = bf16_bits;
  using Vec = __m512bh;
  static constexpr int64_t kPerStep = 2;
  static Vec load(const bf16_bits* b, __mmask16 lanes) { return (__m512bh)_mm512_maskz_loadu_epi32(lanes, b); }
  static Vec broadcast(const bf16_bits* a) {
    return (__m512bh)_mm512_set1_epi32(*reinterpret_cast<const pair_bits*>(a));
  }
  static __m512 multiply_add(__m512 acc, Vec a, Vec b) { return _mm512_dpbf16_ps(acc, a, b); }
};
#endif

// Rows 2p and 2p + 1 of a result, 16 columns each, as 16 bfloat16 pairs (rounded to nearest even; as pack_pairs).
inline void store_pairs(uint16_t* out, __m512 even_row, __m512 odd_row);

// alpha sums + beta c for 16 columns of C at `c` (`keep` of them read and written; c not read where beta is 0),
// stored and returned: the last step of every product (tile's, and tile_results' for the AMX tiles).
inline __m512 write_result(__m512 sums, float* c, __mmask16 keep, __m512 scale, __m512 prior_scale, float beta) {
  __m512 prior = _mm512_setzero_ps();
  if (beta != 0.f) prior = _mm512_maskz_loadu_ps(keep, c);
  if (beta != 0.f && beta != 1.f) prior = _mm512_mul_ps(prior_scale, prior);
  const __m512 result = _mm512_fmadd_ps(scale, sums, prior);
  _mm512_mask_storeu_ps(c, keep, result);
  return result;
}

// The micro-kernel: C [MR, 16 NV] = alpha A B + beta C (C not read when beta is 0), MR x NV float32 sums in registers,
// over `steps` steps of the inner dimension. Row r's step s of A is at A + r a_row + s a_step; B's step s is the row at
// B + s b_step (F::kPerStep elements per column). The last 16 columns keep `lanes` of theirs (n not a multiple of 16).
// With kPairs, the tile's rows (its first row even) are also written rounded to bfloat16 pairs of rows into `pairs`, in
// pack_pairs' layout (pair row stride pairs_ld elements, zero past the last row and column): the packed operand of a
// later product, formed while the results are still in registers.
template <typename F, int MR, int NV, bool kPairs = false>
inline void tile(int64_t steps, const typename F::Element* A, int64_t a_row, int64_t a_step,
                 const typename F::Element* B, int64_t b_step, float alpha, float* C, int64_t ldc, float beta,
                 __mmask16 lanes, uint16_t* pairs = nullptr, int64_t pairs_ld = 0) {
  // every loop over r and v unrolled, so that the sums live in registers (left rolled, GCC kept acc on the stack and
  // the float32 forward took 16.1 instead of 8.8 ms at B1 H8 T4096 D64, C = 16, 1 thread)
  __m512 acc[MR][NV];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t s = 0; s < steps; ++s) {
    typename F::Vec b[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) b[v] = F::load(B + s * b_step + 16 * F::kPerStep * v, v + 1 < NV ? 0xFFFF : lanes);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const typename F::Vec a = F::broadcast(A + r * a_row + s * a_step);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] = F::multiply_add(acc[r][v], a, b[v]);
    }
  }
  const __m512 scale = _mm512_set1_ps(alpha), prior_scale = _mm512_set1_ps(beta);
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v)
      acc[r][v] = write_result(acc[r][v], C + r * ldc + 16 * v, v + 1 < NV ? 0xFFFF : lanes, scale, prior_scale, beta);
  }
  if constexpr (kPairs) {
#pragma GCC unroll 4
    for (int r = 0; r < MR; r += 2)
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v)
        store_pairs(pairs + (r / 2) * pairs_ld + 32 * v, acc[r][v], r + 1 < MR ? acc[r + 1][v] : _mm512_setzero_ps());
  }
}

// The last rows (fewer than a full tile): tile with MR = rows, chosen at run time.
template <typename F, int NV, bool kPairs, int R = 1>
inline void tile_rows(int rows, int64_t steps, const typename F::Element* A, int64_t a_row, int64_t a_step,
                      const typename F::Element* B, int64_t b_step, float alpha, float* C, int64_t ldc,
                      float beta, __mmask16 lanes, uint16_t* pairs, int64_t pairs_ld) {
  if constexpr (R < 8) {
    if (rows == R)
      return tile<F, R, NV, kPairs>(steps, A, a_row, a_step, B, b_step, alpha, C, ldc, beta, lanes, pairs,
                                    pairs_ld);
    tile_rows<F, NV, kPairs, R + 1>(rows, steps, A, a_row, a_step, B, b_step, alpha, C, ldc, beta, lanes, pairs,
                                    pairs_ld);
  }
}

// C [m, 16 NV at most] in tiles of MR rows: 6 x 4 or 8 x NV accumulators (of 32 vector registers); MR even, so that
// every tile starts at an even row (kPairs).
template <typename F, int NV, bool kPairs>
void tiles(int64_t m, int64_t steps, const typename F::Element* A, int64_t a_row, int64_t a_step,
           const typename F::Element* B, int64_t b_step, float alpha, float* C, int64_t ldc, float beta,
           __mmask16 lanes, uint16_t* pairs, int64_t pairs_ld, PacedLines& lines) {
  constexpr int MR = NV >= 3 ? 6 : 8;
  int64_t i = 0;
  for (; i + MR <= m; i += MR) {
    lines.issue(PacedLines::kPerTile);
    tile<F, MR, NV, kPairs>(steps, A + i * a_row, a_row, a_step, B, b_step, alpha, C + i * ldc, ldc, beta, lanes,
                            pairs + i / 2 * pairs_ld, pairs_ld);
  }
  if (i < m)
    tile_rows<F, NV, kPairs>(int(m - i), steps, A + i * a_row, a_row, a_step, B, b_step, alpha, C + i * ldc, ldc,
                             beta, lanes, pairs + i / 2 * pairs_ld, pairs_ld);
}

// The 64-column block [j, j + w) of vector_gemm.
template <typename F, bool kPairs>
void column_block(int64_t m, int64_t w, int64_t steps, const typename F::Element* A, int64_t a_row, int64_t a_step,
                  const typename F::Element* B, int64_t b_step, float alpha, float* C, int64_t ldc, float beta,
                  uint16_t* pairs, int64_t pairs_ld, PacedLines& lines) {
  const __mmask16 lanes = first_lanes(w - 16 * ((w - 1) / 16));
  switch ((w + 15) / 16) {
    case 4: return tiles<F, 4, kPairs>(m, steps, A, a_row, a_step, B, b_step, alpha, C, ldc, beta, lanes, pairs,
                                       pairs_ld, lines);
    case 3: return tiles<F, 3, kPairs>(m, steps, A, a_row, a_step, B, b_step, alpha, C, ldc, beta, lanes, pairs,
                                       pairs_ld, lines);
    case 2: return tiles<F, 2, kPairs>(m, steps, A, a_row, a_step, B, b_step, alpha, C, ldc, beta, lanes, pairs,
                                       pairs_ld, lines);
    default: return tiles<F, 1, kPairs>(m, steps, A, a_row, a_step, B, b_step, alpha, C, ldc, beta, lanes,
                                        pairs, pairs_ld, lines);
  }
}

// C [m, n] = alpha A B + beta C in blocks of 64 columns, A and B as in tile; with `pairs`, C's rows also rounded to
// bfloat16 pairs of rows there (tile's kPairs; pair row stride pairs_ld elements, 16-column groups written whole).
// Never inlined: how GCC inlined it into its callers moved with their number (one more call site made the bfloat16
// forward at T = 8-16 10-15% slower, side by side in one process; out of line every caller runs as fast as before).
// `lines`: the calling thread's PacedLines (paced_lines(), looked up once per sequence by the chunk loops: a
// thread_local of a loaded library is a call of __tls_get_addr each time, 2-3% of the bfloat16 forward's samples,
// B1 H8 T4096 D64, 1 thread, when every product looked it up).
#if defined(FWP_NATIVE_BF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define FWP_TILE_BF16 1
struct TileThreadState;
TileThreadState& tile_state();
void tile_gemm(int64_t m, int64_t n, int64_t steps, const bf16_bits* A, int64_t a_row, int64_t a_step,
               const bf16_bits* B, int64_t b_step, float alpha, float* C, int64_t ldc, float beta, PacedLines& lines,
               uint16_t* pairs, int64_t pairs_ld, TileThreadState& state);
#endif

template <typename F>
__attribute__((noinline)) void vector_gemm(int64_t m, int64_t n, int64_t steps, const typename F::Element* A,
                                           int64_t a_row, int64_t a_step, const typename F::Element* B, int64_t b_step,
                                           float alpha, float* C, int64_t ldc, float beta, PacedLines& lines,
                                           uint16_t* pairs = nullptr, int64_t pairs_ld = 0) {
#ifdef FWP_TILE_BF16
  // bfloat16 factors in the tile registers where the sequence's policy asks for them (kTileBfloat16), same operands
  if constexpr (std::is_same_v<F, Bfloat16Factors>) {
    TileThreadState& state = tile_state();
    if (state.enabled)
      return tile_gemm(m, n, steps, A, a_row, a_step, B, b_step, alpha, C, ldc, beta, lines, pairs, pairs_ld, state);
  }
#endif
  for (int64_t j = 0; j < n; j += 64) {
    const int64_t w = std::min<int64_t>(64, n - j);
    const typename F::Element* Bj = B + F::kPerStep * j;
    if (pairs != nullptr) {
      column_block<F, true>(m, w, steps, A, a_row, a_step, Bj, b_step, alpha, C + j, ldc, beta, pairs + 2 * j,
                            pairs_ld, lines);
    } else {
      column_block<F, false>(m, w, steps, A, a_row, a_step, Bj, b_step, alpha, C + j, ldc, beta, nullptr, 0, lines);
    }
  }
}

// 16 rows of 16 32-bit lanes transposed in registers: Eklundh's swaps of the off-diagonal b x b blocks of every
// 2b x 2b block, b = 1, 2, 4, 8, each a two-source permute per row.
__attribute__((always_inline)) inline void transpose_registers(__m512 (&r)[16]) {
#pragma GCC unroll 4
  for (int b = 1; b < 16; b *= 2) {
    alignas(64) int upper[16], lower[16];  // row i (bit b clear) and row i + b of every pair
    for (int col = 0; col < 16; ++col) {
      upper[col] = (col & b) ? 16 + col - b : col;
      lower[col] = (col & b) ? 16 + col : col + b;
    }
    const __m512i up = _mm512_load_si512(upper), low = _mm512_load_si512(lower);
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) {
      if (i & b) continue;
      const __m512 top = r[i], bottom = r[i + b];
      r[i] = _mm512_permutex2var_ps(top, up, bottom);
      r[i + b] = _mm512_permutex2var_ps(top, low, bottom);
    }
  }
}

// A 16 x 16 block of x (row stride ld) transposed into out (row stride ld_out), in registers.
constexpr int64_t kTransposeBlock = 16;
inline void transpose_block(const float* x, int64_t ld, float* out, int64_t ld_out) {
  __m512 r[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(x + i * ld);
  transpose_registers(r);
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) _mm512_storeu_ps(out + i * ld_out, r[i]);
}

#ifdef FWP_NATIVE_BF16
inline void store_pairs(uint16_t* out, __m512 even_row, __m512 odd_row) {
  alignas(64) static const int16_t order[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i rows = (__m512i)_mm512_cvtne2ps_pbh(odd_row, even_row);
  _mm512_storeu_si512(out, _mm512_permutexvar_epi16(_mm512_load_si512(order), rows));
}
#else
inline void store_pairs(uint16_t*, __m512, __m512) {}  // no bfloat16 products in this build: never called
#endif

#elif defined(__AVX2__) && defined(__FMA__)
// AVX2 with FMA (x86-64-v3: Zen 1-3, Intel's cores without AVX-512): the float32 micro-kernel in 8-lane registers, 16
// of them, where MKL's sgemm (AVX2 code on these CPUs too) pays a call's set-up for every small product (B1 H8 T4096
// D64, mode auto, Zen 3, 1 / 2 threads, bench_cpu_zen3.json: the delta rule's forward 1.19x / 1.16x faster than with
// MKL's products, forward + backward 1.02x / 1.03x; the sum rule's forward 1.29x / 1.25x). Each sum is formed as the
// AVX-512 tile forms it (one fused multiply-add per step of the inner dimension, in order, then alpha sum + beta C in
// one more), so that a product's bits do not depend on the vector width (by construction: no CPU here runs both).
#define FWP_VECTOR_PRODUCTS 1
#include <immintrin.h>

// float32 factors (no bfloat16 products without AVX-512 BF16): the tag of VectorGemm's one policy here
struct Float32Factors {};

// The first min(max(n, 0), 8) of 8 lanes, as vmaskmovps's mask.
inline __m256i first_lanes8(int64_t n) {
  const int kept = int(std::min<int64_t>(std::max<int64_t>(n, 0), 8));
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(kept), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// C [MR, 8 NV] = alpha A B + beta C (C not read when beta is 0), A and B as in vector_gemm; the last 8 columns keep
// `lanes` of theirs where `ragged`. MR x NV sums in registers: 6 x 2 of 16 with B's two vectors and A's broadcast.
template <int MR, int NV>
inline void tile8(int64_t steps, const float* A, int64_t a_row, int64_t a_step, const float* B, int64_t b_step,
                  float alpha, float* C, int64_t ldc, float beta, __m256i lanes, bool ragged) {
  __m256 acc[MR][NV];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm256_setzero_ps();
  for (int64_t s = 0; s < steps; ++s) {
    __m256 b[NV];
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) {
      const float* bv = B + s * b_step + 8 * v;
      b[v] = v + 1 < NV || !ragged ? _mm256_loadu_ps(bv) : _mm256_maskload_ps(bv, lanes);
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m256 a = _mm256_broadcast_ss(A + r * a_row + s * a_step);
#pragma GCC unroll 2
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm256_fmadd_ps(a, b[v], acc[r][v]);
    }
  }
  const __m256 scale = _mm256_set1_ps(alpha), prior_scale = _mm256_set1_ps(beta);
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) {
      const bool masked = v + 1 == NV && ragged;
      float* c = C + r * ldc + 8 * v;
      __m256 prior = _mm256_setzero_ps();
      if (beta != 0.f) prior = masked ? _mm256_maskload_ps(c, lanes) : _mm256_loadu_ps(c);
      if (beta != 0.f && beta != 1.f) prior = _mm256_mul_ps(prior_scale, prior);
      acc[r][v] = _mm256_fmadd_ps(scale, acc[r][v], prior);
      if (masked) {
        _mm256_maskstore_ps(c, lanes, acc[r][v]);
      } else {
        _mm256_storeu_ps(c, acc[r][v]);
      }
    }
  }
}

// C [m, 8 NV at most] in tiles of 6 rows, the last rows in one smaller tile; `lines` issued a few per tile (as the
// AVX-512 tiles issue PacedLines::kPerTile per 6 x 64 outputs).
template <int NV>
void tiles8(int64_t m, int64_t steps, const float* A, int64_t a_row, int64_t a_step, const float* B, int64_t b_step,
            float alpha, float* C, int64_t ldc, float beta, __m256i lanes, bool ragged, PacedLines& lines) {
  constexpr int MR = 6;
  int64_t i = 0;
  for (; i + MR <= m; i += MR) {
    lines.issue(PacedLines::kPerTile * NV / 8);
    tile8<MR, NV>(steps, A + i * a_row, a_row, a_step, B, b_step, alpha, C + i * ldc, ldc, beta, lanes, ragged);
  }
  const float* Ai = A + i * a_row;
  float* Ci = C + i * ldc;
  switch (m - i) {
    case 5: return tile8<5, NV>(steps, Ai, a_row, a_step, B, b_step, alpha, Ci, ldc, beta, lanes, ragged);
    case 4: return tile8<4, NV>(steps, Ai, a_row, a_step, B, b_step, alpha, Ci, ldc, beta, lanes, ragged);
    case 3: return tile8<3, NV>(steps, Ai, a_row, a_step, B, b_step, alpha, Ci, ldc, beta, lanes, ragged);
    case 2: return tile8<2, NV>(steps, Ai, a_row, a_step, B, b_step, alpha, Ci, ldc, beta, lanes, ragged);
    case 1: return tile8<1, NV>(steps, Ai, a_row, a_step, B, b_step, alpha, Ci, ldc, beta, lanes, ragged);
    default: return;
  }
}

// C [m, n] = alpha A B + beta C in blocks of 16 columns (B's block, steps x 16, stays in L1 while the row tiles pass);
// A, B, `lines` as the AVX-512 vector_gemm takes them (float32 factors only: kPerStep 1).
template <typename F>
__attribute__((noinline)) void vector_gemm(int64_t m, int64_t n, int64_t steps, const float* A, int64_t a_row,
                                           int64_t a_step, const float* B, int64_t b_step, float alpha, float* C,
                                           int64_t ldc, float beta, PacedLines& lines) {
  static_assert(std::is_same_v<F, Float32Factors>, "AVX2 builds multiply float32 factors only");
  for (int64_t j = 0; j < n; j += 16) {
    const int64_t w = std::min<int64_t>(16, n - j);
    const bool ragged = w % 8 != 0;
    const __m256i lanes = first_lanes8(w % 8);
    if (w > 8) {
      tiles8<2>(m, steps, A, a_row, a_step, B + j, b_step, alpha, C + j, ldc, beta, lanes, ragged, lines);
    } else {
      tiles8<1>(m, steps, A, a_row, a_step, B + j, b_step, alpha, C + j, ldc, beta, lanes, ragged, lines);
    }
  }
}

// An 8 x 8 block of x (row stride ld) transposed into out (row stride ld_out), in registers (unpack, shuffle, swap of
// 128-bit halves).
constexpr int64_t kTransposeBlock = 8;
inline void transpose_block(const float* x, int64_t ld, float* out, int64_t ld_out) {
  __m256 r[8], t[8];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(x + i * ld);
#pragma GCC unroll 4
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
#pragma GCC unroll 2
  for (int h = 0; h < 8; h += 4) {  // rows h .. h + 3: columns 4p + i of their 128-bit halves
    r[h] = _mm256_shuffle_ps(t[h], t[h + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[h + 1] = _mm256_shuffle_ps(t[h], t[h + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[h + 2] = _mm256_shuffle_ps(t[h + 1], t[h + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[h + 3] = _mm256_shuffle_ps(t[h + 1], t[h + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    _mm256_storeu_ps(out + i * ld_out, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
    _mm256_storeu_ps(out + (i + 4) * ld_out, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
  }
}
#endif  // AVX-512 / AVX2

#ifdef FWP_VECTOR_PRODUCTS
// A thread's scratch for packed operands, reused by every product of the thread: slots 0 and 1 hold a VectorGemm's
// packed B and A, slot 2 the operands a bfloat16 chunk keeps over its two products (ChunkProducts), slot 3 those of a
// bfloat16 chunk's backward (BackwardProducts).
template <typename E>
E* scratch(int slot, int64_t size) {
  thread_local Buffer<E> buffers[4];
  TORCH_CHECK(slot >= 0 && slot < 4, "fwp_chunk: no scratch slot ", slot);
  if (int64_t(buffers[slot].size()) < size) buffers[slot].resize(size);
  return buffers[slot].data();
}

// x^T of x [rows, ld] (cols columns) into out [cols, ld_out], for any 32-bit W (float32, or bfloat16 pairs): square
// blocks in registers (transpose_block: 16 x 16 with AVX-512, 8 x 8 with AVX2; the bits moved, never converted), the
// edges one by one.
template <typename W>
inline void transpose_into(int64_t rows, int64_t cols, const W* x, int64_t ld, W* out, int64_t ld_out) {
  static_assert(sizeof(W) == sizeof(float), "transpose_into moves 32-bit elements");
  constexpr int64_t b = kTransposeBlock;
  const int64_t rows_b = rows / b * b, cols_b = cols / b * b;
  for (int64_t i = 0; i < rows_b; i += b)
    for (int64_t j = 0; j < cols_b; j += b)
      transpose_block(reinterpret_cast<const float*>(x + i * ld + j), ld,
                      reinterpret_cast<float*>(out + j * ld_out + i), ld_out);
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = i < rows_b ? cols_b : 0; j < cols; ++j) out[j * ld_out + i] = x[i * ld + j];
}

template <typename F>
struct VectorGemm;

// A VectorGemm's `lines`: the PacedLines of the thread that runs its products (on_this_thread), or nullptr: looked up
// at each product.
inline PacedLines& lines_or_thread(PacedLines* lines) { return lines != nullptr ? *lines : paced_lines(); }

template <>
struct VectorGemm<Float32Factors> {
  PacedLines* lines = nullptr;
  void operator()(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* A,
                  int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) const {
    const float* Bk = B;  // op(B) row-major [k, n]
    int64_t b_step = ldb;
    if (trans_b) {
      float* t = scratch<float>(0, k * n);
      transpose_into(n, k, B, ldb, t, n);
      Bk = t;
      b_step = n;
    }
    vector_gemm<Float32Factors>(m, n, k, A, trans_a ? 1 : lda, trans_a ? lda : 1, Bk, b_step, alpha, C, ldc, beta,
                                lines_or_thread(lines));
  }
};
#endif  // FWP_VECTOR_PRODUCTS

#ifdef FWP_NATIVE_BF16
// Pair-packing of the float32 x [k, ld] (n columns): pair p of column j = (x[2p][j], x[2p+1][j]) rounded to bfloat16,
// into out [ceil(k / 2), n_out, 2]; zero past row k and column n (n_out a multiple of 16).
void pack_pairs(int64_t k, int64_t n, const float* x, int64_t ld, bf16_bits* out, int64_t n_out) {
  for (int64_t p = 0; 2 * p < k; ++p) {
    const float* r0 = x + 2 * p * ld;
    for (int64_t j = 0; j < n_out; j += 16) {
      const __mmask16 lanes = first_lanes(n - j);
      store_pairs(out + 2 * (p * n_out + j), _mm512_maskz_loadu_ps(lanes, r0 + j),
                  2 * p + 1 < k ? _mm512_maskz_loadu_ps(lanes, r0 + ld + j) : _mm512_setzero_ps());
    }
  }
}

// The same pairs from bfloat16 x [k, ld] (n columns), the bits moved as they are: rows 2p and 2p + 1 interleaved.
void interleave_rows(int64_t k, int64_t n, const bf16_bits* x, int64_t ld, bf16_bits* out, int64_t n_out) {
  for (int64_t p = 0; 2 * p < k; ++p) {
    const bf16_bits* r0 = x + 2 * p * ld;
    for (int64_t j = 0; j < n_out; j += 16) {
      const __mmask16 lanes = first_lanes(n - j);
      const __m512i lo = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes, r0 + j));
      const __m512i hi = 2 * p + 1 < k ? _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes, r0 + ld + j))
                                       : _mm512_setzero_si512();
      _mm512_storeu_si512(out + 2 * (p * n_out + j), _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
  }
}

// The pairs of interleave_rows from diag(scale) x: row i of the bfloat16 x widened and times scale[i], rounded to
// bfloat16 (as pack_pairs rounds the float32 rows).
void scaled_pairs(int64_t k, int64_t n, const bf16_bits* x, int64_t ld, const float* scale, bf16_bits* out,
                  int64_t n_out) {
  const auto row = [&](int64_t i, int64_t j, __mmask16 lanes) {
    const __m512i bits = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes, x + i * ld + j));
    return _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(bits, 16)), _mm512_set1_ps(scale[i]));
  };
  for (int64_t p = 0; 2 * p < k; ++p) {
    for (int64_t j = 0; j < n_out; j += 16) {
      const __mmask16 lanes = first_lanes(n - j);
      store_pairs(out + 2 * (p * n_out + j), row(2 * p, j, lanes),
                  2 * p + 1 < k ? row(2 * p + 1, j, lanes) : _mm512_setzero_ps());
    }
  }
}

// Rows of the float32 x [m, ld] (k columns) rounded to bfloat16 into out [m, k2] (k2: k rounded up to even, the pad
// zero): an A operand with its pairs along the rows.
void round_rows(int64_t m, int64_t k, const float* x, int64_t ld, bf16_bits* out, int64_t k2) {
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < k2; j += 16) {
      const __m256bh y = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(first_lanes(k - j), x + i * ld + j));
      _mm256_mask_storeu_epi16(out + i * k2 + j, first_lanes(k2 - j), (__m256i)y);
    }
  }
}

// x^T as a B operand of bfloat16 factors, from the float32 x [n, ld] (k columns): pair p of column i is
// (x[i][2p], x[i][2p + 1]) rounded (as round_rows rounds), into out [ceil(k / 2), n_out, 2]. Blocks of 16 rows and 32
// columns rounded and transposed as 32-bit pairs in registers (round_rows and then transpose_into, for the states the
// bfloat16 backward keeps and its dS'^T: the backward op 13.35 against 12.34 ms, side by side, B1 H8 T4096 D64).
void transposed_pairs(int64_t n, int64_t k, const float* x, int64_t ld, bf16_bits* out, int64_t n_out) {
  for (int64_t i0 = 0; i0 < n; i0 += 16) {
    const __mmask16 columns = first_lanes(n - i0);
    for (int64_t j0 = 0; j0 < k; j0 += 32) {
      const __mmask16 low = first_lanes(k - j0), high = first_lanes(k - j0 - 16);
      __m512 r[16];
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) {
        const float* row = x + (i0 + i) * ld + j0;
        r[i] = i0 + i < n ? (__m512)_mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(high, row + 16),
                                                        _mm512_maskz_loadu_ps(low, row))
                          : _mm512_setzero_ps();
      }
      transpose_registers(r);
      for (int64_t p = 0; p < 16 && j0 + 2 * p < k; ++p)
        _mm512_mask_storeu_ps(out + 2 * ((j0 / 2 + p) * n_out + i0), columns, r[p]);
    }
  }
}

// <A, B> of two [k, n] matrices held as bfloat16 pairs (pack_pairs' layout, pair row stride 2 n_out), vdpbf16ps.
float pairs_dot(int64_t k, int64_t n, const bf16_bits* a, const bf16_bits* b, int64_t n_out) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t p = 0; 2 * p < k; ++p)
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 lanes = first_lanes(n - j);
      const int64_t at = 2 * (p * n_out + j);
      acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_maskz_loadu_epi32(lanes, a + at),
                             (__m512bh)_mm512_maskz_loadu_epi32(lanes, b + at));
    }
  return _mm512_reduce_add_ps(acc);
}

#ifdef FWP_TILE_BF16
// ---------------------------------------------------------------------------------------------------------------
// bfloat16 factors in AMX's tile registers (Sapphire Rapids and later Xeons): TDPBF16PS multiplies a 16 x 32 bfloat16
// tile of A by a 32 x 16 tile of B held as 16 rows of column pairs (pack_pairs' layout, as vdpbf16ps reads it) into a
// 16 x 16 float32 tile of sums, 16 times the work of one vdpbf16ps, where Intel's cores issue vdpbf16ps once a cycle
// (half their float32 FMA rate: the AVX-512 BF16 products ran no faster than float32 on such a core). Each product of a
// bfloat16 pair is exact in float32 and every sum is rounded to nearest even, as with vdpbf16ps; the order of a
// pair's two products within a sum may differ between the two, so their bits can differ in the last place.

// Whether this process may use the tile data: Linux grants it on request, once per process and for all its threads
// (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA; refused by a kernel before 5.16, and then the AVX-512 BF16
// products run).
bool tiles_usable() {
  static const bool usable = [] {
    constexpr long kRequestPermission = 0x1023;  // ARCH_REQ_XCOMP_PERM
    constexpr long kTileData = 18;               // XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return usable;
}

// The tile registers' shapes, LDTILECFG's operand (palette 1): two 16 x 16 float32 sums, a 16-row tile of A and two of
// B (16 pairs of the inner dimension each), and where the inner dimension's pairs are not a multiple of 16, tiles of A
// and B for the last `tail` pairs. (The intrinsics take a register's number as a literal: tile_gemm writes these.)
enum TileRegister : int { kSums0 = 0, kSums1 = 1, kTileA = 2, kTileB0 = 3, kTileB1 = 4, kTailA = 5, kTailB0 = 6,
                          kTailB1 = 7 };
struct alignas(64) TileShapes {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t row_bytes[16] = {};
  uint8_t rows[16] = {};
  explicit TileShapes(int64_t tail) {
    for (int t : {kSums0, kSums1, kTileA, kTileB0, kTileB1}) rows[t] = 16, row_bytes[t] = 64;
    if (tail == 0) return;
    rows[kTailA] = 16, row_bytes[kTailA] = uint16_t(4 * tail);
    for (int t : {kTailB0, kTailB1}) rows[t] = uint8_t(tail), row_bytes[t] = 64;
  }
};

// A thread's tile state, set by on_this_thread as a sequence begins: whether its policy multiplies in tiles, the tail
// its tile shapes were loaded for (-1: not loaded since the sequence began: other code, oneDNN's kernels, loads
// shapes of its own between the ops' calls; a load costs about a tenth of a product's time at D = 64, C = 32, by
// perf), and its copies of A.
struct TileThreadState {
  bool enabled = false;
  int64_t loaded_tail = -1;
  Buffer<pair_bits> transposed, last_rows;
};
TileThreadState& tile_state() {
  thread_local TileThreadState state;
  return state;
}

// C [rows, 16 groups at most] = alpha sums + beta C for one or two 16-column groups of sums [2][16][16] (C not read
// where beta is 0), columns [0, n) kept; with `pairs`, the results also as bfloat16 pairs of rows (tile's kPairs: zero
// past row `rows` and column n, 16-column groups written whole).
inline void tile_results(int64_t rows, int64_t n, int groups, const float (*sums)[16][16], float alpha, float* C,
                         int64_t ldc, float beta, uint16_t* pairs, int64_t pairs_ld) {
  const __m512 scale = _mm512_set1_ps(alpha), prior_scale = _mm512_set1_ps(beta);
  for (int g = 0; g < groups; ++g) {
    const __mmask16 keep = first_lanes(n - 16 * g);
    __m512 even = _mm512_setzero_ps();
    for (int64_t r = 0; r < rows; ++r) {
      // (zero past column n for the pairs: the tiles' sums there are of whatever B's padding held)
      const __m512 result = _mm512_maskz_mov_ps(
          keep, write_result(_mm512_load_ps(sums[g][r]), C + r * ldc + 16 * g, keep, scale, prior_scale, beta));
      if (pairs == nullptr) continue;
      if (r % 2 == 0) {
        even = result;
        if (r + 1 == rows) store_pairs(pairs + r / 2 * pairs_ld + 32 * g, even, _mm512_setzero_ps());
      } else {
        store_pairs(pairs + r / 2 * pairs_ld + 32 * g, even, result);
      }
    }
  }
}

// A's rows as the tiles read them, 16 pairs of the inner dimension (64 bytes) at a time: in place where there are 16
// rows from row i0, else copied into `copy`, 16 rows of `steps` pairs (zero past row m).
inline const pair_bits* tile_rows_of_a(int64_t m, int64_t i0, int64_t steps, const pair_bits* A, int64_t lda,
                                       Buffer<pair_bits>& copy) {
  if (m - i0 >= 16) return A + i0 * lda;
  copy.assign(16 * steps, 0);
  for (int64_t r = 0; i0 + r < m; ++r) std::memcpy(copy.data() + r * steps, A + (i0 + r) * lda, 4 * steps);
  return copy.data();
}

// One 16 x 32 block of tile_gemm's C: where its sums go and how they are written.
struct TileBlock {
  int64_t i0 = 0, j0 = 0;
  bool two = false;  // two 16-column groups
  bool pending = false;  // sums stored in the thread's buffer, results not yet written
};

// vector_gemm's C [m, n] = alpha A B + beta C for bfloat16 factors (A, B, `pairs` as there) in tiles: per 16 rows of A
// and 32 columns of B, two 16 x 16 sums over the inner dimension in blocks of 16 pairs (the last `tail` in tiles of
// their own shape). A block's results are written (tile_results) while the tiles compute the next block's sums; where
// they are C's own values (alpha 1, beta 0, no pairs, 16 x 16 inside C) the sums are stored into C directly.
void tile_gemm(int64_t m, int64_t n, int64_t steps, const bf16_bits* A, int64_t a_row, int64_t a_step,
               const bf16_bits* B, int64_t b_step, float alpha, float* C, int64_t ldc, float beta, PacedLines& lines,
               uint16_t* pairs, int64_t pairs_ld, TileThreadState& state) {
  const pair_bits* a = reinterpret_cast<const pair_bits*>(A);
  int64_t lda = a_row / 2;  // pairs from one row of A to the next
  if (a_step != 2) {        // pair s of row r at A + 2 r + s a_step: the columns of pairs transposed into rows
    state.transposed.assign(round_up(m, 16) * steps, 0);
    transpose_into(steps, m, a, a_step / 2, state.transposed.data(), steps);
    a = state.transposed.data(), lda = steps;
  }
  const int64_t full = steps / 16 * 16, tail = steps - full;
  if (state.loaded_tail < 0 || (tail > 0 && state.loaded_tail != tail)) {  // (any shapes have the full tiles)
    const TileShapes shapes(tail);
    _tile_loadconfig(&shapes);
    state.loaded_tail = tail;
  }
  const bool direct = alpha == 1.f && beta == 0.f && pairs == nullptr;
  const int64_t b_stride = 2 * b_step;  // bytes
  // the sums of the last block, by column group (finish reads them before the next block's are stored over them)
  alignas(64) float sums[2][16][16];
  TileBlock last;
  const auto finish = [&](TileBlock& b) {  // the results of a block whose sums are in the buffer
    if (!b.pending) return;
    tile_results(std::min<int64_t>(16, m - b.i0), n - b.j0, b.two ? 2 : 1, sums, alpha,
                 C + b.i0 * ldc + b.j0, ldc, beta, pairs == nullptr ? nullptr : pairs + b.i0 / 2 * pairs_ld + 2 * b.j0,
                 pairs_ld);
    b.pending = false;
  };
  for (int64_t i0 = 0; i0 < m; i0 += 16) {
    const pair_bits* Ai = a_step == 2 ? tile_rows_of_a(m, i0, steps, a, lda, state.last_rows) : a + i0 * lda;
    const int64_t a_stride = a_step == 2 && m - i0 < 16 ? 4 * steps : 4 * lda;
    for (int64_t j0 = 0; j0 < n; j0 += 32) {
      const bool two = n - j0 > 16;
      const bf16_bits* Bj = B + 2 * j0;
      lines.issue(PacedLines::kPerTile);
      _tile_zero(0);
      _tile_zero(1);
      for (int64_t s = 0; s < full; s += 16) {
        _tile_loadd(2, Ai + s, a_stride);
        _tile_loadd(3, Bj + s * b_step, b_stride);
        _tile_dpbf16ps(0, 2, 3);
        if (!two) continue;
        _tile_loadd(4, Bj + s * b_step + 32, b_stride);
        _tile_dpbf16ps(1, 2, 4);
      }
      if (tail > 0) {
        _tile_loadd(5, Ai + full, a_stride);
        _tile_loadd(6, Bj + full * b_step, b_stride);
        _tile_dpbf16ps(0, 5, 6);
        if (two) {
          _tile_loadd(7, Bj + full * b_step + 32, b_stride);
          _tile_dpbf16ps(1, 5, 7);
        }
      }
      finish(last);  // the previous block's results, while the tiles compute
      last = TileBlock{i0, j0, two, true};
      if (direct && m - i0 >= 16 && n - j0 >= (two ? 32 : 16)) {
        _tile_stored(0, C + i0 * ldc + j0, 4 * ldc);
        if (two) _tile_stored(1, C + i0 * ldc + j0 + 16, 4 * ldc);
        last.pending = false;
        continue;
      }
      _tile_stored(0, sums[0], 64);
      if (two) _tile_stored(1, sums[1], 64);
    }
  }
  finish(last);
}
#endif  // FWP_TILE_BF16

template <>
struct VectorGemm<Bfloat16Factors> {
  PacedLines* lines = nullptr;
  bool tiles = false;  // in AMX's tile registers (kTileBfloat16)
  void operator()(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* A,
                  int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) const {
    const int64_t kp = (k + 1) / 2, np = round_up(n, 16);
    bf16_bits* Bp = scratch<bf16_bits>(0, 2 * kp * np);
    if (trans_b) {  // op(B) = B^T: transposed in float32 first, then packed like any row-major operand
      float* t = scratch<float>(0, k * n);
      transpose_into(n, k, B, ldb, t, n);
      pack_pairs(k, n, t, n, Bp, np);
    } else {
      pack_pairs(k, n, B, ldb, Bp, np);
    }
    bf16_bits* Ap;
    int64_t a_row, a_step;
    if (trans_a) {  // op(A) [m, k] = A^T: pair p of row i is (A[2p][i], A[2p+1][i])
      const int64_t mp = round_up(m, 16);
      Ap = scratch<bf16_bits>(1, 2 * kp * mp);
      pack_pairs(k, m, A, lda, Ap, mp);
      a_row = 2, a_step = 2 * mp;
    } else {
      Ap = scratch<bf16_bits>(1, m * 2 * kp);
      round_rows(m, k, A, lda, Ap, 2 * kp);
      a_row = 2 * kp, a_step = 2;
    }
    vector_gemm<Bfloat16Factors>(m, n, kp, Ap, a_row, a_step, Bp, 2 * np, alpha, C, ldc, beta, lines_or_thread(lines));
  }
};
#endif  // FWP_NATIVE_BF16

// Runs f(gemm) with the Gemm policy that `products` names (float64: the BLAS only).
template <typename T, typename F>
void with_products(int64_t products, const F& f) {
  if constexpr (std::is_same_v<T, float>) {
#ifdef FWP_VECTOR_PRODUCTS
    if (products == kVectorFloat32) return f(VectorGemm<Float32Factors>());
#endif
#ifdef FWP_NATIVE_BF16
    if (products == kVectorBfloat16) return f(VectorGemm<Bfloat16Factors>());
#endif
#ifdef FWP_TILE_BF16
    if (products == kTileBfloat16 && tiles_usable()) {
      VectorGemm<Bfloat16Factors> tiles;
      tiles.tiles = true;
      return f(tiles);
    }
#endif
  }
  TORCH_CHECK(products == kBlas, "fwp_chunk: this build or dtype has no products of kind ", products);
  f(BlasGemm<T>());
}

// Runs f(In(), gemm) for the inputs' dtype In (float64, float32 or bfloat16) and the Gemm policy that `products` names,
// for T = at::opmath_type<In>: the dtype of the states, sums and products' results (float32 for bfloat16).
template <typename F>
void dispatch_products(at::ScalarType dtype, int64_t products, const F& f) {
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, dtype, "fwp_chunk", [&] {
    with_products<at::opmath_type<scalar_t>>(products, [&](const auto& gemm) { f(scalar_t(), gemm); });
  });
}

// An optional tensor's data as In*, nullptr when absent.
template <typename In>
In* optional_data(const std::optional<at::Tensor>& x) {
  return x.has_value() ? x->data_ptr<In>() : nullptr;
}

// Runs f(g's data) as In*, or as T* where g is float32 beside bfloat16 inputs (a bfloat16 model's log-decays, computed
// in float32); f((In*)nullptr) without g.
template <typename In, typename T, typename F>
void with_decays(const std::optional<at::Tensor>& g, const F& f) {
  if constexpr (!std::is_same_v<In, T>) {
    if (g.has_value() && g->scalar_type() == c10::CppTypeToScalarType<T>::value) return f(g->data_ptr<T>());
  }
  f(optional_data<In>(g));
}

// The kinds of products this build has, a bit per Products value.
int64_t product_kinds() {
  int64_t kinds = 1 << kBlas;
#ifdef FWP_VECTOR_PRODUCTS
  kinds |= 1 << kVectorFloat32;
#endif
#ifdef FWP_NATIVE_BF16
  kinds |= 1 << kVectorBfloat16;
#endif
#ifdef FWP_TILE_BF16
  if (tiles_usable()) kinds |= 1 << kTileBfloat16;  // the CPU has AMX and Linux grants the process its tile data
#endif
  return kinds;
}

// The delta rule's triangular system in a chunk, (I + strictly_lower(diag(beta) G)) U = X, solved in place (X in U)
// by forward substitution: u_i = x_i - beta_i sum_{j<i} G_ij u_j (eqs. 20-24: each write sees the ones before it).
// G [c, ldg] row-major (its diagonal and upper part are not read), U [c, n]. The columns are independent systems:
// blocks of W columns stay in vector registers, four rows at a time (the sums over the rows above the four share each
// load of u_j and run as 16 independent vector sums; the four then finish among themselves). For these small systems
// this is faster than the BLAS's trsm (measured by hand when a loop of one row at a time replaced MKL's strsm, B1 H8
// T4096 D64, 1 thread: the float32 forward 6-9% faster at C = 16-64).
template <typename T, typename B>
inline void unit_lower_forward_substitution(int64_t c, int64_t n, const T* G, int64_t ldg, const B& beta, T* U) {
  constexpr int64_t W = 64 / sizeof(T) * 4;  // a block of columns: 4 vectors of 64 bytes
  constexpr int64_t R = 4;                   // rows at a time
  // rows i0 .. i0 + r of the block of columns at x0 (r a constant for the full groups of four, so that the tests of
  // k < r fold away: the bfloat16 forward 1% faster at 1 thread, by hand)
  const auto rows = [&](int64_t x0, int64_t i0, auto r) {
    T sum[R][W];
    T a[R];
#pragma GCC unroll 4
    for (int64_t k = 0; k < R; ++k)
#pragma omp simd
      for (int64_t x = 0; x < W; ++x) sum[k][x] = k < r ? U[(i0 + k) * n + x0 + x] : T(0);
    for (int64_t j = 0; j < i0; ++j) {
      const T* uj = U + j * n + x0;
#pragma GCC unroll 4
      for (int64_t k = 0; k < R; ++k) a[k] = k < r ? beta(i0 + k) * G[(i0 + k) * ldg + j] : T(0);
#pragma GCC unroll 4
      for (int64_t k = 0; k < R; ++k)
#pragma omp simd
        for (int64_t x = 0; x < W; ++x) sum[k][x] -= a[k] * uj[x];
    }
    for (int64_t k = 1; k < r; ++k) {  // within the four rows
      const T bk = beta(i0 + k);
      for (int64_t j = 0; j < k; ++j) {
        const T g = bk * G[(i0 + k) * ldg + i0 + j];
#pragma omp simd
        for (int64_t x = 0; x < W; ++x) sum[k][x] -= g * sum[j][x];
      }
    }
    for (int64_t k = 0; k < r; ++k)
#pragma omp simd
      for (int64_t x = 0; x < W; ++x) U[(i0 + k) * n + x0 + x] = sum[k][x];
  };
  int64_t x0 = 0;
  for (; x0 + W <= n; x0 += W) {
    int64_t i0 = 0;
    for (; i0 + R <= c; i0 += R) rows(x0, i0, std::integral_constant<int64_t, R>{});
    if (i0 < c) rows(x0, i0, c - i0);
  }
  for (int64_t i = 1; i < c && x0 < n; ++i) {  // the last columns (fewer than W), a row at a time
    const T bi = beta(i);
    for (int64_t j = 0; j < i; ++j) {
      const T g = bi * G[i * ldg + j];
      const T* uj = U + j * n;
#pragma omp simd
      for (int64_t x = x0; x < n; ++x) U[i * n + x] -= g * uj[x];
    }
  }
}

inline int64_t chunk_workspace(int64_t C, int64_t Dk, int64_t Dv) {
  return 2 * C * Dk + (Dk + 2 * C) * (Dv + C) + C * Dv;
}

// Copies n elements of `from` into `to`, converting (bfloat16 inputs and outputs: widened to / rounded from float32).
template <typename From, typename To>
inline void convert_copy(const From* from, int64_t n, To* to) {
  if constexpr (std::is_same_v<From, To>) {
    std::memcpy(to, from, sizeof(To) * n);
  } else {
    for (int64_t i = 0; i < n; ++i) to[i] = To(from[i]);
  }
}

#ifdef FWP_NATIVE_BF16
// The same in vector registers for bfloat16 <-> float32, with c10::BFloat16's results: widening is exact (the bits
// shifted into the upper half); rounding is to nearest even, NaN to 0x7FC0 (c10's round_to_nearest_even, denormals
// kept, where vcvtneps2bf16 would flush them).
inline void convert_copy(const c10::BFloat16* from, int64_t n, float* to) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 lanes = first_lanes(n - i);
    const __m512i x = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes, from + i));
    _mm512_mask_storeu_ps(to + i, lanes, _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)));
  }
}
// 16 lanes rounded as c10 rounds (the integer form of round to nearest even; NaN to 0x7FC0, denormals kept).
inline __m256i round_like_c10(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd)), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}
// vcvtne2ps2bf16 rounds 32 lanes in one instruction to the same bits, but for NaN (any payload: c10 writes 0x7FC0) and
// denormal inputs (flushed to zero): 32 lanes holding one of those (vfpclassps) take round_like_c10. (By hand, bfloat16
// backward op, B1 H8 T4096 D64, 1 thread: the rounding of the gradient rows 0.5 of its 13.5 ms before.)
inline void convert_copy(const float* from, int64_t n, c10::BFloat16* to) {
  constexpr int kNanOrDenormal = 0x01 | 0x20 | 0x80;  // quiet NaN, denormal, signalling NaN
  for (int64_t i = 0; i < n; i += 32) {
    const __mmask16 low = first_lanes(n - i), high = first_lanes(n - i - 16);
    const __m512 x0 = _mm512_maskz_loadu_ps(low, from + i), x1 = _mm512_maskz_loadu_ps(high, from + i + 16);
    if (_mm512_fpclass_ps_mask(x0, kNanOrDenormal) | _mm512_fpclass_ps_mask(x1, kNanOrDenormal)) {
      _mm256_mask_storeu_epi16(to + i, low, round_like_c10(x0));
      _mm256_mask_storeu_epi16(to + i + 16, high, round_like_c10(x1));
      continue;
    }
    const __m512i r = (__m512i)_mm512_cvtne2ps_pbh(x1, x0);  // x0's 16 then x1's
    _mm512_mask_storeu_epi16(to + i, (__mmask32(high) << 16) | low, r);
  }
}
#endif

// x^T of x [rows, ld] (cols columns) into out [cols, ld_out].
template <typename T>
inline void transpose(int64_t rows, int64_t cols, const T* x, int64_t ld, T* out, int64_t ld_out) {
#ifdef FWP_VECTOR_PRODUCTS
  if constexpr (std::is_same_v<T, float>) return transpose_into(rows, cols, x, ld, out, ld_out);
#endif
  for (int64_t j = 0; j < cols; ++j)  // rows of x^T written whole (x, a chunk's keys, is in L1)
    for (int64_t i = 0; i < rows; ++i) out[j * ld_out + i] = x[i * ld + j];
}

// The two products of a chunk (chunk_forward_seq) on its buffer Z [Dk + 2C, ld] (S^T in the first Dk rows; the
// layout is described there), from the chunk's queries and keys as `load` keeps them. This one, for every Gemm
// policy: K^T beside S^T in Z; the queries and keys read in place where they are T (a product each: Q [S^T | K^T],
// then K [S^T | K^T]), else [Q; K] widened into X [2C, Dk] (one product). In place, the copy that stacked them (7% of
// the float32 forward's time, perf, B1 H8 T4096 D64, 1 thread) is gone, and the tiles read B as often: once per
// group of rows either way.
template <typename T, typename Gemm, typename In>
struct ChunkProducts {
  static constexpr bool kInPlace = std::is_same_v<In, T>;
  const Gemm& gemm;
  int64_t Dk, Dv, ld, cq = 0, c = 0;
  T* X;
  T* Z;
  const T *Q = nullptr, *K = nullptr;  // the chunk's queries and keys [cq, Dk], [c, Dk] (in place, or in X)
  ChunkProducts(const Gemm& gemm, int64_t /*C*/, int64_t Dk, int64_t Dv, int64_t ld, T* X, T* Z)
      : gemm(gemm), Dk(Dk), Dv(Dv), ld(ld), X(X), Z(Z) {}

  // The chunk's c keys, after its cq queries (cq = 0: keys only).
  void load(const In* q, const In* k, int64_t cq_, int64_t c_) {
    cq = cq_, c = c_;
    if constexpr (kInPlace) {
      Q = q, K = k;
    } else {
      if (cq > 0) convert_copy(q, cq * Dk, X);
      convert_copy(k, c * Dk, X + cq * Dk);
      Q = X, K = X + cq * Dk;
    }
    transpose(c, Dk, K, Dk, Z + Dv, ld);
  }
  // K^T <- K^T diag(scale) for the writes (the gated rule's lambda), after states_and_keys
  void scale_keys(const T* scale) {
    for (int64_t j = 0; j < Dk; ++j)
#pragma omp simd
      for (int64_t i = 0; i < c; ++i) Z[j * ld + Dv + i] *= scale[i];
  }
  // Y = [Q; K] [S^T | K^T], Y [rows, ld] (rows: the cq queries, then the c keys where the rule needs them)
  void states_and_keys(int64_t rows, int64_t c, T* Y) const {
    if (K == Q + cq * Dk) return gemm(false, false, rows, Dv + c, Dk, T(1), Q, Dk, Z, ld, T(0), Y, ld);  // stacked
    if (cq > 0) gemm(false, false, cq, Dv + c, Dk, T(1), Q, Dk, Z, ld, T(0), Y, ld);
    if (rows > cq) gemm(false, false, rows - cq, Dv + c, Dk, T(1), K, Dk, Z, ld, T(0), Y + cq * ld, ld);
  }
  // [decay S^T; O] += [K^T; P] U', U' [c, Dv], with O and P = tril(Q K^T) the first cq rows of Y = Z + Dk ld
  void writes_and_reads(int64_t cq, int64_t c, const T* U, T decay) const {
    for (int64_t j = 0; decay != T(1) && j < Dk; ++j)
#pragma omp simd
      for (int64_t i = 0; i < Dv; ++i) Z[j * ld + i] *= decay;
    gemm(false, false, Dk + cq, Dv, c, T(1), Z + Dv, ld, U, Dv, T(1), Z, ld);
  }
};

#ifdef FWP_NATIVE_BF16
// bfloat16 inputs with bfloat16 factors: the chunk's queries and keys are read in place as bfloat16 pairs (no float32
// copies; copied for short chunks and odd Dk: rows_of), and K is paired once for its two uses. S^T, tril(Q K^T) and
// U' are rounded to bfloat16 as they are paired, as VectorGemm<Bfloat16Factors> rounds any operand, so that the
// results are those of the generic ChunkProducts with that policy; the sums are float32. Its buffers are the thread's
// scratch, not X.
template <>
struct ChunkProducts<float, VectorGemm<Bfloat16Factors>, c10::BFloat16> {
  int64_t Dk, Dv, ld, k2, np, mp, nvp, cq = 0, c = 0;
  bool state_in_B = false;  // B's first Dv columns hold S^T's pairs (written by the last S^T update)
  float* Z;
  const bf16_bits *Qr = nullptr, *Kr = nullptr;  // the chunk's queries and keys, rows of k2
  bf16_bits* X;   // where Dk is odd: [Q; K] copied, rows of k2 (Dk rounded up to even, the pad zero)  [2C, k2]
  bf16_bits* B;   // [S^T | K^T] in pairs of rows (as pack_pairs)                               [k2 / 2, np, 2]
  bf16_bits* Kt;  // K^T in pairs of positions: pair p of row j = (K[2p][j], K[2p + 1][j])     [C / 2, mp, 2]
  bf16_bits* P;   // tril(Q K^T) rounded, rows of positions padded to even                      [C, C + 1]
  bf16_bits* U;   // U' in pairs of rows                                                        [C / 2, nvp, 2]
  PacedLines& lines;
  ChunkProducts(const VectorGemm<Bfloat16Factors>& gemm, int64_t C, int64_t Dk, int64_t Dv, int64_t ld, float*,
                float* Z)
      : Dk(Dk), Dv(Dv), ld(ld), k2(round_up(Dk, 2)), np(round_up(Dv + C, 16)), mp(round_up(Dk, 16)),
        nvp(round_up(Dv, 16)), Z(Z), lines(lines_or_thread(gemm.lines)) {
    const int64_t cp = (C + 1) / 2;
    X = scratch<bf16_bits>(2, 2 * C * k2 + k2 * np + 2 * cp * mp + C * 2 * cp + 2 * cp * nvp);
    B = X + 2 * C * k2;
    Kt = B + k2 * np;
    P = Kt + 2 * cp * mp;
    U = P + C * 2 * cp;
  }

  void load(const c10::BFloat16* q, const c10::BFloat16* k, int64_t cq_, int64_t c_) {
    cq = cq_, c = c_;
    Qr = rows_of(q, cq, X);
    Kr = rows_of(k, c, X + cq * k2);
    interleave_rows(c, Dk, Kr, k2, Kt, mp);
  }
  // K^T's pairs for the writes scaled, K^T diag(scale) (the gated rule's lambda): rounded as the generic policy rounds
  void scale_keys(const float* scale) { scaled_pairs(c, Dk, Kr, k2, scale, Kt, mp); }
  void states_and_keys(int64_t rows, int64_t, float* Y) {
    if (!state_in_B) pack_pairs(Dk, Dv, Z, ld, B, np);  // the initial state
    // pair p of column Dv + i of K^T is pair p of row i of K: a transpose of 32-bit pairs
    transpose_into(c, k2 / 2, reinterpret_cast<const pair_bits*>(Kr), k2 / 2, reinterpret_cast<pair_bits*>(B) + Dv, np);
    if (Kr == Qr + cq * k2)  // stacked: one product
      return vector_gemm<Bfloat16Factors>(rows, Dv + c, k2 / 2, Qr, k2, 2, B, 2 * np, 1.f, Y, ld, 0.f, lines);
    if (cq > 0) vector_gemm<Bfloat16Factors>(cq, Dv + c, k2 / 2, Qr, k2, 2, B, 2 * np, 1.f, Y, ld, 0.f, lines);
    if (rows > cq)
      vector_gemm<Bfloat16Factors>(rows - cq, Dv + c, k2 / 2, Kr, k2, 2, B, 2 * np, 1.f, Y + cq * ld, ld, 0.f,
                                   lines);
  }
  void writes_and_reads(int64_t, int64_t, const float* Un, float decay) {
    const int64_t cp = (c + 1) / 2;
    pack_pairs(c, Dv, Un, Dv, U, nvp);
    // S^T <- decay S^T + K^T U', S^T's pairs for the next chunk's first product written from the tiles' registers
    vector_gemm<Bfloat16Factors>(Dk, Dv, cp, Kt, 2, 2 * mp, U, 2 * nvp, 1.f, Z, ld, decay, lines, B, 2 * np);
    state_in_B = true;
    if (cq == 0) return;
    float* O = Z + Dk * ld;
    round_rows(cq, c, O + Dv, ld, P, 2 * cp);
    vector_gemm<Bfloat16Factors>(cq, Dv, cp, P, 2 * cp, 2, U, 2 * nvp, 1.f, O, ld, 1.f, lines);  // O += P U'
  }

 private:
  // rows of x as the products read them: x itself for an even Dk and at least 16 rows, else copied into `out` (with a
  // zero pad for an odd Dk), so that a short chunk's queries and keys are stacked for one product, which reads the
  // state once (read in place, two products made the bfloat16 forward at T = 2-8, D = 128, 10-15% slower than the
  // stacked copy, by hand)
  const bf16_bits* rows_of(const c10::BFloat16* x, int64_t rows, bf16_bits* out) const {
    if (k2 == Dk && rows >= 16) return reinterpret_cast<const bf16_bits*>(x);
    for (int64_t i = 0; i < rows; ++i) {
      std::memcpy(out + i * k2, x + i * Dk, sizeof(bf16_bits) * Dk);
      if (k2 != Dk) out[i * k2 + Dk] = 0;  // the pad column of an odd Dk
    }
    return out;
  }
};
#endif  // FWP_NATIVE_BF16

// Asks for the cache lines of x [n] ahead of their use. The chunk loop reads a chunk's inputs in place (bfloat16) or
// copies them, each one cache miss after another where they are not cached (measured by hand, B1 H8 T4096 D64, the
// caches flushed before each call: the bfloat16 forward 5.4-5.9 -> 4.5-4.6 ms with the next chunk's q, k, v fetched
// during the current one, 1 thread; float32 2-8% faster). kWrite: lines about to be written (the next chunk's rows of
// o: a further 2-5% in both dtypes, cold and warm, by hand; one line per prefetch, every 64 bytes: prefetching every
// other line made the bfloat16 forward 3-13% slower).
template <bool kWrite = false, typename E>
inline void prefetch(const E* x, int64_t n) {
  const char* bytes = reinterpret_cast<const char*>(x);
  for (int64_t b = 0; b < n * int64_t(sizeof(E)); b += 64) __builtin_prefetch(bytes + b, kWrite);
}

// The thread's PacedLines where a Gemm policy's products issue them (the vector products, before each tile), else
// nullptr (prefetched at once).
template <typename Gemm>
inline PacedLines* paced_lines_of(const Gemm&) {
  return nullptr;
}
#ifdef FWP_VECTOR_PRODUCTS
template <typename F>
inline PacedLines* paced_lines_of(const VectorGemm<F>& gemm) {
  return &lines_or_thread(gemm.lines);
}
#endif

// The policy for the products of one sequence on the calling thread: VectorGemm's with the thread's PacedLines (looked
// up once, not at every product), any other as it is.
template <typename Gemm>
inline Gemm on_this_thread(const Gemm& gemm) {
  return gemm;
}
#ifdef FWP_VECTOR_PRODUCTS
template <typename F>
inline VectorGemm<F> on_this_thread(const VectorGemm<F>& gemm) {
  VectorGemm<F> bound = gemm;
  bound.lines = &paced_lines();
#ifdef FWP_TILE_BF16
  if constexpr (std::is_same_v<F, Bfloat16Factors>) {
    TileThreadState& state = tile_state();
    state.enabled = gemm.tiles;
    state.loaded_tail = -1;  // shapes loaded anew
  }
#endif
  return bound;
}
#endif

// Rows [start, start + count) of a chunk whose lines a loop asks for ahead (count 0 past the ends): the rows of the
// chunk it reads after the current one (the next in a forward, the previous in a backward), and the current chunk's
// rows about to be written. Asked for a few streams at each stage of the current chunk rather than all at its start
// (against that, by hand, B1 H8 T4096 D64, 1 and 2 threads, caches flushed before each call: forward 7-14% faster in
// float32 and bfloat16, backward 3-13%, the gated rule's forward 12-13% and backward 6-7%); `paced`: where they
// go, PacedLines (paced_lines_of: products that issue them), or nullptr: prefetched at once.
struct RowsAhead {
  int64_t start, count;
  PacedLines* paced;
  // x [L, width]: the chunk's rows
  template <bool kWrite = false, typename E>
  void fetch(const E* x, int64_t width) const { lines<kWrite>(x + start * width, count * width); }
  // x [N, size]: one entry per chunk of C positions (the states entering them)
  template <typename E>
  void fetch_chunk(const E* x, int64_t C, int64_t size) const { lines(x + start / C * size, count > 0 ? size : 0); }

 private:
  template <bool kWrite = false, typename E>
  void lines(const E* x, int64_t n) const {
    if (paced != nullptr) return paced->add(x, n * int64_t(sizeof(E)), kWrite);
    prefetch<kWrite>(x, n);
  }
};
inline RowsAhead next_chunk(int64_t t0, int64_t C, int64_t L, PacedLines* paced) {
  const int64_t t1 = std::min(t0 + C, L);
  return {t1, std::min(C, L - t1), paced};
}
inline RowsAhead previous_chunk(int64_t t0, int64_t C, PacedLines* paced) {
  const int64_t p0 = std::max<int64_t>(t0 - C, 0);
  return {p0, t0 - p0, paced};
}

// Elements of one state S [Dv, Dk] as bfloat16 pairs of its rows: ceil(Dv / 2) pair rows of round_up(Dk, 16) pairs.
inline int64_t state_pairs_size(int64_t Dk, int64_t Dv) { return round_up(Dv, 2) * round_up(Dk, 16); }

// S [Dv, Dk] as a B operand of bfloat16 factors (pack_pairs' layout: pair p of column j is (S[2p][j], S[2p + 1][j])),
// from the transposed state St = S^T [Dk, ld] that the forward keeps (transposed_pairs), into
// out [state_pairs_size(Dk, Dv)].
template <typename T>
void record_state_pairs(int64_t Dk, int64_t Dv, const T* St, int64_t ld, uint16_t* out) {
#ifdef FWP_NATIVE_BF16
  if constexpr (std::is_same_v<T, float>) {
    return transposed_pairs(Dk, Dv, St, ld, out, round_up(Dk, 16));
  }
#endif
  TORCH_CHECK(false, "fwp_chunk: bfloat16 state pairs need float32 states and a build with AVX-512 BF16");
}

// x [m, k] rounded to bfloat16 rows of round_up(k, 2) (round_rows) into out.
template <typename T>
void record_rows(int64_t m, int64_t k, const T* x, uint16_t* out) {
#ifdef FWP_NATIVE_BF16
  if constexpr (std::is_same_v<T, float>) return round_rows(m, k, x, k, out, round_up(k, 2));
#endif
  TORCH_CHECK(false, "fwp_chunk: bfloat16 rows need float32 values and a build with AVX-512 BF16");
}

// What a forward keeps of one sequence for its backward, each nullptr where not kept: the state entering each chunk
// (`entering` [N, Dv, Dk]), and for the delta rule the new values U' (`u_new` [L, Dv]) and X = V - K S^T of each
// chunk (`x` [L, Dv]: what dbeta needs, so that the backward does not multiply K S^T again). A bfloat16-factor
// backward keeps the entering states and U' as the bfloat16 its products read instead, half the bytes to write and
// read back: `entering_pairs` [N, state_pairs_size(Dk, Dv)] (record_state_pairs) and `u_new_rows` [L, round_up(Dv, 2)]
// (U' rounded, rows padded to even).
template <typename T>
struct ForwardRecord {
  T* entering = nullptr;
  T* u_new = nullptr;
  T* x = nullptr;
  uint16_t* entering_pairs = nullptr;
  uint16_t* u_new_rows = nullptr;
  // keeps the state entering chunk n as asked, from the transposed state St [Dk, ld] of the forward
  void keep_state(int64_t n, int64_t Dk, int64_t Dv, const T* St, int64_t ld) const {
    if (entering != nullptr) transpose(Dk, Dv, St, ld, entering + n * Dv * Dk, Dk);
    if (entering_pairs != nullptr) record_state_pairs(Dk, Dv, St, ld, entering_pairs + n * state_pairs_size(Dk, Dv));
  }
};

// What a forward keeps of one sequence of L positions (N chunks, states [Dv, Dk]) for its backward, in buffers of its
// own: the states entering the chunks and (delta rule) U' as T or as bfloat16 (`as_bfloat16`), X as T.
template <typename T>
struct KeptBuffers {
  Buffer<T> values;
  Buffer<uint16_t> bfloat16;
  ForwardRecord<T> record(int64_t L, int64_t N, int64_t Dk, int64_t Dv, bool delta, bool as_bfloat16) {
    const int64_t states = N * Dv * Dk, per_position = delta ? L * Dv : 0, pairs = N * state_pairs_size(Dk, Dv);
    values.resize((as_bfloat16 ? 0 : states + per_position) + per_position);
    bfloat16.resize(as_bfloat16 ? pairs + (delta ? L * round_up(Dv, 2) : 0) : 0);
    ForwardRecord<T> kept;
    T* next = values.data();
    if (as_bfloat16) {
      kept.entering_pairs = bfloat16.data();
      if (delta) kept.u_new_rows = bfloat16.data() + pairs;
    } else {
      kept.entering = next;
      next += states;
      if (delta) kept.u_new = next;
      next += per_position;
    }
    if (delta) kept.x = next;
    return kept;
  }
  // frees the blocks where they hold more than `limit` bytes (else they stay for the next record of the thread)
  void release_over(int64_t limit) {
    if (int64_t(values.capacity() * sizeof(T) + bfloat16.capacity() * sizeof(uint16_t)) <= limit) return;
    Buffer<T>().swap(values);
    Buffer<uint16_t>().swap(bfloat16);
  }
};

// The calling thread's KeptBuffers, kept from one backward call to the next: fresh ones were fresh pages on every call,
// each faulted in on its first write (MBs per sequence). Their blocks stay with the thread while they are at most
// kKeptBytesKept bytes (a 1.3B Delta Net head at T = 2048 keeps about 6 MB); larger ones are freed after the call.
// Against fresh buffers (benchmarks/results/bench_chunk_builds_kept_buffers.json, same bits): float32 delta rule
// fwd+bwd 1.02x / 1.07x faster at 1 / 2 threads, B1 H8 T4096 D64; the gated and bfloat16 cases 1.00-1.04x.
template <typename T>
KeptBuffers<T>& thread_kept_buffers() {
  thread_local KeptBuffers<T> buffers;
  return buffers;
}
constexpr int64_t kKeptBytesKept = int64_t(64) << 20;

// out[j] = exp(a + s x[j]) for j < m, 0 for m <= j < n (s = 1 or -1: a + s x[j] rounded once, as a - x[j] is).
// Where built with AVX-512, 16 lanes at a time: e^y = 2^k e^r, k = round(y log2(e)), r = y - k ln(2) in two parts
// (|r| <= ln(2) / 2), e^r by its Taylor polynomial to r^7 (truncation below 1e-9 relative), 2^k by vscalefps: within
// 1.3 ulp of e^y over [-104, 89] (by hand, 4M points against float64 exp), exactly 1 at y = 0, 0 below -104 and inf
// above 89, NaN kept (libm's expf, one element at a time, was 8% of the gated forward, B1 H8 T4096 D64, float32).
template <typename T>
void exp_affine(int64_t n, int64_t m, T a, T s, const T* x, T* out) {
  int64_t j = 0;
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) {
    const __m512 va = _mm512_set1_ps(a), vs = _mm512_set1_ps(s), low = _mm512_set1_ps(-104.f),
                 high = _mm512_set1_ps(89.f), log2e = _mm512_set1_ps(1.44269504088896341f),
                 ln2_hi = _mm512_set1_ps(0.693359375f), ln2_lo = _mm512_set1_ps(-2.12194440e-4f);
    for (; j < n; j += 16) {
      const __mmask16 lanes = first_lanes(n - j), kept = first_lanes(m - j);
      __m512 y = _mm512_fmadd_ps(vs, _mm512_maskz_loadu_ps(kept, x + j), va);
      y = _mm512_min_ps(high, _mm512_max_ps(low, y));  // the second operand where y is NaN: NaN kept
      const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(y, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m512 r = _mm512_fnmadd_ps(k, ln2_lo, _mm512_fnmadd_ps(k, ln2_hi, y));
      __m512 p = _mm512_set1_ps(1.f / 5040);
      for (const float c : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f})
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
      _mm512_mask_storeu_ps(out + j, lanes, _mm512_maskz_mov_ps(kept, _mm512_scalef_ps(p, k)));
    }
    return;
  }
#endif
  for (; j < n; ++j) out[j] = j < m ? std::exp(a + s * x[j]) : T(0);
}

// The gated rule's decays of a chunk from its log-decays g [c]: gamma (cumulative), Gamma = exp(gamma), lambda =
// exp(gamma_c - gamma), and D [c, c] = exp(gamma_i - gamma_j) for j <= i, 0 above the diagonal, 1 on it. Empty (C = 0)
// for the rules without decay.
template <typename T>
struct Decays {
  // D as the products E_i F_j, E_i = exp(gamma_i - m), F_j = exp(m - gamma_j), m the midpoint of the chunk's gammas,
  // where they span at most kFactoredSpan: both factors within e^(+-40) and their product within e^(+-80), normal
  // floats (never as Gamma_i / Gamma_j, whose factors leave float32's range over a long sequence). 2c exponentials
  // instead of one per row (c^2 lanes: exp_affine was 2.8% of the gated rule's bfloat16 forward + backward, B1 H8
  // T4096 D64, C = 32, 1 thread, by perf). The error: two rounded arguments (up to half an ulp of span / 2 each, the
  // order of error the cumulative sum gamma already carries), then 1.3 ulp per exponential and the product's rounding,
  // against one rounded difference and 1.3 ulp. A wider span takes each difference's own exponential.
  static constexpr double kFactoredSpan = 80;
  // One allocation per sequence for all six: with six, the gated forward at B1 H8 T16 read 0.98-0.99x the kernel's
  // before E and F (three runs, 1 thread, by hand); with one, 1.00-1.04x.
  Buffer<T> storage;
  T *gamma, *Gamma, *lambda, *E, *F, *D;
  explicit Decays(int64_t C)
      : storage(C * (C + 5)), gamma(storage.data()), Gamma(gamma + C), lambda(Gamma + C), E(lambda + C), F(E + C),
        D(F + C) {}
  Decays(const Decays&) = delete;
  Decays& operator=(const Decays&) = delete;
  template <typename G>
  void compute(int64_t c, const G* g) {
    T acc = 0, low = 0, high = 0;
    for (int64_t i = 0; i < c; ++i) {
      gamma[i] = acc += T(g[i]);
      low = i == 0 ? acc : std::min(low, acc);
      high = i == 0 ? acc : std::max(high, acc);
    }
    exp_affine(c, c, T(0), T(1), gamma, Gamma);
    exp_affine(c, c, gamma[c - 1], T(-1), gamma, lambda);
    if (!(double(high) - double(low) <= kFactoredSpan)) {  // (NaN or inf among the gammas: here too)
      for (int64_t i = 0; i < c; ++i) exp_affine(c, i + 1, gamma[i], T(-1), gamma, D + i * c);
      return;
    }
    const T m = T(0.5) * (low + high);
    exp_affine(c, c, -m, T(1), gamma, E);
    exp_affine(c, c, m, T(-1), gamma, F);
    for (int64_t i = 0; i < c; ++i) {
      T* Di = D + i * c;
      const T e = E[i];
#pragma omp simd
      for (int64_t j = 0; j < i; ++j) Di[j] = e * F[j];  // (one loop with j < i ? : 0 was gathered by GCC: slower)
      Di[i] = 1;
      std::fill(Di + i + 1, Di + c, T(0));
    }
  }
};

// The delta rule's new values of a chunk (eqs. 20-24, stacked): u_i = beta_i (v_i - S_{i-1} k_i) with S_{i-1} = S +
// sum_{j<i} u_j k_j^T, that is (I + strictly_lower(diag(beta) K K^T)) U' = diag(beta) X, X = V - K S^T, solved into Un
// [c, Dv] from KS = [K S^T | K K^T] (row stride ld; the gated rule's decays already applied to it: decay_products);
// X written to x where kept (what the backward's dbeta needs).
template <typename T, typename In>
void new_values(int64_t c, int64_t Dv, const In* V, const In* b, const T* KS, int64_t ld, T* x, T* Un) {
  for (int64_t i = 0; i < c; ++i) {  // beta_i x_i, x_i = v_i - S k_i
    T* u = Un + i * Dv;
    const In* vi = V + i * Dv;
    const T* ks = KS + i * ld;
    const T bi = T(b[i]);
    if (x == nullptr) {
#pragma omp simd
      for (int64_t j = 0; j < Dv; ++j) u[j] = bi * (T(vi[j]) - ks[j]);
      continue;
    }
    T* xi = x + i * Dv;
#pragma omp simd
    for (int64_t j = 0; j < Dv; ++j) {
      xi[j] = T(vi[j]) - ks[j];
      u[j] = bi * xi[j];
    }
  }
  unit_lower_forward_substitution<T>(c, Dv, KS + Dv, ld, [b](int64_t i) { return T(b[i]); }, Un);
}

// The gated rule's decays on a chunk's first product Y = [Q; K] [S^T | K^T] (rows of stride ld: cq query rows, then
// key rows up to `rows`), in place (Gated DeltaNet sec. 3.1; kernels/README.md, "Gated delta rule"):
//   [Q S^T | Q K^T] -> [diag(Gamma) Q S^T | tril(Q K^T) * D],   [K S^T | K K^T] -> [diag(Gamma) K S^T | (K K^T) * D]
// so that the delta rule's steps that follow compute O = diag(Gamma) Q S^T + P U' and (I + A) U' = diag(beta) (V -
// diag(Gamma) K S^T), A = strictly_lower(diag(beta) (K K^T * D)).
template <typename T>
void decay_products(const Decays<T>& d, int64_t cq, int64_t c, int64_t rows, int64_t Dv, T* Y, int64_t ld) {
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = r < cq ? r : r - cq;
    T* y = Y + r * ld;
    const T gamma = d.Gamma[i];
    const T* D = d.D + i * c;
#pragma omp simd
    for (int64_t j = 0; j < Dv; ++j) y[j] *= gamma;
#pragma omp simd
    for (int64_t j = 0; j < c; ++j) y[Dv + j] *= D[j];
  }
}

// One sequence: q, k [L, Dk], v [L, Dv], beta [L] (nullptr: sum rule), g [L] (the gated rule's log-decays, with beta;
// nullptr: no decay). S [Dv, Dk] holds the initial state on entry and the final one on return. Writes o [L, Dv] (unless
// nullptr) and what `record` asks for. `work` holds chunk_workspace(C, Dk, Dv) elements.
// In: the type of q, k, v, beta and o (T, or bfloat16 with T = float: the state, sums and products' results float32);
// G: of g (In, or T: a bfloat16 model computes its log-decays in float32).
template <typename T, typename Gemm, typename In = T, typename G = In>
void chunk_forward_seq(int64_t L, int64_t Dk, int64_t Dv, int64_t C, const In* q, const In* k, const In* v,
                       const In* beta, const G* g, T* S, std::type_identity_t<In>* o, const ForwardRecord<T>& record,
                       T* work, const Gemm& policy) {
  const Gemm gemm = on_this_thread(policy);
  // The state is kept transposed, St = S^T [Dk, Dv], beside K^T [Dk, c], and the chunk's queries and keys are stacked,
  // X = [Q; K] [2c, Dk] (widened there, or read in place as two products: ChunkProducts). One buffer Z [Dk + 2C,
  // Dv + C] (row stride ld) holds
  //   rows 0 .. Dk:             [ S^T | K^T ]
  //   then c rows (with o):     [ Q S^T | Q K^T ]   -> [ O | tril(Q K^T) ]
  //   then c rows (delta rule): [ K S^T | K K^T ]
  // so that each chunk is two products: X [S^T | K^T] fills the rows below the first Dk, and [K^T; P] U' adds both
  // the chunk's writes to S^T and their reads to O.
  const int64_t ld = Dv + C;
  T* X = work;                           // [Q; K]                                [2C, Dk]
  T* Z = X + 2 * C * Dk;                 // the buffer above                      [Dk + 2C, ld]
  T* U_buf = Z + (Dk + 2 * C) * ld;      // U' when the caller does not keep it   [C, Dv]
  T* St = Z;
  ChunkProducts<T, Gemm, In> products(gemm, C, Dk, Dv, ld, X, Z);
  Decays<T> decays(g != nullptr ? C : 0);
  PacedLines* const paced = paced_lines_of(gemm);
  transpose(Dv, Dk, S, Dk, St, ld);
  for (int64_t t0 = 0, n = 0; t0 < L; t0 += C, ++n) {
    const int64_t c = std::min(C, L - t0);
    const In* V = v + t0 * Dv;
    record.keep_state(n, Dk, Dv, St, ld);
    // Without outputs to write (the backward's recomputation of the states) only the keys are stacked.
    const int64_t cq = o != nullptr ? c : 0;
    if (paced != nullptr) paced->issue_all();  // what the previous chunk asked for and no tile issued
    // this chunk's rows of o, written at its end (from the second chunk: asked for in the first, they made the forward
    // at T = 16-64 2-7% slower, by hand)
    if (o != nullptr && t0 > 0) RowsAhead{t0, c, paced}.fetch<true>(o, Dv);
    products.load(q + t0 * Dk, k + t0 * Dk, cq, c);
    const RowsAhead next = next_chunk(t0, C, L, paced);
    if (cq > 0) next.fetch(q, Dk);

    // [Q; K] [S^T | K^T]: Q S^T is what the state entering the chunk returns for each query (eq. 25 with W = S)
    // (the sum rule needs neither K S^T nor K K^T: only the Q rows)
    const int64_t rows = cq + (beta != nullptr ? c : 0);
    T* Y = Z + Dk * ld;  // [Q S^T | Q K^T] then [K S^T | K K^T]
    products.states_and_keys(rows, c, Y);
    next.fetch(k, Dk);
    T* P = Y + Dv;  // tril(Q K^T), diagonal included: position i reads the writes of positions j <= i
    for (int64_t i = 0; i < cq; ++i) std::fill(P + i * ld + i + 1, P + i * ld + c, T(0));
    if (g != nullptr) {
      decays.compute(c, g + t0);
      decay_products(decays, cq, c, rows, Dv, Y, ld);
    }

    const T* U = U_buf;  // sum rule: the values themselves are written (eq. 17)
    if (beta == nullptr) {
      if constexpr (std::is_same_v<In, T>) {
        U = V;
      } else {
        convert_copy(V, c * Dv, U_buf);
      }
    } else {  // the delta rule within the chunk
      T* Un = record.u_new != nullptr ? record.u_new + t0 * Dv : U_buf;
      new_values(c, Dv, V, beta + t0, Y + cq * ld, ld, record.x != nullptr ? record.x + t0 * Dv : nullptr, Un);
      if (record.u_new_rows != nullptr) record_rows(c, Dv, Un, record.u_new_rows + t0 * round_up(Dv, 2));
      U = Un;
    }
    next.fetch(v, Dv);
    if (g != nullptr) products.scale_keys(decays.lambda);
    // [S^T; O] += [K^T; P] U': the chunk's writes (S^T <- S^T + K^T U') and their reads (O = Q S^T + P U'); the gated
    // rule's S^T <- Gamma_c S^T + K^T diag(lambda) U'
    products.writes_and_reads(cq, c, U, g != nullptr ? decays.Gamma[c - 1] : T(1));
    for (int64_t i = 0; i < cq; ++i) convert_copy(Y + i * ld, Dv, o + (t0 + i) * Dv);
  }
  if (paced != nullptr) paced->clear();
  transpose(Dk, Dv, St, ld, S, Dk);
}

// The transposed system of the backward, (I + strictly_lower(diag(beta) G))^T R = D, in place (D in R), by back
// substitution: once r_j is final (j from the last row), r_i -= beta_j G_ji r_j for every i < j.
template <typename T, typename B>
inline void unit_lower_transposed_back_substitution(int64_t c, int64_t n, const T* G, int64_t ldg, const B& beta,
                                                    T* R) {
  constexpr int64_t W = 64 / sizeof(T) * 4;  // a block of columns: 4 vectors of 64 bytes
  for (int64_t x0 = 0; x0 < n; x0 += W) {
    const int64_t w = std::min(W, n - x0);
    for (int64_t j = c - 1; j > 0; --j) {
      T rj[W];  // r_j's block in registers for every row above it (reloaded for each row, the bfloat16 backward op
                // was 3.9% slower: 15.34 against 14.76 ms side by side, B1 H8 T4096 D64, 1 thread; float32 level)
      for (int64_t x = 0; x < W; ++x) rj[x] = x < w ? R[j * n + x0 + x] : T(0);
      const T bj = beta(j);
      for (int64_t i = 0; i < j; ++i) {
        const T a = bj * G[j * ldg + i];
        T* ri = R + i * n + x0;
        if (w == W) {
#pragma omp simd
          for (int64_t x = 0; x < W; ++x) ri[x] -= a * rj[x];
        } else {
          for (int64_t x = 0; x < w; ++x) ri[x] -= a * rj[x];
        }
      }
    }
  }
}

// A chunk's n elements of x as T: x itself, or widened into `buf` (bfloat16 inputs of the backward).
template <typename T, typename In>
inline const T* rows_as(const In* x, int64_t n, T* buf) {
  if constexpr (std::is_same_v<In, T>) {
    return x;
  } else {
    convert_copy(x, n, buf);
    return buf;
  }
}
// Where a chunk's gradient rows are computed: in x itself, or in `buf`, which store_rows rounds into x.
template <typename T, typename Out>
inline T* rows_for(Out* x, T* buf) {
  if constexpr (std::is_same_v<Out, T>) {
    return x;
  } else {
    return buf;
  }
}
template <typename T, typename Out>
inline void store_rows(const T* buf, int64_t n, Out* x) {
  if constexpr (!std::is_same_v<Out, T>) convert_copy(buf, n, x);
}

// A backward's (or the gated forward's) chunk of inputs as T, positions [t0, t0 + c): each in place, or widened into
// `buf` (rows_as; size(C, Dk, Dv) elements), nullptr where the caller passes none (k always given).
template <typename T>
struct ChunkInputs {
  const T *Q, *K, *V, *b, *g, *dO;
  static int64_t size(int64_t C, int64_t Dk, int64_t Dv) { return 2 * C * (Dk + Dv + 1); }
  template <typename In, typename G>
  ChunkInputs(int64_t t0, int64_t c, int64_t C, int64_t Dk, int64_t Dv, const In* q, const In* k, const In* v,
              const In* beta, const G* gs, const In* dout, T* buf) {
    Q = q != nullptr ? rows_as(q + t0 * Dk, c * Dk, buf) : nullptr;
    K = rows_as(k + t0 * Dk, c * Dk, buf + C * Dk);
    V = v != nullptr ? rows_as(v + t0 * Dv, c * Dv, buf + 2 * C * Dk) : nullptr;
    dO = dout != nullptr ? rows_as(dout + t0 * Dv, c * Dv, buf + 2 * C * Dk + C * Dv) : nullptr;
    b = beta != nullptr ? rows_as(beta + t0, c, buf + 2 * C * (Dk + Dv)) : nullptr;
    g = gs != nullptr ? rows_as(gs + t0, c, buf + 2 * C * (Dk + Dv) + C) : nullptr;
  }
};

// Where a backward computes its chunk's gradients, positions [t0, t0 + c): in the outputs themselves, or in `buf`
// (rows_for; size(C, Dk, Dv) elements), rounded into the outputs by store; nullptr where the caller passes none.
template <typename T, typename Out, typename GOut = Out>
struct ChunkGradients {
  int64_t t0, c, Dk, Dv;
  Out *dq, *dk, *dv, *dbeta;
  GOut* dg;  // (the type of g: Out, or T)
  T *dQ, *dK, *dV, *db, *dgs;
  static int64_t size(int64_t C, int64_t Dk, int64_t Dv) { return 2 * C * (Dk + 1) + C * Dv; }
  ChunkGradients(int64_t t0, int64_t c, int64_t C, int64_t Dk, int64_t Dv, Out* dq, Out* dk, Out* dv, Out* dbeta,
                 GOut* dg, T* buf)
      : t0(t0), c(c), Dk(Dk), Dv(Dv), dq(dq + t0 * Dk), dk(dk + t0 * Dk), dv(dv + t0 * Dv),
        dbeta(dbeta != nullptr ? dbeta + t0 : nullptr), dg(dg != nullptr ? dg + t0 : nullptr) {
    dQ = rows_for(this->dq, buf);
    dK = rows_for(this->dk, buf + C * Dk);
    dV = rows_for(this->dv, buf + 2 * C * Dk);
    db = this->dbeta != nullptr ? rows_for(this->dbeta, buf + 2 * C * Dk + C * Dv) : nullptr;
    dgs = this->dg != nullptr ? rows_for(this->dg, buf + 2 * C * Dk + C * Dv + C) : nullptr;
  }
  void store() const {
    store_rows(dQ, c * Dk, dq);
    store_rows(dK, c * Dk, dk);
    store_rows(dV, c * Dv, dv);
    if (db != nullptr) store_rows(db, c, dbeta);
    if (dgs != nullptr) store_rows(dgs, c, dg);
  }
};

inline int64_t chunk_backward_workspace(int64_t C, int64_t Dk, int64_t Dv) {
  return 4 * C * C + 3 * C * Dk + 2 * C * Dv + C * std::max(Dk, Dv) + C + ChunkInputs<float>::size(C, Dk, Dv) +
         ChunkGradients<float, float>::size(C, Dk, Dv);
}

// The buffers of one chunk's backward (chunk_backward_seq), in a workspace of chunk_backward_workspace(C, Dk, Dv).
template <typename T>
struct BackwardBuffers {
  T* P;    // tril(Q K^T)                                    [c, c]
  T* A;    // strictly_lower(K K^T) (beta applied as read)   [c, c]
  T* dP;   //                                                [c, c]
  T* dA;   //                                                [c, c]
  T* dR;   // dU', then dR in place                          [c, Dv]
  T* M;    // dA K                                           [c, Dk]
  T* bK;   // diag(beta) K                                   [c, Dk]
  T* Kt;   // K^T, for tril(Q K^T) and K K^T                 [Dk, c]
  T* Ut;   // U'^T, for dP and dA                            [Dv, c]
  T* G;    // the gated rule's diag(Gamma) Q, diag(Gamma) dV    [c, max(Dk, Dv)]
  T* dgam;  // the gated rule's gradient of gamma               [c]
  T* in;   // the chunk's inputs widened to T (ChunkInputs; bfloat16 inputs)
  T* out;  // its gradients before they are rounded (ChunkGradients; bfloat16 outputs)
  BackwardBuffers(T* work, int64_t C, int64_t Dk, int64_t Dv)
      : P(work), A(P + C * C), dP(A + C * C), dA(dP + C * C), dR(dA + C * C), M(dR + C * Dv), bK(M + C * Dk),
        Kt(bK + C * Dk), Ut(Kt + C * Dk), G(Ut + C * Dv), dgam(G + C * std::max(Dk, Dv)), in(dgam + C),
        out(in + ChunkInputs<T>::size(C, Dk, Dv)) {}
};

// The backward's products, each C [m, n] = alpha op(A) op(B) + beta C, read their matrices through forms made once per
// chunk however many products read them (K: five):
//   rows(X [m, k]):         A = X
//   pairs(X [k, n]):        B = X, or A = X^T (X [k, m])
//   transposed(X [n, k]):   B = X^T
// and the chunk's inputs through `inputs` (Q, K, dO as rows and as pairs, K^T). This one serves every Gemm policy on
// T matrices: a form is the matrix itself (transposed() writes X^T into `buf` where one is given), each product one
// gemm call.
enum class Form { kRows, kPairs, kTransposed };

template <typename T, typename Gemm, typename In>
struct BackwardProducts {
  static constexpr bool kReadsInputsInPlace = false;  // the products read q and dout widened to T (ChunkInputs)
  static constexpr bool kKeepsBfloat16 = false;      // the forward keeps the entering states and U' in T
  struct Operand {
    const T* x;
    int64_t ld;
    Form form;
  };
  struct Inputs {
    Operand Q, K, dO, Qp, Kp, dOp, Kt;
  };
  const Gemm& gemm;
  int64_t Dk, Dv;
  BackwardProducts(const Gemm& gemm, int64_t /*C*/, int64_t Dk, int64_t Dv) : gemm(gemm), Dk(Dk), Dv(Dv) {}
  void begin_chunk() {}
  // the state entering chunk n, S [Dv, Dk], as pairs; the c new values U' [c, Dv] from position t0 as rows (the delta
  // rule's, kept by the forward; the sum rule's, the values V [c, Dv] themselves: V_T as ChunkInputs holds them)
  Operand state(const ForwardRecord<T>& kept, int64_t n) {
    return pairs(kept.entering + n * Dv * Dk, Dv, Dk, Dk);
  }
  Operand new_values(const ForwardRecord<T>& kept, int64_t t0, int64_t c) {
    return rows(kept.u_new + t0 * Dv, c, Dv, Dv);
  }
  Operand values(const T* V_T, const In*, int64_t c) { return rows(V_T, c, Dv, Dv); }
  Operand rows(const T* x, int64_t /*m*/, int64_t /*k*/, int64_t ld) { return {x, ld, Form::kRows}; }
  Operand pairs(const T* x, int64_t /*k*/, int64_t /*n*/, int64_t ld) { return {x, ld, Form::kPairs}; }
  // (x_rows: x's rows form where the caller has one; not needed here)
  Operand transposed(const T* x, int64_t n, int64_t k, int64_t ld, T* buf = nullptr, const Operand* = nullptr) {
    if (buf == nullptr) return {x, ld, Form::kTransposed};
    transpose(n, k, x, ld, buf, n);
    return {buf, n, Form::kPairs};
  }
  // x: the chunk's c rows as ChunkInputs holds them; K^T written into Kt [Dk, c]
  Inputs inputs(const ChunkInputs<T>& x, const In*, const In*, const In*, int64_t c, T* Kt) {
    return {rows(x.Q, c, Dk, Dk),  rows(x.K, c, Dk, Dk),  rows(x.dO, c, Dv, Dv),          pairs(x.Q, c, Dk, Dk),
            pairs(x.K, c, Dk, Dk), pairs(x.dO, c, Dv, Dv), transposed(x.K, c, Dk, Dk, Kt)};
  }
  void operator()(int64_t m, int64_t n, int64_t k, const Operand& a, const Operand& b, T alpha, T beta, T* C,
                  int64_t ldc) const {
    gemm(a.form == Form::kPairs, b.form == Form::kTransposed, m, n, k, alpha, a.x, a.ld, b.x, b.ld, beta, C, ldc);
  }
  // The chunk's last update of dS [Dv, Dk], dS += alpha op(a) op(b), and the pairs of dS' that the next chunk reads
  // (here: dS itself).
  void update_state_gradient(int64_t k, const Operand& a, const Operand& b, T alpha, T* dS) {
    (*this)(Dv, Dk, k, a, b, alpha, T(1), dS, Dk);
  }
  Operand state_gradient_pairs(const T* dS) { return pairs(dS, Dv, Dk, Dk); }
  // <S, dS'> (the gated rule's decay of the state), S entering chunk n: with bfloat16 factors both rounded, as any
  // product reads them (pairs_dot, as the bfloat16 specialization computes it)
  T state_dot(const ForwardRecord<T>& kept, int64_t n, const T* dS) const {
    const T* S = kept.entering + n * Dv * Dk;
#ifdef FWP_NATIVE_BF16
    if constexpr (std::is_same_v<Gemm, VectorGemm<Bfloat16Factors>>) {
      const int64_t size = state_pairs_size(Dk, Dv);
      bf16_bits* pairs = scratch<bf16_bits>(1, 2 * size);
      pack_pairs(Dv, Dk, S, Dk, pairs, round_up(Dk, 16));
      pack_pairs(Dv, Dk, dS, Dk, pairs + size, round_up(Dk, 16));
      return pairs_dot(Dv, Dk, pairs, pairs + size, round_up(Dk, 16));
    }
#endif
    return dot(Dv * Dk, S, dS);
  }
};

#ifdef FWP_NATIVE_BF16
// bfloat16 inputs with bfloat16 factors: every form packed once per chunk as the micro-kernel reads it (the generic
// BackwardProducts with VectorGemm<Bfloat16Factors> packs both operands of each of a chunk's 15 products); q, k and
// dout read in place as rows (copied with a zero pad for an odd width), their pairs interleaved from the bfloat16
// bits. The float32 matrices are rounded as VectorGemm<Bfloat16Factors> rounds them, and each product is the same
// vector_gemm call, so the gradients are bit for bit those of the generic products on the widened inputs. The forms
// live in the thread's scratch slot 3, taken in turn and given back by begin_chunk.
template <>
struct BackwardProducts<float, VectorGemm<Bfloat16Factors>, c10::BFloat16> {
  static constexpr bool kReadsInputsInPlace = true;
  static constexpr bool kKeepsBfloat16 = true;  // the forward keeps the entering states' pairs and U's rows
  static constexpr int64_t kMostForms = 24;  // a chunk makes at most 20
  struct Operand {
    const bf16_bits* x;
    int64_t ld;  // elements from one row (rows) or pair row (pairs) to the next
    Form form;
  };
  struct Inputs {
    Operand Q, K, dO, Qp, Kp, dOp, Kt;
  };
  int64_t Dk, Dv, capacity, used = 0;
  bf16_bits* arena;
  bf16_bits* dS_pairs;         // dS' as pairs, written by the previous chunk's last update of dS (after the arena)
  bool dS_pairs_kept = false;  // whether they are there
  PacedLines& lines;
  BackwardProducts(const VectorGemm<Bfloat16Factors>& gemm, int64_t C, int64_t Dk, int64_t Dv)
      : Dk(Dk), Dv(Dv), lines(lines_or_thread(gemm.lines)) {
    const int64_t side = round_up(std::max({C, Dk, Dv}), 16);  // no form is larger than side x side
    capacity = kMostForms * (side * side + 32);
    arena = scratch<bf16_bits>(3, capacity + state_pairs_size(Dk, Dv));
    dS_pairs = arena + capacity;
  }
  void begin_chunk() { used = 0; }
  Operand state(const ForwardRecord<float>& kept, int64_t n) {
    return {kept.entering_pairs + n * state_pairs_size(Dk, Dv), 2 * round_up(Dk, 16), Form::kPairs};
  }
  Operand new_values(const ForwardRecord<float>& kept, int64_t t0, int64_t) {
    return {kept.u_new_rows + t0 * round_up(Dv, 2), round_up(Dv, 2), Form::kRows};
  }
  Operand values(const float*, const c10::BFloat16* v, int64_t c) { return input_rows(v, c, Dv); }  // in place
  Operand rows(const float* x, int64_t m, int64_t k, int64_t ld) {
    const int64_t k2 = round_up(k, 2);
    bf16_bits* out = take(m * k2);
    round_rows(m, k, x, ld, out, k2);
    return {out, k2, Form::kRows};
  }
  Operand pairs(const float* x, int64_t k, int64_t n, int64_t ld) {
    const int64_t np = round_up(n, 16);
    bf16_bits* out = take(round_up(k, 2) * np);
    pack_pairs(k, n, x, ld, out, np);
    return {out, 2 * np, Form::kPairs};
  }
  Operand transposed(const float* x, int64_t n, int64_t k, int64_t ld, float* = nullptr,
                     const Operand* x_rows = nullptr) {
    if (x_rows != nullptr) return transposed_rows(*x_rows, n);
    const int64_t np = round_up(n, 16);
    bf16_bits* out = take(round_up(k, 2) * np);
    transposed_pairs(n, k, x, ld, out, np);
    return {out, 2 * np, Form::kPairs};
  }
  Inputs inputs(const ChunkInputs<float>&, const c10::BFloat16* q, const c10::BFloat16* k,
                const c10::BFloat16* dout, int64_t c, float*) {
    Inputs f;
    f.Q = input_rows(q, c, Dk);
    f.K = input_rows(k, c, Dk);
    f.dO = input_rows(dout, c, Dv);
    f.Qp = interleaved(f.Q, c, Dk);
    f.Kp = interleaved(f.K, c, Dk);
    f.dOp = interleaved(f.dO, c, Dv);
    f.Kt = transposed_rows(f.K, c);
    return f;
  }
  void operator()(int64_t m, int64_t n, int64_t k, const Operand& a, const Operand& b, float alpha, float beta,
                  float* C, int64_t ldc) const {
    const bool a_pairs = a.form == Form::kPairs;
    vector_gemm<Bfloat16Factors>(m, n, (k + 1) / 2, a.x, a_pairs ? 2 : a.ld, a_pairs ? a.ld : 2, b.x, b.ld, alpha, C,
                                 ldc, beta, lines);
  }
  // dS's pairs for the next chunk written from the registers of its last update (the tiles' kPairs), not packed again
  void update_state_gradient(int64_t k, const Operand& a, const Operand& b, float alpha, float* dS) {
    const bool a_pairs = a.form == Form::kPairs;
    vector_gemm<Bfloat16Factors>(Dv, Dk, (k + 1) / 2, a.x, a_pairs ? 2 : a.ld, a_pairs ? a.ld : 2, b.x, b.ld, alpha, dS,
                                 Dk, 1.f, lines, dS_pairs, 2 * round_up(Dk, 16));
    dS_pairs_kept = true;
  }
  Operand state_gradient_pairs(const float* dS) {
    if (dS_pairs_kept) return {dS_pairs, 2 * round_up(Dk, 16), Form::kPairs};
    return pairs(dS, Dv, Dk, Dk);  // the final state's gradient, before any update
  }
  // <S, dS'> from the pairs the products read (the generic one's with these factors)
  float state_dot(const ForwardRecord<float>& kept, int64_t n, const float* dS) {
    const Operand dSp = state_gradient_pairs(dS);
    return pairs_dot(Dv, Dk, state(kept, n).x, dSp.x, round_up(Dk, 16));
  }

 private:
  bf16_bits* take(int64_t n) {
    bf16_bits* out = arena + used;
    used += round_up(n, 32);  // each form on its own 64 bytes
    TORCH_CHECK(used <= capacity, "fwp_chunk: more backward operand forms than kMostForms");
    return out;
  }
  // B = X^T from X's n rows: pair p of column i is pair p of row i, a transpose of 32-bit pairs
  Operand transposed_rows(const Operand& r, int64_t n) {
    const int64_t np = round_up(n, 16);
    bf16_bits* out = take(r.ld * np);
    transpose_into(n, r.ld / 2, reinterpret_cast<const pair_bits*>(r.x), r.ld / 2, reinterpret_cast<pair_bits*>(out),
                   np);
    return {out, 2 * np, Form::kPairs};
  }
  Operand input_rows(const c10::BFloat16* x, int64_t rows, int64_t width) {
    const bf16_bits* bits = reinterpret_cast<const bf16_bits*>(x);
    if (width % 2 == 0) return {bits, width, Form::kRows};
    bf16_bits* out = take(rows * (width + 1));
    for (int64_t i = 0; i < rows; ++i) {
      std::memcpy(out + i * (width + 1), bits + i * width, sizeof(bf16_bits) * width);
      out[i * (width + 1) + width] = 0;
    }
    return {out, width + 1, Form::kRows};
  }
  Operand interleaved(const Operand& r, int64_t rows, int64_t width) {
    const int64_t np = round_up(width, 16);
    bf16_bits* out = take(round_up(rows, 2) * np);
    interleave_rows(rows, width, r.x, r.ld, out, np);
    return {out, 2 * np, Form::kPairs};
  }
};
#endif  // FWP_NATIVE_BF16

// The gated rule's decays in a chunk's backward (Gated DeltaNet sec. 3.1; kernels/README.md, "Gated delta rule"): its
// Decays, and dgam [c], the gradient of gamma (cumulative log-decay) that each step adds to. nullptr for no decay.
template <typename T>
struct DecayGradients {
  const Decays<T>& d;
  T* dgam;
  // O reads diag(Gamma) Q S^T: dQ = dO S given, scaled in place to diag(Gamma) dO S; dgam_i += Gamma_i (dO S)_i . q_i
  void queries(int64_t c, int64_t Dk, const T* Q, T* dQ) const {
    for (int64_t i = 0; i < c; ++i) {
      const T gamma = d.Gamma[i];
      dgam[i] += gamma * dot(Dk, dQ + i * Dk, Q + i * Dk);
#pragma omp simd
      for (int64_t j = 0; j < Dk; ++j) dQ[i * Dk + j] *= gamma;
    }
  }
  // S' = Gamma_c S + U'^T diag(lambda) K: dK = U' dS' given, scaled to diag(lambda) U' dS'; dgam_i = -lambda_i (U'
  // dS')_i . k_i (the first term of dgam), and dgam_c gets sum_i lambda_i (U' dS')_i . k_i + Gamma_c <S, dS'>
  void keys(int64_t c, int64_t Dk, const T* K, T* dK, T state_dot) const {
    T lambda_sum = 0;
    for (int64_t i = 0; i < c; ++i) {
      const T lambda = d.lambda[i], acc = lambda * dot(Dk, dK + i * Dk, K + i * Dk);
      dgam[i] = -acc;
      lambda_sum += acc;
#pragma omp simd
      for (int64_t j = 0; j < Dk; ++j) dK[i * Dk + j] *= lambda;
    }
    dgam[c - 1] += lambda_sum + d.Gamma[c - 1] * state_dot;
  }
  // X [c, c] = M * D (P, or KD = K K^T * D) read as M: with its gradient dX (rows scaled by `rows` where given:
  // diag(beta) dA for KD), dgam_i += sum_j H_ij - sum_j H_ji, H = dX * X; then dX <- dX * D, the gradient of M
  template <typename B>
  void through_D(int64_t c, const T* X, T* dX, const B& rows) const {
    T* const dg = dgam;  // (read through `this` in the loop, GCC gathered and scattered dgam[j]: the op 5% slower)
    for (int64_t i = 0; i < c; ++i) {  // (whole rows: the vector loop has no ragged end; above the diagonal dX is 0)
      const T row = rows(i);
      const T *Xi = X + i * c, *Di = d.D + i * c;
      T* dXi = dX + i * c;
      // (H's row sum by dot, its products formed again in the loop below: a row of c in L1, read twice instead of a
      // reduction's serial tail inside the loop; the dots' change as a whole in bench_chunk_builds_float32_dot.json)
      const T acc = row * dot(c, dXi, Xi);
#pragma omp simd
      for (int64_t j = 0; j < c; ++j) {
        dg[j] -= row * dXi[j] * Xi[j];
        dXi[j] *= Di[j];
      }
      dg[i] += acc;
    }
  }
  // x_i <- lambda_i x_i for rows x [c, n]
  void lambda_rows(int64_t c, int64_t n, T* x) const { scale_rows(d.lambda, c, n, x, x); }
  // out_i = Gamma_i x_i for rows x [c, n]
  void gamma_rows(int64_t c, int64_t n, const T* x, T* out) const { scale_rows(d.Gamma, c, n, x, out); }
  // x <- x * D elementwise, x [c, c] (P or K K^T: their decays)
  void times_D(int64_t c, T* x) const {
    const T* D = d.D;
#pragma omp simd
    for (int64_t i = 0; i < c * c; ++i) x[i] *= D[i];
  }

 private:
  // out_i = scale_i x_i for rows x [c, n] (out may be x)
  static void scale_rows(const T* scale, int64_t c, int64_t n, const T* x, T* out) {
    for (int64_t i = 0; i < c; ++i) {
      const T s = scale[i];
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) out[i * n + j] = s * x[i * n + j];
    }
  }
};

// The delta rule's part of a chunk's backward (after the products that the sum rule shares), with dU' in dR, X kept by
// the forward, and the forms of U'^T and S that the shared part made:
//   (I + A) U' = diag(beta) X, X = V - K S^T, A = strictly_lower(diag(beta) K K^T):
//     dR = (I + A)^-T dU',  dV = diag(beta) dR,  dbeta = rowsum(dR * X) + rowsum((dA K) * K),
//     dA = -strictly_lower(dR U'^T),  dK += -dV S + diag(beta) dA K + dA^T diag(beta) K,  dS -= dV^T K
// The gated rule's decays where `decay` is given: X = V - diag(Gamma) K S^T, A = strictly_lower(diag(beta) (K K^T *
// D)), so dV S and dV^T K take diag(Gamma) dV, dA goes through D, and dgam_i -= dV_i . (V - X)_i (V as T).
template <typename T, typename Products>
void delta_rule_chunk_backward(int64_t c, int64_t Dk, int64_t Dv, const T* K, const T* V, const T* X, const T* b,
                               const BackwardBuffers<T>& w, Products& mm, const typename Products::Inputs& in,
                               const typename Products::Operand& Ut, const typename Products::Operand& Sp, T* dS,
                               T* dK, T* dV, T* db, const DecayGradients<T>* decay) {
  // Recompute A, then dR = (I + A)^-T dU'
  mm(c, c, Dk, in.K, in.Kt, T(1), T(0), w.A, c);
  if (decay != nullptr) decay->times_D(c, w.A);
  unit_lower_transposed_back_substitution<T>(c, Dv, w.A, c, [b](int64_t i) { return b[i]; }, w.dR);
  // dV = diag(beta) dR;  dbeta = rowsum(dR * X);  gated: dgam_i -= dV_i . (Gamma K S^T)_i, Gamma K S^T = V - X
  for (int64_t i = 0; i < c; ++i) {
    db[i] = dot(Dv, w.dR + i * Dv, X + i * Dv);
    for (int64_t j = 0; j < Dv; ++j) dV[i * Dv + j] = b[i] * w.dR[i * Dv + j];
    if (decay == nullptr) continue;
    decay->dgam[i] -= dot(Dv, dV + i * Dv, V + i * Dv, X + i * Dv);
  }
  // dK -= dX S;  dS -= dX^T K   (dX = dV; gated: diag(Gamma) dV)
  const T* dX = dV;
  if (decay != nullptr) {
    decay->gamma_rows(c, Dv, dV, w.G);
    dX = w.G;
  }
  mm(c, Dk, Dv, mm.rows(dX, c, Dv, Dv), Sp, T(-1), T(1), dK, Dk);
  mm.update_state_gradient(c, mm.pairs(dX, c, Dv, Dv), in.Kp, T(-1), dS);
  // dA = -strictly_lower(dR U'^T)  (gated: through D, dA <- dA * D)
  mm(c, c, Dv, mm.rows(w.dR, c, Dv, Dv), Ut, T(-1), T(0), w.dA, c);
  for (int64_t i = 0; i < c; ++i) std::fill(w.dA + i * c + i, w.dA + (i + 1) * c, T(0));
  if (decay != nullptr) decay->through_D(c, w.A, w.dA, [b](int64_t i) { return b[i]; });
  // M = dA K:  dK += diag(beta) M,  dbeta += rowsum(M * K);  dK += dA^T diag(beta) K
  mm(c, Dk, c, mm.rows(w.dA, c, c, c), in.Kp, T(1), T(0), w.M, Dk);
  for (int64_t i = 0; i < c; ++i) {
    db[i] += dot(Dk, w.M + i * Dk, K + i * Dk);
    for (int64_t j = 0; j < Dk; ++j) {
      dK[i * Dk + j] += b[i] * w.M[i * Dk + j];
      w.bK[i * Dk + j] = b[i] * K[i * Dk + j];
    }
  }
  mm(c, Dk, c, mm.pairs(w.dA, c, c, c), mm.pairs(w.bK, c, Dk, Dk), T(1), T(1), dK, Dk);
}

// The gradients that reach a chunk's outputs and the state leaving it (see chunk_backward_seq): dU' (into dU), dK =
// U' dS' + dP^T Q, dQ = dO S + dP K, dP = tril(dO U'^T), P = tril(Q K^T) recomputed into w.P; the gated rule's decays
// where `decay` is given (dU' = diag(lambda) K dS'^T + P^T dO, P = tril(Q K^T) * D, ...: DecayGradients), with
// state_dot = <S, dS'> (S entering the chunk). fetch(stage): the caller's prefetches, stages 1 and 2.
template <typename T, typename Products, typename Fetch>
void output_gradients(int64_t c, int64_t Dk, int64_t Dv, const T* Q, const T* K, T state_dot, const T* dS, T* dU,
                      T* dQ, T* dK, const BackwardBuffers<T>& w, Products& mm, const typename Products::Inputs& in,
                      const typename Products::Operand& Ur, const typename Products::Operand& Ut,
                      const typename Products::Operand& Sp, const DecayGradients<T>* decay, const Fetch& fetch) {
  mm(c, c, Dk, in.Q, in.Kt, T(1), T(0), w.P, c);
  for (int64_t i = 0; i < c; ++i) std::fill(w.P + i * c + i + 1, w.P + (i + 1) * c, T(0));
  if (decay != nullptr) decay->times_D(c, w.P);
  // dU' = K dS'^T + P^T dO
  mm(c, Dv, Dk, in.K, mm.transposed(dS, Dv, Dk, Dk), T(1), T(0), dU, Dv);
  if (decay != nullptr) decay->lambda_rows(c, Dv, dU);
  mm(c, Dv, c, mm.pairs(w.P, c, c, c), in.dOp, T(1), T(1), dU, Dv);
  fetch(1);
  // dK = U' dS' (dS' still the gradient of the state leaving the chunk)
  mm(c, Dk, Dv, Ur, mm.state_gradient_pairs(dS), T(1), T(0), dK, Dk);
  if (decay != nullptr) decay->keys(c, Dk, K, dK, state_dot);
  // dP = tril(dO U'^T);  dQ = dO S + dP K;  dK += dP^T Q
  mm(c, c, Dv, in.dO, Ut, T(1), T(0), w.dP, c);
  for (int64_t i = 0; i < c; ++i) std::fill(w.dP + i * c + i + 1, w.dP + (i + 1) * c, T(0));
  mm(c, Dk, Dv, in.dO, Sp, T(1), T(0), dQ, Dk);
  if (decay != nullptr) {
    decay->queries(c, Dk, Q, dQ);
    decay->through_D(c, w.P, w.dP, [](int64_t) { return T(1); });
  }
  mm(c, Dk, c, mm.rows(w.dP, c, c, c), in.Kp, T(1), T(1), dQ, Dk);
  fetch(2);
  mm(c, Dk, c, mm.pairs(w.dP, c, c, c), in.Qp, T(1), T(1), dK, Dk);
}

// The backward of one sequence, chunks from last to first. Given what `chunk_forward_seq` kept (`kept`: the states
// entering the chunks; U' and X for the delta rule), the output gradient do [L, Dv] and, in dS [Dv, Dk], the gradient
// of the final state (replaced by that of the initial state). Per chunk, with S entering it and dS' the gradient of the
// state leaving it (derivation: kernels/README.md, "Backward of the CPU kernel"):
//   O = Q S^T + P U', P = tril(Q K^T), S' = S + U'^T K:
//     dU' = K dS'^T + P^T dO,  dP = tril(dO U'^T),  dQ = dO S + dP K,  dK = U' dS' + dP^T Q,
//     dS = dS' + dO^T Q
//   delta rule: delta_rule_chunk_backward;  sum rule: dV = dU'.
// The gated rule (g: its log-decays, dg their gradient; kernels/README.md, "Gated delta rule"): the same steps with its
// decays, O = diag(Gamma) Q S^T + P U', P = tril(Q K^T) * D, S' = Gamma_c S + U'^T diag(lambda) K (DecayGradients).
// In: the type of q, k, v, beta and do; Out: of dq, dk, dv and dbeta (T, or bfloat16 with T = float: widened as they
// are read, rounded as they are written, the rest float32); G, GOut: of g and dg (In and Out, or T for both: a bfloat16
// model computes its log-decays in float32).
template <typename T, typename Gemm, typename In = T, typename Out = In, typename G = In, typename GOut = Out>
void chunk_backward_seq(int64_t L, int64_t Dk, int64_t Dv, int64_t C, const In* q, const In* k, const In* v,
                        const In* beta, const G* g, const ForwardRecord<T>& kept, const In* dout, T* dS, Out* dq,
                        Out* dk, Out* dv, Out* dbeta, GOut* dg, T* work, const Gemm& policy) {
  const Gemm gemm = on_this_thread(policy);
  const BackwardBuffers<T> w(work, C, Dk, Dv);
  using Products = BackwardProducts<T, Gemm, In>;
  Products mm(gemm, C, Dk, Dv);
  TORCH_CHECK(g == nullptr || beta != nullptr, "fwp_chunk: decays only with the delta rule");
  Decays<T> decays(g != nullptr ? C : 0);
  const DecayGradients<T> decay_gradients{decays, w.dgam};
  const DecayGradients<T>* decay = g != nullptr ? &decay_gradients : nullptr;
  PacedLines* const paced = paced_lines_of(gemm);
  for (int64_t n = (L + C - 1) / C - 1; n >= 0; --n) {
    const int64_t t0 = n * C, c = std::min(C, L - t0);
    mm.begin_chunk();
    if (paced != nullptr) paced->issue_all();  // what the previous chunk asked for and no tile issued
    // this chunk's gradient rows, written during it or at its end (a store that misses waits for its line: by hand,
    // bfloat16, B1 H8 T4096 D64, 1 thread, the backward op 14.5 -> 13.2-14.6 ms, the rows asked for one chunk ahead)
    const RowsAhead rows_written{t0, c, paced};
    rows_written.fetch<true>(dq, Dk);
    rows_written.fetch<true>(dk, Dk);
    rows_written.fetch<true>(dv, Dv);
    // (q, dout and, for the sum rule, V (its U') only where the products read them widened; q and V for the decays)
    constexpr bool kWiden = !Products::kReadsInputsInPlace;
    const ChunkInputs<T> x(t0, c, C, Dk, Dv, kWiden || decay ? q : nullptr, k,
                           (kWiden && beta == nullptr) || decay ? v : nullptr, beta, g, kWiden ? dout : nullptr, w.in);
    const typename Products::Inputs in = mm.inputs(x, q + t0 * Dk, k + t0 * Dk, dout + t0 * Dv, c, w.Kt);
    const ChunkGradients<T, Out, GOut> d(t0, c, C, Dk, Dv, dq, dk, dv, dbeta, dg, w.out);
    // the previous chunk's rows and state (read next) on their way while this one computes, a few at each stage
    const RowsAhead previous = previous_chunk(t0, C, paced);
    previous.fetch(q, Dk);
    previous.fetch(k, Dk);
    if (decay != nullptr) decays.compute(c, x.g);
    // U' (the sum rule: V), as T where the products read it so (nullptr for the bfloat16 products: its rows form only)
    const T* U = beta == nullptr ? x.V : kept.u_new != nullptr ? kept.u_new + t0 * Dv : nullptr;
    const typename Products::Operand Ur = beta != nullptr ? mm.new_values(kept, t0, c) : mm.values(U, v + t0 * Dv, c);
    const typename Products::Operand Ut = mm.transposed(U, c, Dv, Dv, w.Ut, &Ur), Sp = mm.state(kept, n);
    const auto fetch = [&](int stage) {
      if (stage == 1) {
        previous.fetch(dout, Dv);
        if (Products::kKeepsBfloat16) previous.fetch_chunk(kept.entering_pairs, C, state_pairs_size(Dk, Dv));
        if (!Products::kKeepsBfloat16) previous.fetch_chunk(kept.entering, C, Dv * Dk);
        return;
      }
      if (beta == nullptr || decay != nullptr) previous.fetch(v, Dv);  // the sum rule's U', the gated rule's V
      if (beta != nullptr && Products::kKeepsBfloat16) previous.fetch(kept.u_new_rows, round_up(Dv, 2));
      if (beta != nullptr && !Products::kKeepsBfloat16) previous.fetch(kept.u_new, Dv);
    };
    const T state_dot = decay != nullptr ? mm.state_dot(kept, n, dS) : T(0);  // <S, dS'>
    T* dU = beta != nullptr ? w.dR : d.dV;  // dU' (the sum rule's dV)
    output_gradients(c, Dk, Dv, x.Q, x.K, state_dot, dS, dU, d.dQ, d.dK, w, mm, in, Ur, Ut, Sp, decay, fetch);
    // dS = dS' + dO^T Q  (gated: Gamma_c dS' + dO^T diag(Gamma) Q), the delta rule's part, then its last update
    typename Products::Operand Qp = in.Qp;
    T state_decay = 1;  // the gated rule's Gamma_c, as the product's scale of dS'
    if (decay != nullptr) {
      state_decay = decays.Gamma[c - 1];
      decay->gamma_rows(c, Dk, x.Q, w.G);
      Qp = mm.pairs(w.G, c, Dk, Dk);
    }
    if (beta != nullptr) {
      mm(Dv, Dk, c, in.dOp, Qp, T(1), state_decay, dS, Dk);
      previous.fetch(kept.x, Dv);
      delta_rule_chunk_backward(c, Dk, Dv, x.K, x.V, kept.x + t0 * Dv, x.b, w, mm, in, Ut, Sp, dS, d.dK, d.dV, d.db,
                                decay);
    } else {
      mm.update_state_gradient(c, in.dOp, Qp, T(1), dS);
    }
    T acc = 0;  // gamma = cumsum(g): dg_j = sum_{i >= j} dgam_i
    for (int64_t i = c - 1; decay != nullptr && i >= 0; --i) d.dgs[i] = acc += w.dgam[i];
    d.store();
  }
  if (paced != nullptr) paced->clear();
}

// MKL (the BLAS that libtorch_cpu links) would take its threaded path inside a task once torch.set_num_threads has
// switched its dynamic mode off: a nested fork/join per small BLAS call (5 per chunk). Measured, B1 H8 T4096 D64, 2
// threads, while the tasks still ran in one thread (a build without -fopenmp): the forward 3-10x slower than on 1
// thread. Each task asks MKL for one thread on its own thread and restores the setting when it ends. The symbol is
// weak: with another BLAS it is absent and the guard does nothing.
struct SequentialBlasInTask {
  int saved = 0;
  SequentialBlasInTask() { saved = MKL_Set_Num_Threads_Local != nullptr ? MKL_Set_Num_Threads_Local(1) : 0; }
  ~SequentialBlasInTask() { if (MKL_Set_Num_Threads_Local != nullptr) MKL_Set_Num_Threads_Local(saved); }
};

// at::parallel_for over [0, n) with grain 1, each task's BLAS calls single-threaded (above).
template <typename F>
void parallel_tasks(int64_t n, const F& f) {
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    SequentialBlasInTask sequential_blas;
    f(begin, end);
  });
}

// Runs f(begin, end) over the sequences: in parallel (one sequence per task) when there are at least as
// many sequences as threads, else in the calling thread, where the BLAS may use the threads itself (few,
// long sequences with large heads).
template <typename F>
void for_sequences(int64_t BH, const F& f) {
  if (BH >= at::get_num_threads()) {
    parallel_tasks(BH, f);
  } else {
    f(0, BH);
  }
}

// Fewer sequences than threads: the value dimension is cut into blocks of columns, one task per (sequence, block).
// Both rules act on each column of V (row of the state S [Dv, Dk]) on its own given the keys, queries and beta:
// in (I + A) U' = diag(beta) (V - K S^T), O = Q S^T + P U', S' = S + U'^T K, column j of U' and O and row j of
// S read only column j of V and row j of S. Each block recomputes the key-only products (P, A) of its chunks.
// At least 16 columns per block, and only for sequences of at least 64 positions (below that a task is a few
// microseconds, the cost of starting one). 1: no split.
inline int64_t value_blocks(int64_t BH, int64_t L, int64_t Dv) {
  const int64_t threads = at::get_num_threads();
  if (BH >= threads || L < 64) return 1;
  return std::max<int64_t>(1, std::min((threads + BH - 1) / BH, Dv / 16));
}

// Columns [j0, j0 + n) of a row-major x [L, ld] into the contiguous out [L, n], and back (converted to out's type).
template <typename T>
void gather_columns(const T* x, int64_t L, int64_t ld, int64_t j0, int64_t n, T* out) {
  for (int64_t t = 0; t < L; ++t) std::memcpy(out + t * n, x + t * ld + j0, sizeof(T) * n);
}
template <typename T, typename Out>
void scatter_columns(const T* x, int64_t L, int64_t ld, int64_t j0, int64_t n, Out* out) {
  for (int64_t t = 0; t < L; ++t) convert_copy(x + t * n, n, out + t * ld + j0);
}

void check(const at::Tensor& x, const at::Tensor& like, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == like.scalar_type() && x.is_contiguous(), "fwp_chunk: `",
              name, "` must be a contiguous CPU tensor of dtype ", like.scalar_type());
}

// Sizes shared by forward and backward: BH sequences of L positions, heads Dk/Dv, N chunks of C positions.
struct ChunkShapes {
  int64_t BH, L, Dk, Dv, C, N;
};

static ChunkShapes chunk_shapes(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t chunk_size) {
  TORCH_CHECK(q.dim() == 3 && k.sizes() == q.sizes() && v.dim() == 3, "fwp_chunk: q, k, v must be [BH, L, D]");
  const int64_t BH = q.size(0), L = q.size(1), Dk = q.size(2), Dv = v.size(2);
  TORCH_CHECK(chunk_size >= 1, "fwp_chunk: chunk_size must be positive");
  const int64_t C = std::min(chunk_size, std::max<int64_t>(L, 1)), N = (L + C - 1) / C;
  TORCH_CHECK(std::max({L * std::max(Dk, Dv), C * C, Dv * Dk}) < std::numeric_limits<int>::max(),
              "fwp_chunk: sizes exceed the 32-bit BLAS interface");
  return {BH, L, Dk, Dv, C, N};
}

// The forward of value_blocks(BH, L, Dv) = nb > 1 column blocks, one task per (sequence, block): see value_blocks.
template <typename T, typename Gemm, typename In, typename G>
void forward_value_blocks(const ChunkShapes& s, int64_t nb, const In* q, const In* k, const In* v, const In* beta,
                          const G* g, T* S, In* o, const Gemm& gemm) {
  parallel_tasks(s.BH * nb, [&](int64_t begin, int64_t end) {
    Buffer<In> columns;
    Buffer<T> work;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / nb, j = task % nb, j0 = j * s.Dv / nb, n = (j + 1) * s.Dv / nb - j0;
      columns.resize(2 * s.L * n);
      work.resize(chunk_workspace(s.C, s.Dk, n));
      In* vb = columns.data();  // the block's columns of V, then of O   [L, n] each
      In* ob = vb + s.L * n;
      gather_columns(v + bh * s.L * s.Dv, s.L, s.Dv, j0, n, vb);
      chunk_forward_seq<T>(s.L, s.Dk, n, s.C, q + bh * s.L * s.Dk, k + bh * s.L * s.Dk, vb,
                           beta != nullptr ? beta + bh * s.L : nullptr, g != nullptr ? g + bh * s.L : nullptr,
                           S + (bh * s.Dv + j0) * s.Dk, ob, ForwardRecord<T>{}, work.data(), gemm);
      scatter_columns(ob, s.L, s.Dv, j0, n, o + bh * s.L * s.Dv);
    }
  });
}

// The backward in nb > 1 column blocks. dV and the rows of dS split like V and S; dQ, dK, dbeta and (gated rule) dg
// are sums over the value columns (dQ = dO S + dP K, dP = tril(dO U'^T), ...; dg's terms, such as <S, dS'>, alike):
// each block writes its part in T, summed at the end (and then rounded, for bfloat16 gradients).
template <typename T, typename Gemm, typename In, typename G>
void backward_value_blocks(const ChunkShapes& s, int64_t nb, const In* q, const In* k, const In* v, const In* beta,
                           const G* g, const T* s0, const In* dout, T* dS, const at::Tensor& dq, const at::Tensor& dk,
                           In* dv, const std::optional<at::Tensor>& dbeta, const std::optional<at::Tensor>& dg,
                           const Gemm& gemm) {
  const at::TensorOptions in_T = dq.options().dtype(c10::CppTypeToScalarType<T>::value);
  const at::Tensor dq_parts = dq.new_empty({nb, s.BH, s.L, s.Dk}, in_T);
  const at::Tensor dk_parts = dq.new_empty({nb, s.BH, s.L, s.Dk}, in_T);
  const at::Tensor gate_parts = dq.new_empty({2, nb, s.BH, s.L}, in_T);  // dbeta's, then dg's
  T *dqp = dq_parts.data_ptr<T>(), *dkp = dk_parts.data_ptr<T>(), *dbp = gate_parts.data_ptr<T>();
  T* dgp = dbp + nb * s.BH * s.L;
  parallel_tasks(s.BH * nb, [&](int64_t begin, int64_t end) {
    Buffer<In> columns;
    Buffer<T> buf;
    KeptBuffers<T>& keep = thread_kept_buffers<T>();
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / nb, j = task % nb, j0 = j * s.Dv / nb, n = (j + 1) * s.Dv / nb - j0;
      const int64_t work = std::max(chunk_workspace(s.C, s.Dk, n), chunk_backward_workspace(s.C, s.Dk, n));
      columns.resize(2 * s.L * n);
      buf.resize(s.L * n + n * s.Dk + work);
      In* vb = columns.data();  // the block's columns of V and dO      [L, n] each
      In* dob = vb + s.L * n;
      T* dvb = buf.data();      // the block's columns of dV            [L, n]
      T* state = dvb + s.L * n;  // its rows of the state                [n, Dk]
      const ForwardRecord<T> kept = keep.record(s.L, s.N, s.Dk, n, beta != nullptr,
                                                BackwardProducts<T, Gemm, In>::kKeepsBfloat16);
      gather_columns(v + bh * s.L * s.Dv, s.L, s.Dv, j0, n, vb);
      gather_columns(dout + bh * s.L * s.Dv, s.L, s.Dv, j0, n, dob);
      std::memcpy(state, s0 + (bh * s.Dv + j0) * s.Dk, sizeof(T) * n * s.Dk);
      const In* qs = q + bh * s.L * s.Dk;
      const In* ks = k + bh * s.L * s.Dk;
      const In* bs = beta != nullptr ? beta + bh * s.L : nullptr;
      const G* gs = g != nullptr ? g + bh * s.L : nullptr;
      chunk_forward_seq<T>(s.L, s.Dk, n, s.C, qs, ks, vb, bs, gs, state, nullptr, kept, state + n * s.Dk, gemm);
      const int64_t part = j * s.BH + bh;
      chunk_backward_seq<T, Gemm, In, T>(s.L, s.Dk, n, s.C, qs, ks, vb, bs, gs, kept, dob,
                                         dS + (bh * s.Dv + j0) * s.Dk, dqp + part * s.L * s.Dk,
                                         dkp + part * s.L * s.Dk, dvb, dbp + part * s.L, dgp + part * s.L,
                                         state + n * s.Dk, gemm);
      scatter_columns(dvb, s.L, s.Dv, j0, n, dv + bh * s.L * s.Dv);
    }
    keep.release_over(kKeptBytesKept);
  });
  dq.copy_(dq_parts.sum(0));
  dk.copy_(dk_parts.sum(0));
  if (dbeta.has_value()) dbeta->copy_(gate_parts[0].sum(0).view_as(*dbeta));
  if (dg.has_value()) dg->copy_(gate_parts[1].sum(0).view_as(*dg));
}

// The forward of every sequence (chunk_forward and the gated rule's forward; g nullptr without decay): one task per
// sequence, or per (sequence, value block) for fewer sequences than threads (value_blocks). entering [BH, N, Dv, Dk]
// and u_new [BH, L, Dv] are kept where given (the backward's own call, which splits by itself: no value blocks).
template <typename T, typename Gemm, typename In, typename G>
void forward_sequences(const ChunkShapes& s, const In* q, const In* k, const In* v, const In* beta, const G* g,
                       T* S, In* o, T* entering, T* u_new, const Gemm& gemm) {
  const int64_t nb = o != nullptr && entering == nullptr && u_new == nullptr ? value_blocks(s.BH, s.L, s.Dv) : 1;
  if (nb > 1) return forward_value_blocks<T>(s, nb, q, k, v, beta, g, S, o, gemm);
  const int64_t L = s.L, Dk = s.Dk, Dv = s.Dv;
  for_sequences(s.BH, [&](int64_t begin, int64_t end) {
    Buffer<T> work(chunk_workspace(s.C, Dk, Dv));
    for (int64_t bh = begin; bh < end; ++bh) {
      const ForwardRecord<T> record{entering != nullptr ? entering + bh * s.N * Dv * Dk : nullptr,
                                    u_new != nullptr ? u_new + bh * L * Dv : nullptr};
      chunk_forward_seq<T>(L, Dk, Dv, s.C, q + bh * L * Dk, k + bh * L * Dk, v + bh * L * Dv,
                           beta != nullptr ? beta + bh * L : nullptr, g != nullptr ? g + bh * L : nullptr,
                           S + bh * Dv * Dk, o != nullptr ? o + bh * L * Dv : nullptr, record, work.data(), gemm);
    }
  });
}

// q, k [BH, L, Dk], v [BH, L, Dv], beta [BH, L] or None (sum rule); S [BH, Dv, Dk]: initial state in,
// final state out; o [BH, L, Dv] optional (not computed when None); entering [BH, N, Dv, Dk] and u_new [BH, L, Dv]
// optional. bfloat16 q, k, v, beta and o take a float32 S (and no entering / u_new): converted as they are read and
// written. `products`: how the products are computed (a Products value; product_kinds() lists this build's).
void chunk_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const std::optional<at::Tensor>& beta, const at::Tensor& S, int64_t chunk_size,
                   const std::optional<at::Tensor>& o, const std::optional<at::Tensor>& entering,
                   const std::optional<at::Tensor>& u_new, int64_t products) {
  const ChunkShapes shapes = chunk_shapes(q, k, v, chunk_size);
  const int64_t BH = shapes.BH, L = shapes.L, Dk = shapes.Dk, Dv = shapes.Dv, N = shapes.N;
  const bool bf16 = q.scalar_type() == at::kBFloat16;
  for (auto* x : {&k, &v}) check(*x, q, "input");
  TORCH_CHECK(S.device().is_cpu() && S.is_contiguous() && S.scalar_type() == at::toOpMathType(q.scalar_type()),
              "fwp_chunk: S must be a contiguous CPU tensor of q's dtype (float32 for bfloat16 q)");
  TORCH_CHECK(v.size(0) == BH && v.size(1) == L && S.size(0) == BH && S.size(1) == Dv && S.size(2) == Dk,
              "fwp_chunk: inconsistent shapes");
  if (o.has_value()) {
    check(*o, q, "o");
    TORCH_CHECK(o->sizes() == v.sizes(), "fwp_chunk: o must be [BH, L, Dv]");
  }
  if (beta.has_value()) {
    check(*beta, q, "beta");
    TORCH_CHECK(beta->numel() == BH * L, "fwp_chunk: beta must be [BH, L]");
  }
  TORCH_CHECK(!bf16 || (!entering.has_value() && !u_new.has_value()), "fwp_chunk: bfloat16 keeps no entering / u_new");
  if (entering.has_value()) {
    check(*entering, q, "entering");
    TORCH_CHECK(entering->numel() == BH * N * Dv * Dk, "fwp_chunk: entering must be [BH, N, Dv, Dk]");
  }
  if (u_new.has_value()) {
    check(*u_new, q, "u_new");
    TORCH_CHECK(u_new->numel() == BH * L * Dv, "fwp_chunk: u_new must be [BH, L, Dv]");
  }
  dispatch_products(q.scalar_type(), products, [&](auto in, const auto& gemm) {
    using In = decltype(in);
    using T = at::opmath_type<In>;
    forward_sequences<T>(shapes, q.data_ptr<In>(), k.data_ptr<In>(), v.data_ptr<In>(), optional_data<In>(beta),
                         (const In*)nullptr, S.data_ptr<T>(), optional_data<In>(o), optional_data<T>(entering),
                         optional_data<T>(u_new), gemm);
  });
}

// The backward of sequences [begin, end) one after another (chunk_backward without value blocks, and the gated rule's
// backward: g and dg given): the states entering the chunks and U' recomputed per sequence into the thread's buffers.
template <typename T, typename Gemm, typename In, typename G>
void backward_sequences(const ChunkShapes& s, int64_t begin, int64_t end, const In* q, const In* k, const In* v,
                        const In* beta, const G* g, const T* s0, const In* dout, T* dS, In* dq, In* dk, In* dv,
                        In* dbeta, G* dg, const Gemm& gemm) {
  const int64_t L = s.L, Dk = s.Dk, Dv = s.Dv;
  Buffer<T> work(std::max(chunk_workspace(s.C, Dk, Dv), chunk_backward_workspace(s.C, Dk, Dv)));
  Buffer<T> state(Dv * Dk);
  KeptBuffers<T>& keep = thread_kept_buffers<T>();
  const ForwardRecord<T> kept =
      keep.record(L, s.N, Dk, Dv, beta != nullptr, BackwardProducts<T, Gemm, In>::kKeepsBfloat16);
  for (int64_t bh = begin; bh < end; ++bh) {
    const In *qs = q + bh * L * Dk, *ks = k + bh * L * Dk, *vs = v + bh * L * Dv;
    const In* bs = beta != nullptr ? beta + bh * L : nullptr;
    const G* gs = g != nullptr ? g + bh * L : nullptr;
    std::memcpy(state.data(), s0 + bh * Dv * Dk, sizeof(T) * Dv * Dk);
    chunk_forward_seq<T>(L, Dk, Dv, s.C, qs, ks, vs, bs, gs, state.data(), nullptr, kept, work.data(), gemm);
    chunk_backward_seq<T>(L, Dk, Dv, s.C, qs, ks, vs, bs, gs, kept, dout + bh * L * Dv, dS + bh * Dv * Dk,
                          dq + bh * L * Dk, dk + bh * L * Dk, dv + bh * L * Dv,
                          bs != nullptr ? dbeta + bh * L : nullptr, gs != nullptr ? dg + bh * L : nullptr, work.data(),
                          gemm);
  }
  keep.release_over(kKeptBytesKept);
}

// The backward of every sequence (chunk_backward, and the gated rule's backward: g and dg given): in value blocks for
// fewer sequences than threads (value_blocks), else one task per sequence.
void backward_all(const ChunkShapes& shapes, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const std::optional<at::Tensor>& beta, const std::optional<at::Tensor>& g, const at::Tensor& s0,
                  const at::Tensor& dout, const at::Tensor& dS, const at::Tensor& dq, const at::Tensor& dk,
                  const at::Tensor& dv, const std::optional<at::Tensor>& dbeta, const std::optional<at::Tensor>& dg,
                  int64_t products) {
  const int64_t nb = value_blocks(shapes.BH, shapes.L, shapes.Dv);
  dispatch_products(q.scalar_type(), products, [&](auto in, const auto& gemm) {
    using In = decltype(in);
    using T = at::opmath_type<In>;
    const In *q_p = q.data_ptr<In>(), *k_p = k.data_ptr<In>(), *v_p = v.data_ptr<In>(), *dout_p = dout.data_ptr<In>();
    const In* beta_p = optional_data<In>(beta);
    with_decays<In, T>(g, [&](auto* g_p) {
      using G = std::remove_pointer_t<decltype(g_p)>;
      if (nb > 1) {
        return backward_value_blocks<T>(shapes, nb, q_p, k_p, v_p, beta_p, (const G*)g_p, s0.data_ptr<T>(), dout_p,
                                        dS.data_ptr<T>(), dq, dk, dv.data_ptr<In>(), dbeta, dg, gemm);
      }
      for_sequences(shapes.BH, [&](int64_t begin, int64_t end) {
        backward_sequences<T>(shapes, begin, end, q_p, k_p, v_p, beta_p, (const G*)g_p, s0.data_ptr<T>(), dout_p,
                              dS.data_ptr<T>(), dq.data_ptr<In>(), dk.data_ptr<In>(), dv.data_ptr<In>(),
                              optional_data<In>(dbeta), optional_data<G>(dg), gemm);
      });
    });
  });
}

// Gradients of chunk_forward. dS [BH, Dv, Dk]: the final state's gradient in, the initial state's out.
// dq, dk [BH, L, Dk], dv [BH, L, Dv], dbeta [BH, L] (delta rule) are written. The states entering the
// chunks and U' are recomputed per sequence (one state per chunk, in a per-thread buffer). bfloat16 q, k, v, beta
// and dout take a float32 s0 and dS and write bfloat16 gradients: widened as they are read, rounded as they are
// written (the sums, states and products float32).
void chunk_backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const std::optional<at::Tensor>& beta, const at::Tensor& s0, int64_t chunk_size,
                    const at::Tensor& dout, const at::Tensor& dS, const at::Tensor& dq, const at::Tensor& dk,
                    const at::Tensor& dv, const std::optional<at::Tensor>& dbeta, int64_t products) {
  const ChunkShapes shapes = chunk_shapes(q, k, v, chunk_size);
  const int64_t BH = shapes.BH, L = shapes.L, Dk = shapes.Dk, Dv = shapes.Dv;
  for (auto* x : {&k, &v, &dout, &dq, &dk, &dv}) check(*x, q, "input");
  for (auto* x : {&s0, &dS})
    TORCH_CHECK(x->device().is_cpu() && x->is_contiguous() && x->scalar_type() == at::toOpMathType(q.scalar_type()),
                "fwp_chunk: s0 and dS must be contiguous CPU tensors of q's dtype (float32 for bfloat16 q)");
  TORCH_CHECK(v.size(0) == BH && v.size(1) == L && s0.numel() == BH * Dv * Dk && dS.numel() == BH * Dv * Dk &&
                  dout.sizes() == v.sizes() && dv.sizes() == v.sizes() && dq.sizes() == q.sizes() &&
                  dk.sizes() == q.sizes(),
              "fwp_chunk: inconsistent shapes");
  TORCH_CHECK(beta.has_value() == dbeta.has_value(), "fwp_chunk: beta and dbeta go together");
  if (beta.has_value()) {
    check(*beta, q, "beta");
    check(*dbeta, q, "dbeta");
    TORCH_CHECK(beta->numel() == BH * L && dbeta->numel() == BH * L, "fwp_chunk: beta must be [BH, L]");
  }
  backward_all(shapes, q, k, v, beta, std::nullopt, s0, dout, dS, dq, dk, dv, dbeta, std::nullopt, products);
}

// The decode step and the token step below keep GCC's own preference of 256-bit vectors for the loops it vectorises:
// the package builds this file with -mprefer-vector-width=512 (kernels/chunk.py, CHUNK_KERNEL_CFLAGS: the chunk loops
// 2-12% faster), under which this decode step of 24 layers of B1 H16 D128 states ran 0.92-0.96x as fast and its
// sums added in another order (side by side, bench_chunk_builds.py --base_cflags, 2026-12-02, Intel Xeon with AMX).
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("prefer-vector-width=256")
#define FWP_DECODE_VECTOR_WIDTH_PUSHED 1
#endif

// One position for every sequence (decoding), each row of the state read and written once. Row i of S [Dv, Dk]
// (value i) with the key k, query q, and the decay a = exp(g) of the gated delta rule (a = 1 without g):
//   delta rule (eqs. 20, 24, 25):  d_i = beta (v_i - a S_i k),  S'_i = a S_i + d_i k^T,
//                                  o_i = S'_i q = a S_i q + d_i (k q)
//   sum rule (eqs. 10-11):          d_i = v_i
// q, k [BH, Dk], v [BH, Dv], beta [BH] or None (sum rule), g [BH] or None, S [BH, Dv, Dk] or None (zeros); writes
// S_out (may be S) and o [BH, Dv]. Rows in parallel over threads; four rows of one head at a time, so that the dot
// products have eight independent sums (one row's two sums leave the vector unit waiting on the adds: 1.7x slower,
// measured).

// States of at least this many bytes are written around the caches (non-temporal stores): a state this large does not
// stay in a core's L2 anyway, and in decoding the next token reads it after every weight of the model has streamed
// through the caches (a state of 1 MB per layer is a model of 2,048 hidden units). Side by side on the Zen 4 EPYC,
// 2026-11-29: 24 layers of B1 H16 D128 states, 200 MB read between tokens, 4.24 -> 2.13 ms per token at 1 thread,
// 2.40 -> 1.53 at 2 (each state bit for bit the same); the stores no longer read the new state's lines first. With AVX2
// (Zen 3, 2026-12-02, the same 24 layers after 200 MB read; bench_chunk_builds_zen3_stream.json): 11.21 -> 10.80 ms at
// 1 thread, 8.39 -> 7.66 at 2 (medians of 30 tokens; states bit for bit the same).
constexpr int64_t kStreamStateBytes = int64_t(1) << 20;

// out [n] = a x + d k (x: a row of the state or nullptr for zeros; k: the key), with non-temporal stores when `stream`
// (float32, `out` 64-byte aligned, n a multiple of 16 with AVX-512, of 8 with AVX2 + FMA). Every path rounds alike:
// d k rounded, then one fused multiply-add (what GCC had contracted the loop's a x + d k to; spelled out, so that no
// compiler differs).
template <typename T>
inline void scaled_row_plus(int64_t n, T a, const T* x, T d, const T* k, T* out, bool stream) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) {
    if (stream && x != nullptr && n % 16 == 0 && (reinterpret_cast<uintptr_t>(out) & 63) == 0) {
      const __m512 va = _mm512_set1_ps(a), vd = _mm512_set1_ps(d);
      for (int64_t j = 0; j < n; j += 16) {
        const __m512 dk = _mm512_mul_ps(vd, _mm512_loadu_ps(k + j));
        _mm512_stream_ps(out + j, _mm512_fmadd_ps(va, _mm512_loadu_ps(x + j), dk));
      }
      return;
    }
  }
#elif defined(__AVX2__) && defined(__FMA__)
  if constexpr (std::is_same_v<T, float>) {
    if (stream && x != nullptr && n % 8 == 0 && (reinterpret_cast<uintptr_t>(out) & 63) == 0) {
      const __m256 va = _mm256_set1_ps(a), vd = _mm256_set1_ps(d);
      for (int64_t j = 0; j < n; j += 8) {
        const __m256 dk = _mm256_mul_ps(vd, _mm256_loadu_ps(k + j));
        _mm256_stream_ps(out + j, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + j), dk));
      }
      return;
    }
  }
#endif
  if (x != nullptr) {
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) out[j] = std::fma(a, x[j], d * k[j]);
  } else {
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) out[j] = d * k[j];
  }
}

template <typename T>
inline void decode_four_rows(int64_t Dk, const T* Si, const T* kk, const T* qq, const T* v, const T* beta, T a,
                             T kq, T* So, T* o, bool stream) {
  T sk0 = 0, sk1 = 0, sk2 = 0, sk3 = 0, sq0 = 0, sq1 = 0, sq2 = 0, sq3 = 0;
  if (Si != nullptr) {
    const T *S0 = Si, *S1 = Si + Dk, *S2 = Si + 2 * Dk, *S3 = Si + 3 * Dk;
#pragma omp simd reduction(+ : sk0, sk1, sk2, sk3, sq0, sq1, sq2, sq3)
    for (int64_t j = 0; j < Dk; ++j) {
      sk0 += S0[j] * kk[j];
      sk1 += S1[j] * kk[j];
      sk2 += S2[j] * kk[j];
      sk3 += S3[j] * kk[j];
      sq0 += S0[j] * qq[j];
      sq1 += S1[j] * qq[j];
      sq2 += S2[j] * qq[j];
      sq3 += S3[j] * qq[j];
    }
  }
  const T sk[4] = {sk0, sk1, sk2, sk3}, sq[4] = {sq0, sq1, sq2, sq3};
  for (int r = 0; r < 4; ++r) {
    const T d = beta != nullptr ? *beta * (v[r] - a * sk[r]) : v[r];
    scaled_row_plus<T>(Dk, a, Si != nullptr ? Si + r * Dk : nullptr, d, kk, So + r * Dk, stream);
    o[r] = a * sq[r] + d * kq;
  }
}

// Rows r0..r1 of the states (decode_step); `stream`: S_out written with non-temporal stores (kStreamStateBytes).
template <typename T>
void decode_rows(int64_t r0, int64_t r1, int64_t Dv, int64_t Dk, const T* q, const T* k, const T* v, const T* beta,
                 const T* g, const T* S, T* S_out, T* o, bool stream) {
  for (int64_t r = r0; r < r1;) {
    const int64_t bh = r / Dv;
    const T* kk = k + bh * Dk;
    const T* qq = q + bh * Dk;
    const T* bb = beta != nullptr ? beta + bh : nullptr;
    const T a = g != nullptr ? std::exp(g[bh]) : T(1);
    T kq = 0;
#pragma omp simd reduction(+ : kq)
    for (int64_t j = 0; j < Dk; ++j) kq += kk[j] * qq[j];
    const int64_t head_end = std::min(r1, (bh + 1) * Dv);
    for (; r + 4 <= head_end; r += 4)
      decode_four_rows<T>(Dk, S != nullptr ? S + r * Dk : nullptr, kk, qq, v + r, bb, a, kq, S_out + r * Dk, o + r,
                          stream);
    for (; r < head_end; ++r) {  // the last rows of a task (fewer than four)
      T sk = 0, sq = 0;
      if (S != nullptr) {
        const T* Si = S + r * Dk;
#pragma omp simd reduction(+ : sk, sq)
        for (int64_t j = 0; j < Dk; ++j) {
          sk += Si[j] * kk[j];
          sq += Si[j] * qq[j];
        }
      }
      const T d = bb != nullptr ? *bb * (v[r] - a * sk) : v[r];
      scaled_row_plus<T>(Dk, a, S != nullptr ? S + r * Dk : nullptr, d, kk, S_out + r * Dk, stream);
      o[r] = a * sq + d * kq;
    }
  }
#ifdef FWP_VECTOR_PRODUCTS
  if (stream) _mm_sfence();  // the non-temporal stores visible before the task ends
#endif
}

// Whether decode_rows writes states S_out [BH, Dv, Dk] of T around the caches.
template <typename T>
inline bool stream_states(int64_t BH, int64_t Dv, int64_t Dk) {
  return BH * Dv * Dk * int64_t(sizeof(T)) >= kStreamStateBytes;
}

std::optional<at::Tensor> widened(const std::optional<at::Tensor>& x) {
  return x.has_value() ? std::optional<at::Tensor>(x->to(at::kFloat)) : std::nullopt;
}

// q, k, v, beta, g and o in one dtype: float32 or float64 with the states S, S_out in it too, or bfloat16 with float32
// states (the inputs, a few KB, widened here and o rounded once: five fewer small ops for the caller).
void decode_step(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& beta,
                 const std::optional<at::Tensor>& g, const std::optional<at::Tensor>& S, const at::Tensor& S_out,
                 const at::Tensor& o) {
  if (q.scalar_type() == at::kBFloat16) {
    for (auto* x : {&k, &v, &o}) check(*x, q, "input");
    const at::Tensor o_acc = o.new_empty(o.sizes(), o.options().dtype(at::kFloat));
    decode_step(q.to(at::kFloat), k.to(at::kFloat), v.to(at::kFloat), widened(beta), widened(g), S, S_out, o_acc);
    o.copy_(o_acc);
    return;
  }
  TORCH_CHECK(q.dim() == 2 && k.sizes() == q.sizes() && v.dim() == 2 && v.size(0) == q.size(0),
              "fwp_chunk.decode_step: q, k must be [BH, Dk] and v [BH, Dv]");
  const int64_t BH = q.size(0), Dk = q.size(1), Dv = v.size(1);
  for (auto* x : {&k, &v, &S_out, &o}) check(*x, q, "input");
  TORCH_CHECK(S_out.numel() == BH * Dv * Dk && o.numel() == BH * Dv, "fwp_chunk.decode_step: inconsistent shapes");
  if (S.has_value()) {
    check(*S, q, "S");
    TORCH_CHECK(S->numel() == BH * Dv * Dk, "fwp_chunk.decode_step: S must be [BH, Dv, Dk]");
  }
  if (beta.has_value()) {
    check(*beta, q, "beta");
    TORCH_CHECK(beta->numel() == BH, "fwp_chunk.decode_step: beta must be [BH]");
  }
  if (g.has_value()) {
    check(*g, q, "g");
    TORCH_CHECK(g->numel() == BH && beta.has_value(), "fwp_chunk.decode_step: g must be [BH], with beta");
  }
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "decode_step", [&] {
    const scalar_t* Sp = S.has_value() ? S->data_ptr<scalar_t>() : nullptr;
    const scalar_t* bp = beta.has_value() ? beta->data_ptr<scalar_t>() : nullptr;
    const scalar_t* gp = g.has_value() ? g->data_ptr<scalar_t>() : nullptr;
    // about 16K state elements per task: a task's rows stay in L1/L2, small states run in the calling thread
    at::parallel_for(0, BH * Dv, std::max<int64_t>(1, 16384 / std::max<int64_t>(Dk, 1)), [&](int64_t r0, int64_t r1) {
      decode_rows<scalar_t>(r0, r1, Dv, Dk, q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
                            bp, gp, Sp, S_out.data_ptr<scalar_t>(), o.data_ptr<scalar_t>(),
                            stream_states<scalar_t>(BH, Dv, Dk));
    });
  });
}

// ---------------------------------------------------------------------------------------------------------------
// One position of a whole Delta Net / Gated DeltaNet layer between its projections and its output projection, in
// one call (modeling_fwp's FastWeightLinearAttention for a decode step on CPU, ``fast_weight_token_step`` in
// kernels/token_step.py): a decode step's dozen small ops per layer (convolutions, activations, L2 norms, beta, the
// decay, the state update above, the output norm and gate) each cost more in dispatch than in arithmetic. Per
// sequence b, from the projections q, k [H * Dk], v [Hv * Dv]:
//   q, k, v <- the short causal convolution's step (when there is one), conv_* states shifted by one position
//   q, k <- phi(q), phi(k) (identity, SiLU, ReLU or ELU + 1), per head / max(sum phi, 1e-6) (sum_normalization,
//           eq. 29);   v <- SiLU(v) (value_silu)
//   q, k <- x / sqrt(|x|^2 + eps) per head (l2_eps >= 0);   q <- q * query_scale (query_scale > 0)
//   beta = beta_scale * sigmoid(beta logits) (Schlag et al. 2021 eq. 21; none: the sum rule)
//   g = -exp(A_log) softplus(decay logits + dt_bias) (the gated delta rule's log-decay; none: a = 1)
//   S', o: decode_rows above (eqs. 20-25), value head j reading query / key head j / (Hv / H)
//   o <- RMSNorm(o) * weight per head (norm_weight given);   o <- o * act(gate) (gate given: SiLU or sigmoid)
// Each value is rounded to the inputs' dtype (float32 or bfloat16) wherever the unfused ops store one, so bfloat16
// follows them step by step; sums in float32, the state float32.
namespace token {

enum FeatureMap : int64_t { kIdentity = 0, kSilu = 1, kRelu = 2, kElu = 3 };
enum GateActivation : int64_t { kGateSilu = 1, kGateSigmoid = 2 };

template <typename T>
inline float rounded(float x) {
  return static_cast<float>(static_cast<T>(x));
}
inline float silu(float x) { return x / (1.0f + std::exp(-x)); }
inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }
inline float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }  // torch's threshold 20

// What the op reads and writes, as raw pointers (nullptr: the option is off), and its options.
template <typename T>
struct Layer {
  int64_t B, H, Hv, Dk, Dv, K;  // K: the convolution's width (0: none)
  const T *q, *k, *v, *beta_logits, *decay_logits, *gate;
  const float *A_log, *dt_bias, *norm_weight;
  const T* conv_weights[3];
  const T* conv_states[3];
  T* new_conv_states[3];
  const float* S;
  float* S_out;
  T* out;
  int64_t feature_map, gate_activation;
  bool sum_normalization, value_silu;
  float l2_eps, query_scale, beta_scale, norm_eps;
};

// One input x [C] of sequence b through the convolution's step (y = sum_i w_i [state, x]_i, in order, as
// short_conv_step), rounded; the state shifted. Without a convolution, x as it is.
template <typename T>
void convolve(const Layer<T>& L, int which, int64_t b, int64_t C, const T* x, float* y) {
  if (L.K == 0) {
    for (int64_t c = 0; c < C; ++c) y[c] = static_cast<float>(x[c]);
    return;
  }
  const int64_t W = L.K - 1;
  for (int64_t c = 0; c < C; ++c) {
    const T* before = L.conv_states[which] + (b * C + c) * W;
    const T* w = L.conv_weights[which] + c * L.K;
    float s = 0;
    for (int64_t i = 0; i < W; ++i) s += static_cast<float>(before[i]) * static_cast<float>(w[i]);
    s += static_cast<float>(x[c]) * static_cast<float>(w[W]);
    y[c] = rounded<T>(s);
    T* after = L.new_conv_states[which] + (b * C + c) * W;
    for (int64_t i = 0; i + 1 < W; ++i) after[i] = before[i + 1];
    after[W - 1] = x[c];
  }
}

template <typename T>
float feature(const Layer<T>& L, float x) {
  switch (L.feature_map) {
    case kSilu: return rounded<T>(silu(x));
    case kRelu: return x > 0 ? x : 0.0f;
    case kElu: return rounded<T>(rounded<T>(x > 0 ? x : std::expm1(x)) + 1.0f);  // F.elu(x) + 1.0: two roundings
    default: return x;
  }
}

// x [D] <- x / sqrt(sum(x^2) + eps) (normalize_rows' arithmetic), times gain [D] if given, rounded.
template <typename T>
void normalize(int64_t D, float* x, const float* gain, float eps, bool mean_square) {
  float squares = 0;
#pragma omp simd reduction(+ : squares)
  for (int64_t j = 0; j < D; ++j) squares += x[j] * x[j];
  const float scale = 1 / std::sqrt((mean_square ? squares / D : squares) + eps);
  for (int64_t j = 0; j < D; ++j) x[j] = rounded<T>(gain ? x[j] * scale * gain[j] : x[j] * scale);
}

// Sequence b's query or key heads (which = 0, 1), feature-mapped, normalised and scaled, into out [Hv, Dk] (each
// value head its query / key head's copy); `scratch` [H * Dk].
template <typename T>
void query_or_key(const Layer<T>& L, int which, int64_t b, float* scratch, float* out) {
  const int64_t C = L.H * L.Dk;
  convolve(L, which, b, C, (which == 0 ? L.q : L.k) + b * C, scratch);
  for (int64_t c = 0; c < C; ++c) scratch[c] = feature(L, scratch[c]);
  for (int64_t h = 0; h < L.H; ++h) {
    float* head = scratch + h * L.Dk;
    if (L.sum_normalization) {  // phi / phi.sum(-1).clamp_min(1e-6), the sum rounded as torch's
      float sum = 0;
      for (int64_t j = 0; j < L.Dk; ++j) sum += head[j];
      const float divisor = rounded<T>(std::max(rounded<T>(sum), 1e-6f));
      for (int64_t j = 0; j < L.Dk; ++j) head[j] = rounded<T>(head[j] / divisor);
    }
    if (L.l2_eps >= 0) normalize<T>(L.Dk, head, nullptr, L.l2_eps, false);
    if (which == 0 && L.query_scale > 0) {
      for (int64_t j = 0; j < L.Dk; ++j) head[j] = rounded<T>(head[j] * L.query_scale);
    }
  }
  const int64_t group = L.Hv / L.H;
  for (int64_t j = 0; j < L.Hv; ++j) std::memcpy(out + j * L.Dk, scratch + (j / group) * L.Dk, sizeof(float) * L.Dk);
}

// Sequence b's values [Hv * Dv], beta [Hv] and log-decay [Hv] (nullptr where off).
template <typename T>
void values_and_gates(const Layer<T>& L, int64_t b, float* v, float* beta, float* g) {
  const int64_t C = L.Hv * L.Dv;
  convolve(L, 2, b, C, L.v + b * C, v);
  if (L.value_silu) {
    for (int64_t c = 0; c < C; ++c) v[c] = rounded<T>(silu(v[c]));
  }
  for (int64_t j = 0; j < L.Hv; ++j) {
    if (beta != nullptr) beta[j] = rounded<T>(sigmoid(static_cast<float>(L.beta_logits[b * L.Hv + j]))) * L.beta_scale;
    if (g != nullptr) {
      const float pre = static_cast<float>(L.decay_logits[b * L.Hv + j]) + L.dt_bias[j];
      g[j] = -std::exp(L.A_log[j]) * softplus(pre);
    }
  }
}

// Sequence b's outputs o [Hv * Dv] (float32 from decode_rows) rounded, normalised and gated into out.
template <typename T>
void outputs(const Layer<T>& L, int64_t b, float* o) {
  const int64_t C = L.Hv * L.Dv;
  for (int64_t c = 0; c < C; ++c) o[c] = rounded<T>(o[c]);
  if (L.norm_weight != nullptr) {
    for (int64_t j = 0; j < L.Hv; ++j) normalize<T>(L.Dv, o + j * L.Dv, L.norm_weight, L.norm_eps, true);
  }
  T* out = L.out + b * C;
  for (int64_t c = 0; c < C; ++c) {
    float y = o[c];
    if (L.gate != nullptr) {
      const float x = static_cast<float>(L.gate[b * C + c]);
      y = rounded<T>(y * rounded<T>(L.gate_activation == kGateSigmoid ? sigmoid(x) : silu(x)));
    }
    out[c] = static_cast<T>(y);
  }
}

template <typename T>
void run(const Layer<T>& L) {
  const int64_t BH = L.B * L.Hv;
  std::vector<float> q(BH * L.Dk), k(BH * L.Dk), v(BH * L.Dv), o(BH * L.Dv), scratch(L.H * L.Dk);
  std::vector<float> beta(L.beta_logits ? BH : 0), g(L.decay_logits ? BH : 0);
  for (int64_t b = 0; b < L.B; ++b) {
    query_or_key(L, 0, b, scratch.data(), q.data() + b * L.Hv * L.Dk);
    query_or_key(L, 1, b, scratch.data(), k.data() + b * L.Hv * L.Dk);
    values_and_gates(L, b, v.data() + b * L.Hv * L.Dv, L.beta_logits ? beta.data() + b * L.Hv : nullptr,
                     L.decay_logits ? g.data() + b * L.Hv : nullptr);
  }
  const float* bp = L.beta_logits ? beta.data() : nullptr;
  const float* gp = L.decay_logits ? g.data() : nullptr;
  at::parallel_for(0, BH * L.Dv, std::max<int64_t>(1, 16384 / std::max<int64_t>(L.Dk, 1)), [&](int64_t r0, int64_t r1) {
    decode_rows<float>(r0, r1, L.Dv, L.Dk, q.data(), k.data(), v.data(), bp, gp, L.S, L.S_out, o.data(),
                       stream_states<float>(BH, L.Dv, L.Dk));
  });
  for (int64_t b = 0; b < L.B; ++b) outputs(L, b, o.data() + b * L.Hv * L.Dv);
}

template <typename T>
const T* data_or_null(const std::optional<at::Tensor>& x) {
  return x.has_value() ? x->data_ptr<T>() : nullptr;
}

// `x` (when given) a contiguous CPU tensor of dtype `dtype` with `numel` elements.
void check_optional(const std::optional<at::Tensor>& x, at::ScalarType dtype, int64_t numel, const char* name) {
  TORCH_CHECK(!x.has_value() || (x->device().is_cpu() && x->scalar_type() == dtype && x->is_contiguous() &&
                                 x->numel() == numel),
              "fwp_chunk.token_step: `", name, "` must be a contiguous CPU tensor of dtype ", dtype, " with ", numel,
              " elements");
}

// The three convolutions' weights [C, K] and states [B, C, K - 1] (C = H * Dk for q, k, Hv * Dv for v), or none;
// returns K (0: none).
int64_t check_convolutions(at::TensorList weights, at::TensorList states, at::TensorList new_states,
                           const at::Tensor& q, int64_t key_channels, int64_t value_channels) {
  TORCH_CHECK((weights.empty() || weights.size() == 3) && states.size() == weights.size() &&
                  new_states.size() == weights.size(), "fwp_chunk.token_step: three convolutions or none");
  const int64_t K = weights.empty() ? 0 : weights[0].size(-1);
  for (size_t i = 0; i < weights.size(); ++i) {
    const int64_t C = i < 2 ? key_channels : value_channels;
    for (const at::Tensor* x : {&weights[i], &states[i], &new_states[i]}) check(*x, q, "conv");
    TORCH_CHECK(K >= 2 && weights[i].sizes() == at::IntArrayRef({C, K}) &&
                    states[i].sizes() == at::IntArrayRef({q.size(0), C, K - 1}) &&
                    new_states[i].sizes() == states[i].sizes(),
                "fwp_chunk.token_step: conv weights must be [C, K] and conv states [B, C, K - 1]");
  }
  return K;
}

// The op (schema below): q, k [B, H * Dk], v [B, Hv * Dv], beta_logits / decay_logits [B, Hv], gate [B, Hv * Dv] and
// the convolutions in one dtype (float32 or bfloat16); A_log, dt_bias [Hv], norm_weight [Dv] (any float dtype); S
// (None: zeros) and S_out float32 [B, Hv, Dv, Dk]; out [B, Hv * Dv]. l2_eps < 0: no L2 norm; query_scale 0: no scaling.
void token_step(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                const std::optional<at::Tensor>& beta_logits, const std::optional<at::Tensor>& decay_logits,
                const std::optional<at::Tensor>& A_log, const std::optional<at::Tensor>& dt_bias,
                const std::optional<at::Tensor>& gate, at::TensorList conv_weights, at::TensorList conv_states,
                const std::optional<at::Tensor>& S, const std::optional<at::Tensor>& norm_weight, int64_t num_heads,
                int64_t feature_map, bool sum_normalization, bool value_silu, double l2_eps, double query_scale,
                double beta_scale, double norm_eps, int64_t gate_activation, at::TensorList new_conv_states,
                const at::Tensor& S_out, const at::Tensor& out) {
  TORCH_CHECK((q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16) && q.dim() == 2 && v.dim() == 2 &&
                  num_heads > 0 && q.size(1) % num_heads == 0 && S_out.dim() == 4,
              "fwp_chunk.token_step: q, k [B, H * Dk], v [B, Hv * Dv] in float32 or bfloat16, S_out [B, Hv, Dv, Dk]");
  const int64_t B = q.size(0), H = num_heads, Dk = q.size(1) / H, Hv = S_out.size(1), Dv = S_out.size(2);
  TORCH_CHECK(k.sizes() == q.sizes() && v.size(0) == B && Hv % H == 0 && Hv * Dv == v.size(1) &&
                  S_out.sizes() == at::IntArrayRef({B, Hv, Dv, Dk}) && out.sizes() == v.sizes(),
              "fwp_chunk.token_step: inconsistent shapes");
  for (const at::Tensor* x : {&k, &v, &out}) check(*x, q, "input");
  check_optional(S_out, at::kFloat, B * Hv * Dv * Dk, "S_out");
  check_optional(S, at::kFloat, B * Hv * Dv * Dk, "S");
  for (auto* x : {&beta_logits, &decay_logits}) check_optional(*x, q.scalar_type(), B * Hv, "beta / decay logits");
  TORCH_CHECK(A_log.has_value() == decay_logits.has_value() && dt_bias.has_value() == decay_logits.has_value() &&
                  (beta_logits.has_value() || !decay_logits.has_value()),
              "fwp_chunk.token_step: decay logits come with A_log, dt_bias and beta logits");
  // the parameters in float32, as the unfused ops widen them (a copy only where they are not)
  const std::optional<at::Tensor> A_log32 = widened(A_log), dt_bias32 = widened(dt_bias), norm32 = widened(norm_weight);
  for (auto* x : {&A_log32, &dt_bias32}) check_optional(*x, at::kFloat, Hv, "A_log / dt_bias");
  check_optional(gate, q.scalar_type(), B * Hv * Dv, "gate");
  check_optional(norm32, at::kFloat, Dv, "norm_weight");
  const int64_t K = check_convolutions(conv_weights, conv_states, new_conv_states, q, H * Dk, Hv * Dv);
  auto fill = [&](auto* typed) {  // the raw pointers of `run` in the inputs' type T (typed: a null T*)
    using T = std::remove_pointer_t<decltype(typed)>;
    Layer<T> L{B, H, Hv, Dk, Dv, K, q.data_ptr<T>(), k.data_ptr<T>(), v.data_ptr<T>(), data_or_null<T>(beta_logits),
               data_or_null<T>(decay_logits), data_or_null<T>(gate), data_or_null<float>(A_log32),
               data_or_null<float>(dt_bias32), data_or_null<float>(norm32), {}, {}, {},
               data_or_null<float>(S), S_out.data_ptr<float>(), out.data_ptr<T>(), feature_map, gate_activation,
               sum_normalization, value_silu, static_cast<float>(l2_eps), static_cast<float>(query_scale),
               static_cast<float>(beta_scale), static_cast<float>(norm_eps)};
    for (int64_t i = 0; i < (K ? 3 : 0); ++i) {
      L.conv_weights[i] = conv_weights[i].data_ptr<T>();
      L.conv_states[i] = conv_states[i].data_ptr<T>();
      L.new_conv_states[i] = new_conv_states[i].data_ptr<T>();
    }
    run(L);
  };
  if (q.scalar_type() == at::kBFloat16) {
    fill(static_cast<c10::BFloat16*>(nullptr));
  } else {
    fill(static_cast<float*>(nullptr));
  }
}

}  // namespace token
#ifdef FWP_DECODE_VECTOR_WIDTH_PUSHED
#pragma GCC pop_options
#endif

// ---------------------------------------------------------------------------------------------------------------
// The gated delta rule (Yang, Kautz, Hatamizadeh 2025, "Gated Delta Networks", sec. 3.1):
//
//   W_t = a_t W_{t-1} + beta_t (v_t - a_t W_{t-1} k_t) k_t^T,   a_t = exp(g_t),   o_t = W_t q_t,
//
// the delta rule's chunk loops (chunk_forward_seq, chunk_backward_seq) with its decays applied to their products
// (decay_products, DecayGradients): the same Gemm policies, forms, substitutions and tasks; these are its ops' checks.
// Derivation: kernels/README.md, "Gated delta rule". Per chunk of c rows, with the state S [Dv, Dk] entering it
// (y = S q), the cumulative log-decay
// gamma_i = g_1 + ... + g_i, Gamma_i = exp(gamma_i), D_ij = exp(gamma_i - gamma_j) (j <= i), lambda_j =
// exp(gamma_c - gamma_j):
//
//   (I + A) U' = diag(beta) X,   X = V - diag(Gamma) K S^T,   A = diag(beta) KD,   KD = strictly_lower(K K^T * D)
//   O = diag(Gamma) Q S^T + P U',   P = tril(Q K^T) * D,    S <- Gamma_c S + U'^T diag(lambda) K
namespace gated {

void check(const at::Tensor& x, at::ScalarType dtype, int64_t numel, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == dtype && x.is_contiguous() && x.numel() == numel,
              "fwp_chunk.gated: `", name, "` must be a contiguous CPU tensor of dtype ", dtype, " with ", numel,
              " elements");
}

// chunk_shapes' sizes and the dtypes of q, k, v, the gates, o and the gradients (in) and of the states (float32 for
// bfloat16 q)
struct Shapes : ChunkShapes {
  at::ScalarType in, state;
};

// g (and dg) [BH, L]: of q's dtype, or float32 beside bfloat16 q (a bfloat16 model's log-decays, computed in float32)
void check_decays(const Shapes& s, const at::Tensor& g, const char* name) {
  check(g, g.scalar_type() == s.state ? s.state : s.in, s.BH * s.L, name);
}

Shapes shapes(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t chunk_size) {
  return {chunk_shapes(q, k, v, chunk_size), q.scalar_type(), at::toOpMathType(q.scalar_type())};
}

// q, k [BH, L, Dk], v [BH, L, Dv], beta, g [BH, L]; S [BH, Dv, Dk]: initial state in, final state out; o [BH, L, Dv].
// bfloat16 q, k, v, beta and o take a float32 S (g bfloat16 or float32): widened chunk by chunk as they are read, o
// rounded as written.
void forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& beta,
             const at::Tensor& g, const at::Tensor& S, int64_t chunk_size, const at::Tensor& o, int64_t products) {
  const Shapes s = shapes(q, k, v, chunk_size);
  check(k, s.in, s.BH * s.L * s.Dk, "k");
  for (auto* x : {&v, &o}) check(*x, s.in, s.BH * s.L * s.Dv, "v / o");
  check(beta, s.in, s.BH * s.L, "beta");
  check_decays(s, g, "g");
  check(S, s.state, s.BH * s.Dv * s.Dk, "S");
  dispatch_products(q.scalar_type(), products, [&](auto in, const auto& gemm) {
    using In = decltype(in);
    using T = at::opmath_type<In>;
    with_decays<In, T>(g, [&](auto* g_p) {
      forward_sequences<T>(s, q.data_ptr<In>(), k.data_ptr<In>(), v.data_ptr<In>(), beta.data_ptr<In>(), g_p,
                           S.data_ptr<T>(), o.data_ptr<In>(), (T*)nullptr, (T*)nullptr, gemm);
    });
  });
}

// Gradients of gated_forward. dS [BH, Dv, Dk]: the final state's gradient in, the initial state's out. The states
// entering the chunks and U' are recomputed per sequence (one state per chunk, in a per-thread buffer). bfloat16
// inputs and dout take a float32 s0 and dS and write bfloat16 gradients (each rounded once; dg of g's dtype).
void backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& beta,
              const at::Tensor& g, const at::Tensor& s0, int64_t chunk_size, const at::Tensor& dout,
              const at::Tensor& dS, const at::Tensor& dq, const at::Tensor& dk, const at::Tensor& dv,
              const at::Tensor& dbeta, const at::Tensor& dg, int64_t products) {
  const Shapes s = shapes(q, k, v, chunk_size);
  for (auto* x : {&k, &dq, &dk}) check(*x, s.in, s.BH * s.L * s.Dk, "k / dq / dk");
  for (auto* x : {&v, &dout, &dv}) check(*x, s.in, s.BH * s.L * s.Dv, "v / dout / dv");
  for (auto* x : {&beta, &dbeta}) check(*x, s.in, s.BH * s.L, "beta / dbeta");
  check_decays(s, g, "g");
  check(dg, g.scalar_type(), s.BH * s.L, "dg");
  for (auto* x : {&s0, &dS}) check(*x, s.state, s.BH * s.Dv * s.Dk, "s0 / dS");
  backward_all(s, q, k, v, beta, g, s0, dout, dS, dq, dk, dv, dbeta, dg, products);
}

}  // namespace gated

}  // namespace

FWP_TORCH_LIBRARY(FWP_OP_NAMESPACE, m) {
  m.def(
      "chunk_forward(Tensor q, Tensor k, Tensor v, Tensor? beta, Tensor(a!) S, int chunk_size, Tensor(b!)? o, "
      "Tensor(c!)? entering, Tensor(d!)? u_new, int products=0) -> ()");
  m.def(
      "chunk_backward(Tensor q, Tensor k, Tensor v, Tensor? beta, Tensor s0, int chunk_size, Tensor dout, "
      "Tensor(a!) dS, Tensor(b!) dq, Tensor(c!) dk, Tensor(d!) dv, Tensor(e!)? dbeta, int products=0) -> ()");
  m.def(
      "decode_step(Tensor q, Tensor k, Tensor v, Tensor? beta, Tensor? g, Tensor? S, Tensor(a!) S_out, Tensor(b!) o) "
      "-> ()");
  m.def("gated_forward(Tensor q, Tensor k, Tensor v, Tensor beta, Tensor g, Tensor(a!) S, int chunk_size, "
        "Tensor(b!) o, int products=0) -> ()");
  m.def("gated_backward(Tensor q, Tensor k, Tensor v, Tensor beta, Tensor g, Tensor s0, int chunk_size, "
        "Tensor dout, Tensor(a!) dS, Tensor(b!) dq, Tensor(c!) dk, Tensor(d!) dv, Tensor(e!) dbeta, "
        "Tensor(f!) dg, int products=0) -> ()");
  m.def("token_step(Tensor q, Tensor k, Tensor v, Tensor? beta_logits, Tensor? decay_logits, Tensor? A_log, "
        "Tensor? dt_bias, Tensor? gate, Tensor[] conv_weights, Tensor[] conv_states, Tensor? S, Tensor? norm_weight, "
        "int num_heads, int feature_map, bool sum_normalization, bool value_silu, float l2_eps, float query_scale, "
        "float beta_scale, float norm_eps, int gate_activation, Tensor(a!)[] new_conv_states, Tensor(b!) S_out, "
        "Tensor(c!) out) -> ()");
  m.def("product_kinds", &product_kinds);  // no tensor argument: one kernel for every dispatch key
}

FWP_TORCH_LIBRARY_IMPL(FWP_OP_NAMESPACE, CPU, m) {
  m.impl("chunk_forward", &chunk_forward);
  m.impl("chunk_backward", &chunk_backward);
  m.impl("decode_step", &decode_step);
  m.impl("token_step", &token::token_step);
  m.impl("gated_forward", &gated::forward);
  m.impl("gated_backward", &gated::backward);
}
