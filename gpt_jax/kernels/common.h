// Shared by the native CPU kernels (paged_attention.cc, causal_attention.cc, int8_matmul.cc,
// few_rows_matmul.cc): a parallel loop over XLA:CPU's intra-op thread pool, eight-float vector
// helpers and the widest float vector with its fused multiply-add. Built
// into each kernel by gpt_jax/kernels/builder.py (its text is part of every kernel's cache key).

#ifndef GPT_JAX_KERNELS_COMMON_H_
#define GPT_JAX_KERNELS_COMMON_H_

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>

#if defined(__AVX__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace gpt_jax_kernels {

// Run fn(0..n-1) on the calling thread and the pool. Items are claimed from a shared
// counter, so the caller never waits for a task that has not started: it waits only for
// items other threads have claimed (tasks that start late find nothing left and return).
struct Work {
  std::atomic<int64_t> next{0}, finished{0};
  int64_t total = 0;
  std::function<void(int64_t)> fn;
  std::mutex mutex;
  std::condition_variable all_done;

  void drain() {
    for (int64_t i; (i = next.fetch_add(1)) < total;) {
      fn(i);
      if (finished.fetch_add(1) + 1 == total) {
        std::lock_guard<std::mutex> lock(mutex);
        all_done.notify_all();
      }
    }
  }
};

inline void parallel_for(xla::ffi::ThreadPool& pool, int64_t n,
                         std::function<void(int64_t)> fn) {
  auto work = std::make_shared<Work>();
  work->total = n;
  work->fn = std::move(fn);
  const int64_t helpers = std::min<int64_t>(pool.num_threads() - 1, n - 1);
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([work] { work->drain(); });
  work->drain();
  std::unique_lock<std::mutex> lock(work->mutex);
  work->all_done.wait(lock, [&] { return work->finished.load() == n; });
  work->fn = nullptr;  // late tasks keep `work` alive, never the caller's frame
}

// Eight floats in one vector register (GCC/Clang vector extension; the compiler picks the
// instructions for -march=native: AVX on x86).
typedef float f32x8 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));

inline f32x8 load8(const float* p) {
  f32x8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline f32x8 load8(const uint16_t* p) {  // eight bfloat16, widened exactly
  u16x8 half;
  std::memcpy(&half, p, sizeof half);
  const u32x8 bits = __builtin_convertvector(half, u32x8) << 16;
  f32x8 v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

inline float sum8(f32x8 v) {
  float total = 0.0f;
  for (int j = 0; j < 8; ++j) total += v[j];
  return total;
}

// The CPU's widest float vector, `fvec` of kLanes floats: 16 with AVX-512, else 8 (AVX2 and
// the scalar build, which splits it).
#if defined(__AVX512F__)
typedef float fvec __attribute__((vector_size(64)));
constexpr int kLanes = 16;
#else
typedef f32x8 fvec;
constexpr int kLanes = 8;
#endif

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

}  // namespace gpt_jax_kernels

#endif  // GPT_JAX_KERNELS_COMMON_H_
