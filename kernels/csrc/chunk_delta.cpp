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
// substitution), so the UT-transform matrix T = (I + A)^-1 and the WY factors are never formed. Every product is a
// call to the BLAS that PyTorch links (sgemm_/dgemm_): one call per product and chunk, no tensor allocation and no
// dispatcher in the loop. Matrices are row-major; `gemm_rm` maps a row-major product to the column-major BLAS call by
// computing its transpose. bfloat16 inputs on a CPU with AVX-512 BF16 have a forward of their own (chunk_forward_bf16,
// below), whose products are a micro-kernel of this file.
//
// The Python wrapper allocates every output and passes it in; this file only runs loops over raw pointers.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

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

// The delta rule's triangular system in a chunk, (I + strictly_lower(diag(beta) G)) U = X, solved in place (X in U)
// by forward substitution, row by row: u_i = x_i - beta_i sum_{j<i} G_ij u_j (eqs. 20-24: each write sees the ones
// before it). G [c, ldg] row-major (its diagonal and upper part are not read), U [c, n]. For these small systems a
// loop of vector updates is faster than the BLAS's trsm (measured: the bfloat16 forward, B1 H8 T4096 D64, 1 thread,
// C = 32, 8.3 -> 6.2 ms).
template <typename T, typename B>
inline void unit_lower_forward_substitution(int64_t c, int64_t n, const T* G, int64_t ldg, const B& beta, T* U) {
  for (int64_t i = 1; i < c; ++i) {
    T* ui = U + i * n;
    const T bi = beta(i);
    for (int64_t j = 0; j < i; ++j) {
      const T a = bi * G[i * ldg + j];
      const T* uj = U + j * n;
#pragma omp simd
      for (int64_t x = 0; x < n; ++x) ui[x] -= a * uj[x];
    }
  }
}

// One sequence: q, k [L, Dk], v [L, Dv], beta [L] (nullptr: sum rule). S [Dv, Dk] holds the initial state
// on entry and the final one on return. Writes o [L, Dv] (unless nullptr); optionally the state entering each chunk
// (`entering` [N, Dv, Dk]) and the new values U' (`u_new` [L, Dv], delta rule) for the backward pass.
// `work` holds chunk_workspace(C, Dk, Dv) elements.
inline int64_t chunk_workspace(int64_t C, int64_t Dk, int64_t Dv) {
  return 2 * C * Dk + Dk * C + 2 * C * C + 2 * C * Dv + C * Dv + Dk * Dv;
}

template <typename T>
void chunk_forward_seq(int64_t L, int64_t Dk, int64_t Dv, int64_t C, const T* q, const T* k, const T* v,
                       const T* beta, T* S, T* o, T* entering, T* u_new, T* work) {
  // Inside the loop the state is kept transposed, St = S^T [Dk, Dv], and the chunk's queries and keys are
  // stacked, X = [Q; K] [2c, Dk], with a transposed copy Kt = K^T [Dk, c]: then every product below is a
  // plain row-major (no-transpose) product, and the four products with S or K^T are two calls.
  T* X = work;              // [Q; K]                                                  [2c, Dk]
  T* Kt = X + 2 * C * Dk;   // K^T                                                     [Dk, c]
  T* G = Kt + Dk * C;       // [Q; K] K^T: P = tril(Q K^T) on top, then A = K K^T       [2c, c]
  T* Y = G + 2 * C * C;     // [Q; K] S^T                                              [2c, Dv]
  T* U_buf = Y + 2 * C * Dv;  // U' when the caller does not keep it                   [c, Dv]
  T* St = U_buf + C * Dv;   // S^T                                                     [Dk, Dv]
  for (int64_t i = 0; i < Dv; ++i)
    for (int64_t j = 0; j < Dk; ++j) St[j * Dv + i] = S[i * Dk + j];
  for (int64_t t0 = 0, n = 0; t0 < L; t0 += C, ++n) {
    const int64_t c = std::min(C, L - t0);
    const T* V = v + t0 * Dv;
    T* O = o != nullptr ? o + t0 * Dv : nullptr;
    if (entering != nullptr) {
      T* E = entering + n * Dv * Dk;
      for (int64_t i = 0; i < Dv; ++i)
        for (int64_t j = 0; j < Dk; ++j) E[i * Dk + j] = St[j * Dv + i];
    }
    // Without outputs to write (the backward's recomputation of the states) only the keys are stacked.
    const int64_t cq = o != nullptr ? c : 0;
    if (cq > 0) std::memcpy(X, q + t0 * Dk, sizeof(T) * c * Dk);
    std::memcpy(X + cq * Dk, k + t0 * Dk, sizeof(T) * c * Dk);
    const T* K = X + cq * Dk;
    for (int64_t i = 0; i < c; ++i)
      for (int64_t j = 0; j < Dk; ++j) Kt[j * c + i] = K[i * Dk + j];

    // [Q; K] S^T: Q S^T is what the state entering the chunk returns for each query (eq. 25 with W = S)
    // (the sum rule needs neither K S^T nor K K^T: only the Q rows)
    const int64_t rows = cq + (beta != nullptr ? c : 0);
    gemm_rm<T>(false, false, rows, Dv, Dk, T(1), X, Dk, St, Dv, T(0), Y, Dv);
    // [Q; K] K^T
    gemm_rm<T>(false, false, rows, c, Dk, T(1), X, Dk, Kt, c, T(0), G, c);
    T* P = G;  // tril(Q K^T), diagonal included: position i reads the writes of positions j <= i
    for (int64_t i = 0; i < cq; ++i) std::fill(P + i * c + i + 1, P + (i + 1) * c, T(0));

    const T* U = V;  // sum rule: the values themselves are written (eq. 17)
    if (beta != nullptr) {
      // Delta rule within the chunk, u_i = beta_i (v_i - S_{i-1} k_i) with S_{i-1} = S + sum_{j<i} u_j k_j^T
      // (eqs. 20-24), stacked: (I + strictly_lower(diag(beta) K K^T)) U' = diag(beta) (V - K S^T).
      T* Un = u_new != nullptr ? u_new + t0 * Dv : U_buf;
      const T* b = beta + t0;
      const T* KS = Y + cq * Dv;
      for (int64_t i = 0; i < c; ++i) {
        const T bi = b[i];
        for (int64_t j = 0; j < Dv; ++j) Un[i * Dv + j] = bi * (V[i * Dv + j] - KS[i * Dv + j]);
      }
      unit_lower_forward_substitution<T>(c, Dv, G + cq * c, c, [b](int64_t i) { return b[i]; }, Un);
      U = Un;
    }
    // O = Q S^T + tril(Q K^T) U': the reads of the chunk's own writes
    if (cq > 0) {
      std::memcpy(O, Y, sizeof(T) * c * Dv);
      gemm_rm<T>(false, false, c, Dv, c, T(1), P, c, U, Dv, T(1), O, Dv);
    }
    // S^T <- S^T + K^T U': the chunk's writes
    gemm_rm<T>(false, false, Dk, Dv, c, T(1), Kt, c, U, Dv, T(1), St, Dv);
  }
  for (int64_t i = 0; i < Dv; ++i)
    for (int64_t j = 0; j < Dk; ++j) S[i * Dk + j] = St[j * Dv + i];
}

