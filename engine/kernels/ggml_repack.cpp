// Streamed GGUF blocks repacked into the VNNI kernels' weight layouts (int4_vnni.cpp), byte for byte
// what the load-time repack in engine/weights/packed.py produces for a resident block:
//   int4_from_gguf   Q4_0 / Q4_1 / Q4_K  -> Int4Weight "vnni": codes kept, (scale, min) per 32 to fp16
//   Int8Weight.quantize(dequantize(...)) Q8_0 / Q5_0 / Q5_1 / Q5_K / Q6_K -> Int8Weight "vnni":
//                    the row dequantized exactly (gguf-py's arithmetic, as engine/weights/dequant.py),
//                    then symmetric per-row int8 (scale max|w| / 127, codes round-half-even(w / scale))
// The torch code does the same work in ~20 ops per tensor, each a pass over a temporary; here it is
// one pass per row, on the prefetch thread, into buffers the caller reuses (no allocation).
//
// Bit-for-bit equality with the torch code needs its roundings: fp32 throughout, a*b + c rounded twice
// (built with -ffp-contract=off), float -> fp16 round to nearest even (F16C, as torch's .half()), true
// division and round half to even (torch.round). Built with the VNNI kernels' AVX-512 flags: it only
// runs beside them. tests/weights/test_stream_repack.py
// compares the bytes for every type.
//
// Output layouts (see int4_vnni.cpp): rows in blocks of 16, the last padded with zero rows.
//   int4: codes (N16/16, G*256) u8, in group g, vector v (0..3), lane j: byte t = q[8v+t] | q[8v+4+t] << 4;
//         scales (N16/16, G, 2, 16) fp16: 16 scales then 16 mins.        padding: code 0, scale 0, min 0
//   int8: codes (N16/16, G*512) u8 = q + 128, in group g, vector v (0..7), lane j: byte t = q[4v+t] + 128;
//         scales (N16/16, 16) fp32.                                        padding: code 128, scale 0
// `order` (optional, int64 (N,)): output row r is stored row order[r] (llama-family Q/K rows, which
// llama.cpp's converter permutes), so the reorder costs no gather of its own.

#include <torch/extension.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// GGML type ids (gguf.GGMLQuantizationType).
enum : int64_t { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

constexpr int64_t GROUP = 32;
constexpr int64_t LANES = 16;

inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return c10::detail::fp16_ieee_to_fp32_value(h);
}

// (block size in weights, bytes per block) of the types handled here.
std::pair<int64_t, int64_t> block_size(int64_t qtype) {
  switch (qtype) {
    case Q4_0: return {32, 18};
    case Q4_1: return {32, 20};
    case Q5_0: return {32, 22};
    case Q5_1: return {32, 24};
    case Q8_0: return {32, 34};
    case Q4_K: return {256, 144};
    case Q5_K: return {256, 176};
    case Q6_K: return {256, 210};
    default: TORCH_CHECK_VALUE(false, "ggml repack: unsupported GGML type id ", qtype);
  }
  return {0, 0};
}

// Q4_K / Q5_K: 12 bytes of packed 6-bit (scale, min) pairs (dequant.k_scale_min).
inline void k_scale_min(const uint8_t* s, uint8_t* sc, uint8_t* mn) {
  const uint8_t *d = s, *m = s + 4, *md = s + 8;
  for (int i = 0; i < 4; ++i) {
    sc[i] = d[i] & 0x3F;
    sc[4 + i] = (md[i] & 0x0F) | ((d[i] >> 2) & 0x30);
    mn[i] = m[i] & 0x3F;
    mn[4 + i] = (md[i] >> 4) | ((m[i] >> 2) & 0x30);
  }
}

// One lane's 4 bytes of a 64-byte vector of the int4 layout, from 8 stored bytes `a` holding the 8
// codes of that vector in their low (or high) nibbles: byte t = code t | code 4 + t << 4.
inline uint32_t lane_bytes(uint64_t a, bool high) {
  constexpr uint64_t LOW = 0x0F0F0F0FULL;
  if (!high) return static_cast<uint32_t>((a & LOW) | (((a >> 32) & LOW) << 4));
  return static_cast<uint32_t>(((a >> 4) & LOW) | ((a >> 32) & (LOW << 4)));
}

