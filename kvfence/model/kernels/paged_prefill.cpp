// Prefill attention straight from the paged KV pool. A row is a chunk of q_len new tokens, the
// last q_len of its ctx_len context tokens (a cached prefix and earlier chunks, then the chunk
// itself), whose queries attend causally over that context. Each job (a row, a KV head, a block
// of tokens with every query head sharing that KV head) streams the row's pages a tile of keys at
// a time, in place, with an online softmax: no gathered copy of the context and no
// [q_len, ctx_len] mask exist, and a job's scratch is a few tiles whatever the context's length.
// A job reads only slots [its first query's window start, its last query's position]: never a
// page's stale tail, never past the row's context.
//
// A job's queries lie in vector lanes (transposed once per job), so a tile's scores are computed
// keys x query lanes with each key's elements broadcast straight from its page, the softmax's
// max and sum run down the keys lane by lane (no horizontal reductions), and the output adds
// probabilities x V rows read from their pages too: a float32 tile is never copied. bf16 pages
// take the host's bf16 dot products where it has them (run_job_bf16, whose K rows are read in
// place too); other cache dtypes, and bf16 elsewhere, are widened to float32 a tile at a time
// (rows, never transposed). Every product accumulates in float32.
//
// q [N, H, D]: row b's queries are q[q_starts[b] : q_starts[b] + q_lens[b]]. k_cache, v_cache
// [slots, KVH, D] (one layer); page_table [B, P], ctx_lens, q_starts, q_lens [B] int64. The
// answers are written to the same rows of out [N, H, D]; rows no b covers are left as they are.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "vec16.h"

#include <algorithm>
#include <atomic>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t KT = 128;  // keys per tile
constexpr int64_t QB = 48;  // query lanes per block: three vectors (16 tokens x 3 heads of GQA)
constexpr int NK = 8;       // keys per score microkernel: 8 x 3 accumulators
constexpr int MR = 6;       // query rows per output microkernel: 6 x 4 accumulators
// Query vectors (tokens x the heads sharing a KV head) per job, at most: each key tile a job
// reads serves this many queries. Fewer when the batch would otherwise leave cores idle.
constexpr int64_t JOB_QUERIES = 384;
// A finite floor for scores no query may see and for the running max before any key: 2^ of a
// difference of floors is 1 and of a floor minus a score is exp2_16's clamp (it then rescales a
// zero output and sum), never NaN; a floored score's probability is set to 0 outright.
constexpr float FLOOR = -1e30f;

struct Job {
    int64_t row, head, first, last;  // tokens [first, last) of the row, for KV head `head`
};

// N keys' scores for a block's lanes, acc[key][lanes / 16], into S: where MASKED, a score whose
// key the lane may not see (past its position, before its window) is stored as FLOOR. mx gathers
// each lane's max over the first `rows` keys (the others lie past the tile).
template <int N, bool MASKED>
inline void store_scores(const v16 (&acc)[N][3], float* S, int64_t key0, const float* pos,
                         const float* lo, int64_t rows, v16* mx) {
    const v16 floor = v16{} + FLOOR;
    for (int j = 0; j < 3; ++j) {
        v16 pv = {}, lv = {};
        if (MASKED) {
            pv = load16(pos + 16 * j);
            lv = load16(lo + 16 * j);
        }
        for (int i = 0; i < N; ++i) {
            v16 s = acc[i][j];
            if (MASKED) {
                const v16 key = v16{} + static_cast<float>(key0 + i);
                s = (key <= pv) & (key >= lv) ? s : floor;
            }
            store16(S + i * QB + 16 * j, s);
            if (i < rows) mx[j] = mx[j] > s ? mx[j] : s;
        }
    }
}