// The transposed system of the backward, (I + strictly_lower(diag(beta) G))^T R = D, in place (D in R), by back
// substitution: once r_j is final (j from the last row), r_i -= beta_j G_ji r_j for every i < j.
template <typename T, typename B>
inline void unit_lower_transposed_back_substitution(int64_t c, int64_t n, const T* G, int64_t ldg, const B& beta,
                                                    T* R) {
  for (int64_t j = c - 1; j > 0; --j) {
    const T* rj = R + j * n;
    const T bj = beta(j);
    for (int64_t i = 0; i < j; ++i) {
      const T a = bj * G[j * ldg + i];
      T* ri = R + i * n;
#pragma omp simd
      for (int64_t x = 0; x < n; ++x) ri[x] -= a * rj[x];
    }
  }
}

inline int64_t chunk_backward_workspace(int64_t C, int64_t Dk, int64_t Dv) {
  return 4 * C * C + 2 * C * Dv + 2 * C * Dk;
}

// The backward of one sequence, chunks from last to first. Given the state entering each chunk
// (`entering` [N, Dv, Dk]) and U' (`u_new` [L, Dv]; delta rule) from `chunk_forward_seq`, the output
// gradient do [L, Dv] and, in dS [Dv, Dk], the gradient of the final state (replaced by that of the
// initial state). Per chunk, with S entering it and dS' the gradient of the state leaving it
// (derivation: kernels/README.md, "Backward of the CPU kernel"):
//   O = Q S^T + P U', P = tril(Q K^T), S' = S + U'^T K:
//     dU' = K dS'^T + P^T dO,  dP = tril(dO U'^T),  dQ = dO S + dP K,  dK = U' dS' + dP^T Q,
//     dS = dS' + dO^T Q
//   delta rule, (I + A) U' = diag(beta) X, X = V - K S^T, A = strictly_lower(diag(beta) K K^T):
//     dR = (I + A)^-T dU',  dV = diag(beta) dR,  dbeta = rowsum(dR * X) + rowsum((dA K) * K),
//     dA = -strictly_lower(dR U'^T),  dK += -dV S + diag(beta) dA K + dA^T diag(beta) K,  dS -= dV^T K
//   sum rule: dV = dU'.
template <typename T>
void chunk_backward_seq(int64_t L, int64_t Dk, int64_t Dv, int64_t C, const T* q, const T* k, const T* v,
                        const T* beta, const T* entering, const T* u_new, const T* dout, T* dS, T* dq, T* dk,
                        T* dv, T* dbeta, T* work) {
  T* P = work;              // tril(Q K^T), then dP = tril(dO U'^T) is a separate buffer  [c, c]
  T* A = P + C * C;         // I + strictly_lower(diag(beta) K K^T)                      [c, c]
  T* dP = A + C * C;        //                                                           [c, c]
  T* dA = dP + C * C;       //                                                           [c, c]
  T* X = dA + C * C;        // V - K S^T                                                 [c, Dv]
  T* dR = X + C * Dv;       // dU', then dR in place                                     [c, Dv]
  T* M = dR + C * Dv;       // dA K                                                      [c, Dk]
  T* bK = M + C * Dk;       // diag(beta) K                                              [c, Dk]
  const int64_t N = (L + C - 1) / C;
  for (int64_t n = N - 1; n >= 0; --n) {
    const int64_t t0 = n * C, c = std::min(C, L - t0);
    const T* Q = q + t0 * Dk;
    const T* K = k + t0 * Dk;
    const T* V = v + t0 * Dv;
    const T* dO = dout + t0 * Dv;
    const T* S = entering + n * Dv * Dk;
    const T* U = beta != nullptr ? u_new + t0 * Dv : V;
    T* dQ = dq + t0 * Dk;
    T* dK = dk + t0 * Dk;
    T* dV = dv + t0 * Dv;

    gemm_rm<T>(false, true, c, c, Dk, T(1), Q, Dk, K, Dk, T(0), P, c);
    for (int64_t i = 0; i < c; ++i) std::fill(P + i * c + i + 1, P + (i + 1) * c, T(0));
    // dU' = K dS'^T + P^T dO   (into dV for the sum rule, where dV = dU')
    T* dU = beta != nullptr ? dR : dV;
    gemm_rm<T>(false, true, c, Dv, Dk, T(1), K, Dk, dS, Dk, T(0), dU, Dv);
    gemm_rm<T>(true, false, c, Dv, c, T(1), P, c, dO, Dv, T(1), dU, Dv);
    // dK = U' dS' (dS' still the gradient of the state leaving the chunk)
    gemm_rm<T>(false, false, c, Dk, Dv, T(1), U, Dv, dS, Dk, T(0), dK, Dk);
    // dP = tril(dO U'^T);  dQ = dO S + dP K;  dK += dP^T Q;  dS = dS' + dO^T Q
    gemm_rm<T>(false, true, c, c, Dv, T(1), dO, Dv, U, Dv, T(0), dP, c);
    for (int64_t i = 0; i < c; ++i) std::fill(dP + i * c + i + 1, dP + (i + 1) * c, T(0));
    gemm_rm<T>(false, false, c, Dk, Dv, T(1), dO, Dv, S, Dk, T(0), dQ, Dk);
    gemm_rm<T>(false, false, c, Dk, c, T(1), dP, c, K, Dk, T(1), dQ, Dk);
    gemm_rm<T>(true, false, c, Dk, c, T(1), dP, c, Q, Dk, T(1), dK, Dk);
    gemm_rm<T>(true, false, Dv, Dk, c, T(1), dO, Dv, Q, Dk, T(1), dS, Dk);
    if (beta == nullptr) continue;

    const T* b = beta + t0;
    // Recompute X = V - K S^T and A, then dR = (I + A)^-T dU'
    std::memcpy(X, V, sizeof(T) * c * Dv);
    gemm_rm<T>(false, true, c, Dv, Dk, T(-1), K, Dk, S, Dk, T(1), X, Dv);
    gemm_rm<T>(false, true, c, c, Dk, T(1), K, Dk, K, Dk, T(0), A, c);
    unit_lower_transposed_back_substitution<T>(c, Dv, A, c, [b](int64_t i) { return b[i]; }, dR);
    // dV = diag(beta) dR;  dbeta = rowsum(dR * X)
    for (int64_t i = 0; i < c; ++i) {
      T acc = 0;
      for (int64_t j = 0; j < Dv; ++j) {
        acc += dR[i * Dv + j] * X[i * Dv + j];
        dV[i * Dv + j] = b[i] * dR[i * Dv + j];
      }
      dbeta[t0 + i] = acc;
    }
    // dK -= dV S;  dS -= dV^T K
    gemm_rm<T>(false, false, c, Dk, Dv, T(-1), dV, Dv, S, Dk, T(1), dK, Dk);
    gemm_rm<T>(true, false, Dv, Dk, c, T(-1), dV, Dv, K, Dk, T(1), dS, Dk);
    // dA = -strictly_lower(dR U'^T)
    gemm_rm<T>(false, true, c, c, Dv, T(-1), dR, Dv, U, Dv, T(0), dA, c);
    for (int64_t i = 0; i < c; ++i) std::fill(dA + i * c + i, dA + (i + 1) * c, T(0));
    // M = dA K:  dK += diag(beta) M,  dbeta += rowsum(M * K);  dK += dA^T diag(beta) K
    gemm_rm<T>(false, false, c, Dk, c, T(1), dA, c, K, Dk, T(0), M, Dk);
    for (int64_t i = 0; i < c; ++i) {
      T acc = 0;
      for (int64_t j = 0; j < Dk; ++j) {
        acc += M[i * Dk + j] * K[i * Dk + j];
        dK[i * Dk + j] += b[i] * M[i * Dk + j];
        bK[i * Dk + j] = b[i] * K[i * Dk + j];
      }
      dbeta[t0 + i] += acc;
    }
    gemm_rm<T>(true, false, c, Dk, c, T(1), dA, c, bK, Dk, T(1), dK, Dk);
  }
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

// Columns [j0, j0 + n) of a row-major x [L, ld] into the contiguous out [L, n], and back.
template <typename T>
void gather_columns(const T* x, int64_t L, int64_t ld, int64_t j0, int64_t n, T* out) {
  for (int64_t t = 0; t < L; ++t) std::memcpy(out + t * n, x + t * ld + j0, sizeof(T) * n);
}
template <typename T>
void scatter_columns(const T* x, int64_t L, int64_t ld, int64_t j0, int64_t n, T* out) {
  for (int64_t t = 0; t < L; ++t) std::memcpy(out + t * ld + j0, x + t * n, sizeof(T) * n);
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
template <typename T>
void forward_value_blocks(const ChunkShapes& s, int64_t nb, const T* q, const T* k, const T* v, const T* beta, T* S,
                          T* o) {
  parallel_tasks(s.BH * nb, [&](int64_t begin, int64_t end) {
    std::vector<T> buf;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / nb, j = task % nb, j0 = j * s.Dv / nb, n = (j + 1) * s.Dv / nb - j0;
      buf.resize(2 * s.L * n + chunk_workspace(s.C, s.Dk, n));
      T* vb = buf.data();  // the block's columns of V, then of O   [L, n] each
      T* ob = vb + s.L * n;
      gather_columns(v + bh * s.L * s.Dv, s.L, s.Dv, j0, n, vb);
      chunk_forward_seq<T>(s.L, s.Dk, n, s.C, q + bh * s.L * s.Dk, k + bh * s.L * s.Dk, vb,
                           beta != nullptr ? beta + bh * s.L : nullptr, S + (bh * s.Dv + j0) * s.Dk, ob, nullptr,
                           nullptr, ob + s.L * n);
      scatter_columns(ob, s.L, s.Dv, j0, n, o + bh * s.L * s.Dv);
    }
  });
}

// The backward in nb > 1 column blocks. dV and the rows of dS split like V and S; dQ, dK and dbeta are sums over
// the value columns (dQ = dO S + dP K, dP = tril(dO U'^T), ...): each block writes its part, summed at the end.
template <typename T>
void backward_value_blocks(const ChunkShapes& s, int64_t nb, const at::Tensor& q, const at::Tensor& k, const T* v,
                           const T* beta, const T* s0, const T* dout, T* dS, const at::Tensor& dq,
                           const at::Tensor& dk, T* dv, const std::optional<at::Tensor>& dbeta) {
  const at::Tensor dq_parts = q.new_empty({nb, s.BH, s.L, s.Dk});
  const at::Tensor dk_parts = q.new_empty({nb, s.BH, s.L, s.Dk});
  const at::Tensor db_parts = q.new_empty({nb, s.BH, s.L});
  const T *qp = q.data_ptr<T>(), *kp = k.data_ptr<T>();
  T *dqp = dq_parts.data_ptr<T>(), *dkp = dk_parts.data_ptr<T>(), *dbp = db_parts.data_ptr<T>();
  parallel_tasks(s.BH * nb, [&](int64_t begin, int64_t end) {
    std::vector<T> buf;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / nb, j = task % nb, j0 = j * s.Dv / nb, n = (j + 1) * s.Dv / nb - j0;
      const int64_t work = std::max(chunk_workspace(s.C, s.Dk, n), chunk_backward_workspace(s.C, s.Dk, n));
      buf.resize(4 * s.L * n + (s.N + 1) * n * s.Dk + work);
      T* vb = buf.data();         // the block's columns of V, dO, dV and U'   [L, n] each
      T* dob = vb + s.L * n;
      T* dvb = dob + s.L * n;
      T* u_new = dvb + s.L * n;
      T* entering = u_new + s.L * n;  // the block's rows of the state entering each chunk   [N, n, Dk]
      T* state = entering + s.N * n * s.Dk;
      gather_columns(v + bh * s.L * s.Dv, s.L, s.Dv, j0, n, vb);
      gather_columns(dout + bh * s.L * s.Dv, s.L, s.Dv, j0, n, dob);
      std::memcpy(state, s0 + (bh * s.Dv + j0) * s.Dk, sizeof(T) * n * s.Dk);
      const T* qs = qp + bh * s.L * s.Dk;
      const T* ks = kp + bh * s.L * s.Dk;
      const T* bs = beta != nullptr ? beta + bh * s.L : nullptr;
      chunk_forward_seq<T>(s.L, s.Dk, n, s.C, qs, ks, vb, bs, state, nullptr, entering, u_new, state + n * s.Dk);
      const int64_t part = j * s.BH + bh;
      chunk_backward_seq<T>(s.L, s.Dk, n, s.C, qs, ks, vb, bs, entering, u_new, dob, dS + (bh * s.Dv + j0) * s.Dk,
                            dqp + part * s.L * s.Dk, dkp + part * s.L * s.Dk, dvb, dbp + part * s.L,
                            state + n * s.Dk);
      scatter_columns(dvb, s.L, s.Dv, j0, n, dv + bh * s.L * s.Dv);
    }
  });
  dq.copy_(dq_parts.sum(0));
  dk.copy_(dk_parts.sum(0));
  if (dbeta.has_value()) dbeta->copy_(db_parts.sum(0).view_as(*dbeta));
}

