// y = x @ W.T for a 4-bit weight with a (scale, min) per 32 weights, the way llama.cpp multiplies
// Q4_0/Q4_1/Q4_K: the activations are quantized on the fly to int8 per 32 values (one scale per
// group, and the group's exact float sum for the min term), the 4-bit codes (u8) times the int8
// activations (s8) are summed exactly with AVX512-VNNI (vpdpbusd), and the groups are combined in
// fp32:
//   y[m, n] = sum_g  d[n,g] * dx[m,g] * sum_i q[n,32g+i] * xq[m,32g+i]   +   min[n,g] * sx[m,g]
// with w = d * q + min (q in 0..15), xq = round(x / dx) in -127..127, dx = max|x| / 127 over the
// group, sx = sum of x over the group. tests/kernels/test_int4_kernel.py holds the same math in torch.
//
// Weight layout (engine/weights/packed.py, Int4Weight "vnni"): rows in blocks of 16 (the 16 int32
// lanes of a 512-bit register, so one register holds 16 rows' partial sums and no horizontal sum
// is ever needed), the last block padded with zero rows.
//   codes  (N16/16, G*256) uint8: per row block and group of 32, four 64-byte vectors v = 0..3;
//          in vector v, lane j (row 16b + j) holds 4 bytes, byte t = q[8v + t] | q[8v + 4 + t] << 4
//          (so one broadcast of 4 activation bytes meets the low nibbles, the next 4 the high)
//   scales (N16/16, G, 2, 16) fp16: per row block and group, the 16 rows' scales, then their mins;
//          or (N16/16, G, 16), scales only, for symmetric weights (Q4_0: min = -8 * scale), whose
//          mins would be a tenth of the bytes a decode step reads
// K = 32 G need not be a multiple of 256 (any number of groups).
// The same kernel reads int8 weights (block_kernel_i8) and Q4_K / Q6_K with their integer sub-scales
// kept (block_kernel_k, KQuantWeight), each described where its block kernel is.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include "stream_prefetch.h"

#include <algorithm>
#include <atomic>
#include <type_traits>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t GROUP = 32;
constexpr int64_t LANES = 16;  // rows per block
// Activation rows multiplied per pass over a row block. Four, not eight: at eight rows, two passes' integer sums
// (16 registers) beside eight float sums and the unpacked weights spill registers inside the group loop; at
// four every weight format's prompt products ran faster, most of all Q6_K's and int8's, with the same bits,
// and batched decode's 8-16 rows no slower (docs/benchmarks/scale.md).
constexpr int64_t MTILE = 4;
// A one-row (decode) product walks DECODE_BLOCKS row blocks side by side (block_kernel's NB) where a row block's
// codes are longer than PAIRED_BLOCK_BYTES: two long streams keep more reads in flight than one. Shorter row
// blocks side by side make two streams that each end after a few KiB, and one stream through consecutive row
// blocks reads them faster (int4 and int8 products of 640-8192 inputs: docs/benchmarks/gemma3.md).
constexpr int DECODE_BLOCKS = 2;
constexpr int64_t PAIRED_BLOCK_BYTES = 16 << 10;
using layerstream::prefetch_stream;  // each group's code bytes, asked for ahead (stream_prefetch.h)

// Activations of M rows quantized per group of 32: int8 codes in x's order, each group's scale
// (max|x| / 127) and its exact float sum (for the min term).
struct QuantX {
  int64_t M = 0, K = 0, G = 0;
  std::vector<int8_t> q;   // (M, K)
  std::vector<int8_t> r;   // (M, K): the rounding residual in 1/256ths of a step (two-pass only)
  std::vector<float> dx;   // (M, G): the step, or the step / 256 in two passes
  std::vector<float> sx;   // (M, G)
  std::vector<int32_t> qsum;  // (M, G): sum of the integer activations (q * 256 + r in two passes)
  std::vector<int32_t> hsum;  // (M, 2G): the same per 16 values (the k-quant layouts' sub-scales)
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

// Stores lanes [0, n) of v, converted to T (round to nearest even).
inline void store16(float* p, __m512 v, __mmask16 k) { _mm512_mask_storeu_ps(p, k, v); }
inline void store16(c10::BFloat16* p, __m512 v, __mmask16 k) {
  __m512i b = _mm512_castps_si512(v);
  __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  b = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  _mm256_mask_storeu_epi16(p, k, _mm512_cvtepi32_epi16(b));
}
inline void store16(c10::Half* p, __m512 v, __mmask16 k) {
  _mm256_mask_storeu_epi16(p, k, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

inline int32_t sum_i8_16(const int8_t* p) {  // 16 values
  return _mm512_reduce_add_epi32(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

template <typename T>
void quantize_rows(const T* x, int64_t M, int64_t K, bool two_pass, QuantX& X) {
  const int64_t G = K / GROUP;
  X.M = M; X.K = K; X.G = G;
  X.q.resize(M * K);
  X.r.resize(two_pass ? M * K : 0);
  X.dx.resize(M * G);
  X.sx.resize(M * G);
  X.qsum.resize(M * G);
  X.hsum.resize(M * 2 * G);
  const __m512 k256 = _mm512_set1_ps(256.f);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < G; ++g) {
      const T* xg = x + m * K + g * GROUP;
      __m512 a = load16(xg), b = load16(xg + 16);
      float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
      __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
      __m512 ta = _mm512_mul_ps(a, inv), tb = _mm512_mul_ps(b, inv);
      // cvtps rounds to nearest even (the default MXCSR mode), as torch.round does.
      __m512i qa = _mm512_cvtps_epi32(ta), qb = _mm512_cvtps_epi32(tb);
      const int64_t at = m * K + g * GROUP;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(X.q.data() + at), _mm512_cvtsepi32_epi8(qa));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(X.q.data() + at + 16), _mm512_cvtsepi32_epi8(qb));
      if (two_pass) {
        // x / step = q + r / 256 with r = round(256 (x / step - q)) in -128..127 (+128 saturates).
        __m512i ra = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(ta, _mm512_cvtepi32_ps(qa)), k256));
        __m512i rb = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(tb, _mm512_cvtepi32_ps(qb)), k256));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(X.r.data() + at), _mm512_cvtsepi32_epi8(ra));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(X.r.data() + at + 16), _mm512_cvtsepi32_epi8(rb));
      }
      // The sums of what was stored (saturated), per 16 and per 32: the int8 weights' +128 offset, the
      // 6-bit k-quant weights' -32.
      for (int h = 0; h < 2; ++h) {
        const int32_t qh = sum_i8_16(X.q.data() + at + 16 * h);
        X.hsum[(m * G + g) * 2 + h] = two_pass ? 256 * qh + sum_i8_16(X.r.data() + at + 16 * h) : qh;
      }
      X.qsum[m * G + g] = X.hsum[(m * G + g) * 2] + X.hsum[(m * G + g) * 2 + 1];
      X.dx[m * G + g] = two_pass ? amax / 127.f / 256.f : amax / 127.f;
      X.sx[m * G + g] = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
    }
  }
}

