// Decode attention over a paged KV cache, for XLA:CPU (an XLA FFI custom call).
//
// G queries per (row, kv head) attend over slots [0, length) of that row's pages, found
// through its page table in a pool shared by all rows (PagedAttention, Kwon et al. 2023).
// XLA:CPU runs the same computation as batched matrix-vector dots on one thread (about half
// the memory bandwidth of this memory-bound step); this kernel spreads the (row, kv head)
// pairs over XLA's intra-op thread pool and reads exactly each row's live slots.
//
// Arguments (B rows: the product of the leading axes of q, which vmap adds):
//   q           f32 [..., K, G, H]  queries, G per kv head
//   lengths     s32 [...]           slots to attend per row (0: the output is zeros; past
//                                   the row's pages: all of them)
//   page_table  s32 [..., max_pages]  the row's pages in order; a negative entry ends the
//                                     row
//   k_pool      f32 or bf16 [..., num_pages, K, P, H]  key pages (leading axes of size 1:
//                                                      shared)
//   v_pool      as k_pool           value pages
// Results: out f32 [..., K, G, H], softmax(q k^T / sqrt(H)) v with a float32 softmax
// (Vaswani et al. 2017), max-subtracted (online, page by page, for H of 32, 64 and 128);
// and lse f32 [..., K, G], the log of the softmax denominator (log sum exp of the scores;
// -1e30 for a row with no slot), so the caller can fold in more keys (online softmax).
//
// Built by gpt_jax/kernels/builder.py on first use (gpt_jax/kernels/paged_attention.py binds it).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using namespace gpt_jax_kernels;

namespace {

inline float to_f32(float x) { return x; }

inline float to_f32(uint16_t bf16) {  // bfloat16 is the top half of a float32
  uint32_t bits = uint32_t(bf16) << 16;
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

constexpr float kNoScore = -1e30f;  // lse of a row with no slot (the model's MASK_VALUE)

// One pool of pages, [num_pages, K, P, H], and the page tables, [B, max_pages], that index it.
template <typename T>
struct Pool {
  const T* data;
  const int32_t* page_table;
  int64_t num_pages, K, P, H, max_pages;

  const T* slots(int64_t page, int64_t k) const { return data + ((page * K + k) * P) * H; }
};

// fn(page, s, n) for each page of row b, in order, holding its slots [s, s + n) of
// [0, length). A page table entry outside the pool ends the row.
template <typename T, typename Fn>
void for_each_page(const Pool<T>& pool, int64_t b, int64_t length, Fn fn) {
  for (int64_t i = 0, s = 0; i < pool.max_pages && s < length; ++i) {
    const int64_t page = pool.page_table[b * pool.max_pages + i];
    if (page < 0 || page >= pool.num_pages) return;
    const int64_t n = std::min<int64_t>(pool.P, length - s);
    fn(page, s, n);
    s += n;
  }
}

// The slots row b can reach: its pages up to the first entry outside the pool.
template <typename T>
int64_t row_capacity(const Pool<T>& pool, int64_t b) {
  int64_t i = 0;
  while (i < pool.max_pages && pool.page_table[b * pool.max_pages + i] >= 0 &&
         pool.page_table[b * pool.max_pages + i] < pool.num_pages) ++i;
  return i * pool.P;
}

// Row b, kv head k: out[G, H] = softmax(scores) v over the first `length` slots, any H.
template <typename T>
void attend_one(const float* q_GH, const Pool<T>& keys, const Pool<T>& values, int64_t b,
                int64_t k, int64_t G, int64_t H, int64_t length, float* out_GH,
                float* lse_G) {
  std::fill(out_GH, out_GH + G * H, 0.0f);
  std::fill(lse_G, lse_G + G, kNoScore);
  if (length <= 0) return;
  thread_local std::vector<float> scores_GS;
  scores_GS.resize(G * length);
  const float scale = 1.0f / std::sqrt(float(H));

  for_each_page(keys, b, length, [&](int64_t page, int64_t s, int64_t n) {
    const T* k_SH = keys.slots(page, k);
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t g = 0; g < G; ++g) {
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t h = 0; h < H; ++h) dot += q_GH[g * H + h] * to_f32(k_SH[i * H + h]);
        scores_GS[g * length + s + i] = dot * scale;
      }
    }
  });
  for (int64_t g = 0; g < G; ++g) {
    float* row = scores_GS.data() + g * length;
    const float max = *std::max_element(row, row + length);
    float total = 0.0f;
    for (int64_t s = 0; s < length; ++s) total += (row[s] = std::exp(row[s] - max));
    for (int64_t s = 0; s < length; ++s) row[s] /= total;
    lse_G[g] = max + std::log(total);
  }
  for_each_page(values, b, length, [&](int64_t page, int64_t s, int64_t n) {
    const T* v_SH = values.slots(page, k);
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t g = 0; g < G; ++g) {
        const float prob = scores_GS[g * length + s + i];
        float* o = out_GH + g * H;
#pragma omp simd
        for (int64_t h = 0; h < H; ++h) o[h] += prob * to_f32(v_SH[i * H + h]);
      }
    }
  });
}

