// Small fused CPU ops for a decode step, each one call instead of the 2-8 torch ops engine/model.py
// would otherwise dispatch (at decode each of those ops costs more in dispatch than in arithmetic).
// Each computes what the torch code in engine/model.py computes, op by op, with the same roundings:
// values are widened to fp32, every torch op's result is rounded to the tensor dtype where torch
// would round it, and the build turns off FMA contraction (-ffp-contract=off) so a*b + c rounds
// twice as torch's separate mul and add do. What can differ: the order of the fp32 sum in RMSNorm's
// mean and SiLU's exp (ours within 2 ulp, torch's Sleef within 1) (fp32 results within ~1e-6; a bf16 result then rounds the same
// way or, rarely, one ulp apart). tests/kernels/test_fused_ops.py holds both sides.
//
//   rms_norm(x, w, eps)            y = w * (x32 * rsqrt(mean(x32^2) + eps)).to(dtype)     (rows, n)
//   add_rms_norm(x, r, w, eps)     h = x + r; y = rms_norm(h, w, eps); returns (h, y)
//   silu_mul(g, u)                 silu(g) * u                                             (rows, n)
//   rotary(x, cos, sin)            x * cos + roll(x, hd / 2, -1) * sin   x: (tokens, heads, hd),
//                                  cos, sin: (tokens, 1, hd)
//   decode_attention(q, k, v, k_cache, v_cache, slots, tables, positions, window)
//                                  one query token per row, each with its sequence's block-table row
//                                  (a decode step's sequences, or every token of short prompt chunks:
//                                  engine/model.py _tokenwise_tables): writes all k, v into the paged
//                                  cache at slots first, then softmax(q k^T / sqrt(hd)) v over that
//                                  row's cached keys up to its position; (rows, heads * hd). See
//                                  decode_attention below.
// Tensors: CPU, float32 / bfloat16 / float16, all of one dtype, last dimension contiguous (rows may
// be strided, e.g. the halves of a stacked gate/up output); outputs are new contiguous tensors.

#include <torch/extension.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <cstdint>
#include <tuple>
#include <vector>

#include "exp_approx.h"
#include "stream_prefetch.h"

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

// f(begin, end) over rows [0, rows), split over torch's threads when the op has enough values to pay
// for the fork: in a decode step the other thread often has to be woken first, which costs more than a
// small op saves (so RMSNorm at decode sizes stays on one thread, SiLU*up and prefill-sized ops split).
// Each row is computed as on one thread, so results do not depend on the split.
template <typename F>
void for_rows(int64_t rows, int64_t row_values, const F& f) {
  constexpr int64_t PARALLEL_VALUES = 16384;  // per task; below twice that the op runs here
  if (rows * row_values < 2 * PARALLEL_VALUES) {
    f(0, rows);
    return;
  }
  at::parallel_for(0, rows, std::max<int64_t>(1, PARALLEL_VALUES / std::max<int64_t>(1, row_values)), f);
}

// bf16 rows on AVX-512 (this file is otherwise built for plain x86-64, where the bf16 <-> fp32
// conversions of the row loops below run one value at a time).
// The same arithmetic, 16 values at a time: widening is exact, narrowing rounds to nearest even with
// NaN kept as torch's c10::BFloat16 does, and products and sums are separate roundings as in the
// scalar loops (no FMA), so results are bit for bit theirs (compared once against a build of the scalar
// loops, NaN, inf and subnormals included: a throwaway script; tests/kernels/test_fused_ops.py holds the
// results to torch's).
#define LAYERSTREAM_BF16_AVX512 __attribute__((target("avx512f")))

// The CPU has AVX-512 F (checked once): these rows and decode attention's AVX-512 loops.
bool bf16_avx512() {
  static const bool cpu = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") != 0;
  }();
  return cpu;
}

// 16 bf16 values (raw bits or c10::BFloat16) widened to fp32: exact.
LAYERSTREAM_BF16_AVX512 inline __m512 load_bf16x16(const uint16_t* p) {
  const __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
}

LAYERSTREAM_BF16_AVX512 inline __m512 load_bf16x16(const c10::BFloat16* p) {
  return load_bf16x16(reinterpret_cast<const uint16_t*>(p));
}

// The bf16 bits of v (in the low half of each lane): round to nearest even, NaN -> 0x7FC0.
LAYERSTREAM_BF16_AVX512 inline __m512i bf16_bits(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i bias = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)),
                                        _mm512_set1_epi32(0x7FFF));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
}

LAYERSTREAM_BF16_AVX512 inline __m512 round_bf16x16(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(v), 16));
}

LAYERSTREAM_BF16_AVX512 inline void store_bf16x16(c10::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_bits(v)));
}

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

