// Chunkwise gated delta rule on CPU (Yang, Kautz, Hatamizadeh 2025, "Gated Delta Networks", sec. 3.1):
//
//   W_t = a_t W_{t-1} + beta_t (v_t - a_t W_{t-1} k_t) k_t^T,   a_t = exp(g_t),   o_t = W_t q_t,
//
// one (batch, head) sequence per task of at::parallel_for, its chunks in order. Built on first use by
// kernels/gated_delta_rule_kernels.py (cpp_build.register_cpu_kernel). Derivation: kernels/README.md, "Gated delta
// rule". Per chunk of c rows, with the state S [Dv, Dk] entering it (y = S q), the cumulative log-decay
// gamma_i = g_1 + ... + g_i, Gamma_i = exp(gamma_i), D_ij = exp(gamma_i - gamma_j) (j <= i), lambda_j =
// exp(gamma_c - gamma_j):
//
//   (I + A) U' = diag(beta) X,   X = V - diag(Gamma) K S^T,   A = diag(beta) KD,   KD = strictly_lower(K K^T * D)
//   O = diag(Gamma) Q S^T + P U',   P = tril(Q K^T) * D,    S <- Gamma_c S + U'^T diag(lambda) K
//
// U' comes from one triangular solve per chunk (T = (I + A)^-1 is never formed); every product is one call to the
// BLAS that PyTorch links. The Python wrapper allocates every output; this file runs loops over raw pointers.
// The BLAS wrappers repeat those of chunk_delta.cpp: each kernel is one self-contained source file (a saved model
// folder carries it as a string and builds it alone).

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

// The ops' namespace: fwp_gated_chunk_<build key> when cpp_build compiles this file (-DFWP_OP_NAMESPACE), one
// per build, so that builds of different sources (the package's, a saved model folder's older copy) load side by
// side in one process (two TORCH_LIBRARY blocks of one namespace abort it).
#ifndef FWP_OP_NAMESPACE
#define FWP_OP_NAMESPACE fwp_gated_chunk
#endif
// TORCH_LIBRARY pastes its argument unexpanded: one more macro level expands FWP_OP_NAMESPACE first.
#define FWP_TORCH_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define FWP_TORCH_LIBRARY_IMPL(ns, key, m) TORCH_LIBRARY_IMPL(ns, key, m)

extern "C" {
void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k, const float* alpha,
            const float* a, const int* lda, const float* b, const int* ldb, const float* beta, float* c,
            const int* ldc);
void dgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k, const double* alpha,
            const double* a, const int* lda, const double* b, const int* ldb, const double* beta, double* c,
            const int* ldc);
void strsm_(const char* side, const char* uplo, const char* transa, const char* diag, const int* m, const int* n,
            const float* alpha, const float* a, const int* lda, float* b, const int* ldb);
void dtrsm_(const char* side, const char* uplo, const char* transa, const char* diag, const int* m, const int* n,
            const double* alpha, const double* a, const int* lda, double* b, const int* ldb);
// MKL's per-thread thread count, C interface; weak, absent with another BLAS (see SequentialBlasInTask).
int MKL_Set_Num_Threads_Local(int nt) __attribute__((weak));
}