// S[k][lane] = K_k . Q[lane] for N keys (key0, key0 + 1, ...) and one block's 48 query lanes:
// per element d, three vector loads of the transposed queries and N broadcasts of the keys'
// d-th elements (read where the keys lie) feed 3 N fused multiply-adds.
template <int N, bool MASKED>
inline void scores(const float* const* kp, const float* qt, int64_t D, float* S, int64_t key0,
                   const float* pos, const float* lo, int64_t rows, v16* mx) {
    const float* k[N];
    for (int i = 0; i < N; ++i) k[i] = kp[i];
    v16 acc[N][3] = {};
    for (int64_t d = 0; d < D; ++d) {
        const v16 q0 = load16(qt + d * QB), q1 = load16(qt + d * QB + 16),
                  q2 = load16(qt + d * QB + 32);
        for (int i = 0; i < N; ++i) {
            const float kv = k[i][d];
            acc[i][0] += kv * q0;
            acc[i][1] += kv * q1;
            acc[i][2] += kv * q2;
        }
    }
    store_scores<N, MASKED>(acc, S, key0, pos, lo, rows, mx);
}

// O[r][col, col + 16 NV) = O[r][...] * corr[r] + sum_t P[t][r] V_t[col, ...) for MR query rows:
// the accumulators stay in registers while each V row segment is loaded once, from its page.
template <int NV>
inline void outputs(const float* P, const float* const* vp, int64_t n, int64_t col,
                    const float* corr, float* O, int64_t Dp) {
    v16 acc[MR][NV];
    for (int r = 0; r < MR; ++r)
        for (int j = 0; j < NV; ++j) acc[r][j] = load16(O + r * Dp + col + 16 * j) * corr[r];
    for (int64_t t = 0; t < n; ++t) {
        v16 v[NV];
        for (int j = 0; j < NV; ++j) v[j] = load16(vp[t] + col + 16 * j);
        for (int r = 0; r < MR; ++r) {
            const float p = P[t * QB + r];
            for (int j = 0; j < NV; ++j) acc[r][j] += p * v[j];
        }
    }
    for (int r = 0; r < MR; ++r)
        for (int j = 0; j < NV; ++j) store16(O + r * Dp + col + 16 * j, acc[r][j]);
}

inline void outputs_rows(const float* P, const float* const* vp, int64_t n, const float* corr,
                         float* O, int64_t Dp) {
    int64_t col = 0;
    for (; col + 64 <= Dp; col += 64) outputs<4>(P, vp, n, col, corr, O, Dp);
    switch ((Dp - col) / 16) {
        case 3: outputs<3>(P, vp, n, col, corr, O, Dp); break;
        case 2: outputs<2>(P, vp, n, col, corr, O, Dp); break;
        case 1: outputs<1>(P, vp, n, col, corr, O, Dp); break;
        default: break;
    }
}

// 2^x on 16 lanes for softmax's x <= 0 (scores are in base-2 units: log2(e) is folded into the
// query scale). Cheaper than exp16 by the reduction's multiplies: rounding x to an integer n
// with the 1.5 * 2^23 trick leaves n in the sum's low bits (no conversion), r = x - n is exact,
// and 2^r on [-1/2, 1/2] is its degree-6 Taylor series (relative error < 1e-7). Below -126 the
// result is clamped to 2^-126, which a sum holding 2^0 = 1 cannot tell from 0.
inline v16 exp2_16(v16 x) {
    const v16 lo = v16{} - 126.0f;
    x = x < lo ? lo : x;
    const v16 t = x + 12582912.0f;
    const v16 r = x - (t - 12582912.0f);
    v16 p = r * 1.5403530393e-4f + 1.3333558146e-3f;
    p = p * r + 9.6181291076e-3f;
    p = p * r + 5.5504108665e-2f;
    p = p * r + 2.4022650696e-1f;
    p = p * r + 6.9314718056e-1f;
    p = p * r + 1.0f;
    const i16 bits = (reinterpret_cast<i16>(t) - (0x4B400000 - 127)) << 23;
    return p * as_float16(bits);
}

