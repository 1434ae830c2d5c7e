"""Dependencies point one way, as docs/architecture.md's table "The folders, and what
each may import" says: wire/ and kvcache/ import nothing of kvserve's above them, a
replica never reaches into the router, and the router reaches into a replica only for
the few torch-free helpers the table names.

The rules are read from that table itself, so the page and the check cannot drift apart:
its "may import" cell names folders (`wire/`) and single modules (`replica/versions.py`)
in backticks, or says "everything" or "anything". A file may also import its own folder;
the most specific folder is a module's own (replica/server/ rather than replica/), so
replica/ importing replica/server/ goes upward too. Every import of every file counts
(import_graph.py)."""

import re

import pytest
from import_graph import PACKAGES, ROOT, import_graph, package_files

PAGE = ROOT / "docs" / "architecture.md"
TABLE = "## The folders, and what each may import"
ANY = None  # the rule of a folder that may import everything


def module_of(name: str) -> str:
    """`replica/server/` -> replica.server, `replica/versions.py` -> replica.versions."""
    return name.removesuffix("/").removesuffix(".py").replace("/", ".")


def parse_rules(page: str) -> dict[str, frozenset[str] | None]:
    """folder -> the folders and modules it may import (ANY: everything), as module
    names, from the page's table. Refuses a name in a rule that is neither a folder nor a
    .py file of the repository: a renamed module must be renamed on the page too."""
    if TABLE not in page:
        raise ValueError(f"no section {TABLE!r}")
    section = page.split(TABLE, 1)[1].split("\n## ", 1)[0]
    rules = {}
    for row in (line for line in section.splitlines() if line.startswith("| `")):
        cells = [cell.strip() for cell in row.strip().strip("|").split("|")]
        if len(cells) != 3 or not re.fullmatch(r"`[\w/]+/`", cells[0]):
            raise ValueError(f"a row that is not (`folder/`, owns, may import): {row}")
        folder, _, may_import = cells
        if re.match(r"(everything|anything)\b", may_import):
            rules[module_of(folder.strip("`"))] = ANY
            continue
        names = re.findall(r"`([^`]+)`", may_import)
        for name in names:
            path = ROOT / name
            if not ((name.endswith("/") and path.is_dir()) or (name.endswith(".py") and path.is_file())):
                raise ValueError(f"the rule for {folder} names `{name}`, which is no folder/ or .py file")
        rules[module_of(folder.strip("`"))] = frozenset(module_of(name) for name in names)
    return rules


def folder_of(module: str, rules: dict) -> str | None:
    """The most specific folder of the table that holds the module."""
    holding = [f for f in rules if module == f or module.startswith(f + ".")]
    return max(holding, key=len, default=None)


def upward_imports(graph: dict[str, set[str]], rules: dict) -> list[str]:
    """Each import the rules do not allow, naming the file, the import and the rule."""
    files = package_files()
    found = []
    for source in sorted(graph):
        folder = folder_of(source, rules)
        if folder is None:
            found.append(f"{files[source].relative_to(ROOT)} is under no folder of the table")
            continue
        allowed = rules[folder]
        for target in sorted(graph[source]):
            if (
                allowed is ANY
                or folder_of(target, rules) == folder
                or any(target == a or target.startswith(a + ".") for a in allowed)
            ):
                continue
            path, where = files[source].relative_to(ROOT), folder.replace(".", "/") + "/"
            rule = ", ".join([f"{where} itself", *sorted(allowed)])
            found.append(f"{path} imports {target}, but the table lets {where} import only {rule}")
    return found


@pytest.fixture(scope="module")
def rules():
    return parse_rules(PAGE.read_text())


def test_every_file_of_the_packages_falls_under_a_row_of_the_table(rules):
    """A file outside every row would have no rule, and no import of it would be checked."""
    assert set(PACKAGES) <= set(rules)
    homeless = [m for m in package_files() if folder_of(m, rules) is None]
    assert not homeless, f"files under no folder of {PAGE.name}'s table: {homeless}"


def test_every_import_goes_the_way_the_page_allows(rules):
    graph = import_graph()
    assert len(graph) > 50, "the walk found too few modules to mean anything"
    upward = upward_imports(graph, rules)
    assert not upward, f"imports that {PAGE.name}'s table does not allow:\n" + "\n".join(upward)


@pytest.mark.parametrize(
    "source, target, rule",
    [
        ("wire.sampling_params", "replica.engine", "wire/ import only wire/ itself"),
        ("replica.engine", "router.api.http", "replica/ import only replica/ itself, kvcache, wire"),
        (
            "replica.engine",
            "replica.server.deployment",
            "replica/ import only replica/ itself, kvcache, wire",
        ),
        (
            "router.api.http",
            "replica.engine",
            "router/api/ import only router/api/ itself, replica.chat_template",
        ),
        ("router.placement.kv_router", "kvcache.kv_manager", "router/placement/ import only"),
        ("kvserve", "router.api.http", "kvserve/ import only kvserve/ itself, replica, wire"),
    ],
)
def test_the_check_reports_a_planted_upward_import(rules, source, target, rule):
    """One import that the table forbids, added to the real graph, is reported as the only
    new finding, with the file, the import and the rule."""
    graph = import_graph()
    assert source in graph and target in graph and target not in graph[source]
    before = upward_imports(graph, rules)
    graph[source] = graph[source] | {target}
    [found] = [f for f in upward_imports(graph, rules) if f not in before]
    path = package_files()[source].relative_to(ROOT)
    assert found.startswith(f"{path} imports {target}, but the table lets {rule}"), found


PAGE_OF_RULES = """
## The folders, and what each may import

| folder | owns | may import |
| --- | --- | --- |
| `wire/` | contracts | nothing of kvserve's; no `torch` |
| `replica/` | the engine | `wire/`, and `replica/versions.py` |
| `deployments/` | the app | everything, `kvserve/` included |

## Next
"""


def test_the_table_gives_folders_modules_everything_or_nothing():
    """How the page's cells read: a name in backticks that is no folder or .py file is
    refused rather than read as prose, so a typo or a rename fails here."""
    with pytest.raises(ValueError, match="the rule for `wire/` names `torch`"):
        parse_rules(PAGE_OF_RULES)
    rules = parse_rules(PAGE_OF_RULES.replace("no `torch`", "no torch"))
    assert rules == {
        "wire": frozenset(),
        "replica": frozenset({"wire", "replica.versions"}),
        "deployments": ANY,
    }
