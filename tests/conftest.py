import pytest
import torch

from tests.support.models import ARCHS, build

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
    """Build (first run: a minute or two) or load every kernel once, under the real layerstream cache,
    before any test points LAYERSTREAM_CACHE at a folder of its own (which would build them again)."""
    from engine import kernels
    from engine.kernels.prepare import prepare

    prepare()
    return kernels.int4_backend()


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    """arch -> folder of a tiny fp32 random-weight checkpoint (built once per test session)."""
    root = tmp_path_factory.mktemp("models")
    return {arch: build(root / arch, arch) for arch in ARCHS}


@pytest.fixture(scope="session")
def llama_dir(model_dirs):
    return model_dirs["llama"]