inline __m512i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// One 64-byte vector of 4-bit codes (wl: low nibbles, wh: high; 16 rows x 8 weights) times activation rows
// [m0, m0 + MT) at column k: each row's integer sums of q (and, in two passes, of r) grow by 8 products.
template <int MT, bool TWO_PASS>
inline __attribute__((always_inline)) void dot_tile(__m512i* isum, __m512i* rsum, __m512i wl, __m512i wh,
                                                    const QuantX& X, int64_t m0, int64_t k) {
  for (int m = 0; m < MT; ++m) {
    const int64_t at = (m0 + m) * X.K + k;
    isum[m] = _mm512_dpbusd_epi32(isum[m], wl, bcast4(X.q.data() + at));
    isum[m] = _mm512_dpbusd_epi32(isum[m], wh, bcast4(X.q.data() + at + 4));
    if (TWO_PASS) {
      rsum[m] = _mm512_dpbusd_epi32(rsum[m], wl, bcast4(X.r.data() + at));
      rsum[m] = _mm512_dpbusd_epi32(rsum[m], wh, bcast4(X.r.data() + at + 4));
    }
  }
}

// Row block n0's outputs for activation rows [m0, m0 + MT): y[m, n0 .. min(n0 + 16, N)) = acc[m] (times the
// block's 16 row scales where given, in one rounding with the bias) + bias.
template <int MT, typename T>
inline void store_rows(const __m512* acc, const float* rowscale, const float* bias, int64_t m0, int64_t n0, int64_t N,
                       T* y) {
  const int64_t nvalid = std::min(LANES, N - n0);
  const __mmask16 k = static_cast<__mmask16>(nvalid >= LANES ? 0xFFFF : (1u << nvalid) - 1);
  const __m512 b = bias ? _mm512_maskz_loadu_ps(k, bias + n0) : _mm512_setzero_ps();
  for (int m = 0; m < MT; ++m)
    store16(y + (m0 + m) * N + n0,
            rowscale ? _mm512_fmadd_ps(acc[m], _mm512_loadu_ps(rowscale), b) : _mm512_add_ps(acc[m], b), k);
}