// A block's lanes fold one tile's scores (their maxima mx) into their running max m and sum l:
// corr holds each lane's rescale of its earlier output, and probs(j, m_new) turns the scores of
// lanes [16 j, 16 j + 16) into probabilities where P.V reads them and returns their sum.
template <typename Probs>
inline void fold_tile(const v16* mx, float* m, float* l, float* corr, Probs probs) {
    for (int j = 0; j < 3; ++j) {
        const v16 m_old = load16(m + 16 * j);
        const v16 m_new = m_old > mx[j] ? m_old : mx[j];
        const v16 c = exp2_16(m_old - m_new);
        store16(corr + 16 * j, c);
        const v16 z = probs(j, m_new);
        store16(m + 16 * j, m_new);
        store16(l + 16 * j, load16(l + 16 * j) * c + z);
    }
}

// The probability of score s: 0 where a key is masked.
inline v16 prob(v16 s, v16 m_new, bool masked) {
    const v16 p = exp2_16(s - m_new);
    return masked ? (s > v16{} + FLOOR ? p : v16{}) : p;
}

// fold_tile with the probabilities in place of the scores.
inline void softmax_block(float* S, int64_t n, bool masked, const v16* mx, float* m, float* l,
                          float* corr) {
    fold_tile(mx, m, l, corr, [&](int j, v16 m_new) {
        v16 z = {};
        for (int64_t t = 0; t < n; ++t) {
            const v16 p = prob(load16(S + t * QB + 16 * j), m_new, masked);
            store16(S + t * QB + 16 * j, p);
            z += p;
        }
        return z;
    });
}

// A job's scratch and steps, one type per path (Widened here, Pairs for bf16 dot products); run_job
// walks the tiles and blocks for either. Sized by the job (queries x head size x tile), never
// by the context. pos and lo: each lane's position and window start, as floats (exact below
// 2^24 tokens) for the masks' lane-wise compares.
struct Widened {
    std::vector<float> qt, o, m, l, s, corr, kbuf, vbuf, zeros, pos, lo;
    std::vector<const float*> kp, vp;
    int64_t D, Dp;
    Widened(int64_t Mp, int64_t D, int64_t Dp)
        : qt(Mp * D), o(Mp * Dp), m(Mp), l(Mp), s(KT * QB), corr(QB), kbuf(KT * D),
          vbuf(KT * Dp, 0.f), zeros(Dp, 0.f), pos(Mp), lo(Mp), kp(KT), vp(KT), D(D), Dp(Dp) {}

    // Lane mi's query, transposed into its block and scaled; a padding lane's (src null) is 0.
    template <typename T>
    void query(int64_t mi, const T* src, float qscale) {
        float* dst = &qt[(mi / QB) * D * QB + mi % QB];
        if (src)
            for (int64_t d = 0; d < D; ++d) dst[d * QB] = static_cast<float>(src[d]) * qscale;
        else
            for (int64_t d = 0; d < D; ++d) dst[d * QB] = 0.f;
    }

    // Key t (< n) of the tile: float32 rows are read in place, others widened (V rows also
    // where they must be padded to whole vectors).
    template <typename T>
    void key(int64_t t, int64_t, const T* kr, const T* vr) {
        constexpr bool in_place = std::is_same<T, float>::value;
        if constexpr (in_place) {
            kp[t] = kr;
        } else {
            float* kd = &kbuf[t * D];
            for (int64_t d = 0; d < D; ++d) kd[d] = static_cast<float>(kr[d]);
            kp[t] = kd;
        }
        if (in_place && D == Dp) {
            vp[t] = reinterpret_cast<const float*>(vr);
        } else {
            float* vd = &vbuf[t * Dp];
            for (int64_t d = 0; d < D; ++d) vd[d] = static_cast<float>(vr[d]);
            vp[t] = vd;
        }
    }

    void past(int64_t t) { kp[t] = zeros.data(); }  // score rows past the tile read zeros

