// Weight-only int8 matmul for XLA:CPU (an XLA FFI custom call):
//   y[..., M, O] = x[..., M, I] @ (w * scale)^T,
// float32 activations, int8 weights with one float32 scale per output channel (symmetric
// absmax quantization; gpt_jax/model.py `Int8Weight`). XLA:CPU would first widen the whole
// int8 matrix to a float32 copy in memory and then run its float32 dot; a few-row (decode)
// matmul is bound by reading the weights, so this kernel reads the int8 bytes once: eight
// int8 weights are widened to float in a register (vpmovsxbd, vcvtdq2ps), multiplied into
// the rows' accumulators with fused multiply-adds, and each channel's sum is scaled at the
// end. Panels of channels are spread over XLA's intra-op thread pool.
//
// The weights come in panels of eight channels, w[P, I, 8] (P = ceil(O / 8), channels past
// O zero): the eight weights of input i for eight channels are eight consecutive bytes, so
// the kernel reads memory strictly in order (a panel is one stream, which the hardware
// prefetcher follows; eight separate channel rows ran at half the speed here), and one
// widened vector holds eight channels: the outer-product form, y[r, 8 channels] +=
// x[r, i] * w[i, 8 channels], needs no horizontal sums and lets eight rows share each
// widening.
//
// Arguments (M rows: the product of x's leading axes, which vmap adds), then one or more
// weights that all multiply x (a layer's q, k and v projections: one call, one parallel
// loop over the panels of all three):
//   x      f32 [..., M, I]
//   w      s8  [..., P, I, 8]  leading axes of size 1 (shared by every row, as vmap's
//                              expand_dims passes them)
//   scale  f32 [..., O]        as w
// Results: per weight, y f32 [..., M, O].
//
// Built by gpt_jax/cpu_kernels.py on first use (gpt_jax/cpu_int8.py binds it).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#if defined(__AVX2__) || defined(__FMA__)
#include <immintrin.h>
#endif

#include "cpu_kernels.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using namespace gpt_jax_kernels;

