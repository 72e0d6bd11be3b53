"""The README's code runs as written (its python blocks, in order, in one namespace)."""

from __future__ import annotations

import re
from pathlib import Path

import pargrad

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_examples_run() -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)
    assert len(blocks) >= 3
    previous = pargrad.get_default_engine()
    namespace: dict[str, object] = {}
    try:
        for block in blocks:
            exec(compile(block, str(README), "exec"), namespace)
    finally:
        pargrad.set_default_engine(previous)
    x = namespace["x"]
    assert isinstance(x, pargrad.Tensor)
    assert x.grad is not None and x.grad.data.tolist() == [6.0, 0.0]


def test_readme_commands_are_the_ci_commands() -> None:
    text = README.read_text()
    ci = (README.parent / ".ci" / "run").read_text()
    assert "pip install -e '.[bench]' && python -m benchmarks --quick" in text
    assert "python -m pargrad.demo" in text
    assert "pip install -e '.[test]' && pytest" in text
    assert "pip install -e '.[test]' && pytest" in ci
