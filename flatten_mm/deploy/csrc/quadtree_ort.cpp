// ONNX Runtime custom operator flatten_mm::QuadTreeLevel: one finer level of QuadTree
// attention on the CPU execution provider, by the same forward as the PyTorch extension
// (flatten_mm/models/ops/csrc/quadtree_level.h), on the session's intra-op thread pool.
//
// Part of flatten_mm (Apache-2.0). Built by flatten_mm/deploy/ort_ops.py against ONNX
// Runtime's C API header only (nothing to link: the API table comes in through
// RegisterCustomOps). The plain-operator graph (models/ops/quadtree_tiles.py) computes
// the same level with standard ONNX operators; this operator reads each parent's candidate
// rows in place instead of writing gathered (N, 4K, d) tiles first.
//
// Inputs (float32 unless said; BH = batch x heads, an (M / width, width) level, even sides):
//   0 q           (BH, M, d)        queries, raster order (not pre-scaled)
//   1 k, 2 v      (BH, M, d)        keys and values
//   3 prev_idx    (BH, M / 4, Kp)   int64 cells of the parent grid each parent selected
//   4 prev_score  (BH, M / 4, Kp)   variant A: the weights of those cells; B: ignored
//   5 init        (BH, M, d) or empty: the messages are added to it (empty: to zeros)
// Attributes: width (int), scale (float, the score scale), topk (int, 0 at the final
// level), type_a (int, 1 for variant A).
// Outputs:
//   0 msg         (BH, M, d)
//   1 next_idx    (BH, M, topk)             int64 candidate rows passed on
//   2 next_score  (BH, M, type_a ? topk : 0) their weights (variant A)
#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>
#undef ORT_API_MANUAL_INIT

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <exception>
#include <mutex>
#include <string>
#include <vector>

#include "quadtree_level.h"

namespace {

using flatten_mm_quadtree::LevelArgs;

constexpr const char* kDomain = "flatten_mm";
constexpr const char* kOpName = "QuadTreeLevel";

// run_level's parallel_for on the session's intra-op pool: chunks of `grain` tasks
struct OrtParallelFor {
  const OrtKernelContext* context;

  template <typename Fn>
  void operator()(int64_t tasks, int64_t grain, const Fn& fn) const {
    struct Job {
      const Fn* fn;
      int64_t tasks, grain;
    } job{&fn, tasks, grain};
    const int64_t chunks = (tasks + grain - 1) / grain;
    auto run_chunk = [](void* data, size_t chunk) {
      const Job* j = static_cast<const Job*>(data);
      const int64_t begin = static_cast<int64_t>(chunk) * j->grain;
      (*j->fn)(begin, std::min(j->tasks, begin + j->grain));
    };
    Ort::ThrowOnError(Ort::GetApi().KernelContext_ParallelFor(
        context, run_chunk, static_cast<size_t>(chunks), 0, &job));
  }
};

struct LevelError : std::exception {
  std::string what_;
  explicit LevelError(std::string w) : what_(std::move(w)) {}
  const char* what() const noexcept override { return what_.c_str(); }
};

inline void require(bool ok, const std::string& message) {
  if (!ok) throw LevelError(std::string(kDomain) + "::" + kOpName + ": " + message);
}

std::string shape_str(const std::vector<int64_t>& s) {
  std::string out = "(";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + ")";
}

struct QuadTreeLevelKernel {
  int64_t width, topk;
  float scale;
  bool type_a;

  explicit QuadTreeLevelKernel(const OrtKernelInfo* info) {
    Ort::ConstKernelInfo ki(info);
    width = ki.GetAttribute<int64_t>("width");
    topk = ki.GetAttribute<int64_t>("topk");
    scale = ki.GetAttribute<float>("scale");
    type_a = ki.GetAttribute<int64_t>("type_a") != 0;
  }