// rms_norm_impl's row for bf16 on AVX-512: h = x (+ r, rounded; written to hout), then norm_row.
// The 16 lanes of `acc` are norm_row's 16 partial sums, summed in the same order.
LAYERSTREAM_BF16_AVX512 void norm_row_bf16(const c10::BFloat16* xr, const c10::BFloat16* rr, const c10::BFloat16* w,
                                           c10::BFloat16* hout, c10::BFloat16* y, float* h, int64_t n, float eps) {
  const int64_t vn = n / 16 * 16;
  __m512 acc = _mm512_setzero_ps();
  for (int64_t k = 0; k < vn; k += 16) {
    __m512 v = load_bf16x16(xr + k);
    if (rr != nullptr) {
      v = round_bf16x16(_mm512_add_ps(v, load_bf16x16(rr + k)));  // x + r in dtype
      store_bf16x16(hout + k, v);
    }
    _mm512_storeu_ps(h + k, v);
    acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));
  }
  for (int64_t k = vn; k < n; ++k) {
    float v = static_cast<float>(xr[k]);
    if (rr != nullptr) {
      const c10::BFloat16 s = static_cast<c10::BFloat16>(v + static_cast<float>(rr[k]));
      hout[k] = s;
      v = static_cast<float>(s);
    }
    h[k] = v;
  }
  float part[16];
  _mm512_storeu_ps(part, acc);
  float sum = 0;
  for (int j = 0; j < 16; ++j) sum += part[j];
  for (int64_t k = vn; k < n; ++k) sum += h[k] * h[k];
  const float mean = sum / static_cast<float>(n);
  const float r = 1.0f / std::sqrt(mean + eps);
  const __m512 rv = _mm512_set1_ps(r);
  for (int64_t k = 0; k < vn; k += 16) {
    const __m512 normed = round_bf16x16(_mm512_mul_ps(_mm512_loadu_ps(h + k), rv));
    store_bf16x16(y + k, _mm512_mul_ps(load_bf16x16(w + k), normed));
  }
  for (int64_t k = vn; k < n; ++k) {
    const float normed = round_to<c10::BFloat16>(h[k] * r);
    y[k] = static_cast<c10::BFloat16>(static_cast<float>(w[k]) * normed);
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
  for_rows(rows, n, [&](int64_t m0, int64_t m1) {
    std::vector<float> h(n);
    for (int64_t m = m0; m < m1; ++m) {
      const T* xr = xp + m * xs;
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        if (bf16_avx512()) {
          norm_row_bf16(xr, rp ? rp + m * rs : nullptr, wp, rp ? hp + m * n : nullptr, yp + m * n, h.data(), n,
                        static_cast<float>(eps));
          continue;
        }
      }
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
  });
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

// One row of silu(g) * u in fp32 from values widened from T; built for AVX-512, AVX2 and plain x86-64,
// picked at load by the CPU (the loop is the same C++; only the vector width changes).
__attribute__((target_clones("avx512f", "avx2", "default")))
void silu_row(const float* g, float* y, int64_t n) {
  for (int64_t k = 0; k < n; ++k) y[k] = g[k] / (1.0f + exp_approx(-g[k]));
}

__attribute__((target_clones("avx512f", "avx2", "default")))
void silu_mul_row(const float* g, const float* u, float* y, int64_t n, bool round_bf16, bool round_f16) {
  silu_row(g, y, n);
  if (round_bf16) for (int64_t k = 0; k < n; ++k) y[k] = round_to<c10::BFloat16>(y[k]);  // F.silu in dtype
  if (round_f16) for (int64_t k = 0; k < n; ++k) y[k] = round_to<c10::Half>(y[k]);
  for (int64_t k = 0; k < n; ++k) y[k] = y[k] * u[k];
}

// silu_mul_impl's row for bf16 on AVX-512: g widened, silu_row, then (silu rounded to bf16) * u rounded.
LAYERSTREAM_BF16_AVX512 void silu_mul_row_bf16(const c10::BFloat16* gr, const c10::BFloat16* ur, c10::BFloat16* yr,
                                               float* gf, float* yf, int64_t n) {
  const int64_t vn = n / 16 * 16;
  for (int64_t k = 0; k < vn; k += 16) _mm512_storeu_ps(gf + k, load_bf16x16(gr + k));
  for (int64_t k = vn; k < n; ++k) gf[k] = static_cast<float>(gr[k]);
  silu_row(gf, yf, n);
  for (int64_t k = 0; k < vn; k += 16)
    store_bf16x16(yr + k, _mm512_mul_ps(round_bf16x16(_mm512_loadu_ps(yf + k)), load_bf16x16(ur + k)));
  for (int64_t k = vn; k < n; ++k)
    yr[k] = static_cast<c10::BFloat16>(round_to<c10::BFloat16>(yf[k]) * static_cast<float>(ur[k]));
}

template <typename T>
void silu_mul_impl(const torch::Tensor& g, const torch::Tensor& u, torch::Tensor& y) {
  const int64_t n = g.size(-1), rows = rows_of(g);
  const int64_t gs = row_stride(g), us = row_stride(u);
  const T* gp = g.data_ptr<T>();
  const T* up = u.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  for_rows(rows, n, [&](int64_t m0, int64_t m1) {
    std::vector<float> gf(n), uf(n), yf(n);  // uf: the scalar loops' only
    for (int64_t m = m0; m < m1; ++m) {
      const T* gr = gp + m * gs;
      const T* ur = up + m * us;
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        if (bf16_avx512()) {
          silu_mul_row_bf16(gr, ur, yp + m * n, gf.data(), yf.data(), n);
          continue;
        }
      }
      for (int64_t k = 0; k < n; ++k) gf[k] = static_cast<float>(gr[k]);
      for (int64_t k = 0; k < n; ++k) uf[k] = static_cast<float>(ur[k]);
      silu_mul_row(gf.data(), uf.data(), yf.data(), n, std::is_same_v<T, c10::BFloat16>,
                   std::is_same_v<T, c10::Half>);
      T* yr = yp + m * n;
      for (int64_t k = 0; k < n; ++k) yr[k] = static_cast<T>(yf[k]);  // * up, in dtype
    }
  });
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

// rotary_impl's (token, head) row for bf16 on AVX-512, head_dim a multiple of 32 (each half whole vectors).
LAYERSTREAM_BF16_AVX512 void rotary_row_bf16(const c10::BFloat16* xr, const c10::BFloat16* c, const c10::BFloat16* s,
                                             c10::BFloat16* yr, int64_t hd) {
  const int64_t half = hd / 2;
  for (int64_t d = 0; d < hd; d += 16) {
    const __m512 a = round_bf16x16(_mm512_mul_ps(load_bf16x16(xr + d), load_bf16x16(c + d)));  // x * cos
    const int64_t rolled = d < half ? d + half : d - half;
    const __m512 b = round_bf16x16(_mm512_mul_ps(load_bf16x16(xr + rolled), load_bf16x16(s + d)));  // rolled * sin
    store_bf16x16(yr + d, _mm512_add_ps(a, b));
  }
}

template <typename T>
void rotary_impl(const torch::Tensor& x, const torch::Tensor& c, const torch::Tensor& s, torch::Tensor& y) {
  const int64_t tokens = x.size(0), heads = x.size(1), hd = x.size(2), half = hd / 2;
  const int64_t xt = x.stride(0), xh = x.stride(1), ct = c.stride(0), st = s.stride(0);
  const T* xp = x.data_ptr<T>();
  const T* cp = c.data_ptr<T>();
  const T* sp = s.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  for_rows(tokens, heads * hd, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const T* ctr = cp + t * ct;
      const T* str = sp + t * st;
      for (int64_t h = 0; h < heads; ++h) {
        const T* xr = xp + t * xt + h * xh;
        T* yr = yp + (t * heads + h) * hd;
        if constexpr (std::is_same_v<T, c10::BFloat16>) {
          if (hd % 32 == 0 && bf16_avx512()) {
            rotary_row_bf16(xr, ctr, str, yr, hd);
            continue;
          }
        }
        for (int64_t d = 0; d < hd; ++d) {
          // roll by half: element d of the rolled row is x[(d + half) % hd]
          const float a = round_to<T>(static_cast<float>(xr[d]) * static_cast<float>(ctr[d]));  // x * cos
          const float b = round_to<T>(static_cast<float>(xr[d < half ? d + half : d - half]) *
                                      static_cast<float>(str[d]));                             // rolled * sin
          yr[d] = static_cast<T>(a + b);
        }
      }
    }
  });
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