inline uint64_t load8(const uint8_t* p) {
  uint64_t a;
  std::memcpy(&a, p, 8);
  return a;
}

// float -> fp16 bits, round to nearest even (as torch's .half()).
inline uint16_t to_f16(float v) { return _cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }

// One row of Q4_0 / Q4_1 / Q4_K written as lane j of its row block: the codes into `dst` (the row
// block's codes, G * 256 bytes), and per 32 weights, w = scale * q + min (packed.int4_from_gguf), into
// the block's fp16 scales (G, 2, 16). Returns false if a scale or min is not finite in fp16.
bool pack_int4_row(const uint8_t* row, int64_t qtype, int64_t G, int64_t j, uint8_t* dst, uint16_t* sm) {
  bool finite = true;
  auto put = [&](int64_t g, float scale, float minimum, const uint8_t* qs8[4], bool high[4]) {
    uint8_t* d = dst + g * 256 + j * 4;
    for (int v = 0; v < 4; ++v) {
      const uint32_t u = lane_bytes(load8(qs8[v]), high[v]);
      std::memcpy(d + v * 64, &u, 4);
    }
    const uint16_t s = to_f16(scale), m = to_f16(minimum);
    finite &= (s & 0x7C00) != 0x7C00 && (m & 0x7C00) != 0x7C00;
    sm[g * 2 * LANES + j] = s;
    sm[g * 2 * LANES + LANES + j] = m;
  };
  if (qtype == Q4_K) {
    for (int64_t s0 = 0; s0 < G / 8; ++s0) {
      const uint8_t* b = row + s0 * 144;
      const float d = f16(b), dmin = f16(b + 2);
      uint8_t sc[8], mn[8];
      k_scale_min(b + 4, sc, mn);
      for (int s = 0; s < 8; ++s) {
        // sub-block s: the low (s even) or high (s odd) nibbles of 32 bytes
        const uint8_t* qs = b + 16 + 32 * (s / 2);
        const uint8_t* qs8[4] = {qs, qs + 8, qs + 16, qs + 24};
        bool high[4] = {s % 2 == 1, s % 2 == 1, s % 2 == 1, s % 2 == 1};
        put(s0 * 8 + s, d * static_cast<float>(sc[s]), -(dmin * static_cast<float>(mn[s])), qs8, high);
      }
    }
    return finite;
  }
  const int64_t size = qtype == Q4_0 ? 18 : 20;
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* b = row + g * size;
    const float d = f16(b);
    // codes 0..15 are the low nibbles of the 16 bytes, 16..31 their high nibbles
    const uint8_t* qs = b + (qtype == Q4_0 ? 2 : 4);
    const uint8_t* qs8[4] = {qs, qs + 8, qs, qs + 8};
    bool high[4] = {false, false, true, true};
    put(g, d, qtype == Q4_0 ? -8.0f * d : f16(b + 2), qs8, high);
  }
  return finite;
}

