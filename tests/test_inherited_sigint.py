"""The suite does not depend on the SIGINT disposition it inherits.

A background job (``pytest &``) and some CI runners start processes with SIGINT ignored.
pargrad leaves an ignored SIGINT alone (pargrad/interrupts.py), so the tests that check
what a Ctrl-C does are marked ``sigint`` and get Python's default handler for their own
duration (tests/conftest.py). This runs the files that send SIGINT, whole, in a child
started with SIGINT ignored, so that a Ctrl-C test without the mark fails here rather
than only in the background.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from tests.helpers import ROOT

SIGINT_FILES = ["tests/test_interrupts.py", "tests/test_threaded.py",
                "tests/test_reliability.py"]


def _ignore_sigint() -> None:  # runs in the child before exec; SIG_IGN survives exec
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.timeout(300)
def test_ctrl_c_tests_pass_in_a_process_started_with_sigint_ignored() -> None:
    child = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *SIGINT_FILES],
        cwd=ROOT, capture_output=True, text=True, timeout=280, preexec_fn=_ignore_sigint,
        env={**os.environ, "PARGRAD_RACE_BUDGET": "0"})
    summary = child.stdout.strip().splitlines()[-1] if child.stdout.strip() else ""
    assert child.returncode == 0, child.stdout[-4000:] + child.stderr[-2000:]
    assert " passed" in summary and "failed" not in summary, summary


def test_a_process_started_with_sigint_ignored_keeps_it_ignored_through_backward() -> None:
    code = ("import signal, pargrad\n"
            "x = pargrad.tensor([1.0, 2.0], requires_grad=True)\n"
            "(x * x).sum().backward()\n"
            "with pargrad.ThreadedEngine(workers=1, handoff_threshold=1) as e:\n"
            "    (x.sin() * x).sum().backward(engine=e)\n"
            "print(signal.getsignal(signal.SIGINT) is signal.SIG_IGN, x.grad)\n")
    child = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                           text=True, timeout=60, preexec_fn=_ignore_sigint)
    assert child.returncode == 0, child.stderr
    assert child.stdout.startswith("True "), child.stdout
