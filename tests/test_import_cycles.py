"""The Python files import each other without cycles: a package's modules form layers,
so each one can be read, tested and replaced from the bottom up.

Every import counts, also one inside a function or under TYPE_CHECKING: an import
deferred to break a cycle still ties the two files together."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("wire", "kvcache", "replica", "router", "deployments", "kvserve")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, modules: set[str]) -> set[str]:
    """This repository's modules that the file imports (`from a import b` counts a.b where
    that is a module, else a)."""
    found = set()
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return {m for m in found if m in modules}


def import_graph() -> dict[str, set[str]]:
    """module -> the modules it imports."""
    files = [p for package in PACKAGES for p in (ROOT / package).rglob("*.py") if "protos" not in p.parts]
    modules = {module_name(p) for p in files}
    graph = {}
    for path in files:
        source = module_name(path)
        # A package's __init__ re-exporting its own modules is no cycle of files.
        graph[source] = {
            target
            for target in imported_modules(path, modules)
            if target != source and not (path.name == "__init__.py" and target.startswith(source + "."))
        }
    return graph


def cycle_through(graph: dict[str, set[str]], start: str) -> list[str] | None:
    """A path of imports from `start` back to itself, if there is one (depth first)."""
    stack, seen = [(start, [start])], set()
    while stack:
        module, path = stack.pop()
        for target in sorted(graph[module]):
            if target == start:
                return path + [start]
            if target not in seen:
                seen.add(target)
                stack.append((target, path + [target]))
    return None


def test_no_import_cycles():
    graph = import_graph()
    assert len(graph) > 50, "the walk found too few modules to mean anything"
    cycles = [c for m in sorted(graph) if (c := cycle_through(graph, m))]
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_cycle_check_finds_a_cycle():
    graph = import_graph()
    assert "replica.scheduler" in graph["replica.engine"]  # it reads real imports
    graph["replica.scheduler"] = graph["replica.scheduler"] | {"replica.engine"}
    cycle = cycle_through(graph, "replica.engine")
    assert cycle is not None and cycle[0] == cycle[-1] == "replica.engine"
    assert cycle[-2:] == ["replica.scheduler", "replica.engine"]
