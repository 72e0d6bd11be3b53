"""Gradient buffers: the arrival-order buffer sums as a fold of ``accumulate`` and never
writes an array it was handed; the canonical-order buffer folds what it can as soon as
it can, and sums bitwise as an in-order fold whatever the order of arrival."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

import pargrad
from pargrad.engine.buffer import InputBuffer, OrderedInputBuffer, accumulate


def in_order(parts: list[np.ndarray | None]) -> np.ndarray | None:
    buffer = InputBuffer(1)
    for part in parts:
        buffer.accumulate(0, part)
    return buffer.take()[0]


@given(arrivals=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 3)), max_size=12),
       seed=st.integers(0, 2**32 - 1))
def test_input_buffer_is_a_fold_of_accumulate_and_writes_nothing_it_was_given(
        arrivals: list[tuple[int, int]], seed: int) -> None:
    """Three outputs, each gradient an array, None, a Tensor or a read-only broadcast."""
    rng = np.random.default_rng(seed)
    buffer = InputBuffer(3)
    totals: list[object] = [None] * 3
    owned = [False] * 3
    given_arrays: list[tuple[np.ndarray, np.ndarray]] = []
    for output_nr, kind in arrivals:
        array = rng.standard_normal(4)
        grad: object
        if kind == 0:
            grad = array
        elif kind == 1:
            grad = None
        elif kind == 2:
            grad = pargrad.tensor(array)
        else:
            grad = np.broadcast_to(array[:1], (4,))
        if isinstance(grad, np.ndarray):
            given_arrays.append((grad, grad.copy()))
        buffer.accumulate(output_nr, grad)
        if grad is not None:
            totals[output_nr], owned[output_nr] = accumulate(totals[output_nr],
                                                             owned[output_nr], grad)
    for got, want in zip(buffer.take(), totals):
        if want is None:
            assert got is None
        else:
            want_array = want.data if isinstance(want, pargrad.Tensor) else want
            got_array = got.data if isinstance(got, pargrad.Tensor) else got
            assert type(got) is type(want)
            np.testing.assert_array_equal(got_array, want_array)
    for array, before in given_arrays:
        np.testing.assert_array_equal(array, before)


@given(n=st.integers(1, 12), seed=st.integers(0, 2**32 - 1))
def test_any_arrival_order_sums_bitwise_as_the_canonical_order(n: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    keys = sorted({(1, -int(k), 0) for k in rng.choice(10_000, n, replace=False)})
    parts = [None if rng.random() < 0.2 else rng.standard_normal(5) * 10.0 ** rng.integers(-8, 8)
             for _ in keys]
    buffer = OrderedInputBuffer(1, [keys])
    for i in rng.permutation(len(keys)):
        buffer.accumulate(0, parts[i], keys[i])
    got = buffer.take()[0]
    want = in_order(parts)
    if want is None:
        assert got is None
    else:
        np.testing.assert_array_equal(got, want)


def test_contributions_in_order_are_folded_at_once_and_early_ones_wait() -> None:
    keys = [(0, 0), (1, -9, 0), (1, -5, 1)]
    buffer = OrderedInputBuffer(1, [keys])
    buffer.accumulate(0, np.ones(2), (1, -5, 1))  # early: (0, 0) and (1, -9, 0) come first
    assert list(buffer._early[0]) == [(1, -5, 1)]
    buffer.accumulate(0, np.full(2, 2.0), (0, 0))  # in order: folded
    assert list(buffer._early[0]) == [(1, -5, 1)] and buffer._next[0] == 1
    buffer.accumulate(0, None, (1, -9, 0))  # releases the early one
    assert not buffer._early[0] and buffer._next[0] == 3
    np.testing.assert_array_equal(buffer.take()[0], [3.0, 3.0])
