// ONNX Runtime custom operator flatten_mm::QuadTreeLevel: one finer level of QuadTree
// attention on the CPU execution provider, by the same forward as the PyTorch extension
// (flatten_mm/models/ops/csrc/quadtree_level.h), on the session's intra-op thread pool.
//
// Part of flatten_mm (Apache-2.0). Built by flatten_mm/deploy/ort_ops.py against ONNX
// Runtime's C API header only (nothing to link: the API table comes in through
// RegisterCustomOps, in isa_guard.cpp: it checks the CPU first, then calls
// flatten_mm_register_ops here). The plain-operator graph (models/ops/quadtree_tiles.py) computes
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
#include <new>
#include <string>
#include <vector>

#include "quadtree_level.h"

// The instruction sets beyond the architecture's baseline this file was compiled for
// (space-separated __builtin_cpu_supports names): isa_guard.cpp refuses to register the
// operators on a CPU without one of them, instead of dying with SIGILL in them.
extern "C" const char flatten_mm_ort_isa[] = ""
#if defined(__AVX__)
    " avx"
#endif
#if defined(__AVX2__)
    " avx2"
#endif
#if defined(__FMA__)
    " fma"
#endif
#if defined(__F16C__)
    " f16c"
#endif
#if defined(__BMI__)
    " bmi"
#endif
#if defined(__BMI2__)
    " bmi2"
#endif
#if defined(__AVX512F__)
    " avx512f"
#endif
#if defined(__AVX512CD__)
    " avx512cd"
#endif
#if defined(__AVX512BW__)
    " avx512bw"
#endif
#if defined(__AVX512DQ__)
    " avx512dq"
#endif
#if defined(__AVX512VL__)
    " avx512vl"
#endif
#if defined(__AVX512FP16__)
    " avx512fp16"
#endif
    "";

namespace {

using flatten_mm_quadtree::InputError;
using flatten_mm_quadtree::LevelArgs;

constexpr const char* kDomain = "flatten_mm";
constexpr const char* kOpName = "QuadTreeLevel";

// run_level's parallel_for on the session's intra-op pool: chunks of `grain` tasks. fn
// never throws (run_level wraps it in parallel_for_carrying): nothing may leave run_chunk,
// which ONNX Runtime calls through a C function pointer.
struct OrtParallelFor {
  const OrtKernelContext* context;

