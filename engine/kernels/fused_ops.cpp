// Small fused CPU ops for a decode step, each one call instead of the 2-8 torch ops engine/model.py
// would otherwise dispatch (at decode each of those ops costs more in dispatch than in arithmetic).
// Each computes what the torch code in engine/model.py computes, op by op, with the same roundings:
// values are widened to fp32, every torch op's result is rounded to the tensor dtype where torch
// would round it, and the build turns off FMA contraction (-ffp-contract=off) so a*b + c rounds
// twice as torch's separate mul and add do. What can differ: the order of the fp32 sum in RMSNorm's
// mean and SiLU's exp (ours within 2 ulp, torch's Sleef within 1) (fp32 results within ~1e-6; a bf16 result then rounds the same
// way or, rarely, one ulp apart). tests/test_fused_ops.py holds both sides.
//
//   rms_norm(x, w, eps)            y = w * (x32 * rsqrt(mean(x32^2) + eps)).to(dtype)     (rows, n)
//   add_rms_norm(x, r, w, eps)     h = x + r; y = rms_norm(h, w, eps); returns (h, y)
//   silu_mul(g, u)                 silu(g) * u                                             (rows, n)
//   rotary(x, cos, sin)            x * cos + roll(x, hd / 2, -1) * sin   x: (tokens, heads, hd),
//                                  cos, sin: (tokens, 1, hd)
// Tensors: CPU, float32 / bfloat16 / float16, all of one dtype, last dimension contiguous (rows may
// be strided, e.g. the halves of a stacked gate/up output); outputs are new contiguous tensors.

#include <torch/extension.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstring>
#include <type_traits>
#include <cstdint>
#include <tuple>
#include <vector>

namespace {

// The value torch stores when an fp32 result is written to a tensor of dtype T.
template <typename T> inline float round_to(float v) { return static_cast<float>(static_cast<T>(v)); }
template <> inline float round_to<float>(float v) { return v; }

void check(const torch::Tensor& t, const char* name, const torch::Tensor& like) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.scalar_type() == like.scalar_type(), name, " must have dtype ", like.scalar_type(),
              ", got ", t.scalar_type());
  TORCH_CHECK(t.dim() >= 1 && t.stride(-1) == 1, name, " must be contiguous in its last dimension");
}

// The row stride of x viewed as (rows, n), or -1 when its leading dimensions do not collapse into
// one stride (e.g. per-head q viewed out of a stacked qkv row): the caller then takes a contiguous copy.
int64_t row_stride(const torch::Tensor& x) {
  const int64_t n = x.size(-1);
  if (x.dim() == 1) return n;
  const int64_t stride = x.stride(-2);
  int64_t expect = stride;
  for (int64_t d = x.dim() - 2; d >= 0; --d) {
    if (x.size(d) != 1 && x.stride(d) != expect) return -1;
    expect *= x.size(d);
  }
  return stride;
}

torch::Tensor as_rows(const torch::Tensor& x) { return row_stride(x) < 0 ? x.contiguous() : x; }

int64_t rows_of(const torch::Tensor& x) { return x.size(-1) == 0 ? 0 : x.numel() / x.size(-1); }

// One row of RMSNorm over fp32 values h (already rounded to T), written to y as T.
template <typename T>
void norm_row(const float* h, const T* w, T* y, int64_t n, float eps) {
  constexpr int L = 16;  // independent partial sums the compiler keeps in one vector register
  float acc[L] = {0};
  int64_t i = 0;
  for (; i + L <= n; i += L)
    for (int j = 0; j < L; ++j) acc[j] += h[i + j] * h[i + j];
  float sum = 0;
  for (int j = 0; j < L; ++j) sum += acc[j];
  for (; i < n; ++i) sum += h[i] * h[i];
  const float mean = sum / static_cast<float>(n);  // torch's mean: the fp32 sum divided by n
  const float r = 1.0f / std::sqrt(mean + eps);    // torch's rsqrt on CPU: 1 / sqrt, two roundings
  for (int64_t k = 0; k < n; ++k) {
    const float normed = round_to<T>(h[k] * r);  // x32 * rsqrt(...), then .to(dtype)
    y[k] = static_cast<T>(static_cast<float>(w[k]) * normed);  // weight * that, in dtype
  }
}