// NB blocks of 16 weight rows (rows n0 .. n0 + 16 NB; their codes code_stride bytes apart, scales sm_stride) times
// activation rows [m0, m0 + MT); writes y[m, n0 .. n0 + 16 NB) (the last block's rows up to N only).
// HAS_MIN false: the symmetric layout (Q4_0), scales only, (N16/16, G, 16), min = -8 * scale.
// NB > 1 (decode's one row) walks NB row blocks' codes side by side, group by group: that many memory streams
// and independent accumulations in flight instead of one (a plain read of NB streams outran one stream's, with
// or without software prefetch), and each broadcast of 4 activation bytes serves all NB row blocks (the
// broadcasts are loads: decode's one row has no other use for them). Each row's sums are the same operations
// in the same order whatever NB is.
template <int MT, bool TWO_PASS, bool HAS_MIN, int NB = 1, typename T>
void block_kernel(const uint8_t* codes, int64_t code_stride, const uint16_t* sm, int64_t sm_stride, const float* bias,
                  const QuantX& X, int64_t m0, int64_t n0, int64_t N, T* y) {
  const int64_t G = X.G;
  const __m512i low = _mm512_set1_epi8(0x0F);
  constexpr int SG = HAS_MIN ? 32 : 16;  // float16 values per group of a row block
  __m512 acc[NB][MT];
  for (int r = 0; r < NB; ++r)
    for (int m = 0; m < MT; ++m) acc[r][m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    for (int r = 0; r < NB; ++r) prefetch_stream<4>(codes + r * code_stride + g * 256);
    __m512i isum[NB][MT], rsum[NB][MT];
    for (int r = 0; r < NB; ++r)
      for (int m = 0; m < MT; ++m) isum[r][m] = rsum[r][m] = _mm512_setzero_si512();
    for (int v = 0; v < 4; ++v) {
      for (int r = 0; r < NB; ++r) {
        const __m512i wv = _mm512_loadu_si512(codes + r * code_stride + g * 256 + v * 64);
        const __m512i wl = _mm512_and_si512(wv, low);
        const __m512i wh = _mm512_and_si512(_mm512_srli_epi16(wv, 4), low);
        dot_tile<MT, TWO_PASS>(isum[r], rsum[r], wl, wh, X, m0, g * GROUP + v * 8);
      }
    }
    for (int r = 0; r < NB; ++r) {
      // Two passes: q . codes * 256 + r . codes, exact in int32 (|.| < 2^24, so exact in fp32 too).
      if (TWO_PASS)
        for (int m = 0; m < MT; ++m) isum[r][m] = _mm512_add_epi32(_mm512_slli_epi32(isum[r][m], 8), rsum[r][m]);
      const uint16_t* s = sm + r * sm_stride + g * SG;
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
      // -8 * d is exactly the float16 min the asymmetric layout would store for it (a power of two
      // times a float16 that fits: from_codes refuses scales whose min overflows), so both layouts
      // give the same bits.
      const __m512 mn = HAS_MIN ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 16)))
                                : _mm512_mul_ps(d, _mm512_set1_ps(-8.f));
      for (int m = 0; m < MT; ++m) {
        const int64_t i = (m0 + m) * G + g;
        acc[r][m] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(isum[r][m]), _mm512_set1_ps(X.dx[i])), d, acc[r][m]);
        acc[r][m] = _mm512_fmadd_ps(mn, _mm512_set1_ps(X.sx[i]), acc[r][m]);
      }
    }
  }
  for (int r = 0; r < NB; ++r) store_rows<MT>(acc[r], nullptr, bias, m0, n0 + r * LANES, N, y);
}

// int8 weights (Int8Weight "vnni"): codes (N16/16, G*512) uint8 = w + 128, per block and group eight
// 64-byte vectors, vector v lane j = w[16b + j, 32g + 4v + t] + 128 for t = 0..3; one fp32 scale per
// row, (N16/16, 16). vpdpbusd wants its unsigned operand first: (w + 128) . xq = w . xq + 128 sum(xq),
// and the second term, a property of the activations alone, is subtracted once per group.
template <int MT, bool TWO_PASS, int NB = 1, typename T>
void block_kernel_i8(const uint8_t* codes, int64_t code_stride, const float* rowscale, const float* bias,
                     const QuantX& X, int64_t m0, int64_t n0, int64_t N, T* y) {
  const int64_t G = X.G, K = X.K;
  __m512 acc[NB][MT];
  for (int r = 0; r < NB; ++r)
    for (int m = 0; m < MT; ++m) acc[r][m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    for (int r = 0; r < NB; ++r) prefetch_stream<8>(codes + r * code_stride + g * 512);
    __m512i isum[NB][MT], rsum[NB][MT];
    for (int r = 0; r < NB; ++r)
      for (int m = 0; m < MT; ++m) isum[r][m] = rsum[r][m] = _mm512_setzero_si512();
    for (int v = 0; v < 8; ++v) {
      for (int r = 0; r < NB; ++r) {
        const __m512i wv = _mm512_loadu_si512(codes + r * code_stride + g * 512 + v * 64);
        for (int m = 0; m < MT; ++m) {
          const int64_t at = (m0 + m) * K + g * GROUP + v * 4;
          isum[r][m] = _mm512_dpbusd_epi32(isum[r][m], wv, bcast4(X.q.data() + at));
          if (TWO_PASS) rsum[r][m] = _mm512_dpbusd_epi32(rsum[r][m], wv, bcast4(X.r.data() + at));
        }
      }
    }
    for (int r = 0; r < NB; ++r) {
      for (int m = 0; m < MT; ++m) {
        const int64_t i = (m0 + m) * G + g;
        __m512i t = TWO_PASS ? _mm512_add_epi32(_mm512_slli_epi32(isum[r][m], 8), rsum[r][m]) : isum[r][m];
        t = _mm512_sub_epi32(t, _mm512_set1_epi32(128 * X.qsum[i]));
        acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_set1_ps(X.dx[i]), acc[r][m]);
      }
    }
  }
  for (int r = 0; r < NB; ++r) store_rows<MT>(acc[r], rowscale + r * LANES, bias, m0, n0 + r * LANES, N, y);
}

