// One decoder block of a decode step (one token per sequence; or of short prompt chunks, whose tokens
// each attend as one with their sequence's block-table row: engine/model.py _tokenwise_tables) as
// one C++ call: at decode a block is ~40 small torch ops, and on a 135M model their Python dispatch
// cost as much as the block's arithmetic besides the matmuls. This is engine/model.py's block_forward
// for the stacked weights (wqkv, w_gate_up), calling the same functions in the same order (the fused
// CPU ops of fused_ops.cpp and the VNNI kernels of int4_vnni.cpp, both included here, or for dense
// weights at::linear, or bf16_rows.cpp's kernel where few_rows says engine/model.py's linear uses it
// too), so its result is bit-identical to the op-by-op path (tests/kernels/test_decode_block.py):
//
//   hn  = rms_norm(x, attn_norm)                          (seqs, hidden)
//   qkv = hn @ wqkv.T + bqkv                              (seqs, (heads + 2 kv_heads) * hd), wqkv
//                                                         stacked or as its q, k, v parts
//   q,k = rotary(q and k heads of qkv), v = its v heads
//   a   = decode_attention(q, k, v, caches ...) @ wo.T + bo   (the KV write included)
//   h, hn2 = x + a, rms_norm(x + a, mlp_norm)
//   y   = h + (silu(gate) * up) @ w_down.T,  gate | up = hn2 @ w_gate_up.T (stacked or as two parts)
//
// A weight is (tensor, scales, out_features, adapter): scales None for a dense (out, in) tensor, float16
// scales for Int4Weight's "vnni" layout, float32 for Int8Weight's, uint8 for KQuantWeight's
// (engine/weights/packed/weights.py); adapter None, or served adapters' term on the step's rows.
// Built with the VNNI kernels' instruction sets and fused_ops' rounding flags (no FMA contraction:
// the kernels use explicit intrinsics, so neither side's results change).

#define LAYERSTREAM_NO_MODULE
#include "int4_vnni.cpp"
#include "fused_ops.cpp"
#include "bf16_rows.cpp"

namespace {

// A served adapter term on a projection (engine/lora_serving/rows.py, RowLoRAWeight): the step's adapters'
// A stacked (sum R, in), their B transposed and stacked (sum R, out), and each token's run of columns
// (tokens, 2): [start, count], count 0 for a row of the base. lora_rows_add_ below adds it to y.
using Adapter = c10::optional<std::tuple<at::Tensor, at::Tensor, at::Tensor>>;
// (tensor, scales, out_features, adapter)
using Weight = std::tuple<at::Tensor, c10::optional<at::Tensor>, int64_t, Adapter>;

// v rounded to T and back (T float: v itself), as a product whose result is stored in T rounds it.
template <typename T>
inline __m512 round_to(__m512 v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    alignas(64) T tmp[16];
    store16(tmp, v, 0xFFFF);
    return load16(tmp);
  }
}

template <typename T>
inline __m512 load16_masked(const T* p, __mmask16 k) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_maskz_loadu_ps(k, p);
  } else {
    if (k == 0xFFFF) return load16(p);
    alignas(64) T tmp[16] = {};
    std::memcpy(tmp, p, sizeof(T) * __builtin_popcount(k));  // k is always a prefix mask here
    return load16(tmp);
  }
}

// Served adapters' term, each row through its own adapter's columns only, as punica's batched LoRA does on
// a GPU: y[m] += ((x[m] A_c^T) rounded to T) B_c^T rounded to T, c = row m's run of columns. For a decode
// step's few rows the masked products it replaced (every row times every adapter's columns, the others'
// masked to zero) spent more on their small products' calls than on their arithmetic; past LORA_ROWS_MAX
// rows, a prompt chunk's, those masked dense products are the faster (engine/ops.py's _lora_rows_linear;
// a block with that many adapter rows runs op by op). Both products accumulate in fp32; T is the
// activations', the adapters' and y's dtype (one dtype: the caller checks).
constexpr int64_t LORA_ROWS_MAX = 32;
//   x (M, K), a (R, K), b_t (R, N), row_cols (M, 2) int64 [start, count], y (M, N) updated in place.
template <typename T>
void lora_rows_run(T* y, const T* x, const T* a, const T* b_t, const int64_t* rc, int64_t M, int64_t K, int64_t N,
                   int64_t R) {
  std::vector<float> t(M * R, 0.f);  // (M, R): row m's own columns only
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      for (int64_t j = rc[2 * m]; j < rc[2 * m] + rc[2 * m + 1]; ++j) {
        __m512 acc = _mm512_setzero_ps();
        int64_t k = 0;
        for (; k + 16 <= K; k += 16) acc = _mm512_fmadd_ps(load16(x + m * K + k), load16(a + j * K + k), acc);
        if (k < K) {
          const __mmask16 tail = static_cast<__mmask16>((1u << (K - k)) - 1);
          acc = _mm512_fmadd_ps(load16_masked(x + m * K + k, tail), load16_masked(a + j * K + k, tail), acc);
        }
        t[m * R + j] = static_cast<float>(T(_mm512_reduce_add_ps(acc)));
      }
    }
  });
  at::parallel_for(0, (N + 15) / 16, 16, [&](int64_t c0, int64_t c1) {
    for (int64_t m = 0; m < M; ++m) {
      const int64_t start = rc[2 * m], count = rc[2 * m + 1];
      if (count == 0) continue;
      for (int64_t c = c0; c < c1; ++c) {
        const int64_t n = 16 * c;
        const __mmask16 k = static_cast<__mmask16>(N - n >= 16 ? 0xFFFF : (1u << (N - n)) - 1);
        __m512 acc = _mm512_setzero_ps();
        for (int64_t j = start; j < start + count; ++j)
          acc = _mm512_fmadd_ps(_mm512_set1_ps(t[m * R + j]), load16_masked(b_t + j * N + n, k), acc);
        store16(y + m * N + n, _mm512_add_ps(load16_masked(y + m * N + n, k), round_to<T>(acc)), k);
      }
    }
  });
}

