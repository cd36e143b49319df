// Attention over a quantized paged KV cache (engine/kv_quant.py's format), one query token per row, reading
// the int8/int4 codes where they lie: no dequantized copy of the cache, not even of one sequence.
//
//   attention(q, k_codes, k_scales, v_codes, v_scales, tables, positions, window, bits, scale)
//     q          (rows, heads, hd) fp32, contiguous: each row one token, already rotated as K was
//     *_codes    (blocks, block_size, kv_heads, hd) int8 (bits 8) or (.., hd / 2) uint8 (bits 4, two codes a
//                byte, the even dimension in the low nibble, each an index into kInt4Levels)
//     *_scales   (blocks, block_size, kv_heads, groups) float16: one per hd / groups values (int8: one group;
//                int4: groups of 32, or 16 for small heads)
//     tables     (rows, max_blocks) int64: the block table of each row's sequence
//     positions  (rows,) int64: each row attends keys [max(0, pos - window + 1), pos]
//   -> (rows, heads, hd) fp32: softmax(scale * q k^T) v, in the rotated space of V.
//
//   write(x, codes, scales, slots, bits): x (rows, kv_heads, hd) fp32 quantized into the cache at slots.
//
// K/V must already hold every row's own key (engine/model.py writes them first, quantized), so a chunk of
// prompt tokens is as many causal one-token attentions, as in fused_ops.cpp's decode_attention.
// A code's contribution is factored: q . (s * c) = s * (q . c) per scale group, and p * (s * c) adds
// (p * s) * c, so each key costs one multiply by its scale per group, not one per value.

#include <torch/extension.h>
#include <c10/util/Half.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "exp_approx.h"

namespace {

// engine/kv_quant.py's INT4_LEVELS and INT4_TOPS (tests/kernels/test_kv_attention.py holds the two sides
// equal: the kernel reads and writes the codes torch does).
constexpr float kInt4Levels[16] = {-127, -96, -75, -58, -44, -31, -18, -6, 6, 18, 31, 44, 58, 75, 96, 127};
constexpr float kInt4Tops[] = {100, 104, 108, 112, 116, 120, 124, 128, 132, 136, 140, 144, 148, 152, 156, 160, 164};
constexpr int kInt4Candidates = sizeof(kInt4Tops) / sizeof(kInt4Tops[0]);

struct Args {
  const float* q;
  const void* kc;
  const c10::Half* ks;
  const void* vc;
  const c10::Half* vs;
  const int64_t* tables;
  int64_t table_stride;
  const int64_t* positions;
  int64_t block_size, nkv, group, hd, window, code_width, groups;
  float scale;
  float* out;
};

// Sum over d of q[d] * c[d] for one group of n int8 codes.
__attribute__((target_clones("avx512f", "avx2", "default")))
float dot_i8(const float* q, const int8_t* c, int64_t n) {
  constexpr int L = 16;
  float acc[L] = {0};
  int64_t d = 0;
  for (; d + L <= n; d += L)
    for (int l = 0; l < L; ++l) acc[l] += q[d + l] * static_cast<float>(c[d + l]);
  float sum = 0;
  for (int l = 0; l < L; ++l) sum += acc[l];
  for (; d < n; ++d) sum += q[d] * static_cast<float>(c[d]);
  return sum;
}

// The same for n int4 codes packed two a byte (n / 2 bytes), each a level's index.
__attribute__((target_clones("avx512f", "avx2", "default")))
float dot_i4(const float* q, const uint8_t* c, int64_t n) {
  constexpr int L = 16;
  float acc[L] = {0};
  for (int64_t b = 0; b < n / 2; b += L / 2)
    for (int l = 0; l < L / 2; ++l) {
      const uint8_t v = c[b + l];
      acc[2 * l] += q[2 * (b + l)] * kInt4Levels[v & 0xF];
      acc[2 * l + 1] += q[2 * (b + l) + 1] * kInt4Levels[v >> 4];
    }
  float sum = 0;
  for (int l = 0; l < L; ++l) sum += acc[l];
  return sum;
}

// a[d] += w * c[d] over n int8 codes.
__attribute__((target_clones("avx512f", "avx2", "default")))
void axpy_i8(float* a, float w, const int8_t* c, int64_t n) {
  for (int64_t d = 0; d < n; ++d) a[d] += w * static_cast<float>(c[d]);
}

// a[d] += w * level[d] over n int4 codes (n / 2 bytes).
__attribute__((target_clones("avx512f", "avx2", "default")))
void axpy_i4(float* a, float w, const uint8_t* c, int64_t n) {
  for (int64_t b = 0; b < n / 2; ++b) {
    const uint8_t v = c[b];
    a[2 * b] += w * kInt4Levels[v & 0xF];
    a[2 * b + 1] += w * kInt4Levels[v >> 4];
  }
}

// Pointers to key `key`'s codes and scales for KV head kvh, through the row's block table.
inline void locate(const Args& A, const int64_t* table, int64_t key, int64_t kvh, const void* codes,
                   const c10::Half* scales, const uint8_t** c, const c10::Half** sc) {
  const int64_t b = key / A.block_size, off = key - b * A.block_size;
  const int64_t slot = (table[b] * A.block_size + off) * A.nkv + kvh;
  *c = static_cast<const uint8_t*>(codes) + slot * A.code_width;
  *sc = scales + slot * A.groups;
}

// The AVX-512 path (head_dim = 16 C, C <= 16): each key's and value's codes are widened to fp32 once, times
// their scales, for the whole group of query heads (the generic loops below widen them once per head), the
// scores are FMA chains reduced once, and p . V accumulates in registers, HG heads at a time over all keys
// (as fused_ops.cpp's bf16 path does: in memory, each key's update waits on the last one's store).
#define LAYERSTREAM_AVX512 __attribute__((target("avx512f,avx512bw")))

bool cpu_avx512() {
  static const bool yes = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  }();
  return yes;
}

