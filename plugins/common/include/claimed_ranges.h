// Items [0, n) of a parallel loop shared out for threads that may be preempted. Each thread of the team owns one
// contiguous range and claims its items front to back, one at a time, so it walks adjacent items (a GEMM tile's
// prefetch of the next panel stays on its core); a thread whose range is empty claims items from the back of the
// fullest other range. A thread another process preempted (on a 2-core machine: Triton's responder,
// tritonserver, a client) holds back the loop's end by at most the item it is on, while with `schedule(static)`
// its partner waits at the barrier for the rest of its range, and with `schedule(guided)` for up to half the loop.
//
//   ClaimedRanges work(n, omp_get_max_threads());
//   #pragma omp parallel
//   for (int64_t i; (i = work.next(omp_get_thread_num())) >= 0;) body(i);
//
// Correct for any team size: ranges with no thread of their own are emptied by the others.
#pragma once
#include <atomic>
#include <cstdint>

namespace inflight {

class ClaimedRanges {
 public:
  static constexpr int kMaxRanges = 64;

  ClaimedRanges(int64_t n, int threads) : count_(threads < 1 ? 1 : threads > kMaxRanges ? kMaxRanges : threads) {
    for (int r = 0; r < count_; ++r) ranges_[r].bounds.store(pack(n * r / count_, n * (r + 1) / count_));
  }

  // The next item for thread `me` (its own range first, then the others' backs), or -1 when none is left.
  int64_t next(int me) {
    int64_t item;
    if (me < count_ && take(ranges_[me], true, &item)) return item;
    for (;;) {
      int victim = -1;
      int64_t most = 0;
      for (int r = 0; r < count_; ++r) {
        const uint64_t b = ranges_[r].bounds.load(std::memory_order_relaxed);
        if (back(b) - front(b) > most) most = back(b) - front(b), victim = r;
      }
      if (victim < 0) return -1;
      if (take(ranges_[victim], false, &item)) return item;
    }
  }

 private:
  // front (next item) in the low 32 bits, back (one past the last) in the high: one compare-and-swap claims.
  struct alignas(64) Range {
    std::atomic<uint64_t> bounds;
  };
  static uint64_t pack(int64_t f, int64_t b) { return uint64_t(b) << 32 | uint64_t(f); }
  static int64_t front(uint64_t b) { return int64_t(b & 0xffffffffu); }
  static int64_t back(uint64_t b) { return int64_t(b >> 32); }

  static bool take(Range& r, bool from_front, int64_t* item) {
    uint64_t b = r.bounds.load(std::memory_order_relaxed);
    while (front(b) < back(b)) {
      const uint64_t claimed = from_front ? pack(front(b) + 1, back(b)) : pack(front(b), back(b) - 1);
      if (r.bounds.compare_exchange_weak(b, claimed, std::memory_order_relaxed)) {
        *item = from_front ? front(b) : back(b) - 1;
        return true;
      }
    }
    return false;
  }

  int count_;
  Range ranges_[kMaxRanges];
};

}  // namespace inflight
