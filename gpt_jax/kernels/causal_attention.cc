// Causal self-attention over whole sequences, forward and backward, for XLA:CPU (XLA FFI
// custom calls): the training path's attention.
//
// XLA:CPU runs it as ~15 small ops per layer forward and ~20 backward (score dots, mask
// selects, the softmax's max, exp and sum reductions, transposes between them), each a
// separate pass over the [T, T] scores of every head. These kernels do each (row, kv head)
// in one pass with the scores in registers and cache, and skip the masked half.
//
// Forward (Vaswani et al. 2017), per row b and query head n (kv head n / G):
//   S = Q K^T / sqrt(H), masked to keys j <= t; P = softmax(S); O = P V;
//   lse_t = log sum_j exp(S_tj) (kept for the backward, as FlashAttention does).
// Backward (FlashAttention-2, Dao 2023, Algorithm 2; P recomputed from lse):
//   dP = dO V^T; D_t = sum_j P_tj dP_tj (= dO_t . O_t); dS = P * (dP - D); dQ = dS K / sqrt(H);
//   dK = dS^T Q / sqrt(H); dV = P^T dO (dK and dV summed over the G query heads).
//
// Arguments (B rows, T positions, N query heads, K kv heads, G = N / K, H = 32, 64 or 128):
//   forward:  q f32 [B, T, N, H], k, v f32 [B, T, K, H]
//             -> out f32 [B, T, N, H], lse f32 [B, N, T]
//   backward: q, k, v, lse as above, d_out f32 [B, T, N, H]
//             -> d_q f32 [B, T, N, H], d_k, d_v f32 [B, T, K, H]
//
// Built by gpt_jax/kernels/builder.py on first use (gpt_jax/kernels/causal_attention.py binds it).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using namespace gpt_jax_kernels;

namespace {

typedef int32_t i32x8 __attribute__((vector_size(32)));

constexpr int64_t R = 4;  // query rows per tile: each loaded key or value vector feeds R FMAs

inline void store8(float* p, f32x8 v) { std::memcpy(p, &v, sizeof v); }

inline f32x8 splat(float x) { return f32x8{} + x; }

// exp(x) for eight floats, relative error ~1e-7 (Cephes expf: exp(x) = 2^n exp(r), r = x -
// n ln 2, |r| <= ln(2) / 2, a degree-6 polynomial for exp(r)); 0 below -87.3.
inline f32x8 exp8(f32x8 x) {
  const i32x8 underflow = x < -87.3f;
  x = x < -87.3f ? splat(-87.3f) : x;
  x = x > 88.3f ? splat(88.3f) : x;
  const f32x8 magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  const f32x8 n = (x * 1.44269504088896341f + magic) - magic;
  const f32x8 r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  f32x8 p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const i32x8 bits = (__builtin_convertvector(n, i32x8) + 127) << 23;
  f32x8 two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return underflow ? splat(0.0f) : p * two_n;
}

// One (row, kv head): its keys and values copied into row-major [T, H] and transposed
// [H, Tp] (Tp: T rounded up to 8, zero-padded) buffers, so that scores of a query against
// eight consecutive keys are eight FMA lanes.
struct Head {
  int64_t T, Tp, H;
  std::vector<float> k_TH, v_TH, k_HT, v_HT;

  Head(int64_t T, int64_t H) : T(T), Tp((T + 7) / 8 * 8), H(H),
      k_TH(T * H), v_TH(T * H), k_HT(H * Tp), v_HT(H * Tp) {}

  // Gathers kv head `kh` of row `b` from k, v [B, T, K, H]; the transposed value rows only
  // `with_v_HT` (the backward's).
  void load(const float* k, const float* v, int64_t b, int64_t K, int64_t kh, bool with_v_HT) {
    for (int64_t t = 0; t < T; ++t) {
      const int64_t src = ((b * T + t) * K + kh) * H;
      std::memcpy(&k_TH[t * H], k + src, H * sizeof(float));
      std::memcpy(&v_TH[t * H], v + src, H * sizeof(float));
    }
    transpose(k_TH, k_HT);
    if (with_v_HT) transpose(v_TH, v_HT);
  }

