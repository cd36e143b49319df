// y = x @ W.T for a 4-bit weight with a (scale, min) per 32 weights, the way llama.cpp multiplies
// Q4_0/Q4_1/Q4_K: the activations are quantized on the fly to int8 per 32 values (one scale per
// group, and the group's exact float sum for the min term), the 4-bit codes (u8) times the int8
// activations (s8) are summed exactly with AVX512-VNNI (vpdpbusd), and the groups are combined in
// fp32:
//   y[m, n] = sum_g  d[n,g] * dx[m,g] * sum_i q[n,32g+i] * xq[m,32g+i]   +   min[n,g] * sx[m,g]
// with w = d * q + min (q in 0..15), xq = round(x / dx) in -127..127, dx = max|x| / 127 over the
// group, sx = sum of x over the group. tests/test_int4_kernel.py holds the same math in torch.
//
// Weight layout (engine/weights/packed.py, Int4Weight "vnni"):
//   qs        (N, K/2) uint8: per group of 32, 16 bytes, byte j = q[j] | q[j+16] << 4
//             (ggml's order: a Q4_0/Q4_1 block's 16 code bytes as they are in the file)
//   scale_min (N, 2, K/32) fp16: each row's group scales, then its group mins
// K must be a multiple of 32; it need not be one of 128 (4 groups per 512-bit step: the last
// step is masked).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t GROUP = 32;
constexpr int64_t CHUNK = 4;   // groups per 512-bit step
constexpr int64_t MTILE = 8;   // activation rows multiplied per pass over a weight row
constexpr int64_t ROW_BLOCK = 16;  // weight rows kept hot while every activation tile passes

// Quantized activations of M rows. Per row, C = ceil(G/4) chunks of 128 bytes: the first 16
// values of each of the chunk's 4 groups (64 bytes, matching the low nibbles of the weight's
// 64 code bytes), then their last 16 values. Groups past G are zero.
struct QuantX {
  int64_t M, G, C, G16;
  std::vector<int8_t> q;    // (M, C, 128)
  std::vector<float> dxv;   // (M, C, 16): each group's scale on its 4 int32 lanes
  std::vector<float> sx;    // (M, G16): each group's sum of x, zero past G
};

template <typename T> inline __m512 load16(const T* p);
template <> inline __m512 load16<float>(const float* p) { return _mm512_loadu_ps(p); }
template <> inline __m512 load16<c10::BFloat16>(const c10::BFloat16* p) {
  __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}
template <> inline __m512 load16<c10::Half>(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

template <typename T>
void quantize_rows(const T* x, int64_t M, int64_t K, QuantX& X) {
  const int64_t G = K / GROUP;
  X.M = M; X.G = G; X.C = (G + CHUNK - 1) / CHUNK; X.G16 = (G + 15) / 16 * 16;
  X.q.assign(M * X.C * 128, 0);
  X.dxv.assign(M * X.C * 16, 0.f);
  X.sx.assign(M * X.G16, 0.f);
  for (int64_t m = 0; m < M; ++m) {
    const T* xr = x + m * K;
    for (int64_t g = 0; g < G; ++g) {
      __m512 a = load16(xr + g * GROUP), b = load16(xr + g * GROUP + 16);
      float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
      float inv = amax > 0.f ? 127.f / amax : 0.f;
      __m512 vinv = _mm512_set1_ps(inv);
      // cvtps rounds to nearest even (the default MXCSR mode), as torch.round does.
      __m128i qa = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(a, vinv)));
      __m128i qb = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(b, vinv)));
      int8_t* chunk = X.q.data() + (m * X.C + g / CHUNK) * 128 + (g % CHUNK) * 16;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(chunk), qa);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(chunk + 64), qb);
      float dx = amax / 127.f;
      float* dv = X.dxv.data() + (m * X.C + g / CHUNK) * 16 + (g % CHUNK) * 4;
      dv[0] = dv[1] = dv[2] = dv[3] = dx;
      X.sx[m * X.G16 + g] = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
    }
  }
}