// Single-token attention over the paged KV cache, for decode steps (every sequence brings one query
// token): the KV write, the gather through the block table and SDPA's dispatch cost more than the
// arithmetic at short contexts (docs/benchmarks/decode-profile.md). It computes what SDPA's CPU flash
// kernel computes for one query row whose keys all fit one of its tiles (512 keys): fp32 scores
// q . k * scale, their max, p = exp(s - max) summed in fp32, p rounded to the tensor dtype for the
// p . V product (accumulated in fp32), and out = that / sum rounded once to the dtype. The sums run
// in another order than its GEMMs and exp is exp_approx (within 2 ulp of the exact value, flash's
// own is ~1 ulp), so results agree to fp32 rounding; past 512 keys flash rescales tile by tile and
// rounds p against a running max, so there the two agree to the dtype's rounding
// (tests/kernels/test_fused_ops.py).
//
// Per (sequence, KV head): the `group` query heads that share the KV head are done together, so
// each cached key and value row is read once. bf16 caches on AVX-512 take decode_attention_chunked
// instead: the same arithmetic per chunk of keys, in the cache's order. Built for AVX-512, AVX2 and plain x86-64 like SiLU.
template <typename T>
struct DecodeArgs {
  const T* q; int64_t q_seq, q_head;           // (seqs, heads, hd), last dim contiguous
  const T* kc; const T* vc;                      // (blocks, block_size, kv_heads, hd) contiguous
  const int64_t* tables; int64_t table_stride;   // (seqs, max_blocks)
  const int64_t* positions;                      // (seqs,): each query's position; it attends to keys 0..pos
  int64_t block_size, nkv, group, hd, window;    // window 0: none; else keys > pos - window only
  float scale;
  T* out;                                        // (seqs, heads * hd) contiguous
};

inline float bf16_bits_to_float(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// The kernels below read keys and values through row pointers (one per key, through the block
// table), either fp32 rows or bf16 rows widened as they are read. Not templates: target_clones
// builds each for AVX-512, AVX2 and plain x86-64 and picks one at load.
//
// s[g * stride + j] = scale * (q_g . k_j) for the group's heads g: 16 partial sums per dot product,
// like norm_row, so it vectorizes without reassociation flags.
#define LAYERSTREAM_SCORES(NAME, ELEM, LOAD)                                                              \
  __attribute__((target_clones("avx512f", "avx2", "default")))                                            \
  void NAME(const float* qf, const ELEM* const* rows, int64_t n, int64_t group, int64_t hd, float scale,  \
            float* s, int64_t stride) {                                                                   \
    constexpr int L = 16;                                                                                 \
    for (int64_t j = 0; j < n; ++j) {                                                                     \
      const ELEM* k = rows[j];                                                                            \
      for (int64_t g = 0; g < group; ++g) {                                                               \
        const float* qg = qf + g * hd;                                                                    \
        float acc[L] = {0};                                                                               \
        int64_t d = 0;                                                                                    \
        for (; d + L <= hd; d += L)                                                                       \
          for (int l = 0; l < L; ++l) acc[l] += qg[d + l] * LOAD(k[d + l]);                               \
        float sum = 0;                                                                                    \
        for (int l = 0; l < L; ++l) sum += acc[l];                                                        \
        for (; d < hd; ++d) sum += qg[d] * LOAD(k[d]);                                                    \
        s[g * stride + j] = sum * scale;                                                                  \
      }                                                                                                   \
    }                                                                                                     \
  }
// acc[g * hd + d] += p[g * stride + j] * v_j[d] over the keys j, for the group's heads g.
#define LAYERSTREAM_ACCUMULATE(NAME, ELEM, LOAD)                                                          \
  __attribute__((target_clones("avx512f", "avx2", "default")))                                            \
  void NAME(const float* p, int64_t stride, const ELEM* const* rows, int64_t n, int64_t group, int64_t hd, \
            float* acc) {                                                                                 \
    for (int64_t j = 0; j < n; ++j) {                                                                     \
      const ELEM* v = rows[j];                                                                            \
      for (int64_t g = 0; g < group; ++g) {                                                               \
        const float pg = p[g * stride + j];                                                               \
        float* a = acc + g * hd;                                                                          \
        for (int64_t d = 0; d < hd; ++d) a[d] += pg * LOAD(v[d]);                                         \
      }                                                                                                   \
    }                                                                                                     \
  }
#define LAYERSTREAM_AS_FLOAT(x) (x)
LAYERSTREAM_SCORES(scores_f32, float, LAYERSTREAM_AS_FLOAT)
LAYERSTREAM_SCORES(scores_bf16, uint16_t, bf16_bits_to_float)
LAYERSTREAM_ACCUMULATE(accumulate_f32, float, LAYERSTREAM_AS_FLOAT)
LAYERSTREAM_ACCUMULATE(accumulate_bf16, uint16_t, bf16_bits_to_float)

// A decode step's cached keys and values come from memory, not cache (the streamed weights pass
// through it between one layer's attention and the next), one short row per key and KV head through
// the block table: asked for all at once, their misses overlap instead of following one another.
inline void prefetch_row(const void* row, int64_t bytes) {
  const char* p = static_cast<const char*>(row);
  for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
}

// f(j, row) for keys lo..lo+n-1 of one sequence's KV head in a paged cache (blocks, block_size, nkv, hd),
// walking the block table a block at a time rather than dividing per key for its block and offset
// (faster at every context measured, with the register accumulators below).
template <typename T, typename F>
inline void for_each_row(const T* cache, const int64_t* table, int64_t block_size, int64_t nkv, int64_t kvh,
                         int64_t hd, int64_t lo, int64_t n, const F& f) {
  const int64_t row_stride = nkv * hd;
  for (int64_t j = 0, key = lo; j < n;) {
    const int64_t b = key / block_size, off = key - b * block_size;
    const int64_t take = std::min(block_size - off, n - j);
    const T* r = cache + ((table[b] * block_size + off) * nkv + kvh) * hd;
    for (int64_t i = 0; i < take; ++i) f(j + i, r + i * row_stride);
    j += take;
    key += take;
  }
}

// Row pointers of keys lo..lo+n-1 of one sequence's KV head, as the kernels read them: bf16 rows as
// they lie in the cache, fp32 rows likewise (prefetched as the pointers are made), fp16 rows widened
// into `wide` first.
template <typename T>
void key_rows(const T* cache, const int64_t* table, int64_t block_size, int64_t nkv, int64_t kvh, int64_t hd,
              int64_t lo, int64_t n, std::vector<const void*>& rows, std::vector<float>& wide) {
  rows.resize(n);
  if (std::is_same_v<T, c10::Half>) wide.resize(n * hd);
  for_each_row(cache, table, block_size, nkv, kvh, hd, lo, n, [&](int64_t j, const T* r) {
    if constexpr (std::is_same_v<T, c10::Half>) {
      for (int64_t d = 0; d < hd; ++d) wide[j * hd + d] = static_cast<float>(r[d]);
      rows[j] = wide.data() + j * hd;
    } else {
      rows[j] = r;
      prefetch_row(r, hd * sizeof(T));
    }
  });
}

// Every row of keys lo..lo+n-1 of one sequence's KV head asked from memory now, before it is read.
template <typename T>
void prefetch_rows(const T* cache, const int64_t* table, int64_t block_size, int64_t nkv, int64_t kvh, int64_t hd,
                   int64_t lo, int64_t n) {
  for_each_row(cache, table, block_size, nkv, kvh, hd, lo, n,
               [&](int64_t, const T* r) { prefetch_row(r, hd * sizeof(T)); });
}

// bf16 caches on AVX-512 with head_dim a multiple of 16 (up to 256) take decode_attention_chunked (below);
// the loops above serve the rest.
constexpr int64_t AVX512_MAX_HD = 256;

bool attention_avx512(int64_t hd) { return bf16_avx512() && hd % 16 == 0 && hd <= AVX512_MAX_HD; }

template <typename T>
void scores(const float* qf, const std::vector<const void*>& rows, int64_t group, int64_t hd, float scale,
            float* s, int64_t stride) {
  const int64_t n = static_cast<int64_t>(rows.size());
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    scores_bf16(qf, reinterpret_cast<const uint16_t* const*>(rows.data()), n, group, hd, scale, s, stride);
  } else {
    scores_f32(qf, reinterpret_cast<const float* const*>(rows.data()), n, group, hd, scale, s, stride);
  }
}

