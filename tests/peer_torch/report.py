"""Run the peer suite (tests/peer_torch) and report its result per area and engine.

    python -m tests.peer_torch.report            # print the results
    python -m tests.peer_torch.report --write    # also fill docs/autograd.md's column

Each area is one test file; each row of the table "Next to torch.autograd" in
docs/autograd.md that has a peer-suite cell names its file in a comment-free form
(``hooks``, ``function``...): the cell between the row's last two ``|`` is rewritten as
``passed/total`` per engine configuration (sequential · threaded · threaded-handoff1),
with the expected failures (``xfail``, each a deliberate difference listed in that row;
a non-strict one counts as such whether or not it happened to pass in this run).
Exits non-zero if any test failed outright.
"""

from __future__ import annotations

import re
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
GUIDE = HERE.parent.parent / "docs" / "autograd.md"
ENGINES = ("sequential", "threaded", "threaded-handoff1")
CELL = re.compile(r"peer suite `(?P<area>\w+)`[^|]*")


class _Collect:
    """A pytest plugin that records each test's outcome by (area, engine)."""

    def __init__(self) -> None:
        self.outcomes: dict[tuple[str, str], dict[str, int]] = defaultdict(
            lambda: defaultdict(int))

    def pytest_runtest_logreport(self, report: Any) -> None:
        if report.when != "call" and not (report.when == "setup" and not report.passed):
            return
        match = re.search(r"test_torch_(\w+)\.py::.*\[(.+)\]$", report.nodeid)
        if match is None:
            return
        area, engine = match.groups()
        if hasattr(report, "wasxfail"):
            outcome = "xfailed" if report.skipped else "xpassed"
        else:
            outcome = report.outcome
        self.outcomes[(area, engine)][outcome] += 1


def run() -> dict[tuple[str, str], dict[str, int]]:
    collect = _Collect()
    code = pytest.main(["-q", "-p", "no:cacheprovider", str(HERE)], plugins=[collect])
    if code not in (0, 1):
        raise SystemExit(f"pytest could not run the peer suite (exit code {code})")
    return collect.outcomes


def cell(area: str, outcomes: dict[tuple[str, str], dict[str, int]]) -> str:
    parts, xfails = [], []
    for engine in ENGINES:
        got = outcomes.get((area, engine), {})
        parts.append(f"{got.get('passed', 0)}/{sum(got.values())}")
        xfails.append(str(got.get("xfailed", 0) + got.get("xpassed", 0)))  # (non-strict too)
    note = f"; xfail (deliberate) {' · '.join(xfails)}" if set(xfails) != {"0"} else ""
    return f"peer suite `{area}`: {' · '.join(parts)}{note} "


def main(argv: list[str]) -> int:
    outcomes = run()
    areas = sorted({area for area, _ in outcomes})
    print(f"\n{'area':<16}" + "".join(f"{e:>20}" for e in ENGINES))
    failed = 0
    for area in areas:
        row = []
        for engine in ENGINES:
            got = outcomes.get((area, engine), {})
            failed += got.get("failed", 0)
            row.append(f"{got.get('passed', 0)}/{sum(got.values())}"
                       f" ({got.get('xfailed', 0) + got.get('xpassed', 0)} xfail)")
        print(f"{area:<16}" + "".join(f"{r:>20}" for r in row))
    for engine in ENGINES:
        got = [outcomes.get((a, engine), {}) for a in areas]
        passed = sum(g.get("passed", 0) for g in got)
        total = sum(sum(g.values()) for g in got)
        print(f"{engine}: {passed}/{total} passed ({100 * passed / total:.1f}%)")
    if "--write" in argv:
        text = GUIDE.read_text()
        new = CELL.sub(lambda m: cell(m.group("area"), outcomes), text)
        GUIDE.write_text(new)
        print(f"wrote {GUIDE}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