template <typename T> inline T from_float(float v) { return static_cast<T>(v); }

// Rows [n0, n1) of y for activation rows [m0, m0 + MT).
template <int MT, typename T>
void rows_kernel(const uint8_t* qs, const uint16_t* sm, const float* bias, const QuantX& X,
                 int64_t n0, int64_t n1, int64_t m0, int64_t N, T* y) {
  const int64_t G = X.G, C = X.C, full = G / CHUNK, rem = G % CHUNK;
  const __m512i low = _mm512_set1_epi8(0x0F);
  const __m512i lanes = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  const __mmask64 tail_bytes = rem ? (~0ULL >> (64 - 16 * rem)) : 0;
  const __mmask8 tail_groups = static_cast<__mmask8>((1u << rem) - 1);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* w = qs + n * G * 16;
    const uint16_t* d = sm + n * 2 * G;
    const uint16_t* mn = d + G;
    __m512 acc[MT];
    for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
    auto step = [&](int64_t c, __m512i wv, __m128i d4) {
      const __m512i wl = _mm512_and_si512(wv, low);
      const __m512i wh = _mm512_and_si512(_mm512_srli_epi16(wv, 4), low);
      const __m512 dv = _mm512_permutexvar_ps(lanes, _mm512_castps128_ps512(_mm_cvtph_ps(d4)));
      for (int m = 0; m < MT; ++m) {
        const int8_t* xq = X.q.data() + ((m0 + m) * C + c) * 128;
        __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wl, _mm512_loadu_si512(xq));
        s = _mm512_dpbusd_epi32(s, wh, _mm512_loadu_si512(xq + 64));
        const __m512 dx = _mm512_loadu_ps(X.dxv.data() + ((m0 + m) * C + c) * 16);
        acc[m] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(s), dx), dv, acc[m]);
      }
    };
    for (int64_t c = 0; c < full; ++c)
      step(c, _mm512_loadu_si512(w + c * 64), _mm_loadl_epi64(reinterpret_cast<const __m128i*>(d + c * CHUNK)));
    if (rem)
      step(full, _mm512_maskz_loadu_epi8(tail_bytes, w + full * 64), _mm_maskz_loadu_epi16(tail_groups, d + full * CHUNK));
    // The min term: sum over groups of min * (sum of x), 16 groups at a time.
    for (int64_t g = 0; g < G; g += 16) {
      const __mmask16 k = static_cast<__mmask16>(G - g >= 16 ? 0xFFFF : ((1u << (G - g)) - 1));
      const __m512 mv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, mn + g));
      for (int m = 0; m < MT; ++m)
        acc[m] = _mm512_fmadd_ps(mv, _mm512_loadu_ps(X.sx.data() + (m0 + m) * X.G16 + g), acc[m]);
    }
    const float b = bias ? bias[n] : 0.f;
    for (int m = 0; m < MT; ++m) y[(m0 + m) * N + n] = from_float<T>(_mm512_reduce_add_ps(acc[m]) + b);
  }
}

template <typename T>
void tile(int64_t mt, const uint8_t* qs, const uint16_t* sm, const float* bias, const QuantX& X,
          int64_t n0, int64_t n1, int64_t m0, int64_t N, T* y) {
  switch (mt) {
    case 1: return rows_kernel<1>(qs, sm, bias, X, n0, n1, m0, N, y);
    case 2: return rows_kernel<2>(qs, sm, bias, X, n0, n1, m0, N, y);
    case 3: return rows_kernel<3>(qs, sm, bias, X, n0, n1, m0, N, y);
    case 4: return rows_kernel<4>(qs, sm, bias, X, n0, n1, m0, N, y);
    case 5: return rows_kernel<5>(qs, sm, bias, X, n0, n1, m0, N, y);
    case 6: return rows_kernel<6>(qs, sm, bias, X, n0, n1, m0, N, y);
    case 7: return rows_kernel<7>(qs, sm, bias, X, n0, n1, m0, N, y);
    default: return rows_kernel<8>(qs, sm, bias, X, n0, n1, m0, N, y);
  }
}

