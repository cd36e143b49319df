// A float exp that vectorizes, and softmax's numerators over a row with it, shared by the kernels that #include this header (fused_ops.cpp,
// kv_attention.cpp; decode_block.cpp through fused_ops.cpp). Their Python loaders list it in INCLUDES, so
// a change here rebuilds them.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

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

// p = exp(s - mx) over one row of scores, in place; returns their sum. Separate loops and 16 partial
// sums, so that each vectorizes (glibc's expf is a scalar call, and a row is the context's length).
// Always inlined: each caller's instruction set compiles it.
__attribute__((always_inline)) inline float exp_numerators(float* s, int64_t n, float mx) {
  for (int64_t j = 0; j < n; ++j) s[j] = exp_approx(s[j] - mx);
  constexpr int L = 16;
  float part[L] = {0};
  int64_t j = 0;
  for (; j + L <= n; j += L)
    for (int l = 0; l < L; ++l) part[l] += s[j + l];
  float sum = 0;
  for (int l = 0; l < L; ++l) sum += part[l];
  for (; j < n; ++j) sum += s[j];
  return sum;
}

// The same against the row's own max.
__attribute__((target_clones("avx512f", "avx2", "default")))
float softmax_numerators(float* s, int64_t n) {
  float mx = -INFINITY;
  for (int64_t j = 0; j < n; ++j) mx = s[j] > mx ? s[j] : mx;
  return exp_numerators(s, n, mx);
}
