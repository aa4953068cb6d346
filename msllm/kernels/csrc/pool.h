// The kernels' thread pool (Pool) and the plainest way to use it (parallel_rows).
#pragma once

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <new>
#include <thread>
#include <vector>

namespace msllm {

inline void cpu_relax() {
#if defined(__x86_64__)
  __builtin_ia32_pause();
#endif
}

// Thread pool. MindSpore runs its CPU kernels one after another on its actor thread; while one
// of ours runs, MindSpore's own kernel threads sleep, so the pool uses (cores - 1) workers plus
// the calling thread. Workers spin ~50 us after a job (kernels come back to back) and then
// sleep on a futex (std::atomic::wait), so they do not steal cycles from MindSpore's kernels; the
// caller waits for the workers the same way (spin ~50 us, then sleep).
// Size: MSLLM_KERNEL_THREADS if set, else the number of CPUs this process may run on.
class Pool {
 public:
  static Pool &get() {
    static Pool pool;
    return pool;
  }
  int size() const { return n_; }

  // Calls fn(i) for every i in [0, ntasks), tasks handed out dynamically; returns when all ran.
  // A call from inside a task runs its tasks inline (no nesting). Re-entrant: the pool's one
  // job/next/busy state belongs to one caller at a time (owner_); a second thread that launches a
  // kernel meanwhile (MindSpore may run two CPU kernels at once) runs its tasks inline on its own
  // thread instead of waiting. A task that throws (std::bad_alloc from scratch()) stops the hand-out;
  // the exception is rethrown to the caller once every worker is back.
  template <class F>
  void run(int ntasks, F &&fn) {
    if (ntasks <= 0) return;
    std::unique_lock<std::mutex> owner(owner_, std::try_to_lock);
    if (n_ == 1 || ntasks == 1 || in_pool() || !owner.owns_lock()) {
      for (int i = 0; i < ntasks; ++i) fn(i);
      return;
    }
    std::function<void(int)> job(fn);
    job_ = &job;
    ntasks_ = ntasks;
    failed_.store(false, std::memory_order_relaxed);
    next_.store(0, std::memory_order_relaxed);
    busy_.store(n_ - 1, std::memory_order_relaxed);
    epoch_.fetch_add(1, std::memory_order_release);
    epoch_.notify_all();
    in_pool() = true;
    work();
    in_pool() = false;
    // Wait for the workers: spin briefly (they usually finish within microseconds of the caller),
    // then sleep on the counter. Spinning longer is harmful when runnable threads outnumber cores
    // (two processes on 2 cores: data-parallel ranks on one machine, a test run on 2 workers): a
    // worker descheduled mid-task needs the very core this loop would burn for a whole time slice.
    auto t0 = std::chrono::steady_clock::now();
    for (int b; (b = busy_.load(std::memory_order_acquire)) != 0;) {
      if (std::chrono::steady_clock::now() - t0 < std::chrono::microseconds(kSpinMicros)) cpu_relax();
      else busy_.wait(b, std::memory_order_acquire);
    }
    job_ = nullptr;
    if (failed_.load(std::memory_order_acquire)) throw std::bad_alloc();
  }

 private:
  Pool() {
    int n = 1;
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof(set), &set) == 0) n = CPU_COUNT(&set);
    if (const char *e = std::getenv("MSLLM_KERNEL_THREADS"))
      if (std::atoi(e) > 0) n = std::atoi(e);
    n_ = std::max(1, n);
    for (int i = 1; i < n_; ++i) workers_.emplace_back([this] { loop(); });
  }
  ~Pool() {
    stop_.store(true);
    epoch_.fetch_add(1);
    epoch_.notify_all();
    for (auto &t : workers_) t.join();
  }
  static bool &in_pool() {
    static thread_local bool flag = false;
    return flag;
  }
  void work() {
    for (;;) {
      int i = next_.fetch_add(1, std::memory_order_relaxed);
      if (i >= ntasks_) break;
      try {
        (*job_)(i);
      } catch (...) {  // no exception may leave a worker thread: record it, hand out no more tasks
        failed_.store(true, std::memory_order_release);
        next_.store(ntasks_, std::memory_order_relaxed);
      }
    }
  }
  void loop() {
    in_pool() = true;
    uint32_t seen = 0;  // the epoch at construction (run() may already have moved it on)
    for (;;) {
      auto t0 = std::chrono::steady_clock::now();
      uint32_t e;
      while ((e = epoch_.load(std::memory_order_acquire)) == seen) {
        cpu_relax();
        if (std::chrono::steady_clock::now() - t0 > std::chrono::microseconds(kSpinMicros)) epoch_.wait(seen);
      }
      seen = e;
      if (stop_.load()) return;
      work();
      if (busy_.fetch_sub(1, std::memory_order_acq_rel) == 1) busy_.notify_one();   // the last one wakes the caller
    }
  }

  static constexpr int kSpinMicros = 50;   // spin this long before sleeping (workers and caller alike)
  int n_ = 1;
  std::vector<std::thread> workers_;
  std::atomic<uint32_t> epoch_{0};
  std::atomic<int> next_{0}, busy_{0};
  std::atomic<bool> stop_{false}, failed_{false};
  std::mutex owner_;
  std::function<void(int)> *job_ = nullptr;
  int ntasks_ = 0;
};

// Split [0, n) into the pool's threads: fn(begin, end) per chunk (chunks of `grain` multiples).
template <class F>
inline void parallel_rows(int64_t n, int64_t grain, F &&fn) {
  Pool &pool = Pool::get();
  int nt = pool.size();
  int64_t chunks = std::min<int64_t>(nt * 4, (n + grain - 1) / grain);
  if (chunks <= 1) {
    fn(int64_t(0), n);
    return;
  }
  int64_t step = (n + chunks - 1) / chunks;
  pool.run((int)chunks, [&](int i) {
    int64_t b = i * step, e = std::min(n, b + step);
    if (e > b) fn(b, e);
  });
}

}  // namespace msllm