namespace {

// Inside a parallel task MKL would still take its threaded path (torch.set_num_threads turns its dynamic mode off),
// a nested fork/join per small BLAS call: each task runs its BLAS single-threaded (as chunk_delta.cpp's tasks do;
// each source is built and shipped on its own, so the few lines are not shared).
struct SequentialBlasInTask {
  int saved = 0;
  SequentialBlasInTask() { saved = MKL_Set_Num_Threads_Local != nullptr ? MKL_Set_Num_Threads_Local(1) : 0; }
  ~SequentialBlasInTask() { if (MKL_Set_Num_Threads_Local != nullptr) MKL_Set_Num_Threads_Local(saved); }
};

inline void blas_gemm(char ta, char tb, int m, int n, int k, float alpha, const float* a, int lda, const float* b,
                      int ldb, float beta, float* c, int ldc) {
  sgemm_(&ta, &tb, &m, &n, &k, &alpha, a, &lda, b, &ldb, &beta, c, &ldc);
}
inline void blas_gemm(char ta, char tb, int m, int n, int k, double alpha, const double* a, int lda,
                      const double* b, int ldb, double beta, double* c, int ldc) {
  dgemm_(&ta, &tb, &m, &n, &k, &alpha, a, &lda, b, &ldb, &beta, c, &ldc);
}
inline void blas_trsm(char ta, int m, int n, const float* a, int lda, float* b, int ldb) {
  const char side = 'R', uplo = 'U', diag = 'U';
  const float one = 1;
  strsm_(&side, &uplo, &ta, &diag, &m, &n, &one, a, &lda, b, &ldb);
}
inline void blas_trsm(char ta, int m, int n, const double* a, int lda, double* b, int ldb) {
  const char side = 'R', uplo = 'U', diag = 'U';
  const double one = 1;
  dtrsm_(&side, &uplo, &ta, &diag, &m, &n, &one, a, &lda, b, &ldb);
}

// Row-major C [m, n] = alpha op(A) op(B) + beta C (the column-major C^T = op(B)^T op(A)^T); lda etc. row strides.
template <typename T>
inline void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, T alpha, const T* A, int64_t lda, const T* B,
                 int64_t ldb, T beta, T* C, int64_t ldc) {
  blas_gemm(tb ? 'T' : 'N', ta ? 'T' : 'N', int(n), int(m), int(k), alpha, B, int(ldb), A, int(lda), beta, C,
            int(ldc));
}

// X <- L^-1 X (transposed: L^-T X) in place; L [c, c] row-major unit lower (diagonal and upper part not read).
template <typename T>
inline void unit_lower_solve(bool transposed, int64_t c, int64_t n, const T* L, T* X) {
  blas_trsm(transposed ? 'T' : 'N', int(n), int(c), L, int(c), X, int(n));
}

// The chunk's decays from g [c]: gamma (cumulative), Gamma = exp(gamma), lambda = exp(gamma_c - gamma), and
// D [c, c] = exp(gamma_i - gamma_j) for j <= i, 0 above the diagonal (from the differences: no under/overflow).
template <typename T>
struct Decays {
  std::vector<T> gamma, Gamma, lambda, D;
  explicit Decays(int64_t C) : gamma(C), Gamma(C), lambda(C), D(C * C) {}
  void compute(int64_t c, const T* g) {
    T acc = 0;
    for (int64_t i = 0; i < c; ++i) gamma[i] = acc += g[i];
    for (int64_t i = 0; i < c; ++i) {
      Gamma[i] = std::exp(gamma[i]);
      lambda[i] = std::exp(gamma[c - 1] - gamma[i]);
      for (int64_t j = 0; j < c; ++j) D[i * c + j] = j <= i ? std::exp(gamma[i] - gamma[j]) : T(0);
    }
  }
};

// Per-chunk buffers of forward and backward, [c, c] and [c, D] matrices at the chunk length C.
template <typename T>
struct Work {
  Decays<T> dec;
  std::vector<T> P, KD, A, dP, dA, X, dR, Kl, M1, M2;
  Work(int64_t C, int64_t Dk, int64_t Dv)
      : dec(C), P(C * C), KD(C * C), A(C * C), dP(C * C), dA(C * C), X(C * Dv), dR(C * Dv), Kl(C * Dk),
        M1(C * Dk), M2(C * Dk) {}
};

// KD = strictly_lower(K K^T * D) and A = diag(beta) KD (the solver reads A's strict lower part only).
template <typename T>
void build_A(int64_t c, int64_t Dk, const T* K, const T* b, Work<T>& w) {
  gemm<T>(false, true, c, c, Dk, T(1), K, Dk, K, Dk, T(0), w.KD.data(), c);
  for (int64_t i = 0; i < c; ++i)
    for (int64_t j = 0; j < c; ++j) {
      T& kd = w.KD[i * c + j];
      kd = j < i ? kd * w.dec.D[i * c + j] : T(0);
      w.A[i * c + j] = b[i] * kd;
    }
}

