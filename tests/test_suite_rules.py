"""Rules the test files themselves keep, checked on their source.

No sleep in place of a state: a test that sleeps and then asserts on what other
processes or threads did is betting that the sleep was long enough, and on a busy
machine it loses. It waits for the state instead (conftest.wait_for, wait_for_async),
bounded, and asserts after. The rule, as checked here: after a call of time.sleep or
asyncio.sleep, no `assert` may come before some call whose name starts with "wait"
(wait_for, asyncio.wait, Event.wait, Popen.wait, ...). What comes after a sleep is the
rest of its block and, past the end of a with, if or try that holds it, what follows
that; the end of a loop's body is followed by the loop's next turn. So a poll loop's
interval passes, and so does a sleep that paces load with no assertion after it. What
the rule cannot see: an assertion inside a helper called after the sleep (say
pytest.raises, or a function that asserts), or after the loop whose body sleeps."""

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
BLOCKS = ("body", "orelse", "finalbody")
SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)


def _call_name(call: ast.Call) -> str:
    func = call.func
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else ""


def _is_sleep(call: ast.Call) -> bool:
    """time.sleep(...), asyncio.sleep(...), or a bare sleep(...) imported from either."""
    func = call.func
    if isinstance(func, ast.Attribute):
        return (
            func.attr == "sleep" and isinstance(func.value, ast.Name) and func.value.id in ("time", "asyncio")
        )
    return isinstance(func, ast.Name) and func.id == "sleep"


def _own_nodes(node: ast.AST):
    """The node and everything under it, but not what a nested function, lambda or class
    holds: that runs later, or never."""
    yield node
    for child in ast.iter_child_nodes(node):
        if not isinstance(child, SCOPES):
            yield from _own_nodes(child)


def _first_wait_or_assert(statement: ast.stmt) -> str | None:
    """'wait' or 'assert', whichever happens first in the statement; None if neither. An
    assert happens where it ends, after its test (which may itself wait); a call where it
    starts. A nested function's or class's body does not happen here."""
    if isinstance(statement, SCOPES):
        return None
    found = []
    for node in _own_nodes(statement):
        if isinstance(node, ast.Assert):
            found.append((node.end_lineno, node.end_col_offset, "assert"))
        elif isinstance(node, ast.Call) and _call_name(node).startswith("wait"):
            found.append((node.lineno, node.col_offset, "wait"))
    return min(found)[2] if found else None


def _sleeps(statement: ast.stmt) -> bool:
    """A simple statement that calls a sleep (a compound one's blocks are scanned apart)."""
    simple = isinstance(statement, (ast.Expr, ast.Assign, ast.AnnAssign))
    return simple and any(isinstance(n, ast.Call) and _is_sleep(n) for n in _own_nodes(statement))


def _scan(block: list[ast.stmt], after: list[ast.stmt], lines: list[int]) -> None:
    """after: what runs once the block ends. Past the end of a with, if or try's block
    come the statements after it; a loop's body goes round again, and a function's or
    class's body returns, so nothing comes after theirs."""
    for i, statement in enumerate(block):
        following = block[i + 1 :] + after
        if _sleeps(statement):
            for later in following:
                first = _first_wait_or_assert(later)
                if first == "assert":
                    lines.append(statement.lineno)
                if first is not None:
                    break
        if isinstance(statement, (ast.For, ast.AsyncFor, ast.While)):
            _scan(statement.body, [], lines)
            _scan(statement.orelse, following, lines)
        elif isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            _scan(statement.body, [], lines)
        else:
            nested = [getattr(statement, name, []) for name in BLOCKS]
            nested += [handler.body for handler in getattr(statement, "handlers", [])]
            nested += [case.body for case in getattr(statement, "cases", [])]
            for inner in nested:
                _scan(inner, following, lines)


def sleeps_before_asserts(source: str) -> list[int]:
    """Lines of the sleeps that an assert follows before any wait."""
    lines: list[int] = []
    _scan(ast.parse(source).body, [], lines)
    return sorted(lines)


@pytest.mark.parametrize(
    "source, flagged",
    [
        ("time.sleep(1)\nassert done()", [1]),
        ("async def f():\n    await asyncio.sleep(0.2)\n    x = g()\n    assert x == 3", [2]),
        ("with a:\n    sleep(1)\n    n = count()\n    if n:\n        assert n == 4", [2]),
        ("asyncio.run(asyncio.sleep(0.1))\nwith b:\n    assert b.ok", [1]),
        # A poll loop: the sleep ends its block.
        ("while not ready():\n    assert time.monotonic() < deadline\n    time.sleep(0.1)", []),
        ("for _ in range(9):\n    if ready():\n        break\n    time.sleep(0.1)\nassert ready()", []),
        # A wait for the state comes first.
        ("time.sleep(1)\nwait_for(ready)\nassert count() == 4", []),
        ("await asyncio.sleep(x)\ntask.cancel()\ndone, _ = await asyncio.wait({task})\nassert done", []),
        ("time.sleep(1)\nassert wait_for(ready) is None", []),
        # Pacing, with nothing asserted after it in its block.
        ("async def post(at):\n    await asyncio.sleep(at)\n    return await client.post(url)", []),
        # A sleep inside a function defined after it does not run there.
        ("time.sleep(1)\ndef later():\n    assert x", []),
        # Past the end of a with, if or try: what follows it runs next.
        ("with lock:\n    time.sleep(1)\nassert state()", [2]),
        ("try:\n    if c:\n        time.sleep(1)\nfinally:\n    n = 1\nassert n", [3]),
        ("with lock:\n    time.sleep(1)\nwait_for(state)\nassert state()", []),
        # A loop's next turn follows the end of its body, not what comes after the loop.
        ("while busy():\n    time.sleep(1)\nassert idle()", []),
    ],
)
def test_the_rule_flags_a_sleep_only_where_an_assert_follows_it_before_a_wait(source, flagged):
    assert sleeps_before_asserts(source) == flagged


def test_no_test_sleeps_in_place_of_a_state():
    found = {
        path.name: lines
        for path in sorted(TESTS.glob("*.py"))
        if (lines := sleeps_before_asserts(path.read_text()))
    }
    assert not found, f"sleeps followed by an assert before any wait, by file and line: {found}"
