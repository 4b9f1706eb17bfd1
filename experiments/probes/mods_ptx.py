"""(Probe: `docs/results/mods_ptx_c589c99.txt`, docs/performance/score_mods.md.) What a score_mod
costs in instructions, without a GPU: fa2's forward at d=128, causal, bf16 compiled for sm_90
(`cuda.compile_ptx`, then ptxas and cuobjdump as experiments/compile_report.py runs them) four
ways: plain, the built-in ALiBi (`alibi_slopes`), ALiBi as a score_mod written the int64 way
(experiments/mods.py `alibi_int64`: float32(abs(q_idx - kv_idx))) and the float way
(variants/score_mods.py `alibi`: abs(float32(q_idx) - float32(kv_idx))). Prints, for each: the
PTX's int-to-float conversions (s32 and s64), 64-bit integer instructions and global loads, and
ptxas's registers, spills and the main loop's static SASS count.

    python experiments/probes/mods_ptx.py            (about a minute on two cores)
"""
import os
import re
import sys
from dataclasses import replace

sys.path.insert(0, os.getcwd())
os.environ["NUMBA_ENABLE_CUDASIM"] = "0"

from numba import cuda, types  # noqa: E402

import experiments.compile_report as report  # noqa: E402
from common.hardware.elements import BFLOAT16  # noqa: E402
from common.host.mods import resolve  # noqa: E402
from common.host.problem import MOD_TYPES  # noqa: E402
from experiments.mods import alibi_int64  # noqa: E402
from variants import fa2, score_mods  # noqa: E402

PTX_COUNTS = {"cvt.rn.f32.s32": r"cvt\.rn\.f32\.s32", "cvt.rn.f32.s64": r"cvt\.rn\.f32\.s64",
              "64-bit int ops": r"^\s*[a-z]+\.[a-z0-9.]*[su]64\b", "ld.global": r"\bld\.global"}
SASS_KEYS = ("registers", "spill_stores", "spill_loads", "loop_instructions", "loop_local",
             "sass_total")


def main():
    name, _, argtypes, _ = next(t for t in fa2.compile_targets()
                                if t[0] == "fa2 d=128 bf16 causal=True")
    slopes = (types.UniTuple(types.Array(types.float32, 1, "C"), 1),)
    at = argtypes.index(MOD_TYPES[0])
    with_aux = argtypes[:at] + slopes + argtypes[at + 1:]
    plain = fa2.default_config(128, BFLOAT16, True)
    cases = [("plain", plain, argtypes),
             ("built-in alibi_slopes", fa2.default_config(128, BFLOAT16, True,
                                                          (("alibi", True),)), argtypes),
             ("score_mod, int64 form", replace(plain, mods=resolve(score_mod=alibi_int64)),
              with_aux),
             ("score_mod, float form", replace(plain, mods=resolve(score_mod=score_mods.alibi)),
              with_aux)]
    print(f"# {name}: ALiBi four ways (PTX counts over the whole kernel; SASS: ptxas sm_90)")
    for label, cfg, args in cases:
        kern = fa2.build(cfg)
        ptx, _ = cuda.compile_ptx(kern.py_func, args, cc=(9, 0),
                                  launch_bounds=kern.targetoptions.get("launch_bounds"))
        counts = {k: len(re.findall(p, ptx, flags=re.M)) for k, p in PTX_COUNTS.items()}
        sass = report.ptxas_resources(ptx, arch="sm_90") or {}
        print(f"{label:24s}", " ".join(f"{k}={v}" for k, v in counts.items()),
              " ".join(f"{k}={sass.get(k)}" for k in SASS_KEYS), flush=True)


if __name__ == "__main__":
    main()
