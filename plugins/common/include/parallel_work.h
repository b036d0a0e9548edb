// Whether a call is worth a team of threads. Opening a parallel region wakes the team's other threads; a call
// too small to gain from them runs on the calling thread, and the others stay asleep. On a 2-core machine
// that matters beyond the region's own cost: through Triton, a small model's steps made of such calls kept an
// OpenMP worker spinning between regions on one core while the engine thread, the responder, tritonserver and
// the client shared the other (the tiny test model served one stream ~10x slower with 2 threads than with 1).
// The results do not depend on it: every item of these loops is computed alike by whichever thread takes it.
#pragma once
#include <cstdint>

namespace inflight {

// Multiply-adds below which one thread does the whole call. 2^17: a 128-wide model's layers at a few rows stay
// on one thread; a 512-wide model's smallest layer (512 x 512) at one row already takes the team.
constexpr int64_t kMinParallelMacs = int64_t(1) << 17;

inline bool worth_threads(int64_t macs) { return macs >= kMinParallelMacs; }

// A greedy screen's refine (greedy_screen_cpu.cpp, int8_screen_cpu.cpp) of M rows of N logits: each row scans its
// N logits and recomputes some (tens on the bench models' heads) at K multiply-adds each.
inline bool refine_worth_threads(int64_t M, int64_t K, int64_t N) { return worth_threads(M * (N + 64 * K)); }

}  // namespace inflight
