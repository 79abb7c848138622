// Fused CPU scans of the recurrent Fast Weight Programmers (Irie, Schlag, Csordas, Schmidhuber 2021).
//
// Built on first use by kernels/rfwp_scan.py with torch.utils.cpp_extension.load; the equations, the
// tensor layouts and the derivation of the backward are in kernels/README.md ("Recurrent FWP scans").
// The Python wrappers allocate every output and pass it in: this file only runs loops over raw
// pointers, one (batch, head) sequence per task of at::parallel_for, with the fast weight matrices
// of the sequence in a small local buffer.
//
// Backward passes never read a stored per-step fast weight: they start from the final one and undo
// the delta rule step by step, R_{t-1} = R_t - delta_t k_t^T, using delta_t = beta_t (v_t - R_{t-1} k_t)
// rebuilt from the stored retrieved value R_{t-1} k_t (one vector per step).
//
// Conventions: a matrix M [n, n] is row-major, y = M x reads a value of M with key x. Positions whose
// mask is 0 leave every state (fast weights, previous output, cell) unchanged and output y_{t-1}.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

// The ops' namespace: fwp_rfwp_<build key> when cpp_build compiles this file (-DFWP_OP_NAMESPACE), one
// per build, so that builds of different sources (the package's, a saved model folder's older copy) load side by
// side in one process (two TORCH_LIBRARY blocks of one namespace abort it).
#ifndef FWP_OP_NAMESPACE
#define FWP_OP_NAMESPACE fwp_rfwp
#endif
// TORCH_LIBRARY pastes its argument unexpanded: one more macro level expands FWP_OP_NAMESPACE first.
#define FWP_TORCH_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define FWP_TORCH_LIBRARY_IMPL(ns, key, m) TORCH_LIBRARY_IMPL(ns, key, m)

namespace {

// Cells of the fast RNN scan (keep in sync with CELLS in kernels/rfwp_scan.py).
enum Cell : int64_t { RNN_A = 0, RNN_B = 1, LSTM_A = 2, LSTM_B = 3, LSTM_C = 4, LSTM_D = 5 };

inline bool is_lstm(int64_t cell) { return cell >= LSTM_A; }
// Versions A feed y_{t-1} (already a softmax output) to R_t; the others feed softmax(y_{t-1}).
inline bool softmax_input(int64_t cell) { return cell != RNN_A && cell != LSTM_A; }

template <typename T>
inline T sigmoid(T x) {
  return T(1) / (T(1) + std::exp(-x));
}

template <typename T>
void softmax(const T* x, T* out, int64_t n) {
  T m = x[0];
  for (int64_t i = 1; i < n; ++i) m = std::max(m, x[i]);
  T sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += (out[i] = std::exp(x[i] - m));
  for (int64_t i = 0; i < n; ++i) out[i] /= sum;
}

// Backward of y = softmax(x): out = y * (g - <g, y>). `out` may alias `g`.
template <typename T>
void softmax_backward(const T* y, const T* g, T* out, int64_t n) {
  T dot = 0;
  for (int64_t i = 0; i < n; ++i) dot += g[i] * y[i];
  for (int64_t i = 0; i < n; ++i) out[i] = y[i] * (g[i] - dot);
}

// The small dense helpers below carry `omp simd` hints (compiled with -fopenmp, which also makes
// at::parallel_for parallel): they let the compiler vectorise the dot-product reductions, which strict IEEE
// ordering otherwise forbids.

// y = M x
template <typename T>
inline void matvec(const T* __restrict__ M, const T* __restrict__ x, T* __restrict__ y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const T* row = M + i * n;
    T acc = 0;
#pragma omp simd reduction(+ : acc)
    for (int64_t j = 0; j < n; ++j) acc += row[j] * x[j];
    y[i] = acc;
  }
}

// y += M^T x
template <typename T>
inline void matvec_t_acc(const T* __restrict__ M, const T* __restrict__ x, T* __restrict__ y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const T* row = M + i * n;
    const T xi = x[i];
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) y[j] += row[j] * xi;
  }
}

// M += a b^T
template <typename T>
inline void outer_acc(T* __restrict__ M, const T* __restrict__ a, const T* __restrict__ b, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    T* row = M + i * n;
    const T ai = a[i];
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) row[j] += ai * b[j];
  }
}

