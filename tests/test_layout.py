"""The package layout: no folder named like build output or tests, imports between mtp_ray's subpackages run one way,
no import cycle between files, and serve/'s stages run one way too (docs/design.md, "Layout"). Reads every module's
AST, lazy imports inside functions and type-hint imports (`if TYPE_CHECKING:`) included."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

from tests.conftest import SERVE_MARK

ROOT = Path(__file__).resolve().parent.parent / "mtp_ray"
# the flow, bottom up: a subpackage may import only those before it (llm is the offline API over the engine,
# request_output its return types, beam_search its and the server's beam bookkeeping, prompts its prompt forms)
ORDER = ["config", "layers", "model", "parallel", "engine", "request_output", "beam_search", "prompts", "llm",
         "runtime", "rl", "serve"]
# serve/'s stages, bottom up: a module of one imports modules of the stages before it (and its own) only, and every
# serve module is in one (a folder, or app.py): text parsing < the generation path's request and rendering < the other
# APIs' adapters < the Serve side (groups, deployment, metrics) < the FastAPI shell < the application builder
SERVE_ORDER = ["parsers", "openai", "apis", "cluster", "http", "app"]


def _unit(module: str) -> str | None:
    """The layout unit a dotted module name belongs to: mtp_ray.engine.core -> engine, mtp_ray.llm -> llm."""
    parts = module.split(".")
    return parts[1] if parts[0] == "mtp_ray" and len(parts) > 1 else None


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)  # from mtp_ray import engine
    return found


def _edges() -> dict[str, dict[str, str]]:
    """unit -> {imported unit: a file that imports it}."""
    edges: dict[str, dict[str, str]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent)
        src = _unit(".".join(rel.with_suffix("").parts))
        if src in (None, "__init__"):
            continue
        for mod in _imports(path):
            dst = _unit(mod)
            if dst is not None and dst != src and ((ROOT / dst).is_dir() or (ROOT / f"{dst}.py").exists()):
                edges.setdefault(src, {}).setdefault(dst, str(rel))
    return edges


def _cycle(edges: dict[str, dict[str, str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(u: str) -> list[str] | None:
        state[u] = 1
        stack.append(u)
        for v in edges.get(u, {}):
            if state.get(v) == 1:
                return stack[stack.index(v):] + [v]
            if v not in state and (c := visit(v)):
                return c
        stack.pop()
        state[u] = 2
        return None

    for u in list(edges):
        if u not in state and (c := visit(u)):
            return c
    return None


def test_no_dist_or_spec_package_folder():
    bad = [str(p.relative_to(ROOT.parent)) for p in ROOT.rglob("*") if p.is_dir()
           and p.name in ("dist", "build", "spec", "specs", "test", "tests")]
    assert not bad, f"package folders named like build output or tests (ignored or skipped by common tools): {bad}"


def test_no_import_cycle_between_subpackages():
    edges = _edges()
    cycle = _cycle(edges)
    if cycle:
        hops = [f"{a} -> {b} ({edges[a][b]})" for a, b in zip(cycle, cycle[1:])]
        raise AssertionError("import cycle between mtp_ray subpackages: " + "; ".join(hops))


def test_imports_follow_the_flow():
    units = ({p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
             | {p.stem for p in ROOT.glob("*.py") if p.stem != "__init__"})
    assert units - {"assets"} == set(ORDER), f"update ORDER (and docs/design.md) for {units ^ set(ORDER)}"
    up = [f"{src} imports {dst} ({where})" for src, dsts in _edges().items() for dst, where in dsts.items()
          if ORDER.index(dst) > ORDER.index(src)]
    assert not up, "imports that run back up the flow " + " > ".join(ORDER) + ":\n" + "\n".join(up)


def test_cycle_finder_finds_a_cycle():
    """The checks above would pass vacuously if the walker saw no edges or the cycle search were broken."""
    edges = _edges()
    assert edges["serve"] and edges["engine"], edges
    assert _cycle({"a": {"b": "x"}, "b": {"c": "y"}, "c": {"a": "z"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b": "x"}, "b": {}}) is None


def _modules() -> dict[str, Path]:
    """Every module of mtp_ray by dotted name (a package by its own name: mtp_ray.serve.http)."""
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _targets(module: str, tree: ast.AST, modules: dict[str, Path] | set[str]) -> dict[str, int]:
    """The mtp_ray modules `module`'s imports name, each with its first line: `from P import x` is module P.x where
    that is a module (`from mtp_ray.serve.apis import anthropic`), else P (where x is defined); `import a.b` is a.b."""

    def known(name: str) -> str | None:  # the longest prefix of a dotted name that is a module of ours
        parts = name.split(".")
        return next((m for i in range(len(parts), 0, -1) if (m := ".".join(parts[:i])) in modules), None)

    is_pkg = module in modules and isinstance(modules, dict) and modules[module].name == "__init__.py"
    found: dict[str | None, int] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                found[known(a.name)] = min(found.get(known(a.name), node.lineno), node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package, up level - 1 more
                pkg = module.split(".") if is_pkg else module.split(".")[:-1]
                pkg = pkg[: len(pkg) - node.level + 1]
                base = ".".join(pkg + ([base] if base else []))
            for a in node.names:
                dst = f"{base}.{a.name}" if f"{base}.{a.name}" in modules else known(base)
                found[dst] = min(found.get(dst, node.lineno), node.lineno)
    return {m: line for m, line in found.items() if m is not None and m != module}


@functools.cache
def _module_edges() -> dict[str, dict[str, str]]:
    """module -> {module it imports: file:line of the (first) import}."""
    modules = _modules()
    edges: dict[str, dict[str, str]] = {}
    for mod, path in modules.items():
        rel = path.relative_to(ROOT.parent)
        edges[mod] = {dst: f"{rel}:{line}" for dst, line in
                      sorted(_targets(mod, ast.parse(path.read_text(), str(path)), modules).items())}
    return edges


def _module_components(edges: dict[str, dict[str, str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan): each module of one is on a cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    comps: list[set[str]] = []

    def visit(u: str) -> None:
        index[u] = low[u] = len(index)
        stack.append(u)
        on.add(u)
        for v in edges.get(u, {}):
            if v not in index:
                visit(v)
                low[u] = min(low[u], low[v])
            elif v in on:
                low[u] = min(low[u], index[v])
        if low[u] == index[u]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == u:
                    break
            if len(comp) > 1:
                comps.append(comp)

    for u in sorted(edges):
        if u not in index:
            visit(u)
    return comps


def _module_cycles(edges: dict[str, dict[str, str]]) -> list[list[str]]:
    """One cycle per component of _module_components, as [a, b, ..., a]."""
    cycles = []
    for comp in _module_components(edges):  # the shortest way back to its first module, within the component
        start = min(comp)
        prev: dict[str, str] = {}
        todo, end = [start], None
        while todo and end is None:
            u = todo.pop(0)
            for v in sorted(edges[u]):
                if v == start:
                    end = u
                    break
                if v in comp and v not in prev:
                    prev[v] = u
                    todo.append(v)
        path = [end]
        while path[-1] != start:
            path.append(prev[path[-1]])
        cycles.append([start] + path[::-1][1:] + [start] if len(path) > 1 else [start, start])
    return sorted(cycles)


@pytest.mark.parametrize("unit", ORDER)
def test_no_import_cycle_between_modules(unit):
    """No two files import each other, directly or around a circle, type hints and lazy imports included: a circle
    is code that cannot be read (or moved) one file at a time. Per subpackage (a circle across subpackages is also
    one between them, which test_no_import_cycle_between_subpackages names)."""
    edges = _module_edges()
    found = []
    for comp in _module_components(edges):
        if any(_unit(m) == unit for m in comp):
            cycle = _module_cycles({m: {v: w for v, w in edges[m].items() if v in comp} for m in comp})[0]
            others = sorted(comp - set(cycle))
            found.append("; ".join(f"{a} -> {b} ({edges[a][b]})" for a, b in zip(cycle, cycle[1:]))
                         + (f" (in a circle with {', '.join(others)} too)" if others else ""))
    assert not found, "import cycles between files (type hints and lazy imports count):\n" + "\n".join(found)


def _stage(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if parts[:2] == ["mtp_ray", "serve"] and len(parts) > 2 else None


def test_every_serve_module_is_in_a_stage():
    """A new file goes into a stage folder (or a new stage into SERVE_ORDER and docs/design.md), not flat in serve/."""
    loose = [m for m in _modules() if m.startswith("mtp_ray.serve.") and _stage(m) not in SERVE_ORDER]
    assert not loose, f"serve modules in no stage of {SERVE_ORDER}: {loose}"
    assert (ROOT / "serve" / "app.py").is_file(), "deployments/*.yaml import mtp_ray.serve.app:build_app"
    assert all((ROOT / "serve" / s / "__init__.py").is_file() for s in SERVE_ORDER if s != "app")


def test_serve_stages_follow_their_order():
    up = [f"{src} imports {dst} ({where})" for src, dsts in _module_edges().items() for dst, where in dsts.items()
          if _stage(src) and _stage(dst) and SERVE_ORDER.index(_stage(dst)) > SERVE_ORDER.index(_stage(src))]
    assert not up, "serve imports that run back up its stages " + " < ".join(SERVE_ORDER) + ":\n" + "\n".join(up)


def test_module_walker_resolves_names_and_finds_cycles():
    """The module checks above would pass vacuously if imports resolved to nothing or the cycle search were broken."""
    mods = {"mtp_ray", "mtp_ray.serve", "mtp_ray.serve.apis", "mtp_ray.serve.apis.anthropic", "mtp_ray.serve.app"}
    code = ("from mtp_ray.serve.apis import anthropic, helper\nfrom mtp_ray import __version__\n"
            "if TYPE_CHECKING:\n    from mtp_ray.serve import app\ndef f():\n    import mtp_ray.serve.apis.x\n")
    assert set(_targets("mtp_ray.serve.http.ingress", ast.parse(code), mods)) == {
        "mtp_ray.serve.apis.anthropic", "mtp_ray.serve.apis", "mtp_ray", "mtp_ray.serve.app"}
    edges = _module_edges()
    assert "mtp_ray.serve.apis.anthropic" in edges["mtp_ray.serve.http.http_app"], edges["mtp_ray.serve.http.http_app"]
    assert "mtp_ray.serve.openai.request" in edges["mtp_ray.serve.openai.chat_request"]
    assert _module_cycles({"a": {"b": ""}, "b": {"c": ""}, "c": {"a": "", "d": ""}, "d": {}}) == [["a", "b", "c", "a"]]
    assert _module_cycles({"a": {"b": ""}, "b": {}}) == []


@pytest.mark.parametrize("module", ["mtp_ray", "mtp_ray.serve.app", "mtp_ray.serve.http.ingress"])
def test_serving_side_imports_no_torch(module):
    """The processes that route requests and never run the model (the HTTP ingress replicas, a group replica until it
    places its ranks, the `serve run` CLI) import no torch (2.5 s and ~180 MB a process on the 2-core CI
    machine). A fresh interpreter, so what this test process imported does not count."""
    import subprocess
    import sys

    code = (f"import sys, {module}; bad = sorted(m for m in ('torch', 'safetensors', 'triton') if m in sys.modules); "
            "print(bad); sys.exit(1 if bad else 0)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, f"{module} imports {run.stdout.strip()} {run.stderr[-2000:]}"


# Files that run Ray Serve on the engine half's cluster (tests/conftest.py, worker_of): each on a port of its own,
# never one a `serve`-marked file uses (the two halves' clusters run at the same time on one machine)
SERVE_ON_ENGINE_HALF = {"test_prefix_caching.py": 8033}
STARTS_SERVE = re.compile(
    r"serve\.(start|run)\(|bench/serve\.py|serve run deployments|from tests\.test_serve_\w+ import")


def test_files_that_start_serve_run_on_the_serve_worker():
    """Under `-n 2 --dist loadscope` the files marked `serve` share one worker and cluster, the rest the other: a
    file that starts Serve (or borrows a Serve file's fixtures) unmarked would bind its port on the other cluster
    while the Serve worker's app may hold it."""
    tests = ROOT.parent / "tests"
    unmarked = [f.name for f in sorted(tests.glob("test_*.py"))
                if STARTS_SERVE.search(f.read_text()) and SERVE_MARK not in f.read_text()
                and f.name not in SERVE_ON_ENGINE_HALF and f.name != "test_layout.py"]
    assert not unmarked, f"mark these pytestmark = pytest.mark.serve (CONTRIBUTING.md, lanes): {unmarked}"
    ports = {int(p) for f in tests.glob("test_*.py") if SERVE_MARK in f.read_text()
             for p in re.findall(r"\b(80\d\d)\b", f.read_text())}
    for name, port in SERVE_ON_ENGINE_HALF.items():
        assert f"port = {port}" in (tests / name).read_text() and port not in ports, (name, port, sorted(ports))
