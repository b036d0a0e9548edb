// The sampler's per-row work (see include/cpu_ops.h): the draw for sampled rows (ops_sample_rows_f32: what
// sampler.py's torch calls did a row at a time: scale, the top-k / top-p filters, softmax, running sum, search)
// and the log-probabilities requests ask for (ops_logprobs_rows_f32: token_rules.py's log_softmax and topk), one
// pass or two over the row each, one thread a row. Weights in fp32 (e^gap through fast_exp.h), sums in double.
#include "cpu_ops.h"
#include "fast_exp.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <vector>

namespace {

using inflight::exp_neg;

// Ranks tokens best first: by logit, ties by the lower index.
struct Better {
  const float* x;
  bool operator()(int32_t a, int32_t b) const { return x[a] > x[b] || (x[a] == x[b] && a < b); }
};

// x's bits as an unsigned key that orders as the values do, largest first (NaN-free: the caller checked).
inline uint32_t descending_key(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  return ~(u & 0x80000000u ? ~u : u | 0x80000000u);
}

// Every token best first (Better's order): a stable radix sort of the values' keys, 8 bits a pass, over the
// tokens in index order, so ties stay in index order. (A comparison sort through the indices took ~0.5 ms a
// 32,000-token row.)
void sort_all(const float* x, int64_t n, std::vector<int32_t>& best, std::vector<uint32_t>& keys,
              std::vector<int32_t>& spare) {
  best.resize(n);
  spare.resize(n);
  keys.resize(2 * n);
  uint32_t *key = keys.data(), *key2 = keys.data() + n;
  for (int64_t i = 0; i < n; ++i) {
    best[i] = int32_t(i);
    key[i] = descending_key(x[i]);
  }
  int32_t *idx = best.data(), *idx2 = spare.data();
  for (int shift = 0; shift < 32; shift += 8) {
    int64_t count[257] = {};
    for (int64_t i = 0; i < n; ++i) ++count[((key[i] >> shift) & 0xFF) + 1];
    for (int d = 0; d < 256; ++d) count[d + 1] += count[d];
    for (int64_t i = 0; i < n; ++i) {
      const int64_t to = count[(key[i] >> shift) & 0xFF]++;
      key2[to] = key[i];
      idx2[to] = idx[i];
    }
    std::swap(key, key2);
    std::swap(idx, idx2);
  }
  if (idx != best.data()) std::copy(idx, idx + n, best.data());  // (four passes: back where it started)
}

constexpr int64_t kMaxBlock = 32;  // values a block maximum stands for

// The `k` best tokens of x (0 < k < n), best first, into `best`. At least k values are no smaller than the k-th
// largest of the blocks' maxima, so only those are candidates: two vector passes and a selection among few.
void best_tokens(const float* x, int64_t n, int64_t k, std::vector<int32_t>& best, std::vector<float>& maxima) {
  const Better better{x};
  best.clear();
  const int64_t nb = (n + kMaxBlock - 1) / kMaxBlock;
  float threshold = -INFINITY;
  if (k < nb) {
    maxima.resize(nb);
    for (int64_t b = 0; b < nb; ++b) {
      float m = -INFINITY;
      const int64_t e = std::min(n, (b + 1) * kMaxBlock);
#pragma omp simd reduction(max : m)
      for (int64_t i = b * kMaxBlock; i < e; ++i) m = x[i] > m ? x[i] : m;
      maxima[b] = m;
    }
    std::nth_element(maxima.begin(), maxima.begin() + (k - 1), maxima.end(), std::greater<float>());
    threshold = maxima[k - 1];
  }
  for (int64_t i = 0; i < n; ++i)
    if (x[i] >= threshold) best.push_back(int32_t(i));
  if (int64_t(best.size()) > k) {
    std::nth_element(best.begin(), best.begin() + (k - 1), best.end(), better);
    best.resize(k);
  }
  std::sort(best.begin(), best.end(), better);
}

// Zeroes w outside `keep` (token indices).
void keep_only(std::vector<float>& w, const std::vector<int32_t>& keep, std::vector<float>& saved) {
  saved.resize(keep.size());
  for (size_t j = 0; j < keep.size(); ++j) saved[j] = w[keep[j]];
  std::fill(w.begin(), w.end(), 0.f);
  for (size_t j = 0; j < keep.size(); ++j) w[keep[j]] = saved[j];
}

constexpr int64_t kBlock = 1024;  // the draw's running sum goes a block at a time, then within one block
constexpr size_t kNotYet = size_t(-1);
constexpr int64_t kSelectAtMost = 256;  // top-p alone: the most tokens selected before sorting them all

struct Scratch {
  std::vector<float> w, saved, maxima;
  std::vector<int32_t> best, spare;
  std::vector<uint32_t> keys;
  std::vector<double> blocks;
};

// Where the nucleus ends among `best` (best first): the first token the mass strictly better than which reaches
// `goal`; best.size() when they all stay, kNotYet when even all of them do not reach it.
size_t nucleus_end(const std::vector<int32_t>& best, const float* w, double goal) {
  double mass = 0.0;
  for (size_t j = 0; j < best.size(); ++j) {
    if (mass >= goal) return j;
    mass += w[best[j]];
  }
  return mass >= goal ? best.size() : kNotYet;
}

// Keeps the nucleus of top_p of the kept mass (the k best when k > 0, else every token).
void keep_nucleus(const float* x, int64_t n, int64_t k, float top_p, Scratch& s) {
  const float* w = s.w.data();
  double kept = 0.0;
#pragma omp simd reduction(+ : kept)
  for (int64_t i = 0; i < n; ++i) kept += w[i];  // zeros outside the top k
  const double goal = double(top_p) * kept;
  size_t end = k ? nucleus_end(s.best, w, goal) : kNotYet;  // (k best, best first, already in s.best)
  // Without top-k: the best 64 tokens, then 256, then all of them, until their mass reaches the goal (sorting
  // every token by radix costs about what selecting and sorting 1,024 of them does).
  for (int64_t c = std::min<int64_t>(64, n); end == kNotYet; c = c < kSelectAtMost ? std::min(n, c * 4) : n) {
    if (c < n && c <= kSelectAtMost)
      best_tokens(x, n, c, s.best, s.maxima);
    else
      sort_all(x, n, s.best, s.keys, s.spare);
    end = nucleus_end(s.best, w, goal);
    if (end == kNotYet && c == n) end = s.best.size();  // rounding: the whole row
  }
  s.best.resize(end);
  keep_only(s.w, s.best, s.saved);
}

// The first index whose running sum of w passes u * total: by blocks' sums, then within the block; never a zero
// weight.
int64_t draw(const float* w, int64_t n, double u, Scratch& s) {
  const int64_t nb = (n + kBlock - 1) / kBlock;
  s.blocks.resize(nb);
  double total = 0.0;
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t e = std::min(n, (b + 1) * kBlock);
    double sum = 0.0;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = b * kBlock; i < e; ++i) sum += w[i];
    s.blocks[b] = sum;
    total += sum;
  }
  if (!(total > 0.0) || !std::isfinite(total)) return -1;
  const double target = u * total;
  double before = 0.0;
  for (int64_t b = 0; b < nb; ++b) {
    if (before + s.blocks[b] > target) {  // (so the block holds a positive weight)
      double run = before;
      int64_t last = -1;
      for (int64_t i = b * kBlock, e = std::min(n, (b + 1) * kBlock); i < e; ++i) {
        if (w[i] > 0.f) {
          run += w[i];
          last = i;
          if (run > target) return i;
        }
      }
      return last;  // the block's two sums differ in their last bits
    }
    before += s.blocks[b];
  }
  for (int64_t i = n - 1; i >= 0; --i)  // rounding put the target past the last block's sum
    if (w[i] > 0.f) return i;
  return -1;
}