template <typename T>
inline T dot(const T* __restrict__ a, const T* __restrict__ b, int64_t n) {
  T acc = 0;
#pragma omp simd reduction(+ : acc)
  for (int64_t j = 0; j < n; ++j) acc += a[j] * b[j];
  return acc;
}

// y += alpha x
template <typename T>
inline void axpy(T alpha, const T* __restrict__ x, T* __restrict__ y, int64_t n) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) y[j] += alpha * x[j];
}

// One delta rule write followed by a read, in a single pass over the rows of R: row i of every quantity needs
// only row i of R,
//   v_old_i = R_i . k,   R_i += beta (v_i - v_old_i) k,   out_i = R_i . s        (R_t = R_{t-1} + delta k^T)
template <typename T>
inline void write_read(T* R, const T* k, const T* v, T beta, const T* s, T* v_old, T* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    T* row = R + i * n;
    v_old[i] = dot(row, k, n);
    axpy(beta * (v[i] - v_old[i]), k, row, n);
    out[i] = dot(row, s, n);
  }
}

// Backward of write_read, also in one pass over the rows. In: dR = dL/dR_t without the read's term, g_out.
// Out: R undone to R_{t-1}, dR = dL/dR_{t-1}; ds += R_t^T g_out; gk, gv, gbeta written. With delta = beta (v - v_old):
//   dR_t = dR + g_out s^T,  g_delta = dR_t k,  gv = beta g_delta,  gbeta = g_delta . (v - v_old),
//   gk = dR_t^T delta + R_{t-1}^T g_vold  (g_vold = -beta g_delta),  dR_{t-1} = dR_t + g_vold k^T.
template <typename T>
inline void write_read_backward(T* R, T* dR, const T* k, const T* v, T beta, const T* v_old, const T* s,
                                const T* g_out, T* ds, T* gk, T* gv, T* gbeta, int64_t n) {
  T gb = 0;
  std::fill(gk, gk + n, T(0));
  for (int64_t i = 0; i < n; ++i) {
    T* drow = dR + i * n;
    T* row = R + i * n;
    const T diff = v[i] - v_old[i], delta = beta * diff;
    axpy(g_out[i], s, drow, n);  // dR_t
    const T g_delta = dot(drow, k, n);
    gv[i] = beta * g_delta;
    gb += g_delta * diff;
    axpy(delta, drow, gk, n);
    axpy(-beta * g_delta, k, drow, n);  // dR_{t-1}
    axpy(g_out[i], row, ds, n);
    axpy(-delta, k, row, n);  // R_{t-1}
    axpy(-beta * g_delta, row, gk, n);
  }
  *gbeta = gb;
}

void check(const at::Tensor& x, const at::Tensor& like, const char* name) {
  TORCH_CHECK(x.is_contiguous(), "fwp_rfwp: `", name, "` must be contiguous");
  TORCH_CHECK(x.device().is_cpu(), "fwp_rfwp: `", name, "` must be a CPU tensor");
  TORCH_CHECK(x.scalar_type() == like.scalar_type(), "fwp_rfwp: `", name, "` has dtype ", x.scalar_type(),
              ", expected ", like.scalar_type());
}

template <typename T>
const T* ptr_or_null(const std::optional<at::Tensor>& x) {
  return x.has_value() && x->defined() ? x->data_ptr<T>() : nullptr;
}

// ------------------------------------------------------------------------------------------------
// Fast RNN / LSTM scan. Per (b, h): z, k, v [G, T, D], beta [G, T], R [G, D, D], y0, c0 [D], y, c [T, D],
// act [3, T, D] (LSTM gates i, u, o after their activation), v_old [G, T, D].
// ------------------------------------------------------------------------------------------------

