"""Sweeps over several GPUs: Hydra's joblib launcher, each worker process pinned to one GPU.

    python experiments/run.py -m hydra/launcher=gpus variant=fa2,fa3 problem.seqlen=4096,16384
    python experiments/run.py -m hydra/launcher=slurm ...      # a SLURM cluster, through submitit

`hydra/launcher=gpus` (conf/hydra/launcher/gpus.yaml) is hydra-joblib-launcher with one worker
process per visible GPU (`n_jobs: ${fa_gpus:}`, `worker_count` below). A worker, before anything in
it touches CUDA, takes the first free GPU slot: an exclusive lock (flock) on a file in the sweep's
directory, held for the life of the process, and sets CUDA_VISIBLE_DEVICES to that GPU alone
(`pin_this_process`). So one job runs on a GPU at a time, each job goes to whichever GPU is free,
and a worker that joblib replaces hands its GPU to the next. The rows land in each job's and the
sweep's results.csv as in a serial sweep (experiments/run.py appends under a lock).

On SLURM (`hydra/launcher=slurm`, conf/hydra/launcher/slurm.yaml: hydra-submitit-launcher) every job
is its own allocation of one GPU, so nothing is pinned here.
"""
import fcntl
import os
import subprocess
import sys
from pathlib import Path

_pinned = None   # (the GPU this process took, its open lock file) once pin_this_process ran


def visible_gpus():
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES names them (ids or UUIDs): its
    entries when set, else 0 .. n-1 for the n GPUs the driver shows. The driver is asked in a
    child process, so this process's CUDA stays uninitialised (and can still be pinned)."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [g.strip() for g in listed.split(",") if g.strip()]
    root = str(Path(__file__).resolve().parents[1])
    out = subprocess.run([sys.executable, "-c", "import common; print(common.gpu_count())"],
                         capture_output=True, text=True, cwd=root)
    count = int(out.stdout.strip() or 0) if out.returncode == 0 else 0
    return [str(i) for i in range(count)]


def worker_count():
    """Parallel workers for `hydra/launcher=gpus`: one per visible GPU (one without a GPU, where
    the simulator runs the jobs; hydra.launcher.n_jobs=N overrides)."""
    return max(1, len(visible_gpus()))


def pin_this_process(lock_dir):
    """Give this process one GPU of the visible ones for its whole life: the first whose lock file
    in lock_dir no other process holds (if every one is held, wait for GPU pid % n). Sets
    CUDA_VISIBLE_DEVICES and returns the GPU's name; None without GPUs. Idempotent. Must run
    before this process initialises CUDA (numba or torch), which reads CUDA_VISIBLE_DEVICES once."""
    global _pinned
    if _pinned is not None:
        return _pinned[0]
    gpus = visible_gpus()
    if not gpus:
        return None
    if "numba.cuda" in sys.modules or "torch" in sys.modules:
        raise RuntimeError("pin_this_process must run before numba.cuda or torch is imported: "
                           "CUDA reads CUDA_VISIBLE_DEVICES once, at initialisation")
    lock_dir = Path(lock_dir)
    lock_dir.mkdir(parents=True, exist_ok=True)
    for slot in range(len(gpus)):
        lock = open(lock_dir / f".gpu{slot}.lock", "w")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            lock.close()
    else:   # more workers than GPUs (hydra.launcher.n_jobs raised by hand): queue for one
        slot = os.getpid() % len(gpus)
        lock = open(lock_dir / f".gpu{slot}.lock", "w")
        fcntl.flock(lock, fcntl.LOCK_EX)
    os.environ["CUDA_VISIBLE_DEVICES"] = gpus[slot]
    _pinned = (gpus[slot], lock)
    return gpus[slot]
