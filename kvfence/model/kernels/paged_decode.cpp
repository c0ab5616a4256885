// Decode attention straight from the paged KV pool: one query token per sequence, every K/V row
// read once, in place, from the sequence's own pages. No gathered copy of the context is made, and
// no slot outside [window start, context length) of a row's page table is ever touched, so a
// page's stale tail (or another grant's data) is never read, not even to be masked out.
//
// q [B, H, D], k_cache / v_cache [slots, KVH, D] (one layer), page_table [B, P] int64,
// ctx_lens [B] int64. Returns [B, H, D]. Accumulates in float32 for every cache dtype.
#include <torch/extension.h>
#include <ATen/Parallel.h>

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

template <typename T>
void decode_kernel(const T* q, const T* kc, const T* vc, const int64_t* pt, const int64_t* ctx,
                   T* out, int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t P,
                   int64_t page_size, float scale, int64_t window) {
    // A job is one sequence and a range of its KV heads. A slot's K (and V) row holds every KV
    // head, KVH * D contiguous values, and a page is page_size such rows back to back, so a job
    // with all heads streams whole pages; small batches split by head to keep every core busy.
    const int64_t G = H / KVH;  // query heads per KV head
    const int64_t row = KVH * D;  // values per slot in the cache
    const int64_t per_b = B < 4 * at::get_num_threads() ? KVH : 1;  // jobs per sequence
    const int64_t heads = KVH / per_b;
    int64_t max_ctx = 0;
    for (int64_t b = 0; b < B; ++b) max_ctx = std::max(max_ctx, ctx[b]);
    at::parallel_for(0, B * per_b, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> scores(H * std::max<int64_t>(max_ctx, 1));
        std::vector<float> qf(H * D), acc(H * D), inv(H);
        for (int64_t job = begin; job < end; ++job) {
            const int64_t b = job / per_b, h0 = (job % per_b) * heads, h1 = h0 + heads;
            const int64_t n = ctx[b];
            const int64_t t0 = window > 0 ? std::max<int64_t>(0, n - window) : 0;
            const int64_t len = n - t0;
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
                float* s = &scores[qh * len];
                float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
                for (int64_t i = 0; i < len; ++i) m = std::max(m, s[i]);
                float z = 0.f;
                int64_t i = 0;
                v16 zv = {};
                for (; i + 16 <= len; i += 16) {
                    const v16 e = exp16(load16(s + i) - m);
                    store16(s + i, e);
                    zv += e;
                }
                z = sum16(zv);
                for (; i < len; ++i) {
                    s[i] = std::exp(s[i] - m);
                    z += s[i];
                }
                inv[qh] = 1.f / z;
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
                           double scale, int64_t window) {
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
                                static_cast<float>(scale), window);
    });
    return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    // The GIL is released while a kernel runs, as torch releases it for its own ops: the
    // server's event loop must keep streaming tokens while the engine thread computes.
    const auto nogil = py::call_guard<py::gil_scoped_release>();
    m.def("paged_decode", &paged_decode, nogil,
          "decode attention read in place from the paged KV pool");
}