template <typename T>
void accumulate(const float* p, int64_t stride, const std::vector<const void*>& rows, int64_t group, int64_t hd,
                float* acc) {
  const int64_t n = static_cast<int64_t>(rows.size());
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    accumulate_bf16(p, stride, reinterpret_cast<const uint16_t* const*>(rows.data()), n, group, hd, acc);
  } else {
    accumulate_f32(p, stride, reinterpret_cast<const float* const*>(rows.data()), n, group, hd, acc);
  }
}

// p = exp(s - max s) over one row of scores, in place (softmax_numerators), then rounded to bf16 or fp16
// when asked; returns the fp32 sum of the unrounded p.
__attribute__((target_clones("avx512f", "avx2", "default")))
float softmax_row(float* s, int64_t n, bool round_bf16, bool round_f16) {
  const float sum = softmax_numerators(s, n);
  if (round_bf16) for (int64_t k = 0; k < n; ++k) s[k] = round_to<c10::BFloat16>(s[k]);
  if (round_f16) for (int64_t k = 0; k < n; ++k) s[k] = round_to<c10::Half>(s[k]);
  return sum;
}

template <typename T>
void decode_attend_one(const DecodeArgs<T>& A, int64_t seq, int64_t kvh) {
  const int64_t pos = A.positions[seq], hd = A.hd, G = A.group;
  const int64_t lo = A.window > 0 ? std::max<int64_t>(0, pos - A.window + 1) : 0, ctx = pos + 1 - lo;
  thread_local std::vector<float> qf, s, acc, wide, sums;
  thread_local std::vector<const void*> rows;
  qf.resize(G * hd); s.resize(G * ctx); acc.assign(G * hd, 0.0f); sums.resize(G);
  for (int64_t g = 0; g < G; ++g) {
    const T* qg = A.q + seq * A.q_seq + (kvh * G + g) * A.q_head;
    for (int64_t d = 0; d < hd; ++d) qf[g * hd + d] = static_cast<float>(qg[d]);
  }
  const int64_t* table = A.tables + seq * A.table_stride;
  prefetch_rows(A.vc, table, A.block_size, A.nkv, kvh, hd, lo, ctx);  // read after the scores
  key_rows(A.kc, table, A.block_size, A.nkv, kvh, hd, lo, ctx, rows, wide);
  scores<T>(qf.data(), rows, G, hd, A.scale, s.data(), ctx);
  for (int64_t g = 0; g < G; ++g)  // flash multiplies V by p in the dtype
    sums[g] = softmax_row(s.data() + g * ctx, ctx, std::is_same_v<T, c10::BFloat16>,
                          std::is_same_v<T, c10::Half>);
  key_rows(A.vc, table, A.block_size, A.nkv, kvh, hd, lo, ctx, rows, wide);
  accumulate<T>(s.data(), ctx, rows, G, hd, acc.data());
  T* out = A.out + seq * (A.nkv * G * hd) + kvh * G * hd;
  for (int64_t g = 0; g < G; ++g) {
    const float r = 1.0f / sums[g];
    for (int64_t d = 0; d < hd; ++d) out[g * hd + d] = static_cast<T>(acc[g * hd + d] * r);
  }
}

// bf16 caches on AVX-512 (attention_avx512): the same arithmetic as decode_attend_one, read in the cache's
// order. A cache block holds block_size keys x every KV head, contiguous. Reading one KV head's rows for
// the whole context (decode_attend_one), or a slice of heads per task, touches a few hundred bytes of
// each key's row of heads and leaves the memory's prefetchers little to follow: that kept attention far
// below the memory's speed. Here a task takes a span of DECODE_SPAN keys of one sequence and every KV
// head, and walks it block by block, so each task reads whole cache blocks front to back; the threads
// split the keys, never the heads.
//
// Chunks of DECODE_CHUNK keys are softmaxed apart (against their own max, p rounded to bf16 there) and
// merged as flash-decoding merges them: out = sum_c e^(m_c - M) acc_c / sum_c e^(m_c - M) l_c. Past one
// chunk, p is rounded against each chunk's max, as flash's tiles round it against their running max (so
// the two agree to the dtype's rounding). Three passes, each over all spans of a wave of sequences split
// over the threads: (1) each span's scores and their max per head; (2) p = exp(s - its chunk's max, from
// the maxima of the chunk's spans), their sum and p . V over the span; (3) per (sequence, head), the spans'
// sums and p . V added in span order into their chunk's, then the chunks merged. Against decode_attend_one the
// dot products are reduced in another order (16 keys' at once, sum_lanes16) and p . V and sum p are
// summed span by span, so the two agree to fp32 rounding, not bit for bit. Chunks and spans depend on the
// context alone, never on the threads, and so do the results.
constexpr int64_t DECODE_CHUNK = 512;
constexpr int64_t DECODE_SPAN = 128;  // enough spans to keep two threads busy at one chunk
// A wave's scores and span partials (1 MiB): they stay in the cores' caches from one pass to the next.
constexpr int64_t DECODE_SCRATCH_FLOATS = 1 << 18;