template <typename T>
void fast_rnn_forward_seq(int64_t cell, int64_t G, int64_t L, int64_t D, const T* z, const T* k, const T* v,
                          const T* beta, T* R, const T* y0, const T* c0, const T* mask, T* y, T* c, T* act,
                          T* v_old) {
  const bool lstm = is_lstm(cell);
  std::vector<T> s(D), a(G * D), y_prev(y0, y0 + D), c_prev(D, T(0)), h(D);
  if (lstm) std::copy(c0, c0 + D, c_prev.begin());
  for (int64_t t = 0; t < L; ++t) {
    T* yt = y + t * D;
    if (mask != nullptr && mask[t] == T(0)) {  // padding: carry every state through
      std::copy(y_prev.begin(), y_prev.end(), yt);
      if (lstm) std::copy(c_prev.begin(), c_prev.end(), c + t * D);
      continue;
    }
    if (softmax_input(cell)) {
      softmax(y_prev.data(), s.data(), D);
    } else {
      std::copy(y_prev.begin(), y_prev.end(), s.begin());
    }
    for (int64_t g = 0; g < G; ++g) {
      const int64_t off = (g * L + t) * D;
      // R_t = R_{t-1} + beta_t (v_t - R_{t-1} k_t) k_t^T ;  a_t = z_t + R_t s_{t-1}
      write_read(R + g * D * D, k + off, v + off, beta[g * L + t], s.data(), v_old + off, a.data() + g * D, D);
      for (int64_t i = 0; i < D; ++i) a[g * D + i] += z[off + i];
    }
    if (cell == RNN_A) {
      softmax(a.data(), yt, D);  // y_t = softmax(z_t + R_t y_{t-1})
    } else if (cell == RNN_B) {
      std::copy(a.begin(), a.begin() + D, yt);  // y_t = z_t + R_t softmax(y_{t-1})
    } else {
      T* ct = c + t * D;
      for (int64_t i = 0; i < D; ++i) {
        const T ig = sigmoid(a[i]);
        const T ug = cell == LSTM_D ? a[D + i] : sigmoid(a[D + i]);
        const T og = sigmoid(a[2 * D + i]);
        ct[i] = c_prev[i] + ig * (ug - c_prev[i]);  // c_t = i u + (1 - i) c_{t-1}
        h[i] = og * ct[i];
        act[t * D + i] = ig;
        act[(L + t) * D + i] = ug;
        act[(2 * L + t) * D + i] = og;
      }
      if (cell == LSTM_A) {
        softmax(h.data(), yt, D);  // y_t = softmax(o c_t)
      } else if (cell == LSTM_C) {
        for (int64_t i = 0; i < D; ++i) yt[i] = h[i] + z[(L + t) * D + i];  // y_t = o c_t + z_u
      } else {
        std::copy(h.begin(), h.end(), yt);  // y_t = o c_t
      }
      std::copy(ct, ct + D, c_prev.begin());
    }
    std::copy(yt, yt + D, y_prev.begin());
  }
}

