"""experiments/measure/timing.py: interleaved rounds time every function once a round, so that what is compared
within a round ran under the same clocks, in an order that changes who runs before whom."""
from collections import Counter

import pytest

from experiments.measure import timing


def test_interleaved_rounds_take_turns():
    calls = []
    fns = [lambda i, k=k: calls.append(k) for k in range(3)]
    rounds = timing.interleaved(fns, rounds=4, target_ms=0.01)
    assert [len(r) for r in rounds] == [4, 4, 4]
    assert all(isinstance(t, timing.Timing) for r in rounds for t in r)
    # an untimed first pass in list order, then each round in williams_order's order, each
    # function's calls (settle and timed) one run
    runs = [k for j, k in enumerate(calls) if j == 0 or calls[j - 1] != k]
    assert runs == [0, 1, 2] + [k for r in range(4) for k in timing.williams_order(3, r)]


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
def test_williams_order_balances_who_runs_before_whom(n):
    period = n if n % 2 == 0 else 2 * n
    rows = [timing.williams_order(n, r) for r in range(period)]
    assert all(sorted(row) == list(range(n)) for row in rows)
    follows = Counter((a, b) for row in rows for a, b in zip(row, row[1:]))
    # every ordered pair once over the period (twice for odd n: the mirrored rows)
    assert set(follows) == {(a, b) for a in range(n) for b in range(n) if a != b}
    assert set(follows.values()) == {period // n}
    # even n: in fewer rounds than functions a function still follows a different one each round
    for k in range(n if n % 2 == 0 else 0):
        before = [row[row.index(k) - 1] for row in rows[:n - 1] if row.index(k) > 0]
        assert len(set(before)) == len(before)
