// The small ops between a decoder layer's matmuls (float32 or bfloat16 rows), one call each
// instead of torch's chain of ops (F.rms_norm alone is ~8 aten ops, each allocating and dispatching):
//
// - add_rms_norm(x, delta, weight, eps): x += delta in place (the residual stream; delta may be
//   None), then returns rmsnorm(x) * weight, one row at a time while the row is in L1.
// - silu_mul(gate_up, n): silu(gate_up[:, :n]) * gate_up[:, n:], a new [rows, n] tensor.
// - rope_store(qkv, cos, sin, n_q_heads, k_cache, v_cache, slot_mapping): rotates q and k of the
//   packed qkv projection (HF rotate-half), writes k and v straight into the caches' rows
//   slot_mapping (and no others), returns q [T, H, D]: one pass per token instead of rope's
//   cat/neg/mul/add and two index_copy_.
//
// Rows are contiguous float32 or bfloat16. bfloat16 rows are widened to float32, computed in
// float32 and rounded back where torch's bf16 ops round (the residual sum; the norm before and
// after its weight; silu before and after * up; rope once at the end), so they give the bf16
// torch path's values to its rounding: exactly for the residual stream, rope and the caches.
//
// Few rows (decode) run serially on the calling thread: waking
// OpenMP's workers costs more than the work; many rows (prefill) are claimed by the threads a
// chunk at a time (claim.h).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "claim.h"
#include "vec16.h"

#include <cmath>
#include <cstring>

namespace {

constexpr int64_t kLanes = 16;
// Elements per parallel chunk: below this a call stays on the calling thread.
constexpr int64_t kGrainElems = 1 << 16;

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
    return p * as_float16(bits);
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

void check_rows(const torch::Tensor& t, const char* name, at::ScalarType dtype) {
    TORCH_CHECK(t.dim() == 2, name, " must be [rows, cols]");
    TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype);
    TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
    TORCH_CHECK(!t.is_cuda(), name, " must be a CPU tensor");
}

// x * cos + rotate_half(x) * sin for one head, rounded like torch's separate mul, mul and add:
// the same bits. g++ fuses a * b + c into one fma by default in C++ (one rounding, not two), so
// contraction is off here.
__attribute__((optimize("fp-contract=off"))) void rope_head(const float* x, const float* c, const float* s, float* o, int64_t d) {
    const int64_t h = d / 2;
#pragma omp simd
    for (int64_t i = 0; i < h; ++i) o[i] = x[i] * c[i] + (-x[i + h]) * s[i];
#pragma omp simd
    for (int64_t i = h; i < d; ++i) o[i] = x[i] * c[i] + x[i - h] * s[i];
}

using bf16 = c10::BFloat16;

void add_rms_norm_row(bf16* x, const bf16* d, const bf16* w, float eps, bf16* out, int64_t n) {
    v16 ssv = {};
    float ss = 0.f;
    int64_t i = 0;
    for (; i + kLanes <= n; i += kLanes) {
        v16 v = load16(x + i);
        if (d != nullptr) {  // the stream is bf16: the norm sees the rounded sum
            v = round_bf16(v + load16(d + i));
            store16(x + i, v);
        }
        ssv += v * v;
    }
    for (; i < n; ++i) {
        float v = static_cast<float>(x[i]);
        if (d != nullptr) {
            x[i] = static_cast<bf16>(v + static_cast<float>(d[i]));
            v = static_cast<float>(x[i]);
        }
        ss += v * v;
    }
    for (int l = 0; l < kLanes; ++l) ss += ssv[l];
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
    const v16 invv = splat(inv);
    // transformers' bf16 order: normalise in float32, round, then scale by the weight and round.
    for (i = 0; i < n - n % kLanes; i += kLanes)
        store16(out + i, round_bf16(load16(x + i) * invv) * load16(w + i));
    for (; i < n; ++i) {
        const float h = static_cast<float>(static_cast<bf16>(static_cast<float>(x[i]) * inv));
        out[i] = static_cast<bf16>(h * static_cast<float>(w[i]));
    }
}

void silu_mul_row(const bf16* g, const bf16* u, bf16* o, int64_t n) {
    // silu(gate) rounds to bf16 before the product, as F.silu(gate) * up does in bf16.
    int64_t i = 0;
    for (; i + kLanes <= n; i += kLanes) {
        const v16 gv = load16(g + i);
        store16(o + i, round_bf16(gv / (splat(1.0f) + exp16(-gv))) * load16(u + i));
    }
    if (i < n) {  // the ragged tail through zero-padded float32 vectors
        float gb[kLanes] = {}, ub[kLanes] = {};
        for (int64_t j = i; j < n; ++j) {
            gb[j - i] = static_cast<float>(g[j]);
            ub[j - i] = static_cast<float>(u[j]);
        }
        const v16 gv = load16(gb);
        const v16 ov = round_bf16(gv / (splat(1.0f) + exp16(-gv))) * load16(ub);
        for (int64_t j = i; j < n; ++j) o[j] = static_cast<bf16>(ov[j - i]);
    }
}