template <typename T>
void fast_rnn_backward_seq(int64_t cell, int64_t G, int64_t L, int64_t D, const T* gy, const T* gc,
                           const T* k, const T* v, const T* beta, T* R, T* dR, const T* y0, const T* c0,
                           const T* mask, const T* y, const T* c, const T* act, const T* v_old, T* gz, T* gk,
                           T* gv, T* gbeta, T* gy0, T* gc0) {
  const bool lstm = is_lstm(cell);
  std::vector<T> s(D), ds(D), ga(G * D), dy(D, T(0)), dc(D, T(0)), gyt(D), gct(D), gh(D);
  for (int64_t t = L - 1; t >= 0; --t) {
    for (int64_t i = 0; i < D; ++i) {
      gyt[i] = gy[t * D + i] + dy[i];
      gct[i] = lstm ? (gc != nullptr ? gc[t * D + i] : T(0)) + dc[i] : T(0);
    }
    if (mask != nullptr && mask[t] == T(0)) {  // y_t = y_{t-1}, c_t = c_{t-1}
      std::copy(gyt.begin(), gyt.end(), dy.begin());
      std::copy(gct.begin(), gct.end(), dc.begin());
      continue;
    }
    const T* yp = t > 0 ? y + (t - 1) * D : y0;
    if (softmax_input(cell)) {
      softmax(yp, s.data(), D);
    } else {
      std::copy(yp, yp + D, s.begin());
    }
    // cell backward: dL/da (and dL/dc_{t-1} for the LSTM)
    if (cell == RNN_A) {
      softmax_backward(y + t * D, gyt.data(), ga.data(), D);
    } else if (cell == RNN_B) {
      std::copy(gyt.begin(), gyt.end(), ga.begin());
    } else {
      const T* ct = c + t * D;
      const T* cp = t > 0 ? c + (t - 1) * D : c0;
      if (cell == LSTM_A) {
        softmax_backward(y + t * D, gyt.data(), gh.data(), D);
      } else {
        std::copy(gyt.begin(), gyt.end(), gh.begin());
      }
      for (int64_t i = 0; i < D; ++i) {
        const T ig = act[t * D + i], ug = act[(L + t) * D + i], og = act[(2 * L + t) * D + i];
        const T g_c = gct[i] + gh[i] * og;  // total dL/dc_t
        const T gi = g_c * (ug - cp[i]);
        const T gu = g_c * ig;
        ga[i] = gi * ig * (T(1) - ig);
        ga[D + i] = cell == LSTM_D ? gu : gu * ug * (T(1) - ug);
        ga[2 * D + i] = gh[i] * ct[i] * og * (T(1) - og);
        dc[i] = g_c * (T(1) - ig);
      }
    }
    std::fill(ds.begin(), ds.end(), T(0));
    for (int64_t g = 0; g < G; ++g) {
      const int64_t off = (g * L + t) * D;
      for (int64_t i = 0; i < D; ++i) gz[off + i] = ga[g * D + i];
      if (cell == LSTM_C && g == 1) {
        for (int64_t i = 0; i < D; ++i) gz[off + i] += gyt[i];  // y_t = o c_t + z_u
      }
      write_read_backward(R + g * D * D, dR + g * D * D, k + off, v + off, beta[g * L + t], v_old + off, s.data(),
                          ga.data() + g * D, ds.data(), gk + off, gv + off, gbeta + g * L + t, D);
    }
    if (softmax_input(cell)) {
      softmax_backward(s.data(), ds.data(), dy.data(), D);
    } else {
      std::copy(ds.begin(), ds.end(), dy.begin());
    }
  }
  std::copy(dy.begin(), dy.end(), gy0);
  if (lstm) std::copy(dc.begin(), dc.end(), gc0);
}

void fast_rnn_forward(const at::Tensor& z, const at::Tensor& k, const at::Tensor& v, const at::Tensor& beta,
                      const at::Tensor& R, const at::Tensor& y0, const at::Tensor& c0,
                      const std::optional<at::Tensor>& mask, int64_t cell, const at::Tensor& y,
                      const at::Tensor& c, const at::Tensor& act, const at::Tensor& v_old) {
  TORCH_CHECK(z.dim() == 5, "fwp_rfwp: `z` must be [B, H, G, T, D]");
  const int64_t B = z.size(0), H = z.size(1), G = z.size(2), L = z.size(3), D = z.size(4);
  for (auto* pair : {&k, &v, &beta, &R, &y0, &y, &v_old}) check(*pair, z, "input");
  const bool lstm = is_lstm(cell);
  TORCH_CHECK(cell >= RNN_A && cell <= LSTM_D, "fwp_rfwp: unknown cell ", cell);
  TORCH_CHECK(G == (lstm ? 3 : 1), "fwp_rfwp: cell ", cell, " needs G = ", lstm ? 3 : 1, " gates, got ", G);
  if (lstm) {
    check(c0, z, "c0");
    check(c, z, "c");
    check(act, z, "act");
  }
  if (mask.has_value()) check(*mask, z, "mask");
  AT_DISPATCH_FLOATING_TYPES(z.scalar_type(), "fast_rnn_forward", [&] {
    const scalar_t* m = ptr_or_null<scalar_t>(mask);
    at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
      for (int64_t bh = begin; bh < end; ++bh) {
        const int64_t b = bh / H;
        fast_rnn_forward_seq<scalar_t>(
            cell, G, L, D, z.data_ptr<scalar_t>() + bh * G * L * D, k.data_ptr<scalar_t>() + bh * G * L * D,
            v.data_ptr<scalar_t>() + bh * G * L * D, beta.data_ptr<scalar_t>() + bh * G * L,
            R.data_ptr<scalar_t>() + bh * G * D * D, y0.data_ptr<scalar_t>() + bh * D,
            lstm ? c0.data_ptr<scalar_t>() + bh * D : nullptr, m ? m + b * L : nullptr,
            y.data_ptr<scalar_t>() + bh * L * D, lstm ? c.data_ptr<scalar_t>() + bh * L * D : nullptr,
            lstm ? act.data_ptr<scalar_t>() + bh * 3 * L * D : nullptr,
            v_old.data_ptr<scalar_t>() + bh * G * L * D);
      }
    });
  });
}

