"""The benchmark suite runs (smoke mode: tiny graphs, one repeat), so it never rots.

No timing is asserted: a benchmark is a program whose figures are read, not tested. What
is asserted is that every workload ran every contender, that each contender computed the
reference's gradient (the suite checks that itself and fails otherwise), and that the
report has its ratios and targets. tqdm, matplotlib and the peers are optional here.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


OPTIONAL = ("tqdm", "matplotlib", "torch", "autograd")


def run_suite(tmp_path: Path, *args: str, block: tuple[str, ...] = ()) -> tuple[dict, str]:
    """Run the suite in smoke mode; the packages in ``block`` fail to import there."""
    out = tmp_path / "figures.json"
    blocked = tmp_path / "blocked"
    for name in block:
        (blocked / name).mkdir(parents=True)
        (blocked / name / "__init__.py").write_text(f"raise ImportError('{name} blocked')")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(blocked), str(ROOT)])}
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--smoke", "--json", str(out), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=240, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(out.read_text()), result.stdout


@pytest.mark.timeout(300)
@pytest.mark.parametrize("block", [(), OPTIONAL], ids=["installed", "without-optional"])
def test_smoke_run_of_the_whole_suite(tmp_path: Path, block: tuple[str, ...]) -> None:
    plot = tmp_path / "speedups.png"
    figures, stdout = run_suite(tmp_path, "--plot", str(plot), block=block)
    cores = figures["machine"]["cores"]
    default = f"threaded({figures['machine']['pargrad_default_workers']})"
    names = [w["name"] for w in figures["workloads"]]
    assert names[:5] == ["wide-matmul", "wide-elementwise", "tiny-chain", "fan-in", "mlp-step"]
    assert [n for n in names if n.startswith("random-dag:")]
    for w in figures["workloads"]:
        contenders = w["contenders"]
        assert {"sequential", default, "threaded(1)", "threaded(2)", "threaded(4)",
                f"{default[:-1]}, deterministic)"} <= set(contenders)
        for name, c in contenders.items():
            assert c["backward"]["median_s"] > 0, name
            if c["kind"] != "peer":
                assert c["peak_backward_bytes"] > 0, name
        assert w["nodes"] > 0 and w["description"]
        for peer in ("torch", "hips"):
            assert peer in contenders or peer in w["skipped_peers"]
    wide = figures["workloads"][0]["contenders"]
    assert {"ceiling(1)", f"ceiling({cores})", f"ceiling({cores}, BLAS 1)",
            f"{default[:-1]}, limit_blas)"} <= set(wide)
    assert set(figures["widths"]) == {"wide-matmul", "wide-elementwise"}
    targets = {t["target"].split(":")[0] for t in figures["targets"]}
    assert {"wide-matmul", "tiny-chain", "fan-in", "mlp-step"} <= targets
    assert figures["machine"]["cores"] >= 1 and figures["machine"]["blas"] is not None
    overlap = figures["overlap"]  # the async training step against the sync one
    assert overlap["sync / async"] > 0 and overlap["async_step"]["median_s"] > 0
    assert set(overlap["leaves_ready_ms"]) == {"W1", "b1", "W2", "b2", "W3", "b3"}
    assert "sync / async" in stdout
    assert "targets (ratios of medians in this run)" in stdout
    has_matplotlib = importlib.util.find_spec("matplotlib") is not None
    assert plot.exists() == (has_matplotlib and not block)
    if block:
        assert "no plot: needs matplotlib" in stdout
        assert "skipped torch: not installed" in stdout
        assert "skipped hips: not installed" in stdout


def test_only_selects_workloads(tmp_path: Path) -> None:
    figures, stdout = run_suite(tmp_path, "--only", "tiny-chain,random-dag", "--no-peers",
                                "--workers", "3")
    names = [w["name"] for w in figures["workloads"]]
    assert names[0] == "tiny-chain" and all(n.startswith("random-dag:") for n in names[1:])
    assert figures["widths"] == {} and "overlap" not in figures
    chain = figures["workloads"][0]
    d = figures["machine"]["pargrad_default_workers"]
    assert set(chain["contenders"]) == {"sequential", f"threaded({d})", "threaded(3)",
                                        f"threaded({d}, deterministic)"}
    assert chain["skipped_peers"] == {"torch": "--no-peers", "hips": "--no-peers"}
    assert "skipped torch: --no-peers" in stdout
