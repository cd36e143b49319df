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


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    """arch -> folder of a tiny fp32 random-weight checkpoint (built once per test session)."""
    root = tmp_path_factory.mktemp("models")
    return {arch: build(root / arch, arch) for arch in ARCHS}


@pytest.fixture(scope="session")
def llama_dir(model_dirs):
    return model_dirs["llama"]
