"""The imports between kvserve's Python files, read from their source with ast, for the
tests that hold docs/architecture.md's lines (test_import_cycles.py,
test_import_direction.py).

Every import counts, also one inside a function or under TYPE_CHECKING: an import
deferred to break a cycle, or to keep a module light, still ties the two files together.
Relative imports resolve to the modules they name."""

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("wire", "kvcache", "replica", "router", "deployments", "kvserve")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_files() -> dict[str, Path]:
    """module -> its file, for every Python file of the packages (generated protobuf
    code aside)."""
    files = [p for package in PACKAGES for p in (ROOT / package).rglob("*.py") if "protos" not in p.parts]
    return {module_name(p): p for p in files}


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


@functools.cache
def _read_graph() -> dict[str, frozenset[str]]:
    files = package_files()
    modules = set(files)
    return {source: frozenset(imported_modules(path, modules) - {source}) for source, path in files.items()}


def import_graph() -> dict[str, set[str]]:
    """module -> the other modules it imports: a fresh copy, which a test may change to
    plant an import; the files are parsed once per session."""
    return {source: set(targets) for source, targets in _read_graph().items()}
