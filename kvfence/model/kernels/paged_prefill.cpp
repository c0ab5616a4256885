// Prefill attention straight from the paged KV pool. A row is a chunk of q_len new tokens, the
// last q_len of its ctx_len context tokens (a cached prefix and earlier chunks, then the chunk
// itself), whose queries attend causally over that context. Each job (a row, a KV head, a block of
// queries) streams the row's pages a tile of keys at a time, in place, with an online softmax:
// no gathered copy of the context and no [q_len, ctx_len] mask exist, and a job's scratch is a few
// tiles whatever the context's length. A job reads only slots [its first query's window start,
// its last query's position]: never a page's stale tail, never past the row's context.
//
// q [N, H, D]: row b's queries are q[q_starts[b] : q_starts[b] + q_lens[b]]. k_cache, v_cache
// [slots, KVH, D] (one layer); page_table [B, P], ctx_lens, q_starts, q_lens [B] int64. The
// answers are written to the same rows of out [N, H, D]; rows no b covers are left as they are.
// Every cache dtype is widened to float32 a tile at a time, and accumulates in float32.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "vec16.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <vector>

namespace {

constexpr int64_t KT = 64;  // keys per tile: four 16-lane vectors of scores per query
// Query vectors (tokens x the heads sharing a KV head) per job, at most: each key tile a job
// loads serves this many queries, so a long context's K/V is streamed from memory fewer times.
// Fewer when the batch would otherwise leave cores idle.
constexpr int64_t JOB_QUERIES = 128;

struct Job {
    int64_t row, head, first, last;  // queries [first, last) of the row, for KV head `head`
};

// S[r][0..KT) = Q[r] . Kt for MR query rows: Kt is the tile transposed ([D][KT]), so each step
// of d is four vector loads and MR broadcasts feeding 4 * MR fused multiply-adds.
template <int MR>
inline void qk_rows(const float* Q, int64_t D, const float* Kt, float* S) {
    v16 acc[MR][4] = {};
    for (int64_t d = 0; d < D; ++d) {
        v16 k[4];
        for (int j = 0; j < 4; ++j) k[j] = load16(Kt + d * KT + 16 * j);
        for (int r = 0; r < MR; ++r) {
            const float qv = Q[r * D + d];
            for (int j = 0; j < 4; ++j) acc[r][j] += qv * k[j];
        }
    }
    for (int r = 0; r < MR; ++r)
        for (int j = 0; j < 4; ++j) store16(S + r * KT + 16 * j, acc[r][j]);
}

// O[r][col, col + 16 NV) += P[r][0..n) . V[0..n)[col, ...) for MR query rows, the accumulators in
// registers while each V row segment is loaded once.
template <int MR, int NV>
inline void pv_rows(const float* P, const float* V, int64_t Dp, int64_t n, int64_t col, float* O) {
    v16 acc[MR][NV];
    for (int r = 0; r < MR; ++r)
        for (int j = 0; j < NV; ++j) acc[r][j] = load16(O + r * Dp + col + 16 * j);
    for (int64_t t = 0; t < n; ++t) {
        v16 v[NV];
        for (int j = 0; j < NV; ++j) v[j] = load16(V + t * Dp + col + 16 * j);
        for (int r = 0; r < MR; ++r) {
            const float p = P[r * KT + t];
            for (int j = 0; j < NV; ++j) acc[r][j] += p * v[j];
        }
    }
    for (int r = 0; r < MR; ++r)
        for (int j = 0; j < NV; ++j) store16(O + r * Dp + col + 16 * j, acc[r][j]);
}

template <int MR>
inline void pv_cols(const float* P, const float* V, int64_t Dp, int64_t n, float* O) {
    int64_t col = 0;
    for (; col + 64 <= Dp; col += 64) pv_rows<MR, 4>(P, V, Dp, n, col, O);
    switch ((Dp - col) / 16) {
        case 3: pv_rows<MR, 3>(P, V, Dp, n, col, O); break;
        case 2: pv_rows<MR, 2>(P, V, Dp, n, col, O); break;
        case 1: pv_rows<MR, 1>(P, V, Dp, n, col, O); break;
        default: break;
    }
}

void qk_tile(const float* Q, int64_t M, int64_t D, const float* Kt, float* S) {
    int64_t r = 0;
    for (; r + 4 <= M; r += 4) qk_rows<4>(Q + r * D, D, Kt, S + r * KT);
    for (; r < M; ++r) qk_rows<1>(Q + r * D, D, Kt, S + r * KT);
}

void pv_tile(const float* P, int64_t M, const float* V, int64_t Dp, int64_t n, float* O) {
    int64_t r = 0;
    for (; r + 4 <= M; r += 4) pv_cols<4>(P + r * KT, V, Dp, n, O + r * Dp);
    for (; r < M; ++r) pv_cols<1>(P + r * KT, V, Dp, n, O + r * Dp);
}

// Horizontal max and sum of 16 lanes: a shuffle tree, 4 steps deep instead of 15.
template <typename Op>
inline float reduce_lanes(v16 x, Op op) {
    const i16 by8 = {8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7};
    const i16 by4 = {4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11};
    const i16 by2 = {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13};
    const i16 by1 = {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14};
    x = op(x, __builtin_shuffle(x, by8));
    x = op(x, __builtin_shuffle(x, by4));
    x = op(x, __builtin_shuffle(x, by2));
    return op(x, __builtin_shuffle(x, by1))[0];
}

// One query's scores for a tile become probabilities, folded into its running max m, sum l
// and output row o (flash-style: o and l are rescaled when the max grows). Keys outside [a, e)
// (past the query, before its window, past the tile) get probability 0, in vector lanes.
inline void online_softmax(float* s, int64_t a, int64_t e, float& m, float& l, float* o,
                           int64_t Dp) {
    const v16 ninf = v16{} - std::numeric_limits<float>::infinity();
    const i16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const auto vmax = [](v16 x, v16 y) { return x > y ? x : y; };
    i16 keep[KT / 16];
    v16 sv[KT / 16], mx = ninf;
    for (int j = 0; j < KT / 16; ++j) {
        const i16 idx = lane + 16 * j;
        keep[j] = (idx >= static_cast<int>(a)) & (idx < static_cast<int>(e));
        sv[j] = keep[j] ? load16(s + 16 * j) : ninf;
        mx = vmax(mx, sv[j]);
    }
    const float m_new = std::max(m, reduce_lanes(mx, vmax));
    const float corr = std::exp(m - m_new);  // 0 on the first tile (m = -inf)
    m = m_new;
    v16 z = {};
    for (int j = 0; j < KT / 16; ++j) {
        const v16 p = keep[j] ? exp16(sv[j] - m_new) : v16{};
        store16(s + 16 * j, p);
        z += p;
    }
    l = l * corr + reduce_lanes(z, [](v16 x, v16 y) { return x + y; });
    if (corr != 1.f)
        for (int64_t d = 0; d < Dp; ++d) o[d] *= corr;
}

// One worker's scratch: sized by the job (queries x head size x tile), never by the context.
struct Scratch {
    std::vector<float> q, kt, v, s, o, m, l;
    Scratch(int64_t M, int64_t D, int64_t Dp)
        : q(M * D), kt(D * KT), v(KT * Dp), s(M * KT), o(M * Dp), m(M), l(M) {}
};

template <typename T>
void run_job(const Job& job, const T* q, const T* kc, const T* vc, const int64_t* pt,
             const int64_t* ctx, const int64_t* q_starts, const int64_t* q_lens, T* out,
             int64_t H, int64_t KVH, int64_t D, int64_t Dp, int64_t P, int64_t page_size,
             float scale, int64_t window, Scratch& w) {
    const int64_t G = H / KVH, row = KVH * D, b = job.row, h = job.head;
    const int64_t n_ctx = ctx[b], first_pos = n_ctx - q_lens[b];  // position of query 0
    const int64_t M = (job.last - job.first) * G;  // query vectors, token-major: m = i * G + g
    const int64_t* pages = pt + b * P;
    for (int64_t i = job.first; i < job.last; ++i)
        for (int64_t g = 0; g < G; ++g) {
            const T* src = q + ((q_starts[b] + i) * H + h * G + g) * D;
            float* dst = &w.q[((i - job.first) * G + g) * D];
            for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<float>(src[d]) * scale;
        }
    std::fill(w.o.begin(), w.o.begin() + M * Dp, 0.f);
    std::fill(w.m.begin(), w.m.begin() + M, -std::numeric_limits<float>::infinity());
    std::fill(w.l.begin(), w.l.begin() + M, 0.f);
    const int64_t last_pos = first_pos + job.last - 1;
    const int64_t lo = window > 0 ? std::max<int64_t>(0, first_pos + job.first - window + 1) : 0;
    for (int64_t t0 = lo; t0 <= last_pos; t0 += KT) {
        const int64_t n = std::min(KT, last_pos + 1 - t0);
        // The tile, widened to float32: K transposed for the score product, V row-major; the
        // lanes past n (or past D) are zero, so they add nothing.
        std::fill(w.kt.begin(), w.kt.end(), 0.f);
        std::fill(w.v.begin(), w.v.end(), 0.f);
        for (int64_t t = 0; t < n; ++t) {
            const int64_t pos = t0 + t;
            const int64_t slot = pages[pos / page_size] * page_size + pos % page_size;
            const T* kr = kc + slot * row + h * D;
            const T* vr = vc + slot * row + h * D;
            for (int64_t d = 0; d < D; ++d) w.kt[d * KT + t] = static_cast<float>(kr[d]);
            for (int64_t d = 0; d < D; ++d) w.v[t * Dp + d] = static_cast<float>(vr[d]);
        }
        qk_tile(w.q.data(), M, D, w.kt.data(), w.s.data());
        for (int64_t mi = 0; mi < M; ++mi) {
            float* s = &w.s[mi * KT];
            const int64_t pos = first_pos + job.first + mi / G;  // this query's position
            // Keys this query may see in the tile: causal, and inside its sliding window.
            const int64_t a = window > 0 ? std::max<int64_t>(0, pos - window + 1 - t0) : 0;
            const int64_t e = std::min(n, pos + 1 - t0);
            if (a >= e) {  // none: its probabilities here are all zero
                std::fill(s, s + KT, 0.f);
                continue;
            }
            online_softmax(s, a, e, w.m[mi], w.l[mi], &w.o[mi * Dp], Dp);
        }
        pv_tile(w.s.data(), M, w.v.data(), Dp, n, w.o.data());
    }
    for (int64_t i = job.first; i < job.last; ++i)
        for (int64_t g = 0; g < G; ++g) {
            const int64_t mi = (i - job.first) * G + g;
            const float inv = 1.f / w.l[mi];
            T* dst = out + ((q_starts[b] + i) * H + h * G + g) * D;
            for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(w.o[mi * Dp + d] * inv);
        }
}

template <typename T>
void prefill_kernel(const T* q, const T* kc, const T* vc, const int64_t* pt, const int64_t* ctx,
                    const int64_t* q_starts, const int64_t* q_lens, T* out, int64_t B, int64_t H,
                    int64_t KVH, int64_t D, int64_t P, int64_t page_size, float scale,
                    int64_t window) {
    const int64_t G = H / KVH, Dp = (D + 15) / 16 * 16;
    int64_t per_job = std::max<int64_t>(1, JOB_QUERIES / G);  // query tokens per job
    auto count = [&](int64_t n) {
        int64_t c = 0;
        for (int64_t b = 0; b < B; ++b) c += (q_lens[b] + n - 1) / n * KVH;
        return c;
    };
    while (per_job > 8 && count(per_job) < 4 * at::get_num_threads()) per_job /= 2;
    std::vector<Job> jobs;
    for (int64_t b = 0; b < B; ++b)
        for (int64_t i = 0; i < q_lens[b]; i += per_job)
            for (int64_t h = 0; h < KVH; ++h)
                jobs.push_back({b, h, i, std::min(q_lens[b], i + per_job)});
    // Later queries see more keys: the longest jobs go first, and workers take the next job as
    // they finish one, so a causal chunk's uneven jobs still keep every core busy to the end.
    auto keys = [&](const Job& j) {
        const int64_t last = ctx[j.row] - q_lens[j.row] + j.last;
        return window > 0 ? std::min(last, window + j.last - j.first) : last;
    };
    std::stable_sort(jobs.begin(), jobs.end(),
                     [&](const Job& x, const Job& y) { return keys(x) > keys(y); });
    std::atomic<int64_t> next{0};
    const int64_t n_jobs = static_cast<int64_t>(jobs.size());
    const int64_t workers = std::min<int64_t>(at::get_num_threads(), n_jobs);
    at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
        Scratch w(per_job * G, D, Dp);
        for (int64_t unused = begin; unused < end; ++unused)
            for (int64_t j = next++; j < n_jobs; j = next++)
                run_job<T>(jobs[j], q, kc, vc, pt, ctx, q_starts, q_lens, out, H, KVH, D, Dp, P,
                           page_size, scale, window, w);
    });
}

