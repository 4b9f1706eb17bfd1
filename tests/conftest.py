"""Test setup: GPU when this machine has one, else Numba's CUDA simulator (chosen before numba loads).

- Tests marked `gpu` run only on a GPU, tests marked `sim` only in the simulator; unmarked tests run
  in both, with sizes chosen by `ON_GPU` (small in the simulator, real on a GPU).
- The `rng` fixture draws a fresh seed every run (FA_TEST_SEED=<n> replays one); a failing test's
  report shows the seed.
"""
import os

import common

MODE = common.select_backend()
ON_GPU = MODE == "gpu"

import numpy as np  # noqa: E402
import pytest  # noqa: E402


def pytest_report_header(config):
    from common.hardware import target
    return f"kernels run on: {target.describe()}"


# The README's command, `pytest -n 2 --dist loadfile --no-loadscope-reorder`, hands whole files to
# the two workers in collection order, two to each at the start (the first and third to one, the
# second and fourth to the other), then one to whichever finishes a file. So the files go longest
# first (a greedy schedule: the last file a worker takes is a short one, and the two finish close
# together), and the small ones fill the tail. Simulator, two cores, 2026-11-25 (pytest
# --durations=0, a file's tests summed): the forward sweep ~11 minutes, the compile report ~5.3
# (two processes: it slows the other worker too), the backward ~4.5, then the head dims, varlen
# and masks (~2.5-3 each), the backward's options (~2.2), decoding, fp8 and the jobs (~0.8-1.4).
# (Alphabetical order used to leave test_varlen, ~3 minutes, as one worker's tail.) These times are
# from before common/hardware/_sim_block.py, which made every simulated file ~2.3x faster and left the order
# as it was; the compile report (~3 minutes, compiled by ptxas and NVVM, not simulated) now weighs
# more against the rest.
SLOW_FIRST = ("tests/test_variants.py", "tests/test_compile.py", "tests/test_backward.py",
              "tests/test_masks.py", "tests/test_varlen.py", "tests/test_head_dims.py",
              "tests/test_backward_options.py", "tests/test_fp8.py", "tests/test_decode.py",
              "tests/test_config.py")


def _file_rank(item):
    path = item.nodeid.split("::")[0]
    return SLOW_FIRST.index(path) if path in SLOW_FIRST else len(SLOW_FIRST)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "gpu" in item.keywords and not ON_GPU:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "sim" in item.keywords and ON_GPU:
            item.add_marker(pytest.mark.skip(reason="simulator-only test"))
    items.sort(key=_file_rank)     # stable: each file keeps its own order


@pytest.fixture(scope="session", autouse=True)
def _replay_ready():
    """On a GPU with torch: the replay's one-time imports done before the first test, so that
    every test's second call of a geometry is recorded and its third replayed
    (common/host/replay.py: warm_up)."""
    if ON_GPU:
        import importlib.util
        if importlib.util.find_spec("torch") is not None:
            from common.host import replay
            replay.warm_up()


@pytest.fixture
def rng(request):
    seed = int(os.environ.get("FA_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
    request.node.user_properties.append(("seed", seed))
    return np.random.default_rng(seed)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for key, value in item.user_properties:
            if key == "seed":
                report.sections.append(("random seed", f"FA_TEST_SEED={value} replays this test"))


def compiled_in_a_subprocess(code):
    """The stdout lines of Python `code` run in a fresh process with the simulator off, from the
    repository root: numba-cuda compiles PTX there without a GPU (`cuda.compile_ptx`), which the
    simulator, chosen for this process, cannot. Fails the test with the process's stderr."""
    import subprocess
    import sys
    from pathlib import Path
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1],
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.splitlines()
