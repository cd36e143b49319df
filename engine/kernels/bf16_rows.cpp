// bf16 products of a few rows, y = x @ w.T + bias, for decode steps of 1-16 sequences on CPUs with
// AVX512-BF16. torch's choices there are poor on this kind of CPU: oneDNN spends 1.4-2.7x a one-row
// product on 4-16 rows (layerstream/bench/bf16_rows.py, 2 threads), and torch's own matrix-vector kernel
// (single_row_products) runs row by row. Here every weight byte is read from memory once per call,
// whatever the row count, and multiplied against all rows at once:
//
//   x (M, K) bf16 is first laid out as K/2 pairs, each pair of every row side by side: one vector
//   (8 rows in a ymm register, 16 in a zmm) per pair, row m in lane m;
//   w (N, K) bf16 is taken as it is (a mapped checkpoint, no repacking), 16 output rows (a tile) at a
//   time; for each pair of k, the x vector is loaded once and each of the tile's 16 outputs adds
//   VDPBF16PS(x vector, its own weight pair broadcast) into its accumulator: lane m of output n's
//   accumulator is y[m][n]. No horizontal sums, one x load per 16 instructions, and 16 weight rows
//   streamed side by side, 4 bytes of each per step;
//   the next tile's bytes are prefetched into L2 in address order, evenly over the k loop, so the
//   memory stream runs under the arithmetic.
//
// It replaced a 4x4-register-tile kernel (two 16-row tiles of x against 4 weight rows, horizontal sums
// per K block), which it beat at every shape and row count measured (`layerstream bench-bf16-rows`,
// docs/benchmarks/bf16-rows.md).
// The old kernel left the memory stream and the arithmetic serialised (a 2816x1024 product at 16 rows
// took about its in-cache time plus its memory time); prefetching each row's own lines ahead instead
// of the next tile in address order, or not prefetching, did the same in a throwaway A/B.
//
// Accuracy: products of bf16 values are exact in fp32; each output sums its K/2 pair products in
// fp32, in k order, a different order than oneDNN's; the result (plus bias, in fp32) rounds once to
// bf16 (nearest even): the same error class as F.linear (tests/kernels/test_bf16_rows.py holds both to a
// float64 reference). VDPBF16PS treats bf16 subnormal inputs as zero, as oneDNN's AVX512-BF16
// kernels do.
//
//   linear(x, w, bias) -> (M, N) bf16   when applies(x, w), else at::linear(x, w, bias) (the caller need
//                                        not check: engine/model.py and decode_block.cpp call this)
//   applies(x, w)                        x (M, K) bf16 contiguous, 1 <= M <= MAX_ROWS (16) (for M >= 2: K <=
//                                        4096, or K <= 8192 a multiple of 2048); w (N, K) bf16 contiguous;
//                                        K % 32 == 0; the CPU has AVX512-BF16
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "stream_prefetch.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace bf16_rows {

// Up to 16 rows, a decode step of 16 sequences; prefill chunks keep oneDNN.
constexpr int64_t MAX_ROWS = 16;
constexpr int64_t SLICE = 32;  // K must be a multiple of this: a k loop step reads one 64-byte line of each weight row
constexpr int64_t TILE = 16;   // weight rows per tile: 16 accumulators, one per output
constexpr int64_t MAX_PAIRED_K = 4096;  // the most inputs 2-16 rows take this kernel for (applies) ...
constexpr int64_t MAX_STAGED_K = 8192;  // ... or, where the tile stages its lines (staged), this many

#define LAYERSTREAM_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")))

// The vector a row lane lives in: 8 rows in a ymm register, 16 in a zmm (VDPBF16PS runs two ymm or one
// zmm per cycle here, the same arithmetic either way, so up to 8 rows pay for no idle lanes).
template <int L> struct Lanes;
template <> struct Lanes<8> {
  using V = __m256;
  LAYERSTREAM_BF16_TARGET static V zero() { return _mm256_setzero_ps(); }
  LAYERSTREAM_BF16_TARGET static V dot(V acc, const uint32_t* xp, uint32_t w) {
    return _mm256_dpbf16_ps(acc, (__m256bh)_mm256_load_si256(reinterpret_cast<const __m256i*>(xp)),
                            (__m256bh)_mm256_set1_epi32(static_cast<int>(w)));
  }
  LAYERSTREAM_BF16_TARGET static void store(float* out, V v) { _mm256_storeu_ps(out, v); }
};
template <> struct Lanes<16> {
  using V = __m512;
  LAYERSTREAM_BF16_TARGET static V zero() { return _mm512_setzero_ps(); }
  LAYERSTREAM_BF16_TARGET static V dot(V acc, const uint32_t* xp, uint32_t w) {
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_load_si512(xp), (__m512bh)_mm512_set1_epi32(static_cast<int>(w)));
  }
  LAYERSTREAM_BF16_TARGET static void store(float* out, V v) { _mm512_storeu_ps(out, v); }
};