void paged_prefill(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                   torch::Tensor page_table, torch::Tensor ctx_lens, torch::Tensor q_starts,
                   torch::Tensor q_lens, int64_t page_size, double scale, int64_t window,
                   torch::Tensor out) {
    TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3, "bad ranks");
    TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                    out.is_contiguous(),
                "q, caches and out must be contiguous");
    TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && k_cache.sizes() == v_cache.sizes() &&
                    out.scalar_type() == q.scalar_type() && out.sizes() == q.sizes(),
                "q/k/v/out dtype or shape mismatch");
    for (const auto& t : {page_table, ctx_lens, q_starts, q_lens})
        TORCH_CHECK(t.scalar_type() == at::kLong, "page_table and lengths must be int64");
    const int64_t N = q.size(0), H = q.size(1), D = q.size(2), KVH = k_cache.size(1);
    const int64_t B = page_table.size(0);
    TORCH_CHECK(k_cache.size(2) == D && H % KVH == 0, "head shapes");
    TORCH_CHECK(ctx_lens.size(0) == B && q_starts.size(0) == B && q_lens.size(0) == B,
                "batch shapes");
    auto pt = page_table.contiguous();
    auto ctx = ctx_lens.contiguous(), qs = q_starts.contiguous(), ql = q_lens.contiguous();
    const int64_t P = pt.size(1), slots = k_cache.size(0);
    const int64_t *ctx_p = ctx.data_ptr<int64_t>(), *pt_p = pt.data_ptr<int64_t>();
    const int64_t *qs_p = qs.data_ptr<int64_t>(), *ql_p = ql.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) {  // bounds: a bad table is an error, never a wild read
        TORCH_CHECK(ql_p[b] >= 1 && ctx_p[b] >= ql_p[b], "a row needs 1 <= q_len <= ctx_len");
        TORCH_CHECK(qs_p[b] >= 0 && qs_p[b] + ql_p[b] <= N, "a row's queries are outside q");
        TORCH_CHECK((ctx_p[b] + page_size - 1) / page_size <= P,
                    "context longer than its page table");
        for (int64_t i = 0; i < (ctx_p[b] + page_size - 1) / page_size; ++i)
            TORCH_CHECK(pt_p[b * P + i] >= 0 && (pt_p[b * P + i] + 1) * page_size <= slots,
                        "page index out of the pool");
    }
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_prefill", [&] {
        prefill_kernel<scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(),
                                 v_cache.data_ptr<scalar_t>(), pt_p, ctx_p, qs_p, ql_p,
                                 out.data_ptr<scalar_t>(), B, H, KVH, D, P, page_size,
                                 static_cast<float>(scale), window);
    });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    // The GIL is released while a kernel runs, as torch releases it for its own ops.
    const auto nogil = py::call_guard<py::gil_scoped_release>();
    m.def("paged_prefill", &paged_prefill, nogil,
          "prefill-chunk attention read in place from the paged KV pool, written into out");
}
