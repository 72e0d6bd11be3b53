"""The documents speak to users: README.md, CHANGELOG.md, docs/*.md and examples/ state
what pargrad does now, not how it got there. So they contain no commit ids, no rounds of
work ("the ninth pass"), no references to the project's issues ("issue 14", "#12"), and
no session history ("this session").

A commit id is 7 to 40 lowercase hex characters with at least one letter and one digit,
as a whole word: numbers, plain words (``deadbeef``, ``facade``), hex colours (``#1f77b4``),
``0x`` literals and 64-character sha256 digests do not match. A document that must show
a revision writes ``REV`` or ``HEAD``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = sorted([ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").glob("*.md"),
                    *(ROOT / "examples").glob("*.py")])

ORDINALS = ("first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|"
            "twelfth|[0-9]+(?:st|nd|rd|th)")
RULES: dict[str, re.Pattern[str]] = {
    "a commit id": re.compile(
        r"(?<![\w#./-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![\w-])"),
    "a round of work": re.compile(rf"\b(?:{ORDINALS})[ -]pass(?:es)?\b", re.IGNORECASE),
    "an issue reference": re.compile(
        r"\b(?:issues?|PR|pull request)[ -]?#?[0-9]+\b|(?<![\w&/#])#[0-9]+\b", re.IGNORECASE),
    "session history": re.compile(r"\bthis session\b", re.IGNORECASE),
}


def findings(text: str) -> list[str]:
    """``line N: what, "the text"`` for each match of a rule in ``text``."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for what, rule in RULES.items():
            found += [f"line {number}: {what}, {m.group(0)!r}" for m in rule.finditer(line)]
    return found


def test_the_rules_catch_history_and_pass_the_rest() -> None:
    caught = ["the full run of 45c0499", "fails on 590e79e (checked)", "(compare b359260)",
              "`--compare 9c69d633c7b1907d3d807ce489ad91167927b779`",
              "the ninth pass's two full runs", "Hot path, seventh pass", "the 3rd pass",
              "issue 14", "every #12 target", "(issue #13)", "Issues 12 and 13",
              "in this session"]
    for text in caught:
        assert findings(text), f"no rule catches {text!r}"
    passed = ["colour #1f77b4", "0x7fffffff", "1e6 elements, 4096 rows, 2026-12-05",
              "a deadbeef or a facade", "sha256 " + "ab12" * 16, "§10, bpo-29988",
              "[docs](docs/autograd.md#next-to-torchautograd)", "one pass over the graph",
              "a `passes` counter", "C#1 and x#2", "2.7 MB for 3 ranks"]
    for text in passed:
        assert not findings(text), f"{text!r} is flagged: {findings(text)}"


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_documents_state_the_present(path: Path) -> None:
    if not path.exists():
        pytest.skip(f"{path.name} does not exist")
    found = findings(path.read_text())
    assert not found, (
        f"{path.relative_to(ROOT)} tells history: state the current fact instead (a "
        f"measured figure: what was measured, on what machine, without the commit):\n  "
        + "\n  ".join(found))
