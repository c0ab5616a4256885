// 16 float32 lanes (one AVX-512 register; GCC lowers them to AVX2 or SSE pairs where that is
// what -march=native offers) and the one way every kernel moves them to and from memory.
//
// Loads and stores dereference an unaligned, may_alias vector type: one vmovups each, whatever
// the tuning. A 64-byte memcpy into a vector looks the same but is not: under a tuning that
// prefers 256-bit vectors (GCC's guess for some Xeons) it became two ymm stores to the stack and
// a zmm reload (a failed store forward) per load, and spilled the accumulators around it: the
// packed GEMM ran at a fifth of MKL's speed there (benchmarks/RESULTS.md "Session 13").
#pragma once

typedef float v16 __attribute__((vector_size(64)));
typedef int i16 __attribute__((vector_size(64)));
typedef float v16_mem __attribute__((vector_size(64), aligned(4), may_alias));

inline v16 load16(const float* p) { return *reinterpret_cast<const v16_mem*>(p); }

inline void store16(float* p, v16 v) { *reinterpret_cast<v16_mem*>(p) = v; }

// The lanes' bits read as float32 (a vector cast between same-size types moves no value).
inline v16 as_float16(i16 bits) { return reinterpret_cast<v16>(bits); }