at::Tensor lora_rows_add_(at::Tensor y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b_t,
                          const at::Tensor& row_cols) {
  const auto dtype = y.scalar_type();
  TORCH_CHECK(x.scalar_type() == dtype && a.scalar_type() == dtype && b_t.scalar_type() == dtype &&
                  (dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf),
              "lora_rows_add_: y, x, a and b_t in one dtype of float32, bfloat16, float16");
  TORCH_CHECK(y.dim() == 2 && x.dim() == 2 && a.dim() == 2 && b_t.dim() == 2 && y.is_contiguous() &&
                  x.is_contiguous() && a.is_contiguous() && b_t.is_contiguous(),
              "lora_rows_add_: contiguous 2-d y, x, a, b_t");
  const int64_t M = x.size(0), K = x.size(1), R = a.size(0), N = b_t.size(1);
  TORCH_CHECK(a.size(1) == K && b_t.size(0) == R && y.size(0) == M && y.size(1) == N,
              "lora_rows_add_: x ", x.sizes(), ", a ", a.sizes(), ", b_t ", b_t.sizes(), ", y ", y.sizes());
  TORCH_CHECK(row_cols.scalar_type() == at::kLong && row_cols.is_contiguous() && row_cols.dim() == 2 &&
                  row_cols.size(0) == M && row_cols.size(1) == 2,
              "lora_rows_add_: row_cols must be contiguous (M, 2) int64");
  const int64_t* rc = row_cols.data_ptr<int64_t>();
  for (int64_t m = 0; m < M; ++m)
    TORCH_CHECK(rc[2 * m] >= 0 && rc[2 * m + 1] >= 0 && rc[2 * m] + rc[2 * m + 1] <= R,
                "lora_rows_add_: row ", m, "'s columns [", rc[2 * m], ", +", rc[2 * m + 1], ") out of ", R);
  if (M == 0 || N == 0) return y;
  if (dtype == at::kFloat)
    lora_rows_run(y.data_ptr<float>(), x.data_ptr<float>(), a.data_ptr<float>(), b_t.data_ptr<float>(), rc, M, K, N, R);
  else if (dtype == at::kBFloat16)
    lora_rows_run(y.data_ptr<c10::BFloat16>(), x.data_ptr<c10::BFloat16>(), a.data_ptr<c10::BFloat16>(),
                  b_t.data_ptr<c10::BFloat16>(), rc, M, K, N, R);
  else
    lora_rows_run(y.data_ptr<c10::Half>(), x.data_ptr<c10::Half>(), a.data_ptr<c10::Half>(),
                  b_t.data_ptr<c10::Half>(), rc, M, K, N, R);
  return y;
}

at::Tensor base_product(const at::Tensor& x, const at::Tensor& tensor, const c10::optional<at::Tensor>& scales,
                        int64_t out, const c10::optional<at::Tensor>& bias, bool few_rows) {
  if (!scales.has_value() || !scales->defined()) {
    return few_rows ? bf16_rows::linear(x, tensor, bias) : at::linear(x, tensor, bias);
  }
  if (scales->scalar_type() == at::kHalf) return int4_linear(x, tensor, *scales, out, bias, true);
  if (scales->scalar_type() == at::kByte) return kquant_linear(x, tensor, *scales, out, bias, true);
  return int8_linear(x, tensor, *scales, out, bias, true);
}

at::Tensor project(const at::Tensor& x, const Weight& w, const c10::optional<at::Tensor>& bias, bool few_rows) {
  const auto& [tensor, scales, out, adapter] = w;
  at::Tensor y = base_product(x, tensor, scales, out, bias, few_rows);
  if (adapter.has_value()) {
    const auto& [a, b_t, row_cols] = *adapter;
    TORCH_CHECK(x.size(0) <= LORA_ROWS_MAX, "decode block: served adapters on ", x.size(0), " rows, at most ",
                LORA_ROWS_MAX, " (engine/ops.py runs more op by op)");
    lora_rows_add_(y, x.contiguous(), a, b_t, row_cols);
  }
  return y;
}

