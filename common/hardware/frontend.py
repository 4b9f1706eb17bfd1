"""Numba's compiler frontend made faster where it is slow on our kernels, with no change to what
it makes: the PTX of every kernel is the same byte for byte (tests/test_compile.py compiles one
both ways; docs/compile_cache.md has the times and the whole comparison).

A kernel here is one function of thousands of IR blocks once its helpers are inlined (every
`device_function` in target.py is `inline="always"`), and three of numba-cuda 0.30's passes
scale badly with that:

1. Inlining copies IR nobody else holds. For each call site, Numba's InlineInlinables pass runs the
   callee's untyped passes afresh (`InlineWorker.inline_function` -> `run_untyped_passes`: a new
   FunctionIR) and hands that IR to `InlineWorker.inline_ir`, which deep-copies every block of it
   twice: once because it will mutate the IR, once to return an unmutated copy, which
   InlineInlinables discards. On this path neither copy protects anything. `inline_function` is
   made to call `inline_ir` with the block copies skipped. Only that path: `inline_ir` is also
   called by the typed pass that inlines `@overload(inline="always")` templates, whose IR is kept
   and reused, and there the copies are still made.

2. Variable liveness iterates in the wrong order. `analysis.compute_live_map` (run after most
   passes, to place `del`s and find dead code) solves two dataflow problems, definitions reaching
   each block (forward) and variables live at its entry (backward), by sweeping the blocks in
   label order until nothing changes. After inlining, label order is unrelated to the control
   flow, so a fact moves about one block a sweep and a kernel of thousands of blocks takes
   hundreds of sweeps over sets of thousands of names. `live_map` sweeps the forward problem in
   reverse postorder and the backward one in postorder, until nothing changes: the same
   equations, whose least solution does not depend on the order, in a few sweeps, over sets held
   as bits of Python integers (a union of thousands of names is one integer OR).

3. SSA reconstruction visits every block for every variable. `ssa._run_ssa` fixes the variables
   assigned more than once one at a time, each by two rewrites (`_run_block_rewrite`: fresh
   names for its definitions, then each use pointed at its reaching definition, with phis) that
   call a handler on every statement of every block, though only statements naming the variable
   change. The blocks naming each variable are known from the pass that found the violators
   (`_run_block_analysis` gathering defs and uses); `_rewrite` hands only those to the handler, in
   the same order, and copies the others as they are. A rewrite for one variable names no other
   violator anew (fresh names and phis are of that variable), so the index stays true for the
   rest of the loop.

Measured on a 2-core CPU (compile_ptx, cold; docs/compile_cache.md): all 74 compile-report
targets 1 432 s -> 352 s with the same PTX, fa2's backward K/V kernel 100 s -> 12 s, fa3's forward
at d=128 causal 10.8 s -> 4.6 s.

FA_STOCK_FRONTEND=1 in the environment leaves numba-cuda's frontend as it is (to rule these
patches out). Otherwise `install()` checks the details of numba-cuda it leans on (the inliner's
only `copy.deepcopy` is inline_ir's block copy; inline_function is run_untyped_passes then
inline_ir; compute_live_map's signature; ssa.py's two rewrites a violator after one analysis) and
leaves the compiler as it is where they differ, saying why in `skipped`.
tests/test_compile.py fails then, so that an upgrade is noticed rather than silently slower.
"""
import copy
import inspect
import os
import threading
from collections import defaultdict

import numpy as np

_fresh = threading.local()   # .on: inline_ir is running over IR made for this call site alone
installed = False
skipped = None               # why install() left the compiler alone, if it did
copies_skipped = 0           # blocks not copied (a count for tests/test_compile.py)
_originals = {}              # (module or class, name) -> numba-cuda's own, once installed


# --------------------------------------------------------------------------- 1. inlining

class _CopyModule:
    """What inline_closurecall sees as its `copy` module: the real one, except that deepcopy
    returns its argument while `_fresh.on` (inline_ir copying a block of IR nobody else holds)."""

    def __getattr__(self, name):
        return getattr(copy, name)

    @staticmethod
    def deepcopy(x, memo=None):
        global copies_skipped
        if getattr(_fresh, "on", False):
            copies_skipped += 1
            return x
        return copy.deepcopy(x, memo)


