// y = x @ W (+ bias) with W pre-packed into column panels of 48 columns (the last one
// zero-padded). A panel is one contiguous stream, so decode's skinny matmuls (a few rows against
// weights that come from DRAM every step) read each weight byte once, in order, with the rows'
// sums held in registers: an 8 x 48 tile of float32 accumulators takes 24 of AVX-512's 32
// vector registers.
//
// float32: x [M, K] float32, panels [P, K, 48] float32, y [M, n] float32.
// bfloat16 (hosts with avx512_bf16): x [M, K] bf16, panels [P, ceil(K / 2), 48, 2] bf16: K in
// pairs, so one 64-byte load holds 16 columns' (w[2j, c], w[2j + 1, c]) and one vdpbf16ps adds
// both products of a pair to each column's float32 sum, x's pair broadcast as one 32-bit value
// (an odd K's last pair is zero in the panel and in the broadcast). y [M, n] bf16: the float32
// sum plus the bias, rounded once to nearest even, as oneDNN and torch's bf16 matmuls round.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "claim.h"
#include "vec16.h"

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;
constexpr int64_t kU = 3;  // vectors per panel row
constexpr int64_t kNB = kLanes * kU;  // panel width
constexpr int64_t kMR = 8;  // rows per register tile
// Prefetches go to L2 (prefetcht2), not L1: a block, the next one and x's rows would not all
// fit in L1. Measured against L1 (3), L1/L2 (2) and non-temporal (0, 1.2-2x slower).
constexpr int kLocality = 1;

// One tile's walk over one block of a panel: rows [0, MR) of x (row stride ldx) against kn
// panel rows (a float32 row is one k, a bf16 row one pair of k). The sums start from acc (or zero
// when `fresh`) and end there, so a panel can be walked in blocks of K. odd_tail: x's last pair
// in this block has only its first value (K is odd). ahead, every, phase: see Prefetcher.
template <typename T>
struct Walk {
    const T* x;
    int64_t ldx, kn;
    bool odd_tail;
    const T* panel;
    float* acc;
    bool fresh;
    int64_t ahead, every, phase;
};

template <int MR, typename T>
void load_acc(v16 (&acc)[MR][kU], const Walk<T>& a) {
    for (int m = 0; m < MR; ++m)
        for (int u = 0; u < kU; ++u)
            acc[m][u] = a.fresh ? v16{} : load16(a.acc + m * kNB + u * kLanes);
}

template <int MR, typename T>
void store_acc(v16 (&acc)[MR][kU], const Walk<T>& a) {
    for (int m = 0; m < MR; ++m)
        for (int u = 0; u < kU; ++u) store16(a.acc + m * kNB + u * kLanes, acc[m][u]);
}

// Panel row k + ahead is requested on the steps k where (k + phase) % every == 0, so the `every`
// tiles that walk one block share the fetching of the next between them. A panel row is 192
// bytes in either dtype (48 float32, or 48 pairs of bf16): three cache lines.
class Prefetcher {
  public:
    template <typename T>
    explicit Prefetcher(const Walk<T>& a)
        : next_((a.every - a.phase % a.every) % a.every),
          every_(a.every),
          ahead_(a.ahead * kRowBytes) {}

    void at(int64_t k, const void* row) {
        if (k != next_) return;
        next_ += every_;
        const char* p = static_cast<const char*>(row) + ahead_;
        for (int u = 0; u < kU; ++u) __builtin_prefetch(p + 64 * u, 0, kLocality);
    }

  private:
    static constexpr int64_t kRowBytes = kNB * 4;
    int64_t next_, every_, ahead_;
};

// Panel row k (one k) against x's column k for rows [0, MR).
template <int MR>
__attribute__((always_inline)) inline void step(v16 (&acc)[MR][kU], const float* w,
                                                const Walk<float>& a, int64_t k) {
    const v16 w0 = load16(w), w1 = load16(w + kLanes), w2 = load16(w + 2 * kLanes);
    for (int m = 0; m < MR; ++m) {
        const float xv = a.x[m * a.ldx + k];
        acc[m][0] += w0 * xv;
        acc[m][1] += w1 * xv;
        acc[m][2] += w2 * xv;
    }
}

#ifdef __AVX512BF16__
using bf16 = c10::BFloat16;

// One panel row (48 columns' pairs) against each row m's pair of x, pair(m) (32 bits: x[2j] in
// the low half, x[2j + 1] in the high one, as the panel holds w[2j] and w[2j + 1]).
template <int MR, typename Pair>
__attribute__((always_inline)) inline void dot_row(v16 (&acc)[MR][kU], const bf16* w, Pair pair) {
    const __m512i w0 = _mm512_loadu_si512(w), w1 = _mm512_loadu_si512(w + 2 * kLanes),
                  w2 = _mm512_loadu_si512(w + 4 * kLanes);
    for (int m = 0; m < MR; ++m) {
        const __m512i xv = _mm512_set1_epi32(pair(m));
        acc[m][0] = dot_bf16(acc[m][0], xv, w0);
        acc[m][1] = dot_bf16(acc[m][1], xv, w1);
        acc[m][2] = dot_bf16(acc[m][2], xv, w2);
    }
}

