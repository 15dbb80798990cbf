// Float32 matmul of a few rows by output-major weights for XLA:CPU (an XLA FFI custom call):
// y_k[..., M, O_k] = x[..., M, I] @ w_k[O_k, I]^T for one or more weights w_k that all
// multiply x (a layer's q, k and v projections, or gate and up: one call, one parallel loop
// over the channels of all of them). Used for a decode step (one row per sequence) and a
// speculative verification (a few per sequence): gpt_jax/kernels/few_rows_matmul.py says
// where and why.
//
// Each weight row (an output channel's I weights, contiguous in [O, I]) is read once for all
// M rows of x: a tile of C channels by R rows keeps C * R vector accumulators (kLanes floats
// each, summed in float32), multiplied into from C weight vectors loaded once per step, and
// reduces each to its output at the end; one row takes one channel at a time (`channels`).
// A task is a run of consecutive channels of one weight, i.e. one contiguous block of w of at
// least kChunkBytes, streamed in order (the hardware prefetcher follows it; software prefetch
// ahead in each channel's row was slower).
// The tasks of a call are spread over XLA's intra-op thread pool and the calling thread
// (`parallel_for`): a weight read from memory is read by every core, where XLA:CPU emits a
// one-row product inline on the calling thread only. A call whose weights are at most
// kSerialBytes in all (they stay in cache: a small model's verification) runs on the calling
// thread, since handing work to the pool would cost more than it saves.
//
// Arguments (M rows: the product of x's leading axes, which vmap adds):
//   x    f32 [..., M, I]
//   w_k  f32 [..., O_k, I]   leading axes of size 1 (shared by every row, vmap's expand_dims)
// Results: per weight, y_k f32 [..., M, O_k].
//
// Built by gpt_jax/kernels/builder.py on first use (gpt_jax/kernels/few_rows_matmul.py binds it).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#if defined(__AVX__)
#include <immintrin.h>
#endif

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using namespace gpt_jax_kernels;

