"""The optional C++ kernels' shared loader (engine/kernels/build.py optional_kernel) and each kernel's use
of it: the off setting logged with the kernel's own message, a bad setting refused, a source that does not
compile falling back with one warning, a reason that blocks the build, and a CPU the module turns down.
What each kernel computes is tested in its own file; this is the part they share."""

from __future__ import annotations

import logging
import types
from pathlib import Path

import pytest
import torch

from engine import kernels
from engine.kernels import attention_ops as ao
from engine.kernels import bf16_rows as br
from engine.kernels import build
from engine.kernels import decode_block as db
from engine.kernels import fused_ops as fo
from engine.kernels import ggml_repack as gr

# (module, loader name, setting, its off value, what the warning says, the build failure's subject, needs VNNI)
KERNELS = [
    (fo, "fused_ops", "LAYERSTREAM_FUSED_OPS", "torch", "not the fused CPU ops", "they", False),
    (ao, "attention_ops", "LAYERSTREAM_ATTENTION_OPS", "torch", "not the fused C++ softmax", "it", False),
    (br, "bf16_rows", "LAYERSTREAM_BF16_ROWS", "off", "not the AVX512-BF16 kernel", "it", False),
    (db, "decode_block", "LAYERSTREAM_DECODE_BLOCK", "off", "not as one C++ call", "it", True),
    (gr, "ggml_repack", "LAYERSTREAM_STREAM_REPACK", "off", "not repacked for the VNNI kernels", "it", True),
]
IDS = [k[1] for k in KERNELS]


@pytest.fixture
def redecide(monkeypatch):
    """Decide a kernel again under this test's environment; the process's choice is restored after."""
    loaders = []

    def start(loader):
        loaders.append(loader)
        loader.cache_clear()
        return loader

    yield start
    monkeypatch.undo()
    for loader in loaders:
        loader.cache_clear()
        loader()


@pytest.mark.parametrize("module,name,setting,off,what,subject,vnni", KERNELS, ids=IDS)
def test_off_setting_is_logged_and_a_bad_one_refused(redecide, monkeypatch, caplog, module, name, setting, off, what,
                                                     subject, vnni):
    loader = redecide(getattr(module, name))
    monkeypatch.setenv(setting, off)
    with caplog.at_level(logging.WARNING, logger="layerstream"):
        assert loader() is None
    assert f"{what}: {setting}={off}" in caplog.text
    loader.cache_clear()
    monkeypatch.setenv(setting, "fast")
    with pytest.raises(ValueError, match=f"{setting} must be auto or {off}, got 'fast'"):
        loader()


@pytest.mark.parametrize("module,name,setting,off,what,subject,vnni", KERNELS, ids=IDS)
def test_a_source_that_does_not_compile_falls_back_logged(redecide, monkeypatch, tmp_path, caplog, module, name,
                                                          setting, off, what, subject, vnni):
    if vnni and kernels.int4_backend() != "vnni":
        pytest.skip("without the VNNI kernels it is not built at all")
    bad = tmp_path / f"{name}.cpp"
    bad.write_text("#error this kernel does not compile\n")
    loader = redecide(getattr(module, name))
    monkeypatch.setattr(module, "SOURCE", bad)
    monkeypatch.setenv("LAYERSTREAM_CACHE", str(tmp_path / "cache"))
    with caplog.at_level(logging.WARNING, logger="layerstream"):
        assert loader() is None
    assert f"{what}: {subject} could not be built" in caplog.text


def test_a_blocking_reason_and_a_cpu_it_cannot_use(monkeypatch, caplog):
    """blocked() is asked before any build and its reason logged; a module whose cpu_supported() is false
    is not used, with the cpu_check reason; with neither, the module comes back."""
    built = []
    fake = types.SimpleNamespace(cpu_supported=lambda: False)

    def compile_or_reason(*args):
        built.append(args[0])
        return fake, ""

    monkeypatch.setattr(build, "compile_or_reason", compile_or_reason)
    monkeypatch.delenv("LAYERSTREAM_TEST_KERNEL", raising=False)
    with caplog.at_level(logging.WARNING, logger="layerstream"):
        assert build.optional_kernel("LAYERSTREAM_TEST_KERNEL", "off", "test kernel", "k", build.Path("k.cpp"),
                                     blocked=lambda: "its parts are off") is None
        assert built == []
        assert build.optional_kernel("LAYERSTREAM_TEST_KERNEL", "off", "test kernel", "k", build.Path("k.cpp"),
                                     cpu_check="the CPU lacks it") is None
    assert "test kernel: its parts are off" in caplog.text and "test kernel: the CPU lacks it" in caplog.text
    assert build.optional_kernel("LAYERSTREAM_TEST_KERNEL", "off", "test kernel", "k", build.Path("k.cpp")) is fake
    assert built == ["k", "k"]


def _int4_module():
    return kernels._module if kernels.int4_backend() == "vnni" else None


# The kernels that split their work with at::parallel_for (decode_block holds fused_ops' and bf16_rows' code).
PARALLEL = [("fused_ops", fo.fused_ops), ("attention_ops", ao.attention_ops), ("bf16_rows", br.bf16_rows),
            ("decode_block", db.decode_block), ("int4_vnni", _int4_module)]


@pytest.mark.parametrize("name,loaded", PARALLEL, ids=[p[0] for p in PARALLEL])
def test_the_kernels_are_built_to_run_on_torchs_threads(name, loaded):
    """at::parallel_for compiles to a loop on the calling thread unless the kernel is built with OpenMP
    (build.PARALLEL); all of them once ran on one core of two that way. Built right, the library calls
    into libgomp's parallel region."""
    module = loaded()
    if module is None:
        pytest.skip(f"{name} is not in use on this machine")
    assert b"GOMP_parallel" in Path(module.__file__).read_bytes()
    assert "-fopenmp" in build._with_parallel(fo.CFLAGS)


@pytest.mark.parametrize("amx", [True, False], ids=["amx", "no-amx"])
def test_bf16_rows_leaves_two_or_more_rows_to_onednn_on_an_amx_cpu(redecide, monkeypatch, amx):
    """Where oneDNN has AMX tiles it multiplies 2-16 bf16 rows faster than bf16_rows.cpp but one row slower:
    the kernel takes one row there, 1-16 elsewhere (engine/ops.py asks max_rows)."""
    from engine import ops
    kernel = redecide(br.bf16_rows)()
    if kernel is None:
        pytest.skip("bf16_rows.cpp does not build or run here")
    monkeypatch.setattr(br, "onednn_has_amx", lambda: amx)
    assert br.max_rows(kernel) == (1 if amx else kernel.MAX_ROWS)
    one, two = torch.zeros(1, 64, dtype=torch.bfloat16), torch.zeros(2, 64, dtype=torch.bfloat16)
    assert ops._few_bf16_rows(one) and ops._few_bf16_rows(two) == (not amx)