template <typename T>
void rms_norm_impl(const torch::Tensor& x, const torch::Tensor* r, const torch::Tensor& w, torch::Tensor& h_out,
                   torch::Tensor& y, double eps) {
  const int64_t n = x.size(-1), rows = rows_of(x);
  const int64_t xs = row_stride(x), rs = r ? row_stride(*r) : 0;
  const T* xp = x.data_ptr<T>();
  const T* rp = r ? r->data_ptr<T>() : nullptr;
  const T* wp = w.data_ptr<T>();
  T* hp = r ? h_out.data_ptr<T>() : nullptr;
  T* yp = y.data_ptr<T>();
  std::vector<float> h(n);
  for (int64_t m = 0; m < rows; ++m) {
    const T* xr = xp + m * xs;
    if (rp) {
      const T* rr = rp + m * rs;
      for (int64_t k = 0; k < n; ++k) {
        const T s = static_cast<T>(static_cast<float>(xr[k]) + static_cast<float>(rr[k]));  // x + r in dtype
        hp[m * n + k] = s;
        h[k] = static_cast<float>(s);
      }
    } else {
      for (int64_t k = 0; k < n; ++k) h[k] = static_cast<float>(xr[k]);
    }
    norm_row<T>(h.data(), wp, yp + m * n, n, static_cast<float>(eps));
  }
}

std::vector<int64_t> out_shape(const torch::Tensor& x) { return x.sizes().vec(); }

torch::Tensor rms_norm(const torch::Tensor& x_in, const torch::Tensor& w, double eps) {
  check(x_in, "x", x_in);
  const torch::Tensor x = as_rows(x_in);
  check(w, "weight", x);
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(-1), "weight must be (", x.size(-1), ",), got ", w.sizes());
  auto y = torch::empty(out_shape(x), x.options());
  torch::Tensor none;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm",
                                  [&] { rms_norm_impl<scalar_t>(x, nullptr, w, none, y, eps); });
  return y;
}

std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(const torch::Tensor& x_in, const torch::Tensor& r_in,
                                                      const torch::Tensor& w, double eps) {
  check(x_in, "x", x_in);
  check(r_in, "r", x_in);
  const torch::Tensor x = as_rows(x_in), r = as_rows(r_in);
  check(w, "weight", x);
  TORCH_CHECK(r.sizes() == x.sizes(), "r must have x's shape ", x.sizes(), ", got ", r.sizes());
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(-1), "weight must be (", x.size(-1), ",), got ", w.sizes());
  auto h = torch::empty(out_shape(x), x.options());
  auto y = torch::empty(out_shape(x), x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm",
                                  [&] { rms_norm_impl<scalar_t>(x, &r, w, h, y, eps); });
  return {h, y};
}

// expf that the compiler vectorizes (glibc's expf is a scalar call, which made SiLU over 1536 values
// 3x slower than torch's vectorized one): Cephes' range reduction and degree-6 polynomial, within
// 2 ulp of the exact value like torch's own vectorized exp (Sleef, 1 ulp). Overflow gives inf as expf
// does; below -87.3 it flushes to 0, where silu(a) = a / (1 + exp(-a)) is a either way.
inline float exp_approx(float x) {
  const float big = x > 88.7228f ? INFINITY : 0.0f;
  x = x < -87.3365f ? -87.3365f : (x > 88.3763f ? 88.3763f : x);
  // n = round(x / ln 2) by the 1.5 * 2^23 trick: plain adds, which vectorize without SSE4.1's round
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return big > 0.0f ? big : p * scale;
}

// One row of silu(g) * u in fp32 from values widened from T; built for AVX-512, AVX2 and plain x86-64,
// picked at load by the CPU (the loop is the same C++; only the vector width changes).
__attribute__((target_clones("avx512f", "avx2", "default")))
void silu_mul_row(const float* g, const float* u, float* y, int64_t n, bool round_bf16, bool round_f16) {
  for (int64_t k = 0; k < n; ++k) y[k] = g[k] / (1.0f + exp_approx(-g[k]));
  if (round_bf16) for (int64_t k = 0; k < n; ++k) y[k] = round_to<c10::BFloat16>(y[k]);  // F.silu in dtype
  if (round_f16) for (int64_t k = 0; k < n; ++k) y[k] = round_to<c10::Half>(y[k]);
  for (int64_t k = 0; k < n; ++k) y[k] = y[k] * u[k];
}