// q, k [BH, L, Dk], v [BH, L, Dv], beta [BH, L] or None (sum rule); S [BH, Dv, Dk]: initial state in,
// final state out; o [BH, L, Dv] optional (not computed when None); entering [BH, N, Dv, Dk] and u_new [BH, L, Dv] optional.
void chunk_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const std::optional<at::Tensor>& beta, const at::Tensor& S, int64_t chunk_size,
                   const std::optional<at::Tensor>& o, const std::optional<at::Tensor>& entering,
                   const std::optional<at::Tensor>& u_new) {
  const ChunkShapes shapes = chunk_shapes(q, k, v, chunk_size);
  const int64_t BH = shapes.BH, L = shapes.L, Dk = shapes.Dk, Dv = shapes.Dv, C = shapes.C, N = shapes.N;
  for (auto* x : {&k, &v, &S}) check(*x, q, "input");
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
  if (entering.has_value()) {
    check(*entering, q, "entering");
    TORCH_CHECK(entering->numel() == BH * N * Dv * Dk, "fwp_chunk: entering must be [BH, N, Dv, Dk]");
  }
  if (u_new.has_value()) {
    check(*u_new, q, "u_new");
    TORCH_CHECK(u_new->numel() == BH * L * Dv, "fwp_chunk: u_new must be [BH, L, Dv]");
  }
  // the states entering the chunks and U' are kept only by the backward's own call, which splits by itself
  const int64_t nb = o.has_value() && !entering.has_value() && !u_new.has_value() ? value_blocks(BH, L, Dv) : 1;
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "chunk_forward", [&] {
    if (nb > 1) {
      return forward_value_blocks<scalar_t>(
          shapes, nb, q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
          beta.has_value() ? beta->data_ptr<scalar_t>() : nullptr, S.data_ptr<scalar_t>(), o->data_ptr<scalar_t>());
    }
    for_sequences(BH, [&](int64_t begin, int64_t end) {
      std::vector<scalar_t> work(chunk_workspace(C, Dk, Dv));
      for (int64_t bh = begin; bh < end; ++bh) {
        chunk_forward_seq<scalar_t>(
            L, Dk, Dv, C, q.data_ptr<scalar_t>() + bh * L * Dk, k.data_ptr<scalar_t>() + bh * L * Dk,
            v.data_ptr<scalar_t>() + bh * L * Dv, beta.has_value() ? beta->data_ptr<scalar_t>() + bh * L : nullptr,
            S.data_ptr<scalar_t>() + bh * Dv * Dk, o.has_value() ? o->data_ptr<scalar_t>() + bh * L * Dv : nullptr,
            entering.has_value() ? entering->data_ptr<scalar_t>() + bh * N * Dv * Dk : nullptr,
            u_new.has_value() ? u_new->data_ptr<scalar_t>() + bh * L * Dv : nullptr, work.data());
      }
    });
  });
}