// A projection given as parts whose outputs are concatenated: q/k/v (or gate/up) stacked at load, as one
// part, or kept apart (weights that are views of a mapped checkpoint, which stacking would copy). Each
// output element is the same dot product either way, so the results are the same bits.
at::Tensor project_parts(const at::Tensor& x, const std::vector<Weight>& parts,
                         const std::vector<c10::optional<at::Tensor>>& biases, bool few_rows) {
  TORCH_CHECK(!parts.empty() && (biases.empty() || biases.size() == parts.size()),
              "decode block: ", parts.size(), " weight parts with ", biases.size(), " biases");
  const auto bias = [&](size_t i) { return biases.empty() ? c10::optional<at::Tensor>() : biases[i]; };
  if (parts.size() == 1) return project(x, parts[0], bias(0), few_rows);
  std::vector<at::Tensor> outs;
  for (size_t i = 0; i < parts.size(); ++i) outs.push_back(project(x, parts[i], bias(i), few_rows));
  return at::cat(outs, 1);
}

at::Tensor block(const at::Tensor& x, const at::Tensor& attn_norm, const at::Tensor& mlp_norm, double eps,
                 const std::vector<Weight>& wqkv, const std::vector<c10::optional<at::Tensor>>& bqkv, const Weight& wo,
                 const c10::optional<at::Tensor>& bo, const std::vector<Weight>& w_gate_up, const Weight& w_down,
                 const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache, at::Tensor v_cache,
                 const at::Tensor& slots, const at::Tensor& tables, const at::Tensor& positions, int64_t window,
                 int64_t heads, int64_t kv_heads, int64_t head_dim, bool few_rows) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "decode block: x must be contiguous (seqs, hidden), got ", x.sizes());
  const int64_t seqs = x.size(0), qk_heads = heads + kv_heads;
  int64_t qkv_rows = 0;
  for (const auto& part : wqkv) qkv_rows += std::get<2>(part);
  TORCH_CHECK(qkv_rows == (heads + 2 * kv_heads) * head_dim, "decode block: q/k/v have ", qkv_rows,
              " rows, expected (", heads, " + 2 * ", kv_heads, ") * ", head_dim);
  const at::Tensor hn = rms_norm(x, attn_norm, eps);
  const at::Tensor qkv = project_parts(hn, wqkv, bqkv, few_rows).view({seqs, qk_heads + kv_heads, head_dim});
  const at::Tensor qk = rotary(qkv.narrow(1, 0, qk_heads), cos, sin);  // (seqs, heads + kv_heads, hd)
  const at::Tensor attn = decode_attention(qk.narrow(1, 0, heads), qk.narrow(1, heads, kv_heads),
                                           qkv.narrow(1, qk_heads, kv_heads), k_cache, v_cache, slots, tables,
                                           positions, window);  // (seqs, heads * hd)
  const auto [h, hn2] = add_rms_norm(x, project(attn, wo, bo, few_rows), mlp_norm, eps);
  at::Tensor act;
  if (w_gate_up.size() == 2) {  // gate and up apart: no concatenation needed
    act = silu_mul(project(hn2, w_gate_up[0], c10::nullopt, few_rows), project(hn2, w_gate_up[1], c10::nullopt, few_rows));
  } else {
    TORCH_CHECK(w_gate_up.size() == 1, "decode block: gate/up in ", w_gate_up.size(), " parts");
    const at::Tensor gate_up = project(hn2, w_gate_up[0], c10::nullopt, few_rows);  // (seqs, 2 * intermediate)
    const int64_t inter = gate_up.size(1) / 2;
    act = silu_mul(gate_up.narrow(1, 0, inter), gate_up.narrow(1, inter, inter));
  }
  return h + project(act, w_down, c10::nullopt, few_rows);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("block", &block, "one decoder block for one token per sequence (engine/model.py block_forward)",
        py::arg("x"), py::arg("attn_norm"), py::arg("mlp_norm"), py::arg("eps"), py::arg("wqkv"), py::arg("bqkv"),
        py::arg("wo"), py::arg("bo"), py::arg("w_gate_up"), py::arg("w_down"), py::arg("cos"), py::arg("sin"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("slots"), py::arg("block_tables"), py::arg("positions"),
        py::arg("window"), py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"), py::arg("few_rows"));
  m.def("lora_rows_add_", &lora_rows_add_, "y += served adapters' term, each row through its own columns",
        py::arg("y"), py::arg("x"), py::arg("a"), py::arg("b_t"), py::arg("row_cols"));
  m.attr("LORA_ROWS_MAX") = LORA_ROWS_MAX;
  m.def("cpu_supported", &cpu_supported, "whether this CPU has AVX512F/BW/VL and AVX512-VNNI");
}
