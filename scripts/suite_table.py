"""tests/README.md's tables from a run's --suite-profile JSON (tests/suite_budget.py):
the suite's time by file and by fixture set-up, and its memory.

    .venv/bin/python -m pytest -q --suite-profile=profile.json tests
    python scripts/suite_table.py profile.json
"""

import json
import sys
from collections import defaultdict
from pathlib import Path


def main(path: str, rows: int = 25) -> None:
    profile = json.loads(Path(path).read_text())
    tests, fixtures = profile["tests"], profile["fixtures"]
    total = sum(t["seconds"] for t in tests)
    by_file: dict[str, list[dict]] = defaultdict(list)
    for t in tests:
        by_file[t["nodeid"].split("::")[0]].append(t)
    setups: dict[str, float] = defaultdict(float)
    for f in fixtures:
        setups[f["nodeid"].split("::")[0]] += f["seconds"]

    print(f"{len(tests)} tests, {total / 60:.1f} min in all.\n")
    print("| file | tests | seconds | of which fixture set-up | peak RSS of pytest after (GB) |")
    print("|---|---:|---:|---:|---:|")
    files = sorted(by_file.items(), key=lambda kv: -sum(t["seconds"] for t in kv[1]))
    for name, ts in files[:rows]:
        seconds = sum(t["seconds"] for t in ts)
        rss = max(t["rss_gb"] for t in ts)
        print(f"| {name} | {len(ts)} | {seconds:.0f} | {setups[name]:.0f} | {rss:.1f} |")
    rest = files[rows:]
    if rest:
        seconds = sum(t["seconds"] for _, ts in rest for t in ts)
        count = sum(len(ts) for _, ts in rest)
        print(f"| {len(rest)} other files | {count} | {seconds:.0f} | | |")

    by_fixture: dict[tuple[str, str], list[float]] = defaultdict(list)
    for f in fixtures:
        by_fixture[f["name"], f["scope"]].append(f["seconds"])
    print("\n| fixture | scope | set-ups | seconds |")
    print("|---|---|---:|---:|")
    ranked = sorted(by_fixture.items(), key=lambda kv: -sum(kv[1]))
    for (name, scope), times in ranked[:rows]:
        print(f"| {name} | {scope} | {len(times)} | {sum(times):.0f} |")
    print(f"\nAll fixture set-ups: {sum(f['seconds'] for f in fixtures):.0f} s of {total:.0f} s.")


if __name__ == "__main__":
    main(sys.argv[1])