// Gradients of chunk_forward. dS [BH, Dv, Dk]: the final state's gradient in, the initial state's out.
// dq, dk [BH, L, Dk], dv [BH, L, Dv], dbeta [BH, L] (delta rule) are written. The states entering the
// chunks and U' are recomputed per sequence (one state per chunk, in a per-thread buffer).
void chunk_backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const std::optional<at::Tensor>& beta, const at::Tensor& s0, int64_t chunk_size,
                    const at::Tensor& dout, const at::Tensor& dS, const at::Tensor& dq, const at::Tensor& dk,
                    const at::Tensor& dv, const std::optional<at::Tensor>& dbeta) {
  const ChunkShapes shapes = chunk_shapes(q, k, v, chunk_size);
  const int64_t BH = shapes.BH, L = shapes.L, Dk = shapes.Dk, Dv = shapes.Dv, C = shapes.C, N = shapes.N;
  for (auto* x : {&k, &v, &s0, &dout, &dS, &dq, &dk, &dv}) check(*x, q, "input");
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
  const int64_t nb = value_blocks(BH, L, Dv);
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "chunk_backward", [&] {
    if (nb > 1) {
      return backward_value_blocks<scalar_t>(
          shapes, nb, q, k, v.data_ptr<scalar_t>(), beta.has_value() ? beta->data_ptr<scalar_t>() : nullptr,
          s0.data_ptr<scalar_t>(), dout.data_ptr<scalar_t>(), dS.data_ptr<scalar_t>(), dq, dk,
          dv.data_ptr<scalar_t>(), dbeta);
    }
    for_sequences(BH, [&](int64_t begin, int64_t end) {
      std::vector<scalar_t> work(std::max(chunk_workspace(C, Dk, Dv), chunk_backward_workspace(C, Dk, Dv)));
      std::vector<scalar_t> entering(N * Dv * Dk), state(Dv * Dk);
      std::vector<scalar_t> u_new(beta.has_value() ? L * Dv : 0);
      for (int64_t bh = begin; bh < end; ++bh) {
        const scalar_t* qs = q.data_ptr<scalar_t>() + bh * L * Dk;
        const scalar_t* ks = k.data_ptr<scalar_t>() + bh * L * Dk;
        const scalar_t* vs = v.data_ptr<scalar_t>() + bh * L * Dv;
        const scalar_t* bs = beta.has_value() ? beta->data_ptr<scalar_t>() + bh * L : nullptr;
        std::memcpy(state.data(), s0.data_ptr<scalar_t>() + bh * Dv * Dk, sizeof(scalar_t) * Dv * Dk);
        chunk_forward_seq<scalar_t>(L, Dk, Dv, C, qs, ks, vs, bs, state.data(), nullptr, entering.data(),
                                    bs != nullptr ? u_new.data() : nullptr, work.data());
        chunk_backward_seq<scalar_t>(
            L, Dk, Dv, C, qs, ks, vs, bs, entering.data(), u_new.data(), dout.data_ptr<scalar_t>() + bh * L * Dv,
            dS.data_ptr<scalar_t>() + bh * Dv * Dk, dq.data_ptr<scalar_t>() + bh * L * Dk,
            dk.data_ptr<scalar_t>() + bh * L * Dk, dv.data_ptr<scalar_t>() + bh * L * Dv,
            bs != nullptr ? dbeta->data_ptr<scalar_t>() + bh * L : nullptr, work.data());
      }
    });
  });
}