// 16 codes from p (int8: 16 bytes; int4: 8 bytes, the even value in the low nibble) as fp32 (int4: their levels).
template <int BITS>
LAYERSTREAM_AVX512 inline __m512 widen16(const uint8_t* p) {
  if constexpr (BITS == 8) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  } else {
    const __m128i x = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));  // 8 x u16
    const __m128i lo = _mm_and_si128(x, _mm_set1_epi16(0xF)), hi = _mm_srli_epi16(x, 4);
    const __m128i bytes = _mm_or_si128(lo, _mm_slli_epi16(hi, 8));  // 16 bytes: value 0, 1, 2, ... in order
    return _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(bytes), _mm512_loadu_ps(kInt4Levels));
  }
}

// Row `c` (C chunks of 16) widened and times its group scales: z[0..C).
template <int BITS, int C>
LAYERSTREAM_AVX512 inline void widen_row(const uint8_t* c, const c10::Half* sc, int64_t chunks_per_group, __m512* z) {
  for (int i = 0; i < C; ++i)
    z[i] = _mm512_mul_ps(widen16<BITS>(c + i * 16 * BITS / 8), _mm512_set1_ps(static_cast<float>(sc[i / chunks_per_group])));
}

template <int BITS, int C>
LAYERSTREAM_AVX512 void attend_one_avx512(const Args& A, int64_t row, int64_t kvh) {
  constexpr int HG = C >= 16 ? 1 : 16 / C;
  const int64_t pos = A.positions[row], hd = A.hd, G = A.group;
  const int64_t lo = A.window > 0 ? std::max<int64_t>(0, pos - A.window + 1) : 0, ctx = pos + 1 - lo;
  const int64_t chunks_per_group = hd / A.groups / 16;
  thread_local std::vector<float> s;
  s.resize(G * ctx);
  const int64_t* table = A.tables + row * A.table_stride;
  const float* q = A.q + (row * A.nkv * G + kvh * G) * hd;
  const uint8_t* c;
  const c10::Half* sc;
  __m512 z[C];
  for (int64_t j = 0; j < ctx; ++j) {
    locate(A, table, lo + j, kvh, A.kc, A.ks, &c, &sc);
    widen_row<BITS, C>(c, sc, chunks_per_group, z);
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = q + g * hd;
      __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qg), z[0]);
      for (int i = 1; i < C; ++i) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * i), z[i], acc);
      s[g * ctx + j] = _mm512_reduce_add_ps(acc) * A.scale;
    }
  }
  float sums[64];
  std::vector<float> big_sums;
  float* sum = sums;
  if (G > 64) {
    big_sums.resize(G);
    sum = big_sums.data();
  }
  for (int64_t g = 0; g < G; ++g) sum[g] = softmax_numerators(s.data() + g * ctx, ctx);
  float* out = A.out + (row * A.nkv * G + kvh * G) * hd;
  for (int64_t g0 = 0; g0 < G; g0 += HG) {
    const int64_t hg = std::min<int64_t>(HG, G - g0);
    __m512 a[HG][C];
    for (int h = 0; h < HG; ++h)
      for (int i = 0; i < C; ++i) a[h][i] = _mm512_setzero_ps();
    for (int64_t j = 0; j < ctx; ++j) {
      locate(A, table, lo + j, kvh, A.vc, A.vs, &c, &sc);
      widen_row<BITS, C>(c, sc, chunks_per_group, z);
      for (int h = 0; h < HG; ++h) {
        if (h < hg) {
          const __m512 p = _mm512_set1_ps(s[(g0 + h) * ctx + j]);
          for (int i = 0; i < C; ++i) a[h][i] = _mm512_fmadd_ps(p, z[i], a[h][i]);
        }
      }
    }
    for (int h = 0; h < hg; ++h) {
      const __m512 r = _mm512_set1_ps(1.0f / sum[g0 + h]);
      for (int i = 0; i < C; ++i) _mm512_storeu_ps(out + (g0 + h) * hd + 16 * i, _mm512_mul_ps(a[h][i], r));
    }
  }
}

