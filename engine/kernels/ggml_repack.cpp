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
// (built with -ffp-contract=off), float -> fp16 round to nearest even (c10::Half, as torch's .half()),
// true division and nearbyint (torch.round) in the default rounding mode. tests/test_stream_repack.py
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

// One row of Q4_0 / Q4_1 / Q4_K: its K codes (0..15) and, per 32 weights, w = scale * q + min
// (packed.int4_from_gguf).
void decode_int4_row(const uint8_t* row, int64_t qtype, int64_t K, uint8_t* q, float* scale, float* minimum) {
  if (qtype == Q4_K) {
    for (int64_t s0 = 0; s0 < K / 256; ++s0) {
      const uint8_t* b = row + s0 * 144;
      const float d = f16(b), dmin = f16(b + 2);
      uint8_t sc[8], mn[8];
      k_scale_min(b + 4, sc, mn);
      for (int s = 0; s < 8; ++s) {
        const int64_t g = s0 * 8 + s;
        scale[g] = d * static_cast<float>(sc[s]);
        minimum[g] = -(dmin * static_cast<float>(mn[s]));
        const uint8_t* qs = b + 16 + 32 * (s / 2);
        const int shift = (s % 2) * 4;
        for (int i = 0; i < 32; ++i) q[g * 32 + i] = (qs[i] >> shift) & 0x0F;
      }
    }
    return;
  }
  const int64_t size = qtype == Q4_0 ? 18 : 20;
  for (int64_t g = 0; g < K / 32; ++g) {
    const uint8_t* b = row + g * size;
    const float d = f16(b);
    scale[g] = d;
    minimum[g] = qtype == Q4_0 ? -8.0f * d : f16(b + 2);
    const uint8_t* qs = b + (qtype == Q4_0 ? 2 : 4);
    for (int i = 0; i < 16; ++i) {
      q[g * 32 + i] = qs[i] & 0x0F;
      q[g * 32 + 16 + i] = qs[i] >> 4;
    }
  }
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
        for (int i = 0; i < 32; ++i) {
          const int low = i < 16 ? (qs[i] & 0x0F) : (qs[i - 16] >> 4);
          const int q = low | (((qh[i / 8] >> (i % 8)) & 1) << 4);
          w[g * 32 + i] = one ? d * static_cast<float>(q) + m : d * static_cast<float>(q - 16);
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
          for (int i = 0; i < 32; ++i) {
            const int idx = s * 32 + i;
            const float scale = d * static_cast<float>(scales[idx / 16]);
            const int q = (((low[i] >> shift) & 0x0F) | (((qh[32 * h + i] >> (2 * k)) & 3) << 4)) - 32;
            w[s0 * 256 + idx] = scale * static_cast<float>(q);
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
  c10::Half* sm = scales.data_ptr<c10::Half>();
  std::vector<uint8_t> q(K);
  std::vector<float> scale(G), minimum(G);
  for (int64_t n = 0; n < blocks * LANES; ++n) {
    const int64_t b = n / LANES, j = n % LANES;
    if (n < N) {
      decode_int4_row(src.row(n), qtype, K, q.data(), scale.data(), minimum.data());
    } else {
      std::fill(q.begin(), q.end(), 0);
      std::fill(scale.begin(), scale.end(), 0.0f);
      std::fill(minimum.begin(), minimum.end(), 0.0f);
    }
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* qg = q.data() + g * GROUP;
      uint8_t* dst = out + b * G * 256 + g * 256 + j * 4;
      for (int v = 0; v < 4; ++v)
        for (int t = 0; t < 4; ++t) dst[v * 64 + t] = qg[8 * v + t] | (qg[8 * v + 4 + t] << 4);
      const c10::Half s(scale[g]), m(minimum[g]);
      TORCH_CHECK_VALUE(std::isfinite(static_cast<float>(s)) && std::isfinite(static_cast<float>(m)),
                        "int4: a group scale or minimum of a (", N, ", ", K,
                        ") weight does not fit in float16 (|value| > 65504)");
      c10::Half* smg = sm + (b * G + g) * 2 * LANES;
      smg[j] = s;
      smg[LANES + j] = m;
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
  std::vector<float> w(K);
  std::vector<uint8_t> q(K);
  for (int64_t n = 0; n < blocks * LANES; ++n) {
    const int64_t b = n / LANES, j = n % LANES;
    float s = 0.0f;
    if (n < N) {
      dequantize_row(src.row(n), qtype, K, w.data());
      float amax = 0.0f;
      for (int64_t i = 0; i < K; ++i) amax = std::max(amax, std::fabs(w[i]));
      s = std::max(amax / 127.0f, FLT_MIN);  // Int8Weight.quantize: (amax / 127).clamp(min=tiny)
      for (int64_t i = 0; i < K; ++i) {
        const float c = std::min(std::max(std::nearbyint(w[i] / s), -127.0f), 127.0f);
        q[i] = static_cast<uint8_t>(static_cast<int>(c) + 128);
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

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("repack_int4", &repack_int4, "Q4_0/Q4_1/Q4_K rows -> the int4 VNNI layout, into codes and scales",
        py::arg("rows"), py::arg("qtype"), py::arg("K"), py::arg("codes"), py::arg("scales"),
        py::arg("order") = py::none());
  m.def("repack_int8", &repack_int8, "Q8_0/Q5_0/Q5_1/Q5_K/Q6_K rows -> per-row int8 in the VNNI layout",
        py::arg("rows"), py::arg("qtype"), py::arg("K"), py::arg("codes"), py::arg("scales"),
        py::arg("order") = py::none());
}
