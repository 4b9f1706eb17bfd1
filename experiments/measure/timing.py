"""Timing with CUDA events: warm-up first (compiles and first-touch excluded), then the median of
repeated runs, each bracketed by its own pair of events on the default stream."""
import math
import statistics
import time
from dataclasses import dataclass

from numba import cuda

from common.hardware.target import SIMULATOR


@dataclass
class Timing:
    median_ms: float
    min_ms: float
    max_ms: float
    reps: int
    simulated: bool = False   # True: host wall-clock of the CUDA simulator, meaningless for speed


def benchmark(fn, *, warmup=3, min_reps=5, max_reps=100, target_ms=300.0):
    """Time fn(i) for i = 0, 1, 2, ... (callers rotate input sets with i). Repeats until about
    target_ms of kernel time is measured, within [min_reps, max_reps]."""
    if SIMULATOR:
        t = time.perf_counter()
        fn(0)
        ms = (time.perf_counter() - t) * 1e3
        return Timing(ms, ms, ms, 1, simulated=True)
    for i in range(warmup):
        fn(i)
    cuda.synchronize()
    start, end = cuda.event(timing=True), cuda.event(timing=True)
    start.record()
    fn(warmup)
    end.record()
    end.synchronize()
    estimate = max(cuda.event_elapsed_time(start, end), 1e-3)
    reps = int(min(max_reps, max(min_reps, target_ms / estimate)))
    events = [(cuda.event(timing=True), cuda.event(timing=True)) for _ in range(reps)]
    for i, (s, e) in enumerate(events):
        s.record()
        fn(warmup + 1 + i)
        e.record()
    events[-1][1].synchronize()
    times = [cuda.event_elapsed_time(s, e) for s, e in events]
    return Timing(statistics.median(times), min(times), max(times), reps)


def williams_order(n, r):
    """Round r's order of n functions in a Williams design (crossover trials' balanced Latin
    square): row r of the square whose first row is 0, 1, n-1, 2, n-2, ... and whose row r adds r
    (mod n); for odd n, rows n..2n-1 are rows 0..n-1 reversed. Over a full period (n rounds, 2n
    for odd n) every function runs right after every other one equally often; for even n, in
    fewer rounds, each still follows a different one each round (the first row's steps 1, -2, 3,
    -4, ... are distinct mod n)."""
    first = [0]
    for i in range(1, n):
        first.append((i + 1) // 2 if i % 2 else n - i // 2)
    period = n if n % 2 == 0 else 2 * n
    r %= period
    row = [(x + r) % n for x in first]
    return row if r < n else row[::-1]


def interleaved(fns, *, rounds=5, target_ms=60.0, warmup=3, settle_ms=30.0):
    """Time every fn(i) in turn, round after round, each one's `benchmark` of about target_ms a
    round: a GPU's clocks follow its power and temperature over seconds, and the calls compared
    within one round ran under the same clocks. What runs just before a function moves its time
    too (docs/performance/fp8.md, "FP8 tiles between panels": the option timed right after fa3
    bf16 measured 1-4% low even after a settle, ~9% without one), so each round takes the order
    `williams_order` gives (no function always after the same other one) and each function
    first runs untimed for about settle_ms (its duration known from an untimed first pass).
    Returns, per fn, the list of its rounds' Timings (a ratio of two fns is best taken round by
    round)."""
    last = []
    for fn in fns:   # compiled, warmed, and each one's duration for its settle
        last.append(benchmark(fn, warmup=warmup, min_reps=1, max_reps=3, target_ms=0).median_ms)
    out = [[] for _ in fns]
    for r in range(rounds):
        for k in williams_order(len(fns), r):
            t = benchmark(fns[k], warmup=max(1, math.ceil(settle_ms / max(last[k], 1e-3))),
                          target_ms=target_ms)
            last[k] = t.median_ms
            out[k].append(t)
    return out


class PerInputSet:
    """make(j) for input set j, made once and kept; `self[i]` takes set i % n, as benchmark's fn(i)
    rotates them. For what a timed pass starts from but must not time (the forward that a
    backward-only pass differentiates): `prime()` makes every set's now, outside the timing."""

    def __init__(self, n, make):
        self._n, self._make, self._made = n, make, {}

    def __getitem__(self, i):
        j = i % self._n
        if j not in self._made:
            self._made[j] = self._make(j)
        return self._made[j]

    def prime(self):
        for j in range(self._n):
            self[j]


def capture_cuda_graph(fn, warmup=2):
    """(graph, fn's result) of fn captured once in a torch CUDA graph, by torch's recipe: warm-up
    calls on a side stream first (kernels compiled, launchers and caches made outside the
    capture). graph.replay() reruns it on whatever the captured tensors then hold."""
    import torch
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out
