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
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings

from tests.strategies import graph_recipes

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
    listed = [t["target"] for t in figures["targets"]]  # those of issue #12 too
    deterministic = f"{default[:-1]}, deterministic)"
    for wanted in (f"tiny-chain: {default} / fastest torch, forward+backward per op",
                   f"tiny-chain: {default} / hips, forward+backward per op",
                   f"tiny-chain: {default} / fastest torch, backward per node",
                   f"random-dag:12: {default} / fastest torch, backward per node",
                   f"fan-in: {deterministic} / sequential",
                   "wide-matmul: slowest threaded speed-up",
                   "wide-elementwise sweep: worst threaded(2) speed-up / ceiling speed-up"):
        assert any(t.startswith(wanted) for t in listed), (wanted, listed)
    assert [t["limit"] for t in figures["targets"]
            if t["target"].startswith("random-dag:12: slowest threaded")] == [1.03]
    assert list(figures["sweep"]) == ["2x2x1000", "3x1x2000"]
    assert "wide-elementwise sweep (branches x depth x elements)" in stdout
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


def test_random_dags_run_pytorch_op_for_op(tmp_path: Path) -> None:
    if importlib.util.find_spec("torch") is None:
        pytest.skip("PyTorch is not installed (pip install -e '.[peers]')")
    figures, _ = run_suite(tmp_path, "--only", "random-dag,fan-in")
    fan_in, dag = figures["workloads"]
    if figures["machine"]["cores"] > 1:
        assert "torch(1)" in dag["contenders"] and "torch(1)" not in fan_in["contenders"]
    torch = dag["contenders"]["torch"]  # its gradient was checked against sequential's
    assert torch["kind"] == "peer" and torch["backward"]["median_s"] > 0
    assert "torch" not in dag["skipped_peers"] and "hips" in dag["skipped_peers"]
    assert f"threaded({figures['machine']['pargrad_default_workers']}) backward us per node" \
        in figures["ratios"][dag["name"]]
    assert "torch backward us per node" in figures["ratios"][dag["name"]]


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


def _git_checkout() -> bool:
    if shutil.which("git") is None:
        return False
    return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", "HEAD"],
                          capture_output=True).returncode == 0


@pytest.mark.timeout(300)
def test_compare_runs_this_tree_against_a_revision(tmp_path: Path) -> None:
    if not _git_checkout():
        pytest.skip("needs git and this repository's history (git rev-parse HEAD failed)")
    figures, stdout = run_suite(tmp_path, "--compare", "HEAD", "--only", "tiny-chain",
                                "--no-peers")
    pargrad_of = figures["compare"]["pargrad"]
    assert Path(pargrad_of["current"]) == ROOT / "pargrad" / "__init__.py"
    rev_tree = Path(pargrad_of["rev"]).parent.parent
    assert rev_tree != ROOT and not rev_tree.exists()  # extracted, then removed
    assert figures["compare"]["rounds"] == 2
    rows = {row["contender"]: row for row in figures["rows"]}
    assert set(rows) == set(figures["sides"]["current"][0]["contenders"])
    sequential = rows["sequential"]
    assert sequential["nodes"] == {"rev": 51, "current": 51}
    for part in ("forward", "backward"):
        assert sequential[part]["rev / current"] == pytest.approx(
            sequential[part]["rev_s"] / sequential[part]["current_s"])
    assert figures["sides"]["rev"][0]["repeats"] == 2  # one per round, pooled
    assert "before/after: medians in ms on HEAD (rev)" in stdout
    assert "tiny-chain per op" in stdout
    memory = [t for t in figures["targets"]
              if t["target"] == "tiny-chain: sequential peak memory, this tree / REV"]
    assert len(memory) == 1 and memory[0]["value"] == pytest.approx(
        sequential["peak_backward_bytes"]["current"] / sequential["peak_backward_bytes"]["rev"])


def test_compare_with_an_unknown_revision_says_so() -> None:
    if not _git_checkout():
        pytest.skip("needs git and this repository's history (git rev-parse HEAD failed)")
    result = subprocess.run([sys.executable, "-m", "benchmarks", "--smoke", "--compare",
                             "no-such-revision"], cwd=ROOT, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2
    assert "'no-such-revision' is not a commit of a git repository" in result.stderr


@settings(max_examples=30, deadline=None)
@given(recipe=graph_recipes())
def test_torch_translation_of_random_dags_is_op_for_op(recipe: object) -> None:
    """PyTorch's build of a recipe records as many nodes as pargrad's and computes the
    same gradients (the suite's random-dag workloads rely on both)."""
    torch = pytest.importorskip("torch")
    import pargrad
    from benchmarks import torch_recipes
    from benchmarks.workloads import count_nodes
    leaves = [pargrad.tensor(a, requires_grad=flag)
              for a, flag in zip(recipe.leaves, recipe.requires_grad)]
    roots = recipe.build(leaves)
    grads = [pargrad.tensor(g) for g in recipe.root_grads]
    keep = [k for k, r in enumerate(roots) if r.requires_grad]
    torch_leaves = [torch.from_numpy(np.asarray(a)).requires_grad_(flag)
                    for a, flag in zip(recipe.leaves, recipe.requires_grad)]
    torch_roots = torch_recipes.build(torch, recipe, torch_leaves)
    assert [r.requires_grad for r in torch_roots] == [r.requires_grad for r in roots]
    if not keep:
        return
    assert count_nodes([roots[k] for k in keep]) == torch_recipes.count_nodes(
        torch, [torch_roots[k] for k in keep])
    pargrad.backward([roots[k] for k in keep], [grads[k] for k in keep])
    torch.autograd.backward([torch_roots[k] for k in keep],
                            [torch.from_numpy(recipe.root_grads[k]) for k in keep])
    for mine, theirs in zip(leaves, torch_leaves):
        assert (mine.grad is None) == (theirs.grad is None)
        if mine.grad is not None:
            np.testing.assert_allclose(mine.grad.numpy(), theirs.grad.numpy(),
                                       rtol=1e-10, atol=1e-12)
