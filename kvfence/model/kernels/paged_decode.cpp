// Decode attention straight from the paged KV pool: one query token per sequence, every K/V row
// read once, in place, from the sequence's own pages. No gathered copy of the context is made, and
// no slot outside [window start, context length) of a row's page table is ever touched, so a
// page's stale tail (or another grant's data) is never read, not even to be masked out.
//
// q [B, H, D], k_cache / v_cache [slots, KVH, D] (one layer), page_table [B, P] int64,
// ctx_lens [B] int64. Returns [B, H, D]. Accumulates in float32 for every cache dtype; bf16 pages
// take the host's bf16 dot products where it has them (decode_job_bf16).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "claim.h"
#include "vec16.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

// Software prefetch of the slots this far ahead, into L2 only. The kernel is bound by memory,
// not arithmetic: two blocks ahead into L2 moves the most bytes per second. Into L1 (prefetcht0),
// a block ahead, as before, the prefetches stall on the few L1 miss buffers and the kernel
// reached 10-11 GB/s where a plain streaming read gets 26; this gets 14-15, 20-33% less time
// (benchmarks/RESULTS.md "Kernels").
constexpr int64_t PREFETCH_SLOTS = 32;

inline void prefetch_l2(const void* p) { __builtin_prefetch(p, 0, 1); }

template <typename T>
inline float dot(const float* q, const T* k, int64_t d) {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < d; ++i) s += q[i] * static_cast<float>(k[i]);
    return s;
}

template <typename T>
inline void axpy(float a, const T* x, float* y, int64_t d) {
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) y[i] += a * static_cast<float>(x[i]);
}

// head_dim % 16 == 0: scores for 16 slots at a time, each a 16-lane partial sum
// (vec16.h), then one transpose-and-add tree instead of 16 horizontal reductions:
// out lane i = the sum of p[i]'s 16 lanes.
inline v16 reduce16(const v16* p) {
    v16 r[8], s[4], u[2];
    const i16 lo1 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const i16 hi1 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    for (int k = 0; k < 8; ++k)
        r[k] = __builtin_shuffle(p[2 * k], p[2 * k + 1], lo1) +
               __builtin_shuffle(p[2 * k], p[2 * k + 1], hi1);
    const i16 lo2 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
    const i16 hi2 = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
    for (int k = 0; k < 4; ++k)
        s[k] = __builtin_shuffle(r[2 * k], r[2 * k + 1], lo2) +
               __builtin_shuffle(r[2 * k], r[2 * k + 1], hi2);
    const i16 lo3 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
    const i16 hi3 = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
    for (int k = 0; k < 2; ++k)
        u[k] = __builtin_shuffle(s[2 * k], s[2 * k + 1], lo3) +
               __builtin_shuffle(s[2 * k], s[2 * k + 1], hi3);
    const i16 lo4 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
    const i16 hi4 = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
    return __builtin_shuffle(u[0], u[1], lo4) + __builtin_shuffle(u[0], u[1], hi4);
}

inline float sum16(v16 v) {
    float s = 0.f;
    for (int i = 0; i < 16; ++i) s += v[i];
    return s;
}

// Softmax's numerators over one head's scores s[0, len), in place: exp(s - max s); returns their
// sum. With pb, each is also written to pb rounded to bf16, as P.V's bf16 dot products take it.
inline float exp_row(float* s, int64_t len, unsigned short* pb) {
    // The max in vectors (GCC leaves the scalar loop scalar, omp simd or not: it was a third of
    // this function's time). A max is exact in any order, so m is the scalar loop's m.
    v16 mv = v16{} - std::numeric_limits<float>::infinity();
    int64_t i = 0;
    for (; i + 16 <= len; i += 16) {
        const v16 x = load16(s + i);
        mv = mv > x ? mv : x;
    }
    float m = -std::numeric_limits<float>::infinity();
    for (int k = 0; k < 16; ++k) m = std::max(m, mv[k]);
    for (; i < len; ++i) m = std::max(m, s[i]);
    float z = 0.f;
    i = 0;
    v16 zv = {};
    for (; i + 16 <= len; i += 16) {
        const v16 e = exp16(load16(s + i) - m);
        store16(s + i, e);
        if (pb) *reinterpret_cast<u16x16_mem*>(pb + i) = narrow_bf16(e);
        zv += e;
    }
    z = sum16(zv);
    for (; i < len; ++i) {
        s[i] = std::exp(s[i] - m);
        if (pb) pb[i] = c10::BFloat16(s[i]).x;
        z += s[i];
    }
    return z;
}

