"""docs/autograd.md: the python examples of each section run as written."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

import pytest

GUIDE = Path(__file__).resolve().parent.parent / "docs" / "autograd.md"


def section(title: str) -> str:
    text = GUIDE.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


@pytest.mark.parametrize("title", ["`pargrad.grad`", "Higher-order gradients and `gradgradcheck`",
                                   "Hooks", "In-place operations and version counters",
                                   "Custom `Function` extras", "Anomaly mode", "Checkpointing",
                                   "Seeing the graph"])
def test_section_examples_run(title: str) -> None:
    blocks = re.findall(r"```python\n(.*?)```", section(title), flags=re.DOTALL)
    assert blocks, f"no example in {title}"
    namespace: dict[str, object] = {}
    for block in blocks:
        exec(compile(block, f"{GUIDE}: {title}", "exec"), namespace)


def test_anomaly_output_is_what_the_guide_shows(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    text = section("Anomaly mode")
    (block,) = re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)
    shown = re.search(r"prints\n\n```\n(.*?)```", text, flags=re.DOTALL)
    assert shown is not None
    script = tmp_path / "example.py"
    script.write_text(block)
    runpy.run_path(str(script))
    printed = capsys.readouterr().out.replace(str(script), "example.py").splitlines()
    expected = shown.group(1).splitlines()
    # The message (the engine hint only on the threaded engine), the note's first line,
    # then the frames of example.py (runpy's and pytest's frames come before them here).
    hint = "; set PARGRAD_ENGINE"
    assert printed[0].split(hint)[0] == expected[0].split(hint)[0]
    assert printed[1] == expected[1]
    assert printed[-4:] == expected[-4:]


def test_no_section_is_left_to_be_written() -> None:
    assert "(to be written)" not in GUIDE.read_text()


def test_the_torch_table_names_only_what_pargrad_has() -> None:
    """Every pargrad name in the second column of the torch table exists."""
    import pargrad

    table = section("Next to `torch.autograd`")
    found = 0
    for row in table.splitlines():
        cells = row.split("|")
        for name in re.findall(r"`pargrad\.([\w.]+)", cells[2] if len(cells) > 2 else ""):
            target: object = pargrad
            for part in name.split("."):
                target = getattr(target, part)
            found += 1
    assert found >= 7
