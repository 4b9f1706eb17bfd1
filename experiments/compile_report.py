"""Compile every kernel configuration for sm_90 without a GPU and report what the compiler made.

    python -m experiments.compile_report            # a table
    python -m experiments.compile_report --json     # one JSON object a kernel (used by the tests)
    python -m experiments.compile_report --sass     # also SASS instruction counts (needs cuobjdump)
    python -m experiments.compile_report --skip REGEX   # targets whose name matches are listed, not compiled
    python -m experiments.compile_report --jobs N       # compiled in N processes
    python -m experiments.compile_report --ptx DIR      # only the PTX, one file a kernel, into DIR
                                                   # (a refactor's check: diff -r two such DIRs)
    FA_STOCK_FRONTEND=1 python -m experiments.compile_report ...   # numba-cuda's own frontend
                                                   # (common/hardware/frontend.py off)

For each kernel: the seconds numba.cuda.compile_ptx took (JSON: compile_ptx_seconds), the count
of mma.sync / ldmatrix / cp.async instructions and of float64 operations in the PTX, and, when
ptxas is installed (the `test` extra brings CUDA 13.0's), the registers, spills and stack frame
ptxas reports for sm_90 (and with --sass, counts of SASS instructions:
HMMA tensor-core ops, LDSM/LDGSTS loads, MUFU, integer IMAD/ISETP, local LDL/STL, and the main
loop's instructions; the innermost MMA loop's instructions and stall cycles from the control
bits: `step_loop_stalls`). Needs
NUMBA_ENABLE_CUDASIM unset or 0: the simulator cannot compile.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def variant_modules():
    """Every registered variant's module (variants.REGISTRY, the one list), then the kernels every
    backward shares and decoding's (variants.decode). (Read lazily: this report is measurement, above the variants it compiles.)"""
    from variants import REGISTRY
    return tuple(REGISTRY.values()) + ("variants.backward_shared", "variants.decoding")


def ptx_counts(ptx):
    # PDL: griddepcontrol.wait, and the TMA loads before the first one (-1: no wait) and in all, in
    # the PTX's text order (fa3's producer: straight-line code around its one wait)
    wait = ptx.find("griddepcontrol.wait")
    loads = [m.start() for m in re.finditer(TMA_LOAD, ptx)]
    return {
        "mma": len(re.findall(r"\bmma\.sync\.aligned\.m16n8k16", ptx)),
        "wgmma": len(re.findall(r"\bwgmma\.mma_async", ptx)),
        "ldmatrix": len(re.findall(r"\bldmatrix\.sync", ptx)),
        "cp_async": len(re.findall(r"\bcp\.async\.cg", ptx)),
        "f64_ops": len(re.findall(r"^\s*[a-z][a-z0-9.]*\.f64\b", ptx, flags=re.M)),
        "local_decls": len(re.findall(r"^\s*\.local\b", ptx, flags=re.M)),
        "griddep_wait": ptx.count("griddepcontrol.wait"),
        "tma_loads": len(loads),
        "tma_loads_before_wait": sum(x < wait for x in loads) if wait >= 0 else -1,
    }


TMA_LOAD = r"\bcp\.async\.bulk\.tensor\.\dd\.shared::cluster\.global"


def find_tool(name):
    """A CUDA binary (ptxas, cuobjdump) on PATH or in an installed nvidia wheel."""
    found = shutil.which(name)
    if found:
        return found
    for entry in sys.path:
        candidate = Path(entry) / "nvidia" / "cu13" / "bin" / name
        if candidate.is_file():
            return str(candidate)
    return None


SASS_OPS = ("HMMA", "HGMMA", "QGMMA", "LDSM", "LDGSTS", "UTMALDG", "USETMAXREG", "MUFU", "BAR", "IMAD", "ISETP",
            "LDL", "STL")