template <typename T>
void silu_mul_impl(const torch::Tensor& g, const torch::Tensor& u, torch::Tensor& y) {
  const int64_t n = g.size(-1), rows = rows_of(g);
  const int64_t gs = row_stride(g), us = row_stride(u);
  const T* gp = g.data_ptr<T>();
  const T* up = u.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  std::vector<float> gf(n), uf(n), yf(n);
  for (int64_t m = 0; m < rows; ++m) {
    const T* gr = gp + m * gs;
    const T* ur = up + m * us;
    for (int64_t k = 0; k < n; ++k) gf[k] = static_cast<float>(gr[k]);
    for (int64_t k = 0; k < n; ++k) uf[k] = static_cast<float>(ur[k]);
    silu_mul_row(gf.data(), uf.data(), yf.data(), n, std::is_same_v<T, c10::BFloat16>, std::is_same_v<T, c10::Half>);
    T* yr = yp + m * n;
    for (int64_t k = 0; k < n; ++k) yr[k] = static_cast<T>(yf[k]);  // * up, in dtype
  }
}

torch::Tensor silu_mul(const torch::Tensor& g_in, const torch::Tensor& u_in) {
  check(g_in, "gate", g_in);
  check(u_in, "up", g_in);
  const torch::Tensor g = as_rows(g_in), u = as_rows(u_in);
  TORCH_CHECK(u.sizes() == g.sizes(), "up must have gate's shape ", g.sizes(), ", got ", u.sizes());
  auto y = torch::empty(out_shape(g), g.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, g.scalar_type(), "silu_mul",
                                  [&] { silu_mul_impl<scalar_t>(g, u, y); });
  return y;
}

template <typename T>
void rotary_impl(const torch::Tensor& x, const torch::Tensor& c, const torch::Tensor& s, torch::Tensor& y) {
  const int64_t tokens = x.size(0), heads = x.size(1), hd = x.size(2), half = hd / 2;
  const int64_t xt = x.stride(0), xh = x.stride(1), ct = c.stride(0), st = s.stride(0);
  const T* xp = x.data_ptr<T>();
  const T* cp = c.data_ptr<T>();
  const T* sp = s.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  for (int64_t t = 0; t < tokens; ++t) {
    const T* ctr = cp + t * ct;
    const T* str = sp + t * st;
    for (int64_t h = 0; h < heads; ++h) {
      const T* xr = xp + t * xt + h * xh;
      T* yr = yp + (t * heads + h) * hd;
      for (int64_t d = 0; d < hd; ++d) {
        // roll by half: element d of the rolled row is x[(d + half) % hd]
        const float a = round_to<T>(static_cast<float>(xr[d]) * static_cast<float>(ctr[d]));  // x * cos
        const float b = round_to<T>(static_cast<float>(xr[d < half ? d + half : d - half]) *
                                    static_cast<float>(str[d]));                             // rolled * sin
        yr[d] = static_cast<T>(a + b);
      }
    }
  }
}

torch::Tensor rotary(const torch::Tensor& x, const torch::Tensor& c, const torch::Tensor& s) {
  check(x, "x", x);
  check(c, "cos", x);
  check(s, "sin", x);
  TORCH_CHECK(x.dim() == 3 && x.size(2) % 2 == 0, "x must be (tokens, heads, even head_dim), got ", x.sizes());
  const std::vector<int64_t> table{x.size(0), 1, x.size(2)};
  TORCH_CHECK(c.sizes() == table && s.sizes() == table, "cos and sin must be ", c10::IntArrayRef(table),
              ", got ", c.sizes(), " and ", s.sizes());
  auto y = torch::empty(out_shape(x), x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rotary",
                                  [&] { rotary_impl<scalar_t>(x, c, s, y); });
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "w * (x * rsqrt(mean(x^2) + eps)) with fp32 accumulation");
  m.def("add_rms_norm", &add_rms_norm, "(h, rms_norm(h)) for h = x + r");
  m.def("silu_mul", &silu_mul, "silu(gate) * up");
  m.def("rotary", &rotary, "x * cos + roll(x, head_dim / 2) * sin");
}