// Row b, kv heads [k0, k1), for a head dim known at compile time (a multiple of 8): page by
// page, every head of the range in turn, with the online softmax (Milakov & Gimelshein
// 2018; the decode form of FlashAttention, Dao et al. 2022): per query head a running max,
// a running sum and the output's running sum, rescaled when the max grows. So a row's keys
// and values are read as two streams of whole pages (48 KB per GPT-2 page, all heads), not
// 4 KB per head per page where the hardware prefetcher started again at every piece
// (benchmarks/README.md, "A third pass"). The query and output stay in registers while a page's
// slots are dotted four at a time (independent accumulator chains).
template <typename T, int64_t H>
void attend_heads(const float* q_KGH, const Pool<T>& keys, const Pool<T>& values, int64_t b,
                  int64_t k0, int64_t k1, int64_t G, int64_t length, float* out_KGH,
                  float* lse_KG) {
  constexpr int64_t C = H / 8;  // vectors per head
  const int64_t heads = (k1 - k0) * G;
  std::fill(out_KGH + k0 * G * H, out_KGH + k1 * G * H, 0.0f);
  std::fill(lse_KG + k0 * G, lse_KG + k1 * G, kNoScore);
  if (length <= 0) return;
  thread_local std::vector<float> state;  // per query head: max, sum
  state.assign(2 * heads, 0.0f);
  for (int64_t j = 0; j < heads; ++j) state[2 * j] = kNoScore;
  const float scale = 1.0f / std::sqrt(float(H));
  float scores[256];
  for_each_page(keys, b, length, [&](int64_t page, int64_t, int64_t n) {
    for (int64_t k = k0; k < k1; ++k) {
      const T* k_SH = keys.slots(page, k);
      const T* v_SH = values.slots(page, k);
      for (int64_t g = 0; g < G; ++g) {
        const int64_t j = (k - k0) * G + g;
        f32x8 q[C];
        for (int64_t c = 0; c < C; ++c) q[c] = load8(q_KGH + (k * G + g) * H + c * 8) * scale;
        for (int64_t t0 = 0; t0 < n; t0 += 256) {  // pages of up to 256 slots at a time
          const int64_t m = std::min<int64_t>(256, n - t0);
          const T* kt = k_SH + t0 * H;
          int64_t t = 0;
          for (; t + 4 <= m; t += 4) {
            const T* k4 = kt + t * H;
            f32x8 a0 = q[0] * load8(k4), a1 = q[0] * load8(k4 + H),
                  a2 = q[0] * load8(k4 + 2 * H), a3 = q[0] * load8(k4 + 3 * H);
            for (int64_t c = 1; c < C; ++c) {
              a0 += q[c] * load8(k4 + c * 8);
              a1 += q[c] * load8(k4 + H + c * 8);
              a2 += q[c] * load8(k4 + 2 * H + c * 8);
              a3 += q[c] * load8(k4 + 3 * H + c * 8);
            }
            scores[t] = sum8(a0);
            scores[t + 1] = sum8(a1);
            scores[t + 2] = sum8(a2);
            scores[t + 3] = sum8(a3);
          }
          for (; t < m; ++t) {
            f32x8 a = q[0] * load8(kt + t * H);
            for (int64_t c = 1; c < C; ++c) a += q[c] * load8(kt + t * H + c * 8);
            scores[t] = sum8(a);
          }
          const float old_max = state[2 * j];
          const float max = std::max(old_max, *std::max_element(scores, scores + m));
          const float rescale = std::exp(old_max - max);
          float total = 0.0f;
          for (t = 0; t < m; ++t) total += (scores[t] = std::exp(scores[t] - max));
          state[2 * j] = max;
          state[2 * j + 1] = state[2 * j + 1] * rescale + total;
          float* o_H = out_KGH + (k * G + g) * H;
          f32x8 out[C];
          for (int64_t c = 0; c < C; ++c) out[c] = load8(o_H + c * 8) * rescale;
          const T* vt = v_SH + t0 * H;
          for (t = 0; t < m; ++t)
            for (int64_t c = 0; c < C; ++c) out[c] += scores[t] * load8(vt + t * H + c * 8);
          std::memcpy(o_H, out, sizeof out);
        }
      }
    }
  });
  for (int64_t k = k0; k < k1; ++k) {
    for (int64_t g = 0; g < G; ++g) {
      const int64_t j = (k - k0) * G + g;
      float* o_H = out_KGH + (k * G + g) * H;
      if (state[2 * j + 1] == 0.0f) continue;  // no slot: zeros
      const float total = state[2 * j + 1];
      for (int64_t h = 0; h < H; ++h) o_H[h] /= total;
      lse_KG[k * G + g] = state[2 * j] + std::log(total);
    }
  }
}