def ptxas_resources(ptx, arch="sm_90"):
    """Registers, spills and stack from ptxas -v; with cuobjdump also SASS instruction counts."""
    ptxas = find_tool("ptxas")
    if ptxas is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        src, cubin = Path(tmp) / "k.ptx", Path(tmp) / "k.cubin"
        src.write_text(ptx)
        out = subprocess.run([ptxas, f"-arch={arch}", "-v", str(src), "-o", str(cubin)],
                             capture_output=True, text=True, check=True).stderr
        cuobjdump = find_tool("cuobjdump")
        sass = ""
        if cuobjdump:   # cuobjdump -sass runs nvdisasm: look for it next to cuobjdump too
            env = dict(os.environ, PATH=os.pathsep.join([str(Path(cuobjdump).parent),
                                                         os.environ.get("PATH", "")]))
            sass = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True,
                                  check=True, env=env).stdout

    def grab(pattern):
        m = re.search(pattern, out)
        return int(m.group(1)) if m else 0
    row = {"registers": grab(r"Used (\d+) registers"), "spill_stores": grab(r"(\d+) bytes spill stores"),
           "spill_loads": grab(r"(\d+) bytes spill loads"), "stack_bytes": grab(r"(\d+) bytes stack frame"),
           # ptxas's warning that it made every wgmma wait for the one before (a branch or a
           # non-wgmma write to their registers between them, or too few registers)
           "wgmma_serialized": int("mma_async instructions are serialized" in out)}
    if sass:
        ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9]*)", sass)
        row.update({f"sass_{op}": ops.count(op) for op in SASS_OPS})
        row["sass_total"] = len(ops)
        loop = main_loop(sass)
        row.update(loop_instructions=len(loop), loop_HMMA=loop.count("HMMA"),
                   loop_HGMMA=loop.count("HGMMA"),
                   loop_local=loop.count("LDL") + loop.count("STL"))
        row["step_instructions"], row["step_stall_cycles"] = step_loop_stalls(sass)
        if "USETMAXREG" in ops:
            row["consumer_local"] = consumer_local(ops)
    return row


def consumer_local(ops):
    """Local-memory accesses (LDL, STL) of a warp-specialised kernel's consumers: the opcodes from
    the consumers' setmaxnreg.inc to the producer's setmaxnreg.dec, as ptxas lays the two roles
    out (fa3's kernels: the consumers' code first, the producer's after it); None when the kernel
    does not have exactly that shape."""
    marks = [i for i, op in enumerate(ops) if op == "USETMAXREG"]
    if len(marks) != 2:
        return None
    part = ops[marks[0]:marks[1]]
    return part.count("LDL") + part.count("STL")


_SASS_LINE = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9]*)([^;]*)")
_HEX_WORD = re.compile(r"/\* (0x[0-9a-f]{16}) \*/")


def control_stalls(sass):
    """{address: stall cycles} of each instruction in a cuobjdump SASS listing (sm_70 on, sm_90
    included): the fixed number of cycles ptxas makes the warp wait before its next instruction
    (dependent latency or a pipe's issue rate; results of variable latency, MUFU, shared memory,
    wgmma, are waited for on scoreboard barriers instead), bits 41-44 of the instruction's second
    64-bit word, which cuobjdump prints on the line after it. Their sum over a straight-line
    stretch is the fewest cycles one warp takes to issue it with every variable-latency result on
    time (over a loop with branches it counts every arm: an upper bound of that)."""
    lines = sass.splitlines()
    stalls = {}
    for line, after in zip(lines, lines[1:]):
        m, hi = _SASS_LINE.match(line), _HEX_WORD.search(after)
        if m and hi and _HEX_WORD.search(line):
            stalls[int(m.group(1), 16)] = (int(hi.group(1), 16) >> 41) & 0xF
    return stalls


def _loops(sass):
    """(code, loops, mma): the listing's (address, opcode, operands) and its loops as (length,
    start, end), longest first, each from the target of a backward branch to that branch: those
    holding a tensor-core instruction when any does (mma True), else all of them."""
    code = [(int(m.group(1), 16), m.group(2), m.group(3)) for m in map(_SASS_LINE.match, sass.splitlines()) if m]
    loops = []
    for addr, op, rest in code:
        target = re.search(r"0x([0-9a-f]+)", rest) if op == "BRA" else None
        if target and int(target.group(1), 16) < addr:
            loops.append((addr - int(target.group(1), 16), int(target.group(1), 16), addr))
    loops.sort(key=lambda loop: -loop[0])   # longest first (a stable sort: ties keep their order)

    def has_mma(loop):
        return any(op in ("HMMA", "HGMMA", "QGMMA") for addr, op, _ in code if loop[1] <= addr <= loop[2])
    with_mma = [loop for loop in loops if has_mma(loop)]
    return code, with_mma or loops, bool(with_mma)


def main_loop(sass):
    """Opcodes of the main loop in a SASS listing: the longest loop (for the fa2 kernel: the loop
    over K/V blocks), among the loops that hold a tensor-core instruction when any does
    (decoding's fused combine has a longer loop after its K/V loop: the merge's, over the rows)."""
    code, loops, _ = _loops(sass)
    if not loops:
        return []
    _, start, end = loops[0]
    return [op for addr, op, _ in code if start <= addr <= end]


def step_loop_stalls(sass):
    """(instructions, stall cycles) of the innermost loop that holds a tensor-core instruction (the
    shortest such: fa3's step over K/V blocks inside its persistent loop over tiles; fa2's K/V
    loop), the stalls from `control_stalls`; (0, 0) without one."""
    code, loops, mma = _loops(sass)
    if not mma:
        return 0, 0
    _, start, end = loops[-1]
    cycles = control_stalls(sass)
    inside = [addr for addr, _, _ in code if start <= addr <= end]
    return len(inside), sum(cycles.get(addr, 0) for addr in inside)