inline uint32_t pair(const uint16_t* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// out[n][lane] = sum over k of x[lane][k] * w[n][k], for the TILE weight rows from w (rows K apart).
// xp holds x as K/2 pairs, each pair of every row lane: one vector load per pair, shared by the
// tile's 16 outputs, each of which multiplies it by its own broadcast weight pair. Accumulators are
// per output, lanes per row: no horizontal sums. `next` is the memory that follows (the next tile):
// its lines are prefetched into L2 (T1) in address order, evenly over this tile's k loop. Into L1
// (T0) it was 25% slower, two tiles ahead 15% (2816x1024 at 16 rows, throwaway A/B).
// STAGED: each k step first copies the tile's 16 lines (64 bytes of each row) side by side into a 1 KiB buffer,
// and the pairs are broadcast from there. Rows whose byte stride is a multiple of 4 KiB (K a multiple of 2048)
// all fall in one set of the first-level cache, which holds 8 to 12 lines of a set, so the 16 lines a step reads
// pair by pair evict one another (as the timings say: the CPUs here show no cache counters). Staged, the same
// products in the same order (bit-identical) no longer do; at other strides the copy only costs, so the tile
// stages there alone (docs/benchmarks/bf16-rows.md).
template <int L, bool STAGED>
LAYERSTREAM_BF16_TARGET inline void tile(const uint32_t* xp, const uint16_t* w, int64_t K, const char* next,
                                         float* out) {
  using T = Lanes<L>;
  typename T::V acc[TILE];
  for (int n = 0; n < TILE; ++n) acc[n] = T::zero();
  for (int64_t k0 = 0; k0 < K; k0 += SLICE) {
    for (int n = 0; n < TILE; ++n) _mm_prefetch(next + (k0 / SLICE) * (TILE * 64) + n * 64, _MM_HINT_T1);
    const uint32_t* xk = xp + (k0 / 2) * L;
    if constexpr (STAGED) {
      alignas(64) uint32_t lines[TILE][SLICE / 2];
      for (int n = 0; n < TILE; ++n) _mm512_store_si512(lines[n], _mm512_loadu_si512(w + n * K + k0));
      for (int p = 0; p < SLICE / 2; ++p, xk += L)
        for (int n = 0; n < TILE; ++n) acc[n] = T::dot(acc[n], xk, lines[n][p]);
    } else {
      const uint16_t* wa = w + k0;
      const uint16_t* wb = w + 8 * K + k0;
      for (int p = 0; p < SLICE / 2; ++p, xk += L, wa += 2, wb += 2) {
        for (int n = 0; n < 8; ++n) {
          acc[n] = T::dot(acc[n], xk, pair(wa + n * K));
          acc[n + 8] = T::dot(acc[n + 8], xk, pair(wb + n * K));
        }
      }
    }
  }
  for (int n = 0; n < TILE; ++n) T::store(out + n * L, acc[n]);
}

// The last N % TILE weight rows, one at a time (the models' widths are multiples of 16; small test
// shapes are not).
template <int L>
LAYERSTREAM_BF16_TARGET inline void row(const uint32_t* xp, const uint16_t* w, int64_t K, float* out) {
  using T = Lanes<L>;
  typename T::V acc = T::zero();
  for (int64_t k = 0; k < K; k += 2) acc = T::dot(acc, xp + (k / 2) * L, pair(w + k));
  T::store(out, acc);
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

// y[m][n] = bf16(out[n][m] + bias[n]) for the tile's 16 outputs n of every row m < M: one gather of a
// row's 16 sums, the bias added in fp32, and one rounding (nearest even, as to_bf16) per row.
template <int L>
LAYERSTREAM_BF16_TARGET inline void store_tile(const float* out, int64_t M, const uint16_t* bias, uint16_t* y,
                                               int64_t N) {
  const __m512i lanes = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                           _mm512_set1_epi32(L));
  const __m512 b = bias == nullptr ? _mm512_setzero_ps()
                                   : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                                         _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bias))), 16));
  for (int64_t m = 0; m < M; ++m) {
    __m512 v = _mm512_i32gather_ps(_mm512_add_epi32(lanes, _mm512_set1_epi32(static_cast<int>(m))), out, 4);
    if (bias != nullptr) v = _mm512_add_ps(v, b);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + m * N), (__m256i)_mm512_cvtneps_pbh(v));
  }
}

// Whether the tile stages its lines (tile's STAGED): weight rows a multiple of 4 KiB apart.
inline bool staged(int64_t K) { return (K * int64_t(sizeof(uint16_t))) % 4096 == 0; }

