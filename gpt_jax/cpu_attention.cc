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
//   page_table  s32 [..., M]        the row's pages in order; a negative entry ends the row
//   k_pool      f32 or bf16 [..., N, K, P, H]  key pages (leading axes of size 1: shared)
//   v_pool      as k_pool           value pages
// Results: out f32 [..., K, G, H], softmax(q k^T / sqrt(H)) v with a float32 softmax
// (Vaswani et al. 2017), the max-subtracted two-pass form; and lse f32 [..., K, G], the log
// of the softmax denominator (log sum exp of the scores; -1e30 for a row with no slot), so
// the caller can fold in more keys (online softmax).
//
// Built by gpt_jax/cpu_kernels.py on first use (gpt_jax/cpu_attention.py binds it).

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

#include "cpu_kernels.h"
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

// One pool of pages, [N, K, P, H], and the page tables, [B, M], that index it.
template <typename T>
struct Pool {
  const T* data;
  const int32_t* page_table;
  int64_t num_pages, K, P, H, M;
};

// fn(slots, s, n) for each run of consecutive slots [s, s + n) of row b, kv head k that lies
// in [0, length), page by page; `slots` points at slot s, [n, H]. A page table entry
// outside the pool ends the row.
template <typename T, typename Fn>
void for_each_run(const Pool<T>& pool, int64_t b, int64_t k, int64_t length, Fn fn) {
  for (int64_t i = 0, s = 0; i < pool.M && s < length; ++i) {
    const int64_t page = pool.page_table[b * pool.M + i];
    if (page < 0 || page >= pool.num_pages) return;
    const int64_t n = std::min<int64_t>(pool.P, length - s);
    fn(pool.data + ((page * pool.K + k) * pool.P) * pool.H, s, n);
    s += n;
  }
}