// k-quant weights as llama.cpp stores them, rearranged (KQuantWeight, engine/weights/packed/weights.py),
// for the bytes a decode step reads: 256-weight super-blocks (K a multiple of 256) whose sub-scales
// stay 6- or 8-bit integers under one fp16 scale per row and super-block.
//   Q4_K (BITS 4): codes as int4's; scales (N16/16, K/256, 320) u8: per group g of 32 of the super-block
//          the 16 rows' 6-bit scales sc then their 6-bit mins mn (32 bytes), then 16 fp16 d and 16 fp16
//          dmin: w = d sc q - dmin mn (4.625 bits a weight; Q4_K's own 4.5, int4's 5).
//   Q6_K (BITS 6): codes (N16/16, K/32*384) u8: per group int4's 256 bytes of low nibbles, then two
//          64-byte vectors of high bit pairs: vector p, lane j, byte t holds in bits 2i..2i+1 the high
//          bits of weight 16p + 4i + t (i = 0..3, so each half of a 4-bit vector's byte pairs with the
//          low-nibble vector 2p + i/2); scales (N16/16, K/256, 288) u8: per group the 16 rows' int8
//          scales of its first 16 weights, then of its last 16, then 16 fp16 d: w = d sc (q - 32)
//          (6.5625 bits a weight, as Q6_K).
// (q - 32) . xq = q . xq - 32 sum(xq): the second term is the activations' per-16 sum (QuantX::hsum).
template <int MT, bool TWO_PASS, int BITS, int NB = 1, typename T>
void block_kernel_k(const uint8_t* codes, int64_t code_stride, const uint8_t* sbs, int64_t sb_stride, const float* bias,
                    const QuantX& X, int64_t m0, int64_t n0, int64_t N, T* y) {
  constexpr int64_t CODE_BYTES = BITS == 4 ? 256 : 384, SB_BYTES = BITS == 4 ? 320 : 288;
  const int64_t G = X.G;
  const __m512i low = _mm512_set1_epi8(0x0F), top2 = _mm512_set1_epi8(0x30);
  __m512 acc[NB][MT];
  for (int r = 0; r < NB; ++r)
    for (int m = 0; m < MT; ++m) acc[r][m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    for (int r = 0; r < NB; ++r) prefetch_stream<CODE_BYTES / 64>(codes + r * code_stride + g * CODE_BYTES);
    const int64_t sg = (g % 8) * 32;
    // Q4_K's sub-scales cover a group's 32 weights, Q6_K's 16 (vectors 0-1 hold the first 16, 2-3 the last):
    // one integer sum per row and sub-scale at a time (two would not fit the registers with the tile's float
    // sums: they would spill).
    constexpr int H = BITS == 4 ? 1 : 2;
    for (int h = 0; h < H; ++h) {
      __m512i isum[NB][MT], rsum[NB][MT];
      for (int r = 0; r < NB; ++r)
        for (int m = 0; m < MT; ++m) isum[r][m] = rsum[r][m] = _mm512_setzero_si512();
      for (int v = h * 4 / H; v < (h + 1) * 4 / H; ++v) {
        for (int r = 0; r < NB; ++r) {
          const uint8_t* w = codes + r * code_stride + g * CODE_BYTES;
          const __m512i wv = _mm512_loadu_si512(w + v * 64);
          __m512i wl = _mm512_and_si512(wv, low);
          __m512i wh = _mm512_and_si512(_mm512_srli_epi16(wv, 4), low);
          if (BITS == 6) {
            __m512i hv = _mm512_loadu_si512(w + 256 + (v / 2) * 64);
            if (v % 2) hv = _mm512_srli_epi16(hv, 4);  // bits 4..7 of each byte down (the spill is masked)
            wl = _mm512_or_si512(wl, _mm512_and_si512(_mm512_slli_epi16(hv, 4), top2));
            wh = _mm512_or_si512(wh, _mm512_and_si512(_mm512_slli_epi16(hv, 2), top2));
          }
          dot_tile<MT, TWO_PASS>(isum[r], rsum[r], wl, wh, X, m0, g * GROUP + v * 8);
        }
      }
      for (int r = 0; r < NB; ++r) {
        const uint8_t* s = sbs + r * sb_stride + (g / 8) * SB_BYTES;
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 256)));
        auto u8 = [&](int64_t at) {
          return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + at))));
        };
        auto i8 = [&](int64_t at) {
          return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + at))));
        };
        if (BITS == 4) {
          const __m512 scale = _mm512_mul_ps(d, u8(sg));
          const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 288)));
          const __m512 mn = _mm512_mul_ps(dmin, u8(sg + 16));
          for (int m = 0; m < MT; ++m) {
            const int64_t i = (m0 + m) * G + g;
            __m512i t = isum[r][m];
            if (TWO_PASS) t = _mm512_add_epi32(_mm512_slli_epi32(t, 8), rsum[r][m]);
            acc[r][m] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(t), _mm512_set1_ps(X.dx[i])), scale, acc[r][m]);
            acc[r][m] = _mm512_fnmadd_ps(mn, _mm512_set1_ps(X.sx[i]), acc[r][m]);
          }
        } else {
          const __m512 scale = _mm512_mul_ps(d, i8(sg + 16 * h));
          for (int m = 0; m < MT; ++m) {
            const int64_t i = (m0 + m) * G + g;
            __m512i t = TWO_PASS ? _mm512_add_epi32(_mm512_slli_epi32(isum[r][m], 8), rsum[r][m]) : isum[r][m];
            t = _mm512_sub_epi32(t, _mm512_set1_epi32(32 * X.hsum[i * 2 + h]));
            acc[r][m] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(t), _mm512_set1_ps(X.dx[i])), scale, acc[r][m]);
          }
        }
      }
    }
  }
  for (int r = 0; r < NB; ++r) store_rows<MT>(acc[r], nullptr, bias, m0, n0 + r * LANES, N, y);
}

