"""Programs that tests/test_distributed.py runs on several ranks under mpiexec."""