  void transpose(const std::vector<float>& x_TH, std::vector<float>& x_HT) const {
    for (int64_t h = 0; h < H; ++h) {
      float* row = &x_HT[h * Tp];
      for (int64_t t = 0; t < T; ++t) row[t] = x_TH[t * H + h];
      std::fill(row + T, row + Tp, 0.0f);
    }
  }
};

// scores[r][j] = sum_h a[r][h] * x_HT[h][j] for the R rows of a tile (row pointers `a`, of
// which the first `rows` are real) and keys j < `keys` (rounded up to 8), times `scale`.
// Stored rounded, so the softmax's row maximum minus itself is exactly 0 (a product left
// to an FMA in exp's argument differed from it by up to an ulp of the score: NaN and
// overflow at scores of 1e10).
template <int64_t H>
void tile_dots(const float* const* a, const float* x_HT, int64_t Tp, int64_t keys,
               float scale, float* scores_RT) {
  for (int64_t j = 0; j < keys; j += 8) {
    f32x8 acc[2][R] = {};  // even and odd h: 2R independent FMA chains hide FMA latency
    for (int64_t h = 0; h < H; h += 2) {
      for (int64_t i = 0; i < 2; ++i) {
        const f32x8 x = load8(x_HT + (h + i) * Tp + j);
        for (int64_t r = 0; r < R; ++r) acc[i][r] += a[r][h + i] * x;
      }
    }
    for (int64_t r = 0; r < R; ++r)
      store8(scores_RT + r * Tp + j, (acc[0][r] + acc[1][r]) * scale);
  }
}

// Lanes of the eight keys j..j+7 that query t sees (keys 0..t): -1 there, 0 elsewhere.
inline i32x8 visible(int64_t j, int64_t t) {
  const i32x8 lane = {0, 1, 2, 3, 4, 5, 6, 7};
  return lane <= int32_t(t - j);
}

// exp(row[j] - shift) for keys j <= t, 0 for t < j < keys (a multiple of 8).
inline f32x8 causal_exp(const float* row, int64_t j, int64_t t, float shift) {
  return visible(j, t) ? exp8(load8(row + j) - shift) : splat(0.0f);
}

// Query row t's scaled scores (over keys [0, keys)) -> exp(s - max), in place
// (the softmax before its division); returns {max, sum} of the row.
struct RowSum {
  float max, sum;
};

inline RowSum exp_row(float* row, int64_t t, int64_t keys) {
  f32x8 maxes = splat(-INFINITY);
  for (int64_t j = 0; j <= t; j += 8) {
    const f32x8 x = visible(j, t) ? load8(row + j) : splat(-INFINITY);
    maxes = x > maxes ? x : maxes;
  }
  float max = maxes[0];
  for (int64_t i = 1; i < 8; ++i) max = std::max(max, maxes[i]);
  f32x8 total = {};
  for (int64_t j = 0; j < keys; j += 8) {
    const f32x8 e = causal_exp(row, j, t, max);
    total += e;
    store8(row + j, e);
  }
  return {max, sum8(total)};
}

// Query row t's scores -> its probabilities from the forward's log-sum-exp, in place.
inline void probabilities(float* row, int64_t t, int64_t keys, float lse) {
  for (int64_t j = 0; j < keys; j += 8) store8(row + j, causal_exp(row, j, t, lse));
}

// acc[r] += sum_{j < n} w[r][j] x[j] for the R rows of a tile: weights [R, Tp] times the
// rows of x [T, H], H / 8 vectors per row (P V in the forward, dS K in the backward).
template <int64_t H>
void tile_product(const float* w_RT, int64_t Tp, const float* x_TH, int64_t n,
                  f32x8 (&acc)[R][H / 8]) {
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t c = 0; c < H / 8; ++c) {
      const f32x8 x = load8(x_TH + j * H + c * 8);
      for (int64_t r = 0; r < R; ++r) acc[r][c] += w_RT[r * Tp + j] * x;
    }
  }
}