def _inline_function(self, caller_ir, block, i, function, arg_typs=None):
    """InlineWorker.inline_function: the callee's untyped IR, made afresh, inlined at statement i
    of `block` without copying it first. A worker that also updates type maps (not the untyped
    inliner's) types the callee inside inline_ir, which may compile and inline other functions
    whose IR is kept: it takes numba's own path."""
    if self._permit_update_type_and_call_maps:
        from numba.cuda.core.inline_closurecall import InlineWorker
        return _originals[InlineWorker, "inline_function"](self, caller_ir, block, i, function,
                                                           arg_typs=arg_typs)
    callee_ir = self.run_untyped_passes(function)
    _fresh.on = True
    try:
        return self.inline_ir(caller_ir, block, i, callee_ir, function.__code__.co_freevars,
                              arg_typs=arg_typs)
    finally:
        _fresh.on = False


# --------------------------------------------------------------------------- 2. liveness

def postorder(cfg, nodes):
    """The blocks `nodes` in postorder of a depth-first walk of `cfg` from its entry point (an
    explicit stack: kernels nest deeper than Python's recursion limit), then those the walk does
    not reach, in their given order."""
    entry = cfg.entry_point()
    order, seen = [], {entry}
    stack = [(entry, iter(cfg.successors(entry)))]
    while stack:
        node, edges = stack[-1]
        for succ, _ in edges:
            if succ not in seen:
                seen.add(succ)
                stack.append((succ, iter(cfg.successors(succ))))
                break
        else:
            stack.pop()
            order.append(node)
    return [n for n in nodes if n not in seen][::-1] + order


def live_map(cfg, blocks, var_use_map, var_def_map):
    """The variables live at the entry of each block: numba's compute_live_map, the same
    equations solved in a good order.
    - reach[b]: the names used or defined in b or in any block that reaches b;
      reach[b] >= use[b] | def[b] and reach[s] >= reach[b] for each edge b -> s.
    - live[b]: live[b] >= use[b], and live[p] >= (live[b] & reach[p]) - def[p] for each edge
      p -> b.
    Both are the least sets meeting their constraints; sweeping until no set grows finds them in
    any order, and in (reverse) postorder in a few sweeps. The sets are bits of integers
    (`_Names`) while solving, sets of names in the result."""
    if not blocks:
        return {}
    post = postorder(cfg, list(blocks))
    names = _Names(var_use_map, var_def_map)
    use = {b: names.bits(var_use_map[b]) for b in var_use_map}
    defs = {b: names.bits(var_def_map[b]) for b in var_def_map}
    succs = {b: [s for s, _ in cfg.successors(b)] for b in var_def_map}
    reach = defaultdict(int)
    forward = [b for b in reversed(post) if b in var_def_map] + \
        [b for b in var_def_map if b not in blocks]
    grew = True
    while grew:
        grew = False
        for b in forward:
            here = reach[b] = reach[b] | defs[b] | use[b]
            for s in succs[b]:
                there = reach[s]
                if there | here != there:
                    reach[s] = there | here
                    grew = True
    live = {b: use[b] for b in blocks}
    preds = {b: [p for p, _ in cfg.predecessors(b)] for b in live}
    grew = True
    while grew:
        grew = False
        for b in post:
            if b not in live:
                continue
            here = live[b]
            for p in preds[b]:
                there = live[p]
                more = there | (here & reach[p] & ~defs[p])
                if more != there:
                    live[p] = more
                    grew = True
    return {b: names.names(x) for b, x in live.items()}


class _Names:
    """Sets of the names in the given maps' sets as bits of a Python integer (bit i: the i-th name
    met), and back."""

    def __init__(self, *maps):
        self.index, self.order = {}, []
        for mapping in maps:
            for names in mapping.values():
                for name in names:
                    if name not in self.index:
                        self.index[name] = len(self.order)
                        self.order.append(name)
        self.nbytes = len(self.order) // 8 + 1

    def bits(self, names):
        if not names:
            return 0
        raw, index = bytearray(self.nbytes), self.index
        for name in names:
            i = index[name]
            raw[i >> 3] |= 1 << (i & 7)
        return int.from_bytes(raw, "little")

    def names(self, bits):
        if not bits:
            return set()
        raw = np.frombuffer(bits.to_bytes(self.nbytes, "little"), np.uint8)
        order = self.order
        return {order[i] for i in np.flatnonzero(np.unpackbits(raw, bitorder="little")).tolist()}


# --------------------------------------------------------------------------- 3. SSA

_ssa_index = threading.local()   # .scope, .labels: the function being made SSA, name -> labels