// f(std::integral_constant<int, MT>) for the activation tile's height, 1..MTILE: each a kernel unrolled
// over exactly its rows.
template <typename F>
void with_tile(int64_t mt, F&& f) {
  static_assert(MTILE == 4, "one case per tile height");
  switch (mt) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    default: return f(std::integral_constant<int, 4>{});
  }
}

// The weight formats: Int4Weight, Int8Weight and KQuantWeight's two (engine/weights/packed/weights.py).
enum class Format { Int4, Int8, K4, K6 };

template <typename T>
void run(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, const float* bias, int64_t N,
         bool two_pass, Format fmt, at::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), G = K / GROUP, blocks = codes.size(0);
  thread_local QuantX X;  // reused across calls: no allocation per matmul once warm
  quantize_rows(x.data_ptr<T>(), M, K, two_pass, X);
  const uint8_t* w = codes.data_ptr<uint8_t>();
  const uint16_t* s = fmt == Format::Int4 ? reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>()) : nullptr;
  const bool has_min = fmt == Format::Int4 && scales.dim() == 4;  // else symmetric int4, (N16/16, G, 16)
  const int64_t sm_stride = has_min ? G * 32 : G * 16;  // float16 values per row block
  const float* rs = fmt == Format::Int8 ? scales.data_ptr<float>() : nullptr;
  const uint8_t* ks = fmt == Format::K4 || fmt == Format::K6 ? scales.data_ptr<uint8_t>() : nullptr;
  const int64_t ks_stride = ks ? scales.size(1) * scales.size(2) : 0;  // bytes per row block
  const int64_t block_bytes = G * (fmt == Format::Int4 || fmt == Format::K4 ? 256 : fmt == Format::K6 ? 384 : 512);
  T* out = y.data_ptr<T>();
  const QuantX& Xr = X;  // worker threads read the caller's buffers
  // Enough row blocks per task (~64 KiB of codes) to be worth a hand-off to another thread. The threads take
  // chunks of about an eighth of their share as they finish the last (an atomic counter), not one fixed half
  // each: two cores do not stream memory equally fast, and with fixed halves the first to finish waited for
  // the other at every product's end (perf: over a tenth of a decode step's samples were libgomp waiting).
  // Chunks hold whole pairs of row blocks, which a one-row product may walk side by side.
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / block_bytes);
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), std::max<int64_t>(1, blocks / grain));
  const int64_t chunk = (std::max<int64_t>(grain, blocks / (threads * 8)) + DECODE_BLOCKS - 1) / DECODE_BLOCKS *
                        DECODE_BLOCKS;
  // NB row blocks from b (16 NB weight rows) times activation rows [m0, m0 + MT).
  const auto blocks_at = [&](int64_t b, int64_t m0, auto mt, auto nb) {
    constexpr int MT = decltype(mt)::value, NB = decltype(nb)::value;
    const uint8_t* wb = w + b * block_bytes;
    const int64_t n0 = b * LANES;
    const uint8_t* kb = ks ? ks + b * ks_stride : nullptr;
    switch (fmt) {
      case Format::Int8:
        if (two_pass) block_kernel_i8<MT, true, NB>(wb, block_bytes, rs + b * LANES, bias, Xr, m0, n0, N, out);
        else block_kernel_i8<MT, false, NB>(wb, block_bytes, rs + b * LANES, bias, Xr, m0, n0, N, out);
        break;
      case Format::K4:
        if (two_pass) block_kernel_k<MT, true, 4, NB>(wb, block_bytes, kb, ks_stride, bias, Xr, m0, n0, N, out);
        else block_kernel_k<MT, false, 4, NB>(wb, block_bytes, kb, ks_stride, bias, Xr, m0, n0, N, out);
        break;
      case Format::K6:
        if (two_pass) block_kernel_k<MT, true, 6, NB>(wb, block_bytes, kb, ks_stride, bias, Xr, m0, n0, N, out);
        else block_kernel_k<MT, false, 6, NB>(wb, block_bytes, kb, ks_stride, bias, Xr, m0, n0, N, out);
        break;
      case Format::Int4: {
        const uint16_t* sb = s + b * sm_stride;
        if (has_min) {
          if (two_pass) block_kernel<MT, true, true, NB>(wb, block_bytes, sb, sm_stride, bias, Xr, m0, n0, N, out);
          else block_kernel<MT, false, true, NB>(wb, block_bytes, sb, sm_stride, bias, Xr, m0, n0, N, out);
        } else {
          if (two_pass) block_kernel<MT, true, false, NB>(wb, block_bytes, sb, sm_stride, bias, Xr, m0, n0, N, out);
          else block_kernel<MT, false, false, NB>(wb, block_bytes, sb, sm_stride, bias, Xr, m0, n0, N, out);
        }
        break;
      }
    }
  };
  // Row blocks [b0, b1) times every activation row: one row (decode) of long row blocks DECODE_BLOCKS row blocks
  // at a time, else one row block at a time, every activation tile passing over it while its codes are in L1.
  const bool paired = M == 1 && block_bytes > PAIRED_BLOCK_BYTES;
  const auto row_blocks = [&](int64_t b0, int64_t b1) {
    int64_t b = b0;
    if (paired)
      for (; b + DECODE_BLOCKS <= b1; b += DECODE_BLOCKS)
        blocks_at(b, 0, std::integral_constant<int, 1>{}, std::integral_constant<int, DECODE_BLOCKS>{});
    for (; b < b1; ++b)
      for (int64_t m0 = 0; m0 < M; m0 += MTILE)
        with_tile(std::min(MTILE, M - m0), [&](auto mt) { blocks_at(b, m0, mt, std::integral_constant<int, 1>{}); });
  };
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t b0; (b0 = next.fetch_add(chunk, std::memory_order_relaxed)) < blocks;)
      row_blocks(b0, std::min(blocks, b0 + chunk));
  });
}

