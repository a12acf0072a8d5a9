// The forward of one finer level of QuadTree attention in plain C++ (no PyTorch, no ONNX
// Runtime), shared by the PyTorch extension (quadtree_cpu.cpp) and the ONNX Runtime
// custom operator (flatten_mm/deploy/csrc/quadtree_ort.cpp).
//
// Part of flatten_mm (Apache-2.0). Same maths as ``_finer_level_inference`` of
// ../../layers/quadtree_attention.py (the reference): for every parent query of the
// coarser level, its 4 child queries score the 4 children of the parent's ``Kp`` selected
// keys (4 Kp candidates), take a softmax over them (variant B) or over each group of 4
// children, scaled by the parent's selected weight (variant A), pass the ``topk`` best
// candidates on to the next level, and add the weighted candidate values to their message
// rows. Each parent's candidate rows are read once, straight from the key/value tables,
// and everything else stays in the core's cache: no gathered (N, 4K, d) rows, no (N, 4K)
// score tensors.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace flatten_mm_quadtree {

// A bad input found by the forward (the front-ends prefix the operator's name).
struct InputError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

// parallel_for(tasks, grain, fn) with fn's exceptions carried out: the thread pool's
// callback never throws (ONNX Runtime's pool calls it through a C function pointer, where an
// exception reaches std::terminate), the ranges left after the first failure are skipped,
// and the first exception (a bad_alloc, an InputError, ...) is rethrown on the calling
// thread once the pool is done.
template <typename ParallelFor, typename Fn>
void parallel_for_carrying(ParallelFor&& parallel_for, int64_t tasks, int64_t grain,
                           const Fn& fn) {
  std::atomic<bool> failed{false};
  std::exception_ptr error;  // written by the first range that fails only
  parallel_for(tasks, grain, [&](int64_t begin, int64_t end) noexcept {
    if (failed.load(std::memory_order_acquire)) return;
    try {
      fn(begin, end);
    } catch (...) {
      bool first = false;
      if (failed.compare_exchange_strong(first, true, std::memory_order_acq_rel))
        error = std::current_exception();
    }
  });
  if (error) std::rethrow_exception(error);  // (the pool has joined: its writes are seen)
}

// exp(x) for x <= 0 (softmax after the max subtraction); Cody-Waite range reduction and a
// degree-6 polynomial (relative error ~2e-7, like a libm expf). Scalar form: the generic
// build and the tails; exp8_nonpositive is the AVX2 form.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float fx = std::floor(x * 1.44269504088896341f + 0.5f);
  float r = x - fx * 0.693359375f;
  r = r + fx * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t e = (static_cast<int32_t>(fx) + 127) << 23;
  float scale;
  std::memcpy(&scale, &e, sizeof(scale));
  return p * scale;
}