// rope_head for bf16 values: float32 maths in torch's order (mul, mul, add, no fma), one
// rounding to bf16 at the end, as the torch path's x.float() ... .to(bfloat16).
__attribute__((optimize("fp-contract=off"))) void rope_head(const bf16* x, const float* c,
                                                            const float* s, bf16* o, int64_t d) {
    const int64_t h = d / 2;
    int64_t i = 0;
    for (; i + kLanes <= h; i += kLanes) {
        const v16 a = load16(x + i), b = load16(x + i + h);
        store16(o + i, a * load16(c + i) + (-b) * load16(s + i));
        store16(o + i + h, b * load16(c + i + h) + a * load16(s + i + h));
    }
    for (; i < h; ++i) {
        const float a = static_cast<float>(x[i]), b = static_cast<float>(x[i + h]);
        o[i] = static_cast<bf16>(a * c[i] + (-b) * s[i]);
        o[i + h] = static_cast<bf16>(b * c[i + h] + a * s[i + h]);
    }
}

int64_t grain_rows(int64_t cols) { return std::max<int64_t>(1, kGrainElems / std::max<int64_t>(1, cols)); }

// body(begin, end) over rows [0, rows): one call on the calling thread up to a grain, else
// chunks of a quarter grain claimed by the threads, so they finish within one chunk of each
// other and a thread that loses its core holds back one chunk.
template <typename Body>
void over_rows(int64_t rows, int64_t cols, const Body& body) {
    const int64_t grain = grain_rows(cols);
    if (rows <= grain) {
        body(0, rows);
        return;
    }
    parallel_claim(rows, std::max<int64_t>(1, grain / 4), [&](Claim& claim) {
        for (int64_t begin = 0, end = 0; claim(begin, end);) body(begin, end);
    });
}

at::ScalarType row_dtype(const torch::Tensor& t, const char* name) {
    const auto dtype = t.scalar_type();
    TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, name,
                " must be float32 or bfloat16");
    return dtype;
}

template <typename T>
void add_rms_norm_rows(T* xp, const T* dp, const T* wp, float e, T* op, int64_t rows,
                       int64_t n) {
    over_rows(rows, n, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r)
            add_rms_norm_row(xp + r * n, dp ? dp + r * n : nullptr, wp, e, op + r * n, n);
    });
}

template <typename T>
void silu_mul_rows(const T* gp, T* op, int64_t rows, int64_t n) {
    over_rows(rows, n, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r)
            silu_mul_row(gp + r * 2 * n, gp + r * 2 * n + n, op + r * n, n);
    });
}

template <typename T>
void rope_store_rows(const T* xp, const float* cp, const float* snp, T* qp, T* kc, T* vc,
                     const int64_t* sp, int64_t t, int64_t width, int64_t n_q_heads,
                     int64_t nkv, int64_t d) {
    const int64_t kv_row = nkv * d;
    over_rows(t, width, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
            const T* x = xp + i * width;
            const float* c = cp + i * d;
            const float* s = snp + i * d;
            T* qr = qp + i * n_q_heads * d;
            for (int64_t h = 0; h < n_q_heads; ++h) rope_head(x + h * d, c, s, qr + h * d, d);
            T* kr = kc + sp[i] * kv_row;
            const T* xk = x + n_q_heads * d;
            for (int64_t h = 0; h < nkv; ++h) rope_head(xk + h * d, c, s, kr + h * d, d);
            std::memcpy(vc + sp[i] * kv_row, xk + kv_row, kv_row * sizeof(T));
        }
    });
}

}  // namespace

torch::Tensor add_rms_norm(torch::Tensor& x, const c10::optional<torch::Tensor>& delta,
                           const torch::Tensor& weight, double eps) {
    const auto dtype = row_dtype(x, "x");
    check_rows(x, "x", dtype);
    const int64_t rows = x.size(0), n = x.size(1);
    TORCH_CHECK(weight.dim() == 1 && weight.size(0) == n && weight.is_contiguous() &&
                    weight.scalar_type() == dtype,
                "weight must be [cols] of x's dtype, contiguous");
    if (delta.has_value()) {
        check_rows(*delta, "delta", dtype);
        TORCH_CHECK(delta->sizes() == x.sizes(), "delta must have x's shape");
    }
    auto out = torch::empty_like(x);
    const float e = static_cast<float>(eps);
    if (dtype == at::kFloat) {
        add_rms_norm_rows(x.data_ptr<float>(), delta ? delta->data_ptr<float>() : nullptr,
                          weight.data_ptr<float>(), e, out.data_ptr<float>(), rows, n);
    } else {
        add_rms_norm_rows(x.data_ptr<bf16>(), delta ? delta->data_ptr<bf16>() : nullptr,
                          weight.data_ptr<bf16>(), e, out.data_ptr<bf16>(), rows, n);
    }
    return out;
}

