// Fused CPU kernels for one finer level of QuadTree attention, forward and backward.
//
// Part of flatten_mm (Apache-2.0). Same maths as ``_finer_level_inference`` and the batched
// level of ../../layers/quadtree_attention.py (which stay the reference and the path on
// other devices). The forward is quadtree_level.h (shared with the ONNX Runtime operator);
// this file adds the backward and the PyTorch bindings.
//
// The backward keeps nothing from the forward but its inputs: pass 1 (one parent per task)
// rebuilds a parent's scores and weights and writes its query gradients; pass 2 (one
// cell of the parent grid per task) walks the parents that selected the cell (an inverted
// index built by counting sort) and sums the key / value gradients of its 4 children, so
// every gradient row has one writer: no atomics, no per-thread buffers, and the same
// result for any number of threads.
//
// Registered as torch.ops.flatten_mm.quadtree_level and quadtree_level_backward (no
// pybind11).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "quadtree_level.h"

namespace {

using namespace flatten_mm_quadtree;

// at::parallel_for in the form run_level takes
inline auto torch_parallel_for() {
  return [](int64_t tasks, int64_t grain, const auto& fn) {
    at::parallel_for(0, tasks, grain, fn);
  };
}

// at::parallel_for(0, tasks, grain, fn) with fn's exceptions (a TORCH_CHECK, a bad_alloc)
// caught inside the pool and rethrown here (parallel_for_carrying)
template <typename Fn>
inline void parallel_for_checked(int64_t tasks, int64_t grain, const Fn& fn) {
  parallel_for_carrying(torch_parallel_for(), tasks, grain, fn);
}

// TORCH_CHECK that every entry of cells (n of them) lies in the parent grid of Mp cells
inline void check_cells(const char* op, const int64_t* cells, int64_t n, int64_t Mp) {
  const int64_t bad = first_cell_outside(cells, n, Mp);
  TORCH_CHECK(bad < 0, op, ": prev_idx entry ", bad < 0 ? 0 : cells[bad],
              " is outside the parent grid of ", Mp, " tokens");
}

// The checks both operators share: CPU tensors, q/k/v float32 contiguous, prev_idx int64
// contiguous, and the sizes of check_level_shapes (quadtree_level.h), as RuntimeErrors
// named after op.
void check_level_inputs(const char* op, const at::Tensor& q, const at::Tensor& k,
                        const at::Tensor& v, const at::Tensor& prev_idx, int64_t width,
                        int64_t topk) {
  const char* names[4] = {"q", "k", "v", "prev_idx"};
  const at::Tensor* tensors[4] = {&q, &k, &v, &prev_idx};
  for (int i = 0; i < 4; ++i) {
    const at::Tensor& t = *tensors[i];
    TORCH_CHECK(t.defined() && t.device().is_cpu(), op, ": ", names[i],
                " must be a CPU tensor (CPU tensors only)");
    TORCH_CHECK(t.scalar_type() == (i == 3 ? at::kLong : at::kFloat), op, ": ", names[i],
                i == 3 ? " must be int64" : " must be float32", ", got ", t.scalar_type());
    TORCH_CHECK(t.is_contiguous(), op, ": ", names[i], " must be contiguous");
  }
  try {
    check_level_shapes(q.sizes().vec(), k.sizes().vec(), v.sizes().vec(),
                       prev_idx.sizes().vec(), width, topk);
  } catch (const InputError& e) {
    TORCH_CHECK(false, op, ": ", e.what());
  }
}

// an optional float32 (BH, M / 4, Kp) like prev_idx (variant A's prev_score), contiguous
at::Tensor like_prev_idx(const char* op, const c10::optional<at::Tensor>& t,
                         const at::Tensor& prev_idx) {
  TORCH_CHECK(t.has_value() && t->defined(), op, ": variant A needs prev_score");
  TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat &&
                  t->sizes() == prev_idx.sizes(),
              op, ": prev_score must be a float32 CPU tensor like prev_idx ", prev_idx.sizes(),
              ", got ", t->scalar_type(), " ", t->sizes());
  return t->contiguous();
}

