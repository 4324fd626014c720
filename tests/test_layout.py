"""The package layout: no folder named like build output or tests, and imports between mtp_ray's subpackages run
one way (docs/design.md, "Layout"). Reads every module's AST, lazy imports inside functions included."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "mtp_ray"
# the flow, bottom up: a subpackage may import only those before it (llm is the offline API over the engine,
# request_output its return types, beam_search its and the server's beam bookkeeping, prompts its prompt forms)
ORDER = ["config", "layers", "model", "parallel", "engine", "request_output", "beam_search", "prompts", "llm",
         "runtime", "rl", "serve"]


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


# packages whose modules may still import each other in a circle: serve/'s are being taken apart elsewhere (issue 62)
MODULE_CYCLES_ALLOWED = ("mtp_ray.serve",)


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _module_edges() -> dict[str, dict[str, str]]:
    """module -> {mtp_ray module it imports: file:line}, from every import statement (inside functions and under
    TYPE_CHECKING too; relative ones resolved); `from pkg import name` names the module pkg.name where there is one."""
    paths = {_module(p): p for p in sorted(ROOT.rglob("*.py"))}

    def resolve(name: str) -> str:
        while name and name not in paths:
            name = name.rpartition(".")[0]
        return name

    edges: dict[str, dict[str, str]] = {}
    for mod, path in paths.items():
        here = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(here[: len(here) - node.level + 1] + ([base] if base else []))
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in paths else base for a in node.names]
            else:
                continue
            for name in names:
                dst = resolve(name) if name.split(".")[0] == ROOT.name else ""
                if dst and dst != mod:
                    edges.setdefault(mod, {}).setdefault(dst, f"{path.relative_to(ROOT.parent)}:{node.lineno}")
    return edges


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


def test_no_import_cycle_between_modules():
    """No two files import each other, directly or around a circle, type-hint imports included: a callee takes what
    it needs of its caller (values, or a Protocol of its own), not the caller's class."""
    keep = lambda m: not m.startswith(MODULE_CYCLES_ALLOWED)
    edges = {a: {b: w for b, w in dsts.items() if keep(b)} for a, dsts in _module_edges().items() if keep(a)}
    cycle = _cycle(edges)
    if cycle:
        hops = [f"{a} -> {b} ({edges[a][b]})" for a, b in zip(cycle, cycle[1:])]
        raise AssertionError("import cycle between mtp_ray modules: " + "; ".join(hops))


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
    mods = _module_edges()  # type-hint imports count: warmup.py names the parts of the engine it drives
    assert "mtp_ray.parallel.sync" in mods["mtp_ray.engine.warmup"]
    assert "mtp_ray.engine.warmup" in mods["mtp_ray.engine.core"]