def _block_analysis(blocks, states, handler):
    """ssa._run_block_analysis, keeping the labels that name each variable when the analysis is
    the violators' (defs: (assignment, label) lists, uses: label sets, by name)."""
    _originals[_ssa_module(), "_run_block_analysis"](blocks, states, handler)
    if "defs" in states and "uses" in states and blocks:
        labels = defaultdict(set)
        for name, found in states["defs"].items():
            labels[name].update(label for _, label in found)
        for name, used in states["uses"].items():
            labels[name].update(used)
        _ssa_index.scope, _ssa_index.labels = next(iter(blocks.values())).scope, labels


def _rewrite(blocks, states, handler):
    """ssa._run_block_rewrite over the blocks that name states["varname"]: the others are copied
    as they are (a handler returns every statement that does not name the variable unchanged)."""
    from numba.cuda.core import ir
    name, labels = states.get("varname"), getattr(_ssa_index, "labels", None)
    if name is None or labels is None or states.get("scope") is not _ssa_index.scope:
        return _originals[_ssa_module(), "_run_block_rewrite"](blocks, states, handler)
    named = labels.get(name, ())
    newblocks = {}
    for label, blk in blocks.items():
        if label in named:
            newblocks.update(_originals[_ssa_module(), "_run_block_rewrite"](
                {label: blk}, states, handler))
        else:
            newblk = ir.Block(scope=blk.scope, loc=blk.loc)
            newblk.body = list(blk.body)
            newblocks[label] = newblk
    return newblocks


def _ssa_module():
    from numba.cuda.core import ssa
    return ssa


# --------------------------------------------------------------------------- install

def _unexpected():
    """None when numba-cuda is the one these patches were written against, else why not."""
    from numba.cuda.core import analysis, inline_closurecall, ir_utils
    for owner, name, _ in _patches():
        if getattr(owner.__dict__[name], "__module__", None) == __name__:
            return f"{owner.__name__}.{name} is patched already (another load of this module)"
    if inspect.getsource(inline_closurecall).count("copy.deepcopy(") != 1:
        return "inline_closurecall.py calls copy.deepcopy other than once"
    body = inspect.getsource(inline_closurecall.InlineWorker.inline_function)
    if "self.run_untyped_passes(function)" not in body or "self.inline_ir(" not in body:
        return "InlineWorker.inline_function is not run_untyped_passes then inline_ir"
    if list(inspect.signature(analysis.compute_live_map).parameters) != \
            ["cfg", "blocks", "var_use_map", "var_def_map"] or \
            ir_utils.compute_live_map is not analysis.compute_live_map:
        return "analysis.compute_live_map is not the one ir_utils imports, of the known signature"
    from numba.cuda.core import ssa
    source = inspect.getsource(ssa)
    if source.count("_run_block_rewrite(") != 3 or source.count("_run_block_analysis(") != 2 or \
            "states = dict(defs=defs, uses=uses)" not in source or \
            'states["varname"] = varname' not in inspect.getsource(ssa._fix_ssa_vars):
        return "ssa.py's rewrites are not the two per violator over one index of defs and uses"
    return None


def _patches():
    from numba.cuda.core import analysis, inline_closurecall, ir_utils, ssa
    return [(inline_closurecall, "copy", _CopyModule()),
            (inline_closurecall.InlineWorker, "inline_function", _inline_function),
            (analysis, "compute_live_map", live_map),
            (ir_utils, "compute_live_map", live_map),
            (ssa, "_run_block_analysis", _block_analysis),
            (ssa, "_run_block_rewrite", _rewrite)]


def install():
    """Patch numba-cuda's frontend (once a process; target.py calls it off the simulator, which
    compiles nothing). Returns whether it is installed."""
    global installed, skipped
    if installed or skipped:
        return installed
    if os.environ.get("FA_STOCK_FRONTEND", "").strip() not in ("", "0"):
        skipped = "FA_STOCK_FRONTEND is set"
        return False
    try:
        skipped = _unexpected()
    except (ImportError, AttributeError, OSError, TypeError) as e:
        skipped = f"numba-cuda's frontend unreadable ({e})"
    if skipped:
        return False
    for owner, name, value in _patches():
        _originals[owner, name] = owner.__dict__[name]
        setattr(owner, name, value)
    installed = True
    return True


def uninstall():
    """Undo install() (tests compare a kernel's PTX both ways)."""
    global installed
    for (owner, name), value in _originals.items():   # kept: a compile under way still finds them
        setattr(owner, name, value)
    installed = False