    // Block qb's lanes over the tile's n keys from key t0 (its queries are scaled already).
    void block(int64_t qb, int64_t n, int64_t t0, bool masked, float) {
        const float* p = &pos[qb * QB];
        const float* lv = &lo[qb * QB];
        float* S = s.data();
        const float* q = &qt[qb * D * QB];
        v16 mx[3] = {v16{} + FLOOR, v16{} + FLOOR, v16{} + FLOOR};
        for (int64_t k = 0; k < n; k += NK) {
            if (masked)
                scores<NK, true>(&kp[k], q, D, S + k * QB, t0 + k, p, lv, n - k, mx);
            else
                scores<NK, false>(&kp[k], q, D, S + k * QB, t0 + k, p, lv, n - k, mx);
        }
        softmax_block(S, n, masked, mx, &m[qb * QB], &l[qb * QB], corr.data());
        for (int64_t r = 0; r < QB; r += MR)
            outputs_rows(S + r, vp.data(), n, &corr[r], &o[(qb * QB + r) * Dp], Dp);
    }
};

template <typename T, typename W>
void run_job(const Job& job, const T* q, const T* kc, const T* vc, const int64_t* pt,
             const int64_t* ctx, const int64_t* q_starts, const int64_t* q_lens, T* out,
             int64_t H, int64_t KVH, int64_t D, int64_t P, int64_t page_size, float scale,
             int64_t window, W& w) {
    const int64_t G = H / KVH, row = KVH * D, b = job.row, h = job.head, Dp = w.Dp;
    const int64_t n_ctx = ctx[b], first_pos = n_ctx - q_lens[b];  // position of query 0
    const int64_t M = (job.last - job.first) * G;  // query lanes, token-major: m = i * G + g
    const int64_t blocks = (M + QB - 1) / QB, Mp = blocks * QB;
    const float qscale = scale * 1.4426950408889634f;  // scores in base 2: see exp2_16
    const int64_t* pages = pt + b * P;
    for (int64_t mi = 0; mi < Mp; ++mi) {
        const int64_t i = job.first + mi / G, g = mi % G;
        if (mi < M) {
            w.query(mi, q + ((q_starts[b] + i) * H + h * G + g) * D, qscale);
            const int64_t p = first_pos + i;
            w.pos[mi] = static_cast<float>(p);
            w.lo[mi] = window > 0 ? static_cast<float>(std::max<int64_t>(0, p - window + 1)) : 0.f;
        } else {  // a padding lane sees no key: its output is never written
            w.query(mi, static_cast<const T*>(nullptr), qscale);
            w.pos[mi] = -1.f;
            w.lo[mi] = -FLOOR;
        }
    }
    std::fill(w.o.begin(), w.o.begin() + Mp * Dp, 0.f);
    std::fill(w.m.begin(), w.m.begin() + Mp, FLOOR);
    std::fill(w.l.begin(), w.l.begin() + Mp, 0.f);
    const int64_t last_pos = first_pos + job.last - 1;
    const int64_t lo = window > 0 ? std::max<int64_t>(0, first_pos + job.first - window + 1) : 0;
    for (int64_t t0 = lo; t0 <= last_pos; t0 += KT) {
        const int64_t n = std::min(KT, last_pos + 1 - t0);
        const int64_t n_next = std::min(KT, last_pos + 1 - t0 - KT);  // <= 0 after the last
        int64_t page = t0 / page_size, in_page = t0 % page_size;  // walked, not divided per key
        for (int64_t t = 0; t < KT; ++t, ++in_page) {
            if (t >= n) {
                w.past(t);
                continue;
            }
            if (in_page == page_size) ++page, in_page = 0;
            const int64_t slot = pages[page] * page_size + in_page;
            if (t < n_next) {  // the next tile's rows start loading while this one computes
                const int64_t pn = t0 + KT + t;
                const int64_t sn = pages[pn / page_size] * page_size + pn % page_size;
                for (int64_t d = 0; d < D; d += 64 / static_cast<int64_t>(sizeof(T))) {
                    __builtin_prefetch(kc + sn * row + h * D + d);
                    __builtin_prefetch(vc + sn * row + h * D + d);
                }
            }
            w.key(t, n, kc + slot * row + h * D, vc + slot * row + h * D);
        }
        const int64_t t_end = t0 + n - 1;
        for (int64_t qb = 0; qb < blocks; ++qb) {
            const float* pos = &w.pos[qb * QB];
            const float* lov = &w.lo[qb * QB];
            const int64_t real = std::min<int64_t>(QB, M - qb * QB);
            // Real lanes are token-major, so the first and last hold the block's extremes.
            const int64_t min_pos = pos[0], max_pos = pos[real - 1];
            const int64_t min_lo = lov[0], max_lo = lov[real - 1];
            if (max_pos < t0 || min_lo > t_end) continue;  // no lane sees any of this tile
            w.block(qb, n, t0, t_end > min_pos || t0 < max_lo, qscale);
        }
    }
    for (int64_t mi = 0; mi < M; ++mi) {
        const int64_t i = job.first + mi / G, g = mi % G;
        const float inv = 1.f / w.l[mi];
        T* dst = out + ((q_starts[b] + i) * H + h * G + g) * D;
        for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(w.o[mi * Dp + d] * inv);
    }
}