// X = V - diag(Gamma) K S^T (into w.X), then U' = (I + A)^-1 diag(beta) X (into Un).
template <typename T>
void solve_values(int64_t c, int64_t Dk, int64_t Dv, const T* K, const T* V, const T* b, const T* S, T* Un,
                  Work<T>& w) {
  gemm<T>(false, true, c, Dv, Dk, T(1), K, Dk, S, Dk, T(0), w.X.data(), Dv);
  for (int64_t i = 0; i < c; ++i)
    for (int64_t j = 0; j < Dv; ++j) {
      T& x = w.X[i * Dv + j];
      x = V[i * Dv + j] - w.dec.Gamma[i] * x;
      Un[i * Dv + j] = b[i] * x;
    }
  unit_lower_solve<T>(false, c, Dv, w.A.data(), Un);
}

// One sequence: q, k [L, Dk], v [L, Dv], beta, g [L]; S [Dv, Dk]: initial state in, final state out. Writes o
// [L, Dv] (unless nullptr) and, for the backward, the state entering each chunk and U' (unless nullptr).
template <typename T>
void forward_seq(int64_t L, int64_t Dk, int64_t Dv, int64_t C, const T* q, const T* k, const T* v, const T* beta,
                 const T* g, T* S, T* o, T* entering, T* u_new, Work<T>& w, std::vector<T>& u_buf) {
  for (int64_t t0 = 0, n = 0; t0 < L; t0 += C, ++n) {
    const int64_t c = std::min(C, L - t0);
    const T *Q = q + t0 * Dk, *K = k + t0 * Dk, *V = v + t0 * Dv, *b = beta + t0;
    T* Un = u_new != nullptr ? u_new + t0 * Dv : u_buf.data();
    if (entering != nullptr) std::memcpy(entering + n * Dv * Dk, S, sizeof(T) * Dv * Dk);
    w.dec.compute(c, g + t0);
    build_A(c, Dk, K, b, w);
    solve_values(c, Dk, Dv, K, V, b, S, Un, w);
    if (o != nullptr) {  // O = diag(Gamma) Q S^T + (tril(Q K^T) * D) U'
      T* O = o + t0 * Dv;
      gemm<T>(false, true, c, c, Dk, T(1), Q, Dk, K, Dk, T(0), w.P.data(), c);
      for (int64_t i = 0; i < c * c; ++i) w.P[i] *= w.dec.D[i];
      gemm<T>(false, true, c, Dv, Dk, T(1), Q, Dk, S, Dk, T(0), O, Dv);
      for (int64_t i = 0; i < c; ++i)
        for (int64_t j = 0; j < Dv; ++j) O[i * Dv + j] *= w.dec.Gamma[i];
      gemm<T>(false, false, c, Dv, c, T(1), w.P.data(), c, Un, Dv, T(1), O, Dv);
    }
    // S <- Gamma_c S + U'^T diag(lambda) K
    for (int64_t i = 0; i < c; ++i)
      for (int64_t j = 0; j < Dk; ++j) w.Kl[i * Dk + j] = w.dec.lambda[i] * K[i * Dk + j];
    const T decay = w.dec.Gamma[c - 1];
    for (int64_t i = 0; i < Dv * Dk; ++i) S[i] *= decay;
    gemm<T>(true, false, Dv, Dk, c, T(1), Un, Dv, w.Kl.data(), Dk, T(1), S, Dk);
  }
}

// Row sums of the elementwise product of two row-major [c, n] matrices: out[i] (+)= sum_j x_ij y_ij.
template <typename T>
inline void rowdot(int64_t c, int64_t n, const T* x, const T* y, T* out, bool add) {
  for (int64_t i = 0; i < c; ++i) {
    T acc = 0;
    for (int64_t j = 0; j < n; ++j) acc += x[i * n + j] * y[i * n + j];
    out[i] = add ? out[i] + acc : acc;
  }
}