template <int64_t H>
void forward_head(const float* q, const Head& kv, int64_t b, int64_t N, int64_t n,
                  float* out, float* lse) {
  constexpr int64_t C = H / 8;
  const int64_t T = kv.T, Tp = kv.Tp;
  const float scale = 1.0f / std::sqrt(float(H));
  thread_local std::vector<float> scores;
  scores.resize(R * Tp);
  for (int64_t t0 = 0; t0 < T; t0 += R) {
    const int64_t rows = std::min(R, T - t0), keys = (t0 + rows + 7) / 8 * 8;
    const float* q_rows[R];
    for (int64_t r = 0; r < R; ++r)
      q_rows[r] = q + ((b * T + t0 + std::min(r, rows - 1)) * N + n) * H;
    tile_dots<H>(q_rows, kv.k_HT.data(), Tp, keys, scale, scores.data());
    float inverse[R] = {};
    for (int64_t r = 0; r < rows; ++r) {
      const RowSum row = exp_row(scores.data() + r * Tp, t0 + r, keys);
      lse[(b * N + n) * T + t0 + r] = row.max + std::log(row.sum);
      inverse[r] = 1.0f / row.sum;
    }
    for (int64_t r = rows; r < R; ++r) std::fill_n(scores.data() + r * Tp, keys, 0.0f);
    f32x8 acc[R][C] = {};
    tile_product<H>(scores.data(), Tp, kv.v_TH.data(), std::min(keys, T), acc);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < C; ++c)
        store8(out + ((b * T + t0 + r) * N + n) * H + c * 8, acc[r][c] * inverse[r]);
  }
}

// Query rows per block of the backward: their dK and dV contributions are summed in
// registers, and each key's dK, dV rows are read and written once per block.
constexpr int64_t QB = 8 * R;

// dK[j] += sum_t dS[t][j] q_t and dV[j] += sum_t P[t][j] dO_t over the block's query rows
// t >= j (rows b0 + i of p, ds [QB, Tp]), for keys j < `keys`; four keys by two vectors of
// the head dim at a time (16 accumulators).
template <int64_t H>
void accumulate_dk_dv(const float* q, const float* d_out, int64_t b, int64_t N, int64_t n,
                      int64_t T, int64_t Tp, int64_t b0, int64_t rows, int64_t keys,
                      const float* p, const float* ds, float* dk_TH, float* dv_TH) {
  for (int64_t j0 = 0; j0 < keys; j0 += 4) {
    const int64_t kn = std::min<int64_t>(4, keys - j0);
    for (int64_t c = 0; c < H / 8; c += 2) {
      f32x8 dk[4][2] = {}, dv[4][2] = {};
      for (int64_t t = std::max(b0, j0); t < b0 + rows; ++t) {
        const int64_t at = ((b * T + t) * N + n) * H + c * 8, i = (t - b0) * Tp + j0;
        const f32x8 q0 = load8(q + at), q1 = load8(q + at + 8);
        const f32x8 d0 = load8(d_out + at), d1 = load8(d_out + at + 8);
        for (int64_t jj = 0; jj < 4; ++jj) {
          dk[jj][0] += ds[i + jj] * q0;
          dk[jj][1] += ds[i + jj] * q1;
          dv[jj][0] += p[i + jj] * d0;
          dv[jj][1] += p[i + jj] * d1;
        }
      }
      for (int64_t jj = 0; jj < kn; ++jj) {
        float* dk_row = dk_TH + (j0 + jj) * H + c * 8;
        float* dv_row = dv_TH + (j0 + jj) * H + c * 8;
        store8(dk_row, load8(dk_row) + dk[jj][0]);
        store8(dk_row + 8, load8(dk_row + 8) + dk[jj][1]);
        store8(dv_row, load8(dv_row) + dv[jj][0]);
        store8(dv_row + 8, load8(dv_row + 8) + dv[jj][1]);
      }
    }
  }
}

