"""A call replayed: its launches recorded once per geometry, then re-issued with new addresses.

A training step calls attention with the same shapes, strides, dtypes and options every time. The
first call with a geometry runs every check and keeps a template (common/host/problem.py), but each
later call still walks the variant's Python: it builds the problem's views, carves its work
arrays, looks up its kernels and packs every launch's arguments (issue: host overhead; the
standard forward, three launches, spent ~78 us a call on the host for ~15 us of kernels). What
changes from call to call is only the addresses: of the inputs, of the outputs and of the work
arrays, which are new allocations each call.

`replayed` wraps a variant's forward or backward. The second call with a key (every input's
shape, strides, dtype and device, and every keyword argument) runs as usual while it is recorded:
each `launching.launch` (kernel, grid, block, shared memory, arguments) and each allocation. If the
call did nothing else, the record becomes a Plan: its launches packed once
(`launching.PackedLaunch`), each view's address written as base + offset, a base being an input or
one of the call's allocations. From the third call on a call allocates what the recorded one did,
writes the new addresses into the packed parameters and launches on the current stream: the
launch parameters packed once per key.

What a recorded call may do, so that replaying it is the same call: launch through
`launching.launch` on the current stream, over views of its inputs, of tensors it allocated with
`torch.empty`, of `arrays.placeholder`s (the same in every call) and of arguments the host makes
from such views through `derived` (fa3's TMA tensor maps: made for each replay's addresses), and
return a tuple of tensors it allocated. Anything else makes no plan, and the key
keeps the ordinary path: any other torch operation (a fill, a copy, a read back to the host: seen
by a TorchDispatchMode while recording), a view of other memory, a launch on another stream, a
keyword argument that is an array (preallocated outputs, gradients, FP8 descales: such a call is
never recorded, nor its key kept), an allocation on another device, or two inputs that are the
same tensor. A misaligned input takes the ordinary path, so it raises what it always raised. In
the simulator nothing is recorded.

FA_REPLAY=0 in the environment turns replay off (every call takes the ordinary path): the
switch for measuring what it saves.

What the record cannot see: device work that bypasses both `launching.launch` and torch (a Numba
kernel launched directly, a Numba or CuPy copy or fill, a host read through them). A wrapped body
must do its device work through `launching.launch` and torch; a body that does not must not be
wrapped (the variable-length paths, which read lengths back, are not; decoding is, for its calls
with check=False only: `replayed(..., when=)`).
"""
import atexit
import functools
import os
import sys
import threading

from common.hardware import target
from common.host import arrays, launching
from common.host.problem import misaligned, remember, torch_call_key

ENABLED = os.environ.get("FA_REPLAY", "1") != "0"
_TRY, _NONE = "try", "none"   # a key's state before it has a Plan: record the next call / never
_PLAIN = (type(None), bool, int, float, str)


def replayed(n_inputs, when=None):
    """Decorator for fn(*inputs, **options) -> tuple of new torch tensors, `n_inputs` arrays taken
    positionally (forward: q, k, v; backward: do, q, k, v, o, lse): see the module's docstring.
    when(options): whether a call may be recorded at all (None: every call), for a body whose
    other calls read data back (decoding's check=True), which never give a plan: they take the
    ordinary path at once instead of paying a record (and its first one's torch imports)."""
    def wrap(fn):
        plans = {}
        _ALL_PLANS.append(plans)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            if target.SIMULATOR or not ENABLED or len(args) != n_inputs or _recording() or \
                    (when is not None and not when(kwargs)):
                return fn(*args, **kwargs)   # within a recorded call: its launches are recorded
            try:
                key = torch_call_key(args, tuple(kwargs.items()))
                plan = plans.get(key) if key is not None else _NONE
            except TypeError:   # an unhashable option (a list): no plan
                return fn(*args, **kwargs)
            if type(plan) is Plan:
                result = plan(args)
                if result is not None:
                    return result
                return fn(*args, **kwargs)   # misaligned: the ordinary path says so
            if plan is None:   # the first call: every check; the next one is recorded (it
                result = fn(*args, **kwargs)   # starts the one-time imports a record needs)
                if _plain(kwargs):   # an array among them is in the key by identity: never kept
                    remember(plans, key, _TRY)
                return result
            if plan is _TRY:
                if not _dispatch_ready():   # torch's imports still running: record a later call
                    return fn(*args, **kwargs)
                plan, result = _record(fn, args, kwargs)
                plans[key] = plan
                return result
            return fn(*args, **kwargs)
        call.plans = plans
        return call
    return wrap


