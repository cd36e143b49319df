import time, torch, sys
from gguf import GGMLQuantizationType as Q
from engine.kernels.ggml_repack import ggml_repack
from engine.weights.packed import int4_from_gguf, Int8Weight, INT4_TYPES
from engine.weights.dequant import dequantize
from tests.gguf_models import random_blocks
torch.set_num_threads(1)
m = ggml_repack()
def best(f, n=20):
    ts = []
    for _ in range(n):
        t0 = time.thread_time(); f(); ts.append(time.thread_time() - t0)
    return min(ts) * 1e3
for qt in (Q.Q4_1, Q.Q4_0, Q.Q4_K, Q.Q8_0, Q.Q5_0, Q.Q6_K):
    rows, cols = 1536, 768
    raw = torch.from_numpy(random_blocks(qt, rows, cols, seed=1))
    if qt in INT4_TYPES:
        ref = int4_from_gguf(raw, qt, (rows, cols), torch.bfloat16)
        c, s = torch.empty_like(ref.codes), torch.empty_like(ref.scales)
        cpp = best(lambda: m.repack_int4(raw, int(qt), cols, c, s))
    else:
        ref = Int8Weight.quantize(dequantize(raw, qt, (rows, cols)), torch.bfloat16)
        c, s = torch.empty_like(ref.codes), torch.empty_like(ref.scales)
        cpp = best(lambda: m.repack_int8(raw, int(qt), cols, c, s))
    assert torch.equal(c, ref.codes) and torch.equal(s.view(torch.uint8), ref.scales.view(torch.uint8))
    if len(sys.argv) > 1:
        py = best(lambda: (int4_from_gguf(raw, qt, (rows, cols), torch.bfloat16) if qt in INT4_TYPES else Int8Weight.quantize(dequantize(raw, qt, (rows, cols)), torch.bfloat16)), 5)
        deq = best(lambda: dequantize(raw, qt, (rows, cols)).to(torch.bfloat16), 5)
        print(f"{qt.name} {rows}x{cols}: C++ repack {cpp:.3f} ms, python repack {py:.2f} ms, dequantize to bf16 {deq:.2f} ms")
    else:
        print(f"{qt.name} {rows}x{cols}: C++ repack {cpp:.3f} ms")