// P.V for the query heads [qh0, qh0 + gb) of KV head h, gb <= GB: the GB x NV
// accumulators stay in registers while each V row segment is loaded once.
template <int NV, int GB, typename T>
inline void pv_block(const T* vc, const int64_t* pages, int64_t page_size, int64_t row,
                     int64_t t0, int64_t n, int64_t h, int64_t qh0, int gb, const float* scores,
                     int64_t len, float* acc) {
    constexpr int D = NV * 16;
    v16 a[GB][NV] = {};
    for (int64_t t = t0; t < n; ++t) {
        const T* vr = vc + (pages[t / page_size] * page_size + t % page_size) * row + h * D;
        if (t + PREFETCH_SLOTS < n) {
            const int64_t ahead = t + PREFETCH_SLOTS;
            const T* r = vc + (pages[ahead / page_size] * page_size + ahead % page_size) * row;
            for (int j = 0; j < NV; ++j) prefetch_l2(r + h * D + 16 * j);
        }
        v16 v[NV];
        for (int j = 0; j < NV; ++j) v[j] = load16(vr + 16 * j);
        for (int g = 0; g < GB; ++g) {
            if (g >= gb) break;
            const float p = scores[(qh0 + g) * len + (t - t0)];
            for (int j = 0; j < NV; ++j) a[g][j] += p * v[j];
        }
    }
    for (int g = 0; g < gb; ++g)
        for (int j = 0; j < NV; ++j) store16(acc + (qh0 + g) * D + 16 * j, a[g][j]);
}

template <int NV, int GB, typename T>
void pv_heads(const T* vc, const int64_t* pages, int64_t page_size, int64_t row, int64_t t0,
              int64_t n, int64_t h0, int64_t h1, int64_t G, const float* scores, int64_t len,
              float* acc) {
    for (int64_t h = h0; h < h1; ++h)
        for (int64_t g = 0; g < G; g += GB)
            pv_block<NV, GB, T>(vc, pages, page_size, row, t0, n, h, h * G + g,
                             static_cast<int>(std::min<int64_t>(GB, G - g)), scores, len, acc);
}

// Caches the vector paths read (vec16.h loads either, widening bf16 to float32 exactly); a
// float16 cache takes the scalar loops.
template <typename T>
constexpr bool kVectorCache =
    std::is_same<T, float>::value || std::is_same<T, c10::BFloat16>::value;

#ifdef __AVX512BF16__
// bf16 pages with the host's bf16 dot products (vec16.h), as transformers' bf16 attention
// computes: Q.K of the bf16 values as they are (the scale multiplies the float32 score, so Q is
// not rounded again), the probabilities rounded to bf16 for P.V, every sum in float32. A K row
// and a query row are both [D] contiguous, so their pairs (d, d + 1) line up as they lie; P.V
// pairs two slots, so each pair of V rows is interleaved in registers as it is loaded, once
// for all the query heads that share it.
constexpr int64_t kDotMaxD = 128;  // P.V's accumulators stay in registers up to this head size

// P.V for the query heads [qh0, qh0 + gb) of KV head h, gb <= GB, D = 32 NV2: probs holds each
// head's probabilities as bf16, slot pairs per 32-bit word, `words` words per head.
template <int NV2, int GB>
inline void pv_block_bf16(const c10::BFloat16* vc, const int64_t* pages, int64_t page_size,
                          int64_t row, int64_t t0, int64_t n, int64_t h, int64_t qh0, int gb,
                          const u32_mem* probs, int64_t words, float* acc) {
    constexpr int D = NV2 * 32;
    v16 a[GB][2 * NV2] = {};
    auto at = [&](int64_t t) {
        return vc + (pages[t / page_size] * page_size + t % page_size) * row + h * D;
    };
    for (int64_t t = t0; t < n; t += 2) {
        const c10::BFloat16* v0 = at(t);
        const c10::BFloat16* v1 = t + 1 < n ? at(t + 1) : nullptr;  // never past the context
        for (int64_t ahead = t + PREFETCH_SLOTS; ahead < std::min(t + PREFETCH_SLOTS + 2, n);
             ++ahead)
            for (int j = 0; j < NV2; ++j) prefetch_l2(at(ahead) + 32 * j);
        __m512i w[2 * NV2];
        for (int j = 0; j < NV2; ++j)
            interleave_bf16(_mm512_loadu_si512(v0 + 32 * j),
                            v1 ? _mm512_loadu_si512(v1 + 32 * j) : __m512i{}, w[2 * j],
                            w[2 * j + 1]);
        for (int g = 0; g < GB; ++g) {
            if (g >= gb) break;
            const __m512i p = _mm512_set1_epi32(
                static_cast<int>(probs[(qh0 + g) * words + (t - t0) / 2]));
            for (int j = 0; j < 2 * NV2; ++j) a[g][j] = dot_bf16(a[g][j], p, w[j]);
        }
    }
    for (int g = 0; g < gb; ++g)
        for (int j = 0; j < 2 * NV2; ++j) store16(acc + (qh0 + g) * D + 16 * j, a[g][j]);
}

