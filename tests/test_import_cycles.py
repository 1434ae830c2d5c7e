"""The Python files import each other without cycles: a package's modules form layers,
so each one can be read, tested and replaced from the bottom up.

Every import counts, also one inside a function or under TYPE_CHECKING: an import
deferred to break a cycle still ties the two files together."""

from import_graph import import_graph, package_files


def cycle_graph() -> dict[str, set[str]]:
    """module -> the modules it imports, less a package's __init__ re-exporting its own
    modules: that is no cycle of files."""
    files = package_files()
    return {
        source: {t for t in targets if not t.startswith(source + ".")}
        if files[source].name == "__init__.py"
        else targets
        for source, targets in import_graph().items()
    }


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
    graph = cycle_graph()
    assert len(graph) > 50, "the walk found too few modules to mean anything"
    cycles = [c for m in sorted(graph) if (c := cycle_through(graph, m))]
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_cycle_check_finds_a_cycle():
    graph = cycle_graph()
    assert "replica.scheduler" in graph["replica.engine"]  # it reads real imports
    graph["replica.scheduler"] = graph["replica.scheduler"] | {"replica.engine"}
    cycle = cycle_through(graph, "replica.engine")
    assert cycle is not None and cycle[0] == cycle[-1] == "replica.engine"
    assert cycle[-2:] == ["replica.scheduler", "replica.engine"]