#ifdef __AVX512BF16__
// bf16 pages with the host's bf16 dot products (vec16.h), as transformers' bf16 attention and
// flash-attention kernels compute: Q.K of the bf16 values as they are (the scale is applied to
// the float32 scores, so Q is not rounded again), P rounded to bf16 for P.V, every sum in float32.
// The pairs vdpbf16ps takes lie where the dot products need them: a K row's elements (d, d + 1)
// are adjacent in its page, so a key's pair is one 32-bit broadcast read in place, and each
// lane's query pair is one word of the job's transposed queries. P.V pairs two keys: a tile's V
// rows are interleaved once into (key t, key t + 1) pairs per column, which every block of the
// job then reads, and the softmax writes its probabilities straight as such pairs.
typedef unsigned int u32;

// scores() with bf16 pairs: per pair of elements, three loads of the lanes' query words and N
// broadcasts of the keys' words feed 3 N dot products; the float32 sums are then scaled.
template <int N, bool MASKED>
inline void scores_bf16(const u32_mem* const* kp, const u32* qw, int64_t D2, float qscale,
                        float* S, int64_t key0, const float* pos, const float* lo, int64_t rows,
                        v16* mx) {
    const u32_mem* k[N];
    for (int i = 0; i < N; ++i) k[i] = kp[i];
    v16 acc[N][3] = {};
    for (int64_t d = 0; d < D2; ++d) {
        const __m512i q0 = _mm512_loadu_si512(qw + d * QB),
                      q1 = _mm512_loadu_si512(qw + d * QB + 16),
                      q2 = _mm512_loadu_si512(qw + d * QB + 32);
        for (int i = 0; i < N; ++i) {
            const __m512i kv = _mm512_set1_epi32(static_cast<int>(k[i][d]));
            acc[i][0] = dot_bf16(acc[i][0], q0, kv);
            acc[i][1] = dot_bf16(acc[i][1], q1, kv);
            acc[i][2] = dot_bf16(acc[i][2], q2, kv);
        }
    }
    for (int i = 0; i < N; ++i)
        for (int j = 0; j < 3; ++j) acc[i][j] *= qscale;
    store_scores<N, MASKED>(acc, S, key0, pos, lo, rows, mx);
}

// softmax_block(), writing the probabilities as bf16 pairs of keys into pw (a lone last key's
// partner is 0). The sum l adds them unrounded, as flash attention does.
inline void softmax_bf16(const float* S, int64_t n, bool masked, const v16* mx, float* m,
                         float* l, float* corr, u32* pw) {
    fold_tile(mx, m, l, corr, [&](int j, v16 m_new) {
        v16 z = {};
        for (int64_t t = 0; t < n; t += 2) {
            const v16 p0 = prob(load16(S + t * QB + 16 * j), m_new, masked);
            const v16 p1 = t + 1 < n ? prob(load16(S + (t + 1) * QB + 16 * j), m_new, masked)
                                     : v16{};
            z += p0 + p1;
            _mm512_storeu_si512(pw + (t / 2) * QB + 16 * j, pair_bf16(p0, p1));
        }
        return z;
    });
}