// Gradients reaching O and S' (README: dU', dQ, dK's first terms, dS), with dgam collecting the decay's gradient.
// dS: dS' in, Gamma_c dS' + dO^T diag(Gamma) Q out (the solve's term follows in backward_solve).
template <typename T>
void backward_outputs(int64_t c, int64_t Dk, int64_t Dv, const T* Q, const T* K, const T* Un, const T* dO,
                      const T* S, T* dS, T* dQ, T* dK, T* dgam, Work<T>& w) {
  const Decays<T>& d = w.dec;
  T* dU = w.dR.data();
  // dU' = diag(lambda) K dS'^T + P^T dO   (P recomputed)
  for (int64_t i = 0; i < c; ++i)
    for (int64_t j = 0; j < Dk; ++j) w.Kl[i * Dk + j] = d.lambda[i] * K[i * Dk + j];
  gemm<T>(false, true, c, Dv, Dk, T(1), w.Kl.data(), Dk, dS, Dk, T(0), dU, Dv);
  gemm<T>(false, true, c, c, Dk, T(1), Q, Dk, K, Dk, T(0), w.P.data(), c);
  for (int64_t i = 0; i < c * c; ++i) w.P[i] *= d.D[i];
  gemm<T>(true, false, c, Dv, c, T(1), w.P.data(), c, dO, Dv, T(1), dU, Dv);
  // U' dS' -> dK = diag(lambda) U' dS', dlambda_i = (U' dS')_i . k_i;  Gamma_c <S, dS'>
  T* UdS = w.M1.data();
  gemm<T>(false, false, c, Dk, Dv, T(1), Un, Dv, dS, Dk, T(0), UdS, Dk);
  T dlam_sum = 0, dGc = 0;
  for (int64_t i = 0; i < c; ++i) {
    T acc = 0;
    for (int64_t j = 0; j < Dk; ++j) {
      acc += UdS[i * Dk + j] * K[i * Dk + j];
      dK[i * Dk + j] = d.lambda[i] * UdS[i * Dk + j];
    }
    dgam[i] = -d.lambda[i] * acc;
    dlam_sum += d.lambda[i] * acc;
  }
  for (int64_t i = 0; i < Dv * Dk; ++i) dGc += S[i] * dS[i];
  dgam[c - 1] += dlam_sum + d.Gamma[c - 1] * dGc;
  // dP = dO U'^T (lower); H = dP * P into w.dP's place later; dPD = dP * D
  gemm<T>(false, true, c, c, Dv, T(1), dO, Dv, Un, Dv, T(0), w.dP.data(), c);
  // dO S -> dQ = diag(Gamma) dO S + dPD K, dgam_i += Gamma_i (dO S)_i . q_i
  T* dOS = w.M2.data();
  gemm<T>(false, false, c, Dk, Dv, T(1), dO, Dv, S, Dk, T(0), dOS, Dk);
  for (int64_t i = 0; i < c; ++i) {
    T acc = 0;
    for (int64_t j = 0; j < Dk; ++j) {
      acc += dOS[i * Dk + j] * Q[i * Dk + j];
      dQ[i * Dk + j] = d.Gamma[i] * dOS[i * Dk + j];
    }
    dgam[i] += d.Gamma[i] * acc;
  }
  // dS = Gamma_c dS' + dO^T diag(Gamma) Q
  for (int64_t i = 0; i < Dv * Dk; ++i) dS[i] *= d.Gamma[c - 1];
  T* GQ = w.M2.data();
  for (int64_t i = 0; i < c; ++i)
    for (int64_t j = 0; j < Dk; ++j) GQ[i * Dk + j] = d.Gamma[i] * Q[i * Dk + j];
  gemm<T>(true, false, Dv, Dk, c, T(1), dO, Dv, GQ, Dk, T(1), dS, Dk);
}

// Through D: dgam_i += sum_j H_ij - sum_j H_ji with H = dP * P + dKD * KD; then dQ += (dP * D) K, dK += (dP * D)^T Q
// (+ dE K + dE^T K, dE = dKD * D). On entry w.dP = dO U'^T, w.dA = dKD = diag(beta) dA.
template <typename T>
void backward_decay_products(int64_t c, int64_t Dk, const T* Q, const T* K, T* dQ, T* dK, T* dgam, Work<T>& w) {
  const T* D = w.dec.D.data();
  for (int64_t i = 0; i < c; ++i)
    for (int64_t j = 0; j <= i; ++j) {
      const T h = w.dP[i * c + j] * w.P[i * c + j] + w.dA[i * c + j] * w.KD[i * c + j];
      dgam[i] += h;
      dgam[j] -= h;
    }
  for (int64_t i = 0; i < c * c; ++i) {
    w.dP[i] *= D[i];  // zero above the diagonal
    w.dA[i] *= D[i];  // dE, strictly lower
  }
  gemm<T>(false, false, c, Dk, c, T(1), w.dP.data(), c, K, Dk, T(1), dQ, Dk);
  gemm<T>(true, false, c, Dk, c, T(1), w.dP.data(), c, Q, Dk, T(1), dK, Dk);
  gemm<T>(false, false, c, Dk, c, T(1), w.dA.data(), c, K, Dk, T(1), dK, Dk);
  gemm<T>(true, false, c, Dk, c, T(1), w.dA.data(), c, K, Dk, T(1), dK, Dk);
}