template <int BITS>
bool attend_avx512(const Args& A, int64_t row, int64_t kvh) {
  if (!cpu_avx512() || A.hd % 16 != 0 || (A.hd / A.groups) % 16 != 0) return false;
  switch (A.hd / 16) {
    case 2: attend_one_avx512<BITS, 2>(A, row, kvh); return true;
    case 4: attend_one_avx512<BITS, 4>(A, row, kvh); return true;
    case 6: attend_one_avx512<BITS, 6>(A, row, kvh); return true;
    case 8: attend_one_avx512<BITS, 8>(A, row, kvh); return true;
    case 16: attend_one_avx512<BITS, 16>(A, row, kvh); return true;
    default: return false;
  }
}

template <int BITS>
void attend_one(const Args& A, int64_t row, int64_t kvh) {
  if (attend_avx512<BITS>(A, row, kvh)) return;
  const int64_t pos = A.positions[row], hd = A.hd, G = A.group;
  const int64_t lo = A.window > 0 ? std::max<int64_t>(0, pos - A.window + 1) : 0, ctx = pos + 1 - lo;
  const int64_t gsize = hd / A.groups;  // values per scale
  thread_local std::vector<float> s, acc;
  s.resize(G * ctx);
  acc.assign(G * hd, 0.0f);
  const int64_t* table = A.tables + row * A.table_stride;
  const float* q = A.q + (row * A.nkv * G + kvh * G) * hd;  // (G, hd): the query heads of this KV head
  // Pointers to key j's codes and scales for this KV head.
  auto locate = [&](int64_t key, const void* codes, const c10::Half* scales, const void** c, const c10::Half** sc) {
    const int64_t b = key / A.block_size, off = key - b * A.block_size;
    const int64_t slot = (table[b] * A.block_size + off) * A.nkv + kvh;
    *c = static_cast<const uint8_t*>(codes) + slot * A.code_width;
    *sc = scales + slot * A.groups;
  };
  for (int64_t j = 0; j < ctx; ++j) {
    const void* c;
    const c10::Half* sc;
    locate(lo + j, A.kc, A.ks, &c, &sc);
    for (int64_t g = 0; g < G; ++g) {
      float dot = 0;
      for (int64_t k = 0; k < A.groups; ++k) {
        const float* qg = q + g * hd + k * gsize;
        const float part = BITS == 8 ? dot_i8(qg, static_cast<const int8_t*>(c) + k * gsize, gsize)
                                     : dot_i4(qg, static_cast<const uint8_t*>(c) + k * gsize / 2, gsize);
        dot += static_cast<float>(sc[k]) * part;
      }
      s[g * ctx + j] = dot * A.scale;
    }
  }
  std::vector<float> sums(G);
  for (int64_t g = 0; g < G; ++g) sums[g] = softmax_numerators(s.data() + g * ctx, ctx);
  for (int64_t j = 0; j < ctx; ++j) {
    const void* c;
    const c10::Half* sc;
    locate(lo + j, A.vc, A.vs, &c, &sc);
    for (int64_t g = 0; g < G; ++g) {
      const float p = s[g * ctx + j];
      for (int64_t k = 0; k < A.groups; ++k) {
        float* a = acc.data() + g * hd + k * gsize;
        const float w = p * static_cast<float>(sc[k]);
        if (BITS == 8) axpy_i8(a, w, static_cast<const int8_t*>(c) + k * gsize, gsize);
        else axpy_i4(a, w, static_cast<const uint8_t*>(c) + k * gsize / 2, gsize);
      }
    }
  }
  float* out = A.out + (row * A.nkv * G + kvh * G) * hd;
  for (int64_t g = 0; g < G; ++g) {
    const float r = 1.0f / sums[g];
    for (int64_t d = 0; d < hd; ++d) out[g * hd + d] = acc[g * hd + d] * r;
  }
}

