// Matmuls by weights in panels of sixteen output channels for XLA:CPU (XLA FFI custom calls):
//   y[..., M, O] = x[..., M, I] @ (w * scale)^T,
// float32 activations, and weights either int8 with one float32 scale per output channel
// (symmetric absmax quantization; gpt_jax/layers.py `Int8Weight`; target GptJaxInt8Matmul)
// or float32 without scales (gpt_jax/layers.py `PanelMajor`; target GptJaxF32PanelMatmul).
// Int8: XLA:CPU would first widen the whole int8 matrix to a float32 copy in memory and then
// run its float32 dot; a few-row (decode) matmul is bound by reading the weights, so this
// kernel reads the int8 bytes once: int8 weights are widened to float in a register
// (vpmovsxbd, vcvtdq2ps), multiplied into the rows' accumulators with fused multiply-adds,
// and each channel's sum is scaled at the end. Float32: the same loop without widening or
// scales, which at 2 to 16 rows outruns XLA's products of [O, I] weights (gpt_jax/kernels/
// panel_matmul.py says why). Panels of channels are spread over XLA's intra-op thread pool.
//
// The weights come in panels of sixteen channels, w[n_panels, I, 16] (n_panels =
// ceil(O / 16), channels past O zero): the sixteen weights of input i for sixteen channels
// are consecutive, so the kernel reads memory strictly in order (a panel is one
// stream, which the hardware prefetcher follows, faster than separate channel rows:
// benchmarks/README.md, "The kernel"), and one 16-float register (two of 8 floats
// with AVX2) holds a panel's channels: the outer-product form,
// y[r, 16 channels] += x[r, i] * w[i, 16 channels], needs no horizontal sums and lets
// several rows share each weight vector.
//
// Arguments (M rows: the product of x's leading axes, which vmap adds), then one or more
// weights that all multiply x (a layer's q, k and v projections: one call, one parallel
// loop over the panels of all three):
//   x      f32 [..., M, I]
//   w      s8 or f32 [..., n_panels, I, 16] leading axes of size 1 (shared by every row, as
//                                     vmap's expand_dims passes them)
//   scale  f32 [..., O]        as w (int8 only: each int8 w is followed by its scale)
// Results: per weight, y f32 [..., M, O] (float32 panels: O = 16 * n_panels or less).
//
// Built by gpt_jax/kernels/builder.py on first use (gpt_jax/kernels/panel_matmul.py binds it).

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

constexpr int64_t kPanel = 16;  // output channels per panel
constexpr int64_t kPrefetchBytes = 4096;  // how far ahead in a panel's bytes to prefetch
// Tasks per thread in a call: the threads claim them one by one, so the last one to finish
// waits at most one task's time for the other.
constexpr int64_t kTasksPerThread = 8;

// The tile the CPU's float vector (`fvec` of kLanes floats: common.h) affords (see `panels`):
// with AVX-512, one 16-float register holds a panel's 16 channels, and 32 registers hold
// 24 accumulators (three panels by eight rows); with AVX2, a panel takes two 8-float
// registers and 16 registers hold 12 (one panel by six rows).
#if defined(__AVX512F__)
constexpr int kTilePanels = 3, kTileRows = 8;
#else
constexpr int kTilePanels = 1, kTileRows = 6;
#endif
constexpr int kVectors = kPanel / kLanes;  // vectors per panel
constexpr int kAccumulators = kTilePanels * kVectors * kTileRows;

typedef int8_t i8x8 __attribute__((vector_size(8)));

inline fvec widen(const int8_t* p) {  // kLanes int8, widened exactly
#if defined(__AVX512F__)
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return (fvec)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
#elif defined(__AVX2__)
  // vpmovsxbd + vcvtdq2ps: GCC scalarizes __builtin_convertvector from 8-byte vectors.
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return (fvec)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
#else
  i8x8 v;
  std::memcpy(&v, p, sizeof v);
  return __builtin_convertvector(v, fvec);
#endif
}