// ---------------------------------------------------------------------------------------------------------------
// bfloat16 inputs on a CPU with AVX-512 BF16 (the forward): every product of the chunk loop multiplies bfloat16 pairs
// and sums in float32 (vdpbf16ps); the state S and the new values U' stay float32 and are rounded to bfloat16 only as
// factors of a product (as fla's Triton kernels do on a GPU); the triangular solve runs in float32. Same equations as
// chunk_forward_seq. Needs Dk and Dv multiples of 16; elsewhere, and for the backward, bfloat16 runs in float32.
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define FWP_NATIVE_BF16 1
#include <immintrin.h>

using bf16_bits = uint16_t;
typedef uint32_t pair_bits __attribute__((__may_alias__));  // two bfloat16 side by side

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// The micro-kernel: C [MR, 16 NV] (+)= A B over kp pairs of the inner dimension, float32 sums. Row r's pair p of A is
// the 32 bits at A + r a_row + p a_pair (in bfloat16 elements); B is pair-packed: pair p of column j at B + 2 (p ldb +
// j). MR x NV accumulators stay in registers.
template <int MR, int NV>
inline void bf16_tile(int64_t kp, const bf16_bits* A, int64_t a_row, int64_t a_pair, const bf16_bits* B, int64_t ldb,
                      float* C, int64_t ldc, bool accumulate) {
  __m512 acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = accumulate ? _mm512_loadu_ps(C + r * ldc + 16 * v) : _mm512_setzero_ps();
  for (int64_t p = 0; p < kp; ++p) {
    __m512bh b[NV];
    for (int v = 0; v < NV; ++v) b[v] = (__m512bh)_mm512_loadu_si512(B + 2 * (p * ldb + 16 * v));
    for (int r = 0; r < MR; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(*reinterpret_cast<const pair_bits*>(A + r * a_row + p * a_pair));
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], a, b[v]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(C + r * ldc + 16 * v, acc[r][v]);
}

// The last rows (fewer than a full tile): bf16_tile with MR = rows, chosen at run time.
template <int NV, int R = 1>
inline void bf16_tile_rows(int rows, int64_t kp, const bf16_bits* A, int64_t a_row, int64_t a_pair,
                           const bf16_bits* B, int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  if constexpr (R < 8) {
    if (rows == R) return bf16_tile<R, NV>(kp, A, a_row, a_pair, B, ldb, C, ldc, accumulate);
    bf16_tile_rows<NV, R + 1>(rows, kp, A, a_row, a_pair, B, ldb, C, ldc, accumulate);
  }
}

// C [m, 16 NV] (+)= A B in tiles of MR rows: 6 x 4 or 8 x NV accumulators (of 32 vector registers).
template <int NV>
void bf16_rows(int64_t m, int64_t kp, const bf16_bits* A, int64_t a_row, int64_t a_pair, const bf16_bits* B,
               int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  constexpr int MR = NV >= 3 ? 6 : 8;
  int64_t i = 0;
  for (; i + MR <= m; i += MR) bf16_tile<MR, NV>(kp, A + i * a_row, a_row, a_pair, B, ldb, C + i * ldc, ldc, accumulate);
  if (i < m) bf16_tile_rows<NV>(int(m - i), kp, A + i * a_row, a_row, a_pair, B, ldb, C + i * ldc, ldc, accumulate);
}

// C [m, n] (+)= A [m, 2 kp] B [2 kp, n], n a multiple of 16, in blocks of 64 columns (A and B as in bf16_tile).
void bf16_gemm(int64_t m, int64_t n, int64_t kp, const bf16_bits* A, int64_t a_row, int64_t a_pair,
               const bf16_bits* B, int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  for (int64_t j = 0; j < n; j += 64) {
    const bf16_bits* Bj = B + 2 * j;
    switch (std::min<int64_t>(4, (n - j) / 16)) {
      case 4: bf16_rows<4>(m, kp, A, a_row, a_pair, Bj, ldb, C + j, ldc, accumulate); break;
      case 3: bf16_rows<3>(m, kp, A, a_row, a_pair, Bj, ldb, C + j, ldc, accumulate); break;
      case 2: bf16_rows<2>(m, kp, A, a_row, a_pair, Bj, ldb, C + j, ldc, accumulate); break;
      default: bf16_rows<1>(m, kp, A, a_row, a_pair, Bj, ldb, C + j, ldc, accumulate); break;
    }
  }
}

// Pair-packing of the float32 x [k, ld] (n % 16 == 0 columns): pair p of column j = (x[2p][j], x[2p+1][j]) rounded
// to bfloat16 (to nearest even), zero past row k.
void pack_pairs(int64_t k, int64_t n, const float* x, int64_t ld, bf16_bits* out) {
  const __m512i lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i hi = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
  for (int64_t p = 0; 2 * p < k; ++p) {
    const float* r0 = x + 2 * p * ld;
    for (int64_t j = 0; j < n; j += 16) {
      const __m512 a = _mm512_loadu_ps(r0 + j), b = 2 * p + 1 < k ? _mm512_loadu_ps(r0 + ld + j) : _mm512_setzero_ps();
      const __m512bh pairs = _mm512_cvtne2ps_pbh(_mm512_permutex2var_ps(a, hi, b), _mm512_permutex2var_ps(a, lo, b));
      _mm512_storeu_si512(out + 2 * (p * n + j), (__m512i)pairs);
    }
  }
}

// The same packing of a bfloat16 x [k, ld] (no rounding): the 16 bits of row 2p below those of row 2p + 1.
void interleave_pairs(int64_t k, int64_t n, const bf16_bits* x, int64_t ld, bf16_bits* out) {
  for (int64_t p = 0; 2 * p < k; ++p) {
    const bf16_bits* r0 = x + 2 * p * ld;
    for (int64_t j = 0; j < n; j += 16) {
      const __m512i a = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r0 + j)));
      const __m512i b = 2 * p + 1 < k
                            ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r0 + ld + j)))
                            : _mm512_setzero_si512();
      _mm512_storeu_si512(out + 2 * (p * n + j), _mm512_or_si512(a, _mm512_slli_epi32(b, 16)));
    }
  }
}

