// The softmax of engine/attention_backend.py's bf16 matmul path, in place over fp32 scores: one call
// instead of torch's scale (mul_), mask (masked_fill_) and softmax, which read and write the
// (rows x keys) scores three times and allocate a second copy of them.
//
//   softmax_(s, scale, open_keys, hidden)
//       s:      (seqs, heads, rows, keys) float32, contiguous; replaced by softmax(scale * s) over
//               keys, where key j >= open_keys of a row is left out (probability 0) when
//               hidden[seq, 0, row, j - open_keys] is true
//       hidden: (seqs, 1, rows, keys - open_keys) bool, last dimension contiguous, or None (no key
//               hidden); every row must keep at least one key
//
// The exponential is ATen's exp_u20 (the one SDPA's CPU flash kernel uses); the max and the sum are
// fp32, as torch's softmax takes them. AVX-512 only (the loader checks the CPU first).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <immintrin.h>

#include <cmath>
#include <limits>
#include <optional>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t L = Vec::size();  // 16 floats

// One row: x (n keys) scaled, hidden keys from `open` on set to -inf, then softmax in place.
void softmax_row(float* x, int64_t n, float scale, int64_t open, const bool* hide) {
  const float ninf = -std::numeric_limits<float>::infinity();
  Vec vmax(ninf);
  const Vec vscale(scale);
  int64_t j = 0;
  for (; j + L <= n; j += L) {
    Vec v = Vec::loadu(x + j) * vscale;
    if (hide != nullptr && j + L > open) {
      // keys j..j+15 that lie at or past `open` and are hidden become -inf
      __mmask16 hidden = 0;
      if (j >= open) {
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(hide + (j - open)));
        hidden = _mm_test_epi8_mask(b, b);  // the 16 bools' nonzero bytes
      } else {
        for (int64_t t = open; t < j + L; ++t) hidden |= static_cast<__mmask16>(hide[t - open]) << (t - j);
      }
      v = Vec(_mm512_mask_mov_ps(v, hidden, _mm512_set1_ps(ninf)));
    }
    v.store(x + j);
    vmax = at::vec::maximum(vmax, v);
  }
  float mx = _mm512_reduce_max_ps(vmax);
  for (; j < n; ++j) {
    float v = x[j] * scale;
    if (hide != nullptr && j >= open && hide[j - open]) v = ninf;
    x[j] = v;
    mx = std::max(mx, v);
  }
  const Vec vmx(mx);
  Vec vsum(0.0f);
  j = 0;
  for (; j + L <= n; j += L) {
    Vec e = (Vec::loadu(x + j) - vmx).exp_u20();
    e.store(x + j);
    vsum = vsum + e;
  }
  float sum = _mm512_reduce_add_ps(vsum);
  for (; j < n; ++j) {
    const float e = std::exp(x[j] - mx);
    x[j] = e;
    sum += e;
  }
  const float r = 1.0f / sum;
  const Vec vr(r);
  j = 0;
  for (; j + L <= n; j += L) (Vec::loadu(x + j) * vr).store(x + j);
  for (; j < n; ++j) x[j] *= r;
}

void softmax_(torch::Tensor s, double scale, int64_t open_keys, const std::optional<torch::Tensor>& hidden) {
  TORCH_CHECK(s.device().is_cpu() && s.scalar_type() == at::kFloat && s.dim() == 4 && s.is_contiguous(),
              "softmax_: scores must be a contiguous (seqs, heads, rows, keys) float32 CPU tensor, got ",
              s.scalar_type(), " ", s.sizes());
  const int64_t seqs = s.size(0), heads = s.size(1), rows = s.size(2), keys = s.size(3);
  TORCH_CHECK(open_keys >= 0 && open_keys <= keys, "softmax_: open_keys ", open_keys, " outside [0, ", keys, "]");
  const bool* hp = nullptr;
  int64_t hs0 = 0, hs2 = 0;
  if (hidden.has_value()) {
    const torch::Tensor& h = *hidden;
    TORCH_CHECK(h.device().is_cpu() && h.scalar_type() == at::kBool && h.dim() == 4 && h.size(0) == seqs &&
                    h.size(1) == 1 && h.size(2) == rows && h.size(3) == keys - open_keys &&
                    (h.size(3) <= 1 || h.stride(3) == 1),
                "softmax_: hidden must be a (", seqs, ", 1, ", rows, ", ", keys - open_keys,
                ") bool CPU tensor contiguous in its last dimension, got ", h.scalar_type(), " ", h.sizes());
    hp = h.data_ptr<bool>();
    hs0 = h.stride(0);
    hs2 = h.stride(2);
  }
  float* sp = s.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, seqs * heads * rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t seq = i / (heads * rows), row = i % rows;
      const bool* hide = hp == nullptr ? nullptr : hp + seq * hs0 + row * hs2;
      softmax_row(sp + i * keys, keys, sc, open_keys, hide);
    }
  });
}

bool cpu_supported() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("softmax_", &softmax_, "masked, scaled softmax in place over attention scores", py::arg("s"),
        py::arg("scale"), py::arg("open_keys"), py::arg("hidden"));
  m.def("cpu_supported", &cpu_supported, "whether this CPU runs the AVX-512 build");
}