// The row's largest value into *m; false when the row holds a NaN or +inf, or nothing finite.
bool finite_max(const float* x, int64_t n, float* m) {
  float top = -INFINITY;
  int bad = 0;
#pragma omp simd reduction(max : top) reduction(+ : bad)
  for (int64_t i = 0; i < n; ++i) {
    top = x[i] > top ? x[i] : top;
    bad += (x[i] != x[i]) | (x[i] == INFINITY);
  }
  *m = top;
  return !bad && top > -INFINITY;
}

int64_t sample_row(const float* x, int64_t n, float temperature, int64_t top_k, float top_p, float min_p, double u,
                   Scratch& s) {
  float m;
  if (!finite_max(x, n, &m)) return -1;
  s.w.resize(n);
  float* __restrict w = s.w.data();
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) w[i] = exp_neg((x[i] - m) / temperature);  // the best token: e^0 = 1
  if (min_p > 0.f) {  // w is each token's probability over the best one's: min_p keeps a prefix of the ranking
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) w[i] = w[i] < min_p ? 0.f : w[i];
  }
  const int64_t k = top_k > 0 && top_k < n ? top_k : 0;
  if (k) {
    best_tokens(x, n, k, s.best, s.maxima);
    keep_only(s.w, s.best, s.saved);
  }
  if (top_p < 1.f) keep_nucleus(x, n, k, top_p, s);
  return draw(s.w.data(), n, u, s);
}

}  // namespace

