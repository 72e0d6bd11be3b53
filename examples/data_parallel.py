"""Data-parallel training over MPI (docs/distributed.md): the MLP of ``pargrad.demo``
trained on every rank of the job, each rank on its shard of the data.

Every rank starts from rank 0's weights (``DataParallel`` broadcasts them), computes the
backward of its shard, and ``DataParallel.backward`` averages the gradients across
ranks, each bucket's all-reduce starting while the rest of the backward runs; then every
rank takes the same SGD step, so the weights stay equal everywhere (checked at the end).
Rank 0 prints the loss on the whole data set.

Run from the repository root: ``mpiexec -n 2 python -m mpi4py -m examples.data_parallel``
(``--steps N``; ``python -m mpi4py`` makes an uncaught error on one rank end the job).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
from mpi4py import MPI

import pargrad
from pargrad.demo import init_params, loss_fn, make_data
from pargrad.distributed import DataParallel, shard

LEARNING_RATE = 0.5


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="data-parallel training of the demo MLP")
    parser.add_argument("--steps", type=int, default=301)
    steps = parser.parse_args(argv).steps
    comm = MPI.COMM_WORLD
    x, y = make_data(np.random.default_rng(0))  # the same data set on every rank
    params = init_params(np.random.default_rng(comm.rank), [2, 32, 32, 3])
    dp = DataParallel(params, comm)  # every rank now holds rank 0's weights
    mine = shard(len(y), dp.rank, dp.size)
    if dp.rank == 0:
        print(f"training a 2-32-32-3 MLP on {len(y)} points over {dp.size} ranks, "
              f"{mine.stop - mine.start} points on rank 0")
    losses = []
    for step in range(steps):
        dp.backward(loss_fn(params, x[mine], y[mine]))  # every .grad: the mean over ranks
        with pargrad.no_grad():
            for p in params:
                assert p.grad is not None
                p -= LEARNING_RATE * p.grad
                p.grad = None
        if dp.rank == 0 and (step % 50 == 0 or step == steps - 1):
            with pargrad.no_grad():
                losses.append(loss_fn(params, x, y).item())
            print(f"step {step:3d}  loss {losses[-1]:.4f}", flush=True)
    mine_flat = np.concatenate([p.data.ravel() for p in params])
    first = mine_flat.copy()
    comm.Bcast(first, 0)
    equal = comm.allreduce(bool(np.array_equal(mine_flat, first)), MPI.LAND)
    if dp.rank == 0:
        print("weights bitwise equal on every rank" if equal else "weights differ!")
        if not (equal and losses[-1] < 0.5 * losses[0]):
            print(f"failed: loss {losses[0]:.4f} -> {losses[-1]:.4f}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