_ALL_PLANS = []   # every replayed function's plans
_recipes = threading.local()   # .of while a call is recorded: id(view) -> (view, make, sources)


def _recording():
    """True while this thread records a call (a replayed function called within it runs its
    ordinary path, so that the outer record sees its launches)."""
    return getattr(_recipes, "of", None) is not None


def derived(make, sources, stream):
    """make(sources, stream): a KernelView the host makes from `sources` (a tuple, nested tuples
    allowed, whose KernelViews are over the call's inputs or allocations) for a launch on `stream`
    (fa3: its TMA tensor maps, over q, k, v). A recorded call's plan makes it anew in each replay
    from the replay's views and stream (unless it kept one for those addresses: _Derived), so
    `make` must be cheap for views it saw before (it caches). What `make` does is not recorded:
    it must not depend on the sources' contents, and where it cannot work under CUDA-graph capture
    it must say so (tensormaps.tensor_maps uploads a new map synchronously: under capture it
    raises). `sources` may hold KernelViews, tuples of them and plain numbers or strings; anything
    else makes a recorded call unplannable."""
    view = make(sources, stream)
    recipes = getattr(_recipes, "of", None)
    if recipes is not None:
        recipes[id(view)] = (view, make, sources)
    return view


def _plain(kwargs):
    """True if every keyword argument is None, a bool, int, float or str, or a tuple of them."""
    for value in kwargs.values():
        if not isinstance(value, _PLAIN) and not (
                type(value) is tuple and all(isinstance(x, _PLAIN) for x in value)):
            return False
    return True


def forget():
    """Drop every plan: each key's next call takes the ordinary path again (tests)."""
    for plans in _ALL_PLANS:
        plans.clear()


class Plan:
    """A recorded call: its outputs (shape, dtype), its work arrays (bytes) and its
    PackedLaunches, whose views lie at base + offset, the bases being the inputs' addresses, then
    the allocations' in the order the recorded call made them (`made`: ("out", i) or
    ("work", i)), then the `derived` views' (_Derived), each after those among its own
    sources."""

    def __init__(self, outputs, work, made, launches, device, derived=()):
        self.outputs, self.work, self.made, self.launches, self.device, self.derived = \
            outputs, work, made, launches, device, derived
        self.local = threading.local()

    def __call__(self, inputs):
        """The call over `inputs`, replayed (None: an input's address is misaligned)."""
        bases = [x.data_ptr() for x in inputs]
        if misaligned(*bases):
            return None
        buffers = getattr(self.local, "buffers", None)
        if buffers is None:
            buffers = self.local.buffers = launching.replay_buffers(self.launches)
        like = inputs[0]
        outs = [like.new_empty(shape, dtype=dtype) for shape, dtype in self.outputs]
        stream = arrays.torch_stream(self.device.index)
        work, free = _work_arrays(self.work, self.device, stream, like)
        try:
            for kind, i in self.made:
                bases.append(outs[i].data_ptr() if kind == "out" else work[i])
            # the derived views held until the launches are issued (another thread may drop
            # one from its `kept` meanwhile)
            made = []
            for derived_view in self.derived:
                made.append(derived_view.view(bases, stream))
                bases.append(made[-1].ptr)
            launching.replay(self.launches, buffers, bases, stream)
        finally:
            free()
        return tuple(outs)