template <typename T>
void run(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& sm, const float* bias, at::Tensor& y) {
  const int64_t K = x.size(1), M = x.size(0), N = qs.size(0);
  thread_local QuantX X;  // reused across calls: no allocation per matmul once warm
  quantize_rows(x.data_ptr<T>(), M, K, X);
  const uint8_t* w = qs.data_ptr<uint8_t>();
  const uint16_t* s = reinterpret_cast<const uint16_t*>(sm.data_ptr<at::Half>());
  T* out = y.data_ptr<T>();
  // Enough rows per task that a task's weights (~K/2 bytes a row) are worth a thread hand-off.
  const int64_t grain = std::max<int64_t>(ROW_BLOCK, (int64_t(1) << 16) / std::max<int64_t>(K, 1));
  const QuantX& Xr = X;  // worker threads read the caller's buffers
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t r = n0; r < n1; r += ROW_BLOCK) {
      const int64_t r1 = std::min(n1, r + ROW_BLOCK);
      for (int64_t m0 = 0; m0 < M; m0 += MTILE)
        tile<T>(std::min(MTILE, M - m0), w, s, bias, Xr, r, r1, m0, N, out);
    }
  });
}

at::Tensor int4_linear(const at::Tensor& x_in, const at::Tensor& qs, const at::Tensor& scale_min,
                       const c10::optional<at::Tensor>& bias_in) {
  TORCH_CHECK(x_in.device().is_cpu(), "int4_linear: x must be on the CPU");
  TORCH_CHECK(qs.dtype() == at::kByte && qs.dim() == 2 && qs.is_contiguous(), "int4_linear: qs must be contiguous (N, K/2) uint8");
  const int64_t N = qs.size(0), K = qs.size(1) * 2;
  TORCH_CHECK(K % GROUP == 0, "int4_linear: K = ", K, " is not a multiple of ", GROUP);
  TORCH_CHECK(scale_min.dtype() == at::kHalf && scale_min.is_contiguous() && scale_min.dim() == 3 &&
              scale_min.size(0) == N && scale_min.size(1) == 2 && scale_min.size(2) == K / GROUP,
              "int4_linear: scale_min must be contiguous (N, 2, K/32) float16");
  TORCH_CHECK(x_in.size(-1) == K, "int4_linear: x has ", x_in.size(-1), " features, the weight ", K);
  auto dtype = x_in.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "int4_linear: x must be float32, bfloat16 or float16");
  at::Tensor x = x_in.reshape({-1, K}).contiguous();  // (M, K)
  std::vector<int64_t> out_shape(x_in.sizes().begin(), x_in.sizes().end());
  out_shape.back() = N;
  at::Tensor y = at::empty({x.size(0), N}, x.options());  // (M, N)
  at::Tensor bias;
  if (bias_in.has_value() && bias_in->defined()) {
    TORCH_CHECK(bias_in->numel() == N, "int4_linear: bias has ", bias_in->numel(), " values, expected ", N);
    bias = bias_in->to(at::kFloat).contiguous();
  }
  const float* b = bias.defined() ? bias.data_ptr<float>() : nullptr;
  if (x.size(0) > 0) {
    if (dtype == at::kFloat) run<float>(x, qs, scale_min, b, y);
    else if (dtype == at::kBFloat16) run<c10::BFloat16>(x, qs, scale_min, b, y);
    else run<c10::Half>(x, qs, scale_min, b, y);
  }
  return y.view(out_shape);
}

bool cpu_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int4_linear", &int4_linear, "y = x @ W.T, W 4-bit with a (scale, min) per 32, x quantized to int8 per 32",
        py::arg("x"), py::arg("qs"), py::arg("scale_min"), py::arg("bias") = py::none());
  m.def("cpu_supported", &cpu_supported, "whether this CPU has AVX512F/BW/VL and AVX512-VNNI");
}