torch::Tensor attention(const torch::Tensor& q_in, const torch::Tensor& k_codes, const torch::Tensor& k_scales,
                        const torch::Tensor& v_codes, const torch::Tensor& v_scales, const torch::Tensor& tables_in,
                        const torch::Tensor& positions_in, int64_t window, int64_t bits, double scale) {
  TORCH_CHECK(bits == 8 || bits == 4, "kv_attention: bits must be 8 or 4, got ", bits);
  TORCH_CHECK(q_in.device().is_cpu() && q_in.scalar_type() == at::kFloat && q_in.dim() == 3,
              "kv_attention: q must be a (rows, heads, hd) float32 CPU tensor, got ", q_in.sizes());
  const torch::Tensor q = q_in.contiguous();
  const int64_t rows = q.size(0), nh = q.size(1), hd = q.size(2);
  const auto code_type = bits == 8 ? at::kChar : at::kByte;
  for (const torch::Tensor* t : {&k_codes, &v_codes})
    TORCH_CHECK(t->device().is_cpu() && t->is_contiguous() && t->dim() == 4 && t->scalar_type() == code_type &&
                t->sizes() == k_codes.sizes() && t->size(3) == hd * bits / 8,
                "kv_attention: codes must be contiguous (blocks, block_size, kv_heads, ", hd * bits / 8, ") ",
                bits == 8 ? "int8" : "uint8", ", got ", t->sizes(), " ", t->scalar_type());
  const int64_t nkv = k_codes.size(2), groups = k_scales.dim() == 4 ? k_scales.size(3) : 0;
  TORCH_CHECK(nkv > 0 && nh % nkv == 0, "kv_attention: ", nh, " query heads do not group over ", nkv, " KV heads");
  // The int4 loops take 16 values (8 bytes) a pass.
  TORCH_CHECK(groups > 0 && hd % groups == 0 && (bits == 8 || (hd / groups) % 16 == 0),
              "kv_attention: ", groups, " scale groups do not split head_dim ", hd, " for int", bits);
  for (const torch::Tensor* t : {&k_scales, &v_scales})
    TORCH_CHECK(t->device().is_cpu() && t->is_contiguous() && t->scalar_type() == at::kHalf && t->dim() == 4 &&
                t->size(0) == k_codes.size(0) && t->size(1) == k_codes.size(1) && t->size(2) == nkv &&
                t->size(3) == groups,
                "kv_attention: scales must be contiguous float16 (blocks, block_size, kv_heads, ", groups, "), got ",
                t->sizes());
  for (const torch::Tensor* t : {&tables_in, &positions_in})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kLong, "kv_attention: tables and positions must be "
                "int64 CPU tensors");
  const torch::Tensor tables = tables_in.contiguous(), positions = positions_in.contiguous();
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == rows && positions.numel() == rows,
              "kv_attention: one block-table row and position per query row (", rows, "), got ", tables.sizes(),
              " and ", positions.numel());
  const int64_t bs = k_codes.size(1), blocks = k_codes.size(0);
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* pp = positions.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows; ++i) {
    // Checked here, not trusted: a bad index would read outside the pool.
    TORCH_CHECK(pp[i] >= 0 && pp[i] < tables.size(1) * bs, "kv_attention: position ", pp[i], " beyond the block table");
    for (int64_t b = 0; b <= pp[i] / bs; ++b)
      TORCH_CHECK(tp[i * tables.size(1) + b] >= 0 && tp[i * tables.size(1) + b] < blocks,
                  "kv_attention: block ", tp[i * tables.size(1) + b], " outside the cache");
  }
  auto out = torch::empty({rows, nh, hd}, q.options());
  const Args A{q.data_ptr<float>(), k_codes.data_ptr(), k_scales.data_ptr<c10::Half>(), v_codes.data_ptr(),
               v_scales.data_ptr<c10::Half>(), tp, tables.size(1), pp, bs, nkv, nh / nkv, hd, window,
               k_codes.size(3), groups, static_cast<float>(scale), out.data_ptr<float>()};
  // One task per (row, KV head); a decode of a few short sequences stays on this thread.
  at::parallel_for(0, rows * nkv, 4, [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) {
      if (bits == 8) attend_one<8>(A, i / nkv, i % nkv);
      else attend_one<4>(A, i / nkv, i % nkv);
    }
  });
  return out;
}