// x^T pair-packed for a bfloat16 x [rows, 2 kp] (row-major): pair p of column i is pair p of row i of x; columns
// rows .. n - 1 are zero.
void transpose_pairs(int64_t rows, int64_t n, int64_t kp, const bf16_bits* x, bf16_bits* out) {
  const pair_bits* in = reinterpret_cast<const pair_bits*>(x);
  pair_bits* o = reinterpret_cast<pair_bits*>(out);
  for (int64_t p = 0; p < kp; ++p) {
    for (int64_t i = 0; i < rows; ++i) o[p * n + i] = in[i * kp + p];
    for (int64_t i = rows; i < n; ++i) o[p * n + i] = 0;
  }
}

inline float widen(bf16_bits x) {
  const uint32_t bits = uint32_t(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Rows [0, c) of the float32 x [c, ld] to bfloat16 out [c, ld_out]: columns j <= i (lower = true: tril, the diagonal
// included, zero above it, up to column ld_out) or all n columns (n % 16 == 0).
void round_rows(int64_t c, int64_t n, const float* x, int64_t ld, bf16_bits* out, int64_t ld_out, bool lower) {
  for (int64_t i = 0; i < c; ++i) {
    for (int64_t j = 0; j < (lower ? ld_out : n); j += 16) {
      const __mmask16 keep = lower ? (j > i ? 0 : __mmask16(0xFFFFu >> std::max<int64_t>(0, 15 - (i - j)))) : 0xFFFF;
      const __m256bh y = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(keep, x + i * ld + j));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i * ld_out + j), (__m256i)y);
    }
  }
}