// The sums of the lanes of v[0..15], in lane i for v[i]: pairs of vectors folded together (halves, then
// quarters, then within 128 bits) rather than each reduced alone, a third of the shuffles and adds. Each
// v[i]'s lanes are added in the same tree wherever it sits in v, so a score does not depend on its tile.
LAYERSTREAM_BF16_AVX512 inline __m512 sum_lanes16(const __m512* v) {
  __m512 t[8], u[4];
  for (int k = 0; k < 8; ++k)  // t[k]: 8-lane partials of v[2k] (low 256 bits) and v[2k + 1]
    t[k] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0xEE));
  for (int k = 0; k < 4; ++k)  // u[k]: 4-lane partials of v[4k + j] in its 128 bits j
    u[k] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * k], t[2 * k + 1], 0x88),
                         _mm512_shuffle_f32x4(t[2 * k], t[2 * k + 1], 0xDD));
  const __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(u[0], u[1]), _mm512_unpackhi_ps(u[0], u[1]));
  const __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(u[2], u[3]), _mm512_unpackhi_ps(u[2], u[3]));
  const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(s01, s23, _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_ps(s01, s23, _MM_SHUFFLE(3, 2, 3, 2)));  // lane 4j + m: v[4m + j]
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), r);
}

// A row of hd bf16 values asked for a block ahead of the one being read, a row at a time with the reading:
// the blocks lie where the block table puts them, so the memory's prefetchers cannot follow from one block
// to the next, and the whole next block asked for at once stalled on the fill buffers. Into L2 (T1), not L1:
// a block ahead is far more than the memory's latency, and an L1 prefetch holds one of the core's few L1
// fill buffers until its line arrives, which capped the kernel's reads from memory (stream_prefetch.h says
// the same of the weights); the line moves from L2 to L1 when the row is read.
inline void prefetch_ahead(const uint16_t* row, int64_t hd) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t b = 0; b < hd * static_cast<int64_t>(sizeof(uint16_t)); b += 64) _mm_prefetch(p + b, _MM_HINT_T1);
}

// s[g * stride + i] = scale * (q_g . k_i) for `take` (<= 16) keys k_i = k + i * kstride of one KV head and
// its G query heads qf (G x hd), asking for the first ahead_rows rows at `ahead` (same stride) meanwhile.
// CT: hd / 16 when the caller knows it (the loops then unroll), else 0.
template <int CT>
LAYERSTREAM_BF16_AVX512 void scores_tile(const float* qf, const uint16_t* k, int64_t kstride, int64_t take,
                                         int64_t G, int64_t hd, float scale, float* s, int64_t stride,
                                         const uint16_t* ahead, int64_t ahead_rows) {
  const int64_t C = CT > 0 ? CT : hd / 16;
  const __mmask16 keep = static_cast<__mmask16>((1u << take) - 1);
  __m512 dots[8][16];
  for (int64_t g0 = 0; g0 < G; g0 += 8) {
    const int64_t gn = std::min<int64_t>(8, G - g0);
    const float* q = qf + g0 * hd;
    for (int64_t i = 0; i < 16; ++i) {
      if (i >= take) {
        for (int64_t g = 0; g < gn; ++g) dots[g][i] = _mm512_setzero_ps();
        continue;
      }
      if (g0 == 0 && i < ahead_rows) prefetch_ahead(ahead + i * kstride, hd);
      __m512 kz[CT > 0 ? CT : AVX512_MAX_HD / 16];
      for (int64_t c = 0; c < C; ++c) kz[c] = load_bf16x16(k + i * kstride + 16 * c);
      for (int64_t g = 0; g < gn; ++g) {
        __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(q + g * hd), kz[0]);
        for (int64_t c = 1; c < C; ++c) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * hd + 16 * c), kz[c], acc);
        dots[g][i] = acc;
      }
    }
    for (int64_t g = 0; g < gn; ++g)
      _mm512_mask_storeu_ps(s + (g0 + g) * stride, keep, _mm512_mul_ps(sum_lanes16(dots[g]), _mm512_set1_ps(scale)));
  }
}

// acc[h][16 c .. 16 (c + 1)) += p[h * pstride + i] * v_i[same columns] for H heads and CB 16-lane columns,
// over `take` rows v_i = v + i * vstride, in key order: the accumulators stay in registers for the rows,
// and H is exact, so no head is guarded in the loop.
template <int CB, int H>
LAYERSTREAM_BF16_AVX512 void pv_tile(const float* p, int64_t pstride, const uint16_t* v, int64_t vstride,
                                     int64_t take, float* acc, int64_t hd, const uint16_t* ahead,
                                     int64_t ahead_rows) {
  __m512 a[H][CB];
  for (int h = 0; h < H; ++h)
    for (int c = 0; c < CB; ++c) a[h][c] = _mm512_loadu_ps(acc + h * hd + 16 * c);
  for (int64_t i = 0; i < take; ++i) {
    if (i < ahead_rows) prefetch_ahead(ahead + i * vstride, hd);
    for (int c = 0; c < CB; ++c) {
      const __m512 vz = load_bf16x16(v + i * vstride + 16 * c);
      for (int h = 0; h < H; ++h) a[h][c] = _mm512_fmadd_ps(_mm512_set1_ps(p[h * pstride + i]), vz, a[h][c]);
    }
  }
  for (int h = 0; h < H; ++h)
    for (int c = 0; c < CB; ++c) _mm512_storeu_ps(acc + h * hd + 16 * c, a[h][c]);
}

template <int CB, int H>
LAYERSTREAM_BF16_AVX512 inline void pv_heads(int64_t hg, const float* p, int64_t pstride, const uint16_t* v,
                                             int64_t vstride, int64_t take, float* acc, int64_t hd,
                                             const uint16_t* ahead, int64_t ahead_rows) {
  if constexpr (H > 0) {
    if (hg == H) return pv_tile<CB, H>(p, pstride, v, vstride, take, acc, hd, ahead, ahead_rows);
    pv_heads<CB, H - 1>(hg, p, pstride, v, vstride, take, acc, hd, ahead, ahead_rows);
  }
}

// acc (G x hd) += p . V over `take` rows of one KV head, in tiles of the widest column slice (a power of
// two of 16-lane columns dividing hd / 16) whose accumulators for the group fit the registers; the first
// tile asks for the rows at `ahead` as scores_tile does.
LAYERSTREAM_BF16_AVX512 void pv_rows(const float* p, int64_t pstride, const uint16_t* v, int64_t vstride,
                                     int64_t take, int64_t G, int64_t hd, float* acc, const uint16_t* ahead,
                                     int64_t ahead_rows) {
  const int64_t C = hd / 16;
  int64_t cb = 8;
  while (cb > 1 && (C % cb != 0 || G * cb > 24)) cb /= 2;
  const int64_t HG = 24 / cb;
  for (int64_t c0 = 0; c0 < C; c0 += cb)
    for (int64_t g0 = 0; g0 < G; g0 += HG) {
      const int64_t hg = std::min(HG, G - g0);
      const float* pg = p + g0 * pstride;
      const uint16_t* vc = v + 16 * c0;
      float* ag = acc + g0 * hd + 16 * c0;
      const int64_t ar = c0 == 0 && g0 == 0 ? ahead_rows : 0;
      switch (cb) {
        case 8: pv_heads<8, 3>(hg, pg, pstride, vc, vstride, take, ag, hd, ahead, ar); break;
        case 4: pv_heads<4, 6>(hg, pg, pstride, vc, vstride, take, ag, hd, ahead, ar); break;
        case 2: pv_heads<2, 12>(hg, pg, pstride, vc, vstride, take, ag, hd, ahead, ar); break;
        default: pv_heads<1, 24>(hg, pg, pstride, vc, vstride, take, ag, hd, ahead, ar);
      }
    }
}

