import pytest
import torch

from tests.models import ARCHS, build

try:
    HAS_CUDA = torch.cuda.is_available()
except Exception:  # noqa: BLE001
    HAS_CUDA = False


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords and not HAS_CUDA:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def int4_kernel():
    """Build (first run: ~1 min) or load the int4 kernel once, under the real layerstream cache,
    before any test points LAYERSTREAM_CACHE at a folder of its own (which would build it again)."""
    from engine import kernels
    from engine.kernels.attention_ops import attention_ops
    from engine.kernels.bf16_rows import bf16_rows, built
    from engine.kernels.decode_block import decode_block
    from engine.kernels.fused_ops import fused_ops
    from engine.kernels.ggml_repack import ggml_repack

    fused_ops()  # the fused CPU ops likewise (engine/model.py's RMSNorm, SwiGLU, rotary)
    attention_ops()  # and attention_backend's softmax
    bf16_rows()  # and the bf16 products of 2-16 rows (engine/model.py linear)
    built()  # (the same kernel; tests use it on AMX CPUs too, where bf16_rows() is None)
    ggml_repack()  # and the repack of streamed GGUF blocks (engine/weights/stream_repack.py)
    decode_block()  # and a decode step's block as one C++ call (engine/model.py block_forward)
    return kernels.int4_backend()


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    """arch -> folder of a tiny fp32 random-weight checkpoint (built once per test session)."""
    root = tmp_path_factory.mktemp("models")
    return {arch: build(root / arch, arch) for arch in ARCHS}


@pytest.fixture(scope="session")
def llama_dir(model_dirs):
    return model_dirs["llama"]