inline fvec widen(const float* p) {  // kLanes floats, as they are
  fvec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline fvec broadcast(const float* p) {  // vbroadcastss from memory (`fvec{} + *p` added 0)
#if defined(__AVX512F__)
  return (fvec)_mm512_set1_ps(*p);
#elif defined(__AVX__)
  return (fvec)_mm256_set1_ps(*p);
#else
  return fvec{*p, *p, *p, *p, *p, *p, *p, *p};
#endif
}

// Copies of the accumulators for NP panels by R rows (`panel_tile`'s U): a fused
// multiply-add takes ~4 cycles before its sum can take the next, so few rows need several
// independent chains to keep the core busy; at most four (one 64-byte line of each panel
// per step).
constexpr int copies(int NP, int R) {
  return std::max(1, std::min(4, kAccumulators / (NP * kVectors * R)));
}

// R rows (stride I) times NP consecutive panels [I, 16] into out[NP, R, 16], unscaled: for
// each input, the panels' weights are widened once and each row's input broadcast once,
// y[r, channels] += x[r, i] * w[i, channels] (the outer-product form: no horizontal sums).
// U copies of the accumulators over consecutive inputs.
template <int NP, int R, int U, typename W>
void panel_tile(const float* x, int64_t I, const W* panel, float* out) {
  fvec acc[U][NP][kVectors][R];
  for (int u = 0; u < U; ++u)
    for (int p = 0; p < NP; ++p)
      for (int v = 0; v < kVectors; ++v)
        for (int r = 0; r < R; ++r) acc[u][p][v][r] = fvec{};
  const int64_t stride = I * kPanel;  // bytes from one panel to the next
  int64_t i = 0;
  for (; i + U <= I; i += U) {
    // One cache line per 64 bytes of each panel, 4 KB ahead (16-channel panels read twice
    // the bytes per input of the 8-channel ones, for which 2 KB was chosen; figures in
    // benchmarks/README.md, "A third pass").
    // Float32 panels read U lines of each panel per step: one prefetch each.
    constexpr int64_t kStepBytes = U * kPanel * sizeof(W);
    if (((i * kPanel * sizeof(W)) & 63) < kStepBytes)
      for (int p = 0; p < NP; ++p)
        for (int64_t b = 0; b < kStepBytes; b += 64)
          __builtin_prefetch(reinterpret_cast<const char*>(panel + p * stride + i * kPanel) +
                             kPrefetchBytes + b);
    for (int u = 0; u < U; ++u) {
      fvec w[NP][kVectors];
      for (int p = 0; p < NP; ++p)
        for (int v = 0; v < kVectors; ++v)
          w[p][v] = widen(panel + p * stride + (i + u) * kPanel + v * kLanes);
      for (int r = 0; r < R; ++r) {
        const fvec xr = broadcast(x + r * I + i + u);
        for (int p = 0; p < NP; ++p)
          for (int v = 0; v < kVectors; ++v) acc[u][p][v][r] = fma(xr, w[p][v], acc[u][p][v][r]);
      }
    }
  }
  for (; i < I; ++i) {
    for (int p = 0; p < NP; ++p) {
      for (int v = 0; v < kVectors; ++v) {
        const fvec w = widen(panel + p * stride + i * kPanel + v * kLanes);
        for (int r = 0; r < R; ++r)
          acc[0][p][v][r] = fma(broadcast(x + r * I + i), w, acc[0][p][v][r]);
      }
    }
  }
  for (int p = 0; p < NP; ++p) {
    for (int v = 0; v < kVectors; ++v) {
      for (int r = 0; r < R; ++r) {
        fvec total = acc[0][p][v][r];
        for (int u = 1; u < U; ++u) total += acc[u][p][v][r];
        std::memcpy(out + (p * R + r) * kPanel + v * kLanes, &total, sizeof total);
      }
    }
  }
}

// Rows [r0, r0 + R) times panels [p, p + NP): y[r, 16q + j] = scale[16q + j] *
// sum_i x[r, i] w[q, i, j] for each panel q's channels below O.
template <int NP, int R, typename W>
void rows_by_panels(const float* x, const W* w, const float* scale, int64_t I, int64_t O,
                    int64_t r0, int64_t p, float* y) {
  float out[NP * R * kPanel];
  panel_tile<NP, R, copies(NP, R)>(x + r0 * I, I, w + p * I * kPanel, out);
  for (int q = 0; q < NP; ++q) {
    const int64_t c0 = (p + q) * kPanel, n = std::min(kPanel, O - c0);
    for (int r = 0; r < R; ++r)
      for (int64_t j = 0; j < n; ++j)
        y[(r0 + r) * O + c0 + j] = out[(q * R + r) * kPanel + j] * (scale ? scale[c0 + j] : 1.0f);
  }
}

// Rows [r, r1) times panels [p, p + NP): tiles of kTileRows rows, then the rows left over
// as one tile of their number (R, below kTileRows, from the template recursion).
template <int NP, int R = 1, typename W>
void rows_left(const float* x, const W* w, const float* scale, int64_t I, int64_t O,
               int64_t r, int64_t r1, int64_t p, float* y) {
  if constexpr (R < kTileRows) {
    if (r1 - r == R) return rows_by_panels<NP, R>(x, w, scale, I, O, r, p, y);
    rows_left<NP, R + 1, W>(x, w, scale, I, O, r, r1, p, y);
  }
}

template <int NP, typename W>
void rows(const float* x, const W* w, const float* scale, int64_t I, int64_t O, int64_t r,
          int64_t r1, int64_t p, float* y) {
  for (; r + kTileRows <= r1; r += kTileRows)
    rows_by_panels<NP, kTileRows>(x, w, scale, I, O, r, p, y);
  rows_left<NP>(x, w, scale, I, O, r, r1, p, y);
}

// Panels [p0, p1) for every row, in tiles of kTilePanels panels by kTileRows rows: each
// widened weight vector serves kTileRows multiply-adds and each broadcast input
// kTilePanels * kVectors. Rows go in blocks whose inputs stay in L2 (~256 KB) while this
// task's panels stream by; the panels left over, and every panel for one or two rows (a
// decode step of one or two sequences: bound by reading the weights), one at a time.
//
// 16-float registers (AVX-512) over the previous 8-float ones halve the instructions per
// multiply-add, so the core keeps more of the weight stream in flight; one or two rows go
// panel by panel, faster there than three panels at a time (measurements, AVX-512 and
// AVX2 alone: benchmarks/README.md, "A third pass").
template <typename W>
void panels(const float* x, const W* w, const float* scale, int64_t M, int64_t I,
            int64_t O, int64_t p0, int64_t p1, float* y) {
  const int64_t block = std::max<int64_t>(
      2 * kTileRows, 65536 / std::max<int64_t>(I, 1) / kTileRows * kTileRows);
  for (int64_t b0 = 0; b0 < M; b0 += block) {
    const int64_t b1 = std::min(M, b0 + block);
    int64_t p = p0;
    if (b1 - b0 > 2)
      for (; p + kTilePanels <= p1; p += kTilePanels)
        rows<kTilePanels>(x, w, scale, I, O, b0, b1, p, y);
    for (; p < p1; ++p) rows<1>(x, w, scale, I, O, b0, b1, p, y);
  }
}

// One weight of a call: its panels, scales (null: none, float32 panels), output, and sizes.
template <typename W>
struct Matrix {
  const W* w;
  const float* scale;
  float* y;
  int64_t O, n_panels;
};

// Checks one weight's panels `[..., n_panels, I, 16]` against x's I and the O of its result
// `[..., M, O]`, and makes its `Matrix`.
template <typename W, typename Panels, typename Result>
ffi::Error matrix(Panels& w, Result& y, const float* scale, int64_t M, int64_t I, int64_t O,
                  std::vector<Matrix<W>>& matrices) {
  auto w_dims = w->dimensions();
  if (w_dims.size() < 3 || w_dims[w_dims.size() - 1] != kPanel)
    return ffi::Error::InvalidArgument("w must be [..., n_panels, I, 16]");
  const int64_t n_panels = w_dims[w_dims.size() - 3];
  if (w_dims[w_dims.size() - 2] != I || n_panels != (O + kPanel - 1) / kPanel)
    return ffi::Error::InvalidArgument("w must be [ceil(O / 16), I, 16] for x's I and the O of its result");
  if (w->element_count() != n_panels * I * kPanel)
    return ffi::Error::InvalidArgument("w must be shared by all rows (leading axes 1)");
  if ((*y)->element_count() != M * O)
    return ffi::Error::InvalidArgument("each result must be [..., M, O]");
  matrices.push_back({w->typed_data(), scale, (*y)->typed_data(), O, n_panels});
  return ffi::Error::Success();
}

// Every weight's panels for every row of x, spread over the pool: runs of panels of one
// matrix per task, `kTasksPerThread` per thread over all the matrices of the call (one
// parallel loop for all: the threads never wait between them).
template <typename W>
void run(ffi::ThreadPool& pool, const float* xs, int64_t M, int64_t I,
         const std::vector<Matrix<W>>& matrices) {
  if (I == 0) {
    for (auto& m : matrices) std::fill(m.y, m.y + M * m.O, 0.0f);
    return;
  }
  int64_t panels_in_all = 0;
  for (auto& m : matrices) panels_in_all += m.n_panels;
  int64_t per_task = std::max<int64_t>(
      1, panels_in_all / (kTasksPerThread * std::max<int64_t>(1, pool.num_threads())));
  per_task = (per_task + kTilePanels - 1) / kTilePanels * kTilePanels;
  std::vector<std::pair<int64_t, int64_t>> tasks;  // (matrix, first panel)
  for (size_t k = 0; k < matrices.size(); ++k)
    for (int64_t p = 0; p < matrices[k].n_panels; p += per_task) tasks.emplace_back(k, p);
  parallel_for(pool, tasks.size(), [&](int64_t task) {
    const auto [k, p0] = tasks[task];
    const Matrix<W>& m = matrices[k];
    panels(xs, m.w, m.scale, M, I, m.O, p0, std::min(m.n_panels, p0 + per_task), m.y);
  }, true);
}

// x's I and M (the product of its leading axes).
std::pair<int64_t, int64_t> rows_and_inputs(ffi::Buffer<ffi::F32>& x) {
  auto x_dims = x.dimensions();
  const int64_t I = x_dims.size() < 1 ? 0 : x_dims[x_dims.size() - 1];
  return {I == 0 ? 0 : x.element_count() / I, I};
}

ffi::Error Int8Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::RemainingArgs args,
                      ffi::RemainingRets rets) {
  if (x.dimensions().size() < 1) return ffi::Error::InvalidArgument("x must be [..., M, I]");
  const auto [M, I] = rows_and_inputs(x);
  if (args.size() != 2 * rets.size() || rets.size() == 0)
    return ffi::Error::InvalidArgument("give (w, scale) pairs, one result per pair");
  std::vector<Matrix<int8_t>> matrices;
  for (size_t k = 0; k < rets.size(); ++k) {
    auto w = args.get<ffi::Buffer<ffi::S8>>(2 * k);
    auto scale = args.get<ffi::Buffer<ffi::F32>>(2 * k + 1);
    auto y = rets.get<ffi::Buffer<ffi::F32>>(k);
    if (w.has_error()) return w.error();
    if (scale.has_error()) return scale.error();
    if (y.has_error()) return y.error();
    auto s_dims = scale->dimensions();
    if (s_dims.size() < 1) return ffi::Error::InvalidArgument("scale must be [..., O]");
    const int64_t O = s_dims[s_dims.size() - 1];
    if (scale->element_count() != O)
      return ffi::Error::InvalidArgument("scale must be shared by all rows (leading axes 1)");
    if (auto e = matrix<int8_t>(w, y, scale->typed_data(), M, I, O, matrices); e.failure())
      return e;
  }
  run(pool, x.typed_data(), M, I, matrices);
  return ffi::Error::Success();
}

