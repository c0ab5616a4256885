// y = x @ W for float32, with W pre-packed into column panels: [P, K, 48], panel p holding
// columns [48p, 48p + 48) of W [K, N] (the last one zero-padded). A panel is one contiguous
// stream, so decode's skinny matmuls (a few rows against weights that come from DRAM every
// step) read each weight byte once, in order, with the rows' sums held in registers: an 8 x 48
// tile of accumulators takes 24 of AVX-512's 32 vector registers.
//
// x [M, K] contiguous float32, packed [P, K, 48] float32. Returns y [M, n] float32.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "vec16.h"

#include <algorithm>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;
constexpr int64_t kU = 3;  // vectors per panel row
constexpr int64_t kNB = kLanes * kU;  // panel width
constexpr int64_t kMR = 8;  // rows per register tile
// Prefetches go to L2 (prefetcht2), not L1: a block, the next one and x's rows would not all
// fit in L1. Measured against L1 (3), L1/L2 (2) and non-temporal (0, 1.2-2x slower).
constexpr int kLocality = 1;

// Rows [0, MR) of x (row stride ldx) against panel rows [0, kn): the tile's sums start from
// acc (or zero when `fresh`) and end there, so a panel can be walked in blocks of K.
// Prefetch: panel row k + ahead is requested on the steps k where (k + phase) % every == 0, so
// the `every` tiles that walk one block share the fetching of the next between them.
template <int MR>
void tile(const float* x, int64_t ldx, int64_t kn, const float* panel, float* acc_out, bool fresh,
          int64_t ahead, int64_t every, int64_t phase) {
    v16 acc[MR][kU];
    for (int m = 0; m < MR; ++m)
        for (int u = 0; u < kU; ++u)
            acc[m][u] = fresh ? v16{} : load16(acc_out + m * kNB + u * kLanes);
    const float* w = panel;
    int64_t next = (every - phase % every) % every;
    for (int64_t k = 0; k < kn; ++k, w += kNB) {
        if (k == next) {
            next += every;
            __builtin_prefetch(w + ahead * kNB, 0, kLocality);
            __builtin_prefetch(w + ahead * kNB + kLanes, 0, kLocality);
            __builtin_prefetch(w + ahead * kNB + 2 * kLanes, 0, kLocality);
        }
        const v16 w0 = load16(w), w1 = load16(w + kLanes), w2 = load16(w + 2 * kLanes);
        for (int m = 0; m < MR; ++m) {
            const float xv = x[m * ldx + k];
            acc[m][0] += w0 * xv;
            acc[m][1] += w1 * xv;
            acc[m][2] += w2 * xv;
        }
    }
    for (int m = 0; m < MR; ++m)
        for (int u = 0; u < kU; ++u) store16(acc_out + m * kNB + u * kLanes, acc[m][u]);
}

struct Walk {  // how one tile walks one block of a panel
    const float* x;
    int64_t ldx, kn;
    const float* panel;
    float* acc;
    bool fresh;
    int64_t ahead, every, phase;
};

void rows(int64_t mr, const Walk& a) {
#define KVF_TILE(MR) \
    return tile<MR>(a.x, a.ldx, a.kn, a.panel, a.acc, a.fresh, a.ahead, a.every, a.phase)
    switch (mr) {
        case 8: KVF_TILE(8);
        case 7: KVF_TILE(7);
        case 6: KVF_TILE(6);
        case 5: KVF_TILE(5);
        case 4: KVF_TILE(4);
        case 3: KVF_TILE(3);
        case 2: KVF_TILE(2);
        default: KVF_TILE(1);
    }
#undef KVF_TILE
}

// Panel rows per block when x has more rows than one tile: every tile of x walks a block while
// it is in cache (64 x 48 floats = 12 KiB), and the tiles share fetching the next block ahead of
// time, so the weights stream from DRAM under all the tiles' FMAs instead of under the first
// tile's alone. Measured 32, 64, 96, 128, 256: 64 best (16-32 rows ~0.9x the unblocked walk).
constexpr int64_t kKB = 64;
// Beyond this many row tiles, the blocks' accumulators would crowd L1 out: walk the panel whole
// per tile (prefill's tall x is compute-bound either way).
constexpr int64_t kMaxBlockedTiles = 8;

}  // namespace

int64_t packed_panel_width() { return kNB; }

torch::Tensor packed_matmul(const torch::Tensor& x, const torch::Tensor& packed, int64_t n) {
    TORCH_CHECK(x.dim() == 2 && packed.dim() == 3, "x [M, K], packed [P, K, 48]");
    TORCH_CHECK(x.scalar_type() == at::kFloat && packed.scalar_type() == at::kFloat,
                "float32 only");
    TORCH_CHECK(x.is_contiguous() && packed.is_contiguous(), "contiguous inputs only");
    TORCH_CHECK(!x.is_cuda() && !packed.is_cuda(), "CPU tensors only");
    const int64_t M = x.size(0), K = x.size(1), P = packed.size(0);
    TORCH_CHECK(packed.size(1) == K && packed.size(2) == kNB, "packed shape does not match x");
    TORCH_CHECK(n > (P - 1) * kNB && n <= P * kNB, "n does not match the panel count");
    auto y = torch::empty({M, n}, x.options());
    const float* xp = x.data_ptr<float>();
    const float* wp = packed.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    const int64_t tiles = (M + kMR - 1) / kMR;
    const int64_t kb = tiles > 1 && tiles <= kMaxBlockedTiles ? kKB : K;
    at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> acc(static_cast<size_t>(std::min(tiles, kMaxBlockedTiles) * kMR * kNB));
        for (int64_t p = begin; p < end; ++p) {
            const float* panel = wp + p * K * kNB;
            const int64_t cols = std::min(kNB, n - p * kNB);
            for (int64_t m0 = 0; m0 < M; m0 += kMaxBlockedTiles * kMR) {  // one pass when blocked
                const int64_t m1 = std::min(M, m0 + kMaxBlockedTiles * kMR);
                for (int64_t k0 = 0; k0 < K; k0 += kb) {
                    const int64_t kn = std::min(kb, K - k0);
                    const int64_t t = (m1 - m0 + kMR - 1) / kMR;
                    for (int64_t m = m0; m < m1; m += kMR) {
                        // One tile: 64 rows ahead, every step (measured best of 16-128). Several:
                        // the next block, spread over the tiles walking this one.
                        const Walk w{xp + m * K + k0, K,  kn, panel + k0 * kNB,
                                     acc.data() + (m - m0) * kNB, k0 == 0,
                                     t == 1 ? 64 : kn, t, (m - m0) / kMR};
                        rows(std::min(kMR, M - m), w);
                    }
                }
                for (int64_t m = m0; m < m1; ++m)
                    std::copy_n(acc.data() + (m - m0) * kNB, cols, yp + m * n + p * kNB);
            }
        }
    });
    return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    // The GIL is released while a kernel runs, as torch releases it for its own ops: the
    // server's event loop must keep streaming tokens while the engine thread computes.
    const auto nogil = py::call_guard<py::gil_scoped_release>();
    m.def("packed_matmul", &packed_matmul, nogil, "x @ W with W packed in 48-column panels");
    m.def("packed_panel_width", &packed_panel_width, "columns per panel");
}