  OrtStatusPtr ComputeV2(OrtKernelContext* context) {
    try {
      Compute(context);
      return nullptr;
    } catch (const Ort::Exception& e) {
      return Ort::GetApi().CreateStatus(e.GetOrtErrorCode(), e.what());
    } catch (const std::exception& e) {
      return Ort::GetApi().CreateStatus(ORT_INVALID_ARGUMENT, e.what());
    }
  }

  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    const Ort::ConstValue q = ctx.GetInput(0), k = ctx.GetInput(1), v = ctx.GetInput(2);
    const Ort::ConstValue prev_idx = ctx.GetInput(3), prev_score = ctx.GetInput(4);
    const Ort::ConstValue init = ctx.GetInput(5);
    const std::vector<int64_t> qs = q.GetTensorTypeAndShapeInfo().GetShape();
    require(qs.size() == 3, "q must be (BH, M, d), got " + shape_str(qs));
    require(k.GetTensorTypeAndShapeInfo().GetShape() == qs &&
                v.GetTensorTypeAndShapeInfo().GetShape() == qs,
            "q, k and v must have the same shape (BH, M, d)");
    const int64_t BH = qs[0], M = qs[1], d = qs[2];
    require(width > 0 && width % 2 == 0 && M % (2 * width) == 0,
            "the level must have even height and width (M = " + std::to_string(M) +
                ", width = " + std::to_string(width) + ")");
    const int64_t Mp = M / 4;
    const std::vector<int64_t> is = prev_idx.GetTensorTypeAndShapeInfo().GetShape();
    require(is.size() == 3 && is[0] == BH && is[1] == Mp,
            "prev_idx must be (BH, M / 4, Kp), got " + shape_str(is));
    const int64_t Kp = is[2];
    require(topk >= 0 && topk <= 4 * Kp, "topk must be in [0, 4 Kp]");
    const int64_t* cells = prev_idx.GetTensorData<int64_t>();
    const int64_t bad = flatten_mm_quadtree::first_cell_outside(cells, BH * Mp * Kp, Mp);
    require(bad < 0, "prev_idx entry " + std::to_string(bad < 0 ? 0 : cells[bad]) +
                         " is outside the parent grid of " + std::to_string(Mp) + " tokens");
    const float* score_p = nullptr;
    if (type_a) {
      require(prev_score.GetTensorTypeAndShapeInfo().GetShape() == is,
              "variant A: prev_score must be shaped like prev_idx " + shape_str(is));
      score_p = prev_score.GetTensorData<float>();
    }
    const std::vector<int64_t> ins = init.GetTensorTypeAndShapeInfo().GetShape();
    const bool has_init = init.GetTensorTypeAndShapeInfo().GetElementCount() > 0;
    require(!has_init || ins == qs, "init must be empty or shaped like q, got " + shape_str(ins));

    float* msg = ctx.GetOutput(0, qs).GetTensorMutableData<float>();
    int64_t* next_idx = ctx.GetOutput(1, {BH, M, topk}).GetTensorMutableData<int64_t>();
    float* next_score =
        ctx.GetOutput(2, {BH, M, type_a ? topk : 0}).GetTensorMutableData<float>();
    if (has_init)
      std::memcpy(msg, init.GetTensorData<float>(), sizeof(float) * BH * M * d);
    else
      std::fill(msg, msg + BH * M * d, 0.f);

    const LevelArgs args{q.GetTensorData<float>(), k.GetTensorData<float>(),
                         v.GetTensorData<float>(), cells, score_p, msg, next_idx,
                         type_a ? next_score : nullptr, BH, M, d, width, Kp, topk, scale,
                         type_a};
    const OrtParallelFor parallel_for{context};
    switch (d) {  // compile-time head widths for the common cases, as in PyTorch
      case 16: flatten_mm_quadtree::run_level<16>(args, parallel_for); break;
      case 32: flatten_mm_quadtree::run_level<32>(args, parallel_for); break;
      case 64: flatten_mm_quadtree::run_level<64>(args, parallel_for); break;
      default: flatten_mm_quadtree::run_level<0>(args, parallel_for);
    }
  }
};

struct QuadTreeLevelOp : Ort::CustomOpBase<QuadTreeLevelOp, QuadTreeLevelKernel, true> {
  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info,
                              void** kernel) const {
    try {
      *kernel = new QuadTreeLevelKernel(info);
      return nullptr;
    } catch (const Ort::Exception& e) {
      return api.CreateStatus(e.GetOrtErrorCode(), e.what());
    } catch (const std::exception& e) {
      return api.CreateStatus(ORT_INVALID_ARGUMENT, e.what());
    }
  }
  const char* GetName() const { return kOpName; }
  size_t GetInputTypeCount() const { return 6; }
  ONNXTensorElementDataType GetInputType(size_t index) const {
    return index == 3 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  size_t GetOutputTypeCount() const { return 3; }
  ONNXTensorElementDataType GetOutputType(size_t index) const {
    return index == 1 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
};

}  // namespace

// The entry point ONNX Runtime calls (SessionOptions.register_custom_ops_library); the only
// symbol the library exports (it is built with -fvisibility=hidden).
extern "C" __attribute__((visibility("default"))) OrtStatus* ORT_API_CALL
RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  const OrtApi* api = api_base->GetApi(ORT_API_VERSION);
  if (api == nullptr)  // a runtime older than the header the library was built with
    return api_base->GetApi(1)->CreateStatus(
        ORT_FAIL, "flatten_mm: this ONNX Runtime is older than the C API the custom "
                  "operators were built with; rebuild them against its own headers");
  Ort::InitApi(api);
  // one domain for the process: a session keeps a pointer to it, so it is never freed
  static QuadTreeLevelOp op;
  static OrtCustomOpDomain* domain = nullptr;
  static std::mutex lock;
  std::lock_guard<std::mutex> guard(lock);
  if (domain == nullptr) {
    if (OrtStatus* status = api->CreateCustomOpDomain(kDomain, &domain)) return status;
    if (OrtStatus* status = api->CustomOpDomain_Add(domain, &op)) return status;
  }
  return api->AddCustomOpDomain(options, domain);
}