void fast_rnn_backward(const at::Tensor& gy, const std::optional<at::Tensor>& gc, const at::Tensor& k,
                       const at::Tensor& v, const at::Tensor& beta, const at::Tensor& R, const at::Tensor& dR,
                       const at::Tensor& y0, const at::Tensor& c0, const std::optional<at::Tensor>& mask,
                       const at::Tensor& y, const at::Tensor& c, const at::Tensor& act, const at::Tensor& v_old,
                       int64_t cell, const at::Tensor& gz, const at::Tensor& gk, const at::Tensor& gv,
                       const at::Tensor& gbeta, const at::Tensor& gy0, const at::Tensor& gc0) {
  const int64_t B = k.size(0), H = k.size(1), G = k.size(2), L = k.size(3), D = k.size(4);
  for (auto* x : {&gy, &v, &beta, &R, &dR, &y0, &y, &v_old, &gz, &gk, &gv, &gbeta, &gy0}) check(*x, k, "input");
  const bool lstm = is_lstm(cell);
  if (lstm) {
    for (auto* x : {&c0, &c, &act, &gc0}) check(*x, k, "lstm state");
  }
  if (gc.has_value()) check(*gc, k, "gc");
  if (mask.has_value()) check(*mask, k, "mask");
  AT_DISPATCH_FLOATING_TYPES(k.scalar_type(), "fast_rnn_backward", [&] {
    const scalar_t* m = ptr_or_null<scalar_t>(mask);
    const scalar_t* gcp = ptr_or_null<scalar_t>(gc);
    at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
      for (int64_t bh = begin; bh < end; ++bh) {
        const int64_t b = bh / H, seq = bh * G * L * D;
        fast_rnn_backward_seq<scalar_t>(
            cell, G, L, D, gy.data_ptr<scalar_t>() + bh * L * D, gcp && lstm ? gcp + bh * L * D : nullptr,
            k.data_ptr<scalar_t>() + seq, v.data_ptr<scalar_t>() + seq, beta.data_ptr<scalar_t>() + bh * G * L,
            R.data_ptr<scalar_t>() + bh * G * D * D, dR.data_ptr<scalar_t>() + bh * G * D * D,
            y0.data_ptr<scalar_t>() + bh * D, lstm ? c0.data_ptr<scalar_t>() + bh * D : nullptr,
            m ? m + b * L : nullptr, y.data_ptr<scalar_t>() + bh * L * D,
            lstm ? c.data_ptr<scalar_t>() + bh * L * D : nullptr,
            lstm ? act.data_ptr<scalar_t>() + bh * 3 * L * D : nullptr, v_old.data_ptr<scalar_t>() + seq,
            gz.data_ptr<scalar_t>() + seq, gk.data_ptr<scalar_t>() + seq, gv.data_ptr<scalar_t>() + seq,
            gbeta.data_ptr<scalar_t>() + bh * G * L, gy0.data_ptr<scalar_t>() + bh * D,
            lstm ? gc0.data_ptr<scalar_t>() + bh * D : nullptr);
      }
    });
  });
}

// ------------------------------------------------------------------------------------------------
// Recurrent Delta Net scan. Per (b, h): q, k, v [T, D] and beta [T] are the slow net's feedforward
// parts W_* x_t; Rq, Rk, Rv [D, D] and rb [D] are the head's recurrent slow weights; W [D, D].
// Saved for the backward: y, the activated q_t, k_t, v_t, beta_t and v_old = W_{t-1} k_t.
// ------------------------------------------------------------------------------------------------