// One row of Q8_0 / Q5_0 / Q5_1 / Q5_K / Q6_K dequantized to fp32 exactly as dequant.py does it.
void dequantize_row(const uint8_t* row, int64_t qtype, int64_t K, float* w) {
  switch (qtype) {
    case Q8_0:
      for (int64_t g = 0; g < K / 32; ++g) {
        const uint8_t* b = row + g * 34;
        const float d = f16(b);
        for (int i = 0; i < 32; ++i) w[g * 32 + i] = static_cast<float>(static_cast<int8_t>(b[2 + i])) * d;
      }
      return;
    case Q5_0:
    case Q5_1: {
      const bool one = qtype == Q5_1;
      const int64_t size = one ? 24 : 22;
      for (int64_t g = 0; g < K / 32; ++g) {
        const uint8_t* b = row + g * size;
        const float d = f16(b), m = one ? f16(b + 2) : 0.0f;
        const uint8_t* qh = b + (one ? 4 : 2);
        const uint8_t* qs = qh + 4;
        uint32_t bits;
        std::memcpy(&bits, qh, 4);  // bit i: the 5th bit of weight i
        float* wg = w + g * 32;
        for (int i = 0; i < 32; ++i) {
          const int low = (i < 16 ? qs[i] : qs[i - 16] >> 4) & 0x0F;
          const int q = low | (((bits >> i) & 1) << 4);
          wg[i] = one ? d * static_cast<float>(q) + m : d * static_cast<float>(q - 16);
        }
      }
      return;
    }
    case Q5_K:
      for (int64_t s0 = 0; s0 < K / 256; ++s0) {
        const uint8_t* b = row + s0 * 176;
        const float d = f16(b), dmin = f16(b + 2);
        uint8_t sc[8], mn[8];
        k_scale_min(b + 4, sc, mn);
        const uint8_t *qh = b + 16, *qs = b + 48;
        for (int s = 0; s < 8; ++s) {
          const float scale = d * static_cast<float>(sc[s]), m = dmin * static_cast<float>(mn[s]);
          const uint8_t* q4 = qs + 32 * (s / 2);
          const int shift = (s % 2) * 4;
          for (int i = 0; i < 32; ++i) {
            const int q = ((q4[i] >> shift) & 0x0F) | (((qh[i] >> s) & 1) << 4);
            w[s0 * 256 + s * 32 + i] = scale * static_cast<float>(q) - m;
          }
        }
      }
      return;
    case Q6_K:
      for (int64_t s0 = 0; s0 < K / 256; ++s0) {
        const uint8_t* b = row + s0 * 210;
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
        const float d = f16(b + 208);
        for (int s = 0; s < 8; ++s) {  // sub-block s = 4 h + k of 32 weights
          const int h = s / 4, k = s % 4;
          const uint8_t* low = ql + 64 * h + 32 * (k % 2);
          const int shift = (k / 2) * 4;
          for (int half = 0; half < 2; ++half) {  // one int8 sub-scale per 16 weights
            const float scale = d * static_cast<float>(scales[2 * s + half]);
            const uint8_t *lo = low + 16 * half, *hi = qh + 32 * h + 16 * half;
            float* ws = w + s0 * 256 + s * 32 + 16 * half;
            for (int i = 0; i < 16; ++i) {
              const int q = (((lo[i] >> shift) & 0x0F) | (((hi[i] >> (2 * k)) & 3) << 4)) - 32;
              ws[i] = scale * static_cast<float>(q);
            }
          }
        }
      }
      return;
    default:
      TORCH_CHECK_VALUE(false, "ggml repack: GGML type id ", qtype, " is not repacked to int8");
  }
}

struct Rows {
  const uint8_t* base;
  int64_t stride;  // bytes between stored rows
  const int64_t* order;  // output row -> stored row, or null
  const uint8_t* row(int64_t r) const { return base + (order ? order[r] : r) * stride; }
};

Rows check_rows(const torch::Tensor& rows, const c10::optional<torch::Tensor>& order, int64_t qtype, int64_t K) {
  TORCH_CHECK_VALUE(rows.device().is_cpu() && rows.scalar_type() == torch::kUInt8 && rows.dim() == 2,
                    "ggml repack: rows must be a 2-D uint8 CPU tensor, got ", rows.scalar_type(), " of dim ",
                    rows.dim());
  TORCH_CHECK_VALUE(rows.stride(1) == 1, "ggml repack: rows must be contiguous along a row");
  const auto [block, size] = block_size(qtype);
  TORCH_CHECK_VALUE(K % block == 0 && rows.size(1) == K / block * size, "ggml repack: a row of ", K,
                    " weights of GGML type id ", qtype, " is ", K / block * size, " bytes (whole blocks), got ",
                    rows.size(1));
  const int64_t* idx = nullptr;
  if (order.has_value()) {
    const auto& o = *order;
    TORCH_CHECK_VALUE(o.scalar_type() == torch::kInt64 && o.dim() == 1 && o.is_contiguous() &&
                          o.size(0) == rows.size(0),
                      "ggml repack: order must be a contiguous int64 (rows,) tensor");
    idx = o.data_ptr<int64_t>();
    for (int64_t r = 0; r < o.size(0); ++r)
      TORCH_CHECK_VALUE(idx[r] >= 0 && idx[r] < rows.size(0), "ggml repack: order[", r, "] = ", idx[r],
                        " is out of range");
  }
  return Rows{rows.data_ptr<uint8_t>(), rows.stride(0), idx};
}