// out += sum_t w[t] rows[t] for 4 rows of d floats
template <int D>
inline void axpy4(const float* w, const float* const* rows, int64_t d, float* out) {
  const int64_t n = D > 0 ? D : d;
  const float w0 = w[0], w1 = w[1], w2 = w[2], w3 = w[3];
  const float *r0 = rows[0], *r1 = rows[1], *r2 = rows[2], *r3 = rows[3];
#pragma omp simd
  for (int64_t x = 0; x < n; ++x) out[x] += w0 * r0[x] + w1 * r1[x] + w2 * r2[x] + w3 * r3[x];
}

// The position of row among the topk rows a query passed on, or -1 (variant A: its
// selected keys left the message and carry the next level's gradient instead).
inline int64_t selected_at(const int64_t* chosen, int64_t topk, int64_t row) {
  for (int64_t i = 0; i < topk; ++i)
    if (chosen[i] == row) return i;
  return -1;
}

struct BackwardArgs {
  const float* grad;  // (BH, M, d) gradient of the messages
  const float* q;
  const float* k;
  const float* v;
  const int64_t* prev_idx;
  const float* prev_score;   // variant A only
  const int64_t* next_idx;   // variant A with topk > 0: (BH, M, topk)
  const float* next_grad;    // gradient of next_score, or nullptr (zero)
  float* dq;
  float* dk;
  float* dv;
  float* dprev_score;        // variant A only: (BH, M / 4, Kp)
  float* stats;              // variant B: (BH * M, 3) row max, 1 / sum, sum_c w dw
  const int64_t* offsets;    // (BH * M / 4 + 1): entries of each parent-grid cell
  const int32_t* entries;    // p * Kp + j of every parent p that selected the cell as its j-th
  int64_t BH, M, d, width, Kp, topk;
  float scale;
  bool type_a;
};

// Variant A, one query t of a parent and one group of 4 children (one selected cell, whose
// weight in the coarser level is ps): from the scores s[u] (rebuilt into the softmax), the
// message-weight gradients dw[u] and the rows the query passed on, the weights w[u] of
// the message, the score gradients ds[u] (times scale) and the group's part of d ps.
inline float group_a_backward(float* s, const float* dw, float ps, const int64_t* chosen,
                              const float* chosen_grad, int64_t topk, const int64_t* rows,
                              float scale, float* w, float* ds) {
  softmax_inplace(s, 4);
  float dsoft[4], dps = 0.f, dot = 0.f;
  for (int u = 0; u < 4; ++u) {
    const int64_t i = topk > 0 ? selected_at(chosen, topk, rows[u]) : -1;
    const float dattn = i < 0 ? dw[u] : (chosen_grad != nullptr ? chosen_grad[i] : 0.f);
    w[u] = i < 0 ? s[u] * ps : 0.f;
    dps += dattn * s[u];
    dsoft[u] = dattn * ps;
    dot += s[u] * dsoft[u];
  }
  for (int u = 0; u < 4; ++u) ds[u] = s[u] * (dsoft[u] - dot) * scale;
  return dps;
}

