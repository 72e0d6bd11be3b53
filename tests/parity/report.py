"""Run the parity suite and summarise it per behaviour area and engine.

    python -m tests.parity.report            # print the summary
    python -m tests.parity.report --write    # also refresh docs/autograd.md's last column

An area is a file ``test_parity_<area>.py``. In the table "Next to torch.autograd" of
docs/autograd.md, a cell that starts with ``parity suite `<area>```` is replaced by that
area's result: tests passed out of tests run, for each engine of ``conftest.ENGINES``
in order (a test that applies to some engines only is skipped on the others, and not
counted), and how many of them check a deliberate difference (tests marked ``differs``,
whose reasons the same row gives). The exit status is 1 when any test
failed or errored, so a stale table cannot be written from a red run.
"""

from __future__ import annotations

import re
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest

from tests.parity.conftest import ENGINES

SUITE = Path(__file__).resolve().parent
GUIDE = SUITE.parent.parent / "docs" / "autograd.md"
AREA = re.compile(r"test_parity_(?P<area>\w+)\.py::")
CELL = re.compile(r"parity suite `(?P<area>\w+)`[^|]*")


class Tally:
    """A pytest plugin counting outcomes by (area, engine), and ``differs`` tests."""

    def __init__(self) -> None:
        self.outcomes: dict[tuple[str, str], Counter[str]] = defaultdict(Counter)
        self.differs: dict[tuple[str, str], int] = defaultdict(int)
        self.engine_of: dict[str, str] = {}  # test id -> the engine it runs on

    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        for item in items:
            params = getattr(item, "callspec", None)
            if params is not None and "engine" in params.params:
                self.engine_of[item.nodeid] = params.params["engine"]

    def pytest_runtest_logreport(self, report: Any) -> None:
        # One count per test: its call, or the setup that kept it from being called.
        if not (report.when == "call" or (report.when == "setup" and not report.passed)):
            return
        found = AREA.search(report.nodeid)
        if found is None or report.nodeid not in self.engine_of:
            return
        key = (found["area"], self.engine_of[report.nodeid])
        self.outcomes[key][report.outcome] += 1
        if "differs" in report.keywords and report.outcome != "skipped":
            self.differs[key] += 1


def run() -> Tally:
    tally = Tally()
    status = pytest.main(["-q", "-p", "no:cacheprovider", str(SUITE)], plugins=[tally])
    if status not in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED):
        raise SystemExit(f"the parity suite did not run (pytest exit status {int(status)})")
    return tally


def ran(tally: Tally, area: str, engine: str) -> str:
    """``passed/run`` of one area on one engine (skipped tests did not run)."""
    got = tally.outcomes[area, engine]
    return f"{got['passed']}/{sum(got.values()) - got['skipped']}"


def summary(tally: Tally, area: str) -> str:
    """``passed/run`` per engine, and the deliberate differences among them."""
    results = " · ".join(ran(tally, area, e) for e in ENGINES)
    differs = [tally.differs[area, e] for e in ENGINES]
    note = f"; of them, deliberate differences {' · '.join(map(str, differs))}"
    return f"parity suite `{area}`: {results}{note if any(differs) else ''} "


def main(argv: list[str]) -> int:
    tally = run()
    areas = sorted({area for area, _ in tally.outcomes})
    print(f"\n{'area':<14}" + "".join(f"{e:>20}" for e in ENGINES) + f"{'differs':>10}")
    for area in areas:
        cells = [ran(tally, area, e) for e in ENGINES]
        print(f"{area:<14}" + "".join(f"{c:>20}" for c in cells)
              + f"{'/'.join(str(tally.differs[area, e]) for e in ENGINES):>10}")
    bad = sum(c["failed"] + c["error"] for c in tally.outcomes.values())
    if "--write" in argv:
        if bad:
            print("not writing docs/autograd.md: the suite has failures", file=sys.stderr)
        else:
            GUIDE.write_text(CELL.sub(lambda m: summary(tally, m["area"]), GUIDE.read_text()))
            print(f"wrote {GUIDE.relative_to(SUITE.parent.parent)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