def report(cc=(9, 0), skip=None, jobs=1, ptx_dir=None):
    """One row a compile target, in the variants' order; targets whose name matches the regex
    `skip` are listed as {"kernel": name, "skipped": True} without compiling them. jobs > 1
    compiles in that many processes (NVVM is single-threaded; the targets are independent)."""
    from numba import config
    if config.ENABLE_CUDASIM:
        raise RuntimeError("compile_report needs NUMBA_ENABLE_CUDASIM=0 (the simulator cannot compile)")
    work = [(mod, i, name) for mod in variant_modules()
            for i, name in enumerate(t[0] for t in _targets(mod))]
    todo = [(mod, i, cc, ptx_dir) for mod, i, name in work if not (skip and re.search(skip, name))]
    # longest first, so that the pool's last jobs are short ones: fa1's and fa2's backward K/V
    # kernels take 60-80 s each on a 2-core machine, every other target 0.5-12 s
    slow = {(mod, i) for mod, i, name in work if re.search(r"^fa[12] backward .* kv$", name)}
    todo.sort(key=lambda job: (job[0], job[1]) not in slow)
    if jobs > 1 and len(todo) > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor
        # spawn: a fresh interpreter imports numba with the simulator off, as this one did
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            done = dict(zip(((m, i) for m, i, _, _ in todo), pool.map(_compile_row, todo)))
    else:
        done = {(job[0], job[1]): _compile_row(job) for job in todo}
    return [done.get((mod, i)) or {"kernel": name, "skipped": True} for mod, i, name in work]


def _targets(mod):
    from importlib import import_module
    return list(import_module(mod).compile_targets())


def _compile_row(job):
    """The report row of target `index` of variant module `mod`."""
    mod, index, cc, ptx_dir = job
    os.environ["NUMBA_ENABLE_CUDASIM"] = "0"
    from importlib import import_module

    from numba import cuda
    module = import_module(mod)
    # fa3's wgmma and setmaxnreg need sm_90a (what numba-cuda builds for on a Hopper GPU)
    arch = getattr(module, "COMPILE_CC", cc)
    name, kern, argtypes, mma = _targets(mod)[index]
    # mma: the mma.sync (fa3: wgmma) count the tile shapes call for, or (in the PTX, in the main
    # loop) where some sit outside the loop (the atomic backward's last dQ product)
    total, in_loop = mma if isinstance(mma, tuple) else (mma, mma)
    start = time.perf_counter()
    ptx, _ = cuda.compile_ptx(kern.py_func, argtypes, cc=arch,
                              launch_bounds=kern.targetoptions.get("launch_bounds"))
    row = {"kernel": name, "expected_mma": total, "expected_loop_mma": in_loop,
           "compile_ptx_seconds": round(time.perf_counter() - start, 2), **ptx_counts(ptx)}
    if ptx_dir:   # the PTX alone (no ptxas): what a pure refactor must leave unchanged
        Path(ptx_dir).mkdir(parents=True, exist_ok=True)
        (Path(ptx_dir) / (re.sub(r"[^\w.=-]+", "_", name) + ".ptx")).write_text(ptx)
        return row
    row.update(ptxas_resources(ptx, arch="sm_" + "".join(map(str, arch))) or {})
    return row


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "0")
    skip = argv[argv.index("--skip") + 1] if "--skip" in argv else None
    jobs = int(argv[argv.index("--jobs") + 1]) if "--jobs" in argv else 1
    ptx_dir = argv[argv.index("--ptx") + 1] if "--ptx" in argv else None
    rows = report(skip=skip, jobs=jobs, ptx_dir=ptx_dir)
    if ptx_dir:
        print(f"PTX of {sum(not r.get('skipped') for r in rows)} kernels in {ptx_dir}")
        return
    if "--json" in argv:
        print(json.dumps(rows))
        return
    cols = ["kernel", "mma", "ldmatrix", "cp_async", "f64_ops", "registers", "spill_stores", "stack_bytes"]
    if "--sass" in argv:
        cols += [f"sass_{op}" for op in SASS_OPS] + ["sass_total", "loop_instructions", "loop_HMMA",
                                                     "loop_local", "step_instructions",
                                                     "step_stall_cycles",
                                                     "consumer_local"]
    widths = {c: max(len(c), *(len(str(r.get(c, "-"))) for r in rows)) for c in cols}
    print("  ".join(c.ljust(widths[c]) for c in cols))
    for r in rows:
        print("  ".join(str(r.get(c, "skipped" if r.get("skipped") and c != "kernel" else "-"))
                        .ljust(widths[c]) for c in cols))


if __name__ == "__main__":
    main()