template <int64_t H>
void backward_head(const float* q, const float* lse, const float* d_out,
                   const Head& kv, int64_t b, int64_t N, int64_t n, float* d_q, float* dk_TH,
                   float* dv_TH) {
  constexpr int64_t C = H / 8;
  const int64_t T = kv.T, Tp = kv.Tp;
  const float scale = 1.0f / std::sqrt(float(H));
  thread_local std::vector<float> p_block, ds_block;
  p_block.resize(QB * Tp);
  ds_block.resize(QB * Tp);
  for (int64_t b0 = 0; b0 < T; b0 += QB) {
    const int64_t block_rows = std::min(QB, T - b0);
    for (int64_t t0 = b0; t0 < b0 + block_rows; t0 += R) {
      const int64_t rows = std::min(R, T - t0), keys = (t0 + rows + 7) / 8 * 8;
      float* p = p_block.data() + (t0 - b0) * Tp;
      float* ds = ds_block.data() + (t0 - b0) * Tp;
      const float *q_rows[R], *do_rows[R];
      for (int64_t r = 0; r < R; ++r) {
        const int64_t at = ((b * T + t0 + std::min(r, rows - 1)) * N + n) * H;
        q_rows[r] = q + at;
        do_rows[r] = d_out + at;
      }
      tile_dots<H>(q_rows, kv.k_HT.data(), Tp, keys, scale, p);
      tile_dots<H>(do_rows, kv.v_HT.data(), Tp, keys, 1.0f, ds);  // dP
      for (int64_t r = 0; r < R; ++r) {
        float* p_row = p + r * Tp;
        float* ds_row = ds + r * Tp;
        if (r < rows) {
          probabilities(p_row, t0 + r, keys, lse[(b * N + n) * T + t0 + r]);
        } else {
          std::fill_n(p_row, keys, 0.0f);
        }
        // D = sum_j P_j dP_j (= dO . O): from the same P and dP as dS, so a one-hot row's
        // dS is exactly 0 (dO . O rounds apart from dP at the winning key; times a key of
        // 1e10 that gave dQ of 1e3 where the true one is 0).
        f32x8 dots = {};
        for (int64_t j = 0; j < keys; j += 8) dots += load8(p_row + j) * load8(ds_row + j);
        const float D = sum8(dots);
        for (int64_t j = 0; j < keys; j += 8)
          store8(ds_row + j, load8(p_row + j) * (load8(ds_row + j) - D) * scale);
      }
      f32x8 dq[R][C] = {};
      tile_product<H>(ds, Tp, kv.k_TH.data(), std::min(keys, T), dq);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < C; ++c)
          store8(d_q + ((b * T + t0 + r) * N + n) * H + c * 8, dq[r][c]);
    }
    accumulate_dk_dv<H>(q, d_out, b, N, n, T, Tp, b0, block_rows, std::min(T, b0 + block_rows),
                        p_block.data(), ds_block.data(), dk_TH, dv_TH);
  }
}

struct Shape {
  int64_t B, T, N, K, H;
};

// The shape of q [B, T, N, H] and k, v [B, T, K, H] into `s`, or an error.
ffi::Error shape_of(ffi::Buffer<ffi::F32>& q, ffi::Buffer<ffi::F32>& k,
                    ffi::Buffer<ffi::F32>& v, Shape& s) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || !std::equal(kd.begin(), kd.end(), vd.begin(),
                                                      vd.end()))
    return ffi::Error::InvalidArgument("q must be [B, T, N, H], k and v [B, T, K, H]");
  s = Shape{qd[0], qd[1], qd[2], kd[2], qd[3]};
  if (kd[0] != s.B || kd[1] != s.T || kd[3] != s.H || s.K == 0 || s.N % s.K != 0)
    return ffi::Error::InvalidArgument("k and v must be [B, T, K, H] with K dividing q's N");
  if (s.H != 32 && s.H != 64 && s.H != 128)
    return ffi::Error::InvalidArgument("head dim must be 32, 64 or 128");
  return ffi::Error::Success();
}