// Panel row k (pair k) against x's pair of columns (2k, 2k + 1), read as one 32-bit value.
template <int MR>
__attribute__((always_inline)) inline void step(v16 (&acc)[MR][kU], const bf16* w,
                                                const Walk<bf16>& a, int64_t k) {
    dot_row<MR>(acc, w, [&](int m) {
        return static_cast<int>(*reinterpret_cast<const u32_mem*>(a.x + m * a.ldx + 2 * k));
    });
}

// An odd K's last pair: x[K] is past the row (or the buffer), so x[K - 1] goes with a zero.
template <int MR>
void odd_tail(v16 (&acc)[MR][kU], const bf16* w, const Walk<bf16>& a, int64_t k) {
    dot_row<MR>(acc, w, [&](int m) { return static_cast<int>(a.x[m * a.ldx + 2 * k].x); });
}
#endif

template <int MR>
void odd_tail(v16 (&)[MR][kU], const float*, const Walk<float>&, int64_t) {}  // K has no pairs

template <int MR, typename T>
void tile(const Walk<T>& a) {
    constexpr int64_t row = kNB * 4 / sizeof(T);  // values per panel row: 192 bytes either way
    v16 acc[MR][kU];
    load_acc<MR>(acc, a);
    const T* w = a.panel;
    Prefetcher fetch(a);
    const int64_t whole = a.kn - a.odd_tail;
    for (int64_t k = 0; k < whole; ++k, w += row) {
        fetch.at(k, w);
        step<MR>(acc, w, a, k);
    }
    if (a.odd_tail) odd_tail<MR>(acc, w, a, whole);
    store_acc<MR>(acc, a);
}

template <typename T>
void rows(int64_t mr, const Walk<T>& a) {
    switch (mr) {
        case 8: return tile<8, T>(a);
        case 7: return tile<7, T>(a);
        case 6: return tile<6, T>(a);
        case 5: return tile<5, T>(a);
        case 4: return tile<4, T>(a);
        case 3: return tile<3, T>(a);
        case 2: return tile<2, T>(a);
        default: return tile<1, T>(a);
    }
}

// y's row (cols of one panel) from the tile's float32 sums, plus the bias.
void finish(const float* acc, const float* bias, int64_t cols, float* y) {
    if (bias == nullptr) {
        std::copy_n(acc, cols, y);
        return;
    }
    for (int64_t c = 0; c < cols; ++c) y[c] = acc[c] + bias[c];
}

#ifdef __AVX512BF16__
void finish(const float* acc, const bf16* bias, int64_t cols, bf16* y) {
    if (cols == kNB) {
        for (int u = 0; u < kU; ++u) {
            v16 v = load16(acc + u * kLanes);
            if (bias != nullptr) v += load16(bias + u * kLanes);
            store16(y + u * kLanes, v);  // rounds to nearest even, as torch's cast
        }
        return;
    }
    for (int64_t c = 0; c < cols; ++c)
        y[c] = bf16(acc[c] + (bias == nullptr ? 0.0f : static_cast<float>(bias[c])));
}
#endif

// Panel rows per block when x has more rows than one tile: every tile of x walks a block while
// it is in cache (64 rows x 48 columns: 12 KiB in either dtype), and the tiles share fetching the
// next block ahead of time, so the weights stream from DRAM under all the tiles' FMAs instead of
// under the first tile's alone. Measured 32, 64, 96, 128, 256: 64 best (16-32 rows ~0.9x the
// unblocked walk).
constexpr int64_t kKB = 64;
// Beyond this many row tiles, the blocks' accumulators would crowd L1 out: walk the panel whole
// per tile (prefill's tall x is compute-bound either way). bf16 does twice float32's products
// per instruction on half its bytes, so past two tiles (16 rows) it is compute-bound already,
// and there the whole-panel walk measured 0.85-0.95x the blocked one's time (24-64 rows, one
// thread, benchmarks/bf16_gemm.py).
constexpr int64_t kMaxBlockedTiles = 8;
template <typename T>
constexpr int64_t blocked_tiles() { return sizeof(T) == 4 ? kMaxBlockedTiles : 2; }