#if defined(__AVX2__) && defined(__FMA__)
// exp_nonpositive on 8 lanes (same polynomial); NaN lanes stay NaN
inline __m256 exp8_nonpositive(__m256 x) {
  x = _mm256_max_ps(_mm256_set1_ps(-87.0f), x);  // NaN in x is returned as is
  const __m256 fx = _mm256_floor_ps(
      _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fmadd_ps(fx, _mm256_set1_ps(2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

// softmax of n values in place (a NaN value makes the whole row NaN); returns the row's
// maximum and the inverse of its sum of exponentials (the backward rebuilds the weights
// from them: w = exp(s - max) * inv)
inline std::pair<float, float> softmax_inplace(float* s, int64_t n) {
  float mx = s[0];
  for (int64_t c = 1; c < n; ++c) mx = std::max(mx, s[c]);
  float sum = 0.f;
  int64_t c = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 m8 = _mm256_set1_ps(mx);
  __m256 acc = _mm256_setzero_ps();
  for (; c + 8 <= n; c += 8) {
    const __m256 e = exp8_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + c), m8));
    _mm256_storeu_ps(s + c, e);
    acc = _mm256_add_ps(acc, e);
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, acc);
  for (float l : lanes) sum += l;
#endif
  for (; c < n; ++c) {
    s[c] = exp_nonpositive(s[c] - mx);
    sum += s[c];
  }
  const float inv = 1.f / sum;
  for (c = 0; c < n; ++c) s[c] *= inv;
  return {mx, inv};
}

struct LevelArgs {
  const float* q;
  const float* k;
  const float* v;
  const int64_t* prev_idx;
  const float* prev_score;  // variant A only
  float* msg;
  int64_t* next_idx;
  float* next_score;  // variant A only
  int64_t BH, M, d, width, Kp, topk;
  float scale;
  bool type_a;
};

// The indices of the topk largest of n values (larger first, then lower index; NaN counts
// as the smallest), in no particular order. The k-th largest is found exactly by a binary
// search over the order-preserving integer images of the floats (32 vectorised counting
// passes: no data-dependent branches, unlike a partition-based selection), then one pass
// collects the values above it and the ties at it, lowest index first. keys and out
// hold n ints.
inline void select_topk(const float* w, int64_t n, int64_t topk, int32_t* keys, int32_t* out) {
  if (topk >= n) {
    for (int64_t c = 0; c < n; ++c) out[c] = static_cast<int32_t>(c);
    return;
  }
  for (int64_t c = 0; c < n; ++c) {
    int32_t b;
    std::memcpy(&b, &w[c], sizeof(b));
    // two's complement order of IEEE floats: flip the magnitude bits of negatives
    const int32_t key = b ^ ((b >> 31) & 0x7fffffff);
    keys[c] = std::isnan(w[c]) ? std::numeric_limits<int32_t>::min() : key;
  }
  int64_t lo = std::numeric_limits<int32_t>::min(), hi = std::numeric_limits<int32_t>::max();
  while (lo < hi) {  // the largest t with #(keys >= t) >= topk
    const int64_t mid = lo + (hi - lo + 1) / 2;
    const int32_t m32 = static_cast<int32_t>(mid);
    int32_t below = 0;  // #(keys < mid), in int32 lanes
#pragma omp simd reduction(+ : below)
    for (int64_t c = 0; c < n; ++c) below += keys[c] < m32;
    const int64_t count = n - below;
    if (count >= topk) lo = mid; else hi = mid - 1;
  }
  const int32_t thr = static_cast<int32_t>(lo);
  int64_t taken = 0;
  for (int64_t c = 0; c < n; ++c) {  // branch-free: out has room for n entries
    out[taken] = static_cast<int32_t>(c);
    taken += keys[c] > thr;
  }
  for (int64_t c = 0; c < n && taken < topk; ++c)
    if (keys[c] == thr) out[taken++] = static_cast<int32_t>(c);
}

// scores of 4 query rows against one key row: out[t] = scale * <q_t, kr>
template <int D>
inline void dot4(const float* const* qs, const float* kr, int64_t d, float scale, float* out) {
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (D > 0 && D % 8 == 0) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    __m256 a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    for (int x = 0; x < D; x += 8) {
      const __m256 kx = _mm256_loadu_ps(kr + x);
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qs[0] + x), kx, a0);
      a1 = _mm256_fmadd_ps(_mm256_loadu_ps(qs[1] + x), kx, a1);
      a2 = _mm256_fmadd_ps(_mm256_loadu_ps(qs[2] + x), kx, a2);
      a3 = _mm256_fmadd_ps(_mm256_loadu_ps(qs[3] + x), kx, a3);
    }
    // (a0, a1, a2, a3) -> their 4 horizontal sums in one vector
    const __m256 h01 = _mm256_hadd_ps(a0, a1), h23 = _mm256_hadd_ps(a2, a3);
    const __m256 h = _mm256_hadd_ps(h01, h23);
    const __m128 sum = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    _mm_storeu_ps(out, _mm_mul_ps(sum, _mm_set1_ps(scale)));
    return;
  }
#endif
  const int64_t n = D > 0 ? D : d;
  const float *q0 = qs[0], *q1 = qs[1], *q2 = qs[2], *q3 = qs[3];
  float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
  for (int64_t x = 0; x < n; ++x) {
    s0 += q0[x] * kr[x];
    s1 += q1[x] * kr[x];
    s2 += q2[x] * kr[x];
    s3 += q3[x] * kr[x];
  }
  out[0] = s0 * scale;
  out[1] = s1 * scale;
  out[2] = s2 * scale;
  out[3] = s3 * scale;
}