// Backward, pass 1, one parent per task: the query gradients (and, for A, the gradient of
// the parent's selected-cell weights; for B, the softmax statistics pass 2 needs).
template <int D>
void backward_queries(const BackwardArgs& g) {
  const int64_t d = D > 0 ? D : g.d;
  const int64_t M = g.M, width = g.width, Mp = M / 4, Kp = g.Kp, K = 4 * Kp;
  const int64_t grain = std::max<int64_t>(1, 1024 / (K * d / 32 + 1));
  parallel_for_checked(g.BH * Mp, grain, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> cand(K);
    std::vector<float> w(4 * K), dw(4 * K), col(K), dps(Kp);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / Mp;
      children_of(g.prev_idx + task * Kp, Kp, width, cand.data());
      int64_t rows[4];
      query_rows(bh, task % Mp, M, width, rows);
      const float* qs[4];
      const float* gs[4];
      float* dqs[4];
      for (int t = 0; t < 4; ++t) {
        qs[t] = g.q + rows[t] * d;
        gs[t] = g.grad + rows[t] * d;
        dqs[t] = g.dq + rows[t] * d;
        std::fill(dqs[t], dqs[t] + d, 0.f);
      }
      const float* kb = g.k + bh * M * d;
      const float* vb = g.v + bh * M * d;
      for (int64_t c = 0; c < K; ++c) {
        dot4<D>(qs, kb + cand[c] * d, d, g.scale, &w[4 * c]);  // scores
        dot4<D>(gs, vb + cand[c] * d, d, 1.f, &dw[4 * c]);     // d message weights
      }
      std::fill(dps.begin(), dps.end(), 0.f);
      for (int t = 0; t < 4; ++t) {
        for (int64_t c = 0; c < K; ++c) col[c] = w[4 * c + t];
        if (g.type_a) {
          const int64_t* chosen = g.topk > 0 ? g.next_idx + rows[t] * g.topk : nullptr;
          const float* cg =
              g.topk > 0 && g.next_grad != nullptr ? g.next_grad + rows[t] * g.topk : nullptr;
          const float* ps = g.prev_score + task * Kp;
          for (int64_t j = 0; j < Kp; ++j) {
            float dwj[4], wj[4], ds[4];
            for (int u = 0; u < 4; ++u) dwj[u] = dw[4 * (4 * j + u) + t];
            dps[j] += group_a_backward(&col[4 * j], dwj, ps[j], chosen, cg, g.topk,
                                       &cand[4 * j], g.scale, wj, ds);
            for (int u = 0; u < 4; ++u) w[4 * (4 * j + u) + t] = ds[u];
          }
        } else {
          const std::pair<float, float> st = softmax_inplace(col.data(), K);
          float delta = 0.f;
          for (int64_t c = 0; c < K; ++c) delta += col[c] * dw[4 * c + t];
          for (int64_t c = 0; c < K; ++c)
            w[4 * c + t] = col[c] * (dw[4 * c + t] - delta) * g.scale;
          float* row_stats = g.stats + rows[t] * 3;
          row_stats[0] = st.first;
          row_stats[1] = st.second;
          row_stats[2] = delta;
        }
      }
      aggregate4<D>(w.data(), kb, cand.data(), K, d, dqs);  // dq = sum_c ds k_c
      if (g.type_a)
        for (int64_t j = 0; j < Kp; ++j) g.dprev_score[task * Kp + j] = dps[j];
    }
  });
}