// Through the solve (I + A) U' = diag(beta) X, X = V - diag(Gamma) K S^T (w.X recomputed), w.dR = dU' on entry:
// dR = (I + A)^-T dU', dX = diag(beta) dR = dV, dbeta = rowsum(dR * X) + rowsum(dA * KD), dA = -strictly_lower(dR
// U'^T); dK -= diag(Gamma) dX S, dS -= dX^T diag(Gamma) K, dgam_i -= Gamma_i dX_i . (K S^T)_i.
template <typename T>
void backward_solve(int64_t c, int64_t Dk, int64_t Dv, const T* K, const T* V, const T* b, const T* Un,
                    const T* S, T* dS, T* dK, T* dV, T* db, T* dgam, Work<T>& w) {
  const Decays<T>& d = w.dec;
  unit_lower_solve<T>(true, c, Dv, w.A.data(), w.dR.data());
  rowdot(c, Dv, w.dR.data(), w.X.data(), db, false);
  for (int64_t i = 0; i < c; ++i) {
    T acc = 0;  // dX_i . (K S^T)_i, with K S^T = (V - X) / Gamma written as Gamma (K S^T) = V - X
    for (int64_t j = 0; j < Dv; ++j) {
      dV[i * Dv + j] = b[i] * w.dR[i * Dv + j];
      acc += dV[i * Dv + j] * (V[i * Dv + j] - w.X[i * Dv + j]);
    }
    dgam[i] -= acc;
  }
  T* GK = w.M1.data();
  for (int64_t i = 0; i < c; ++i)
    for (int64_t j = 0; j < Dk; ++j) GK[i * Dk + j] = d.Gamma[i] * K[i * Dk + j];
  T* dVS = w.M2.data();
  gemm<T>(false, false, c, Dk, Dv, T(1), dV, Dv, S, Dk, T(0), dVS, Dk);
  for (int64_t i = 0; i < c; ++i)
    for (int64_t j = 0; j < Dk; ++j) dK[i * Dk + j] -= d.Gamma[i] * dVS[i * Dk + j];
  gemm<T>(true, false, Dv, Dk, c, T(-1), dV, Dv, GK, Dk, T(1), dS, Dk);
  // dA = -strictly_lower(dR U'^T); dbeta += rowsum(dA * KD); w.dA <- dKD = diag(beta) dA
  gemm<T>(false, true, c, c, Dv, T(-1), w.dR.data(), Dv, Un, Dv, T(0), w.dA.data(), c);
  for (int64_t i = 0; i < c; ++i) {
    T acc = 0;
    for (int64_t j = 0; j < c; ++j) {
      T& a = w.dA[i * c + j];
      if (j >= i) a = T(0);
      acc += a * w.KD[i * c + j];
      a *= b[i];
    }
    db[i] += acc;
  }
}

