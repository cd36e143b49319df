"""The layering the architecture doc promises, checked on the source (docs/ARCHITECTURE.md):

- nothing outside engine/weights imports its sub-packages (formats/, packed/, transports/, experts/) or any
  other module inside it: only the package itself (`engine.weights`), and the benchmarks (and tests) its
  probes (`engine.weights.probes`);
- engine/weights imports no model math (`engine.model`): the runner passes it the router it needs;
- engine/model.py imports no kernel module (`engine.kernels`, `engine.attention_backend`): it calls
  `engine.ops`, and inside engine only ops (with the attention kernels it dispatches to, and the engine
  loop, which reports builds) reaches engine/kernels;
- `engine` imports nothing from `server` or `layerstream` (the dispatcher and its benchmarks);
- no import circles between modules (imports inside functions count: a lazy import is still a circle);
- no code outside `engine` walks the engine's object graph (`.runner`, `.streamer`, `.transport`).

The weights package's own unit tests (tests/weights/, and tests/support/ where they share a harness) may
import its parts; so may the tests listed below. Every other test goes through public interfaces.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "server", "layerstream")
# Tests outside tests/weights/ that unit-test one part of the weights package: the int4/int8 layouts
# against the kernel that reads them, and the GPU check that replays the CUDA transport without a GPU.
WEIGHTS_UNIT_TESTS = {"tests/kernels/test_int4_kernel.py", "tests/deploy/test_gpu_check.py"}
WEIGHTS_TEST_DIRS = ("tests/weights/", "tests/support/")
PROBES = "engine.weights.probes"  # what benchmarks measure inside the weights package: bench and tests only
SUB_PACKAGES = ("formats", "packed", "transports", "experts")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path) -> set[str]:
    """Every module `path` imports, anywhere in the file, as absolute dotted names. `from a import b`
    counts as importing a.b when a.b is a module of the project, else as importing a."""
    tree = ast.parse(path.read_text(), str(path))
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out = set()
    for node in _runtime_nodes(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module
            for a in node.names:
                sub = f"{mod}.{a.name}"
                out.add(sub if _is_module(sub) else mod)
    return out


def _runtime_nodes(tree: ast.AST):
    """Every node except those under `if TYPE_CHECKING:` (annotations only: never imported at run time)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _is_module(name: str) -> bool:
    p = ROOT.joinpath(*name.split("."))
    return p.with_suffix(".py").exists() or (p / "__init__.py").exists()


def sources(*dirs: str) -> list[Path]:
    return [p for d in dirs if (ROOT / d).exists() for p in sorted((ROOT / d).rglob("*.py"))]


def project(names: set[str]) -> set[str]:
    return {n for n in names if n.split(".")[0] in PACKAGES}


def _weights_unit_test(path: Path) -> bool:
    rel = str(path.relative_to(ROOT))
    return rel.startswith(WEIGHTS_TEST_DIRS) or rel in WEIGHTS_UNIT_TESTS


def test_nothing_outside_weights_imports_its_internals():
    bad = []
    for path in sources(*PACKAGES, "tests"):
        me = module_name(path)
        if me.startswith("engine.weights") or _weights_unit_test(path):
            continue
        probes_allowed = me.startswith(("layerstream.bench.", "tests."))
        bad += [f"{me} imports {n}" for n in imports(path) if n.startswith("engine.weights.")
                and not (n == PROBES and probes_allowed)]
    assert not bad, "use the public interface in engine/weights/__init__.py:\n" + "\n".join(bad)


def test_nothing_outside_weights_imports_its_sub_packages():
    """The rooms inside engine/weights (formats/, packed/, transports/, experts/) are its own business."""
    rooms = tuple(f"engine.weights.{s}" for s in SUB_PACKAGES)
    bad = [f"{module_name(p)} imports {n}" for p in sources(*PACKAGES, "tests")
           if not module_name(p).startswith("engine.weights") and not _weights_unit_test(p)
           for n in imports(p) if any(n == r or n.startswith(r + ".") for r in rooms)]
    assert not bad, "\n".join(bad)


def test_weights_imports_no_model_math():
    bad = [f"{module_name(p)} imports {n}" for p in sources("engine/weights") for n in imports(p)
           if n == "engine.model" or n.startswith("engine.model.")]
    assert not bad, "the runner passes what the weights need from the model (the MoE router):\n" + "\n".join(bad)


KERNEL_MODULES = ("engine.kernels", "engine.attention_backend")
# engine modules outside engine/kernels that may import it: the dispatch, the attention kernels it calls
# (for the AMX fact their memory bound depends on), and the engine loop (it reports and stops builds).
REACH_KERNELS = {"engine.ops", "engine.attention_backend", "engine.engine_loop"}


def _kernel_module(name: str) -> bool:
    return any(name == k or name.startswith(k + ".") for k in KERNEL_MODULES)


def test_model_imports_no_kernel_module():
    model = ROOT / "engine" / "model.py"
    bad = sorted(n for n in imports(model) if _kernel_module(n))
    assert not bad, f"engine/model.py calls engine.ops, not kernels: {bad}"
    assert "engine.ops" in imports(model)


def test_only_ops_chooses_kernels():
    """Inside engine, the kernel choices are read through engine.ops (engine/kernels builds and loads)."""
    bad = [f"{module_name(p)} imports {n}" for p in sources("engine") for n in imports(p)
           if n.startswith("engine.kernels") and not module_name(p).startswith("engine.kernels")
           and module_name(p) not in REACH_KERNELS]
    assert not bad, "ask engine.ops:\n" + "\n".join(bad)


def test_engine_imports_no_server_bench_or_dispatcher():
    bad = [f"{module_name(p)} imports {n}" for p in sources("engine") for n in imports(p)
           if n.split(".")[0] in ("server", "layerstream")]
    assert not bad, "\n".join(bad)


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one module: the import circles."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circles():
    graph = {module_name(p): project(imports(p)) - {module_name(p)} for p in sources(*PACKAGES)}
    assert not circles(graph), f"import circles: {circles(graph)}"


def test_the_checker_is_not_vacuous():
    """Relative and lazy imports resolve to the modules they name, and a circle is found."""
    pkg = ROOT / "engine"
    assert "engine.weights.transports.streamer" in imports(pkg / "weights" / "model_weights.py")
    assert "engine.weights.transports.disk_reader" in imports(pkg / "weights" / "model_weights.py")  # inside a method
    assert {"engine.planner", "engine.weights"} <= imports(pkg / "loader.py")
    # a room, imported inside a function
    assert "engine.weights.transports.cuda" in imports(ROOT / "tests" / "support" / "cuda_replay.py")
    # under TYPE_CHECKING
    assert "engine.weights.transports.streamer" not in imports(pkg / "weights" / "transports" / "bandwidth.py")
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# Attribute reads with these names that are not the engine's object graph, each with its reason.
NOT_THE_ENGINE = {
    ("server/http_protocol.py", "transport"): "asyncio's transport of a client connection",
    ("tests/server/test_server_app.py", "runner"): "fault injection: a forward pass that fails on demand",
    ("layerstream/bench/decode_profile.py", "runner"): "a profiler: it times the model's parts on the runner's weights and KV cache",
}


def test_nothing_outside_the_engine_walks_its_object_graph():
    bad = []
    for path in sources("server", "layerstream", "tests"):
        rel = str(path.relative_to(ROOT))
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Attribute) and node.attr in ("runner", "streamer", "transport")
                    and (rel, node.attr) not in NOT_THE_ENGINE):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: .{node.attr}")
    assert not bad, "read LLMEngine.telemetry() instead:\n" + "\n".join(bad)