def _work_arrays(sizes, device, stream, like):
    """(addresses of work arrays of `sizes` bytes, a function that frees them) from torch's caching
    allocator itself, on `stream` (~1 us each, torch.empty ~4-7 us), which reuses them in stream
    order after the free, as a tensor's memory; or, where that entry point is missing or another
    device is current, from new tensors (the free drops them)."""
    if not sizes:
        return (), _nothing
    torch = sys.modules["torch"]
    alloc = getattr(torch._C, "_cuda_cudaCachingAllocator_raw_alloc", None)
    if alloc is None or torch._C._cuda_getDevice() != device.index:
        kept = [like.new_empty((n,), dtype=torch.uint8) for n in sizes]
        return [x.data_ptr() for x in kept], kept.clear
    delete = torch._C._cuda_cudaCachingAllocator_raw_delete
    ptrs = []

    def free():
        for ptr in ptrs:
            delete(ptr)
    try:
        for n in sizes:
            ptrs.append(alloc(n, stream))
    except BaseException:
        free()
        raise
    return ptrs, free


def _nothing():
    pass


class _Derived:
    """A `derived` view of a Plan: make(sources, stream) over a replay's views, its sources the
    recorded ones with each KernelView as a _Source. The views made for the last KEEP sets of the
    addresses they depend on are kept (a training step's inputs come back at the same addresses):
    a replay over one of those skips make (~10 us for fa3's three tensor maps). Kept here, the view
    stays alive even if make's own cache drops it. (Neither keeps a view alive for as long as a
    CUDA graph that captured a launch reading it: a graph over fa3 must be replayed while its
    inputs' maps are among the last few hundred made, tensormaps.tensor_maps' cache.)"""
    KEEP = 8

    def __init__(self, make, sources):
        self.make, self.sources, self.kept = make, sources, {}
        self.used = tuple(sorted(set(_bases_of(sources))))

    def view(self, bases, stream):
        key = tuple([bases[i] for i in self.used])
        view = self.kept.get(key)
        if view is None:
            view = self.make(_rebuilt(self.sources, bases), stream)
            remember(self.kept, key, view, self.KEEP)
        return view


def _bases_of(sources):
    if type(sources) is _Source:
        yield sources[0]
    elif type(sources) is tuple:
        for x in sources:
            yield from _bases_of(x)


def _rebuilt(sources, bases):
    """A derived view's sources for a replay: each _Source a KernelView at the replay's
    address."""
    if type(sources) is _Source:
        return launching.KernelView.over(bases[sources[0]] + sources[1], sources[2], None)
    if type(sources) is tuple:
        return tuple(_rebuilt(x, bases) for x in sources)
    return sources


class _Bases:
    """resolve(view) -> (base, offset) of a view a recorded launch reads, or None for a
    placeholder (the same in every call); a `derived` view gets the next base after the
    allocations, its sources resolved in turn (`derived`: _Derived, a replay's order).
    (An object, not closures: a closure that calls itself is a reference cycle, which would keep
    the recorded call's inputs, and so an autograd graph, alive until the collector runs.)"""

    def __init__(self, inputs, allocated, recipes):
        self.owners = {id(x): (i, x.data_ptr()) for i, x in enumerate(inputs)}
        self.allocated, self.recipes = allocated, recipes
        self.next_base = len(inputs) + len(allocated)
        self.derived, self.derived_base = [], {}

    def __call__(self, view):
        recipe = self.recipes.get(id(view))   # first: a made view may sit in an allocation
        if recipe is not None and recipe[0] is view:
            if id(view) not in self.derived_base:
                self.derived.append(_Derived(recipe[1], self.sources(recipe[2])))
                self.derived_base[id(view)] = self.next_base + len(self.derived) - 1
            return self.derived_base[id(view)], 0
        hit = self.owners.get(id(view.owner))
        if hit is not None:
            return hit[0], view.ptr - hit[1]
        if isinstance(view.owner, sys.modules["torch"].Tensor):
            base = self.allocated.get(view.owner.data_ptr())
            if base is not None:
                return base, view.ptr - view.owner.data_ptr()
        if arrays.is_placeholder(view):
            return None
        raise _Unplannable(f"a launch reads a {type(view.owner).__name__} that is neither an "
                           "input nor allocated by the call")

    def sources(self, x):
        """A derived view's sources, each KernelView as a _Source (a placeholder as itself)."""
        if type(x) is launching.KernelView:
            where = self(x)
            return x if where is None else _Source((*where, x.layout))
        if type(x) is tuple:
            return tuple(self.sources(y) for y in x)
        if isinstance(x, _PLAIN) or type(x).__module__ == "numpy" and hasattr(x, "dtype"):
            return x   # a number or string: the same in every call
        raise _Unplannable(f"a derived argument's sources hold a {type(x).__name__}, which a "
                           "replay could not remake")