template <int NV2>
void pv_heads_bf16(const c10::BFloat16* vc, const int64_t* pages, int64_t page_size, int64_t row,
                   int64_t t0, int64_t n, int64_t h0, int64_t h1, int64_t G, const u32_mem* probs,
                   int64_t words, float* acc) {
    constexpr int GB = NV2 <= 2 ? 4 : 2;
    for (int64_t h = h0; h < h1; ++h)
        for (int64_t g = 0; g < G; g += GB)
            pv_block_bf16<NV2, GB>(vc, pages, page_size, row, t0, n, h, h * G + g,
                                   static_cast<int>(std::min<int64_t>(GB, G - g)), probs, words,
                                   acc);
}

// One job (row b, KV heads [h0, h1)) of decode_kernel for bf16 pages, D % 32 == 0, D <= 128.
void decode_job_bf16(const c10::BFloat16* q, const c10::BFloat16* kc, const c10::BFloat16* vc,
                     const int64_t* pages, int64_t n, int64_t t0, int64_t b, int64_t h0,
                     int64_t h1, int64_t H, int64_t G, int64_t D, int64_t row,
                     int64_t page_size, float scale, float* scores, unsigned short* probs,
                     float* acc, float* inv, c10::BFloat16* out) {
    const int64_t len = n - t0, words = (len + 1) / 2, nc = D / 32;
    const c10::BFloat16* qb = q + b * H * D;
    auto slot_row = [&](int64_t t) {
        return kc + (pages[t / page_size] * page_size + t % page_size) * row;
    };
    int64_t t = t0;
    v16 part[16];
    const c10::BFloat16* rows[16];
    for (; t < n; t += 16) {
        const int m = static_cast<int>(std::min<int64_t>(16, n - t));
        for (int i = 0; i < m; ++i) rows[i] = slot_row(t + i);
        const int64_t ahead = t + PREFETCH_SLOTS;
        for (int64_t i = ahead; i < std::min(ahead + 16, n); ++i)
            for (int64_t c = 0; c < (h1 - h0) * D; c += 32) prefetch_l2(slot_row(i) + h0 * D + c);
        for (int64_t h = h0; h < h1; ++h)
            for (int64_t qh = h * G; qh < (h + 1) * G; ++qh) {
                __m512i qv[kDotMaxD / 32];
                for (int64_t c = 0; c < nc; ++c) qv[c] = _mm512_loadu_si512(qb + qh * D + 32 * c);
                for (int i = 0; i < m; ++i) {
                    const c10::BFloat16* kr = rows[i] + h * D;
                    v16 s = {};
                    for (int64_t c = 0; c < nc; ++c)
                        s = dot_bf16(s, qv[c], _mm512_loadu_si512(kr + 32 * c));
                    part[i] = s;
                }
                float* dst = &scores[qh * len + (t - t0)];
                if (m == 16)
                    store16(dst, reduce16(part) * scale);
                else
                    for (int i = 0; i < m; ++i) dst[i] = sum16(part[i]) * scale;
            }
    }
    for (int64_t qh = h0 * G; qh < h1 * G; ++qh) {
        unsigned short* p = &probs[qh * 2 * words];
        const float z = exp_row(&scores[qh * len], len, p);
        if (len % 2) p[len] = 0;  // a lone last slot's partner
        inv[qh] = 1.f / z;
    }
    const u32_mem* pw = reinterpret_cast<const u32_mem*>(probs);
    constexpr decltype(&pv_heads_bf16<1>) pv[] = {pv_heads_bf16<1>, pv_heads_bf16<2>,
                                                  pv_heads_bf16<3>, pv_heads_bf16<4>};
    pv[nc - 1](vc, pages, page_size, row, t0, n, h0, h1, G, pw, words, acc);
    c10::BFloat16* o = out + b * H * D;
    for (int64_t qh = h0 * G; qh < h1 * G; ++qh)
        for (int64_t i = 0; i < D; ++i)
            o[qh * D + i] = static_cast<c10::BFloat16>(acc[qh * D + i] * inv[qh]);
}
#endif

