// Run-time ISA selection for every kernel of the library (see isa.h).

#include "isa.h"

#include <torch/extension.h>

#include <atomic>

namespace kiln {
namespace {

int64_t detect() {
#if defined(__x86_64__) || defined(_M_X64)
  // libgcc's cpuid checks include the OS's XSAVE support for the ymm / zmm state
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  if (!avx2) return ISA_SCALAR;
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq"))
    return ISA_AVX512;
  return ISA_AVX2;
#else
  return ISA_SCALAR;
#endif
}

const char* name_of(int64_t isa) { return isa == ISA_AVX512 ? "avx512" : isa == ISA_AVX2 ? "avx2" : "scalar"; }

std::atomic<int64_t> g_active{-1};

}  // namespace

int64_t cpu_isa() {
  static const int64_t isa = detect();
  return isa;
}

bool cpu_has_avx512_vnni() {
#if defined(__x86_64__) || defined(_M_X64)
  static const bool ok = [] {
    __builtin_cpu_init();
    return cpu_isa() >= ISA_AVX512 && __builtin_cpu_supports("avx512vnni");
  }();
  return ok;
#else
  return false;
#endif
}

bool cpu_has_avx512_bf16() {
#if defined(__x86_64__) || defined(_M_X64)
  static const bool ok = [] {
    __builtin_cpu_init();
    return cpu_isa() >= ISA_AVX512 && __builtin_cpu_supports("avx512bf16");
  }();
  return ok;
#else
  return false;
#endif
}

int64_t active_isa() {
  const int64_t isa = g_active.load(std::memory_order_relaxed);
  return isa < 0 ? cpu_isa() : isa;
}

void set_isa(int64_t isa) {
  TORCH_CHECK_VALUE(isa >= ISA_SCALAR && isa <= ISA_AVX512, "kiln: unknown ISA level ", isa);
  TORCH_CHECK_VALUE(isa <= cpu_isa(), "kiln: this CPU does not support ", name_of(isa), " (it runs ",
                    name_of(cpu_isa()), " at most)");
  g_active.store(isa, std::memory_order_relaxed);
}

int64_t resolve_isa(int64_t requested, const char* who) {
  if (requested < 0) return active_isa();
  TORCH_CHECK_VALUE(requested <= cpu_isa(), who, ": ISA ", name_of(requested), " is not supported by this CPU (it runs ",
                    name_of(cpu_isa()), " at most)");
  return requested;
}

}  // namespace kiln
