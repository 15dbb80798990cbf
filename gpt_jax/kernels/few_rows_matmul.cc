// Float32 matmul of a few rows by an output-major weight for XLA:CPU (an XLA FFI custom
// call): y[..., M, O] = x[..., M, I] @ w[O, I]^T. Verifying speculative drafts feeds a few
// positions per sequence (gpt_jax/layers.py `OutputMajor.matmul`): XLA:CPU emits the one-row
// product of a decode step inline, but hands a product of 2 to 8 rows to XNNPACK on its
// thread pool, several times the cost of the inline one for a small model
// (benchmarks/README.md, "Speculative decoding"). This kernel reads each weight row once for
// up to kTileRows rows of x: per tile, each output channel's dot products with the rows are
// summed in eight-float vectors and reduced at the end, on the calling thread (the kernel is
// used for weights that stay in cache: gpt_jax/kernels/few_rows_matmul.py).
//
// Arguments:
//   x  f32 [..., M, I]   (M rows: the product of x's leading axes, which vmap adds)
//   w  f32 [..., O, I]   leading axes of size 1 (shared by every row, vmap's expand_dims)
// Result: y f32 [..., M, O].
//
// Built by gpt_jax/kernels/builder.py on first use (gpt_jax/kernels/few_rows_matmul.py binds it).

#include <algorithm>
#include <cstdint>

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using namespace gpt_jax_kernels;

namespace {

constexpr int64_t kTileRows = 8;  // rows of x per pass over the weights
constexpr int64_t kChannels = 2;  // output channels per step (their weights loaded once)

// Rows [r0, r0 + R) times channels [o0, o1): y[r, o] = sum_i x[r, i] w[o, i].
template <int R>
void tile(const float* x, const float* w, int64_t I, int64_t O, int64_t r0, int64_t o0,
          int64_t o1, float* y) {
  const int64_t I8 = I / 8 * 8;
  int64_t o = o0;
  for (; o + kChannels <= o1; o += kChannels) {
    f32x8 acc[kChannels][R] = {};
    for (int64_t i = 0; i < I8; i += 8) {
      f32x8 wv[kChannels];
      for (int c = 0; c < kChannels; ++c) wv[c] = load8(w + (o + c) * I + i);
      for (int r = 0; r < R; ++r) {
        const f32x8 xv = load8(x + (r0 + r) * I + i);
        for (int c = 0; c < kChannels; ++c) acc[c][r] += xv * wv[c];
      }
    }
    for (int c = 0; c < kChannels; ++c)
      for (int r = 0; r < R; ++r) {
        float total = sum8(acc[c][r]);
        for (int64_t i = I8; i < I; ++i) total += x[(r0 + r) * I + i] * w[(o + c) * I + i];
        y[(r0 + r) * O + o + c] = total;
      }
  }
  for (; o < o1; ++o)
    for (int r = 0; r < R; ++r) {
      f32x8 acc = {};
      for (int64_t i = 0; i < I8; i += 8) acc += load8(x + (r0 + r) * I + i) * load8(w + o * I + i);
      float total = sum8(acc);
      for (int64_t i = I8; i < I; ++i) total += x[(r0 + r) * I + i] * w[o * I + i];
      y[(r0 + r) * O + o] = total;
    }
}

template <int R = 1>
void rows_left(const float* x, const float* w, int64_t I, int64_t O, int64_t r0, int64_t n,
               int64_t o0, int64_t o1, float* y) {
  if constexpr (R <= kTileRows) {
    if (n == R) return tile<R>(x, w, I, O, r0, o0, o1, y);
    rows_left<R + 1>(x, w, I, O, r0, n, o0, o1, y);
  }
}

ffi::Error FewRowsMatmul(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                         ffi::ResultBuffer<ffi::F32> y) {
  auto x_dims = x.dimensions(), w_dims = w.dimensions();
  if (x_dims.size() < 1 || w_dims.size() < 2)
    return ffi::Error::InvalidArgument("x must be [..., M, I] and w [..., O, I]");
  const int64_t I = x_dims[x_dims.size() - 1], O = w_dims[w_dims.size() - 2];
  if (w_dims[w_dims.size() - 1] != I)
    return ffi::Error::InvalidArgument("w must be [O, I] for x's I");
  if (w.element_count() != O * I)
    return ffi::Error::InvalidArgument("w must be shared by all rows (leading axes 1)");
  const int64_t M = I == 0 ? 0 : x.element_count() / I;
  if (y->element_count() != M * O) return ffi::Error::InvalidArgument("y must be [..., M, O]");
  // rows in tiles of kTileRows, each over every channel
  for (int64_t r0 = 0; r0 < M; r0 += kTileRows)
    rows_left(x.typed_data(), w.typed_data(), I, O, r0, std::min(kTileRows, M - r0), 0, O,
              y->typed_data());
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GptJaxFewRowsMatmul, FewRowsMatmul,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