class _Source(tuple):
    """(base, offset, layout): a KernelView among a derived view's recorded sources."""


class _Unplannable(Exception):
    """What a recorded call did that a replay would not repeat."""


def _record(fn, args, kwargs):
    """(Plan, or _NONE, and fn's result) from one call of fn recorded."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    if _get_current_dispatch_mode() is not None:   # under another mode (tracing, counting):
        return _TRY, fn(*args, **kwargs)             # record a later call
    watch = _allocations_mode()()
    outer, _recipes.of = getattr(_recipes, "of", None), {}
    recipes = _recipes.of
    try:
        with launching.recording() as launches, watch:
            result = fn(*args, **kwargs)
    finally:
        _recipes.of = outer
    try:
        return _plan(args, launches, watch, result, recipes), result
    except _Unplannable as why:
        if "pytest" in sys.modules:   # the GPU tests check which calls replay, and why not
            _REFUSALS.append(str(why))
        return _NONE, result


@functools.lru_cache(maxsize=None)
def _allocations_mode():
    """The TorchDispatchMode that watches a recorded call: `made`, torch.empty's results in order;
    `foreign`, any other operation. (A class made once: torch is imported only when a call is
    recorded, and each new mode class costs torch work at its first dispatch.)"""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Allocations(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.made, self.foreign = [], None

        def __torch_dispatch__(self, func, types, f_args=(), f_kwargs=None):
            f_kwargs = f_kwargs or {}
            out = func(*f_args, **f_kwargs)
            if func is torch.ops.aten.empty.memory_format and not f_kwargs.get("pin_memory") \
                    and f_kwargs.get("memory_format") in (None, torch.contiguous_format) \
                    and f_kwargs.get("layout") in (None, torch.strided):
                self.made.append(out)
            elif func is not torch.ops.aten.detach.default and self.foreign is None:
                self.foreign = f"{func} ({_caller()})"   # detach: an alias, nothing to replay
            return out
    return Allocations


_REFUSALS = []   # why recent recordings made no plan (read by tests/test_call_path.py)
_first_use = None   # the thread running the first use of a dispatch mode (_first_use_apart)
FIRST_USE_EXIT_WAIT = 15.0   # seconds an exiting process waits for that thread
IMPORT_SWITCH_INTERVAL = 1e-4   # the interpreter's switch interval (s) while that thread imports
_first_use_lock = threading.Lock()


def _dispatch_ready():
    """True once a dispatch mode has been used in this process (the record's TorchDispatchMode
    can then start at once). The first call that would be recorded (the second of a geometry)
    starts that first use on a thread of its own and returns False while it runs: the first use
    imports torch._dynamo (and through it torch.fx, sympy, torch.distributed: ~4-5 s of CPU),
    which torch defers to then, and a call that waited for it would stall a training loop's
    second step. Calls go the ordinary path (every check, ~ms of host time) until it is done, and
    the next one is recorded.

    The import holds the GIL while it runs, so it is started no earlier than a second call: a
    process's first calls (the cold compile, or the cubins loaded from the cache, of the forward
    and the backward) run without it (started by the first call, it took 2-5 s of an H100's
    warm first call, docs/compile_cache.md). While it runs, the interpreter's switch interval is
    IMPORT_SWITCH_INTERVAL instead of its 5 ms: each time the calling thread gives the GIL up (a
    driver call, a synchronize) it waits at most that long to get it back. Where
    torch._dynamo is imported already (torch.compile ran), there is nothing to wait for. The
    thread is a daemon that the process's exit waits for up to FIRST_USE_EXIT_WAIT seconds (an
    atexit join): an exit during the import lets it finish, and an import that never finishes
    cannot hold the process (as a non-daemon thread did: pytest-xdist workers on the GPU host,
    every test passed, never exited)."""
    global _first_use
    if _first_use is None:
        with _first_use_lock:
            if _first_use is None:
                if "torch._dynamo" in sys.modules:
                    _first_use = threading.Thread(target=lambda: None, daemon=True)
                else:
                    _first_use = threading.Thread(target=_first_use_apart,
                                                  args=(_allocations_mode,
                                                        sys.getswitchinterval()),
                                                  name="replay: first dispatch mode", daemon=True)
                    sys.setswitchinterval(IMPORT_SWITCH_INTERVAL)
                    atexit.register(_first_use.join, FIRST_USE_EXIT_WAIT)
                _first_use.start()
    return not _first_use.is_alive()


def warm_up():
    """Wait for the one-time imports a record needs (_dispatch_ready), so that the second call of
    each geometry is recorded and the third replayed, deterministically (the GPU tests call it)."""
    _dispatch_ready()
    _first_use.join()


def _first_use_apart(mode_class, switch_interval):
    """Run a dispatch mode of `mode_class()` over one allocation, then set the interpreter's switch
    interval back to `switch_interval`. Its import leaves reference cycles through its frames; the
    frames of its callers would then stay alive until the collector runs
    (experiments/probes/replay_refs.py saw it, when a recorded call itself made the first use): on
    a thread of its own the import has no caller of ours."""
    try:
        import torch

        with mode_class()():
            torch.empty(1)
    finally:
        sys.setswitchinterval(switch_interval)


def _caller():
    """file:line of the innermost frame of this project's code (what ran a foreign operation)."""
    import os
    import traceback
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    frames = [f for f in traceback.extract_stack()[:-2] if f.filename.startswith(root)
              and not f.filename.endswith("replay.py")]
    return f"{os.path.relpath(frames[-1].filename, root)}:{frames[-1].lineno}" if frames else "?"