// Checks common to the weight formats; returns y, calling run() with the right element type.
at::Tensor linear(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& scales, int64_t N, int64_t G,
                  const c10::optional<at::Tensor>& bias_in, bool two_pass, Format fmt) {
  const int64_t blocks = codes.size(0), K = G * GROUP;
  TORCH_CHECK(x_in.device().is_cpu() && codes.device().is_cpu() && scales.device().is_cpu(),
              "int4/int8 linear: a CPU kernel, given tensors on ", x_in.device(), " and ", codes.device());
  TORCH_CHECK(N > (blocks - 1) * LANES && N <= blocks * LANES, "linear: ", N, " rows do not fit ", blocks,
              " blocks of 16");
  TORCH_CHECK(x_in.size(-1) == K, "linear: x has ", x_in.size(-1), " features, the weight ", K);
  auto dtype = x_in.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "linear: x must be float32, bfloat16 or float16");
  at::Tensor x = x_in.reshape({-1, K}).contiguous();  // (M, K)
  std::vector<int64_t> out_shape(x_in.sizes().begin(), x_in.sizes().end());
  out_shape.back() = N;
  at::Tensor y = at::empty({x.size(0), N}, x.options());  // (M, N)
  at::Tensor bias;
  if (bias_in.has_value() && bias_in->defined()) {
    TORCH_CHECK(bias_in->numel() == N, "linear: bias has ", bias_in->numel(), " values, expected ", N);
    bias = bias_in->to(at::kFloat).contiguous();
  }
  const float* b = bias.defined() ? bias.data_ptr<float>() : nullptr;
  if (x.size(0) > 0) {
    if (dtype == at::kFloat) run<float>(x, codes, scales, b, N, two_pass, fmt, y);
    else if (dtype == at::kBFloat16) run<c10::BFloat16>(x, codes, scales, b, N, two_pass, fmt, y);
    else run<c10::Half>(x, codes, scales, b, N, two_pass, fmt, y);
  }
  return y.view(out_shape);
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t N,
                       const c10::optional<at::Tensor>& bias, bool two_pass) {
  TORCH_CHECK(scales.dtype() == at::kHalf && scales.is_contiguous() &&
              ((scales.dim() == 4 && scales.size(2) == 2 && scales.size(3) == LANES) ||
               (scales.dim() == 3 && scales.size(2) == LANES)),
              "int4_linear: scales must be contiguous (N16/16, K/32, 2, 16) or, symmetric, (N16/16, K/32, 16) float16");
  const int64_t G = scales.size(1);
  TORCH_CHECK(codes.dtype() == at::kByte && codes.is_contiguous() && codes.dim() == 2 &&
              codes.size(0) == scales.size(0) && codes.size(1) == G * 256,
              "int4_linear: codes must be contiguous (N16/16, K/32*256) uint8");
  return linear(x, codes, scales, N, G, bias, two_pass, Format::Int4);
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t N,
                       const c10::optional<at::Tensor>& bias, bool two_pass) {
  TORCH_CHECK(codes.dtype() == at::kByte && codes.is_contiguous() && codes.dim() == 2 && codes.size(1) % 512 == 0,
              "int8_linear: codes must be contiguous (N16/16, K/32*512) uint8");
  TORCH_CHECK(scales.dtype() == at::kFloat && scales.is_contiguous() && scales.dim() == 2 &&
              scales.size(0) == codes.size(0) && scales.size(1) == LANES,
              "int8_linear: scales must be contiguous (N16/16, 16) float32");
  return linear(x, codes, scales, N, codes.size(1) / 512, bias, two_pass, Format::Int8);
}

