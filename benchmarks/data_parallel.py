"""The data-parallel workload: a training step of the MLP of examples/async_training.py
over MPI ranks with ``pargrad.distributed.DataParallel``, on 1 and 2 ranks, with the
all-reduce overlapped with the backward or not (``overlap=False``).

The suite (``python -m benchmarks --only data-parallel``) starts
``mpiexec -n R python -m mpi4py -m benchmarks.data_parallel MODE OUT`` for each R; every
rank takes its shard of one global batch (strong scaling), and rank 0 writes the
figures of every rank. Figures per (ranks, overlap):

- the step time (forward, ``DataParallel.backward``, SGD; the ranks start each step
  together), medians over the steps of the slowest rank;
- from traced steps (``pargrad.profile()`` and ``DataParallel.statistics()``), medians
  over rank 0's: the all-reduce time (the union of each bucket's interval from its
  request's start to the first test or wait that saw it complete, an upper bound); the
  share of it before the backward's end (the end of its last node in the trace): the
  hidden fraction; the rest ("after it": what the step waited beyond its backward),
  and the part of that after the *last* rank's backward ended ("after last": what no
  rank's backward covered); the backward's time, and the spread of the backward ends
  across the ranks (one rank waiting for a slower one shows there, not as transfer);
- memory: the peak resident set of each rank and the bytes of its bucket buffers.

Each rank runs BLAS on one thread (``OPENBLAS_NUM_THREADS=1`` and the like, unless set
in the environment), so that ranks sharing the cores do not oversubscribe them.

Ratios: 1 rank over 2 ranks (speed-up), overlap off over on, at 2 ranks. Compare
within one run only.
"""

from __future__ import annotations

import importlib.util
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

import pargrad
from examples.async_training import Task, sgd_step

NAME = "data-parallel"
TASKS = {"full": Task(augment=0), "quick": Task(augment=0),
         "smoke": Task(batch=16, sizes=(12, 8, 8, 3), augment=0)}
STEPS = {"full": 60, "quick": 15, "smoke": 2}  # timed per variant, after 2 untimed
TRACED = {"full": 9, "quick": 3, "smoke": 1}  # traced steps per variant
BUCKET_BYTES = 1 << 14  # the 784-512-512-10 MLP in float32: [b3 W3], [b2 W2], [b1 W1]
RANKS = (1, 2)
BLAS_THREADS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
TIMEOUT_S = {"full": 600, "quick": 300, "smoke": 120}


def hidden(intervals: list[tuple[float, float]], end: float) -> tuple[float, float]:
    """(seconds covered by the union of ``intervals``, of which before ``end``)."""
    total = before = 0.0
    reach = -np.inf
    for start, finish in sorted(intervals):
        start = max(start, reach)  # the part not yet counted
        if finish > start:
            total += finish - start
            before += max(0.0, min(finish, end) - start)
            reach = finish
    return total, before


def _step(task: Task, params: list[pargrad.Tensor], batch: tuple[np.ndarray, np.ndarray],
          dp: Any, engine: pargrad.Engine) -> None:
    dp.backward(task.loss(params, batch), engine=engine)
    for p in params:
        sgd_step(p)


def rank_main(mode: str, out: str) -> None:
    """One rank's part: every variant's step times and traces; rank 0 writes them all."""
    from mpi4py import MPI

    from pargrad.distributed import DataParallel, shard

    comm = MPI.COMM_WORLD
    task = TASKS[mode]
    x, y = task.prepare(0)
    mine = shard(len(y), comm.rank, comm.size)
    batch = (x[mine], y[mine])
    variants = {"overlap": True, "no overlap": False}
    params = {name: task.parameters() for name in variants}
    figures: dict[str, Any] = {name: {"step_s": [], "traced": []}
                               for name in variants}
    with pargrad.ThreadedEngine() as engine:
        dps = {name: DataParallel(params[name], comm, bucket_bytes=BUCKET_BYTES,
                                  overlap=overlap) for name, overlap in variants.items()}
        for name, dp in dps.items():  # untimed: the first step rebuilds the buckets
            for _ in range(2):
                _step(task, params[name], batch, dp, engine)
        for _ in range(STEPS[mode]):  # the variants take turns, so noise hits both
            for name, dp in dps.items():
                comm.Barrier()
                start = time.perf_counter()
                _step(task, params[name], batch, dp, engine)
                figures[name]["step_s"].append(time.perf_counter() - start)
        for _ in range(TRACED[mode]):
            for name, dp in dps.items():
                comm.Barrier()
                with pargrad.profile() as trace:
                    _step(task, params[name], batch, dp, engine)
                events, stats = trace.events(), dp.statistics()
                figures[name]["traced"].append({
                    "backward": [min(e.start for e in events), max(e.end for e in events)],
                    "buckets": [[b.started, b.finished] for b in stats.buckets]})
                figures[name]["buckets"] = len(stats.buckets)
                figures[name]["bucket_bytes"] = sum(b.nbytes for b in stats.buckets)
        for dp in dps.values():
            dp.remove()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: kB
    everyone = comm.gather({"figures": figures, "peak_rss_bytes": peak}, root=0)
    if comm.rank == 0:
        Path(out).write_text(json.dumps(everyone))


