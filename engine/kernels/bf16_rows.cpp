// bf16 products of a few rows, y = x @ w.T + bias, for decode steps of 2-16 sequences on CPUs with
// AVX512-BF16. torch's choices there are poor on this kind of CPU: oneDNN spends 1.4-2.7x a one-row
// product on 4-16 rows (bench/bf16_rows.py, 2 threads), and torch's own matrix-vector kernel
// (single_row_products) runs row by row. Here every weight byte is read from memory once per call,
// whatever the row count, and multiplied against all rows while in L1:
//
//   x (M, K) bf16 is first laid out in 32-wide k-slices, each slice holding that slice of every row
//   (one contiguous 64-byte line per row and slice: rows at a power-of-two stride would share L1 sets);
//   w (N, K) bf16 is taken as it is (a mapped checkpoint, no repacking), 4 output rows at a time;
//   for each 4-row weight tile, K is cut into blocks small enough that the block's slices of x stay
//   in L1 (~16 KB), and within a block every group of 4 x rows runs a 4x4 register tile of
//   VDPBF16PS (16 fp32 accumulators, each summing 32-element pair products), reduced to 4 sums at once;
//   the tile's weights further on are prefetched, a quarter of them by each group, so the memory
//   stream stays even while the later groups reuse the tile from L1.
//
// Accuracy: products of bf16 values are exact in fp32; sums are fp32 in a different order than
// oneDNN's, the result (plus bias, in fp32) rounds once to bf16 (nearest even): the same error class
// as F.linear (tests/test_bf16_rows.py holds both to a float64 reference). VDPBF16PS treats bf16
// subnormal inputs as zero, as oneDNN's AVX512-BF16 kernels do.
//
//   linear(x, w, bias) -> (M, N) bf16   when applies(x, w), else at::linear(x, w, bias) (the caller need
//                                        not check: engine/model.py and decode_block.cpp call this)
//   applies(x, w)                        x (M, K) bf16 contiguous, 2 <= M <= MAX_ROWS (16); w (N, K) bf16
//                                        contiguous; K % 32 == 0; the CPU has AVX512-BF16
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace bf16_rows {

// Up to 16 rows, a decode step of 16 sequences; prefill chunks keep oneDNN. (Before the kernels were built
// with OpenMP this kernel ran on one core and lost to oneDNN at 5-8 rows of wide weights and at 16 rows;
// on two it no longer does: bench/bf16_rows.py.)
constexpr int64_t MAX_ROWS = 16;
constexpr int64_t SLICE = 32;            // bf16 values per VDPBF16PS operand
constexpr int64_t X_BLOCK_BYTES = 16384;  // the slices of x one K block keeps in L1
// Weights are prefetched this many values ahead in a row (8 KB), or one 4-row tile ahead where that is
// further (K > 1024): the same place in the next tile. At 16 rows the shorter distance left the down
// projections (K = 2816) at 380-410 us against 300-310 (1024x2816, 2 threads, throwaway A/B).
constexpr int64_t PREFETCH = 4096;

#define LAYERSTREAM_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")))

// Sums of the 16 lanes of a, b, c, d, as one 4-lane vector.
LAYERSTREAM_BF16_TARGET inline __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512 abcd = _mm512_add_ps(
      _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))),
      _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))));
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(abcd), _mm512_extractf32x8_ps(abcd, 1));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// part[m][n] (+)= x rows [0, MB) . w rows [0, NB) over k in [k0, k1). xs: the packed x at this group's
// first row, each slice `slice_stride` values apart; w: the tile's first weight row, rows K apart.
// The group prefetches weight rows g, g + G, ... of the tile, `ahead` values ahead.
template <int MB, int NB>
LAYERSTREAM_BF16_TARGET inline void tile(const uint16_t* xs, int64_t slice_stride, const uint16_t* w, int64_t K,
                                         int64_t k0, int64_t k1, int g, int G, float (*part)[4]) {
  const int64_t ahead = std::max(PREFETCH, 4 * K);  // at least the same place in the next 4-row tile
  __m512 acc[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int n = 0; n < NB; ++n) acc[m][n] = _mm512_setzero_ps();
  for (int64_t k = k0; k < k1; k += SLICE) {
    __m512bh wv[NB];
    for (int n = 0; n < NB; ++n) wv[n] = (__m512bh)_mm512_loadu_si512(w + n * K + k);
    for (int n = g; n < NB; n += G) _mm_prefetch(reinterpret_cast<const char*>(w + n * K + k + ahead), _MM_HINT_T0);
    const uint16_t* xk = xs + (k / SLICE) * slice_stride;
    for (int m = 0; m < MB; ++m) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(xk + m * SLICE);
      for (int n = 0; n < NB; ++n) acc[m][n] = _mm512_dpbf16_ps(acc[m][n], xv, wv[n]);
    }
  }
  for (int m = 0; m < MB; ++m) {
    if constexpr (NB == 4) {
      _mm_storeu_ps(part[m], _mm_add_ps(_mm_loadu_ps(part[m]), sum4(acc[m][0], acc[m][1], acc[m][2], acc[m][3])));
    } else {
      for (int n = 0; n < NB; ++n) part[m][n] += _mm512_reduce_add_ps(acc[m][n]);
    }
  }
}

