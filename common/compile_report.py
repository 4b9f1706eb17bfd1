"""Compile every kernel configuration for sm_90 without a GPU and report what the compiler made.

    python -m common.compile_report            # a table
    python -m common.compile_report --json     # one JSON object a kernel (used by the tests)

For each kernel: the count of mma.sync / ldmatrix / cp.async instructions and of float64 operations
in the PTX, and, when ptxas is installed (the `test` extra brings CUDA 13.0's), the registers,
spills and stack frame ptxas reports for sm_90. Needs NUMBA_ENABLE_CUDASIM unset or 0: the simulator
cannot compile.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

VARIANT_MODULES = ("variants.standard", "variants.fa2")


def find_ptxas():
    found = shutil.which("ptxas")
    if found:
        return found
    for entry in sys.path:
        for sub in ("nvidia/cu13/bin/ptxas", "nvidia/cuda_nvcc/bin/ptxas"):
            candidate = Path(entry) / sub
            if candidate.is_file():
                return str(candidate)
    return None


def ptx_counts(ptx):
    return {
        "mma": len(re.findall(r"\bmma\.sync\.aligned\.m16n8k16", ptx)),
        "ldmatrix": len(re.findall(r"\bldmatrix\.sync", ptx)),
        "cp_async": len(re.findall(r"\bcp\.async\.cg", ptx)),
        "f64_ops": len(re.findall(r"^\s*[a-z][a-z0-9.]*\.f64\b", ptx, flags=re.M)),
        "local_decls": len(re.findall(r"^\s*\.local\b", ptx, flags=re.M)),
    }


def ptxas_resources(ptx, arch="sm_90"):
    ptxas = find_ptxas()
    if ptxas is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        out = subprocess.run([ptxas, f"-arch={arch}", "-v", str(src), "-o", str(Path(tmp) / "k.cubin")],
                             capture_output=True, text=True, check=True).stderr
    def grab(pattern):
        m = re.search(pattern, out)
        return int(m.group(1)) if m else 0
    return {"registers": grab(r"Used (\d+) registers"), "spill_stores": grab(r"(\d+) bytes spill stores"),
            "spill_loads": grab(r"(\d+) bytes spill loads"), "stack_bytes": grab(r"(\d+) bytes stack frame")}


def report(cc=(9, 0)):
    from importlib import import_module

    from numba import config, cuda
    if config.ENABLE_CUDASIM:
        raise RuntimeError("compile_report needs NUMBA_ENABLE_CUDASIM=0 (the simulator cannot compile)")
    rows = []
    for mod in VARIANT_MODULES:
        for name, kern, argtypes, mma in import_module(mod).compile_targets():
            ptx, _ = cuda.compile_ptx(kern.py_func, argtypes, cc=cc)
            row = {"kernel": name, "expected_mma": mma, **ptx_counts(ptx)}
            row.update(ptxas_resources(ptx) or {})
            rows.append(row)
    return rows


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "0")
    rows = report()
    if "--json" in argv:
        print(json.dumps(rows))
        return
    cols = ["kernel", "mma", "ldmatrix", "cp_async", "f64_ops", "registers", "spill_stores", "stack_bytes"]
    widths = {c: max(len(c), *(len(str(r.get(c, "-"))) for r in rows)) for c in cols}
    print("  ".join(c.ljust(widths[c]) for c in cols))
    for r in rows:
        print("  ".join(str(r.get(c, "-")).ljust(widths[c]) for c in cols))


if __name__ == "__main__":
    main()