extern "C" int ops_sample_rows_f32(const float* x, int64_t n, int64_t ldx, const int64_t* rows, int64_t count,
                                   const float* temperature, const int64_t* top_k, const float* top_p,
                                   const float* min_p, const double* uniform, int64_t* out) {
  if (n <= 0 || ldx < n || count < 0) return OPS_ERR_SHAPE;
  for (int64_t j = 0; j < count; ++j)
    if (rows[j] < 0 || !(temperature[j] > 0.f) || !(uniform[j] >= 0.0 && uniform[j] < 1.0) ||
        !(min_p[j] >= 0.f && min_p[j] <= 1.f))
      return OPS_ERR_SHAPE;
#pragma omp parallel if (count > 1)
  {
    Scratch s;
#pragma omp for schedule(dynamic, 1)
    for (int64_t j = 0; j < count; ++j)
      out[j] = sample_row(x + rows[j] * ldx, n, temperature[j], top_k[j], top_p[j], min_p[j], uniform[j], s);
  }
  return OPS_OK;
}

extern "C" int ops_logprobs_rows_f32(const float* x, int64_t n, int64_t ldx, const int64_t* rows, int64_t count,
                                     const int64_t* tokens, const int64_t* top, int64_t max_top, float* logprob,
                                     int64_t* top_ids, float* top_logprobs, int32_t* ok) {
  if (n <= 0 || ldx < n || count < 0 || max_top < 0) return OPS_ERR_SHAPE;
  for (int64_t j = 0; j < count; ++j)
    if (rows[j] < 0 || tokens[j] < 0 || tokens[j] >= n || top[j] < 0 || top[j] > max_top) return OPS_ERR_SHAPE;
#pragma omp parallel if (count * n >= (int64_t(1) << 18))
  {
    Scratch s;
#pragma omp for schedule(static)
    for (int64_t j = 0; j < count; ++j) {
      const float* r = x + rows[j] * ldx;
      float m;
      ok[j] = finite_max(r, n, &m);
      if (!ok[j]) continue;
      double sum = 0.0;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < n; ++i) sum += inflight::exp_neg(r[i] - m);
      const float lse = float(std::log(sum));  // log_softmax(r)_i = (r_i - m) - lse, as torch computes it
      logprob[j] = (r[tokens[j]] - m) - lse;
      const int64_t k = std::min(top[j], n);
      if (k == 0) continue;
      if (k < n)
        best_tokens(r, n, k, s.best, s.maxima);
      else
        sort_all(r, n, s.best, s.keys, s.spare);
      for (int64_t t = 0; t < k; ++t) {
        top_ids[j * max_top + t] = s.best[t];
        top_logprobs[j * max_top + t] = (r[s.best[t]] - m) - lse;
      }
    }
  }
  return OPS_OK;
}