// The backward of one sequence, chunks from last to first, from the states entering the chunks and U' of
// forward_seq. dS: the final state's gradient in, the initial state's out.
template <typename T>
void backward_seq(int64_t L, int64_t Dk, int64_t Dv, int64_t C, const T* q, const T* k, const T* v, const T* beta,
                  const T* g, const T* entering, const T* u_new, const T* dout, T* dS, T* dq, T* dk, T* dv, T* dbeta,
                  T* dg, Work<T>& w, std::vector<T>& dgam) {
  const int64_t N = (L + C - 1) / C;
  for (int64_t n = N - 1; n >= 0; --n) {
    const int64_t t0 = n * C, c = std::min(C, L - t0);
    const T *Q = q + t0 * Dk, *K = k + t0 * Dk, *V = v + t0 * Dv, *b = beta + t0, *Un = u_new + t0 * Dv;
    const T* S = entering + n * Dv * Dk;
    w.dec.compute(c, g + t0);
    build_A(c, Dk, K, b, w);
    backward_outputs(c, Dk, Dv, Q, K, Un, dout + t0 * Dv, S, dS, dq + t0 * Dk, dk + t0 * Dk, dgam.data(), w);
    // X = V - diag(Gamma) K S^T, recomputed into w.X (solve_values' first half, U' already known)
    gemm<T>(false, true, c, Dv, Dk, T(1), K, Dk, S, Dk, T(0), w.X.data(), Dv);
    for (int64_t i = 0; i < c; ++i)
      for (int64_t j = 0; j < Dv; ++j) w.X[i * Dv + j] = V[i * Dv + j] - w.dec.Gamma[i] * w.X[i * Dv + j];
    backward_solve(c, Dk, Dv, K, V, b, Un, S, dS, dk + t0 * Dk, dv + t0 * Dv, dbeta + t0, dgam.data(), w);
    backward_decay_products(c, Dk, Q, K, dq + t0 * Dk, dk + t0 * Dk, dgam.data(), w);
    T acc = 0;  // gamma = cumsum(g): dg_j = sum_{i >= j} dgamma_i
    for (int64_t i = c - 1; i >= 0; --i) dg[t0 + i] = acc += dgam[i];
  }
}

void check(const at::Tensor& x, const at::Tensor& like, int64_t numel, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == like.scalar_type() && x.is_contiguous() &&
                  x.numel() == numel,
              "fwp_gated_chunk: `", name, "` must be a contiguous CPU tensor of dtype ", like.scalar_type(), " with ",
              numel, " elements");
}

struct Shapes {
  int64_t BH, L, Dk, Dv, C, N;
};

Shapes shapes(const at::Tensor& q, const at::Tensor& v, int64_t chunk_size) {
  TORCH_CHECK(q.dim() == 3 && v.dim() == 3 && chunk_size >= 1, "fwp_gated_chunk: q, v must be [BH, L, D]");
  const int64_t BH = q.size(0), L = q.size(1), Dk = q.size(2), Dv = v.size(2);
  const int64_t C = std::min(chunk_size, std::max<int64_t>(L, 1));
  TORCH_CHECK(std::max({L * std::max(Dk, Dv), C * C, Dv * Dk}) < std::numeric_limits<int>::max(),
              "fwp_gated_chunk: sizes exceed the 32-bit BLAS interface");
  return {BH, L, Dk, Dv, C, (L + C - 1) / C};
}

// q, k [BH, L, Dk], v [BH, L, Dv], beta, g [BH, L]; S [BH, Dv, Dk]: initial state in, final state out; o [BH, L, Dv].
void gated_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& beta,
                   const at::Tensor& g, const at::Tensor& S, int64_t chunk_size, const at::Tensor& o) {
  const Shapes s = shapes(q, v, chunk_size);
  check(k, q, s.BH * s.L * s.Dk, "k");
  for (auto* x : {&v, &o}) check(*x, q, s.BH * s.L * s.Dv, "v / o");
  for (auto* x : {&beta, &g}) check(*x, q, s.BH * s.L, "beta / g");
  check(S, q, s.BH * s.Dv * s.Dk, "S");
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "gated_forward", [&] {
    at::parallel_for(0, s.BH, 1, [&](int64_t begin, int64_t end) {
      SequentialBlasInTask sequential_blas;
      Work<scalar_t> w(s.C, s.Dk, s.Dv);
      std::vector<scalar_t> u_buf(s.C * s.Dv);
      for (int64_t bh = begin; bh < end; ++bh) {
        forward_seq<scalar_t>(s.L, s.Dk, s.Dv, s.C, q.data_ptr<scalar_t>() + bh * s.L * s.Dk,
                              k.data_ptr<scalar_t>() + bh * s.L * s.Dk, v.data_ptr<scalar_t>() + bh * s.L * s.Dv,
                              beta.data_ptr<scalar_t>() + bh * s.L, g.data_ptr<scalar_t>() + bh * s.L,
                              S.data_ptr<scalar_t>() + bh * s.Dv * s.Dk, o.data_ptr<scalar_t>() + bh * s.L * s.Dv,
                              nullptr, nullptr, w, u_buf);
      }
    });
  });
}