// outs[t] += sum_c w[4c + t] * v[cand[c]] for the 4 query rows
template <int D>
inline void aggregate4(const float* w, const float* vb, const int64_t* cand, int64_t K,
                       int64_t d, float* const* outs) {
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (D > 0 && D % 8 == 0) {
    for (int x = 0; x < D; x += 8) {
      __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
      __m256 a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
      for (int64_t c = 0; c < K; ++c) {
        const __m256 vx = _mm256_loadu_ps(vb + cand[c] * D + x);
        a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(w + 4 * c), vx, a0);
        a1 = _mm256_fmadd_ps(_mm256_broadcast_ss(w + 4 * c + 1), vx, a1);
        a2 = _mm256_fmadd_ps(_mm256_broadcast_ss(w + 4 * c + 2), vx, a2);
        a3 = _mm256_fmadd_ps(_mm256_broadcast_ss(w + 4 * c + 3), vx, a3);
      }
      _mm256_storeu_ps(outs[0] + x, _mm256_add_ps(_mm256_loadu_ps(outs[0] + x), a0));
      _mm256_storeu_ps(outs[1] + x, _mm256_add_ps(_mm256_loadu_ps(outs[1] + x), a1));
      _mm256_storeu_ps(outs[2] + x, _mm256_add_ps(_mm256_loadu_ps(outs[2] + x), a2));
      _mm256_storeu_ps(outs[3] + x, _mm256_add_ps(_mm256_loadu_ps(outs[3] + x), a3));
    }
    return;
  }
#endif
  const int64_t n = D > 0 ? D : d;
  std::vector<float> acc(4 * n, 0.f);
  float *a0 = acc.data(), *a1 = a0 + n, *a2 = a1 + n, *a3 = a2 + n;
  for (int64_t c = 0; c < K; ++c) {
    const float* vr = vb + cand[c] * n;
    const float w0 = w[4 * c], w1 = w[4 * c + 1], w2 = w[4 * c + 2], w3 = w[4 * c + 3];
#pragma omp simd
    for (int64_t x = 0; x < n; ++x) {
      a0[x] += w0 * vr[x];
      a1[x] += w1 * vr[x];
      a2[x] += w2 * vr[x];
      a3[x] += w3 * vr[x];
    }
  }
  for (int t = 0; t < 4; ++t) {
    float* out = outs[t];
    const float* a = acc.data() + t * n;
#pragma omp simd
    for (int64_t x = 0; x < n; ++x) out[x] += a[x];
  }
}

// The 4 candidate rows (children, raster order of the level) of each of the Kp selected
// cells of the parent grid: cand[4 j + u] is child u (top-left, top-right, bottom-left,
// bottom-right) of cell sel[j].
// (sel holds valid cells: callers check them first, see first_cell_outside)
inline void children_of(const int64_t* sel, int64_t Kp, int64_t width, int64_t* cand) {
  const int64_t pw = width / 2;
  for (int64_t j = 0; j < Kp; ++j) {
    const int64_t s = sel[j];
    const int64_t base = 2 * (s / pw) * width + 2 * (s % pw);
    cand[4 * j] = base;
    cand[4 * j + 1] = base + 1;
    cand[4 * j + 2] = base + width;
    cand[4 * j + 3] = base + width + 1;
  }
}

// The rows (in the (BH * M) table) of the 4 child queries of parent p of head bh.
inline void query_rows(int64_t bh, int64_t p, int64_t M, int64_t width, int64_t* rows) {
  const int64_t pw = width / 2, py = p / pw, px = p % pw;
  for (int t = 0; t < 4; ++t) rows[t] = bh * M + (2 * py + t / 2) * width + 2 * px + t % 2;
}

// Checks the sizes one finer level reads (both front-ends call it, then check the cells):
// q, k, v (BH, M, d), an (M / width, width) level with even sides, prev_idx (BH, M / 4, Kp)
// with Kp >= 1, 0 <= topk <= 4 Kp. Throws InputError naming the first mismatch.
inline void check_level_shapes(const std::vector<int64_t>& q, const std::vector<int64_t>& k,
                               const std::vector<int64_t>& v, const std::vector<int64_t>& idx,
                               int64_t width, int64_t topk) {
  auto str = [](const std::vector<int64_t>& s) {
    std::string out = "(";
    for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
    return out + ")";
  };
  if (q.size() != 3) throw InputError("q must be (BH, M, d), got " + str(q));
  if (k != q || v != q)
    throw InputError("q, k and v must have the same shape (BH, M, d), got " + str(q) + ", " +
                     str(k) + ", " + str(v));
  const int64_t M = q[1];
  if (width <= 0 || width % 2 != 0 || M % (2 * width) != 0)
    throw InputError("the level must have even height and width (M = " + std::to_string(M) +
                     ", width = " + std::to_string(width) + ")");
  if (idx.size() != 3 || idx[0] != q[0] || idx[1] != M / 4)
    throw InputError("prev_idx must be (BH, M / 4, Kp) = (" + std::to_string(q[0]) + ", " +
                     std::to_string(M / 4) + ", Kp), got " + str(idx));
  if (idx[2] <= 0)
    throw InputError("prev_idx has no selected cells (Kp = 0): a finer level needs at least "
                     "one, got " + str(idx));
  if (topk < 0 || topk > 4 * idx[2])
    throw InputError("topk must be in [0, 4 Kp] = [0, " + std::to_string(4 * idx[2]) +
                     "], got " + std::to_string(topk));
}