// Backward, pass 2, one cell of the parent grid per task: the key and value gradients of
// its 4 children, summed over the parents that selected the cell (each child row is
// written by its cell only: no atomics, the same result for any thread count). The
// weights are rebuilt from the scores (B: with pass 1's statistics).
template <int D>
void backward_keys(const BackwardArgs& g) {
  const int64_t d = D > 0 ? D : g.d;
  const int64_t M = g.M, width = g.width, pw = width / 2, Mp = M / 4, Kp = g.Kp;
  const int64_t cells = g.BH * Mp, total = g.offsets[cells];
  // chunks of cells holding about the same number of entries (popular cells are not
  // spread evenly over the map)
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(
      cells, 16 * static_cast<int64_t>(at::get_num_threads())));
  std::vector<int64_t> bounds(chunks + 1, cells);
  for (int64_t c = 0; c < chunks; ++c)
    bounds[c] = std::lower_bound(g.offsets, g.offsets + cells, total * c / chunks) - g.offsets;
  parallel_for_checked(chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(8 * d);
    for (int64_t cell = bounds[begin]; cell < bounds[end]; ++cell) {
      const int64_t bh = cell / Mp, s = cell % Mp;
      const int64_t base = 2 * (s / pw) * width + 2 * (s % pw);
      const int64_t kids[4] = {base, base + 1, base + width, base + width + 1};
      const float* kr[4];
      const float* vr[4];
      for (int u = 0; u < 4; ++u) {
        kr[u] = g.k + (bh * M + kids[u]) * d;
        vr[u] = g.v + (bh * M + kids[u]) * d;
      }
      std::fill(acc.begin(), acc.end(), 0.f);  // dk of the 4 children, then their dv
      for (int64_t e = g.offsets[cell]; e < g.offsets[cell + 1]; ++e) {
        const int64_t p = g.entries[e] / Kp, j = g.entries[e] % Kp;
        int64_t rows[4];
        query_rows(bh, p, M, width, rows);
        const float* qs[4];
        const float* gs[4];
        for (int t = 0; t < 4; ++t) {
          qs[t] = g.q + rows[t] * d;
          gs[t] = g.grad + rows[t] * d;
        }
        float sc[16], dw[16], w[16], ds[16];  // [4 u + t]
        for (int u = 0; u < 4; ++u) {
          dot4<D>(qs, kr[u], d, g.scale, &sc[4 * u]);
          dot4<D>(gs, vr[u], d, 1.f, &dw[4 * u]);
        }
        for (int t = 0; t < 4; ++t) {
          if (g.type_a) {
            const int64_t* chosen = g.topk > 0 ? g.next_idx + rows[t] * g.topk : nullptr;
            const float* cg =
                g.topk > 0 && g.next_grad != nullptr ? g.next_grad + rows[t] * g.topk : nullptr;
            float st[4], dwt[4], wt[4], dst[4];
            for (int u = 0; u < 4; ++u) {
              st[u] = sc[4 * u + t];
              dwt[u] = dw[4 * u + t];
            }
            group_a_backward(st, dwt, g.prev_score[(bh * Mp + p) * Kp + j], chosen, cg,
                             g.topk, kids, g.scale, wt, dst);
            for (int u = 0; u < 4; ++u) {
              w[4 * u + t] = wt[u];
              ds[4 * u + t] = dst[u];
            }
          } else {
            const float* row_stats = g.stats + rows[t] * 3;
            for (int u = 0; u < 4; ++u) {
              const float pr = exp_nonpositive(sc[4 * u + t] - row_stats[0]) * row_stats[1];
              w[4 * u + t] = pr;
              ds[4 * u + t] = pr * (dw[4 * u + t] - row_stats[2]) * g.scale;
            }
          }
        }
        for (int u = 0; u < 4; ++u) {
          axpy4<D>(&ds[4 * u], qs, d, &acc[u * d]);
          axpy4<D>(&w[4 * u], gs, d, &acc[(4 + u) * d]);
        }
      }
      for (int u = 0; u < 4; ++u) {
        std::copy(&acc[u * d], &acc[(u + 1) * d], g.dk + (bh * M + kids[u]) * d);
        std::copy(&acc[(4 + u) * d], &acc[(5 + u) * d], g.dv + (bh * M + kids[u]) * d);
      }
    }
  });
}

// For every cell of each head's parent grid, the (p * Kp + j) of the parents p that selected
// it as their j-th cell (counting sort: offsets (BH * Mp + 1) and entries (BH * Mp * Kp)).
void cells_to_parents(const int64_t* prev_idx, int64_t BH, int64_t Mp, int64_t Kp,
                      int64_t* offsets, int32_t* entries) {
  std::fill(offsets, offsets + BH * Mp + 1, 0);
  parallel_for_checked(BH, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t* sel = prev_idx + bh * Mp * Kp;
      int64_t* count = offsets + bh * Mp + 1;
      for (int64_t e = 0; e < Mp * Kp; ++e) {
        TORCH_CHECK(sel[e] >= 0 && sel[e] < Mp, "quadtree_level_backward: prev_idx entry ",
                    sel[e], " is outside the parent grid of ", Mp, " tokens");
        ++count[sel[e]];
      }
    }
  });
  for (int64_t c = 0; c < BH * Mp; ++c) offsets[c + 1] += offsets[c];
  parallel_for_checked(BH, 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> cursor(Mp);
    for (int64_t bh = begin; bh < end; ++bh) {
      std::copy(offsets + bh * Mp, offsets + (bh + 1) * Mp, cursor.begin());
      const int64_t* sel = prev_idx + bh * Mp * Kp;
      for (int64_t e = 0; e < Mp * Kp; ++e) entries[cursor[sel[e]]++] = static_cast<int32_t>(e);
    }
  });
}

}  // namespace