// Workspace of one sequence, in float32 elements (its bfloat16 buffers take half an element each, rounded up).
inline int64_t bf16_chunk_workspace(int64_t C, int64_t Dk, int64_t Dv) {
  const int64_t cp = round_up(C, 16), c2 = round_up(C, 2);
  const int64_t floats = Dk * Dv + 2 * C * Dv + 2 * C * cp + C * Dv;
  const int64_t halves = Dk * Dv + Dk * cp + c2 * Dk + c2 * Dv + C * cp;
  return floats + (halves + 1) / 2 + 64;
}

// One sequence in bfloat16 (the layout of chunk_forward_seq): q, k [L, Dk], v, o [L, Dv], beta [L] or nullptr (sum
// rule); the float32 S [Dv, Dk] holds the initial state on entry and the final one on return.
void chunk_forward_seq_bf16(int64_t L, int64_t Dk, int64_t Dv, int64_t C, const bf16_bits* q, const bf16_bits* k,
                            const bf16_bits* v, const bf16_bits* beta, float* S, bf16_bits* o, float* work) {
  const int64_t cp = round_up(C, 16), kp = Dk / 2;
  float* St = work;             // S^T                                              [Dk, Dv]
  float* Y = St + Dk * Dv;      // Q S^T, then O; K S^T                              [2C, Dv]
  float* G = Y + 2 * C * Dv;    // Q K^T; K K^T (columns padded to cp)               [2C, cp]
  float* Un = G + 2 * C * cp;   // U'                                               [C, Dv]
  bf16_bits* Sp = reinterpret_cast<bf16_bits*>(Un + C * Dv);  // S^T pair-packed     [Dk / 2, Dv, 2]
  bf16_bits* Kt = Sp + Dk * Dv;                                // K^T pair-packed     [Dk / 2, cp, 2]
  bf16_bits* Kp = Kt + Dk * cp;                                // K pair-interleaved  [C / 2, Dk, 2]
  bf16_bits* Up = Kp + round_up(C, 2) * Dk;                    // U' pair-packed      [C / 2, Dv, 2]
  bf16_bits* P = Up + round_up(C, 2) * Dv;                     // tril(Q K^T)         [C, cp]
  for (int64_t i = 0; i < Dv; ++i)
    for (int64_t j = 0; j < Dk; ++j) St[j * Dv + i] = S[i * Dk + j];
  for (int64_t t0 = 0; t0 < L; t0 += C) {
    const int64_t c = std::min(C, L - t0), cpairs = (c + 1) / 2;
    const bf16_bits *Q = q + t0 * Dk, *K = k + t0 * Dk, *V = v + t0 * Dv;
    float* KS = Y + C * Dv;
    float* A = G + C * cp;
    pack_pairs(Dk, Dv, St, Dv, Sp);
    transpose_pairs(c, cp, kp, K, Kt);
    // Q S^T (eq. 25 with the state entering the chunk), Q K^T; the delta rule also K S^T and K K^T
    bf16_gemm(c, Dv, kp, Q, Dk, 2, Sp, Dv, Y, Dv, false);
    bf16_gemm(c, cp, kp, Q, Dk, 2, Kt, cp, G, cp, false);
    if (beta != nullptr) {
      bf16_gemm(c, Dv, kp, K, Dk, 2, Sp, Dv, KS, Dv, false);
      bf16_gemm(c, cp, kp, K, Dk, 2, Kt, cp, A, cp, false);
      // (I + strictly_lower(diag(beta) K K^T)) U' = diag(beta) (V - K S^T)   (eqs. 20-24, stacked), in float32
      const bf16_bits* b = beta + t0;
      for (int64_t i = 0; i < c; ++i) {
        const float bi = widen(b[i]);
#pragma omp simd
        for (int64_t x = 0; x < Dv; ++x) Un[i * Dv + x] = bi * (widen(V[i * Dv + x]) - KS[i * Dv + x]);
      }
      unit_lower_forward_substitution<float>(c, Dv, A, cp, [b](int64_t i) { return widen(b[i]); }, Un);
      pack_pairs(c, Dv, Un, Dv, Up);
    } else {
      interleave_pairs(c, Dv, V, Dv, Up);  // sum rule: U' = V (eq. 17)
    }
    // O = Q S^T + tril(Q K^T) U'
    round_rows(c, c, G, cp, P, cp, true);
    bf16_gemm(c, Dv, cpairs, P, cp, 2, Up, Dv, Y, Dv, true);
    round_rows(c, Dv, Y, Dv, o + t0 * Dv, Dv, false);
    // S^T <- S^T + K^T U'
    interleave_pairs(c, Dk, K, Dk, Kp);
    bf16_gemm(Dk, Dv, cpairs, Kp, 2, 2 * Dk, Up, Dv, St, Dv, true);
  }
  for (int64_t i = 0; i < Dv; ++i)
    for (int64_t j = 0; j < Dk; ++j) S[i * Dk + j] = St[j * Dv + i];
}
#endif  // AVX-512 BF16

// Whether this build multiplies bfloat16 natively (chunk_forward_bf16 runs).
bool native_bf16() {
#ifdef FWP_NATIVE_BF16
  return true;
#else
  return false;
#endif
}

// The forward of bfloat16 q, k, v [BH, L, D] and beta [BH, L] or None with a float32 state S [BH, Dv, Dk] (initial
// in, final out), writing bfloat16 o [BH, L, Dv]: chunk_forward's products in bfloat16 (above). Dk, Dv multiples of
// 16; one sequence per task.
void chunk_forward_bf16(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const std::optional<at::Tensor>& beta, const at::Tensor& S, int64_t chunk_size,
                        const at::Tensor& o) {
  const ChunkShapes s = chunk_shapes(q, k, v, chunk_size);
  TORCH_CHECK(native_bf16(), "fwp_chunk.chunk_forward_bf16: built without AVX-512 BF16");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && S.scalar_type() == at::kFloat && S.is_contiguous() &&
                  S.sizes() == at::IntArrayRef({s.BH, s.Dv, s.Dk}),
              "fwp_chunk.chunk_forward_bf16: q must be bfloat16 and S a contiguous float32 [BH, Dv, Dk]");
  for (auto* x : {&k, &v, &o}) check(*x, q, "input");
  TORCH_CHECK(v.size(0) == s.BH && v.size(1) == s.L && o.sizes() == v.sizes() && s.Dk % 16 == 0 && s.Dv % 16 == 0,
              "fwp_chunk.chunk_forward_bf16: v and o must be [BH, L, Dv], Dk and Dv multiples of 16");
  if (beta.has_value()) {
    check(*beta, q, "beta");
    TORCH_CHECK(beta->numel() == s.BH * s.L, "fwp_chunk: beta must be [BH, L]");
  }