template <typename T>
ffi::Error run(ffi::ThreadPool& pool, const float* q, const int32_t* lengths, int64_t B,
               int64_t K, int64_t G, int64_t H, const int32_t* page_table, int64_t max_pages,
               ffi::AnyBuffer k_pool, ffi::AnyBuffer v_pool, float* out, float* lse) {
  auto dims = k_pool.dimensions();
  if (dims.size() < 4 || dims[dims.size() - 3] != K || dims[dims.size() - 1] != H)
    return ffi::Error::InvalidArgument(
        "pools must be [..., num_pages, K, P, H] with q's K and H");
  auto v_dims = v_pool.dimensions();
  if (v_pool.element_type() != k_pool.element_type() || v_dims.size() != dims.size() ||
      !std::equal(dims.begin(), dims.end(), v_dims.begin()))
    return ffi::Error::InvalidArgument("key and value pools differ in dtype or shape");
  const int64_t num_pages = dims[dims.size() - 4], P = dims[dims.size() - 2];
  if (k_pool.element_count() != num_pages * K * P * H)
    return ffi::Error::InvalidArgument("pools must be shared by all rows (leading axes 1)");
  const Pool<T> keys{reinterpret_cast<const T*>(k_pool.untyped_data()), page_table, num_pages,
                     K, P, H, max_pages};
  const Pool<T> values{reinterpret_cast<const T*>(v_pool.untyped_data()), page_table,
                       num_pages, K, P, H, max_pages};
  // Contiguous runs of (row, kv head) items per task (a run may end part-way through a row's
  // heads and go on into the next row's), each row's part of a run in one call.
  const int64_t items = B * K, run_size = std::max<int64_t>(1, items / 8);
  parallel_for(pool, (items + run_size - 1) / run_size, [&](int64_t task) {
    const int64_t end = std::min(items, (task + 1) * run_size);
    for (int64_t item = task * run_size; item < end;) {
      const int64_t b = item / K, k0 = item % K, k1 = std::min(K, k0 + end - item);
      item += k1 - k0;
      // A row never attends past its pages (the XLA path's bound): a length beyond them
      // (a write refused at the end of the cache) means all of them.
      const int64_t length = std::min<int64_t>(lengths[b], row_capacity(keys, b));
      const float* q_KGH = q + b * K * G * H;
      float* out_KGH = out + b * K * G * H;
      float* lse_KG = lse + b * K * G;
      if (H == 32) {  // the shakespeare-char and nanogpt-cpu presets
        attend_heads<T, 32>(q_KGH, keys, values, b, k0, k1, G, length, out_KGH, lse_KG);
      } else if (H == 64) {  // GPT-2
        attend_heads<T, 64>(q_KGH, keys, values, b, k0, k1, G, length, out_KGH, lse_KG);
      } else if (H == 128) {
        attend_heads<T, 128>(q_KGH, keys, values, b, k0, k1, G, length, out_KGH, lse_KG);
      } else {
        for (int64_t k = k0; k < k1; ++k)
          attend_one(q_KGH + k * G * H, keys, values, b, k, G, H, length,
                     out_KGH + k * G * H, lse_KG + k * G);
      }
    }
  }, true);
  return ffi::Error::Success();
}

ffi::Error PagedDecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                                ffi::Buffer<ffi::S32> lengths, ffi::Buffer<ffi::S32> page_table,
                                ffi::AnyBuffer k_pool, ffi::AnyBuffer v_pool,
                                ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> lse) {
  auto dims = q.dimensions();
  if (dims.size() < 3) return ffi::Error::InvalidArgument("q must be [..., K, G, H]");
  const int64_t K = dims[dims.size() - 3], G = dims[dims.size() - 2], H = dims[dims.size() - 1];
  const int64_t B = lengths.element_count();
  auto table_dims = page_table.dimensions();
  if (table_dims.size() < 1)
    return ffi::Error::InvalidArgument("page_table must be [..., max_pages]");
  const int64_t max_pages = table_dims[table_dims.size() - 1];
  if (page_table.element_count() != B * max_pages || q.element_count() != B * K * G * H)
    return ffi::Error::InvalidArgument("q, lengths and page_table differ in rows");
  switch (k_pool.element_type()) {
    case ffi::DataType::F32:
      return run<float>(pool, q.typed_data(), lengths.typed_data(), B, K, G, H,
                        page_table.typed_data(), max_pages, k_pool, v_pool, out->typed_data(),
                        lse->typed_data());
    case ffi::DataType::BF16:
      return run<uint16_t>(pool, q.typed_data(), lengths.typed_data(), B, K, G, H,
                           page_table.typed_data(), max_pages, k_pool, v_pool, out->typed_data(),
                           lse->typed_data());
    default:
      return ffi::Error::InvalidArgument("pools must be float32 or bfloat16");
  }
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GptJaxPagedDecodeAttention, PagedDecodeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