template <typename T>
void rdn_forward_seq(int64_t L, int64_t D, const T* q, const T* k, const T* v, const T* beta, const T* Rq,
                     const T* Rk, const T* Rv, const T* rb, T* W, const T* y0, const T* mask, T* y, T* qs, T* ks,
                     T* vs, T* bs, T* v_old) {
  std::vector<T> h(D), pre(D), y_prev(y0, y0 + D);
  for (int64_t t = 0; t < L; ++t) {
    T* yt = y + t * D;
    if (mask != nullptr && mask[t] == T(0)) {
      std::copy(y_prev.begin(), y_prev.end(), yt);
      continue;
    }
    const int64_t off = t * D;
    for (int64_t i = 0; i < D; ++i) h[i] = std::tanh(y_prev[i]);
    // q_t = softmax(W_q x_t + R_q tanh(y_{t-1})), k_t likewise, v_t = W_v x_t + R_v tanh(y_{t-1})
    matvec(Rq, h.data(), pre.data(), D);
    for (int64_t i = 0; i < D; ++i) pre[i] += q[off + i];
    softmax(pre.data(), qs + off, D);
    matvec(Rk, h.data(), pre.data(), D);
    for (int64_t i = 0; i < D; ++i) pre[i] += k[off + i];
    softmax(pre.data(), ks + off, D);
    matvec(Rv, h.data(), vs + off, D);
    T bl = beta[t];
    for (int64_t i = 0; i < D; ++i) {
      vs[off + i] += v[off + i];
      bl += rb[i] * h[i];
    }
    // beta_t = sigmoid(w_beta x_t + r_beta . tanh(y_{t-1}))
    bs[t] = sigmoid(bl);
    // W_t = W_{t-1} + beta_t (v_t - W_{t-1} k_t) k_t^T ;  y_t = W_t q_t
    write_read(W, ks + off, vs + off, bs[t], qs + off, v_old + off, yt, D);
    std::copy(yt, yt + D, y_prev.begin());
  }
}

template <typename T>
void rdn_backward_seq(int64_t L, int64_t D, const T* gy, T* W, T* dW, const T* Rq, const T* Rk, const T* Rv,
                      const T* rb, const T* y0, const T* mask, const T* y, const T* qs, const T* ks, const T* vs,
                      const T* bs, const T* v_old, T* gq, T* gk, T* gv, T* gbeta, T* gRq, T* gRk, T* gRv, T* grb,
                      T* gy0) {
  std::vector<T> h(D), dy(D, T(0)), gyt(D), gqt(D), gkt(D), gh(D);
  for (int64_t t = L - 1; t >= 0; --t) {
    for (int64_t i = 0; i < D; ++i) gyt[i] = gy[t * D + i] + dy[i];
    if (mask != nullptr && mask[t] == T(0)) {
      std::copy(gyt.begin(), gyt.end(), dy.begin());
      continue;
    }
    const int64_t off = t * D;
    const T* yp = t > 0 ? y + (t - 1) * D : y0;
    for (int64_t i = 0; i < D; ++i) h[i] = std::tanh(yp[i]);
    // y_t = W_t q_t after the write; gq, gk, gv, gb are w.r.t. q_t, k_t, v_t, beta_t after their activations
    std::fill(gqt.begin(), gqt.end(), T(0));
    T gb;
    write_read_backward(W, dW, ks + off, vs + off, bs[t], v_old + off, qs + off, gyt.data(), gqt.data(), gkt.data(),
                        gv + off, &gb, D);
    // activations: softmax for q and k, sigmoid for beta
    softmax_backward(qs + off, gqt.data(), gq + off, D);
    softmax_backward(ks + off, gkt.data(), gk + off, D);
    gbeta[t] = gb * bs[t] * (T(1) - bs[t]);
    // recurrent slow weights: pre_x = W_x x_t + R_x h with h = tanh(y_{t-1})
    outer_acc(gRq, gq + off, h.data(), D);
    outer_acc(gRk, gk + off, h.data(), D);
    outer_acc(gRv, gv + off, h.data(), D);
    std::fill(gh.begin(), gh.end(), T(0));
    matvec_t_acc(Rq, gq + off, gh.data(), D);
    matvec_t_acc(Rk, gk + off, gh.data(), D);
    matvec_t_acc(Rv, gv + off, gh.data(), D);
    for (int64_t i = 0; i < D; ++i) {
      grb[i] += gbeta[t] * h[i];
      gh[i] += gbeta[t] * rb[i];
      dy[i] = gh[i] * (T(1) - h[i] * h[i]);
    }
  }
  std::copy(dy.begin(), dy.end(), gy0);
}