namespace {

constexpr int64_t kPanel = 8;  // channels per panel: one vector of eight floats
constexpr int64_t kPrefetchBytes = 2048;  // how far ahead in a panel's bytes to prefetch
constexpr int64_t kL1Bytes = 32768;  // the L1 data cache of a core
// Tasks per thread in a call: the threads claim them one by one, so the last one to finish
// waits at most one task's time for the other.
constexpr int64_t kTasksPerThread = 8;

typedef int8_t i8x8 __attribute__((vector_size(8)));

inline f32x8 widen8(const int8_t* p) {  // eight int8, widened exactly
#if defined(__AVX2__)
  // vpmovsxbd + vcvtdq2ps: GCC scalarizes __builtin_convertvector from 8-byte vectors.
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return (f32x8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
#else
  i8x8 v;
  std::memcpy(&v, p, sizeof v);
  return __builtin_convertvector(v, f32x8);
#endif
}

inline f32x8 broadcast8(const float* p) {
  f32x8 v = {*p, *p, *p, *p, *p, *p, *p, *p};  // vbroadcastss
  return v;
}

// acc + a * b, one rounding where the CPU has fused multiply-add (GCC does not contract
// `acc + a * b` under -std=c++17).
inline f32x8 fma8(f32x8 a, f32x8 b, f32x8 acc) {
#if defined(__FMA__)
  return (f32x8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)acc);
#else
  return acc + a * b;
#endif
}

// R rows (stride I) times NP consecutive panels [I, 8] into out[NP, R, 8], unscaled. U
// copies of the accumulators over consecutive inputs: a fused multiply-add takes ~4 cycles
// before its sum can take the next, so few rows need several independent chains to keep
// the core busy (NP * R * U accumulators, at most 12 of the 16 AVX registers).
template <int NP, int R, int U>
void panel_tile(const float* x, int64_t I, const int8_t* panel, float* out) {
  f32x8 acc[U][NP][R];
  for (int u = 0; u < U; ++u)
    for (int p = 0; p < NP; ++p)
      for (int r = 0; r < R; ++r) acc[u][p][r] = f32x8{};
  const int64_t stride = I * kPanel;  // bytes from one panel to the next
  int64_t i = 0;
  for (; i + U <= I; i += U) {
    // One cache line ahead every 64 bytes, 2 KB ahead: one thread streamed 14 -> 16 GB/s.
    if ((i & 7) < U)
      for (int p = 0; p < NP; ++p)
        __builtin_prefetch(panel + p * stride + i * kPanel + kPrefetchBytes);
    for (int u = 0; u < U; ++u) {
      f32x8 w[NP];
      for (int p = 0; p < NP; ++p) w[p] = widen8(panel + p * stride + (i + u) * kPanel);
      for (int r = 0; r < R; ++r) {
        const f32x8 xr = broadcast8(x + r * I + i + u);
        for (int p = 0; p < NP; ++p) acc[u][p][r] = fma8(xr, w[p], acc[u][p][r]);
      }
    }
  }
  for (; i < I; ++i) {
    for (int p = 0; p < NP; ++p) {
      const f32x8 w = widen8(panel + p * stride + i * kPanel);
      for (int r = 0; r < R; ++r) acc[0][p][r] = fma8(broadcast8(x + r * I + i), w, acc[0][p][r]);
    }
  }
  for (int p = 0; p < NP; ++p) {
    for (int r = 0; r < R; ++r) {
      f32x8 total = acc[0][p][r];
      for (int u = 1; u < U; ++u) total += acc[u][p][r];
      std::memcpy(out + (p * R + r) * kPanel, &total, sizeof total);
    }
  }
}

// Rows [r0, r0 + R) times panels [p, p + NP): y[r, 8q + j] = scale[8q + j] *
// sum_i x[r, i] w[q, i, j] for each panel q's channels below O.
template <int NP, int R, int U>
void rows_by_panels(const float* x, const int8_t* w, const float* scale, int64_t I, int64_t O,
                    int64_t r0, int64_t p, float* y) {
  float out[NP * R * kPanel];
  panel_tile<NP, R, U>(x + r0 * I, I, w + p * I * kPanel, out);
  for (int q = 0; q < NP; ++q) {
    const int64_t c0 = (p + q) * kPanel, n = std::min(kPanel, O - c0);
    for (int r = 0; r < R; ++r)
      for (int64_t j = 0; j < n; ++j)
        y[(r0 + r) * O + c0 + j] = out[(q * R + r) * kPanel + j] * scale[c0 + j];
  }
}

// Rows [r, r1) times panel p, in tiles of eight rows (eight accumulators: each widened
// weight vector serves eight multiply-adds), then the rows left over.
void rows_by_panel(const float* x, const int8_t* w, const float* scale, int64_t I, int64_t O,
                   int64_t r, int64_t r1, int64_t p, float* y) {
  for (; r + 8 <= r1; r += 8) rows_by_panels<1, 8, 1>(x, w, scale, I, O, r, p, y);
  switch (r1 - r) {
    case 7: rows_by_panels<1, 7, 1>(x, w, scale, I, O, r, p, y); break;
    case 6: rows_by_panels<1, 6, 2>(x, w, scale, I, O, r, p, y); break;
    case 5: rows_by_panels<1, 5, 2>(x, w, scale, I, O, r, p, y); break;
    case 4: rows_by_panels<1, 4, 2>(x, w, scale, I, O, r, p, y); break;
    case 3: rows_by_panels<1, 3, 4>(x, w, scale, I, O, r, p, y); break;
    case 2: rows_by_panels<1, 2, 4>(x, w, scale, I, O, r, p, y); break;
    case 1: rows_by_panels<1, 1, 4>(x, w, scale, I, O, r, p, y); break;
    default: break;
  }
}

// Rows [r, r1), fewer than six, times the pair of panels p and p + 1: as many copies of
// the accumulators as fit (`panel_tile`'s U), at most twelve.
void rows_by_panel_pair(const float* x, const int8_t* w, const float* scale, int64_t I,
                        int64_t O, int64_t r, int64_t r1, int64_t p, float* y) {
  switch (r1 - r) {
    case 5: rows_by_panels<2, 5, 1>(x, w, scale, I, O, r, p, y); break;
    case 4: rows_by_panels<2, 4, 1>(x, w, scale, I, O, r, p, y); break;
    case 3: rows_by_panels<2, 3, 2>(x, w, scale, I, O, r, p, y); break;
    case 2: rows_by_panels<2, 2, 3>(x, w, scale, I, O, r, p, y); break;
    case 1: rows_by_panels<2, 1, 6>(x, w, scale, I, O, r, p, y); break;
    default: break;
  }
}

// Vector registers the compiler may use: 32 with AVX-512VL (which also encodes eight-float
// operations on registers 16-31), else AVX2's 16.
#if defined(__AVX512VL__)
constexpr int kVectorRegisters = 32;
#else
constexpr int kVectorRegisters = 16;
#endif

// Panels per task are a multiple of this, so a task's panels split into whole pairs and
// whole triples (see `panels`).
constexpr int64_t kPanelGroup = 6;

// Panels [p0, p1) for every row. With a dozen rows or more (a prefill), pairs of panels by
// six rows: twelve accumulators, each widened weight vector serving six multiply-adds, ran
// at 190 GFLOP/s on 2 cores here (the FMA peak) against 163 for one panel by eight rows;
// the rows left over by the same pair of panels (`rows_by_panel_pair`). Eight to eleven
// rows (a batch-8 decode step) with 32 vector registers: three panels by eight rows
// (24 accumulators; each broadcast input serves three multiply-adds, each widened weight
// vector eight), on one Zen 4 core 91-95 GFLOP/s against 76-93 panel by panel for 768
// inputs and 103 against 100 for 3072 (pairs of panels by six rows, then by two). Without
// them, six to eleven rows whose inputs overflow the L1 cache take pairs of panels: eight
// rows of 3072 inputs (the MLP's second matrix) ran at 87 GFLOP/s on one core as six and
// two rows by pairs of panels, 74 panel by panel (`rows_by_panel`: eight rows' inputs from
// L2 per weight vector); of 768 inputs, 80-85 panel by panel, 2-4% above the pairs. Fewer
// rows (a batch-1 decode step), and the panels left over, panel by panel.
void panels(const float* x, const int8_t* w, const float* scale, int64_t M, int64_t I,
            int64_t O, int64_t p0, int64_t p1, float* y) {
  // Rows in blocks whose inputs stay in L2 (~256 KB) while this task's panels stream by.
  const int64_t block = std::max<int64_t>(12, 65536 / std::max<int64_t>(I, 1) / 6 * 6);
  for (int64_t b0 = 0; b0 < M; b0 += block) {
    const int64_t b1 = std::min(M, b0 + block), rows = b1 - b0;
    int64_t p = p0;
    if (kVectorRegisters >= 32 && rows >= 8 && rows < 12) {
      for (; p + 3 <= p1; p += 3) {
        rows_by_panels<3, 8, 1>(x, w, scale, I, O, b0, p, y);
        for (int64_t q = p; q < p + 3; ++q) rows_by_panel(x, w, scale, I, O, b0 + 8, b1, q, y);
      }
    } else if (rows >= 12 || (rows >= 6 && rows * I * 4 > kL1Bytes)) {
      for (; p + 2 <= p1; p += 2) {
        int64_t r = b0;
        for (; r + 6 <= b1; r += 6) rows_by_panels<2, 6, 1>(x, w, scale, I, O, r, p, y);
        rows_by_panel_pair(x, w, scale, I, O, r, b1, p, y);
      }
    }
    for (; p < p1; ++p) rows_by_panel(x, w, scale, I, O, b0, b1, p, y);
  }
}

// One weight of a call: its panels, scales, output, and sizes.
struct Matrix {
  const int8_t* w;
  const float* scale;
  float* y;
  int64_t O, P;
};

ffi::Error Int8Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::RemainingArgs args,
                      ffi::RemainingRets rets) {
  auto x_dims = x.dimensions();
  if (x_dims.size() < 1) return ffi::Error::InvalidArgument("x must be [..., M, I]");
  const int64_t I = x_dims[x_dims.size() - 1];
  const int64_t M = I == 0 ? 0 : x.element_count() / I;
  if (args.size() != 2 * rets.size() || rets.size() == 0)
    return ffi::Error::InvalidArgument("give (w, scale) pairs, one result per pair");
  std::vector<Matrix> matrices;
  for (size_t k = 0; k < rets.size(); ++k) {
    auto w = args.get<ffi::Buffer<ffi::S8>>(2 * k);
    auto scale = args.get<ffi::Buffer<ffi::F32>>(2 * k + 1);
    auto y = rets.get<ffi::Buffer<ffi::F32>>(k);
    if (w.has_error()) return w.error();
    if (scale.has_error()) return scale.error();
    if (y.has_error()) return y.error();
    auto w_dims = w->dimensions(), s_dims = scale->dimensions();
    if (w_dims.size() < 3 || s_dims.size() < 1 || w_dims[w_dims.size() - 1] != kPanel)
      return ffi::Error::InvalidArgument("w must be [..., P, I, 8] and scale [..., O]");
    const int64_t P = w_dims[w_dims.size() - 3], O = s_dims[s_dims.size() - 1];
    if (w_dims[w_dims.size() - 2] != I || P != (O + kPanel - 1) / kPanel)
      return ffi::Error::InvalidArgument("w must be [ceil(O / 8), I, 8] for x's I and scale's O");
    if (w->element_count() != P * I * kPanel || scale->element_count() != O)
      return ffi::Error::InvalidArgument(
          "w and scale must be shared by all rows (leading axes 1)");
    if ((*y)->element_count() != M * O)
      return ffi::Error::InvalidArgument("each result must be [..., M, O]");
    matrices.push_back({w->typed_data(), scale->typed_data(), (*y)->typed_data(), O, P});
  }
  if (I == 0) {
    for (auto& m : matrices) std::fill(m.y, m.y + M * m.O, 0.0f);
    return ffi::Error::Success();
  }
  // Runs of panels of one matrix per task, `kTasksPerThread` per thread over all the
  // matrices of the call (one parallel loop for all: the threads never wait between them).
  int64_t panels_in_all = 0;
  for (auto& m : matrices) panels_in_all += m.P;
  int64_t per_task = std::max<int64_t>(
      1, panels_in_all / (kTasksPerThread * std::max<int64_t>(1, pool.num_threads())));
  per_task = (per_task + kPanelGroup - 1) / kPanelGroup * kPanelGroup;
  std::vector<std::pair<int64_t, int64_t>> tasks;  // (matrix, first panel)
  for (size_t k = 0; k < matrices.size(); ++k)
    for (int64_t p = 0; p < matrices[k].P; p += per_task) tasks.emplace_back(k, p);
  const float* xs = x.typed_data();
  parallel_for(pool, tasks.size(), [&](int64_t task) {
    const auto [k, p0] = tasks[task];
    const Matrix& m = matrices[k];
    panels(xs, m.w, m.scale, M, I, m.O, p0, std::min(m.P, p0 + per_task), m.y);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GptJaxInt8Matmul, Int8Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .RemainingRets());
