"""Rank 1 never calls synchronize(): rank 0, with timeout=1, must abort the whole job
(with a message) rather than wait forever.

Run from the repository root: PYTHONPATH=. mpiexec -n 2 python -m mpi4py -m
tests.mpi_jobs.stuck
"""

from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI

from pargrad.distributed import DataParallel
from tests.mpi_jobs import model

if __name__ == "__main__":
    params = model.parameters(np.float64)
    dp = DataParallel(params, MPI.COMM_WORLD, timeout=1.0)
    if dp.rank == 0:
        dp.backward(model.loss(params, *model.batch(np.float64)))
        print("rank 0 returned from backward", flush=True)
    else:
        time.sleep(60)  # stands for a rank that hangs