// Float32 panels: the same products without scales, O from each result `[..., M, O]`.
ffi::Error F32PanelMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                          ffi::RemainingArgs args, ffi::RemainingRets rets) {
  if (x.dimensions().size() < 1) return ffi::Error::InvalidArgument("x must be [..., M, I]");
  const auto [M, I] = rows_and_inputs(x);
  if (args.size() != rets.size() || rets.size() == 0)
    return ffi::Error::InvalidArgument("give one or more weights, one result per weight");
  std::vector<Matrix<float>> matrices;
  for (size_t k = 0; k < rets.size(); ++k) {
    auto w = args.get<ffi::Buffer<ffi::F32>>(k);
    auto y = rets.get<ffi::Buffer<ffi::F32>>(k);
    if (w.has_error()) return w.error();
    if (y.has_error()) return y.error();
    auto y_dims = (*y)->dimensions();
    if (y_dims.size() < 1) return ffi::Error::InvalidArgument("each result must be [..., M, O]");
    const int64_t O = y_dims[y_dims.size() - 1];
    if (auto e = matrix<float>(w, y, nullptr, M, I, O, matrices); e.failure()) return e;
  }
  run(pool, x.typed_data(), M, I, matrices);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GptJaxInt8Matmul, Int8Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .RemainingRets());

XLA_FFI_DEFINE_HANDLER_SYMBOL(GptJaxF32PanelMatmul, F32PanelMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .RemainingRets());
