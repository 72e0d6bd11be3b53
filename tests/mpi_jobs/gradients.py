"""One data-parallel step (or two) per scenario on every rank, each rank with its shard
of the batch; rank 0 saves every rank's gradients to the .npz file named by argv[1].

Run from the repository root: PYTHONPATH=. mpiexec -n N python -m mpi4py -m
tests.mpi_jobs.gradients OUT.npz
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

import pargrad
from pargrad.distributed import DataParallel, shard
from tests.mpi_jobs import model

# name: (dtype, DataParallel keywords, engine, steps)
SCENARIOS: dict[str, tuple[type, dict[str, Any], str, int]] = {
    "f64": (np.float64, {}, "threaded", 1),
    "f32": (np.float32, {}, "threaded", 1),
    "f64-sequential": (np.float64, {}, "sequential", 1),
    "f64-no-overlap": (np.float64, {"overlap": False}, "threaded", 1),
    "f64-uneven-buckets": (np.float64, {"bucket_bytes": 200}, "threaded", 1),
    "f32-bucket-per-parameter": (np.float32, {"bucket_bytes": 1}, "threaded", 1),
    "f64-two-steps": (np.float64, {"bucket_bytes": 200}, "threaded", 2),
    "f64-deterministic": (np.float64, {"deterministic": True, "bucket_bytes": 200},
                          "deterministic", 1),
    "f64-deterministic-no-overlap": (np.float64, {"deterministic": True, "overlap": False},
                                     "deterministic", 1),
    "f32-deterministic": (np.float32, {"deterministic": True, "bucket_bytes": 1},
                          "deterministic", 1),
    "f32-deterministic-no-overlap": (np.float32, {"deterministic": True, "overlap": False},
                                     "deterministic", 1),
}


def engine(kind: str) -> pargrad.Engine:
    if kind == "sequential":
        return pargrad.SequentialEngine()
    return pargrad.ThreadedEngine(workers=2, deterministic=kind == "deterministic",
                                  handoff_threshold=1)


def run(comm: Any, dtype: type, options: dict[str, Any], kind: str, steps: int
        ) -> list[np.ndarray | None]:
    params = model.parameters(dtype, seed=comm.rank)  # DataParallel gives all rank 0's
    eng = engine(kind)
    try:
        with DataParallel(params, comm, **options) as dp:
            for step in range(steps):
                if step:
                    model.sgd(params)
                x, y = model.batch(dtype, step)
                mine = shard(len(y), dp.rank, dp.size)
                dp.backward(model.loss(params, x[mine], y[mine]), engine=eng)
    finally:
        if isinstance(eng, pargrad.ThreadedEngine):
            eng.shutdown()
    return [None if p.grad is None else p.grad.data for p in params]


def unused(comm: Any) -> list[np.ndarray | None]:
    """The MLP, plus ``ghost`` (in no rank's loss) and ``extra`` (in rank 0's only)."""
    params = model.parameters(np.float64)
    ghost = pargrad.tensor(np.ones(3), requires_grad=True)
    extra = pargrad.tensor(np.full(2, 3.0), requires_grad=True)
    with DataParallel([*params, ghost, extra], comm, bucket_bytes=64) as dp:
        x, y = model.batch(np.float64)
        mine = shard(len(y), dp.rank, dp.size)
        loss = model.loss(params, x[mine], y[mine])
        if dp.rank == 0:
            loss = loss + (extra * extra).sum()
        dp.backward(loss)
    return [None if p.grad is None else p.grad.data for p in [*params, ghost, extra]]


def main(out: str) -> None:
    from mpi4py import MPI  # here, so that the tests import SCENARIOS without MPI

    comm = MPI.COMM_WORLD
    results = {name: run(comm, *scenario) for name, scenario in SCENARIOS.items()}
    results["unused"] = unused(comm)
    gathered = comm.gather(results, root=0)
    if comm.rank == 0:
        arrays = {f"{name}/{rank}/{i}": (np.array([]) if g is None else g)
                  for rank, per_rank in enumerate(gathered)
                  for name, grads in per_rank.items() for i, g in enumerate(grads)}
        nones = [f"{name}/{rank}/{i}" for rank, per_rank in enumerate(gathered)
                 for name, grads in per_rank.items() for i, g in enumerate(grads) if g is None]
        np.savez(out, none=np.array(nones, dtype=str), **arrays)


if __name__ == "__main__":
    main(sys.argv[1])