// steps: panel rows (K for float32, ceil(K / 2) for bf16); per_step: x values per panel row.
template <typename T>
void gemm(const T* xp, int64_t M, int64_t K, const T* wp, int64_t P, int64_t n, const T* bias,
          T* yp) {
    constexpr int64_t per_step = sizeof(T) == 4 ? 1 : 2;
    const int64_t steps = (K + per_step - 1) / per_step;
    const bool odd = K % per_step != 0;
    const int64_t row = kNB * per_step;  // values per panel row
    const int64_t tiles = (M + kMR - 1) / kMR;
    const int64_t kb = tiles > 1 && tiles <= blocked_tiles<T>() ? kKB : steps;
    // Panels are claimed one at a time (claim.h): a thread that loses its core holds back one
    // panel, not its whole share of the weights.
    parallel_claim(P, 1, [&](Claim& claim) {
        std::vector<float> acc(static_cast<size_t>(std::min(tiles, kMaxBlockedTiles) * kMR * kNB));
        for (int64_t p = 0, next = 0; claim(p, next);) {  // [p, next): one panel
            const T* panel = wp + p * steps * row;
            const int64_t cols = std::min(kNB, n - p * kNB);
            const T* b = bias == nullptr ? nullptr : bias + p * kNB;
            for (int64_t m0 = 0; m0 < M; m0 += kMaxBlockedTiles * kMR) {  // one pass when blocked
                const int64_t m1 = std::min(M, m0 + kMaxBlockedTiles * kMR);
                for (int64_t k0 = 0; k0 < steps; k0 += kb) {
                    const int64_t kn = std::min(kb, steps - k0);
                    const int64_t t = (m1 - m0 + kMR - 1) / kMR;
                    for (int64_t m = m0; m < m1; m += kMR) {
                        // One tile: 64 rows ahead, every step (measured best of 16-128). Several:
                        // the next block, spread over the tiles walking this one.
                        const Walk<T> w{xp + m * K + k0 * per_step, K, kn, odd && k0 + kn == steps,
                                        panel + k0 * row, acc.data() + (m - m0) * kNB, k0 == 0,
                                        t == 1 ? 64 : kn, t, (m - m0) / kMR};
                        rows(std::min(kMR, M - m), w);
                    }
                }
                for (int64_t m = m0; m < m1; ++m)
                    finish(acc.data() + (m - m0) * kNB, b, cols, yp + m * n + p * kNB);
            }
        }
    });
}

}  // namespace

int64_t packed_panel_width() { return kNB; }

bool packed_has_bf16() {
#ifdef __AVX512BF16__
    return true;
#else
    return false;
#endif
}

torch::Tensor packed_matmul(const torch::Tensor& x, const torch::Tensor& packed, int64_t n,
                            const std::optional<torch::Tensor>& bias) {
    const auto dt = x.scalar_type();
    TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16, "float32 or bfloat16 only");
    TORCH_CHECK(packed.scalar_type() == dt, "x and packed differ in dtype");
    const bool pairs = dt == at::kBFloat16;
    TORCH_CHECK(x.dim() == 2 && packed.dim() == (pairs ? 4 : 3),
                "x [M, K], packed [P, K, 48] (float32) or [P, ceil(K / 2), 48, 2] (bfloat16)");
    TORCH_CHECK(x.is_contiguous() && packed.is_contiguous(), "contiguous inputs only");
    TORCH_CHECK(!x.is_cuda() && !packed.is_cuda(), "CPU tensors only");
    const int64_t M = x.size(0), K = x.size(1), P = packed.size(0);
    TORCH_CHECK(packed.size(1) == (pairs ? (K + 1) / 2 : K) && packed.size(2) == kNB &&
                    (!pairs || packed.size(3) == 2),
                "packed shape does not match x");
    TORCH_CHECK(n > (P - 1) * kNB && n <= P * kNB, "n does not match the panel count");
    if (bias)
        TORCH_CHECK(bias->scalar_type() == dt && bias->is_contiguous() && bias->dim() == 1 &&
                        bias->size(0) == n,
                    "bias: [n] contiguous, x's dtype");
    auto y = torch::empty({M, n}, x.options());
    if (!pairs) {
        gemm<float>(x.data_ptr<float>(), M, K, packed.data_ptr<float>(), P, n,
                    bias ? bias->data_ptr<float>() : nullptr, y.data_ptr<float>());
        return y;
    }
#ifdef __AVX512BF16__
    using T = c10::BFloat16;
    gemm<T>(x.data_ptr<T>(), M, K, packed.data_ptr<T>(), P, n,
            bias ? bias->data_ptr<T>() : nullptr, y.data_ptr<T>());
    return y;
#else
    TORCH_CHECK(false, "the bfloat16 packed matmul needs avx512_bf16 (kernels.has_bf16_dot())");
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    // The GIL is released while a kernel runs, as torch releases it for its own ops: the
    // server's event loop must keep streaming tokens while the engine thread computes.
    const auto nogil = py::call_guard<py::gil_scoped_release>();
    m.def("packed_matmul", &packed_matmul, nogil, "x @ W (+ bias) with W packed in 48-column panels",
          py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("bias") = py::none());
    m.def("packed_panel_width", &packed_panel_width, "columns per panel");
    m.def("packed_has_bf16", &packed_has_bf16, "whether the bfloat16 path was compiled in");
}