template <typename T>
void decode_kernel(const T* q, const T* kc, const T* vc, const int64_t* pt, const int64_t* ctx,
                   T* out, int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t P,
                   int64_t page_size, float scale, int64_t window, bool widen) {
    // A job is one sequence and a range of its KV heads. A slot's K (and V) row holds every KV
    // head, KVH * D contiguous values, and a page is page_size such rows back to back, so a job
    // with all heads streams whole pages; small batches split by head to keep every core busy.
    const int64_t G = H / KVH;  // query heads per KV head
    const int64_t row = KVH * D;  // values per slot in the cache
    const int64_t per_b = B < 4 * at::get_num_threads() ? KVH : 1;  // jobs per sequence
    const int64_t heads = KVH / per_b;
    int64_t max_ctx = 0;
    for (int64_t b = 0; b < B; ++b) max_ctx = std::max(max_ctx, ctx[b]);
    // Jobs are claimed one at a time (claim.h): a thread that loses its core holds back one
    // row's attention, not half the batch's.
    parallel_claim(B * per_b, 1, [&](Claim& claim) {
        std::vector<float> scores(H * std::max<int64_t>(max_ctx, 1));
        std::vector<float> qf(H * D), acc(H * D), inv(H);
#ifdef __AVX512BF16__
        constexpr bool bf16 = std::is_same<T, c10::BFloat16>::value;
        const bool use_dot = bf16 && !widen && D % 32 == 0 && D <= kDotMaxD;
        std::vector<unsigned short> probs(use_dot ? H * (max_ctx + 1) : 0);
#endif
        for (int64_t job = 0, end = 0; claim(job, end);) {
            const int64_t b = job / per_b, h0 = (job % per_b) * heads, h1 = h0 + heads;
            const int64_t n = ctx[b];
            const int64_t t0 = window > 0 ? std::max<int64_t>(0, n - window) : 0;
            const int64_t len = n - t0;
#ifdef __AVX512BF16__
            if constexpr (bf16) {
                if (use_dot) {
                    decode_job_bf16(q, kc, vc, pt + b * P, n, t0, b, h0, h1, H, G, D, row,
                                    page_size, scale, scores.data(), probs.data(), acc.data(),
                                    inv.data(), out);
                    continue;
                }
            }
#endif
            for (int64_t i = h0 * G * D; i < h1 * G * D; ++i)
                qf[i] = static_cast<float>(q[b * H * D + i]) * scale;
            const int64_t* pages = pt + b * P;
            int64_t t = t0;
            if constexpr (kVectorCache<T>) {
                if (D % 16 == 0) {
                    v16 part[16];
                    const T* rows[16];
                    for (; t + 16 <= n; t += 16) {
                        for (int i = 0; i < 16; ++i)
                            rows[i] = kc + (pages[(t + i) / page_size] * page_size +
                                            (t + i) % page_size) * row;
                        // Pages are scattered: start a later block's rows on their way now.
                        const int64_t ahead = t + PREFETCH_SLOTS;
                        for (int64_t i = ahead; i < std::min(ahead + 16, n); ++i) {
                            const T* r = kc + (pages[i / page_size] * page_size +
                                               i % page_size) * row + h0 * D;
                            for (int64_t c = 0; c < (h1 - h0) * D; c += 16) prefetch_l2(r + c);
                        }
                        for (int64_t h = h0; h < h1; ++h)
                            for (int64_t g = 0; g < G; ++g) {
                                const int64_t qh = h * G + g;
                                const float* qq = &qf[qh * D];
                                for (int i = 0; i < 16; ++i) {
                                    const T* kr = rows[i] + h * D;
                                    v16 acc = load16(qq) * load16(kr);
                                    for (int64_t j = 16; j < D; j += 16)
                                        acc += load16(qq + j) * load16(kr + j);
                                    part[i] = acc;
                                }
                                const v16 sc = reduce16(part);
                                store16(&scores[qh * len + (t - t0)], sc);
                            }
                    }
                }
            }
            for (; t < n; ++t) {
                const T* kr = kc + (pages[t / page_size] * page_size + t % page_size) * row;
                for (int64_t h = h0; h < h1; ++h)
                    for (int64_t g = 0; g < G; ++g) {
                        const int64_t qh = h * G + g;
                        scores[qh * len + (t - t0)] = dot(&qf[qh * D], kr + h * D, D);
                    }
            }
            for (int64_t qh = h0 * G; qh < h1 * G; ++qh) {
                inv[qh] = 1.f / exp_row(&scores[qh * len], len, nullptr);
            }
            bool pv_done = false;
            if constexpr (kVectorCache<T>) {
                if (D == 64 || D == 128) {  // the common head sizes get register-blocked P.V
                    (D == 64 ? pv_heads<4, 4, T> : pv_heads<8, 2, T>)(vc, pages, page_size, row, t0, n,
                                                               h0, h1, G, scores.data(), len,
                                                               acc.data());
                    pv_done = true;
                }
            }
            if (!pv_done) std::fill(acc.begin() + h0 * G * D, acc.begin() + h1 * G * D, 0.f);
            for (int64_t t = t0; t < n && !pv_done; ++t) {
                const T* vr = vc + (pages[t / page_size] * page_size + t % page_size) * row;
                for (int64_t h = h0; h < h1; ++h)
                    for (int64_t g = 0; g < G; ++g) {
                        const int64_t qh = h * G + g;
                        axpy(scores[qh * len + (t - t0)], vr + h * D, &acc[qh * D], D);
                    }
            }
            T* o = out + b * H * D;
            for (int64_t qh = h0 * G; qh < h1 * G; ++qh)
                for (int64_t i = 0; i < D; ++i)
                    o[qh * D + i] = static_cast<T>(acc[qh * D + i] * inv[qh]);
        }
    });
}

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor page_table, torch::Tensor ctx_lens, int64_t page_size,
                           double scale, int64_t window, bool widen) {
    TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3, "bad ranks");
    TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
                "q and caches must be contiguous");
    TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && k_cache.sizes() == v_cache.sizes(),
                "q/k/v dtype or shape mismatch");
    TORCH_CHECK(page_table.scalar_type() == at::kLong && ctx_lens.scalar_type() == at::kLong,
                "page_table and ctx_lens must be int64");
    const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KVH = k_cache.size(1);
    TORCH_CHECK(k_cache.size(2) == D && H % KVH == 0, "head shapes");
    TORCH_CHECK(page_table.size(0) == B && ctx_lens.size(0) == B, "batch shapes");
    auto pt = page_table.contiguous();
    auto ctx = ctx_lens.contiguous();
    const int64_t P = pt.size(1), slots = k_cache.size(0);
    const int64_t* ctx_p = ctx.data_ptr<int64_t>();
    const int64_t* pt_p = pt.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) {  // bounds: a bad table is an error, never a wild read
        TORCH_CHECK(ctx_p[b] >= 1 && (ctx_p[b] + page_size - 1) / page_size <= P,
                    "context longer than its page table");
        for (int64_t i = 0; i < (ctx_p[b] + page_size - 1) / page_size; ++i)
            TORCH_CHECK(pt_p[b * P + i] >= 0 && (pt_p[b * P + i] + 1) * page_size <= slots,
                        "page index out of the pool");
    }
    auto out = torch::empty_like(q);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
        decode_kernel<scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(),
                                v_cache.data_ptr<scalar_t>(), pt_p, ctx_p,
                                out.data_ptr<scalar_t>(), B, H, KVH, D, P, page_size,
                                static_cast<float>(scale), window, widen);
    });
    return out;
}

torch::Tensor paged_decode_dot(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                               torch::Tensor page_table, torch::Tensor ctx_lens,
                               int64_t page_size, double scale, int64_t window) {
    return paged_decode(q, k_cache, v_cache, page_table, ctx_lens, page_size, scale, window,
                        false);
}

// The path every host takes: bf16 widened to float32 (exact), kept callable where the bf16 dot
// products exist so that tests and benchmarks can hold the two against each other.
torch::Tensor paged_decode_widened(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                   torch::Tensor page_table, torch::Tensor ctx_lens,
                                   int64_t page_size, double scale, int64_t window) {
    return paged_decode(q, k_cache, v_cache, page_table, ctx_lens, page_size, scale, window,
                        true);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    // The GIL is released while a kernel runs, as torch releases it for its own ops: the
    // server's event loop must keep streaming tokens while the engine thread computes.
    const auto nogil = py::call_guard<py::gil_scoped_release>();
    m.def("paged_decode", &paged_decode_dot, nogil,
          "decode attention read in place from the paged KV pool");
    m.def("paged_decode_widened", &paged_decode_widened, nogil,
          "paged_decode with bf16 widened to float32 for every product, as hosts without bf16 "
          "dot products compute it");
}
