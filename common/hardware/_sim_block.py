"""An event-driven thread block for Numba's CUDA simulator (numba-cuda 0.30's
`numba.cuda.simulator.kernel.BlockManager`), installed by common/hardware/target.py in the simulator.

The simulator runs each CUDA thread of a block as a Python thread. Its BlockManager releases a
`syncthreads` by polling: the launching thread loops over every thread's "blocked" flag, holding
the GIL, until all are set. The GIL then changes hands only when the switch interval expires, so
each barrier costs a few intervals; with Python's 5 ms default a barrier of 128 threads took ~27 ms,
and a short interval (the 0.2 ms this codebase used) makes the runnable threads preempt one
another all the time instead (~7 ms a barrier, half of it in the kernel's futex calls).

Here the last thread to reach a barrier releases the others (a generation count under one
condition variable), and the launching thread sleeps until the block's threads have finished or
one has raised. Nothing polls, so the switch interval can stay long: a thread runs until it blocks
at a barrier or a collective. Measured on a 2-core machine (128 threads, 200 barriers): 2.6 ms a
barrier against 6.9 with the polling manager at 0.2 ms; whole simulated tests 2-4x faster.

Semantics kept from the simulator's BlockManager: a thread that returns no longer counts at later
barriers (as on sm_70+); an exception in one thread is raised from the launch at once, after
releasing the threads waiting at the block barrier (each raises "abort flag set"), and threads
stuck elsewhere (a named barrier or an mbarrier: their stand-ins time out) are left behind as
daemons, as the simulator leaves them.
"""
import sys
import threading

import numpy as np

_kernel = None              # numba.cuda.simulator.kernel, imported by install() (in the simulator
                            # only: _sim_collectives, importable on a GPU too, takes Barrier here)
SWITCH_INTERVAL_S = 5e-3    # Python's default: with no polling thread, a long interval is best


class Barrier:
    """A reusable barrier of `size` threads, as threading.Barrier without its timeout, abort and
    draining states (about half its cost a wait): the collectives of _sim_collectives that meet only
    their own group (a warp, a warpgroup) wait on one; a thread block's barrier is one too (Block)."""

    def __init__(self, size):
        self.cond = threading.Condition()
        self.size = size
        self.waiting = 0            # threads at the barrier now
        self.generation = 0         # barriers completed

    def _release(self):
        self.waiting = 0
        self.generation += 1
        self.cond.notify_all()

    def _stop(self):
        """Whether waiting threads must leave now (a Block whose thread raised)."""
        return False

    def wait(self):
        with self.cond:
            generation = self.generation
            self.waiting += 1
            if self.waiting == self.size:
                self._release()
            else:
                while generation == self.generation and not self._stop():
                    self.cond.wait()


class Block(Barrier):
    """The barrier of one simulated thread block: its size is the threads that have not returned;
    the first exception in a thread releases the others, which raise."""

    def __init__(self, threads):
        super().__init__(threads)
        self.error = None           # the first thread's (exception, traceback)

    def _stop(self):
        return self.error is not None

    def syncthreads(self):
        if self.error is not None:
            raise RuntimeError("abort flag set on syncthreads call")
        self.wait()
        if self.error is not None:
            raise RuntimeError("abort flag set on syncthreads clear")

    def exited(self, error=None):
        """A thread's body returned (or raised `error`)."""
        with self.cond:
            self.size -= 1
            if error is not None and self.error is None:
                self.error = error
            if self.error is not None or self.size == 0:
                self.cond.notify_all()
            elif self.waiting == self.size:   # the others all wait for it: the barrier completes
                self._release()


def _thread_run(self):
    """BlockThread.run: the body, then the block told (with the exception, named by thread)."""
    try:
        super(_kernel.BlockThread, self).run()
    except Exception as e:
        where = f"tid={list(self.threadIdx)} ctaid={list(self.blockIdx)}"
        self.exception = (type(e)(f"{where}: {e}" if str(e) else where), sys.exc_info()[2])
        self._block.exited(self.exception)
        return
    self._block.exited()


def _syncthreads(self):
    self._block.syncthreads()


def _run_block(self, grid_point, *args):
    """BlockManager.run: start the block's threads, sleep until they finish or one raises."""
    block = Block(int(np.prod(self._block_dim)))
    threads = []
    for block_point in np.ndindex(*self._block_dim):
        def target():
            self._f(*args)

        t = _kernel.BlockThread(target, self, grid_point, block_point, self._debug)
        t._block = block
        threads.append(t)
    for t in threads:
        t.start()
    with block.cond:
        while block.size and block.error is None:
            block.cond.wait()
        error = block.error
    if error is not None:
        raise error[0].with_traceback(error[1])


def install():
    """Replace the simulator's polling block manager with this one, and lengthen the switch
    interval (the short one only helped the polling)."""
    global _kernel
    from numba.cuda.simulator import kernel as _kernel
    _kernel.BlockThread.run = _thread_run
    _kernel.BlockThread.syncthreads = _syncthreads
    _kernel.BlockManager.run = _run_block
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    from numba.cuda.simulator import kernelapi
    kernelapi.FakeCUDAShared.__init__ = _poisoned_shared(kernelapi.FakeCUDAShared.__init__)


def _poisoned_shared(zeroed_init):
    """The simulator's dynamic shared memory starts as zeros, which a GPU's does not (it holds
    whatever the SM's last block left): a kernel that reads a word it never wrote (a column a zero
    fill should have cleared, a row no copy reached) would pass every simulated test. Here every
    thread block's starts as 0xFF bytes instead, NaN as fp32, bf16 and fp16, so such a read
    reaches the output."""
    def init(self, dynshared_size):
        zeroed_init(self, dynshared_size)
        self._dynshared.fill(-1)
    return init