#ifdef FWP_NATIVE_BF16
  auto bits = [](const at::Tensor& x) { return reinterpret_cast<bf16_bits*>(x.data_ptr<at::BFloat16>()); };
  const bf16_bits *qp = bits(q), *kp = bits(k), *vp = bits(v), *bp = beta.has_value() ? bits(*beta) : nullptr;
  bf16_bits* op = bits(o);
  float* Sp = S.data_ptr<float>();
  for_sequences(s.BH, [&](int64_t begin, int64_t end) {
    std::vector<float> work(bf16_chunk_workspace(s.C, s.Dk, s.Dv));
    for (int64_t bh = begin; bh < end; ++bh)
      chunk_forward_seq_bf16(s.L, s.Dk, s.Dv, s.C, qp + bh * s.L * s.Dk, kp + bh * s.L * s.Dk, vp + bh * s.L * s.Dv,
                             bp != nullptr ? bp + bh * s.L : nullptr, Sp + bh * s.Dv * s.Dk, op + bh * s.L * s.Dv,
                             work.data());
  });
#endif
}

// One position for every sequence (decoding), each row of the state read and written once. Row i of S [Dv, Dk]
// (value i) with the key k, query q, and the decay a = exp(g) of the gated delta rule (a = 1 without g):
//   delta rule (eqs. 20, 24, 25):  d_i = beta (v_i - a S_i k),  S'_i = a S_i + d_i k^T,
//                                  o_i = S'_i q = a S_i q + d_i (k q)
//   sum rule (eqs. 10-11):          d_i = v_i
// q, k [BH, Dk], v [BH, Dv], beta [BH] or None (sum rule), g [BH] or None, S [BH, Dv, Dk] or None (zeros); writes
// S_out (may be S) and o [BH, Dv]. Rows in parallel over threads; four rows of one head at a time, so that the dot products have eight
// independent sums (one row's two sums leave the vector unit waiting on the adds: 1.7x slower, measured).
template <typename T>
inline void decode_four_rows(int64_t Dk, const T* Si, const T* kk, const T* qq, const T* v, const T* beta, T a,
                             T kq, T* So, T* o) {
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
    T* out = So + r * Dk;
    if (Si != nullptr) {
      const T* in = Si + r * Dk;
#pragma omp simd
      for (int64_t j = 0; j < Dk; ++j) out[j] = a * in[j] + d * kk[j];
    } else {
#pragma omp simd
      for (int64_t j = 0; j < Dk; ++j) out[j] = d * kk[j];
    }
    o[r] = a * sq[r] + d * kq;
  }
}

template <typename T>
void decode_rows(int64_t r0, int64_t r1, int64_t Dv, int64_t Dk, const T* q, const T* k, const T* v, const T* beta,
                 const T* g, const T* S, T* S_out, T* o) {
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
      decode_four_rows<T>(Dk, S != nullptr ? S + r * Dk : nullptr, kk, qq, v + r, bb, a, kq, S_out + r * Dk, o + r);
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
      T* So = S_out + r * Dk;
#pragma omp simd
      for (int64_t j = 0; j < Dk; ++j) So[j] = (S != nullptr ? a * S[r * Dk + j] : T(0)) + d * kk[j];
      o[r] = a * sq + d * kq;
    }
  }
}

void decode_step(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& beta,
                 const std::optional<at::Tensor>& g, const std::optional<at::Tensor>& S, const at::Tensor& S_out,
                 const at::Tensor& o) {
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
                            bp, gp, Sp, S_out.data_ptr<scalar_t>(), o.data_ptr<scalar_t>());
    });
  });
}

}  // namespace

FWP_TORCH_LIBRARY(FWP_OP_NAMESPACE, m) {
  m.def(
      "chunk_forward(Tensor q, Tensor k, Tensor v, Tensor? beta, Tensor(a!) S, int chunk_size, Tensor(b!)? o, "
      "Tensor(c!)? entering, Tensor(d!)? u_new) -> ()");
  m.def(
      "chunk_backward(Tensor q, Tensor k, Tensor v, Tensor? beta, Tensor s0, int chunk_size, Tensor dout, "
      "Tensor(a!) dS, Tensor(b!) dq, Tensor(c!) dk, Tensor(d!) dv, Tensor(e!)? dbeta) -> ()");
  m.def(
      "decode_step(Tensor q, Tensor k, Tensor v, Tensor? beta, Tensor? g, Tensor? S, Tensor(a!) S_out, Tensor(b!) o) "
      "-> ()");
  m.def(
      "chunk_forward_bf16(Tensor q, Tensor k, Tensor v, Tensor? beta, Tensor(a!) S, int chunk_size, Tensor(b!) o) "
      "-> ()");
  m.def("native_bf16", &native_bf16);  // no tensor argument: one kernel for every dispatch key
}

FWP_TORCH_LIBRARY_IMPL(FWP_OP_NAMESPACE, CPU, m) {
  m.impl("chunk_forward", &chunk_forward);
  m.impl("chunk_backward", &chunk_backward);
  m.impl("decode_step", &decode_step);
  m.impl("chunk_forward_bf16", &chunk_forward_bf16);
}