at::Tensor kquant_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t N,
                         const c10::optional<at::Tensor>& bias, bool two_pass) {
  TORCH_CHECK(scales.dtype() == at::kByte && scales.is_contiguous() && scales.dim() == 3 &&
                  (scales.size(2) == 320 || scales.size(2) == 288),
              "kquant_linear: scales must be contiguous (N16/16, K/256, 320 for Q4_K or 288 for Q6_K) uint8");
  const Format fmt = scales.size(2) == 320 ? Format::K4 : Format::K6;
  const int64_t G = scales.size(1) * 8;
  TORCH_CHECK(codes.dtype() == at::kByte && codes.is_contiguous() && codes.dim() == 2 &&
                  codes.size(0) == scales.size(0) && codes.size(1) == G * (fmt == Format::K4 ? 256 : 384),
              "kquant_linear: codes must be contiguous (N16/16, K/32*256 for Q4_K or K/32*384 for Q6_K) uint8");
  return linear(x, codes, scales, N, G, bias, two_pass, fmt);
}

// The weight of any of the formats above, rows [16 b0, 16 b1), dequantized to bf16 transposed: out (K, 16 (b1 - b0)),
// out[k, n] = w[16 b0 + n, k]; or split, out (2 K, 16 (b1 - b0)), the bf16 rounding's remainder in rows K.. 2K, so
// that [x, x] @ out multiplies x by the weight as stored (bf16 alone keeps 8 bits of a 4-bit code times its fp16
// scale: enough to put tests/engine/test_kv_accuracy.py's int4 KV cache past its 3% perplexity bound). A prompt
// chunk of many rows is then one dense bf16 product (oneDNN's, on AMX tiles where the CPU has them), which
// outruns the integer kernel once enough rows share the weight. The layouts hold 16 rows side by side, so 16
// consecutive outputs of one k are one vector: no transposition.
inline __m512i byte_lanes(__m512i v, int t) {  // byte t of each 32-bit lane, zero-extended
  return _mm512_and_si512(_mm512_srli_epi32(v, 8 * t), _mm512_set1_epi32(0xFF));
}

// v rounded to bf16 at p and, where lo (the split form) is not 0, what that rounding left at p + lo: the two
// bf16 values sum to v within 2^-16 of it, so a product over both rows multiplies the weight as stored.
inline void store_bf16(c10::BFloat16* p, int64_t lo, __m512 v) {
  store16(p, v, 0xFFFF);
  if (lo) store16(p + lo, _mm512_sub_ps(v, load16(p)), 0xFFFF);
}

void dequantize_t(const at::Tensor& codes, const at::Tensor& scales, Format fmt, int64_t G, int64_t b0, int64_t b1,
                  at::Tensor& out) {
  const int64_t ld = out.stride(0);  // a view of a wider buffer: its rows are that far apart
  const int64_t lo = out.size(0) == 2 * G * GROUP ? G * GROUP * ld : 0;  // the split form: the rest K rows on
  const uint8_t* w0 = codes.data_ptr<uint8_t>();
  c10::BFloat16* o = out.data_ptr<c10::BFloat16>();
  const bool has_min = fmt == Format::Int4 && scales.dim() == 4;
  const int64_t code_bytes = fmt == Format::Int8 ? 512 : fmt == Format::K6 ? 384 : 256;
  const int64_t block_bytes = G * code_bytes;
  const __m512i nib = _mm512_set1_epi32(0x0F);
  at::parallel_for(b0, b1, 1, [&](int64_t lo_b, int64_t hi_b) {
    for (int64_t b = lo_b; b < hi_b; ++b) {
      c10::BFloat16* ob = o + (b - b0) * LANES;
      for (int64_t g = 0; g < G; ++g) {
        const uint8_t* w = w0 + b * block_bytes + g * code_bytes;
        c10::BFloat16* og = ob + g * GROUP * ld;  // row k = 32 g of out
        if (fmt == Format::Int8) {
          const __m512 sc = _mm512_loadu_ps(scales.data_ptr<float>() + b * LANES);
          const __m512i off = _mm512_set1_epi32(128);
          for (int v = 0; v < 8; ++v) {
            const __m512i wv = _mm512_loadu_si512(w + v * 64);
            for (int t = 0; t < 4; ++t)
              store_bf16(og + (4 * v + t) * ld, lo,
                         _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(byte_lanes(wv, t), off)), sc));
          }
          continue;
        }
        __m512 d[2], mn = _mm512_setzero_ps();
        if (fmt == Format::Int4) {
          const uint16_t* sm = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>()) +
                               b * G * (has_min ? 32 : 16) + g * (has_min ? 32 : 16);
          d[0] = d[1] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sm)));
          mn = has_min ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sm + 16)))
                       : _mm512_mul_ps(d[0], _mm512_set1_ps(-8.f));
        } else {
          const uint8_t* sb = scales.data_ptr<uint8_t>() + (b * (G / 8) + g / 8) * scales.size(2) + (g % 8) * 32;
          const uint8_t* top = scales.data_ptr<uint8_t>() + (b * (G / 8) + g / 8) * scales.size(2) + 256;
          const __m512 dsup = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(top)));
          auto widen = [&](const uint8_t* p, bool is_signed) {
            const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
            return _mm512_cvtepi32_ps(is_signed ? _mm512_cvtepi8_epi32(v) : _mm512_cvtepu8_epi32(v));
          };
          if (fmt == Format::K4) {
            d[0] = d[1] = _mm512_mul_ps(dsup, widen(sb, false));
            const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(top + 32)));
            mn = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(dmin, widen(sb + 16, false)));
          } else {
            d[0] = _mm512_mul_ps(dsup, widen(sb, true));
            d[1] = _mm512_mul_ps(dsup, widen(sb + 16, true));
            mn = _mm512_set1_ps(-32.f);  // applied to q before the scale below
          }
        }
        for (int v = 0; v < 4; ++v) {
          const __m512i wv = _mm512_loadu_si512(w + v * 64);
          __m512i hv = _mm512_setzero_si512();
          if (fmt == Format::K6) {
            hv = _mm512_loadu_si512(w + 256 + (v / 2) * 64);
            if (v % 2) hv = _mm512_srli_epi32(hv, 4);
          }
          for (int t = 0; t < 4; ++t) {
            const __m512i bt = byte_lanes(wv, t);
            __m512i ql = _mm512_and_si512(bt, nib), qh = _mm512_srli_epi32(bt, 4);
            if (fmt == Format::K6) {
              const __m512i ht = byte_lanes(hv, t);
              ql = _mm512_or_si512(ql, _mm512_slli_epi32(_mm512_and_si512(ht, _mm512_set1_epi32(3)), 4));
              qh = _mm512_or_si512(qh, _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(ht, 2),
                                                                          _mm512_set1_epi32(3)), 4));
              store_bf16(og + (8 * v + t) * ld, lo,
                         _mm512_mul_ps(_mm512_add_ps(_mm512_cvtepi32_ps(ql), mn), d[v / 2]));
              store_bf16(og + (8 * v + 4 + t) * ld, lo,
                         _mm512_mul_ps(_mm512_add_ps(_mm512_cvtepi32_ps(qh), mn), d[v / 2]));
            } else {
              store_bf16(og + (8 * v + t) * ld, lo, _mm512_fmadd_ps(_mm512_cvtepi32_ps(ql), d[0], mn));
              store_bf16(og + (8 * v + 4 + t) * ld, lo, _mm512_fmadd_ps(_mm512_cvtepi32_ps(qh), d[0], mn));
            }
          }
        }
      }
    }
  });
}