// outputs() with bf16 pairs: per pair of keys, NV loads of V words and MR broadcasts of the
// rows' probability words feed MR NV dot products.
template <int NV>
inline void outputs_bf16(const u32* pw, const u32* vw, int64_t pairs, int64_t col,
                         const float* corr, float* O, int64_t D) {
    v16 acc[MR][NV];
    for (int r = 0; r < MR; ++r)
        for (int j = 0; j < NV; ++j) acc[r][j] = load16(O + r * D + col + 16 * j) * corr[r];
    for (int64_t t = 0; t < pairs; ++t) {
        __m512i v[NV];
        for (int j = 0; j < NV; ++j) v[j] = _mm512_loadu_si512(vw + t * D + col + 16 * j);
        for (int r = 0; r < MR; ++r) {
            const __m512i p = _mm512_set1_epi32(static_cast<int>(pw[t * QB + r]));
            for (int j = 0; j < NV; ++j) acc[r][j] = dot_bf16(acc[r][j], p, v[j]);
        }
    }
    for (int r = 0; r < MR; ++r)
        for (int j = 0; j < NV; ++j) store16(O + r * D + col + 16 * j, acc[r][j]);
}

// The scratch and steps of the bf16 dot-product path, for run_job; D % 32 == 0.
struct Pairs {
    // qw [blocks][D / 2][QB] and pw [KT / 2][QB]: per lane, a word of two bf16 (query elements
    // 2d, 2d + 1; probabilities of keys 2t, 2t + 1). vw [KT / 2][D]: per column, keys 2t, 2t + 1.
    std::vector<u32> qw, pw, vw, zeros;
    std::vector<float> o, m, l, s, corr, pos, lo;
    std::vector<const u32_mem*> kp;
    const c10::BFloat16* v_even = nullptr;  // the V row of the tile's last even key
    int64_t D, Dp;
    Pairs(int64_t Mp, int64_t D)
        : qw(Mp * D / 2), pw(KT / 2 * QB), vw(KT / 2 * D), zeros(D / 2, 0u), o(Mp * D), m(Mp),
          l(Mp), s(KT * QB), corr(QB), pos(Mp), lo(Mp), kp(KT), D(D), Dp(D) {}

    void query(int64_t mi, const c10::BFloat16* src, float) {
        u32* dst = &qw[(mi / QB) * (D / 2) * QB + mi % QB];
        const auto* words = reinterpret_cast<const u32_mem*>(src);
        for (int64_t d = 0; d < D / 2; ++d) dst[d * QB] = src ? words[d] : 0u;
    }

    // Key t (< n): K read in place; V rows interleaved a pair at a time (a lone last key's
    // partner is zeros, never the slot after it).
    void key(int64_t t, int64_t n, const c10::BFloat16* kr, const c10::BFloat16* vr) {
        kp[t] = reinterpret_cast<const u32_mem*>(kr);
        if (t % 2 == 0) v_even = vr;
        if (t % 2 == 0 && t < n - 1) return;
        u32* dst = &vw[(t / 2) * D];
        for (int64_t d = 0; d < D; d += 32) {
            const __m512i odd = t % 2 ? _mm512_loadu_si512(vr + d) : __m512i{};
            __m512i lo_w, hi_w;
            interleave_bf16(_mm512_loadu_si512(v_even + d), odd, lo_w, hi_w);
            _mm512_storeu_si512(dst + d, lo_w);
            _mm512_storeu_si512(dst + d + 16, hi_w);
        }
    }

    void past(int64_t t) { kp[t] = reinterpret_cast<const u32_mem*>(zeros.data()); }