def _plan(inputs, launches, watch, result, recipes):
    """The Plan of a recorded call, or _Unplannable saying why there is none (recipes: the
    `derived` views it made)."""
    if watch.foreign is not None:
        raise _Unplannable(f"the call ran {watch.foreign}")
    if len({id(x) for x in inputs}) != len(inputs):
        raise _Unplannable("two inputs are the same tensor")
    made = watch.made
    device = inputs[0].device
    if any(x.device != device for x in made):   # a replay allocates on the first input's device
        raise _Unplannable("an allocation on another device than the first input's")
    stream = arrays.torch_stream(device.index)
    # An allocation is known by its address (the caller may hold an alias of what torch.empty
    # returned inside the dispatch mode); the call's allocations are alive, so addresses differ
    # (an empty one has none: no plan).
    allocated = {x.data_ptr(): len(inputs) + j for j, x in enumerate(made)}
    if len(allocated) != len(made) or 0 in allocated:
        raise _Unplannable("an allocation of no bytes")
    torch = sys.modules["torch"]
    resolve = _Bases(inputs, allocated, recipes)
    packed = []
    for record in launches:
        if record[4] != stream:
            raise _Unplannable("a launch is on another stream than the current one")
        packed.append(launching.PackedLaunch(record, resolve))
    if type(result) is not tuple:
        raise _Unplannable(f"the call returned a {type(result).__name__}, not a tuple")
    returned = {}   # index in made -> position in the result
    for i, x in enumerate(result):   # each one a whole allocation, as allocated
        j = allocated.get(x.data_ptr()) if isinstance(x, torch.Tensor) else None
        if j is None or j - len(inputs) in returned:
            raise _Unplannable("the call returned something other than the tensors it allocated")
        y = made[j - len(inputs)]
        if (x.shape, x.stride(), x.dtype) != (y.shape, y.stride(), y.dtype) \
                or not y.is_contiguous():
            raise _Unplannable("the call returned a view of a tensor it allocated")
        returned[j - len(inputs)] = i
    outputs, work, order = [None] * len(result), [], []
    for j, x in enumerate(made):
        if j in returned:
            outputs[returned[j]] = (tuple(x.shape), x.dtype)
            order.append(("out", returned[j]))
        else:
            order.append(("work", len(work)))
            work.append(x.numel() * x.element_size())
    return Plan(tuple(outputs), tuple(work), tuple(order), tuple(packed), device,
                tuple(resolve.derived))