// dequantize_t for Python: the format told from the scales (as decode_block.cpp's project does).
at::Tensor dequantize_bf16_t(const at::Tensor& codes, const at::Tensor& scales, int64_t K, int64_t b0, int64_t b1,
                             at::Tensor out) {
  Format fmt;
  if (scales.scalar_type() == at::kHalf) fmt = Format::Int4;
  else if (scales.scalar_type() == at::kFloat) fmt = Format::Int8;
  else fmt = scales.size(2) == 320 ? Format::K4 : Format::K6;
  const bool kquant = fmt == Format::K4 || fmt == Format::K6;
  TORCH_CHECK(codes.is_contiguous() && scales.is_contiguous() && K % GROUP == 0 && (!kquant || K % 256 == 0),
              "dequantize_bf16_t: contiguous codes and scales, K a multiple of 32 (256 for Q4_K / Q6_K)");
  TORCH_CHECK(0 <= b0 && b0 <= b1 && b1 <= codes.size(0), "dequantize_bf16_t: row blocks [", b0, ", ", b1,
              ") out of ", codes.size(0));
  TORCH_CHECK(out.scalar_type() == at::kBFloat16 && out.dim() == 2 && (out.size(0) == K || out.size(0) == 2 * K) &&
                  out.size(1) == (b1 - b0) * LANES && out.stride(1) == 1,
              "dequantize_bf16_t: out must be (K, 16 (b1 - b0)) or, split, (2 K, 16 (b1 - b0)) bfloat16 with unit "
              "column stride");
  dequantize_t(codes, scales, fmt, K / GROUP, b0, b1, out);
  return out;
}

bool cpu_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}

}  // namespace

// decode_block.cpp includes this file for its functions and defines its own module.
#ifndef LAYERSTREAM_NO_MODULE
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int4_linear", &int4_linear, "y = x @ W.T, W 4-bit with a (scale, min) per 32, x quantized to int8 per 32",
        py::arg("x"), py::arg("codes"), py::arg("scales"), py::arg("out_features"), py::arg("bias") = py::none(),
        py::arg("two_pass") = true);
  m.def("int8_linear", &int8_linear, "y = x @ W.T, W int8 with a scale per row, x quantized to int8 per 32",
        py::arg("x"), py::arg("codes"), py::arg("scales"), py::arg("out_features"), py::arg("bias") = py::none(),
        py::arg("two_pass") = true);
  m.def("kquant_linear", &kquant_linear, "y = x @ W.T, W Q4_K or Q6_K rearranged (KQuantWeight), x int8 per 32",
        py::arg("x"), py::arg("codes"), py::arg("scales"), py::arg("out_features"), py::arg("bias") = py::none(),
        py::arg("two_pass") = true);
  m.def("dequantize_bf16_t", &dequantize_bf16_t, "row blocks [b0, b1) of an int4/int8/k-quant weight as bf16 (K, rows)",
        py::arg("codes"), py::arg("scales"), py::arg("K"), py::arg("b0"), py::arg("b1"), py::arg("out"));
  m.def("cpu_supported", &cpu_supported, "whether this CPU has AVX512F/BW/VL and AVX512-VNNI");
}
#endif