// p = exp(s - mx) over n scores, in place and rounded to bf16 (flash multiplies V by p in the dtype);
// returns the fp32 sum of the unrounded p, in softmax_numerators' order.
LAYERSTREAM_BF16_AVX512 float span_numerators(float* s, int64_t n, float mx) {
  const float sum = exp_numerators(s, n, mx);
  for (int64_t j = 0; j < n; ++j) s[j] = round_to<c10::BFloat16>(s[j]);
  return sum;
}

LAYERSTREAM_BF16_AVX512 void widen_row(const c10::BFloat16* x, float* y, int64_t hd) {
  for (int64_t d = 0; d < hd; d += 16) _mm512_storeu_ps(y + d, load_bf16x16(x + d));
}

LAYERSTREAM_BF16_AVX512 float row_max(const float* s, int64_t n) {
  float top = -INFINITY;
  for (int64_t k = 0; k < n; ++k) top = s[k] > top ? s[k] : top;
  return top;
}

// o (hd) += b: the spans' p . V into their chunk's.
LAYERSTREAM_BF16_AVX512 void add_rows(float* o, const float* b, int64_t hd) {
  for (int64_t d = 0; d < hd; d += 16)
    _mm512_storeu_ps(o + d, _mm512_add_ps(_mm512_loadu_ps(o + d), _mm512_loadu_ps(b + d)));
}

// Keys [k0, k1) of sequence seq, and the spans of its chunk (indices into the wave's spans).
struct DecodeSpan {
  int64_t seq, k0, k1, first_span_of_chunk, last_span_of_chunk;
};

struct ChunkedDecode {
  const DecodeArgs<c10::BFloat16>& A;
  int64_t heads;

  // f(j, take, base, ahead, ahead_rows) over keys [k0, k1) of sequence seq: keys k0 + j .. + take lie in
  // one cache block, `base` the first one's row of KV head 0; the next run's first ahead_rows keys (none
  // after the last) start at `ahead`.
  template <typename F>
  void runs(const c10::BFloat16* cache, int64_t seq, int64_t k0, int64_t k1, const F& f) const {
    const int64_t bs = A.block_size, row = A.nkv * A.hd, n = k1 - k0;
    const int64_t* table = A.tables + seq * A.table_stride;
    for (int64_t j = 0, key = k0; j < n;) {
      const int64_t b = key / bs, off = key - b * bs, take = std::min(bs - off, n - j);
      const int64_t ahead_rows = std::min(take, std::min(bs, n - j - take));
      const c10::BFloat16* ahead = ahead_rows > 0 ? cache + table[b + 1] * bs * row : cache;
      f(j, take, reinterpret_cast<const uint16_t*>(cache + (table[b] * bs + off) * row),
        reinterpret_cast<const uint16_t*>(ahead), ahead_rows);
      j += take;
      key += take;
    }
  }

  // Pass 1: s (heads x n, this sequence's scores from key lo) over keys [k0, k1), and each head's max of them.
  void scores(int64_t seq, int64_t lo, int64_t n, int64_t k0, int64_t k1, float* s, float* mx) const {
    const int64_t hd = A.hd, G = A.group, nkv = A.nkv;
    thread_local std::vector<float> qf;
    qf.resize(heads * hd);
    for (int64_t h = 0; h < heads; ++h) widen_row(A.q + seq * A.q_seq + h * A.q_head, qf.data() + h * hd, hd);
    runs(A.kc, seq, k0, k1, [&](int64_t j, int64_t take, const uint16_t* base, const uint16_t* ahead, int64_t ar) {
      for (int64_t kvh = 0; kvh < nkv; ++kvh) {
        const float* q = qf.data() + kvh * G * hd;
        float* sk = s + kvh * G * n + (k0 - lo) + j;
        const uint16_t* k = base + kvh * hd;
        switch (hd / 16) {
          case 4: scores_tile<4>(q, k, nkv * hd, take, G, hd, A.scale, sk, n, ahead + kvh * hd, ar); break;
          case 8: scores_tile<8>(q, k, nkv * hd, take, G, hd, A.scale, sk, n, ahead + kvh * hd, ar); break;
          case 16: scores_tile<16>(q, k, nkv * hd, take, G, hd, A.scale, sk, n, ahead + kvh * hd, ar); break;
          default: scores_tile<0>(q, k, nkv * hd, take, G, hd, A.scale, sk, n, ahead + kvh * hd, ar);
        }
      }
    });
    for (int64_t h = 0; h < heads; ++h) mx[h] = row_max(s + h * n + (k0 - lo), k1 - k0);
  }

  // Pass 2: p over keys [k0, k1) against each head's chunk max m (heads), its sums l (heads) and p . V
  // acc (heads x hd).
  void values(int64_t seq, int64_t lo, int64_t n, int64_t k0, int64_t k1, float* s, const float* m, float* l,
              float* acc) const {
    const int64_t hd = A.hd, G = A.group, nkv = A.nkv;
    for (int64_t h = 0; h < heads; ++h) l[h] = span_numerators(s + h * n + (k0 - lo), k1 - k0, m[h]);
    std::fill(acc, acc + heads * hd, 0.0f);
    runs(A.vc, seq, k0, k1, [&](int64_t j, int64_t take, const uint16_t* base, const uint16_t* ahead, int64_t ar) {
      for (int64_t kvh = 0; kvh < nkv; ++kvh)
        pv_rows(s + kvh * G * n + (k0 - lo) + j, n, base + kvh * hd, nkv * hd, take, G, hd,
                acc + kvh * G * hd, ahead + kvh * hd, ar);
    });
  }
};