// One int4 group of n values (16 or 32), as kv_quant.py's _quantize_int4 does it: for each candidate top,
// the nearest level of each value of x scaled so that its absmax lands there (a tie to the smaller
// magnitude), and the least-squares scale for those levels; the first candidate of least squared error
// wins. sum(x l) is exact in double and sum(l l) in float (integer levels), so the lanes' order of summing
// does not change the choice: the loops vectorize and still pick what torch picks.
__attribute__((target_clones("avx512f", "avx2", "default")))
void write_int4_group(const float* x, int64_t n, uint8_t* codes, c10::Half* scale) {
  constexpr float FP16_MAX = 65504.0f;
  constexpr int L = 16;
  float mid[7];  // between the positive levels kInt4Levels[8 + m] and [9 + m]
  for (int m = 0; m < 7; ++m) mid[m] = (kInt4Levels[8 + m] + kInt4Levels[9 + m]) / 2;
  float amax = 0;
  for (int64_t d = 0; d < n; ++d) amax = std::max(amax, std::fabs(x[d]));
  float lv[32];
  uint8_t idx[32], best[32];
  double best_score = -1, best_sxl = 0, best_sll = 1;
  for (int c = 0; c < kInt4Candidates; ++c) {
    const float iscale = amax > 0 ? kInt4Tops[c] / amax : 0.0f;
    for (int64_t d = 0; d < n; ++d) {
      const float v = x[d] * iscale, a = std::fabs(v);
      int j = 0;  // the magnitude's level among the 8 positive ones
      for (int m = 0; m < 7; ++m) j += a > mid[m];
      idx[d] = static_cast<uint8_t>(v < 0 ? 7 - j : 8 + j);
      lv[d] = v < 0 ? -kInt4Levels[8 + j] : kInt4Levels[8 + j];
    }
    double sx[L] = {0};
    float sl[L] = {0};
    for (int64_t d = 0; d < n; d += L)
      for (int l = 0; l < L; ++l) {
        sx[l] += static_cast<double>(x[d + l]) * static_cast<double>(lv[d + l]);
        sl[l] += lv[d + l] * lv[d + l];
      }
    double sxl = 0, sll = 0;
    for (int l = 0; l < L; ++l) sxl += sx[l], sll += sl[l];
    const double score = sxl * sxl / sll;
    if (score > best_score) {
      best_score = score, best_sxl = sxl, best_sll = sll;
      std::copy(idx, idx + n, best);
    }
  }
  *scale = c10::Half(std::min(FP16_MAX, static_cast<float>(best_sxl / best_sll)));
  for (int64_t d = 0; d < n; d += 2) codes[d / 2] = static_cast<uint8_t>(best[d] | (best[d + 1] << 4));
}

