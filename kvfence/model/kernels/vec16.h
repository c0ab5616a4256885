// 16 float32 lanes (one AVX-512 register; GCC lowers them to AVX2 or SSE pairs where that is
// what -march=native offers) and the one way every kernel moves them to and from memory.
//
// Loads and stores dereference an unaligned, may_alias vector type: one vmovups each, whatever
// the tuning. A 64-byte memcpy into a vector looks the same but is not: under a tuning that
// prefers 256-bit vectors (GCC's guess for some Xeons) it became two ymm stores to the stack and
// a zmm reload (a failed store forward) per load, and spilled the accumulators around it: the
// packed GEMM ran at a fifth of MKL's speed there (benchmarks/RESULTS.md "Kernels").
#pragma once

typedef float v16 __attribute__((vector_size(64)));
typedef int i16 __attribute__((vector_size(64)));
typedef float v16_mem __attribute__((vector_size(64), aligned(4), may_alias));

inline v16 load16(const float* p) { return *reinterpret_cast<const v16_mem*>(p); }

inline void store16(float* p, v16 v) { *reinterpret_cast<v16_mem*>(p) = v; }

// The lanes' bits read as float32 (a vector cast between same-size types moves no value).
inline v16 as_float16(i16 bits) { return reinterpret_cast<v16>(bits); }

// exp(x) on 16 lanes for softmax's x <= 0 (a score minus the row's maximum): Cody-Waite
// reduction to r in [-ln2/2, ln2/2] and Cephes' polynomial for expf (documented at about 1 ulp;
// the attention's error against float64 is unchanged: decode_attention.py --rounding). Below
// -87 the result is clamped to exp(-87) ~ 1.6e-38, which a sum holding exp(0) = 1 cannot tell
// from 0. GCC does not vectorize std::exp here without -ffast-math:
// the scalar calls were 5 of 35 ms of a step's attention at 8 rows x 1216 tokens.
inline v16 exp16(v16 x) {
    const v16 lo = v16{} - 87.0f;
    x = x < lo ? lo : x;
    const v16 n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
    const v16 r = x - n * 0.693359375f - n * -2.12194440e-4f;
    v16 p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const i16 bits = (__builtin_convertvector(n, i16) + 127) << 23;
    return p * as_float16(bits);
}

// bfloat16 is the top half of a float32: widening is a 16-bit shift (exact), narrowing rounds to
// nearest even exactly as torch's float -> bfloat16 cast does (a NaN becomes the quiet 0x7fc0),
// so a kernel that widens, computes in float32 and narrows where torch's bf16 ops round gives
// torch's bits. Plain integer vector ops: GCC lowers them to AVX-512 (or AVX2 pairs).
typedef unsigned short u16x16 __attribute__((vector_size(32)));
typedef unsigned short u16x16_mem __attribute__((vector_size(32), aligned(2), may_alias));
typedef unsigned int u32x16 __attribute__((vector_size(64)));

inline v16 widen_bf16(u16x16 h) {
    return reinterpret_cast<v16>(__builtin_convertvector(h, u32x16) << 16);
}

inline u16x16 narrow_bf16(v16 v) {
    const u32x16 u = reinterpret_cast<u32x16>(v);
    const u32x16 rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const u32x16 nan = reinterpret_cast<u32x16>(v != v);  // all ones where v is NaN
    return __builtin_convertvector((rounded & ~nan) | (0x7fc0u & nan), u16x16);
}

// v rounded to bfloat16 and widened back: the value a bf16 tensor would hold.
inline v16 round_bf16(v16 v) { return widen_bf16(narrow_bf16(v)); }

inline v16 load16(const c10::BFloat16* p) {
    return widen_bf16(*reinterpret_cast<const u16x16_mem*>(p));
}

inline void store16(c10::BFloat16* p, v16 v) {
    *reinterpret_cast<u16x16_mem*>(p) = narrow_bf16(v);
}

#ifdef __AVX512BF16__
#include <immintrin.h>

// bfloat16 dot products (vdpbf16ps): each float32 lane adds the two products of its lane's pair
// of bf16 values in a and b. A bf16 x bf16 product is exact in float32, so only the adds round:
// a dot product of bf16 values matches the widening path's to float32 rounding, at half the
// instructions and with no widening of either side.
typedef unsigned int u32_mem __attribute__((aligned(2), may_alias));

inline v16 dot_bf16(v16 acc, __m512i a, __m512i b) {
    return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(a), reinterpret_cast<__m512bh>(b));
}

// 32 bf16 values (a's) and another 32 (b's) interleaved into pairs: lo holds (a_i, b_i) for
// i < 16, hi for i >= 16. The pairs a P.V product wants: two keys' values of one column.
inline void interleave_bf16(__m512i a, __m512i b, __m512i& lo, __m512i& hi) {
    const __m512i i_lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9,
                                          40, 8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1,
                                          32, 0);
    const __m512i i_hi = _mm512_add_epi16(i_lo, _mm512_set1_epi16(16));
    lo = _mm512_permutex2var_epi16(a, i_lo, b);
    hi = _mm512_permutex2var_epi16(a, i_hi, b);
}

// Two keys' probabilities (16 lanes each) rounded to bf16 (to nearest even, as torch rounds) and
// paired per lane: (p0_i, p1_i), the a operand of a P.V product.
inline __m512i pair_bf16(v16 p0, v16 p1) {
    const __m512i packed = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(p1, p0));  // p0s, p1s
    const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                         24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                         16, 0);
    return _mm512_permutexvar_epi16(idx, packed);
}
#endif