// The position of the first entry of cells[0, n) outside [0, Mp), or -1 when all are inside.
inline int64_t first_cell_outside(const int64_t* cells, int64_t n, int64_t Mp) {
  for (int64_t e = 0; e < n; ++e)
    if (cells[e] < 0 || cells[e] >= Mp) return e;
  return -1;
}

// One finer level, forward (see the file comment). prev_idx must hold cells of the parent
// grid (first_cell_outside). parallel_for(tasks, grain, fn) calls fn(begin, end) over
// disjoint ranges covering [0, tasks) of about `grain` tasks each: at::parallel_for in
// PyTorch, the session's intra-op thread pool in ONNX Runtime. A task is one parent of
// one head; it writes the message and top-k rows of its 4 child queries only.
// The front-ends check the shapes (check_level_shapes) and the cells first; exceptions
// inside the pool (e.g. a bad_alloc) are rethrown here (parallel_for_carrying).
template <int D, typename ParallelFor>
void run_level(const LevelArgs& g, ParallelFor&& parallel_for) {
  const int64_t d = D > 0 ? D : g.d;
  const int64_t M = g.M, width = g.width, Mp = M / 4;
  const int64_t Kp = g.Kp, K = 4 * Kp, topk = g.topk;
  const int64_t tasks = g.BH * Mp;
  if (tasks == 0) return;  // an empty batch or map: nothing to read or write
  if (Kp <= 0) throw InputError("prev_idx has no selected cells (Kp = 0)");
  const int64_t grain = std::max<int64_t>(1, 2048 / (K * d / 32 + 1));
  parallel_for_carrying(parallel_for, tasks, grain, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> cand(K);
    std::vector<float> w(4 * K);   // scores, then weights: w[4 c + t] for child query t
    std::vector<float> col(K);
    std::vector<int32_t> keys(K);
    std::vector<int32_t> chosen(K);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / Mp;
      children_of(g.prev_idx + task * Kp, Kp, width, cand.data());
      int64_t rows[4];
      query_rows(bh, task % Mp, M, width, rows);
      const float* qs[4];
      float* outs[4];
      for (int t = 0; t < 4; ++t) {
        qs[t] = g.q + rows[t] * d;
        outs[t] = g.msg + rows[t] * d;
      }
      const float* kb = g.k + bh * M * d;
      for (int64_t c = 0; c < K; ++c) dot4<D>(qs, kb + cand[c] * d, d, g.scale, &w[4 * c]);
      for (int t = 0; t < 4; ++t) {
        for (int64_t c = 0; c < K; ++c) col[c] = w[4 * c + t];
        if (g.type_a) {  // softmax within each parent's 4 children, times its weight
          const float* ps = g.prev_score + task * Kp;
          for (int64_t j = 0; j < Kp; ++j) {
            softmax_inplace(&col[4 * j], 4);
            for (int u = 0; u < 4; ++u) col[4 * j + u] *= ps[j];
          }
        } else {
          softmax_inplace(col.data(), K);
        }
        if (topk > 0) {
          select_topk(col.data(), K, topk, keys.data(), chosen.data());
          int64_t* out_idx = g.next_idx + rows[t] * topk;
          for (int64_t i = 0; i < topk; ++i) out_idx[i] = cand[chosen[i]];
          if (g.type_a) {  // A: the refined keys leave this level's message
            float* out_score = g.next_score + rows[t] * topk;
            for (int64_t i = 0; i < topk; ++i) out_score[i] = col[chosen[i]];
            for (int64_t i = 0; i < topk; ++i) col[chosen[i]] = 0.f;
          }
        }
        for (int64_t c = 0; c < K; ++c) w[4 * c + t] = col[c];
      }
      aggregate4<D>(w.data(), g.v + bh * M * d, cand.data(), K, d, outs);
    }
  });
}

}  // namespace flatten_mm_quadtree