torch::Tensor silu_mul(const torch::Tensor& gate_up, int64_t n) {
    const auto dtype = row_dtype(gate_up, "gate_up");
    check_rows(gate_up, "gate_up", dtype);
    TORCH_CHECK(gate_up.size(1) == 2 * n, "gate_up must be [rows, 2 * n]");
    const int64_t rows = gate_up.size(0);
    auto out = torch::empty({rows, n}, gate_up.options());
    if (dtype == at::kFloat)
        silu_mul_rows(gate_up.data_ptr<float>(), out.data_ptr<float>(), rows, n);
    else
        silu_mul_rows(gate_up.data_ptr<bf16>(), out.data_ptr<bf16>(), rows, n);
    return out;
}

torch::Tensor rope_store(const torch::Tensor& qkv, const torch::Tensor& cos,
                         const torch::Tensor& sin, int64_t n_q_heads, torch::Tensor& k_cache,
                         torch::Tensor& v_cache, const torch::Tensor& slot_mapping) {
    const auto dtype = row_dtype(qkv, "qkv");
    check_rows(qkv, "qkv", dtype);
    const int64_t t = qkv.size(0);
    TORCH_CHECK(k_cache.dim() == 3 && k_cache.sizes() == v_cache.sizes(),
                "k_cache and v_cache must be [slots, kv_heads, head_dim] alike");
    for (const auto* c : {&k_cache, &v_cache})
        TORCH_CHECK(c->scalar_type() == dtype && c->is_contiguous() && !c->is_cuda(),
                    "caches must be contiguous CPU tensors of qkv's dtype");
    const int64_t slots = k_cache.size(0), nkv = k_cache.size(1), d = k_cache.size(2);
    TORCH_CHECK(d % 2 == 0, "head_dim must be even");
    TORCH_CHECK(qkv.size(1) == (n_q_heads + 2 * nkv) * d, "qkv must be [T, (H + 2 * KVH) * D]");
    for (const auto* r : {&cos, &sin})
        TORCH_CHECK(r->scalar_type() == at::kFloat && r->is_contiguous() && !r->is_cuda() &&
                        r->numel() == t * d && r->size(0) == t,
                    "cos and sin must be contiguous float32 [T, (1,) head_dim]");
    TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == t &&
                    slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(),
                "slot_mapping must be int64 [T], contiguous");
    const int64_t* sp = slot_mapping.data_ptr<int64_t>();
    // Every slot checked before any is written: a bad mapping writes nothing.
    for (int64_t i = 0; i < t; ++i)
        TORCH_CHECK(sp[i] >= 0 && sp[i] < slots, "slot ", sp[i], " out of range [0, ", slots, ")");
    auto q = torch::empty({t, n_q_heads, d}, qkv.options());
    const float* cp = cos.data_ptr<float>();
    const float* snp = sin.data_ptr<float>();
    const int64_t width = qkv.size(1);
    if (dtype == at::kFloat)
        rope_store_rows(qkv.data_ptr<float>(), cp, snp, q.data_ptr<float>(),
                        k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), sp, t, width,
                        n_q_heads, nkv, d);
    else
        rope_store_rows(qkv.data_ptr<bf16>(), cp, snp, q.data_ptr<bf16>(),
                        k_cache.data_ptr<bf16>(), v_cache.data_ptr<bf16>(), sp, t, width,
                        n_q_heads, nkv, d);
    return q;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    // The GIL is released while a kernel runs, as torch releases it for its own ops: the
    // server's event loop must keep streaming tokens while the engine thread computes.
    const auto nogil = py::call_guard<py::gil_scoped_release>();
    m.def("add_rms_norm", &add_rms_norm, nogil,
          "x += delta (in place); returns rmsnorm(x) * weight");
    m.def("silu_mul", &silu_mul, nogil, "silu(gate_up[:, :n]) * gate_up[:, n:]");
    m.def("rope_store", &rope_store, nogil,
          "rotates q and k of qkv, writes k and v to the caches' rows slot_mapping; returns q");
}