template <int NB>
LAYERSTREAM_BF16_TARGET void column_tile(const uint16_t* xp, int64_t M, int64_t K, int64_t block, const uint16_t* w,
                                         float (*part)[4]) {
  const int G = static_cast<int>((M + 3) / 4);
  for (int64_t k0 = 0; k0 < K; k0 += block) {
    const int64_t k1 = std::min(K, k0 + block);
    for (int64_t m = 0; m < M; m += 4) {
      const uint16_t* xs = xp + m * SLICE;
      const int g = static_cast<int>(m / 4);
      switch (std::min<int64_t>(4, M - m)) {
        case 4: tile<4, NB>(xs, M * SLICE, w, K, k0, k1, g, G, part + m); break;
        case 3: tile<3, NB>(xs, M * SLICE, w, K, k0, k1, g, G, part + m); break;
        case 2: tile<2, NB>(xs, M * SLICE, w, K, k0, k1, g, G, part + m); break;
        default: tile<1, NB>(xs, M * SLICE, w, K, k0, k1, g, G, part + m); break;
      }
    }
  }
}

// fp32 -> bf16, round to nearest even (NaN stays NaN): the rounding torch's bf16 results get.
LAYERSTREAM_BF16_TARGET inline uint16_t to_bf16(float v) {
  return static_cast<uint16_t>(_mm_cvtsi128_si32((__m128i)_mm_cvtneps_pbh(_mm_set1_ps(v))) & 0xFFFF);
}

// v + bias[n] (bias in fp32), rounded once to bf16; bias may be null.
LAYERSTREAM_BF16_TARGET inline uint16_t with_bias(float v, const uint16_t* bias, int64_t n) {
  if (bias != nullptr) {
    const uint32_t bits = static_cast<uint32_t>(bias[n]) << 16;
    float b;
    std::memcpy(&b, &bits, sizeof(b));
    v += b;
  }
  return to_bf16(v);
}

LAYERSTREAM_BF16_TARGET void run(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t N,
                                 const uint16_t* bias, uint16_t* y) {
  // x in k-slices: xp[s][m][0..32) = x[m][32 s .. 32 s + 32)
  std::vector<uint16_t> packed(M * K);
  uint16_t* xp = packed.data();
  for (int64_t s = 0; s < K / SLICE; ++s)
    for (int64_t m = 0; m < M; ++m)
      std::memcpy(xp + (s * M + m) * SLICE, x + m * K + s * SLICE, SLICE * sizeof(uint16_t));
  const int64_t block = std::max<int64_t>(SLICE, X_BLOCK_BYTES / (2 * M) / SLICE * SLICE);
  const int64_t tiles = (N + 3) / 4;
  at::parallel_for(0, tiles, 8, [&](int64_t t0, int64_t t1) {
    float part[MAX_ROWS][4];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * 4, nb = std::min<int64_t>(4, N - n0);
      std::memset(part, 0, sizeof(part));
      const uint16_t* wt = w + n0 * K;
      switch (nb) {
        case 4: column_tile<4>(xp, M, K, block, wt, part); break;
        case 3: column_tile<3>(xp, M, K, block, wt, part); break;
        case 2: column_tile<2>(xp, M, K, block, wt, part); break;
        default: column_tile<1>(xp, M, K, block, wt, part); break;
      }
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < nb; ++n) y[m * N + n0 + n] = with_bias(part[m][n], bias, n0 + n);
    }
  });
}

bool cpu_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512bf16");
}

// The CPU, checked once per process (LAYERSTREAM_BF16_ROWS=off is decided in Python: bf16_rows.py).
bool enabled() {
  static const bool on = cpu_supported();
  return on;
}

bool applies(const at::Tensor& x, const at::Tensor& w) {
  if (!(enabled() && x.device().is_cpu() && w.device().is_cpu() && x.scalar_type() == at::kBFloat16 &&
        w.scalar_type() == at::kBFloat16 && x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1) &&
        x.size(1) % SLICE == 0 && x.is_contiguous() && w.is_contiguous())) {
    return false;
  }
  return x.size(0) >= 2 && x.size(0) <= MAX_ROWS;
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  const bool with_bias = bias.has_value() && bias->defined();
  if (!applies(x, w) || (with_bias && (bias->scalar_type() != at::kBFloat16 || bias->dim() != 1 ||
                                       bias->size(0) != w.size(0) || !bias->is_contiguous()))) {
    return at::linear(x, w, bias);
  }
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  run(reinterpret_cast<const uint16_t*>(x.data_ptr()), M, K, reinterpret_cast<const uint16_t*>(w.data_ptr()), N,
      with_bias ? reinterpret_cast<const uint16_t*>(bias->data_ptr()) : nullptr,
      reinterpret_cast<uint16_t*>(y.data_ptr()));
  return y;
}

}  // namespace bf16_rows

// decode_block.cpp includes this file for bf16_rows::linear and defines its own module.
#ifndef LAYERSTREAM_NO_MODULE
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear", &bf16_rows::linear, "x @ w.T + bias for 2-16 bf16 rows, else at::linear",
        py::arg("x"), py::arg("w"), py::arg("bias") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.def("applies", &bf16_rows::applies, "whether linear runs this kernel for (x, w)");
  m.def("cpu_supported", &bf16_rows::cpu_supported, "whether this CPU has AVX512 F/BW/DQ/VL and AVX512-BF16");
  m.attr("MAX_ROWS") = bf16_rows::MAX_ROWS;
}
#endif
