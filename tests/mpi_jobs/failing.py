"""A backward that fails on the last rank: every rank must raise the same
DistributedError with no .grad changed, and the next step must work. Rank 0 writes
what each rank saw to the JSON file named by argv[1].

Run from the repository root: PYTHONPATH=. mpiexec -n N python -m mpi4py -m
tests.mpi_jobs.failing OUT.json
"""

from __future__ import annotations

import json
import sys
from typing import Any

import numpy as np

import pargrad
from pargrad.distributed import DataParallel, DistributedError, shard
from tests.mpi_jobs import model


class Boom(pargrad.Function):
    """The identity, whose backward raises on the rank it is told to."""

    @staticmethod
    def forward(ctx: pargrad.FunctionCtx, x: pargrad.Tensor, fail: bool) -> np.ndarray:
        ctx.fail = fail
        return x.data.copy()

    @staticmethod
    def backward(ctx: pargrad.FunctionCtx, g: np.ndarray) -> tuple[np.ndarray, None]:
        if ctx.fail:
            raise ValueError("boom")
        return g, None


def loss(params: list[pargrad.Tensor], x: np.ndarray, y: np.ndarray,
         fail: bool) -> pargrad.Tensor:
    """The model's loss with Boom after the first layer: the last layers' buckets have
    started on the failing rank when its backward fails."""
    h = Boom.apply(pargrad.tanh(pargrad.tensor(x) @ params[0] + params[1]), fail)
    h = pargrad.tanh(h @ params[2] + params[3])
    log_probs = pargrad.log_softmax(h @ params[4] + params[5], axis=1)
    return -log_probs[np.arange(len(y)), y].mean()


def main(out: str) -> None:
    from mpi4py import MPI  # here, so that the tests import Boom without MPI

    comm = MPI.COMM_WORLD
    params = model.parameters(np.float64)
    before = [np.full(p.shape, 7.0) for p in params]
    for p, g in zip(params, before):
        p.grad = pargrad.tensor(g)
    seen: dict[str, Any] = {"rank": comm.rank}
    with pargrad.ThreadedEngine(workers=2) as engine, \
            DataParallel(params, comm, bucket_bytes=1) as dp:
        x, y = model.batch(np.float64)
        mine = shard(len(y), dp.rank, dp.size)
        try:
            dp.backward(loss(params, x[mine], y[mine], dp.rank == dp.size - 1),
                        engine=engine)
        except DistributedError as exc:
            seen["error"] = str(exc)
            seen["cause"] = repr(exc.__cause__.__cause__) if exc.__cause__ else None
        seen["unchanged"] = all(np.array_equal(p.grad.data, g)  # type: ignore[union-attr]
                                for p, g in zip(params, before))
        for p in params:
            p.grad = None
        dp.backward(loss(params, x[mine], y[mine], False), engine=engine)  # works again
        seen["after"] = [p.grad.data.tolist() for p in params]  # type: ignore[union-attr]
    everyone = comm.gather(seen, root=0)
    if comm.rank == 0:
        with open(out, "w") as f:
            json.dump(everyone, f)


if __name__ == "__main__":
    main(sys.argv[1])
