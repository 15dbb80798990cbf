// Weight-only int8 matmul for XLA:CPU (an XLA FFI custom call):
//   y[..., M, O] = x[..., M, I] @ (w * scale)^T,
// float32 activations, int8 weights with one float32 scale per output channel (symmetric
// absmax quantization; gpt_jax/layers.py `Int8Weight`). XLA:CPU would first widen the whole
// int8 matrix to a float32 copy in memory and then run its float32 dot; a few-row (decode)
// matmul is bound by reading the weights, so this kernel reads the int8 bytes once: int8
// weights are widened to float in a register (vpmovsxbd, vcvtdq2ps), multiplied into the
// rows' accumulators with fused multiply-adds, and each channel's sum is scaled at the end.
// Panels of channels are spread over XLA's intra-op thread pool.
//
// The weights come in panels of sixteen channels, w[n_panels, I, 16] (n_panels =
// ceil(O / 16), channels past O zero): the sixteen weights of input i for sixteen channels
// are consecutive bytes, so the kernel reads memory strictly in order (a panel is one
// stream, which the hardware prefetcher follows, faster than separate channel rows:
// benchmarks/README.md, "The kernel"), and one widened 16-float register (two of 8 floats
// with AVX2) holds a panel's channels: the outer-product form,
// y[r, 16 channels] += x[r, i] * w[i, 16 channels], needs no horizontal sums and lets
// several rows share each widening.
//
// Arguments (M rows: the product of x's leading axes, which vmap adds), then one or more
// weights that all multiply x (a layer's q, k and v projections: one call, one parallel
// loop over the panels of all three):
//   x      f32 [..., M, I]
//   w      s8  [..., n_panels, I, 16] leading axes of size 1 (shared by every row, as
//                                     vmap's expand_dims passes them)
//   scale  f32 [..., O]        as w
// Results: per weight, y f32 [..., M, O].
//
// Built by gpt_jax/kernels/builder.py on first use (gpt_jax/kernels/int8_matmul.py binds it).

#include <algorithm>
#include <cmath>
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

// The CPU's float vector, `fvec` of kLanes floats, and the tile it affords (see `panels`):
// with AVX-512, one 16-float register holds a panel's 16 channels, and 32 registers hold
// 24 accumulators (three panels by eight rows); with AVX2, a panel takes two 8-float
// registers and 16 registers hold 12 (one panel by six rows).
#if defined(__AVX512F__)
typedef float fvec __attribute__((vector_size(64)));
constexpr int kLanes = 16, kTilePanels = 3, kTileRows = 8;
#else
typedef f32x8 fvec;
constexpr int kLanes = 8, kTilePanels = 1, kTileRows = 6;
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

inline fvec broadcast(const float* p) {  // vbroadcastss from memory (`fvec{} + *p` added 0)
#if defined(__AVX512F__)
  return (fvec)_mm512_set1_ps(*p);
#elif defined(__AVX__)
  return (fvec)_mm256_set1_ps(*p);
#else
  return fvec{*p, *p, *p, *p, *p, *p, *p, *p};
#endif
}

// acc + a * b, one rounding where the CPU has fused multiply-add (GCC does not contract
// `acc + a * b` under -std=c++17).
inline fvec fma(fvec a, fvec b, fvec acc) {
#if defined(__AVX512F__)
  return (fvec)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)acc);
#elif defined(__FMA__)
  return (fvec)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)acc);
