"""common/timing.py: interleaved rounds time every function once a round, so that what is compared
within a round ran under the same clocks, the order rotating from round to round."""
from common import timing


def test_interleaved_rounds_take_turns():
    calls = []
    fns = [lambda i, k=k: calls.append(k) for k in range(3)]
    rounds = timing.interleaved(fns, rounds=4, target_ms=0.01)
    assert [len(r) for r in rounds] == [4, 4, 4]
    assert all(isinstance(t, timing.Timing) for r in rounds for t in r)
    # each function's calls (warm-up and timed) form one run a round; round r starts at function r
    runs = [k for j, k in enumerate(calls) if j == 0 or calls[j - 1] != k]
    assert runs == [0, 1, 2, 1, 2, 0, 2, 0, 1, 0, 1, 2]
