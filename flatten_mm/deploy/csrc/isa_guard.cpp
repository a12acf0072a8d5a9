// The entry point of flatten_mm's ONNX Runtime operator library, RegisterCustomOps.
//
// Part of flatten_mm (Apache-2.0). This file is compiled without ISA flags (the
// architecture's baseline), unlike quadtree_ort.cpp (AVX2 + FMA where the building CPU has
// them): it checks that this CPU has every instruction set the operator code was compiled
// for (flatten_mm_ort_isa, a constant of quadtree_ort.cpp) before running any of it, and
// refuses with an error status otherwise. A library copied to an older CPU then fails to
// register with a message instead of dying with SIGILL.
#include <onnxruntime_c_api.h>

#include <cstdio>
#include <cstring>

extern "C" {
extern const char flatten_mm_ort_isa[];
OrtStatus* flatten_mm_register_ops(OrtSessionOptions* options, const OrtApiBase* api_base);
}

namespace {

// Whether this CPU has the instruction set `name` (a __builtin_cpu_supports name, which
// takes string literals only); an unknown name counts as missing.
bool cpu_has(const char* name, size_t length) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
#define FLATTEN_MM_FEATURE(literal)                                          \
  if (length == sizeof(literal) - 1 && std::strncmp(name, literal, length) == 0) \
    return __builtin_cpu_supports(literal);
  FLATTEN_MM_FEATURE("avx")
  FLATTEN_MM_FEATURE("avx2")
  FLATTEN_MM_FEATURE("fma")
  FLATTEN_MM_FEATURE("f16c")
  FLATTEN_MM_FEATURE("bmi")
  FLATTEN_MM_FEATURE("bmi2")
  FLATTEN_MM_FEATURE("avx512f")
  FLATTEN_MM_FEATURE("avx512cd")
  FLATTEN_MM_FEATURE("avx512bw")
  FLATTEN_MM_FEATURE("avx512dq")
  FLATTEN_MM_FEATURE("avx512vl")
#if (defined(__clang__) && __clang_major__ >= 14) || (!defined(__clang__) && __GNUC__ >= 12)
  FLATTEN_MM_FEATURE("avx512fp16")
#endif
#undef FLATTEN_MM_FEATURE
#endif
  (void)name;
  (void)length;
  return false;
}

}  // namespace

extern "C" {

// The instruction sets the operators were compiled for (space-separated, empty for a
// portable build): what flatten_mm.deploy.ort_ops.library_isa reads.
__attribute__((visibility("default"))) const char* flatten_mm_ort_ops_isa() {
  return flatten_mm_ort_isa;
}

// What ONNX Runtime calls (SessionOptions.register_custom_ops_library).
__attribute__((visibility("default"))) OrtStatus* ORT_API_CALL
RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  char found[256] = "";  // (no allocation here: plain C until the check passed)
  for (const char* p = flatten_mm_ort_isa; *p != '\0';) {
    while (*p == ' ') ++p;
    const char* end = p;
    while (*end != '\0' && *end != ' ') ++end;
    if (end > p && !cpu_has(p, static_cast<size_t>(end - p)))
      std::snprintf(found + std::strlen(found), sizeof(found) - std::strlen(found), " %.*s",
                    static_cast<int>(end - p), p);
    p = end;
  }
  if (found[0] != '\0') {
    char message[640];  // (CreateStatus copies it)
    std::snprintf(message, sizeof(message),
                  "flatten_mm: the ONNX Runtime operator library was compiled for a CPU "
                  "with%s; this CPU lacks%s. Build it on this machine (python "
                  "tools/deployment/build_ort_ops.py build), or a portable one with "
                  "FLATTEN_MM_CPU_ISA=generic",
                  flatten_mm_ort_isa, found);
    return api_base->GetApi(1)->CreateStatus(ORT_FAIL, message);
  }
  return flatten_mm_register_ops(options, api_base);
}

}  // extern "C"
