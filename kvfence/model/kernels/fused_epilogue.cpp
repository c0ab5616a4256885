// The float32 small ops between a decoder layer's matmuls, one call each instead of torch's
// chain of ops (F.rms_norm alone is ~8 aten ops, each allocating and dispatching):
//
// - add_rms_norm(x, delta, weight, eps): x += delta in place (the residual stream; delta may be
//   None), then returns rmsnorm(x) * weight, one row at a time while the row is in L1.
// - silu_mul(gate_up, n): silu(gate_up[:, :n]) * gate_up[:, n:], a new [rows, n] tensor.
//
// Rows are contiguous float32. Few rows (decode) run serially on the calling thread: waking
// OpenMP's workers costs more than the work; many rows (prefill) split over the threads.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>

namespace {

typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef int i16 __attribute__((vector_size(64), aligned(4)));

constexpr int64_t kLanes = 16;
// Elements per parallel chunk: below this a call stays on the calling thread.
constexpr int64_t kGrainElems = 1 << 16;

inline v16 load16(const float* p) {
    v16 v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

inline void store16(float* p, v16 v) { std::memcpy(p, &v, sizeof v); }

inline v16 splat(float a) { return v16{} + a; }

// exp(x) to ~2 ulp (Cephes' expf polynomial): glibc's vector expf is only declared under
// -ffast-math, and a scalar expf per element would cost more than the torch op it replaces.
inline v16 exp16(v16 x) {
    x = x < splat(88.3f) ? x : splat(88.3f);
    x = x > splat(-87.3f) ? x : splat(-87.3f);
    const v16 magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
    const v16 n = (x * splat(1.44269504088896341f) + magic) - magic;
    const v16 r = x - n * splat(0.693359375f) + n * splat(2.12194440e-4f);
    v16 p = splat(1.9875691500e-4f);
    p = p * r + splat(1.3981999507e-3f);
    p = p * r + splat(8.3334519073e-3f);
    p = p * r + splat(4.1665795894e-2f);
    p = p * r + splat(1.6666665459e-1f);
    p = p * r + splat(5.0000001201e-1f);
    p = p * r * r + r + splat(1.0f);
    const i16 bits = (__builtin_convertvector(n, i16) + 127) << 23;
    v16 scale;
    std::memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

inline v16 silu_mul16(v16 g, v16 u) { return g / (splat(1.0f) + exp16(-g)) * u; }

void silu_mul_row(const float* g, const float* u, float* o, int64_t n) {
    int64_t i = 0;
    for (; i + kLanes <= n; i += kLanes) store16(o + i, silu_mul16(load16(g + i), load16(u + i)));
    if (i < n) {  // the ragged tail through a zero-padded vector
        float gb[kLanes] = {}, ub[kLanes] = {}, ob[kLanes];
        std::memcpy(gb, g + i, (n - i) * sizeof(float));
        std::memcpy(ub, u + i, (n - i) * sizeof(float));
        store16(ob, silu_mul16(load16(gb), load16(ub)));
        std::memcpy(o + i, ob, (n - i) * sizeof(float));
    }
}

void add_rms_norm_row(float* x, const float* d, const float* w, float eps, float* out,
                      int64_t n) {
    float ss = 0.f;
    if (d != nullptr) {
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < n; ++i) {
            const float v = x[i] + d[i];
            x[i] = v;
            ss += v * v;
        }
    } else {
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
    }
    // The same order as HF's RMSNorm: x * rsqrt(mean(x^2) + eps), then * weight.
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) out[i] = (x[i] * inv) * w[i];
}

void check_rows(const torch::Tensor& t, const char* name) {
    TORCH_CHECK(t.dim() == 2, name, " must be [rows, cols]");
    TORCH_CHECK(t.scalar_type() == at::kFloat, name, " must be float32");
    TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
    TORCH_CHECK(!t.is_cuda(), name, " must be a CPU tensor");
}

int64_t grain_rows(int64_t cols) { return std::max<int64_t>(1, kGrainElems / std::max<int64_t>(1, cols)); }

}  // namespace

torch::Tensor add_rms_norm(torch::Tensor& x, const c10::optional<torch::Tensor>& delta,
                           const torch::Tensor& weight, double eps) {
    check_rows(x, "x");
    const int64_t rows = x.size(0), n = x.size(1);
    TORCH_CHECK(weight.dim() == 1 && weight.size(0) == n && weight.is_contiguous() &&
                    weight.scalar_type() == at::kFloat,
                "weight must be float32 [cols], contiguous");
    const float* dp = nullptr;
    if (delta.has_value()) {
        check_rows(*delta, "delta");
        TORCH_CHECK(delta->sizes() == x.sizes(), "delta must have x's shape");
        dp = delta->data_ptr<float>();
    }
    auto out = torch::empty_like(x);
    float* xp = x.data_ptr<float>();
    const float* wp = weight.data_ptr<float>();
    float* op = out.data_ptr<float>();
    const float e = static_cast<float>(eps);
    at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r)
            add_rms_norm_row(xp + r * n, dp ? dp + r * n : nullptr, wp, e, op + r * n, n);
    });
    return out;
}

torch::Tensor silu_mul(const torch::Tensor& gate_up, int64_t n) {
    check_rows(gate_up, "gate_up");
    TORCH_CHECK(gate_up.size(1) == 2 * n, "gate_up must be [rows, 2 * n]");
    const int64_t rows = gate_up.size(0);
    auto out = torch::empty({rows, n}, gate_up.options());
    const float* gp = gate_up.data_ptr<float>();
    float* op = out.data_ptr<float>();
    at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r)
            silu_mul_row(gp + r * 2 * n, gp + r * 2 * n + n, op + r * n, n);
    });
    return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("add_rms_norm", &add_rms_norm, "x += delta (in place); returns rmsnorm(x) * weight");
    m.def("silu_mul", &silu_mul, "silu(gate_up[:, :n]) * gate_up[:, n:]");
}