template <int64_t H>
void forward(ffi::ThreadPool& pool, Shape s, const float* q, const float* k, const float* v,
             float* out, float* lse) {
  const int64_t G = s.N / s.K;
  parallel_for(pool, s.B * s.K, [&](int64_t item) {
    const int64_t b = item / s.K, kh = item % s.K;
    thread_local Head kv(0, H);
    if (kv.T != s.T) kv = Head(s.T, H);
    kv.load(k, v, b, s.K, kh, false);
    for (int64_t g = 0; g < G; ++g) forward_head<H>(q, kv, b, s.N, kh * G + g, out, lse);
  }, false);
}

template <int64_t H>
void backward(ffi::ThreadPool& pool, Shape s, const float* q, const float* k, const float* v,
              const float* lse, const float* d_out, float* d_q, float* d_k,
              float* d_v) {
  const int64_t G = s.N / s.K;
  parallel_for(pool, s.B * s.K, [&](int64_t item) {
    const int64_t b = item / s.K, kh = item % s.K;
    thread_local Head kv(0, H);
    if (kv.T != s.T) kv = Head(s.T, H);
    kv.load(k, v, b, s.K, kh, true);
    thread_local std::vector<float> dk_TH, dv_TH;
    dk_TH.assign(s.T * H, 0.0f);
    dv_TH.assign(s.T * H, 0.0f);
    for (int64_t g = 0; g < G; ++g)
      backward_head<H>(q, lse, d_out, kv, b, s.N, kh * G + g, d_q, dk_TH.data(),
                       dv_TH.data());
    for (int64_t t = 0; t < s.T; ++t) {
      const int64_t dst = ((b * s.T + t) * s.K + kh) * H;
      std::memcpy(d_k + dst, &dk_TH[t * H], H * sizeof(float));
      std::memcpy(d_v + dst, &dv_TH[t * H], H * sizeof(float));
    }
  }, false);
}

// fn(std::integral_constant<int64_t, H>) for head dim H (32, 64 or 128: shape_of refuses
// others), so each kernel runs compiled for its H.
template <typename Fn>
void with_head_dim(int64_t H, Fn fn) {
  if (H == 32) fn(std::integral_constant<int64_t, 32>{});
  else if (H == 64) fn(std::integral_constant<int64_t, 64>{});
  else fn(std::integral_constant<int64_t, 128>{});
}

ffi::Error Forward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                   ffi::Buffer<ffi::F32> v, ffi::ResultBuffer<ffi::F32> out,
                   ffi::ResultBuffer<ffi::F32> lse) {
  Shape s;
  if (ffi::Error e = shape_of(q, k, v, s); e.failure()) return e;
  with_head_dim(s.H, [&](auto H) {
    forward<H>(pool, s, q.typed_data(), k.typed_data(), v.typed_data(), out->typed_data(),
               lse->typed_data());
  });
  return ffi::Error::Success();
}

ffi::Error Backward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                    ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::F32> lse,
                    ffi::Buffer<ffi::F32> d_out,
                    ffi::ResultBuffer<ffi::F32> d_q, ffi::ResultBuffer<ffi::F32> d_k,
                    ffi::ResultBuffer<ffi::F32> d_v) {
  Shape s;
  if (ffi::Error e = shape_of(q, k, v, s); e.failure()) return e;
  with_head_dim(s.H, [&](auto H) {
    backward<H>(pool, s, q.typed_data(), k.typed_data(), v.typed_data(), lse.typed_data(),
                d_out.typed_data(), d_q->typed_data(), d_k->typed_data(), d_v->typed_data());
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GptJaxCausalAttentionForward, Forward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(GptJaxCausalAttentionBackward, Backward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
