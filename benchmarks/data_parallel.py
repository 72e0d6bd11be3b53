"""The data-parallel workload: a training step of the MLP of examples/async_training.py
over MPI ranks with ``pargrad.distributed.DataParallel``, on 1 and 2 ranks, with the
all-reduce overlapped with the backward or not (``overlap=False``).

The suite (``python -m benchmarks --only data-parallel``) starts
``mpiexec -n R python -m mpi4py -m benchmarks.data_parallel MODE OUT`` for each R; every
rank takes its shard of one global batch (strong scaling), and rank 0 writes the
figures of every rank. Figures per (ranks, overlap):

- the step time (forward, ``DataParallel.backward``, SGD; the ranks start each step
  together), medians over the steps of the slowest rank;
- from traced steps (``pargrad.profile()`` and ``DataParallel.statistics()``): the
  all-reduce time (the union of each bucket's interval from its request's start to the
  first test or wait that saw it complete, an upper bound) and the share of it that lay
  before the backward's end (the end of its last node in the trace): the hidden fraction;
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
STEPS = {"full": 20, "quick": 8, "smoke": 2}  # timed per variant and repeat; +1 warm-up
TRACED = {"full": 5, "quick": 3, "smoke": 1}  # traced steps per variant
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
    figures: dict[str, Any] = {name: {"step_s": [], "comm_s": [], "hidden_s": []}
                               for name in variants}
    with pargrad.ThreadedEngine() as engine:
        dps = {name: DataParallel(params[name], comm, bucket_bytes=BUCKET_BYTES,
                                  overlap=overlap) for name, overlap in variants.items()}
        for name, dp in dps.items():  # untimed: the first step rebuilds the buckets
            _step(task, params[name], batch, dp, engine)
        for name, dp in dps.items():
            for _ in range(STEPS[mode] + 1):
                comm.Barrier()
                start = time.perf_counter()
                _step(task, params[name], batch, dp, engine)
                figures[name]["step_s"].append(time.perf_counter() - start)
            figures[name]["step_s"].pop(0)
            for _ in range(TRACED[mode]):
                comm.Barrier()
                with pargrad.profile() as trace:
                    _step(task, params[name], batch, dp, engine)
                stats = dp.statistics()
                end = max(e.end for e in trace.events())
                total, before = hidden([(b.started, b.finished) for b in stats.buckets], end)
                figures[name]["comm_s"].append(total)
                figures[name]["hidden_s"].append(before)
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
    """One variant over the ranks: the slowest rank's median step, the hidden fraction
    (median over traced steps, rank 0), memory."""
    per_rank = [r["figures"][name] for r in ranks]
    first = per_rank[0]
    fractions = [h / c for h, c in zip(first["hidden_s"], first["comm_s"]) if c > 0]
    return {"step_median_s": max(statistics.median(f["step_s"]) for f in per_rank),
            "steps": len(first["step_s"]),
            "allreduce_ms": 1e3 * statistics.median(first["comm_s"]),
            "hidden_fraction": statistics.median(fractions) if fractions else None,
            "buckets": first["buckets"], "bucket_bytes": first["bucket_bytes"],
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
    print(f"  {'':<22}{'step ms':>9}{'all-reduce ms':>15}{'hidden':>8}{'buckets':>9}"
          f"{'peak RSS MB (per rank)':>26}")
    for name, v in d["variants"].items():
        fraction = "-" if v["hidden_fraction"] is None else f"{v['hidden_fraction']:.2f}"
        rss = ", ".join(f"{b / 2**20:.0f}" for b in v["peak_rss_bytes"])
        print(f"  {name:<22}{v['step_median_s'] * 1e3:9.1f}{v['allreduce_ms']:15.2f}"
              f"{fraction:>8}{v['buckets']:>9}{rss:>26}")
    print("  " + "; ".join(f"{k} {v:.3f}" if v is not None else f"{k} -"
                           for k, v in d["ratios"].items()))


if __name__ == "__main__":
    rank_main(sys.argv[1], sys.argv[2])