namespace {

constexpr int kMaxRows = 8;  // rows of x per pass over the weights
constexpr int64_t kChunkBytes = 64 << 10;  // least bytes of w per task
constexpr int64_t kMaxChunkBytes = 1 << 20;  // most bytes of w per task (a large weight)
constexpr int64_t kTasksPerThread = 8;  // more tasks than threads: the last one waits less
constexpr int64_t kSerialBytes = 1 << 20;  // up to this many bytes of w: the calling thread

// The tile's budget of accumulator registers for `fvec` (common.h): AVX-512 has 32
// registers, AVX 16.
#if defined(__AVX512F__)
constexpr int kAccumulators = 16;
#else
constexpr int kAccumulators = 8;
#endif

inline fvec load(const float* p) {
  fvec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline float lane_sum(fvec v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps((__m512)v);
#else
  return sum8(v);
#endif
}

// Channels per tile for R rows, and copies of the accumulators over consecutive inputs.
// One row reads one channel at a time with four copies (independent multiply-add chains):
// its weights stream from memory as ONE sequential run, which read at about twice the rate
// of four or eight channel rows read side by side (benchmarks/README.md, "The decode step
// on both cores"). Several rows (weights in cache) take up to four channels per tile,
// within the accumulator budget.
constexpr int channels(int R) {
  return R == 1 ? 1 : std::max(1, std::min(4, kAccumulators / R));
}
constexpr int copies(int R) { return R == 1 ? 4 : 1; }

// Rows [0, R) of x (stride I) times channels [o, o + C) of w into y (stride O), with U
// copies of the accumulators over consecutive vectors of inputs.
template <int C, int R, int U = 1>
void tile(const float* x, const float* w, int64_t I, int64_t O, int64_t o, float* y) {
  const int64_t I_vec = I / kLanes * kLanes;
  fvec acc[U][C][R] = {};
  const float* wc = w + o * I;
  auto step = [&](int64_t i, int u) {  // one vector of inputs into copy u
    fvec wv[C];
    for (int c = 0; c < C; ++c) wv[c] = load(wc + c * I + i);
    for (int r = 0; r < R; ++r) {
      const fvec xv = load(x + r * I + i);
      for (int c = 0; c < C; ++c) acc[u][c][r] = fma(xv, wv[c], acc[u][c][r]);
    }
  };
  int64_t i = 0;
  for (; i + kLanes * U <= I_vec; i += kLanes * U)
    for (int u = 0; u < U; ++u) step(i + u * kLanes, u);
  for (; i < I_vec; i += kLanes) step(i, 0);
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) {
      fvec sum = acc[0][c][r];
      for (int u = 1; u < U; ++u) sum += acc[u][c][r];
      float total = lane_sum(sum);
      for (int64_t i = I_vec; i < I; ++i) total += x[r * I + i] * wc[c * I + i];
      y[r * O + o + c] = total;
    }
}

// Rows [0, R) times channels [o0, o1): tiles of channels(R) channels, then one at a time.
template <int R>
void rows_by_channels(const float* x, const float* w, int64_t I, int64_t O, int64_t o0,
                      int64_t o1, float* y) {
  constexpr int C = channels(R);
  int64_t o = o0;
  for (; o + C <= o1; o += C) tile<C, R, copies(R)>(x, w, I, O, o, y);
  for (; o < o1; ++o) tile<1, R, copies(R)>(x, w, I, O, o, y);
}

// `rows_by_channels` for n (1..kMaxRows) rows, chosen at run time.
template <int R = 1>
void rows(int n, const float* x, const float* w, int64_t I, int64_t O, int64_t o0, int64_t o1,
          float* y) {
  if constexpr (R <= kMaxRows) {
    if (n == R) return rows_by_channels<R>(x, w, I, O, o0, o1, y);
    rows<R + 1>(n, x, w, I, O, o0, o1, y);
  }
}

// One weight of a call: its data, output, and channels.
struct Matrix {
  const float* w;
  float* y;
  int64_t O;
};

// Channels [o0, o1) of one weight for every row of x, in passes of up to kMaxRows rows.
void channel_run(const float* x, const Matrix& m, int64_t M, int64_t I, int64_t o0,
                 int64_t o1) {
  for (int64_t r0 = 0; r0 < M; r0 += kMaxRows)
    rows(static_cast<int>(std::min<int64_t>(kMaxRows, M - r0)), x + r0 * I, m.w, I, m.O, o0,
         o1, m.y + r0 * m.O);
}

ffi::Error FewRowsMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::RemainingArgs args,
                         ffi::RemainingRets rets) {
  auto x_dims = x.dimensions();
  if (x_dims.size() < 1) return ffi::Error::InvalidArgument("x must be [..., M, I]");
  const int64_t I = x_dims[x_dims.size() - 1];
  const int64_t M = I == 0 ? 0 : x.element_count() / I;
  if (args.size() != rets.size() || rets.size() == 0)
    return ffi::Error::InvalidArgument("give one or more weights, one result per weight");
  std::vector<Matrix> matrices;
  int64_t channels_in_all = 0;
  for (size_t k = 0; k < rets.size(); ++k) {
    auto w = args.get<ffi::Buffer<ffi::F32>>(k);
    auto y = rets.get<ffi::Buffer<ffi::F32>>(k);
    if (w.has_error()) return w.error();
    if (y.has_error()) return y.error();
    auto w_dims = w->dimensions();
    if (w_dims.size() < 2 || w_dims[w_dims.size() - 1] != I)
      return ffi::Error::InvalidArgument("each w must be [..., O, I] for x's I");
    const int64_t O = w_dims[w_dims.size() - 2];
    if (w->element_count() != O * I)
      return ffi::Error::InvalidArgument("w must be shared by all rows (leading axes 1)");
    if ((*y)->element_count() != M * O)
      return ffi::Error::InvalidArgument("each result must be [..., M, O]");
    matrices.push_back({w->typed_data(), (*y)->typed_data(), O});
    channels_in_all += O;
  }
  if (I == 0) {
    for (auto& m : matrices) std::fill(m.y, m.y + M * m.O, 0.0f);
    return ffi::Error::Success();
  }
  // Runs of `per_task` channels of one weight (the last run of each may be shorter): about
  // kTasksPerThread per thread over all the weights, within kChunkBytes..kMaxChunkBytes
  // each (so the thread that finishes last waits for at most one short run).
  const int64_t bytes = channels_in_all * I * 4;
  const int64_t threads = bytes <= kSerialBytes ? 1 : std::max<int64_t>(1, pool.num_threads());
  int64_t per_task = std::clamp(channels_in_all / (kTasksPerThread * threads),
                                kChunkBytes / (4 * I), kMaxChunkBytes / (4 * I));
  if (threads == 1) per_task = channels_in_all;
  per_task = std::max<int64_t>(1, (per_task + 3) / 4 * 4);  // whole tiles of 4 channels
  std::vector<std::pair<int64_t, int64_t>> tasks;  // (matrix, first channel)
  for (size_t k = 0; k < matrices.size(); ++k)
    for (int64_t o = 0; o < matrices[k].O; o += per_task) tasks.emplace_back(k, o);
  const float* xs = x.typed_data();
  auto run = [&](int64_t task) {
    const auto [k, o0] = tasks[task];
    const Matrix& m = matrices[k];
    channel_run(xs, m, M, I, o0, std::min(m.O, o0 + per_task));
  };
  if (threads == 1) {
    for (size_t t = 0; t < tasks.size(); ++t) run(t);
  } else {
    parallel_for(pool, tasks.size(), run, true);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GptJaxFewRowsMatmul, FewRowsMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .RemainingRets());