void rdn_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& beta,
                 const at::Tensor& Rq, const at::Tensor& Rk, const at::Tensor& Rv, const at::Tensor& rb,
                 const at::Tensor& W, const at::Tensor& y0, const std::optional<at::Tensor>& mask,
                 const at::Tensor& y, const at::Tensor& qs, const at::Tensor& ks, const at::Tensor& vs,
                 const at::Tensor& bs, const at::Tensor& v_old) {
  TORCH_CHECK(q.dim() == 4, "fwp_rfwp: `q` must be [B, H, T, D]");
  const int64_t B = q.size(0), H = q.size(1), L = q.size(2), D = q.size(3);
  for (auto* x : {&k, &v, &beta, &Rq, &Rk, &Rv, &rb, &W, &y0, &y, &qs, &ks, &vs, &bs, &v_old}) check(*x, q, "input");
  if (mask.has_value()) check(*mask, q, "mask");
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "rdn_forward", [&] {
    const scalar_t* m = ptr_or_null<scalar_t>(mask);
    at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
      for (int64_t bh = begin; bh < end; ++bh) {
        const int64_t b = bh / H, h = bh % H, seq = bh * L * D;
        rdn_forward_seq<scalar_t>(
            L, D, q.data_ptr<scalar_t>() + seq, k.data_ptr<scalar_t>() + seq, v.data_ptr<scalar_t>() + seq,
            beta.data_ptr<scalar_t>() + bh * L, Rq.data_ptr<scalar_t>() + h * D * D,
            Rk.data_ptr<scalar_t>() + h * D * D, Rv.data_ptr<scalar_t>() + h * D * D,
            rb.data_ptr<scalar_t>() + h * D, W.data_ptr<scalar_t>() + bh * D * D, y0.data_ptr<scalar_t>() + bh * D,
            m ? m + b * L : nullptr, y.data_ptr<scalar_t>() + seq, qs.data_ptr<scalar_t>() + seq,
            ks.data_ptr<scalar_t>() + seq, vs.data_ptr<scalar_t>() + seq, bs.data_ptr<scalar_t>() + bh * L,
            v_old.data_ptr<scalar_t>() + seq);
      }
    });
  });
}

void rdn_backward(const at::Tensor& gy, const at::Tensor& W, const at::Tensor& dW, const at::Tensor& Rq,
                  const at::Tensor& Rk, const at::Tensor& Rv, const at::Tensor& rb, const at::Tensor& y0,
                  const std::optional<at::Tensor>& mask, const at::Tensor& y, const at::Tensor& qs,
                  const at::Tensor& ks, const at::Tensor& vs, const at::Tensor& bs, const at::Tensor& v_old,
                  const at::Tensor& gq, const at::Tensor& gk, const at::Tensor& gv, const at::Tensor& gbeta,
                  const at::Tensor& gRq, const at::Tensor& gRk, const at::Tensor& gRv, const at::Tensor& grb,
                  const at::Tensor& gy0) {
  const int64_t B = gy.size(0), H = gy.size(1), L = gy.size(2), D = gy.size(3);
  for (auto* x : {&W, &dW, &Rq, &Rk, &Rv, &rb, &y0, &y, &qs, &ks, &vs, &bs, &v_old, &gq, &gk, &gv, &gbeta, &gRq,
                  &gRk, &gRv, &grb, &gy0})
    check(*x, gy, "input");
  if (mask.has_value()) check(*mask, gy, "mask");
  AT_DISPATCH_FLOATING_TYPES(gy.scalar_type(), "rdn_backward", [&] {
    const scalar_t* m = ptr_or_null<scalar_t>(mask);
    at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
      for (int64_t bh = begin; bh < end; ++bh) {
        const int64_t b = bh / H, h = bh % H, seq = bh * L * D;
        // gRq, gRk, gRv [B, H, D, D] and grb [B, H, D] hold per-sequence sums (reduced over B in Python).
        rdn_backward_seq<scalar_t>(
            L, D, gy.data_ptr<scalar_t>() + seq, W.data_ptr<scalar_t>() + bh * D * D,
            dW.data_ptr<scalar_t>() + bh * D * D, Rq.data_ptr<scalar_t>() + h * D * D,
            Rk.data_ptr<scalar_t>() + h * D * D, Rv.data_ptr<scalar_t>() + h * D * D,
            rb.data_ptr<scalar_t>() + h * D, y0.data_ptr<scalar_t>() + bh * D, m ? m + b * L : nullptr,
            y.data_ptr<scalar_t>() + seq, qs.data_ptr<scalar_t>() + seq, ks.data_ptr<scalar_t>() + seq,
            vs.data_ptr<scalar_t>() + seq, bs.data_ptr<scalar_t>() + bh * L, v_old.data_ptr<scalar_t>() + seq,
            gq.data_ptr<scalar_t>() + seq, gk.data_ptr<scalar_t>() + seq, gv.data_ptr<scalar_t>() + seq,
            gbeta.data_ptr<scalar_t>() + bh * L, gRq.data_ptr<scalar_t>() + bh * D * D,
            gRk.data_ptr<scalar_t>() + bh * D * D, gRv.data_ptr<scalar_t>() + bh * D * D,
            grb.data_ptr<scalar_t>() + bh * D, gy0.data_ptr<scalar_t>() + bh * D);
      }
    });
  });
}

}  // namespace

