// Shared by the native CPU kernels (paged_attention.cc, causal_attention.cc, panel_matmul.cc,
// few_rows_matmul.cc): a parallel loop over XLA:CPU's intra-op thread pool, eight-float vector
// helpers and the widest float vector with its fused multiply-add. Built
// into each kernel by gpt_jax/kernels/builder.py (its text is part of every kernel's cache key).

#ifndef GPT_JAX_KERNELS_COMMON_H_
#define GPT_JAX_KERNELS_COMMON_H_

#include <algorithm>
#include <atomic>
#include <chrono>
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

// How long a helper keeps looking for the next call's work after it ran out, and the caller
// for its helpers to finish before it sleeps. A decode step makes a kernel call every few
// tens of microseconds (XLA's norms, RoPE and attention between them): a helper that slept
// between calls would be woken by the next one (a futex wake, an inter-processor interrupt
// in a virtual machine), each wake costing about what a small call's bytes take to read.
constexpr int64_t kSpinNanos = 100000;

inline int64_t now_nanos() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

inline void spin_pause() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// The latest call's work, where helpers still spinning after an earlier call find it.
// Never destroyed: pool threads may read it while the process exits.
struct Mailbox {
  std::mutex mutex;
  std::shared_ptr<Work> work;  // guarded by mutex
  std::atomic<uint64_t> posted{0};  // calls posted so far
  std::atomic<int64_t> spinning{0};  // helpers looking for work now

  static Mailbox& get() {
    static Mailbox* box = new Mailbox;
    return *box;
  }

  void post(const std::shared_ptr<Work>& w) {
    std::lock_guard<std::mutex> lock(mutex);
    work = w;
    posted.fetch_add(1);
  }

  // A pool thread's task: drain `w`, then the work of any later call posted within
  // kSpinNanos of running out. The count of spinning helpers is left before the last look
  // at `posted`, so a call that counted this helper (and scheduled one fewer) is seen.
  void help(std::shared_ptr<Work> w) {
    uint64_t seen = posted.load();
    for (;;) {
      w->drain();
      w.reset();
      spinning.fetch_add(1);
      for (const int64_t until = now_nanos() + kSpinNanos;
           posted.load() == seen && now_nanos() < until;)
        spin_pause();
      spinning.fetch_sub(1);
      if (posted.load() == seen) return;
      std::lock_guard<std::mutex> lock(mutex);
      w = work;
      seen = posted.load();
    }
  }
};

// `spin`: the helpers look for the next call's work, and the caller waits for them, for
// kSpinNanos before they sleep (the decode kernels, called many times a step); without it
// (the training kernels, between XLA's pool-wide matrix products) they sleep at once.
inline void parallel_for(xla::ffi::ThreadPool& pool, int64_t n, std::function<void(int64_t)> fn,
                         bool spin) {
  auto work = std::make_shared<Work>();
  work->total = n;
  work->fn = std::move(fn);
  Mailbox& box = Mailbox::get();
  const int64_t helpers = std::min<int64_t>(pool.num_threads() - 1, n - 1);
  if (spin && helpers > 0) {
    box.post(work);  // for helpers still spinning after an earlier call
    for (int64_t t = box.spinning.load(); t < helpers; ++t)
      pool.Schedule([work, &box] { box.help(work); });
  } else {
    for (int64_t t = 0; t < helpers; ++t) pool.Schedule([work] { work->drain(); });
  }
  work->drain();
  for (int64_t until = now_nanos() + (spin ? kSpinNanos : 0);
       work->finished.load() != n && now_nanos() < until;)
    spin_pause();
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