#else
  return acc + a * b;
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
template <int NP, int R, int U>
void panel_tile(const float* x, int64_t I, const int8_t* panel, float* out) {
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
    if (((i * kPanel) & 63) < U * kPanel)
      for (int p = 0; p < NP; ++p)
        __builtin_prefetch(panel + p * stride + i * kPanel + kPrefetchBytes);
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
template <int NP, int R>
void rows_by_panels(const float* x, const int8_t* w, const float* scale, int64_t I, int64_t O,
                    int64_t r0, int64_t p, float* y) {
  float out[NP * R * kPanel];
  panel_tile<NP, R, copies(NP, R)>(x + r0 * I, I, w + p * I * kPanel, out);
  for (int q = 0; q < NP; ++q) {
    const int64_t c0 = (p + q) * kPanel, n = std::min(kPanel, O - c0);
    for (int r = 0; r < R; ++r)
      for (int64_t j = 0; j < n; ++j)
        y[(r0 + r) * O + c0 + j] = out[(q * R + r) * kPanel + j] * scale[c0 + j];
  }
}

// Rows [r, r1) times panels [p, p + NP): tiles of kTileRows rows, then the rows left over
// as one tile of their number (R, below kTileRows, from the template recursion).
template <int NP, int R = 1>
void rows_left(const float* x, const int8_t* w, const float* scale, int64_t I, int64_t O,
               int64_t r, int64_t r1, int64_t p, float* y) {
  if constexpr (R < kTileRows) {
    if (r1 - r == R) return rows_by_panels<NP, R>(x, w, scale, I, O, r, p, y);
    rows_left<NP, R + 1>(x, w, scale, I, O, r, r1, p, y);
  }
}

template <int NP>
void rows(const float* x, const int8_t* w, const float* scale, int64_t I, int64_t O, int64_t r,
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
void panels(const float* x, const int8_t* w, const float* scale, int64_t M, int64_t I,
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

// ---------------------------------------------------------------------------------------
// The integer path (AVX-512 VNNI and VBMI): x rounded to 24-bit fixed point per row, its
// digits times the int8 weights by vpdpbusd (64 multiply-adds per instruction, exact in
// int32), scaled once per output.
//
// Widening int8 to float costs two instructions per 16 weights besides the multiply-add, so
// the float path above is bound by issue slots, not memory, at few rows (one decode row: 4
// instructions per 16 weight bytes). Here each row of x becomes q = round(x / s) with
// s = max|x| / kFixedMax, |q| <= kFixedMax < 2^23, written as three signed base-256 digits,
// q = 65536 hi + 256 mid + lo (each in [-127, 127], [-128, 127], [-128, 127]). For four
// inputs and sixteen channels (64 weight bytes, one instruction each), vpdpbusd adds
// sum_k u[4j + k] * d[k] into channel j's int32 sum, with u the weight bytes as unsigned
// (w + 128: one xor; vpdpbusd multiplies unsigned by signed bytes) rearranged channel-major
// (one vpermb) and d one digit of the four inputs, broadcast. Then per digit
// sum_i d_i w_i = sum_i d_i u_i - 128 sum_i d_i, and y = scale[o] * s * (65536 D_hi + 256 D_mid
// + D_lo). Each input is off by at most s / 2 = max|x| / 2^24.0: the size of float32's own
// rounding of the row's largest input, so outputs agree with the float path to float
// rounding (tests/test_quantize.py holds both to one bound). Every product and sum is an
// exact integer below 2^31 for I <= kVnniMaxInputs. Per 64 weight bytes and row: three
// instructions where the float path takes four multiply-adds and, at one row, eight
// widening instructions. A row with a non-finite input takes the float path (NaN and inf
// propagate as in float).
#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__) && defined(__AVX512BW__)
#define GPT_JAX_INT8_VNNI 1

constexpr int kDigits = 3;
constexpr int32_t kFixedMax = 127 * 65536 + 127 * 256 + 127;  // the digits' largest q
constexpr int64_t kVnniMaxInputs = 65536;  // |sum of u * d| <= 255 * 128 * I < 2^31
constexpr int kVnniRows = 8;  // rows per tile: 24 accumulators and one weight register

// x as digits: row r's inputs [0, I4) (I4 = I rounded up to 4; the padding is zero) in
// groups of four, each group the four inputs' digit hi, then mid, then lo (one dword per
// digit: d[r * kDigits * I4 + (i / 4) * 4 * kDigits + 4 k + i % 4]); the row's step s and
// each digit's sum over the row.
struct Digits {
  int64_t I4 = 0;
  std::vector<int8_t> d;
  std::vector<float> step;
  std::vector<int32_t> sums;  // [M, kDigits]
};

// Whether every input is finite (else the float path runs, as NaN and inf need).
bool all_finite(const float* x, int64_t n) {
  bool finite = true;
  for (int64_t i = 0; i < n; ++i) finite &= std::isfinite(x[i]);
  return finite;
}

// Row r of x [M, I] into `digits` (sized by the caller).
void to_digits(const float* x, int64_t I, int64_t r, Digits& digits) {
  const float* row = x + r * I;
  float largest = 0.0f;
  for (int64_t i = 0; i < I; ++i) largest = std::max(largest, std::fabs(row[i]));
  const double step = largest / double(kFixedMax), inverse = largest > 0 ? 1.0 / step : 0.0;
  int8_t* d = digits.d.data() + r * kDigits * digits.I4;
  int32_t sums[kDigits] = {0, 0, 0};
  for (int64_t i = 0; i < I; ++i) {
    const int32_t q = std::clamp<int32_t>(int32_t(std::nearbyint(row[i] * inverse)),
                                          -kFixedMax, kFixedMax);
    const int32_t lo = ((q + 128) & 255) - 128, q1 = (q - lo) / 256;
    const int32_t mid = ((q1 + 128) & 255) - 128, hi = (q1 - mid) / 256;
    int8_t* group = d + (i / 4) * 4 * kDigits + i % 4;
    group[0] = int8_t(hi), group[4] = int8_t(mid), group[8] = int8_t(lo);
    sums[0] += hi, sums[1] += mid, sums[2] += lo;
  }
  digits.step[r] = float(step);
  for (int k = 0; k < kDigits; ++k) digits.sums[r * kDigits + k] = sums[k];
}

// acc + the sums of four products u8(u) * s8(d) per dword (vpdpbusd), in place: the
// intrinsic made GCC copy every accumulator per instruction, and spill them for 8 rows.
inline __m512i dpbusd(__m512i acc, __m512i u, __m512i d) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(d));
  return acc;
}

// The vpermb order taking 64 weight bytes [4 inputs, 16 channels] to channel-major
// [16 channels, 4 inputs], the order in which vpdpbusd sums.
inline __m512i channel_major_order() {
  alignas(64) int8_t idx[64];
  for (int c = 0; c < 16; ++c)
    for (int k = 0; k < 4; ++k) idx[c * 4 + k] = int8_t(k * 16 + c);
  return _mm512_load_si512(idx);
}

// Adds one group of four inputs to the R rows' accumulators: `w` the group's 64 weight
// bytes, loaded, made unsigned (w + 128) and channel-major; d[r] row r's digits of the
// group (kDigits dwords).
template <int R>
inline void vnni_group(__m512i w, __m512i order, const int32_t* const (&d)[R],
                       __m512i (&acc)[R][kDigits]) {
  const __m512i u = _mm512_permutexvar_epi8(order, _mm512_xor_si512(w, _mm512_set1_epi8(-128)));
  for (int r = 0; r < R; ++r)
    for (int k = 0; k < kDigits; ++k)
      acc[r][k] = dpbusd(acc[r][k], u, _mm512_set1_epi32(d[r][k]));
}

// Rows [r0, r0 + R) times panel p: y[r, 16p + j] for the panel's channels below O.
template <int R>
void vnni_tile(const Digits& x, const int8_t* w, const float* scale, int64_t I, int64_t O,
               int64_t r0, int64_t p, float* y) {
  __m512i acc[R][kDigits];
  for (int r = 0; r < R; ++r)
    for (int k = 0; k < kDigits; ++k) acc[r][k] = _mm512_setzero_si512();
  const __m512i order = channel_major_order();
  const int8_t* panel = w + p * I * kPanel;
  const int32_t* d[R];
  for (int r = 0; r < R; ++r)
    d[r] = reinterpret_cast<const int32_t*>(x.d.data() + (r0 + r) * kDigits * x.I4);
  const int64_t whole = I / 4;
  for (int64_t g = 0; g < whole; ++g) {
    __builtin_prefetch(panel + g * 64 + kPrefetchBytes);
    vnni_group<R>(_mm512_loadu_si512(panel + g * 64), order, d, acc);
    for (int r = 0; r < R; ++r) d[r] += kDigits;
  }
  if (whole * 4 < I) {  // the last 1-3 inputs: their bytes only (the rest 128 * zero digits)
    const __mmask64 mask = (__mmask64(1) << ((I - 4 * whole) * kPanel)) - 1;
    vnni_group<R>(_mm512_maskz_loadu_epi8(mask, panel + whole * 64), order, d, acc);
  }
  const int64_t c0 = p * kPanel, n = std::min(kPanel, O - c0);
  for (int r = 0; r < R; ++r) {
    alignas(64) int32_t sums[kDigits][kPanel];
    for (int k = 0; k < kDigits; ++k) _mm512_store_si512(sums[k], acc[r][k]);
    const int32_t* row_sums = x.sums.data() + (r0 + r) * kDigits;
    const double step = x.step[r0 + r];
    for (int64_t j = 0; j < n; ++j) {
      double q = 0.0;
      for (int k = 0; k < kDigits; ++k) q = 256.0 * q + double(sums[k][j] - 128 * row_sums[k]);
      y[(r0 + r) * O + c0 + j] = float(q * step * scale[c0 + j]);
    }
  }
}

template <int R = 1>
void vnni_rows_left(const Digits& x, const int8_t* w, const float* scale, int64_t I,
                    int64_t O, int64_t r, int64_t r1, int64_t p, float* y) {
  if constexpr (R < kVnniRows) {
    if (r1 - r == R) return vnni_tile<R>(x, w, scale, I, O, r, p, y);
    vnni_rows_left<R + 1>(x, w, scale, I, O, r, r1, p, y);
  }
}

// Panels [p0, p1) for every row, rows in blocks whose digits stay in L2 while the panels
// stream by, each block in tiles of kVnniRows rows and one of the rows left over.
void vnni_panels(const Digits& x, const int8_t* w, const float* scale, int64_t M, int64_t I,
                 int64_t O, int64_t p0, int64_t p1, float* y) {
  const int64_t block = std::max<int64_t>(
      2 * kVnniRows, 65536 / std::max<int64_t>(kDigits * x.I4 / 4, 1) / kVnniRows * kVnniRows);
  for (int64_t b0 = 0; b0 < M; b0 += block) {
    const int64_t b1 = std::min(M, b0 + block);
    for (int64_t p = p0; p < p1; ++p) {
      int64_t r = b0;
      for (; r + kVnniRows <= b1; r += kVnniRows) vnni_tile<kVnniRows>(x, w, scale, I, O, r, p, y);
      vnni_rows_left(x, w, scale, I, O, r, b1, p, y);
    }
  }
}
#endif

// One weight of a call: its panels, scales, output, and sizes.
struct Matrix {
  const int8_t* w;
  const float* scale;
  float* y;
  int64_t O, n_panels;
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
      return ffi::Error::InvalidArgument("w must be [..., n_panels, I, 16] and scale [..., O]");
    const int64_t n_panels = w_dims[w_dims.size() - 3], O = s_dims[s_dims.size() - 1];
    if (w_dims[w_dims.size() - 2] != I || n_panels != (O + kPanel - 1) / kPanel)
      return ffi::Error::InvalidArgument("w must be [ceil(O / 16), I, 16] for x's I and scale's O");
    if (w->element_count() != n_panels * I * kPanel || scale->element_count() != O)
      return ffi::Error::InvalidArgument(
          "w and scale must be shared by all rows (leading axes 1)");
    if ((*y)->element_count() != M * O)
      return ffi::Error::InvalidArgument("each result must be [..., M, O]");
    matrices.push_back({w->typed_data(), scale->typed_data(), (*y)->typed_data(), O, n_panels});
  }
  if (I == 0) {
    for (auto& m : matrices) std::fill(m.y, m.y + M * m.O, 0.0f);
    return ffi::Error::Success();
  }
  // Runs of panels of one matrix per task, `kTasksPerThread` per thread over all the
  // matrices of the call (one parallel loop for all: the threads never wait between them).
  int64_t panels_in_all = 0;
  for (auto& m : matrices) panels_in_all += m.n_panels;
  int64_t per_task = std::max<int64_t>(
      1, panels_in_all / (kTasksPerThread * std::max<int64_t>(1, pool.num_threads())));
  per_task = (per_task + kTilePanels - 1) / kTilePanels * kTilePanels;
  std::vector<std::pair<int64_t, int64_t>> tasks;  // (matrix, first panel)
  for (size_t k = 0; k < matrices.size(); ++k)
    for (int64_t p = 0; p < matrices[k].n_panels; p += per_task) tasks.emplace_back(k, p);
  const float* xs = x.typed_data();
#if GPT_JAX_INT8_VNNI
  if (I <= kVnniMaxInputs && all_finite(xs, M * I)) {
    Digits digits;
    digits.I4 = (I + 3) / 4 * 4;
    digits.d.assign(M * kDigits * digits.I4, 0);
    digits.step.resize(M);
    digits.sums.resize(M * kDigits);
    constexpr int64_t kRowsPerTask = 16;  // many rows (a prefill): their digits in parallel
    if (M <= kRowsPerTask) {
      for (int64_t r = 0; r < M; ++r) to_digits(xs, I, r, digits);
    } else {
      parallel_for(pool, (M + kRowsPerTask - 1) / kRowsPerTask, [&](int64_t task) {
        for (int64_t r = task * kRowsPerTask; r < std::min(M, (task + 1) * kRowsPerTask); ++r)
          to_digits(xs, I, r, digits);
      });
    }
    parallel_for(pool, tasks.size(), [&](int64_t task) {
      const auto [k, p0] = tasks[task];
      const Matrix& m = matrices[k];
      vnni_panels(digits, m.w, m.scale, M, I, m.O, p0, std::min(m.n_panels, p0 + per_task), m.y);
    });
    return ffi::Error::Success();
  }
#endif
  parallel_for(pool, tasks.size(), [&](int64_t task) {
    const auto [k, p0] = tasks[task];
    const Matrix& m = matrices[k];
    panels(xs, m.w, m.scale, M, I, m.O, p0, std::min(m.n_panels, p0 + per_task), m.y);
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
