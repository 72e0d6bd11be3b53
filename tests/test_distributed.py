"""pargrad.distributed: data-parallel steps on 2 and 3 real MPI ranks (mpiexec started
from here, with timeouts), against the single-process gradient of the whole batch; the
failure protocol; the example; and, in this process, the parts that need no MPI.

The MPI jobs live in tests/mpi_jobs/; each runs all of its scenarios in one mpiexec
call (a launch costs about a second on 2 cores), and rank 0 saves what every rank saw.
They need mpi4py and an mpiexec (the ``test`` extra installs mpi4py and mpich); without
them they are skipped, saying so.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import pargrad
from pargrad.distributed import (
    DataParallel,
    DistributedError,
    broadcast_parameters,
    mpiexec_path,
    shard,
)
from tests.helpers import run_python
from tests.mpi_jobs import failing, model
from tests.mpi_jobs.gradients import SCENARIOS

ROOT = Path(__file__).resolve().parent.parent
JOB_TIMEOUT = 60  # seconds for one mpiexec call: a hung job fails, it never hangs pytest


MPIEXEC = mpiexec_path()  # beside python, where mpich's wheel puts it, else on PATH
needs_mpi = pytest.mark.skipif(
    importlib.util.find_spec("mpi4py") is None or MPIEXEC is None,
    reason="needs mpi4py and mpiexec: pip install -e '.[test]' (or '.[distributed]') "
           "installs mpi4py and mpich")


def mpiexec(ranks: int, *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``python -m mpi4py args`` (``-m module ...`` or ``script ...``) on ``ranks``
    ranks (an uncaught error on a rank aborts the job). MPICH's own ``MPIEXEC_TIMEOUT``
    ends a job that runs too long; should that fail too, the whole process group is
    killed here."""
    assert MPIEXEC is not None
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MPIEXEC_TIMEOUT": str(JOB_TIMEOUT),
           "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    command = [MPIEXEC, "-n", str(ranks), sys.executable, "-m", "mpi4py", *args]
    process = subprocess.Popen(command, cwd=ROOT, env=env, text=True, start_new_session=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        stdout, stderr = process.communicate(timeout=JOB_TIMEOUT + 15)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        pytest.fail(f"{' '.join(command)} did not end in {JOB_TIMEOUT + 15} s:\n"
                    f"{stdout}\n{stderr}")
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def run_ok(ranks: int, *args: str) -> str:
    result = mpiexec(ranks, *args)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


# ----- one step on N ranks equals the whole batch in one process -----
@pytest.fixture(scope="module", params=[2, 3], ids=["2-ranks", "3-ranks"])
def gradients(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
              ) -> Iterator[tuple[int, dict[str, np.ndarray | None]]]:
    """Every scenario's gradients, by ``"scenario/rank/parameter"`` (None: no .grad)."""
    ranks = request.param
    out = tmp_path_factory.mktemp("mpi") / "gradients.npz"
    run_ok(ranks, "-m", "tests.mpi_jobs.gradients", str(out))
    with np.load(out) as saved:
        nones = set(saved["none"].tolist())
        yield ranks, {k: None if k in nones else saved[k] for k in saved.files if k != "none"}


def per_rank(saved: dict[str, np.ndarray | None], ranks: int, scenario: str,
             count: int = 6) -> list[list[np.ndarray]]:
    grads = [[saved[f"{scenario}/{r}/{i}"] for i in range(count)] for r in range(ranks)]
    assert all(g is not None for rank in grads for g in rank), scenario
    return grads  # type: ignore[return-value]


@pytest.mark.timeout(JOB_TIMEOUT + 30)
@needs_mpi
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_every_rank_gets_the_whole_batch_gradient(
        gradients: tuple[int, dict[str, np.ndarray | None]], scenario: str) -> None:
    ranks, saved = gradients
    dtype, _, _, steps = SCENARIOS[scenario]
    expected = model.reference(dtype, steps)
    tolerance = 1e-5 if dtype == np.float32 else 1e-12
    grads = per_rank(saved, ranks, scenario)
    for rank in range(ranks):
        for i, (got, want) in enumerate(zip(grads[rank], expected)):
            assert got.dtype == dtype
            np.testing.assert_allclose(got, want, rtol=tolerance, atol=tolerance,
                                       err_msg=f"{scenario}: rank {rank}, parameter {i}")
            np.testing.assert_array_equal(got, grads[0][i],  # bitwise the same everywhere
                                          err_msg=f"{scenario}: rank {rank}, parameter {i}")


@pytest.mark.timeout(JOB_TIMEOUT + 30)
@needs_mpi
@pytest.mark.parametrize("dtype", ["f32", "f64"])
def test_deterministic_mode_is_the_rank_order_sum_bitwise(
        gradients: tuple[int, dict[str, np.ndarray | None]], dtype: str) -> None:
    """Deterministic mode: each rank's gradient of its shard (bitwise the reference's on
    the deterministic engine), summed in rank order, divided by the number of ranks;
    the same bits with and without overlap and for any bucket size."""
    ranks, saved = gradients
    real = np.float32 if dtype == "f32" else np.float64
    params = model.parameters(real)
    x, y = model.batch(real)
    local = []
    for rank in range(ranks):
        mine = shard(len(y), rank, ranks)
        local.append(pargrad.grad(model.loss(params, x[mine], y[mine]), params,
                                  engine=pargrad.SequentialEngine()))
    expected = []
    for i in range(len(params)):
        total = local[0][i].data.copy()
        for rank in range(1, ranks):
            total += local[rank][i].data
        expected.append(total / np.asarray(ranks, real))
    for scenario in (f"{dtype}-deterministic", f"{dtype}-deterministic-no-overlap"):
        for rank, grads in enumerate(per_rank(saved, ranks, scenario)):
            for i, (got, want) in enumerate(zip(grads, expected)):
                np.testing.assert_array_equal(got, want, err_msg=f"{scenario}: rank {rank}, "
                                                                 f"parameter {i}")


@pytest.mark.timeout(JOB_TIMEOUT + 30)
@needs_mpi
def test_unused_parameters(gradients: tuple[int, dict[str, np.ndarray | None]]) -> None:
    """``ghost`` is in no rank's loss: its .grad stays None everywhere. ``extra`` is in
    rank 0's loss only: every rank gets rank 0's gradient over the number of ranks."""
    ranks, saved = gradients
    expected = model.reference(np.float64, 1)
    for rank in range(ranks):
        for i, want in enumerate(expected):
            np.testing.assert_allclose(saved[f"unused/{rank}/{i}"], want, rtol=1e-12)  # type: ignore[arg-type]
        assert saved[f"unused/{rank}/6"] is None
        np.testing.assert_array_equal(saved[f"unused/{rank}/7"], np.full(2, 6.0) / ranks)  # type: ignore[arg-type]


# ----- failures -----
@pytest.mark.timeout(JOB_TIMEOUT + 30)
@needs_mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_a_backward_failing_on_one_rank_raises_on_every_rank(tmp_path: Path,
                                                             ranks: int) -> None:
    out = tmp_path / "seen.json"
    run_ok(ranks, "-m", "tests.mpi_jobs.failing", str(out))
    seen = json.loads(out.read_text())
    assert [s["rank"] for s in seen] == list(range(ranks))
    message = (f"the backward failed on rank(s) [{ranks - 1}] of {ranks}; every rank raises "
               "this and no .grad was written")
    expected = model.reference(np.float64, 1)
    for s in seen:
        assert s["error"] == message
        assert s["cause"] == ("ValueError('boom')" if s["rank"] == ranks - 1 else None)
        assert s["unchanged"], f"rank {s['rank']} changed a .grad"
        for got, want in zip(s["after"], expected):  # the next step works
            np.testing.assert_allclose(got, want, rtol=1e-12)
    assert all(s["after"] == seen[0]["after"] for s in seen)


@pytest.mark.timeout(JOB_TIMEOUT + 30)
@needs_mpi
def test_a_rank_that_never_synchronizes_makes_the_others_abort_not_hang() -> None:
    result = mpiexec(2, "-m", "tests.mpi_jobs.stuck")
    assert result.returncode != 0
    assert "rank 0 waited 1.0 s in synchronize() for the other ranks" in result.stderr
    assert "rank 0 returned" not in result.stdout


# ----- the example -----
@pytest.mark.timeout(JOB_TIMEOUT + 30)
@needs_mpi
def test_the_example_trains_on_two_ranks() -> None:
    stdout = run_ok(2, "examples/data_parallel.py", "--steps", "60")  # as the README
    lines = stdout.splitlines()
    assert lines[0] == ("training a 2-32-32-3 MLP on 300 points over 2 ranks, "
                        "150 points on rank 0")
    losses = [float(line.split()[-1]) for line in lines if line.startswith("step")]
    assert len(losses) == 3 and losses[-1] < 0.6 * losses[0]
    assert lines[-1] == "weights bitwise equal on every rank"


# ----- without MPI: one rank through a Communicator of this process -----
class OneRank:
    """A Communicator of one rank that records the collectives started."""

    rank, size = 0, 1

    def __init__(self) -> None:
        self.started: list[int] = []  # the buffers' sizes, in start order
        self.lock = threading.Lock()

    def start_allreduce(self, buffer: np.ndarray) -> OneRank:
        with self.lock:
            self.started.append(buffer.size)
        return self

    def start_allgather(self, buffer: np.ndarray, out: np.ndarray) -> OneRank:
        out[0] = buffer
        return self.start_allreduce(buffer)

    def broadcast(self, buffer: np.ndarray, root: int) -> None:
        pass

    def abort(self, message: str) -> None:
        raise AssertionError(message)

    def test(self) -> bool:
        return True

    def wait(self) -> None:
        pass


@pytest.mark.parametrize("deterministic", [False, True])
def test_buckets_start_in_order_during_the_backward(engine: pargrad.Engine,
                                                    deterministic: bool) -> None:
    params = model.parameters(np.float64)
    comm = OneRank()
    with DataParallel(params, comm, bucket_bytes=200, deterministic=deterministic) as dp:
        comm.started.clear()  # (the check that every rank has the same parameters)
        dp.backward(model.loss(params, *model.batch(np.float64)))
        stats = dp.statistics()
    assert stats is not None
    # reversed parameters (b3 W3 b2 W2 b1 W1) cut at 200 bytes: [b3 W3], [b2 W2], [b1 W1]
    assert [b.parameters for b in stats.buckets] == [(5, 4), (3, 2), (1, 0)]
    assert comm.started == [27, 72, 40, 7]  # the buckets in index order, then the status
    assert all(b.started < stats.synchronize_called for b in stats.buckets)  # overlapped
    for p, want in zip(params, model.reference(np.float64, 1)):
        np.testing.assert_allclose(p.grad.data, want, rtol=1e-12)  # type: ignore[union-attr]


def test_synchronize_after_backward_async(engine: pargrad.Engine) -> None:
    """The asynchronous form: the step passes the future's exception (None here, then
    a failure) to synchronize."""
    params = model.parameters(np.float64)
    with DataParallel(params, OneRank(), bucket_bytes=1) as dp:
        future = pargrad.backward_async(model.loss(params, *model.batch(np.float64)))
        dp.synchronize(future.exception(timeout=30))
        for p, want in zip(params, model.reference(np.float64, 1)):
            np.testing.assert_allclose(p.grad.data, want, rtol=1e-12)  # type: ignore[union-attr]
        before = [p.grad for p in params]
        future = pargrad.backward_async(
            failing.loss(params, *model.batch(np.float64), True))
        with pytest.raises(DistributedError) as info:
            dp.synchronize(future.exception(timeout=30))
        assert isinstance(info.value.__cause__, pargrad.BackwardError)
        assert all(p.grad is g for p, g in zip(params, before))  # nothing written


def test_without_overlap_buckets_start_in_synchronize() -> None:
    params = model.parameters(np.float64)
    with DataParallel(params, OneRank(), bucket_bytes=1, overlap=False) as dp:
        dp.backward(model.loss(params, *model.batch(np.float64)))
        stats = dp.statistics()
    assert stats is not None and len(stats.buckets) == 6
    assert all(b.started >= stats.synchronize_called for b in stats.buckets)


def test_buckets_follow_the_readiness_order_after_the_first_step() -> None:
    """Given in an order that is not the reverse of the forward's, the buckets are cut
    again after the first step, in the order the gradients became ready (c, b, a)."""
    a, b, c = (pargrad.tensor([v], requires_grad=True) for v in (1.0, 2.0, 3.0))
    with DataParallel([c, a, b], OneRank(), bucket_bytes=1) as dp:
        assert [k.parameters for k in dp._buckets] == [(2,), (1,), (0,)]  # b, a, c
        dp.backward((pargrad.exp(pargrad.exp(a) * b) * c).sum(),
                    engine=pargrad.SequentialEngine())
        assert [k.parameters for k in dp._buckets] == [(0,), (2,), (1,)]  # c, b, a
        dp.backward((pargrad.exp(pargrad.exp(a) * b) * c).sum())  # and it still works
    assert a.grad is not None and b.grad is not None and c.grad is not None


@pytest.mark.parametrize("overlap", [True, False])
def test_a_failing_backward_changes_no_grad(engine: pargrad.Engine, overlap: bool) -> None:
    """Boom fails after the last layers' buckets started."""
    params = model.parameters(np.float64)
    for p in params:
        p.grad = pargrad.tensor(np.ones(p.shape))
    comm = OneRank()
    with DataParallel(params, comm, bucket_bytes=1, overlap=overlap) as dp, \
            pytest.raises(DistributedError, match=r"failed on rank\(s\) \[0\] of 1") as info:
        dp.backward(failing.loss(params, *model.batch(np.float64), True))
    assert isinstance(info.value.__cause__, pargrad.BackwardError)
    assert repr(info.value.__cause__.__cause__) == "ValueError('boom')"
    assert len(comm.started) == 1 + 6 + 1  # the parameter check, every bucket, the status
    assert all(np.array_equal(p.grad.data, np.ones(p.shape)) for p in params)  # type: ignore[union-attr]


def test_a_second_backward_before_synchronize_fails() -> None:
    x = pargrad.tensor([1.0, 2.0], requires_grad=True)
    with DataParallel([x], OneRank(), bucket_bytes=1) as dp:
        loss = (x * x).sum()
        loss.backward(retain_graph=True)  # x's bucket starts in its hook
        with pytest.raises(pargrad.BackwardError) as info:
            loss.backward()
        assert "became final twice before synchronize()" in str(info.value.__cause__)
        dp.synchronize()
    assert x.grad is not None and x.grad.data.tolist() == [2.0, 4.0]


def test_a_bucket_holds_one_dtype() -> None:
    a = pargrad.tensor(np.ones(3, np.float32), requires_grad=True)
    b = pargrad.tensor(np.ones(3), requires_grad=True)
    c = pargrad.tensor(np.ones(3, np.float32), requires_grad=True)
    with DataParallel([a, b, c], OneRank()) as dp:
        assert [k.parameters for k in dp._buckets] == [(2, 0), (1,)]
        dp.backward((a * 2).sum() + (b * 3).sum() + (c * 4).sum())
    assert [p.grad.dtype for p in (a, b, c)] == [np.float32, np.float64, np.float32]  # type: ignore[union-attr]
    assert [p.grad.data.tolist() for p in (a, b, c)] == [[2.0] * 3, [3.0] * 3, [4.0] * 3]  # type: ignore[union-attr]


def test_updates_during_backward_and_data_parallel_do_not_combine() -> None:
    """Both take the final gradient in a post-accumulate-grad hook: whichever comes
    second on a parameter raises, registering nothing (an update during backward would
    use this rank's own gradient, before the average)."""
    params = model.parameters(np.float64)
    opt = pargrad.optim.SGD(params, lr=0.1)
    averages = "DataParallel averages it across ranks after the backward"
    updates = r"SGD\.step_in_backward\(\) updates the parameter with it as soon as it is final"
    with DataParallel(params, OneRank(), bucket_bytes=1) as dp:
        with pytest.raises(RuntimeError, match=f"do not combine: {averages}, and {updates}"):
            opt.step_in_backward()
        values = [p.data.copy() for p in params]
        dp.backward(model.loss(params, *model.batch(np.float64)))
        assert all(np.array_equal(p.data, v) for p, v in zip(params, values))  # no update
        for p, want in zip(params, model.reference(np.float64, 1)):
            np.testing.assert_allclose(p.grad.data, want, rtol=1e-12)  # type: ignore[union-attr]
        opt.step()  # how they combine: step after the averaged backward
        opt.zero_grad()
    with opt.step_in_backward():
        comm = OneRank()
        comm.broadcast = lambda buffer, root: pytest.fail("refused, yet broadcast")  # type: ignore[method-assign]
        with pytest.raises(RuntimeError, match=f"do not combine: {updates}, and {averages}"):
            DataParallel(params, comm, bucket_bytes=1)  # before any collective
        assert comm.started == []
        values = [p.data.copy() for p in params]
        model.loss(params, *model.batch(np.float64)).backward()  # no DataParallel hook
        assert all(p.grad is None for p in params)                # left: updated, freed
        assert not any(np.array_equal(p.data, v) for p, v in zip(params, values))


def test_a_module_stands_for_its_parameters() -> None:
    pargrad.random.seed(0)
    net = pargrad.nn.Sequential(pargrad.nn.Linear(3, 4), pargrad.nn.Tanh(),
                                pargrad.nn.Linear(4, 2))
    x = pargrad.randn(5, 3)
    expected = pargrad.grad(net(x).sum(), list(net.parameters()))
    with DataParallel(net, OneRank(), bucket_bytes=64) as dp:
        assert [id(p) for p in dp.parameters] == [id(p) for p in net.parameters()]
        dp.backward(net(x).sum())
    for p, g in zip(net.parameters(), expected):
        assert p.grad is not None
        np.testing.assert_array_equal(p.grad.data, g.data)

    class Root(OneRank):
        def broadcast(self, buffer: np.ndarray, root: int) -> None:
            buffer[...] = root + 1  # "root's values"

    broadcast_parameters(net, Root(), root=2)
    assert all(np.all(p.data == 3.0) for p in net.parameters())


def test_the_core_never_imports_mpi4py() -> None:
    code = ("import sys, pargrad, pargrad.distributed, examples.async_training; "
            "assert 'mpi4py' not in sys.modules, 'mpi4py imported'")
    result = run_python(code)
    assert result.returncode == 0, result.stderr


def test_shard_covers_the_data_once() -> None:
    for length in range(0, 13):
        for size in (1, 2, 3, 5):
            parts = [range(length)[shard(length, r, size)] for r in range(size)]
            assert [i for part in parts for i in part] == list(range(length))
            assert max(map(len, parts)) - min(map(len, parts)) <= 1
    with pytest.raises(ValueError, match="rank 3 is not in range"):
        shard(4, 3, 3)


# ----- the benchmark runs (smoke mode; no timing is asserted) -----
@pytest.mark.timeout(180)
@needs_mpi
def test_the_data_parallel_benchmark_reports_the_hidden_fraction(tmp_path: Path) -> None:
    out = tmp_path / "figures.json"
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--smoke", "--only", "data-parallel",
         "--no-peers", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=150,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stdout + result.stderr
    figures = json.loads(out.read_text())["data-parallel"]
    assert list(figures["variants"]) == ["1 rank, overlap", "1 rank, no overlap",
                                         "2 ranks, overlap", "2 ranks, no overlap"]
    for name, v in figures["variants"].items():
        assert v["step_median_s"] > 0 and v["buckets"] == 1, name
        assert len(v["peak_rss_bytes"]) == (1 if name.startswith("1 rank") else 2)
        if "no overlap" in name:  # every bucket starts after the backward's end
            assert v["hidden_fraction"] in (0.0, None), name
        else:
            assert v["hidden_fraction"] is None or 0 <= v["hidden_fraction"] <= 1, name
    assert set(figures["ratios"]) == {
        "1 rank / 2 ranks, overlap", "1 rank / 2 ranks, no overlap",
        "no overlap / overlap, 2 ranks", "hidden fraction, 2 ranks, overlap"}
    assert "hidden fraction, 2 ranks, overlap" in result.stdout


def test_hidden_counts_the_union_of_the_buckets_before_the_end() -> None:
    from benchmarks.data_parallel import hidden
    assert hidden([], 1.0) == (0.0, 0.0)
    assert hidden([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)], 2.5) == (4.0, 2.5)
    assert hidden([(3.0, 4.0)], 2.0) == (1.0, 0.0)


@pytest.mark.timeout(JOB_TIMEOUT + 30)
@needs_mpi
def test_the_guide_example_runs_on_two_ranks(tmp_path: Path) -> None:
    """docs/distributed.md's python block, as written, on 2 ranks."""
    guide = (ROOT / "docs" / "distributed.md").read_text()
    (block,) = re.findall(r"```python\n(.*?)```", guide, flags=re.DOTALL)
    script = tmp_path / "guide.py"
    script.write_text(block)
    stdout = run_ok(2, str(script))
    assert stdout.startswith("loss ") and float(stdout.split()[1]) < 0.7


def test_the_readme_starts_the_example() -> None:
    assert "mpiexec -n 2 python examples/data_parallel.py" in (ROOT / "README.md").read_text()