// x (rows, kv_heads, hd) fp32 quantized into the cache at slots (rows of (blocks * block_size, kv_heads, ...)),
// exactly as engine/kv_quant.py's quantize does it (int8: the same fp32 operations, float16 scale first,
// rounding half to even; int4: write_int4_group): one call instead of a dozen small torch ops per K and V
// per layer and step.
void write_codes(const torch::Tensor& x_in, torch::Tensor codes, torch::Tensor scales, const torch::Tensor& slots_in,
           int64_t bits) {
  TORCH_CHECK(bits == 8 || bits == 4, "kv_attention.write: bits must be 8 or 4, got ", bits);
  TORCH_CHECK(x_in.device().is_cpu() && x_in.scalar_type() == at::kFloat && x_in.dim() == 3,
              "kv_attention.write: x must be a (rows, kv_heads, hd) float32 CPU tensor, got ", x_in.sizes());
  const torch::Tensor x = x_in.contiguous(), slots = slots_in.contiguous();
  const int64_t rows = x.size(0), nkv = x.size(1), hd = x.size(2);
  TORCH_CHECK(codes.is_contiguous() && codes.dim() == 4 && codes.size(2) == nkv && codes.size(3) == hd * bits / 8 &&
              codes.scalar_type() == (bits == 8 ? at::kChar : at::kByte),
              "kv_attention.write: codes must be contiguous (blocks, block_size, ", nkv, ", ", hd * bits / 8, "), got ",
              codes.sizes(), " ", codes.scalar_type());
  const int64_t groups = scales.dim() == 4 ? scales.size(3) : 0;
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == at::kHalf && groups > 0 && hd % groups == 0 &&
              scales.size(0) == codes.size(0) && scales.size(1) == codes.size(1) && scales.size(2) == nkv &&
              (hd / groups) % 2 == 0 && (bits == 8 || hd / groups == 16 || hd / groups == 32),
              "kv_attention.write: scales must be contiguous float16 (blocks, block_size, ", nkv, ", groups), got ",
              scales.sizes());
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == rows, "kv_attention.write: one int64 slot per row");
  const int64_t cache_rows = codes.size(0) * codes.size(1), gsize = hd / groups, width = codes.size(3);
  const float* xp = x.data_ptr<float>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  uint8_t* cp = static_cast<uint8_t*>(codes.data_ptr());
  c10::Half* scp = scales.data_ptr<c10::Half>();
  for (int64_t i = 0; i < rows; ++i)
    TORCH_CHECK(sp[i] >= 0 && sp[i] < cache_rows, "kv_attention.write: slot ", sp[i], " outside the cache");
  constexpr float FP16_MAX = 65504.0f;
  // Rows in parallel (a step's slots are distinct): int4's scale search makes a prompt chunk's write
  // worth spreading.
  at::parallel_for(0, rows, 64, [&](int64_t first, int64_t last) {
  for (int64_t i = first; i < last; ++i) {
    for (int64_t h = 0; h < nkv; ++h) {
      const float* v = xp + (i * nkv + h) * hd;
      uint8_t* c = cp + (sp[i] * nkv + h) * width;
      c10::Half* sc = scp + (sp[i] * nkv + h) * groups;
      for (int64_t g = 0; g < groups; ++g) {
        const float* vg = v + g * gsize;
        if (bits == 8) {
          float amax = 0;
          for (int64_t d = 0; d < gsize; ++d) amax = std::max(amax, std::fabs(vg[d]));
          const c10::Half scale(std::min(amax / 127.0f, FP16_MAX));
          sc[g] = scale;
          const float s = static_cast<float>(scale), inv = s > 0 ? 1.0f / s : 0.0f;
          int8_t* cg = reinterpret_cast<int8_t*>(c) + g * gsize;
          for (int64_t d = 0; d < gsize; ++d)
            cg[d] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, std::nearbyint(vg[d] * inv))));
        } else {
          write_int4_group(vg, gsize, c + g * gsize / 2, sc + g);
        }
      }
    }
  }
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attention", &attention, "one-token attention over a quantized paged KV cache (int8 / int4 codes)",
        py::arg("q"), py::arg("k_codes"), py::arg("k_scales"), py::arg("v_codes"), py::arg("v_scales"),
        py::arg("block_tables"), py::arg("positions"), py::arg("window"), py::arg("bits"), py::arg("scale"));
  m.def("write", &write_codes, "x quantized into the cache's codes and scales at slots, as engine/kv_quant.py does",
        py::arg("x"), py::arg("codes"), py::arg("scales"), py::arg("slots"), py::arg("bits"));
}