void check_out(const torch::Tensor& t, torch::ScalarType type, std::vector<int64_t> shape, const char* name) {
  TORCH_CHECK_VALUE(t.device().is_cpu() && t.scalar_type() == type && t.is_contiguous() &&
                        t.sizes().vec() == shape,
                    "ggml repack: ", name, " must be a contiguous ", type, " tensor of shape ", shape, ", got ",
                    t.scalar_type(), " ", t.sizes());
}

void repack_int4(const torch::Tensor& rows, int64_t qtype, int64_t K, torch::Tensor codes, torch::Tensor scales,
                 const c10::optional<torch::Tensor>& order) {
  TORCH_CHECK_VALUE(qtype == Q4_0 || qtype == Q4_1 || qtype == Q4_K, "ggml repack: GGML type id ", qtype,
                    " is not a 4-bit type with a scale and min per 32 (Q4_0, Q4_1, Q4_K)");
  const Rows src = check_rows(rows, order, qtype, K);
  const int64_t N = rows.size(0), G = K / GROUP, blocks = (N + LANES - 1) / LANES;
  check_out(codes, torch::kUInt8, {blocks, G * 256}, "codes");
  check_out(scales, torch::kHalf, {blocks, G, 2, LANES}, "scales");
  uint8_t* out = codes.data_ptr<uint8_t>();
  uint16_t* sm = reinterpret_cast<uint16_t*>(scales.data_ptr<c10::Half>());
  for (int64_t n = 0; n < blocks * LANES; ++n) {
    const int64_t b = n / LANES, j = n % LANES;
    uint8_t* dst = out + b * G * 256;
    uint16_t* smb = sm + b * G * 2 * LANES;
    if (n < N) {
      TORCH_CHECK_VALUE(pack_int4_row(src.row(n), qtype, G, j, dst, smb), "int4: a group scale or minimum of a (",
                        N, ", ", K, ") weight does not fit in float16 (|value| > 65504)");
      continue;
    }
    for (int64_t g = 0; g < G; ++g) {  // padding: code 0, scale 0, min 0
      for (int v = 0; v < 4; ++v) std::memset(dst + g * 256 + v * 64 + j * 4, 0, 4);
      smb[g * 2 * LANES + j] = smb[g * 2 * LANES + LANES + j] = 0;
    }
  }
}

