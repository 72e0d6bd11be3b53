"""Every python block of the README and of docs/*.md runs as written, on its own (a block
whose first line is ``# continues the previous block`` runs after the one before it, in
its namespace), and every line it prints is shown next to it: in a comment of the block,
or in the text after it (a "prints" block, or prose quoting the start of the line
followed by "...")."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CONTINUES = "# continues the previous block"
MARK = "----- the block itself -----"


def blocks(path: Path) -> list[tuple[int, str, str]]:
    """(line, code, what follows it up to the next python block) of each python block."""
    text = path.read_text()
    found = list(re.finditer(r"```python\n(.*?)```", text, flags=re.DOTALL))
    out = []
    for i, match in enumerate(found):
        end = found[i + 1].start() if i + 1 < len(found) else len(text)
        out.append((text.count("\n", 0, match.start()) + 1, match.group(1),
                    text[match.end():end]))
    return out


EXAMPLES = [(path, *block) for path in DOCUMENTS for block in blocks(path)]


def test_the_documents_have_examples() -> None:
    names = {path.name for path, *_ in EXAMPLES}
    assert {"README.md", "autograd.md", "async.md", "performance.md"} <= names
    assert len(EXAMPLES) >= 18


def _words(text: str) -> str:
    return " ".join(text.replace("`", "").split())


def _shown(line: str, shown: str) -> bool:
    """``line`` is in ``shown``, or a start of it (40 characters at least) is, followed
    by "..." where the rest was left out."""
    line = _words(line)
    if line in shown:
        return True
    at = shown.find(line[:40])
    if at < 0:
        return False
    k = 40
    while k < len(line) and at + k < len(shown) and shown[at + k] == line[k]:
        k += 1
    return shown[at + k:].lstrip().startswith("...")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("path, line, code, after", EXAMPLES,
                         ids=[f"{p.name}:{line}" for p, line, *_ in EXAMPLES])
def test_block_runs_on_its_own_and_shows_what_it_prints(
        path: Path, line: int, code: str, after: str, tmp_path: Path) -> None:
    """Each block (after the blocks it continues) runs as ``python example.py`` in a
    fresh process and an empty directory."""
    own = [c for p, _, c, _ in EXAMPLES if p == path]
    chain = own[:own.index(code) + 1]
    start = len(chain) - 1
    while chain[start].startswith(CONTINUES):
        assert start > 0, f"{path.name}:{line} continues no block"
        start -= 1
    script = tmp_path / "example.py"
    # What the blocks it continues print is theirs to show: cut at a marker.
    script.write_text("\n".join([*chain[start:-1], f"print({MARK!r})", chain[-1]])
                      if start < len(chain) - 1 else chain[-1])
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=100)
    assert result.returncode == 0, f"{path.name}:{line}\n{result.stderr}"
    shown = _words(code + "\n" + after)
    printed = result.stdout.replace(str(script), "example.py").split(MARK + "\n")[-1]
    for out in printed.splitlines():
        if out.strip():
            assert _shown(out, shown), f"{path.name}:{line} prints {out!r} but does not show it"


def test_continued_blocks_say_so_and_fresh_ones_import_what_they_use() -> None:
    for path, line, code, _ in EXAMPLES:
        if not code.startswith(CONTINUES):
            assert "import pargrad" in code, f"{path.name}:{line}"