    void block(int64_t qb, int64_t n, int64_t t0, bool masked, float qscale) {
        const float* p = &pos[qb * QB];
        const float* lv = &lo[qb * QB];
        float* S = s.data();
        const u32* q = &qw[qb * (D / 2) * QB];
        v16 mx[3] = {v16{} + FLOOR, v16{} + FLOOR, v16{} + FLOOR};
        for (int64_t k = 0; k < n; k += NK) {
            if (masked)
                scores_bf16<NK, true>(&kp[k], q, D / 2, qscale, S + k * QB, t0 + k, p, lv, n - k,
                                      mx);
            else
                scores_bf16<NK, false>(&kp[k], q, D / 2, qscale, S + k * QB, t0 + k, p, lv,
                                       n - k, mx);
        }
        softmax_bf16(S, n, masked, mx, &m[qb * QB], &l[qb * QB], corr.data(), pw.data());
        for (int64_t r = 0; r < QB; r += MR) {
            float* O = &o[(qb * QB + r) * D];
            int64_t col = 0;
            for (; col + 64 <= D; col += 64)
                outputs_bf16<4>(pw.data() + r, vw.data(), (n + 1) / 2, col, &corr[r], O, D);
            if (col < D)  // D % 32 == 0: one pair of vectors left
                outputs_bf16<2>(pw.data() + r, vw.data(), (n + 1) / 2, col, &corr[r], O, D);
        }
    }
};
#endif

template <typename T>
void prefill_kernel(const T* q, const T* kc, const T* vc, const int64_t* pt, const int64_t* ctx,
                    const int64_t* q_starts, const int64_t* q_lens, T* out, int64_t B, int64_t H,
                    int64_t KVH, int64_t D, int64_t P, int64_t page_size, float scale,
                    int64_t window, bool widen) {
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
    const int64_t max_lanes = (per_job * G + QB - 1) / QB * QB;
    auto run_all = [&](auto make_scratch) {
        at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
            auto w = make_scratch();
            for (int64_t unused = begin; unused < end; ++unused)
                for (int64_t j = next++; j < n_jobs; j = next++)
                    run_job(jobs[j], q, kc, vc, pt, ctx, q_starts, q_lens, out, H, KVH, D, P,
                            page_size, scale, window, w);
        });
    };
#ifdef __AVX512BF16__
    if constexpr (std::is_same<T, c10::BFloat16>::value) {
        if (!widen && D % 32 == 0) return run_all([&] { return Pairs(max_lanes, D); });
    }
#endif
    run_all([&] { return Widened(max_lanes, D, Dp); });
}

void paged_prefill(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                   torch::Tensor page_table, torch::Tensor ctx_lens, torch::Tensor q_starts,
                   torch::Tensor q_lens, int64_t page_size, double scale, int64_t window,
                   torch::Tensor out, bool widen) {
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
        TORCH_CHECK(ctx_p[b] <= (int64_t{1} << 24), "a context past 2^24 tokens (float positions)");
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
                                 static_cast<float>(scale), window, widen);
    });
}

void paged_prefill_dot(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                       torch::Tensor page_table, torch::Tensor ctx_lens, torch::Tensor q_starts,
                       torch::Tensor q_lens, int64_t page_size, double scale, int64_t window,
                       torch::Tensor out) {
    paged_prefill(q, k_cache, v_cache, page_table, ctx_lens, q_starts, q_lens, page_size, scale,
                  window, out, false);
}

// The path every host takes: bf16 widened to float32 (exact), kept callable where the bf16 dot
// products exist so that tests and benchmarks can hold the two against each other.
void paged_prefill_widened(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor page_table, torch::Tensor ctx_lens,
                           torch::Tensor q_starts, torch::Tensor q_lens, int64_t page_size,
                           double scale, int64_t window, torch::Tensor out) {
    paged_prefill(q, k_cache, v_cache, page_table, ctx_lens, q_starts, q_lens, page_size, scale,
                  window, out, true);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    // The GIL is released while a kernel runs, as torch releases it for its own ops.
    const auto nogil = py::call_guard<py::gil_scoped_release>();
    m.def("paged_prefill", &paged_prefill_dot, nogil,
          "prefill-chunk attention read in place from the paged KV pool, written into out");
    m.def("paged_prefill_widened", &paged_prefill_widened, nogil,
          "paged_prefill with bf16 widened to float32 for every product, as hosts without bf16 "
          "dot products compute it");
}