// q, k, v, msg: (BH, M, d) float32 contiguous, raster order of an (H, W) level, W = 2 pw.
// prev_idx: (BH, M / 4, Kp) int64, raster indices into the parent (H/2, W/2) grid.
// prev_score: (BH, M / 4, Kp) float32, variant A only (undefined for B).
// Adds the messages to msg in place. Returns (next_idx, next_score): (BH, M, topk) int64
// candidate rows of this level (empty when topk == 0) and, for A, their weights.
std::vector<at::Tensor> quadtree_level(const at::Tensor& q, const at::Tensor& k,
                                       const at::Tensor& v, const at::Tensor& prev_idx,
                                       const c10::optional<at::Tensor>& prev_score_opt,
                                       at::Tensor msg, int64_t width, double temp,
                                       int64_t topk, bool type_a) {
  check_level_inputs("quadtree_level", q, k, v, prev_idx, width, topk);
  TORCH_CHECK(msg.defined() && msg.device().is_cpu() && msg.scalar_type() == at::kFloat &&
                  msg.is_contiguous() && msg.sizes() == q.sizes(),
              "quadtree_level: msg must be a contiguous float32 CPU tensor shaped like q ",
              q.sizes(), ", got ", msg.scalar_type(), " ", msg.sizes());
  const int64_t BH = q.size(0), M = q.size(1), d = q.size(2);
  const int64_t Mp = M / 4, Kp = prev_idx.size(2);
  const float* prev_score_p = nullptr;
  at::Tensor prev_score;
  if (type_a) {
    prev_score = like_prev_idx("quadtree_level", prev_score_opt, prev_idx);
    prev_score_p = prev_score.data_ptr<float>();
  }
  at::Tensor next_idx = at::empty({BH, M, topk}, prev_idx.options());
  at::Tensor next_score = at::empty({BH, M, type_a ? topk : 0}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* mp = msg.data_ptr<float>();
  const int64_t* ip = prev_idx.data_ptr<int64_t>();
  int64_t* nip = next_idx.data_ptr<int64_t>();
  float* nsp = type_a ? next_score.data_ptr<float>() : nullptr;
  const float scale = static_cast<float>(temp);

  check_cells("quadtree_level", ip, BH * Mp * Kp, Mp);
  const LevelArgs args{qp, kp, vp, ip, prev_score_p, mp, nip, nsp, BH, M, d, width, Kp,
                       topk, scale, type_a};
  try {
    switch (d) {  // compile-time head widths for the common cases
      case 16: run_level<16>(args, torch_parallel_for()); break;
      case 32: run_level<32>(args, torch_parallel_for()); break;
      case 64: run_level<64>(args, torch_parallel_for()); break;
      default: run_level<0>(args, torch_parallel_for());
    }
  } catch (const InputError& e) {
    TORCH_CHECK(false, "quadtree_level: ", e.what());
  }
  return {next_idx, next_score};
}

// The backward of quadtree_level (same q, k, v, prev_idx, prev_score, width, temp, type_a;
// next_idx: its returned candidate rows, used by A with topk > 0, when the selected keys
// left the message). grad: (BH, M, d) gradient of the messages; next_grad: optional
// gradient of A's next_score. Returns (dq, dk, dv, dprev_score); dprev_score is empty for
// B. Recomputes the scores and weights (nothing but the inputs is kept from the forward).
std::vector<at::Tensor> quadtree_level_backward(
    const at::Tensor& grad, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& prev_idx, const c10::optional<at::Tensor>& prev_score_opt,
    const at::Tensor& next_idx, const c10::optional<at::Tensor>& next_grad_opt,
    int64_t width, double temp, bool type_a) {
  check_level_inputs("quadtree_level_backward", q, k, v, prev_idx, width, 0);
  TORCH_CHECK(grad.defined() && grad.device().is_cpu() && grad.scalar_type() == at::kFloat &&
                  grad.is_contiguous() && grad.sizes() == q.sizes(),
              "quadtree_level_backward: grad must be a contiguous float32 CPU tensor shaped "
              "like q ", q.sizes(), ", got ", grad.scalar_type(), " ", grad.sizes());
  const int64_t BH = q.size(0), M = q.size(1), d = q.size(2);
  const int64_t Mp = M / 4, Kp = prev_idx.size(2);
  TORCH_CHECK(Mp * Kp < std::numeric_limits<int32_t>::max(),
              "quadtree_level_backward: more than 2^31 selections per head");
  at::Tensor prev_score, next_grad, dprev_score = at::empty({0}, q.options());
  int64_t topk = 0;
  if (type_a) {
    prev_score = like_prev_idx("quadtree_level_backward", prev_score_opt, prev_idx);
    TORCH_CHECK(next_idx.defined() && next_idx.device().is_cpu() &&
                    next_idx.scalar_type() == at::kLong && next_idx.is_contiguous() &&
                    next_idx.dim() == 3 && next_idx.size(0) == BH && next_idx.size(1) == M &&
                    next_idx.size(2) <= 4 * Kp,
                "quadtree_level_backward: next_idx must be contiguous int64 (BH, M, topk) "
                "with topk <= 4 Kp, got ", next_idx.sizes());
    topk = next_idx.size(2);
    if (next_grad_opt.has_value() && next_grad_opt->defined() && topk > 0) {
      TORCH_CHECK(next_grad_opt->device().is_cpu() &&
                      next_grad_opt->scalar_type() == at::kFloat &&
                      next_grad_opt->sizes() == next_idx.sizes(),
                  "quadtree_level_backward: next_grad must be float32 like next_idx");
      next_grad = next_grad_opt->contiguous();
    }
    dprev_score = at::empty(prev_idx.sizes(), q.options());
  }
  at::Tensor dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v);
  at::Tensor stats = at::empty({type_a ? 0 : BH * M, 3}, q.options());
  at::Tensor offsets = at::empty({BH * Mp + 1}, prev_idx.options());
  at::Tensor entries = at::empty({BH * Mp * Kp}, prev_idx.options().dtype(at::kInt));
  cells_to_parents(prev_idx.data_ptr<int64_t>(), BH, Mp, Kp, offsets.data_ptr<int64_t>(),
                   entries.data_ptr<int32_t>());
  const BackwardArgs args{
      grad.data_ptr<float>(), q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(),
      prev_idx.data_ptr<int64_t>(), type_a ? prev_score.data_ptr<float>() : nullptr,
      type_a && topk > 0 ? next_idx.data_ptr<int64_t>() : nullptr,
      next_grad.defined() ? next_grad.data_ptr<float>() : nullptr, dq.data_ptr<float>(),
      dk.data_ptr<float>(), dv.data_ptr<float>(),
      type_a ? dprev_score.data_ptr<float>() : nullptr,
      type_a ? nullptr : stats.data_ptr<float>(), offsets.data_ptr<int64_t>(),
      entries.data_ptr<int32_t>(), BH, M, d, width, Kp, topk, static_cast<float>(temp), type_a};
  switch (d) {
    case 16: backward_queries<16>(args); backward_keys<16>(args); break;
    case 32: backward_queries<32>(args); backward_keys<32>(args); break;
    case 64: backward_queries<64>(args); backward_keys<64>(args); break;
    default: backward_queries<0>(args); backward_keys<0>(args);
  }
  return {dq, dk, dv, dprev_score};
}

TORCH_LIBRARY(flatten_mm, m) {
  m.def(
      "quadtree_level(Tensor q, Tensor k, Tensor v, Tensor prev_idx, Tensor? prev_score, "
      "Tensor(a!) msg, int width, float temp, int topk, bool type_a) -> Tensor[]");
  m.def(
      "quadtree_level_backward(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor prev_idx, "
      "Tensor? prev_score, Tensor next_idx, Tensor? next_grad, int width, float temp, "
      "bool type_a) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(flatten_mm, CPU, m) {
  m.impl("quadtree_level", &quadtree_level);
  m.impl("quadtree_level_backward", &quadtree_level_backward);
}