// Outputs are preallocated by the caller (zero-filled where a position may be skipped) and written
// in place; R / W go in as the initial fast weights and come out as the final ones (forward), or go
// in as the final ones and come out as the initial ones (backward).
FWP_TORCH_LIBRARY(FWP_OP_NAMESPACE, m) {
  m.def(
      "fast_rnn_forward(Tensor z, Tensor k, Tensor v, Tensor beta, Tensor(a!) R, Tensor y0, Tensor c0, "
      "Tensor? mask, int cell, Tensor(b!) y, Tensor(c!) c, Tensor(d!) act, Tensor(e!) v_old) -> ()");
  m.def(
      "fast_rnn_backward(Tensor gy, Tensor? gc, Tensor k, Tensor v, Tensor beta, Tensor(a!) R, Tensor(b!) dR, "
      "Tensor y0, Tensor c0, Tensor? mask, Tensor y, Tensor c, Tensor act, Tensor v_old, int cell, "
      "Tensor(c!) gz, Tensor(d!) gk, Tensor(e!) gv, Tensor(f!) gbeta, Tensor(g!) gy0, Tensor(h!) gc0) -> ()");
  m.def(
      "rdn_forward(Tensor q, Tensor k, Tensor v, Tensor beta, Tensor Rq, Tensor Rk, Tensor Rv, Tensor rb, "
      "Tensor(a!) W, Tensor y0, Tensor? mask, Tensor(b!) y, Tensor(c!) qs, Tensor(d!) ks, Tensor(e!) vs, "
      "Tensor(f!) bs, Tensor(g!) v_old) -> ()");
  m.def(
      "rdn_backward(Tensor gy, Tensor(a!) W, Tensor(b!) dW, Tensor Rq, Tensor Rk, Tensor Rv, Tensor rb, "
      "Tensor y0, Tensor? mask, Tensor y, Tensor qs, Tensor ks, Tensor vs, Tensor bs, Tensor v_old, "
      "Tensor(c!) gq, Tensor(d!) gk, Tensor(e!) gv, Tensor(f!) gbeta, Tensor(g!) gRq, Tensor(h!) gRk, "
      "Tensor(i!) gRv, Tensor(j!) grb, Tensor(k!) gy0) -> ()");
}

FWP_TORCH_LIBRARY_IMPL(FWP_OP_NAMESPACE, CPU, m) {
  m.impl("fast_rnn_forward", &fast_rnn_forward);
  m.impl("fast_rnn_backward", &fast_rnn_backward);
  m.impl("rdn_forward", &rdn_forward);
  m.impl("rdn_backward", &rdn_backward);
}