def _job(ranks: int, mode: str, mpiexec: str) -> list[dict[str, Any]]:
    """Run every rank of the job; what each rank measured."""
    root = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "figures.json"
        # BLAS at one thread per rank unless the environment says otherwise: ranks that
        # share the cores must not each start a BLAS thread per core.
        env = {**dict.fromkeys(BLAS_THREADS, "1"), **os.environ, "PYTHONPATH": os.pathsep.join(
                   [str(root), os.environ.get("PYTHONPATH", "")]),
               "MPIEXEC_TIMEOUT": str(TIMEOUT_S[mode])}
        command = [mpiexec, "-n", str(ranks), sys.executable, "-m", "mpi4py", "-m",
                   "benchmarks.data_parallel", mode, str(out)]
        process = subprocess.Popen(command, cwd=root, env=env, start_new_session=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            output, _ = process.communicate(timeout=TIMEOUT_S[mode] + 15)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            raise
        if process.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed:\n{output}")
        return json.loads(out.read_text())  # type: ignore[no-any-return]


def _summary(ranks: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """One variant over the ranks: the slowest rank's median step; from rank 0's traced
    steps (medians): its backward, the all-reduce time, its hidden fraction, the part
    after rank 0's backward and after the last rank's; the spread of the backward ends
    across ranks (``perf_counter`` is one clock for all processes of a machine)."""
    per_rank = [r["figures"][name] for r in ranks]
    comm, before, after_last, skew, backward = [], [], [], [], []
    for i, traced in enumerate(per_rank[0]["traced"]):
        ends = [r["traced"][i]["backward"][1] for r in per_rank]
        intervals = [tuple(b) for b in traced["buckets"]]
        total, hidden_s = hidden(intervals, traced["backward"][1])
        comm.append(total)
        before.append(hidden_s)
        after_last.append(total - hidden(intervals, max(ends))[1])
        skew.append(max(ends) - min(ends))
        backward.append(traced["backward"][1] - traced["backward"][0])
    fractions = [h / c for h, c in zip(before, comm) if c > 0]
    ms = lambda values: 1e3 * statistics.median(values)
    return {"step_median_s": max(statistics.median(f["step_s"]) for f in per_rank),
            "steps": len(per_rank[0]["step_s"]), "backward_ms": ms(backward),
            "allreduce_ms": ms(comm),
            "hidden_fraction": statistics.median(fractions) if fractions else None,
            "after_backward_ms": ms([c - h for c, h in zip(comm, before)]),
            "after_last_backward_ms": ms(after_last), "backward_end_spread_ms": ms(skew),
            "buckets": per_rank[0]["buckets"], "bucket_bytes": per_rank[0]["bucket_bytes"],
            "peak_rss_bytes": [r["peak_rss_bytes"] for r in ranks]}


def run_data_parallel(mode: str) -> dict[str, Any]:
    """Every figure of the workload, or ``{"skipped": reason}`` without MPI."""
    from pargrad.distributed import mpiexec_path

    mpiexec = mpiexec_path()
    if importlib.util.find_spec("mpi4py") is None or mpiexec is None:
        return {"name": NAME, "skipped": "needs mpi4py and mpiexec: "
                                         "pip install -e '.[distributed]'"}
    task = TASKS[mode]
    rows = {}
    for ranks in RANKS:
        measured = _job(ranks, mode, mpiexec)
        for name in ("overlap", "no overlap"):
            rows[f"{ranks} rank{'s' if ranks > 1 else ''}, {name}"] = _summary(measured, name)
    step = {k: v["step_median_s"] for k, v in rows.items()}
    return {"name": NAME, "description": (
                f"MLP {'-'.join(map(str, task.sizes))} float32, global batch {task.batch} "
                f"split over the ranks, buckets of {BUCKET_BYTES} bytes, ThreadedEngine "
                "per rank: forward + DataParallel.backward + SGD"),
            "cores": os.cpu_count(), "variants": rows, "ratios": {
                "1 rank / 2 ranks, overlap": step["1 rank, overlap"] / step["2 ranks, overlap"],
                "1 rank / 2 ranks, no overlap": (step["1 rank, no overlap"]
                                                 / step["2 ranks, no overlap"]),
                "no overlap / overlap, 2 ranks": (step["2 ranks, no overlap"]
                                                  / step["2 ranks, overlap"]),
                "hidden fraction, 2 ranks, overlap":
                    rows["2 ranks, overlap"]["hidden_fraction"]}}


def print_data_parallel(d: dict[str, Any]) -> None:
    if "skipped" in d:
        print(f"\nskipped {NAME}: {d['skipped']}")
        return
    print(f"\n{d['name']}: {d['description']}")
    print(f"  {'(ms; hidden: a fraction)':<26}{'step':>6}{'backward':>10}{'spread':>8}"
          f"{'all-reduce':>12}{'hidden':>8}{'after it':>10}{'after last':>12}{'buckets':>9}"
          f"{'peak RSS MB':>13}")
    for name, v in d["variants"].items():
        fraction = "-" if v["hidden_fraction"] is None else f"{v['hidden_fraction']:.2f}"
        rss = ", ".join(f"{b / 2**20:.0f}" for b in v["peak_rss_bytes"])
        print(f"  {name:<26}{v['step_median_s'] * 1e3:6.1f}{v['backward_ms']:10.1f}"
              f"{v['backward_end_spread_ms']:8.1f}{v['allreduce_ms']:12.2f}{fraction:>8}"
              f"{v['after_backward_ms']:10.2f}{v['after_last_backward_ms']:12.2f}"
              f"{v['buckets']:>9}{rss:>13}")
    print("  " + "; ".join(f"{k} {v:.3f}" if v is not None else f"{k} -"
                           for k, v in d["ratios"].items()))


if __name__ == "__main__":
    rank_main(sys.argv[1], sys.argv[2])