void repack_int8(const torch::Tensor& rows, int64_t qtype, int64_t K, torch::Tensor codes, torch::Tensor scales,
                 const c10::optional<torch::Tensor>& order) {
  TORCH_CHECK_VALUE(qtype == Q8_0 || qtype == Q5_0 || qtype == Q5_1 || qtype == Q5_K || qtype == Q6_K,
                    "ggml repack: GGML type id ", qtype, " is not requantized to int8 (Q8_0, Q5_0, Q5_1, Q5_K, Q6_K)");
  const Rows src = check_rows(rows, order, qtype, K);
  const int64_t N = rows.size(0), G = K / GROUP, blocks = (N + LANES - 1) / LANES;
  check_out(codes, torch::kUInt8, {blocks, G * 512}, "codes");
  check_out(scales, torch::kFloat, {blocks, LANES}, "scales");
  uint8_t* out = codes.data_ptr<uint8_t>();
  float* sc = scales.data_ptr<float>();
  thread_local std::vector<float> w;  // one row: reused from call to call (the prefetch thread's)
  thread_local std::vector<uint8_t> q;
  w.resize(K);
  q.resize(K);
  for (int64_t n = 0; n < blocks * LANES; ++n) {
    const int64_t b = n / LANES, j = n % LANES;
    float s = 0.0f;
    if (n < N) {
      dequantize_row(src.row(n), qtype, K, w.data());
      __m512 vmax = _mm512_setzero_ps();
      for (int64_t i = 0; i < K; i += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_loadu_ps(&w[i])));
      // Int8Weight.quantize: scale (amax / 127).clamp(min=tiny), codes round(w / scale).clamp(-127, 127),
      // a true division and round half to even, as torch's
      s = std::max(_mm512_reduce_max_ps(vmax) / 127.0f, FLT_MIN);
      const __m512 vs = _mm512_set1_ps(s), lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
      for (int64_t i = 0; i < K; i += 16) {
        __m512 c = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(&w[i]), vs),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        c = _mm512_min_ps(_mm512_max_ps(c, lo), hi);
        const __m512i u = _mm512_add_epi32(_mm512_cvtps_epi32(c), _mm512_set1_epi32(128));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(&q[i]), _mm512_cvtepi32_epi8(u));
      }
    } else {
      std::fill(q.begin(), q.end(), 128);
    }
    sc[b * LANES + j] = s;
    for (int64_t g = 0; g < G; ++g) {
      uint8_t* dst = out + b * G * 512 + g * 512 + j * 4;
      std::memcpy(dst, q.data() + g * GROUP, 4);
      for (int v = 1; v < 8; ++v) std::memcpy(dst + v * 64, q.data() + g * GROUP + 4 * v, 4);
    }
  }
}

