"""The README's first command: the demo trains, its loss falls, its gradients check out."""

from __future__ import annotations

import pytest

from pargrad import demo


def test_demo_runs(capsys: pytest.CaptureFixture[str]) -> None:
    assert demo.main() == 0
    out = capsys.readouterr().out
    assert "gradients match finite differences" in out
    assert "loss fell from" in out