// The slots row b can reach: its pages up to the first entry outside the pool.
template <typename T>
int64_t row_capacity(const Pool<T>& pool, int64_t b) {
  int64_t i = 0;
  while (i < pool.M && pool.page_table[b * pool.M + i] >= 0 &&
         pool.page_table[b * pool.M + i] < pool.num_pages) ++i;
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

  for_each_run(keys, b, k, length, [&](const T* k_SH, int64_t s, int64_t n) {
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
  for_each_run(values, b, k, length, [&](const T* v_SH, int64_t s, int64_t n) {
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

// attend_one for a head dim known at compile time (a multiple of 8), register-blocked: the
// (scaled) query and the output stay in registers, and four key slots are dotted at a time
// (independent accumulator chains), which doubled the rate of a thread here (13.4 against
// 7.0 GB/s) and lets two threads reach the memory bandwidth (22 GB/s). Query heads of a group
// go one after another; each re-reads the row's keys and values (from cache when G > 1).
template <typename T, int64_t H>
void attend_vectorized(const float* q_GH, const Pool<T>& keys, const Pool<T>& values,
                       int64_t b, int64_t k, int64_t G, int64_t length, float* out_GH,
                       float* lse_G) {
  constexpr int64_t C = H / 8;  // vectors per head
  std::fill(out_GH, out_GH + G * H, 0.0f);
  std::fill(lse_G, lse_G + G, kNoScore);
  if (length <= 0) return;
  thread_local std::vector<float> scores_S;
  scores_S.resize(length);
  float* scores = scores_S.data();
  const float scale = 1.0f / std::sqrt(float(H));
  for (int64_t g = 0; g < G; ++g) {
    f32x8 q[C];
    for (int64_t c = 0; c < C; ++c) q[c] = load8(q_GH + g * H + c * 8) * scale;
    for_each_run(keys, b, k, length, [&](const T* k_SH, int64_t s, int64_t n) {
      int64_t i = 0;
      for (; i + 4 <= n; i += 4) {
        const T* k0 = k_SH + i * H;
        f32x8 a0 = q[0] * load8(k0), a1 = q[0] * load8(k0 + H), a2 = q[0] * load8(k0 + 2 * H),
              a3 = q[0] * load8(k0 + 3 * H);
        for (int64_t c = 1; c < C; ++c) {
          a0 += q[c] * load8(k0 + c * 8);
          a1 += q[c] * load8(k0 + H + c * 8);
          a2 += q[c] * load8(k0 + 2 * H + c * 8);
          a3 += q[c] * load8(k0 + 3 * H + c * 8);
        }
        scores[s + i] = sum8(a0);
        scores[s + i + 1] = sum8(a1);
        scores[s + i + 2] = sum8(a2);
        scores[s + i + 3] = sum8(a3);
      }
      for (; i < n; ++i) {
        f32x8 a = q[0] * load8(k_SH + i * H);
        for (int64_t c = 1; c < C; ++c) a += q[c] * load8(k_SH + i * H + c * 8);
        scores[s + i] = sum8(a);
      }
    });
    const float max = *std::max_element(scores, scores + length);
    float total = 0.0f;
    for (int64_t s = 0; s < length; ++s) total += (scores[s] = std::exp(scores[s] - max));
    lse_G[g] = max + std::log(total);
    f32x8 out[C] = {};
    for_each_run(values, b, k, length, [&](const T* v_SH, int64_t s, int64_t n) {
      for (int64_t i = 0; i < n; ++i) {
        const float weight = scores[s + i];
        for (int64_t c = 0; c < C; ++c) out[c] += weight * load8(v_SH + i * H + c * 8);
      }
    });
    for (int64_t c = 0; c < C; ++c) {
      const f32x8 normalized = out[c] / total;
      std::memcpy(out_GH + g * H + c * 8, &normalized, sizeof normalized);
    }
  }
}

template <typename T>
ffi::Error run(ffi::ThreadPool& pool, const float* q, const int32_t* lengths, int64_t B,
               int64_t K, int64_t G, int64_t H, const int32_t* page_table, int64_t M,
               ffi::AnyBuffer k_pool, ffi::AnyBuffer v_pool, float* out, float* lse) {
  auto dims = k_pool.dimensions();
  if (dims.size() < 4 || dims[dims.size() - 3] != K || dims[dims.size() - 1] != H)
    return ffi::Error::InvalidArgument("pools must be [..., N, K, P, H] with q's K and H");
  auto v_dims = v_pool.dimensions();
  if (v_pool.element_type() != k_pool.element_type() || v_dims.size() != dims.size() ||
      !std::equal(dims.begin(), dims.end(), v_dims.begin()))
    return ffi::Error::InvalidArgument("key and value pools differ in dtype or shape");
  const int64_t N = dims[dims.size() - 4], P = dims[dims.size() - 2];
  if (k_pool.element_count() != N * K * P * H)
    return ffi::Error::InvalidArgument("pools must be shared by all rows (leading axes 1)");
  const Pool<T> keys{reinterpret_cast<const T*>(k_pool.untyped_data()), page_table, N, K, P, H,
                     M};
  const Pool<T> values{reinterpret_cast<const T*>(v_pool.untyped_data()), page_table, N, K, P,
                       H, M};
  // Contiguous runs of (row, kv head) items per task: each thread streams long stretches.
  const int64_t items = B * K, run_size = std::max<int64_t>(1, items / 8);
  parallel_for(pool, (items + run_size - 1) / run_size, [&](int64_t task) {
    for (int64_t item = task * run_size; item < std::min(items, (task + 1) * run_size); ++item) {
      const int64_t b = item / K, k = item % K;
      // A row never attends past its pages (the XLA path's bound): a length beyond them
      // (a write refused at the end of the cache) means all of them.
      const int64_t length = std::min<int64_t>(lengths[b], row_capacity(keys, b));
      const float* q_GH = q + item * G * H;
      float* out_GH = out + item * G * H;
      float* lse_G = lse + item * G;
      if (H == 32) {  // the shakespeare-char and nanogpt-cpu presets
        attend_vectorized<T, 32>(q_GH, keys, values, b, k, G, length, out_GH, lse_G);
      } else if (H == 64) {  // GPT-2
        attend_vectorized<T, 64>(q_GH, keys, values, b, k, G, length, out_GH, lse_G);
      } else if (H == 128) {
        attend_vectorized<T, 128>(q_GH, keys, values, b, k, G, length, out_GH, lse_G);
      } else {
        attend_one(q_GH, keys, values, b, k, G, H, length, out_GH, lse_G);
      }
    }
  });
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
  if (table_dims.size() < 1) return ffi::Error::InvalidArgument("page_table must be [..., M]");
  const int64_t M = table_dims[table_dims.size() - 1];
  if (page_table.element_count() != B * M || q.element_count() != B * K * G * H)
    return ffi::Error::InvalidArgument("q, lengths and page_table differ in rows");
  switch (k_pool.element_type()) {
    case ffi::DataType::F32:
      return run<float>(pool, q.typed_data(), lengths.typed_data(), B, K, G, H,
                        page_table.typed_data(), M, k_pool, v_pool, out->typed_data(),
                        lse->typed_data());
    case ffi::DataType::BF16:
      return run<uint16_t>(pool, q.typed_data(), lengths.typed_data(), B, K, G, H,
                           page_table.typed_data(), M, k_pool, v_pool, out->typed_data(),
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