// The k-quant layouts (int4_vnni.cpp's block_kernel_k): Q4_K and Q6_K rearranged, every bit kept.
// Q4_K: codes as repack_int4 writes them; per row block and super-block, 320 bytes: per group the 16
// rows' 6-bit scales then mins, then the 16 rows' fp16 d, then their fp16 dmin (copied, not rounded).
// Q6_K: per row block and group 384 code bytes: the low nibbles in the int4 arrangement, then two
// 64-byte vectors of high bit pairs (vector p, lane j, byte t: bits 2i..2i+1 = weight 16p + 4i + t's);
// per row block and super-block 288 bytes: per group the 16 rows' int8 scales of weights 0..15, then of
// 16..31, then the 16 rows' fp16 d. Padding rows: every byte 0 (code 0, scales 0).
void repack_kquant(const torch::Tensor& rows, int64_t qtype, int64_t K, torch::Tensor codes, torch::Tensor scales,
                   const c10::optional<torch::Tensor>& order) {
  TORCH_CHECK_VALUE(qtype == Q4_K || qtype == Q6_K, "ggml repack: GGML type id ", qtype,
                    " has no k-quant layout (Q4_K, Q6_K)");
  const Rows src = check_rows(rows, order, qtype, K);
  const bool six = qtype == Q6_K;
  const int64_t N = rows.size(0), G = K / GROUP, S = K / 256, blocks = (N + LANES - 1) / LANES;
  const int64_t code_bytes = six ? 384 : 256, sb_bytes = six ? 288 : 320;
  check_out(codes, torch::kUInt8, {blocks, G * code_bytes}, "codes");
  check_out(scales, torch::kUInt8, {blocks, S, sb_bytes}, "scales");
  uint8_t* out = codes.data_ptr<uint8_t>();
  uint8_t* sc_out = scales.data_ptr<uint8_t>();
  for (int64_t n = 0; n < blocks * LANES; ++n) {
    const int64_t b = n / LANES, j = n % LANES;
    uint8_t* dst = out + b * G * code_bytes;
    uint8_t* sbb = sc_out + b * S * sb_bytes;
    if (n >= N) {  // padding
      for (int64_t g = 0; g < G; ++g)
        for (int v = 0; v < code_bytes / 64; ++v) std::memset(dst + g * code_bytes + v * 64 + j * 4, 0, 4);
      for (int64_t s0 = 0; s0 < S; ++s0) {
        uint8_t* sb = sbb + s0 * sb_bytes;
        for (int g = 0; g < 8; ++g) sb[32 * g + j] = sb[32 * g + 16 + j] = 0;
        std::memset(sb + 256 + 2 * j, 0, 2);
        if (!six) std::memset(sb + 288 + 2 * j, 0, 2);
      }
      continue;
    }
    const uint8_t* row = src.row(n);
    for (int64_t s0 = 0; s0 < S; ++s0) {
      uint8_t* sb = sbb + s0 * sb_bytes;
      if (!six) {
        const uint8_t* blk = row + s0 * 144;
        uint8_t sc[8], mn[8];
        k_scale_min(blk + 4, sc, mn);
        std::memcpy(sb + 256 + 2 * j, blk, 2);      // d
        std::memcpy(sb + 288 + 2 * j, blk + 2, 2);  // dmin
        for (int s = 0; s < 8; ++s) {
          sb[32 * s + j] = sc[s];
          sb[32 * s + 16 + j] = mn[s];
          const uint8_t* qs = blk + 16 + 32 * (s / 2);
          uint8_t* d = dst + (s0 * 8 + s) * 256 + j * 4;
          for (int v = 0; v < 4; ++v) {
            const uint32_t u = lane_bytes(load8(qs + 8 * v), s % 2 == 1);
            std::memcpy(d + v * 64, &u, 4);
          }
        }
        continue;
      }
      const uint8_t* blk = row + s0 * 210;
      const uint8_t *ql = blk, *qh = blk + 128;
      std::memcpy(sb + 256 + 2 * j, blk + 208, 2);  // d
      for (int s = 0; s < 8; ++s) {  // group s = 4 h + k of 32 weights, as dequantize_row reads Q6_K
        const int h = s / 4, k = s % 4;
        const uint8_t* lo = ql + 64 * h + 32 * (k % 2);
        const int shift = (k / 2) * 4;
        uint8_t q[32];  // the group's 6-bit codes, 0..63
        for (int i = 0; i < 32; ++i) q[i] = ((lo[i] >> shift) & 0x0F) | (((qh[32 * h + i] >> (2 * k)) & 3) << 4);
        sb[32 * s + j] = blk[192 + 2 * s];
        sb[32 * s + 16 + j] = blk[192 + 2 * s + 1];
        uint8_t* d = dst + (s0 * 8 + s) * 384 + j * 4;
        for (int v = 0; v < 4; ++v)
          for (int t = 0; t < 4; ++t) d[v * 64 + t] = (q[8 * v + t] & 0x0F) | ((q[8 * v + 4 + t] & 0x0F) << 4);
        for (int p = 0; p < 2; ++p)
          for (int t = 0; t < 4; ++t) {
            uint8_t hb = 0;
            for (int i = 0; i < 4; ++i) hb |= (q[16 * p + 4 * i + t] >> 4) << (2 * i);
            d[256 + p * 64 + t] = hb;
          }
      }
    }
  }
}

}  // namespace

// The GIL is released while a repack runs: it runs on the prefetch thread, and holding the GIL would
// stall the compute thread's Python between kernels for the whole repack.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("repack_int4", &repack_int4, "Q4_0/Q4_1/Q4_K rows -> the int4 VNNI layout, into codes and scales",
        py::arg("rows"), py::arg("qtype"), py::arg("K"), py::arg("codes"), py::arg("scales"),
        py::arg("order") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.def("repack_int8", &repack_int8, "Q8_0/Q5_0/Q5_1/Q5_K/Q6_K rows -> per-row int8 in the VNNI layout",
        py::arg("rows"), py::arg("qtype"), py::arg("K"), py::arg("codes"), py::arg("scales"),
        py::arg("order") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.def("repack_kquant", &repack_kquant, "Q4_K/Q6_K rows -> their k-quant layout (every bit kept)",
        py::arg("rows"), py::arg("qtype"), py::arg("K"), py::arg("codes"), py::arg("scales"),
        py::arg("order") = py::none(), py::call_guard<py::gil_scoped_release>());
}