  template <typename Fn>
  void operator()(int64_t tasks, int64_t grain, const Fn& fn) const {
    static_assert(noexcept(fn(int64_t{0}, int64_t{0})), "the pool's callback must not throw");
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

inline void require(bool ok, const std::string& message) {
  if (!ok) throw InputError(message);
}

std::string shape_str(const std::vector<int64_t>& s) {
  std::string out = "(";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + ")";
}

// a status for whatever the kernel threw, named after the operator
OrtStatusPtr status_of(const OrtApi& api, std::exception_ptr error) {
  const std::string op = std::string(kDomain) + "::" + kOpName + ": ";
  try {
    std::rethrow_exception(error);
  } catch (const InputError& e) {
    return api.CreateStatus(ORT_INVALID_ARGUMENT, (op + e.what()).c_str());
  } catch (const Ort::Exception& e) {
    return api.CreateStatus(e.GetOrtErrorCode(), (op + e.what()).c_str());
  } catch (const std::bad_alloc&) {
    return api.CreateStatus(ORT_RUNTIME_EXCEPTION, (op + "out of memory (std::bad_alloc)").c_str());
  } catch (const std::exception& e) {
    return api.CreateStatus(ORT_RUNTIME_EXCEPTION, (op + e.what()).c_str());
  } catch (...) {
    return api.CreateStatus(ORT_RUNTIME_EXCEPTION, (op + "unknown exception").c_str());
  }
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

  OrtStatusPtr ComputeV2(OrtKernelContext* context) noexcept {
    try {
      Compute(context);
      return nullptr;
    } catch (...) {
      return status_of(Ort::GetApi(), std::current_exception());
    }
  }

  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    require(ctx.GetInputCount() == 6 && ctx.GetOutputCount() == 3,
            "6 inputs and 3 outputs expected");
    const Ort::ConstValue q = ctx.GetInput(0), k = ctx.GetInput(1), v = ctx.GetInput(2);
    const Ort::ConstValue prev_idx = ctx.GetInput(3), prev_score = ctx.GetInput(4);
    const Ort::ConstValue init = ctx.GetInput(5);
    const char* names[6] = {"q", "k", "v", "prev_idx", "prev_score", "init"};
    const Ort::ConstValue inputs[6] = {q, k, v, prev_idx, prev_score, init};
    for (int i = 0; i < 6; ++i) {
      require(inputs[i] != nullptr && inputs[i].IsTensor(),
              std::string(names[i]) + " must be a tensor");
      const ONNXTensorElementDataType want =
          i == 3 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
      require(inputs[i].GetTensorTypeAndShapeInfo().GetElementType() == want,
              std::string(names[i]) + (i == 3 ? " must be int64" : " must be float32"));
    }
    const std::vector<int64_t> qs = q.GetTensorTypeAndShapeInfo().GetShape();
    const std::vector<int64_t> is = prev_idx.GetTensorTypeAndShapeInfo().GetShape();
    flatten_mm_quadtree::check_level_shapes(qs, k.GetTensorTypeAndShapeInfo().GetShape(),
                                            v.GetTensorTypeAndShapeInfo().GetShape(), is,
                                            width, topk);
    const int64_t BH = qs[0], M = qs[1], d = qs[2], Mp = M / 4, Kp = is[2];
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
    const int64_t size = BH * M * d;
    if (size == 0) return;  // an empty batch or map: empty outputs (next_idx is too)
    if (has_init)
      std::memcpy(msg, init.GetTensorData<float>(), sizeof(float) * size);
    else
      std::fill(msg, msg + size, 0.f);

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
                              void** kernel) const noexcept {
    try {
      *kernel = new QuadTreeLevelKernel(info);
      return nullptr;
    } catch (...) {
      return status_of(api, std::current_exception());
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

// Registers the operators (RegisterCustomOps in isa_guard.cpp calls it once the CPU is known
// to run this file's code). Thread-safe: sessions may be created on several threads at once.
extern "C" OrtStatus* flatten_mm_register_ops(OrtSessionOptions* options,
                                              const OrtApiBase* api_base) noexcept {
  const OrtApi* api = api_base->GetApi(ORT_API_VERSION);
  if (api == nullptr) {  // a runtime older than the header the library was built with
    const std::string message =
        std::string("flatten_mm: this ONNX Runtime (") + api_base->GetVersionString() +
        ") is older than the C API the custom operators were built with (ORT_API_VERSION " +
        std::to_string(ORT_API_VERSION) + ", ONNX Runtime 1." + std::to_string(ORT_API_VERSION) +
        "); rebuild them against its own headers";
    return api_base->GetApi(1)->CreateStatus(ORT_FAIL, message.c_str());
  }
  // one domain for the process: a session keeps a pointer to it, so it is never freed
  static std::mutex lock;
  static OrtCustomOpDomain* domain = nullptr;
  try {
    std::lock_guard<std::mutex> guard(lock);
    Ort::InitApi(api);  // (a global of the C++ wrapper: set under the lock)
    static QuadTreeLevelOp op;
    if (domain == nullptr) {
      OrtCustomOpDomain* created = nullptr;
      if (OrtStatus* status = api->CreateCustomOpDomain(kDomain, &created)) return status;
      if (OrtStatus* status = api->CustomOpDomain_Add(created, &op)) {
        api->ReleaseCustomOpDomain(created);
        return status;
      }
      domain = created;
    }
    return api->AddCustomOpDomain(options, domain);
  } catch (...) {
    return status_of(*api, std::current_exception());
  }
}