template <int L>
LAYERSTREAM_BF16_TARGET void run_lanes(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t N,
                                       const uint16_t* bias, uint16_t* y) {
  // x as pairs: xp[p][m] = (x[m][2p], x[m][2p + 1]), lanes past M zero. (K / 2, L) uint32, aligned
  // for the vector loads.
  std::vector<uint32_t> storage(K / 2 * L + 16, 0);
  uint32_t* xp = reinterpret_cast<uint32_t*>((reinterpret_cast<uintptr_t>(storage.data()) + 63) & ~uintptr_t(63));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t p = 0; p < K / 2; ++p) xp[p * L + m] = pair(x + m * K + 2 * p);
  const int64_t tiles = N / TILE;
  const bool stage = staged(K);
  at::parallel_for(0, tiles, 2, [&](int64_t t0, int64_t t1) {
    alignas(64) float out[TILE * L];
    for (int64_t t = t0; t < t1; ++t) {
      const uint16_t* wt = w + t * TILE * K;
      const char* next = reinterpret_cast<const char*>(wt + TILE * K);
      if (stage) {
        tile<L, true>(xp, wt, K, next, out);
      } else {
        tile<L, false>(xp, wt, K, next, out);
      }
      store_tile<L>(out, M, bias == nullptr ? nullptr : bias + t * TILE, y + t * TILE, N);
    }
  });
  alignas(64) float out[L];
  for (int64_t n = tiles * TILE; n < N; ++n) {
    row<L>(xp, w + n * K, K, out);
    for (int64_t m = 0; m < M; ++m) y[m * N + n] = with_bias(out[m], bias, n);
  }
}

// How far ahead dot_row asks for a row's lines, into L2 alone. Its loop spends one instruction per 64 bytes of
// weight where the packed kernels spend many, so its own loads keep the core's L1 fill buffers busy and an L1
// prefetch on top only takes buffers from them; and at its pace 2 KiB ahead is as far ahead in time as the
// packed kernels' 4 KiB. With it the 3B model's bf16 matmuls read their weights as fast as a plain read of the
// same bytes, where with stream_prefetch.h's distances they fell short of it when the memory was fast (measured
// on an AMD EPYC: docs/benchmarks/scale.md).
constexpr int64_t BF16_L2_AHEAD = 2048;

// One row (a decode step of one sequence): y[n] = x . w[n], a dot product per weight row, the rows in
// address order so that each thread reads one contiguous stream of the weight (the hardware prefetcher's
// best case) and the broadcast-pair layout above, which would spend one VDPBF16PS per 4 bytes of weight,
// is not needed: here each instruction takes 64 bytes of a row against 64 bytes of x (in L1 for the
// whole product). Four accumulators per row keep four VDPBF16PS chains in flight; one horizontal sum per row.
LAYERSTREAM_BF16_TARGET inline float dot_row(const uint16_t* x, const uint16_t* w, int64_t K) {
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 4 * SLICE <= K; k += 4 * SLICE) {
    // The rows lie one after the other: the lines ahead, into L2 only and nearer than int4_vnni.cpp's
    // kernels ask for theirs (BF16_L2_AHEAD).
    layerstream::prefetch_stream<4, 0, BF16_L2_AHEAD>(w + k);
    a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(w + k), (__m512bh)_mm512_loadu_si512(x + k));
    a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(w + k + SLICE), (__m512bh)_mm512_loadu_si512(x + k + SLICE));
    a2 = _mm512_dpbf16_ps(a2, (__m512bh)_mm512_loadu_si512(w + k + 2 * SLICE),
                          (__m512bh)_mm512_loadu_si512(x + k + 2 * SLICE));
    a3 = _mm512_dpbf16_ps(a3, (__m512bh)_mm512_loadu_si512(w + k + 3 * SLICE),
                          (__m512bh)_mm512_loadu_si512(x + k + 3 * SLICE));
  }
  for (; k < K; k += SLICE) {
    a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(w + k), (__m512bh)_mm512_loadu_si512(x + k));
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}

LAYERSTREAM_BF16_TARGET void run_one(const uint16_t* x, int64_t K, const uint16_t* w, int64_t N, const uint16_t* bias,
                                     uint16_t* y) {
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) y[n] = with_bias(dot_row(x, w + n * K, K), bias, n);
  });
}

LAYERSTREAM_BF16_TARGET void run(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t N,
                                 const uint16_t* bias, uint16_t* y) {
  if (M == 1) {
    run_one(x, K, w, N, bias, y);
  } else if (M <= 8) {
    run_lanes<8>(x, M, K, w, N, bias, y);
  } else {
    run_lanes<16>(x, M, K, w, N, bias, y);
  }
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
  // 2-16 rows lay x out as K/2 pairs of up to 16 rows; past MAX_PAIRED_K inputs (MAX_STAGED_K where the tile
  // stages its lines) oneDNN was the faster (docs/benchmarks/bf16-rows.md). One row reads x as it is.
  const int64_t K = x.size(1);
  return x.size(0) == 1 || (x.size(0) >= 2 && x.size(0) <= MAX_ROWS &&
                            (K <= MAX_PAIRED_K || (staged(K) && K <= MAX_STAGED_K)));
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
  m.def("linear", &bf16_rows::linear, "x @ w.T + bias for 1-16 bf16 rows, else at::linear",
        py::arg("x"), py::arg("w"), py::arg("bias") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.def("applies", &bf16_rows::applies, "whether linear runs this kernel for (x, w)");
  m.def("cpu_supported", &bf16_rows::cpu_supported, "whether this CPU has AVX512 F/BW/DQ/VL and AVX512-BF16");
  m.attr("MAX_ROWS") = bf16_rows::MAX_ROWS;
}
#endif
