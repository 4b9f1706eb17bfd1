"""Every kernel configuration compiles for sm_90 on a machine without a GPU, and the compiler made
what we meant: the mma.sync instructions the tile shapes call for, no float64 arithmetic, no
local-memory arrays, and (with ptxas from the `test` extra) no register spills."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def report():
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    out = subprocess.run([sys.executable, "-m", "common.compile_report", "--json"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_every_kernel_is_covered(report):
    names = [r["kernel"] for r in report]
    assert sum(n.startswith("fa2") for n in names) == 8       # 2 head dims x 2 dtypes x causal
    assert sum(n.startswith("standard") for n in names) == 12


def test_tensor_core_instructions(report):
    for r in report:
        assert r["mma"] == r["expected_mma"], r
        if r["mma"]:
            assert r["ldmatrix"] > 0 and r["cp_async"] > 0, r


def test_no_float64_and_no_local_arrays(report):
    for r in report:
        assert r["f64_ops"] == 0, r
        assert r["local_decls"] == 0, r


def test_no_spills(report):
    if "registers" not in report[0]:
        pytest.skip("ptxas not installed (pip install -e '.[test]' brings it)")
    for r in report:
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0 and r["stack_bytes"] == 0, r
        assert r["registers"] <= 255, r
