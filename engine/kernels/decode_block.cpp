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
// A stacked (sum R, in), their B side by side (out, sum R), and the mask (tokens, sum R) that keeps each
// token's own adapter's columns. y += ((x A^T) * mask) B^T, added to y in place in y's dtype, as
// engine/ops.py's _lora_rows_linear does op by op.
using Adapter = c10::optional<std::tuple<at::Tensor, at::Tensor, at::Tensor>>;
// (tensor, scales, out_features, adapter)
using Weight = std::tuple<at::Tensor, c10::optional<at::Tensor>, int64_t, Adapter>;

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
    const auto& [a, b, mask] = *adapter;
    const at::Tensor xa = base_product(x.to(a.scalar_type()), a, c10::nullopt, 0, c10::nullopt, few_rows).mul_(mask);
    const at::Tensor delta = base_product(xa, b, c10::nullopt, 0, c10::nullopt, few_rows);
    y = y.scalar_type() == delta.scalar_type() ? y.add_(delta) : (y.to(at::kFloat) + delta).to(y.scalar_type());
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
  m.def("cpu_supported", &cpu_supported, "whether this CPU has AVX512F/BW/VL and AVX512-VNNI");
}
