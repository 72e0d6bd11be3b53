"""The docs' benchmark figures are those of the saved run, docs/benchmarks/run.json: the
blocks between ``<!-- generated: NAME -->`` and ``<!-- end generated -->`` in README.md and
docs/performance.md are exactly what ``python -m benchmarks.tables`` makes from it, so the
docs never drift from what was measured. (That the generator works on any run the suite
saves is checked on the smoke run, in tests/test_benchmarks.py.)"""

from __future__ import annotations

import difflib
import re
from pathlib import Path

import pytest

from benchmarks import tables

ROOT = Path(__file__).resolve().parent.parent
RUN = ROOT / "docs" / "benchmarks" / "run.json"


@pytest.mark.parametrize("doc", tables.DOCUMENTS)
def test_the_docs_show_the_saved_run(doc: str) -> None:
    text = (ROOT / doc).read_text()
    assert tables.MARKER.findall(text), f"{doc} has no generated block"
    made = tables.rewrite(text, tables.load(RUN))
    diff = "\n".join(difflib.unified_diff(text.splitlines(), made.splitlines(), doc,
                                          "regenerated", lineterm="", n=1))
    assert made == text, (f"{doc}'s tables are not those of {RUN.relative_to(ROOT)}: run "
                          f"python -m benchmarks.tables\n{diff}")


def test_the_check_passes_on_the_committed_docs(capsys: pytest.CaptureFixture[str]) -> None:
    assert tables.main(["--check"]) == 0
    assert "the tables match docs/benchmarks/run.json" in capsys.readouterr().out


def test_every_block_says_where_when_and_how_to_regenerate_it() -> None:
    run = tables.load(RUN)
    m = run.machine
    for name in tables.BLOCKS:
        said = " ".join(tables.render(name, run).split())
        for fact in (f"Measured on {m['cpu']}, {run.cores} cores",
                     "SIMD: " + " ".join(m["simd"]["baseline"]), *m["simd"]["found"],
                     m["python"], f"numpy {m['numpy']}", f"PyTorch {m['torch']['version']}",
                     f"full run of {run.figures['date']}",
                     "Regenerate: `python -m benchmarks.tables docs/benchmarks/run.json`."):
            assert fact in said, (name, fact)


def test_a_block_is_rewritten_and_nothing_else() -> None:
    run = tables.load(RUN)
    text = ("before\n<!-- generated: readme -->\nstale\n<!-- end generated -->\n"
            "after `<!-- generated: x -->`\n")
    made = tables.rewrite(text, run)
    assert made.startswith("before\n<!-- generated: readme -->\n| workload |")
    assert made.endswith("`.\n<!-- end generated -->\nafter `<!-- generated: x -->`\n")
    assert "stale" not in made and tables.rewrite(made, run) == made


def test_a_bad_block_is_an_error_that_says_what_is_wrong() -> None:
    run = tables.load(RUN)
    with pytest.raises(ValueError, match="unknown generated block 'nope'"):
        tables.rewrite("<!-- generated: nope -->\n<!-- end generated -->\n", run)
    unclosed = "<!-- generated: readme -->\n\n<!-- generated: summary -->\n<!-- end generated -->\n"
    with pytest.raises(ValueError, match="without its '<!-- end generated -->' line"):
        tables.rewrite(unclosed, run)


CITED = re.compile(r'docs/performance\.md, "([^"]+)"')


def test_the_sections_the_code_cites_exist() -> None:
    # benchmarks/report.py prints reasons that send the reader to a section by name.
    headings = set(re.findall(r"^#+ (.+)$", (ROOT / "docs" / "performance.md").read_text(),
                              flags=re.MULTILINE))
    cited = {(path.relative_to(ROOT).as_posix(), name)
             for folder in ("pargrad", "benchmarks")
             for path in sorted((ROOT / folder).rglob("*.py"))
             for name in CITED.findall(path.read_text())}
    assert {name for _, name in cited} >= {"The targets", "Page faults"}
    assert not [c for c in cited if c[1] not in headings], headings
