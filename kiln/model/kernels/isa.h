// Which instruction set the kernels run (see isa.cpp).
//
// One library serves every x86-64 CPU: it is compiled for the baseline ISA and each SIMD function
// carries its own target attribute, so nothing runs an instruction the CPU lacks. The path is
// chosen at run time: the CPU's best by default, or a lower one forced (KILN_CPU_ISA, the
// `engine.cpu_isa` setting) so an AVX-512 machine can run and measure the AVX2 code.
#pragma once

#include <cstdint>

namespace kiln {

// Levels, lowest to highest. AVX2 means AVX2 + FMA + F16C; AVX512 means F/BW/VL/DQ on top of
// that. VNNI and BF16 are extras an AVX512 kernel uses where the CPU has them (else it takes the
// AVX512 or AVX2 code that does without).
enum Isa : int64_t { ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 };

// The highest level this CPU runs (cpuid, with the OS's register-state support).
int64_t cpu_isa();
bool cpu_has_avx512_vnni();
bool cpu_has_avx512_bf16();

// The level the kernels use when a call does not name one (cpu_isa() until set_isa).
int64_t active_isa();
// Select the level; an error names what the CPU supports when it is above cpu_isa().
void set_isa(int64_t isa);

// A call's requested level (-1: the active one); an error when above what the CPU runs.
int64_t resolve_isa(int64_t requested, const char* who);

}  // namespace kiln