// Gradients of gated_forward. dS [BH, Dv, Dk]: the final state's gradient in, the initial state's out. The states
// entering the chunks and U' are recomputed per sequence (one state per chunk, in a per-thread buffer).
void gated_backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& beta,
                    const at::Tensor& g, const at::Tensor& s0, int64_t chunk_size, const at::Tensor& dout,
                    const at::Tensor& dS, const at::Tensor& dq, const at::Tensor& dk, const at::Tensor& dv,
                    const at::Tensor& dbeta, const at::Tensor& dg) {
  const Shapes s = shapes(q, v, chunk_size);
  for (auto* x : {&k, &dq, &dk}) check(*x, q, s.BH * s.L * s.Dk, "k / dq / dk");
  for (auto* x : {&v, &dout, &dv}) check(*x, q, s.BH * s.L * s.Dv, "v / dout / dv");
  for (auto* x : {&beta, &g, &dbeta, &dg}) check(*x, q, s.BH * s.L, "beta / g / dbeta / dg");
  for (auto* x : {&s0, &dS}) check(*x, q, s.BH * s.Dv * s.Dk, "s0 / dS");
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "gated_backward", [&] {
    at::parallel_for(0, s.BH, 1, [&](int64_t begin, int64_t end) {
      SequentialBlasInTask sequential_blas;
      Work<scalar_t> w(s.C, s.Dk, s.Dv);
      std::vector<scalar_t> entering(s.N * s.Dv * s.Dk), state(s.Dv * s.Dk), u_new(s.L * s.Dv), dgam(s.C);
      for (int64_t bh = begin; bh < end; ++bh) {
        const int64_t ok = bh * s.L * s.Dk, ov = bh * s.L * s.Dv, ob = bh * s.L, os = bh * s.Dv * s.Dk;
        const scalar_t *qs = q.data_ptr<scalar_t>() + ok, *ks = k.data_ptr<scalar_t>() + ok;
        const scalar_t *vs = v.data_ptr<scalar_t>() + ov, *bs = beta.data_ptr<scalar_t>() + ob;
        const scalar_t* gs = g.data_ptr<scalar_t>() + ob;
        std::memcpy(state.data(), s0.data_ptr<scalar_t>() + os, sizeof(scalar_t) * s.Dv * s.Dk);
        forward_seq<scalar_t>(s.L, s.Dk, s.Dv, s.C, qs, ks, vs, bs, gs, state.data(), nullptr, entering.data(),
                              u_new.data(), w, u_new);
        backward_seq<scalar_t>(s.L, s.Dk, s.Dv, s.C, qs, ks, vs, bs, gs, entering.data(), u_new.data(),
                               dout.data_ptr<scalar_t>() + ov, dS.data_ptr<scalar_t>() + os,
                               dq.data_ptr<scalar_t>() + ok, dk.data_ptr<scalar_t>() + ok,
                               dv.data_ptr<scalar_t>() + ov, dbeta.data_ptr<scalar_t>() + ob,
                               dg.data_ptr<scalar_t>() + ob, w, dgam);
      }
    });
  });
}

}  // namespace

FWP_TORCH_LIBRARY(FWP_OP_NAMESPACE, m) {
  m.def("gated_forward(Tensor q, Tensor k, Tensor v, Tensor beta, Tensor g, Tensor(a!) S, int chunk_size, "
        "Tensor(b!) o) -> ()");
  m.def("gated_backward(Tensor q, Tensor k, Tensor v, Tensor beta, Tensor g, Tensor s0, int chunk_size, "
        "Tensor dout, Tensor(a!) dS, Tensor(b!) dq, Tensor(c!) dk, Tensor(d!) dv, Tensor(e!) dbeta, "
        "Tensor(f!) dg) -> ()");
}

FWP_TORCH_LIBRARY_IMPL(FWP_OP_NAMESPACE, CPU, m) {
  m.impl("gated_forward", &gated_forward);
  m.impl("gated_backward", &gated_backward);
}