// Every sequence's context [lo, pos] in chunks, each chunk in spans; the passes of ChunkedDecode over all
// of a wave's spans at once, split over the threads by span.
void decode_attention_chunked(const DecodeArgs<c10::BFloat16>& A, int64_t seqs) {
  const int64_t heads = A.nkv * A.group, hd = A.hd;
  const ChunkedDecode D{A, heads};
  const auto window_start = [&](int64_t i) {
    return A.window > 0 ? std::max<int64_t>(0, A.positions[i] - A.window + 1) : int64_t{0};
  };
  const auto keys = [&](int64_t i) { return A.positions[i] + 1 - window_start(i); };
  const auto chunks = [&](int64_t i) { return (keys(i) + DECODE_CHUNK - 1) / DECODE_CHUNK; };
  // Chunks of equal length (at most DECODE_CHUNK): the tasks' work is even.
  const auto chunk_keys = [&](int64_t i) { return (keys(i) + chunks(i) - 1) / chunks(i); };
  const auto spans_of = [&](int64_t i) {
    const int64_t ck = chunk_keys(i), full = keys(i) / ck, rest = keys(i) - full * ck;
    return full * ((ck + DECODE_SPAN - 1) / DECODE_SPAN) + (rest + DECODE_SPAN - 1) / DECODE_SPAN;
  };
  std::vector<float> scratch;
  std::vector<DecodeSpan> spans;
  std::vector<int64_t> score_start, span_start;
  for (int64_t first = 0; first < seqs;) {
    // A wave of sequences whose scores and span partials fit the scratch (at least one sequence).
    int64_t last = first, floats = 0;
    score_start.assign(1, 0);
    span_start.assign(1, 0);
    spans.clear();
    for (; last < seqs; ++last) {
      const int64_t need = heads * keys(last) + spans_of(last) * heads * (hd + 3);
      if (last > first && floats + need > DECODE_SCRATCH_FLOATS) break;
      floats += need;
      score_start.push_back(score_start.back() + heads * keys(last));
      const int64_t lo = window_start(last), end = A.positions[last] + 1, ck = chunk_keys(last);
      for (int64_t c = 0; c < chunks(last); ++c) {
        const int64_t c0 = lo + c * ck, c1 = std::min(end, c0 + ck), s0 = static_cast<int64_t>(spans.size());
        for (int64_t k0 = c0; k0 < c1; k0 += DECODE_SPAN)
          spans.push_back({last, k0, std::min(c1, k0 + DECODE_SPAN), s0, 0});
        for (int64_t t = s0; t < static_cast<int64_t>(spans.size()); ++t) spans[t].last_span_of_chunk = spans.size();
      }
      span_start.push_back(spans.size());
    }
    const int64_t nspans = static_cast<int64_t>(spans.size());
    scratch.resize(score_start.back() + nspans * heads * (hd + 3));
    float* S = scratch.data();                   // per sequence: (heads, keys) scores, then p
    float* mx = S + score_start.back();          // (spans, heads): the span's max score
    float* ls = mx + nspans * heads;             // (spans, heads): its sum of p
    float* ms = ls + nspans * heads;             // (spans, heads): its chunk's max
    float* accs = ms + nspans * heads;           // (spans, heads, hd): its p . V
    at::parallel_for(0, nspans, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const DecodeSpan& sp = spans[t];
        D.scores(sp.seq, window_start(sp.seq), keys(sp.seq), sp.k0, sp.k1, S + score_start[sp.seq - first],
                 mx + t * heads);
      }
    });
    at::parallel_for(0, nspans, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const DecodeSpan& sp = spans[t];
        float* m = ms + t * heads;
        for (int64_t h = 0; h < heads; ++h) {
          float top = -INFINITY;
          for (int64_t u = sp.first_span_of_chunk; u < sp.last_span_of_chunk; ++u)
            top = std::max(top, mx[u * heads + h]);
          m[h] = top;
        }
        D.values(sp.seq, window_start(sp.seq), keys(sp.seq), sp.k0, sp.k1, S + score_start[sp.seq - first], m,
                 ls + t * heads, accs + t * heads * hd);
      }
    });
    // Per (sequence, head): each chunk's spans added in span order, then the chunks merged in chunk order.
    at::parallel_for(0, (last - first) * heads, heads, [&](int64_t t0, int64_t t1) {
      thread_local std::vector<float> chunk, o;
      chunk.resize(hd);
      o.resize(hd);
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t i = first + t / heads, h = t % heads, nc = chunks(i);
        const int64_t u0 = span_start[i - first], u1 = span_start[i - first + 1];
        float top = -INFINITY;
        for (int64_t u = u0; u < u1; ++u) top = std::max(top, ms[u * heads + h]);
        float sum = 0.0f;
        std::fill(o.begin(), o.end(), 0.0f);
        for (int64_t u = u0; u < u1;) {
          const int64_t end = spans[u].last_span_of_chunk;
          float l = ls[u * heads + h];
          std::memcpy(chunk.data(), accs + (u * heads + h) * hd, hd * sizeof(float));
          for (int64_t v = u + 1; v < end; ++v) {
            l += ls[v * heads + h];
            add_rows(chunk.data(), accs + (v * heads + h) * hd, hd);
          }
          if (nc == 1) {
            sum = l;
            o.swap(chunk);
          } else {
            const float w = exp_approx(ms[u * heads + h] - top);
            sum += w * l;
            for (int64_t d = 0; d < hd; ++d) o[d] += w * chunk[d];
          }
          u = end;
        }
        const float r = 1.0f / sum;
        c10::BFloat16* out = A.out + i * (heads * hd) + h * hd;
        for (int64_t d = 0; d < hd; ++d) out[d] = static_cast<c10::BFloat16>(o[d] * r);
      }
    });
    first = last;
  }
}

// Whether decode_attention_chunked ran these sequences (bf16 on AVX-512), or decode_attend_one must.
bool decode_chunked(const DecodeArgs<c10::BFloat16>& A, int64_t seqs) {
  if (!attention_avx512(A.hd)) return false;
  decode_attention_chunked(A, seqs);
  return true;
}
template <typename T>
bool decode_chunked(const DecodeArgs<T>&, int64_t) { return false; }

// Copies rows (seqs, kv_heads, hd) of src into the cache at slots (rows of (blocks * block_size, kv_heads, hd)).
template <typename T>
void write_slots(const torch::Tensor& src, torch::Tensor& cache, const int64_t* slots, int64_t seqs) {
  const int64_t nkv = src.size(1), hd = src.size(2);
  const T* sp = src.data_ptr<T>();
  T* cp = cache.data_ptr<T>();
  for (int64_t i = 0; i < seqs; ++i)
    for (int64_t h = 0; h < nkv; ++h)
      std::memcpy(cp + (slots[i] * nkv + h) * hd, sp + i * src.stride(0) + h * src.stride(1), hd * sizeof(T));
}

torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               torch::Tensor k_cache, torch::Tensor v_cache, const torch::Tensor& slots_in,
                               const torch::Tensor& tables_in, const torch::Tensor& positions_in, int64_t window) {
  for (const torch::Tensor* t : std::initializer_list<const torch::Tensor*>{&q, &k, &v, &k_cache, &v_cache}) check(*t, "q, k, v and the caches", q);
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && k.sizes() == v.sizes(),
              "decode_attention: q (seqs, heads, hd), k and v (seqs, kv_heads, hd), got ", q.sizes(), ", ",
              k.sizes(), ", ", v.sizes());
  const int64_t seqs = q.size(0), nh = q.size(1), hd = q.size(2), nkv = k.size(1);
  TORCH_CHECK(k.size(0) == seqs && k.size(2) == hd && nkv > 0 && nh % nkv == 0,
              "decode_attention: ", nh, " query heads of ", hd, " do not group over k ", k.sizes());
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              k_cache.sizes() == v_cache.sizes() && k_cache.size(2) == nkv && k_cache.size(3) == hd,
              "decode_attention: caches must be contiguous (blocks, block_size, ", nkv, ", ", hd, "), got ",
              k_cache.sizes(), " and ", v_cache.sizes());
  for (const torch::Tensor* t : {&slots_in, &tables_in, &positions_in})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kLong, "decode_attention: slots, tables and "
                "positions must be int64 CPU tensors");
  const torch::Tensor slots = slots_in.contiguous(), tables = tables_in.contiguous(), positions = positions_in.contiguous();
  TORCH_CHECK(slots.numel() == seqs && positions.numel() == seqs && tables.dim() == 2 && tables.size(0) == seqs,
              "decode_attention: one slot, position and block-table row per sequence (", seqs, "), got ",
              slots.numel(), ", ", positions.numel(), ", ", tables.sizes());
  const int64_t bs = k_cache.size(1), cache_rows = k_cache.size(0) * bs;
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* pp = positions.data_ptr<int64_t>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  for (int64_t i = 0; i < seqs; ++i) {
    // Checked here, not trusted: a bad index would read or write outside the pool.
    TORCH_CHECK(sp[i] >= 0 && sp[i] < cache_rows, "decode_attention: slot ", sp[i], " outside the cache");
    TORCH_CHECK(pp[i] >= 0 && pp[i] < tables.size(1) * bs, "decode_attention: position ", pp[i],
                " beyond the block table");
    for (int64_t b = 0; b <= pp[i] / bs; ++b)
      TORCH_CHECK(tp[i * tables.size(1) + b] >= 0 && tp[i * tables.size(1) + b] < k_cache.size(0),
                  "decode_attention: block ", tp[i * tables.size(1) + b], " outside the cache");
  }
  auto out = torch::empty({seqs, nh * hd}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "decode_attention", [&] {
    write_slots<scalar_t>(k, k_cache, sp, seqs);
    write_slots<scalar_t>(v, v_cache, sp, seqs);
    const DecodeArgs<scalar_t> A{q.data_ptr<scalar_t>(), q.stride(0), q.stride(1), k_cache.data_ptr<scalar_t>(),
                                 v_cache.data_ptr<scalar_t>(), tp, tables.size(1), pp, bs, nkv, nh / nkv, hd,
                                 window, static_cast<float>(1.0 / std::sqrt(static_cast<double>(hd))),
                                 out.data_ptr<scalar_t>()};
    if (decode_chunked(A, seqs)) return;
    // One task per (sequence, KV head); a decode of a few short sequences stays on this thread.
    at::parallel_for(0, seqs * nkv, 4, [&](int64_t a, int64_t b) {
      for (int64_t i = a; i < b; ++i) decode_attend_one(A, i / nkv, i % nkv);
    });
  });
  return out;
}

// -- the memory's read speed (bench-decode-profile, bench-scale) ------------------------------------------
// Every byte of `tensors` read once, the way the kernels stream weights: each thread reads its share as two
// streams side by side, 256 bytes a step each, asking for the lines ahead at stream_prefetch.h's distances.
// Nothing is computed, so what it takes is what reading those bytes from where they lie takes: a kernel over
// the same bytes can at best match it. Returns an xor of what it read (so that no read is optimised away).
LAYERSTREAM_BF16_AVX512 uint64_t read_streams_avx512(const char* p, int64_t n) {  // n: a multiple of 512
  const char* q = p + n / 2;
  __m512i a = _mm512_setzero_si512(), b = _mm512_setzero_si512();
  for (int64_t i = 0; i < n / 2; i += 256) {
    layerstream::prefetch_stream<4>(p + i);
    layerstream::prefetch_stream<4>(q + i);
    for (int64_t j = 0; j < 256; j += 64) {
      a = _mm512_xor_si512(a, _mm512_loadu_si512(p + i + j));
      b = _mm512_xor_si512(b, _mm512_loadu_si512(q + i + j));
    }
  }
  alignas(64) uint64_t lanes[8];
  _mm512_store_si512(lanes, _mm512_xor_si512(a, b));
  uint64_t r = 0;
  for (uint64_t l : lanes) r ^= l;
  return r;
}

uint64_t read_bytes(const char* p, int64_t n) {
  if (bf16_avx512() && n % 512 == 0) return read_streams_avx512(p, n);
  uint64_t r = 0;
  for (int64_t i = 0; i + 8 <= n; i += 8) {
    uint64_t v;
    std::memcpy(&v, p + i, 8);
    r ^= v;
  }
  for (int64_t i = n / 8 * 8; i < n; ++i) r ^= static_cast<unsigned char>(p[i]);
  return r;
}

int64_t stream_read(const std::vector<torch::Tensor>& tensors) {
  uint64_t all = 0;
  for (const torch::Tensor& t : tensors) {
    TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), "stream_read: contiguous CPU tensors only");
    const char* base = static_cast<const char*>(t.data_ptr());
    const int64_t n = static_cast<int64_t>(t.nbytes()), steps = n / 512;
    std::vector<uint64_t> parts(at::get_num_threads() + 1, 0);
    // one contiguous share of 512-byte steps per thread
    const int64_t share = std::max<int64_t>(1, (steps + at::get_num_threads() - 1) / at::get_num_threads());
    at::parallel_for(0, steps, share, [&](int64_t s0, int64_t s1) {
      parts[at::get_thread_num()] ^= read_bytes(base + s0 * 512, (s1 - s0) * 512);
    });
    parts.back() = read_bytes(base + steps * 512, n - steps * 512);
    for (uint64_t x : parts) all ^= x;
  }
  return static_cast<int64_t>(all);
}

}  // namespace

// decode_block.cpp includes this file for its functions and defines its own module.
#ifndef LAYERSTREAM_NO_MODULE
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "w * (x * rsqrt(mean(x^2) + eps)) with fp32 accumulation");
  m.def("add_rms_norm", &add_rms_norm, "(h, rms_norm(h)) for h = x + r");
  m.def("silu_mul", &silu_mul, "silu(gate) * up");
  m.def("rotary", &rotary, "x * cos + roll(x, head_dim / 2) * sin");
  m.def("decode_attention", &decode_attention, "KV write and one-token attention over the paged cache",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("k_cache"), py::arg("v_cache"), py::arg("slots"),
        py::arg("block_tables"), py::arg("positions"), py::arg("window") = 0);
  m.def("stream_read", &stream_read, "every byte of the tensors read once, as the kernels stream weights; "
        "returns an xor of them (a probe of the memory's read speed)", py::arg("tensors"));
}
#endif
