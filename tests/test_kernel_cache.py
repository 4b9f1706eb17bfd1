"""The kernel cache's host side (common/host/kernel_cache.py) and the precompile command
(variants/precompile.py): where the cache lives for each setting of the environment, turning it
off, a directory that cannot be created or written, the size bound and its LRU order, stores from
many threads and processes at once, load_or_compile's path with a fake kernel, --info and --clear,
and precompile in the simulator. All of it runs without compiling (fake cubins); the tests marked
`gpu` compile for real."""
import os
import pathlib
import subprocess
import sys
import threading
import time
import warnings
from contextlib import contextmanager

import pytest

from common.host import kernel_cache as kc

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def fresh(monkeypatch, tmp_path):
    """Each test with the cache's per-process state reset, HOME and XDG_CACHE_HOME pointed into
    tmp_path (nothing reaches the real ~/.cache) and no size bound from the environment."""
    monkeypatch.setattr(kc, "_modes", {})
    monkeypatch.setattr(kc, "_warned", set())
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv(kc.ENV, raising=False)
    monkeypatch.delenv(kc.MAX_ENV, raising=False)


@contextmanager
def no_warnings():
    """A block in which any warning fails the test (pytest's filterwarnings=error, made sure)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


def cache_files(directory):
    return sorted(p.name for p in pathlib.Path(directory).iterdir())


# --------------------------------------------------------------------------- where it lives

@pytest.mark.parametrize("env, expect", [
    ({kc.ENV: "{tmp}/mine"}, "{tmp}/mine"),
    ({kc.ENV: "~/kc"}, "{tmp}/home/kc"),                              # ~ is the user's home
    ({"XDG_CACHE_HOME": "{tmp}/xdg"}, "{tmp}/xdg/flash-numba"),
    ({"XDG_CACHE_HOME": "relative/xdg"}, "{tmp}/home/.cache/flash-numba"),   # XDG: absolute only
    ({"XDG_CACHE_HOME": ""}, "{tmp}/home/.cache/flash-numba"),
    ({}, "{tmp}/home/.cache/flash-numba"),
    ({kc.ENV: "{tmp}/mine", "XDG_CACHE_HOME": "{tmp}/xdg"}, "{tmp}/mine"),  # the variable wins
])
def test_cache_dir_follows_the_environment(monkeypatch, tmp_path, env, expect):
    for name, value in env.items():
        monkeypatch.setenv(name, value.format(tmp=tmp_path))
    assert kc.cache_dir() == pathlib.Path(expect.format(tmp=tmp_path))
    assert not (tmp_path / "home").exists() and not (tmp_path / "mine").exists()   # not created


@pytest.mark.parametrize("value", ["", "0", "off", "false", "OFF", " False ", "Off"])
def test_these_values_turn_the_cache_off(monkeypatch, tmp_path, value):
    monkeypatch.setenv(kc.ENV, value)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert kc.cache_dir() is None
    assert kc.usable_dir() == (None, False)
    assert not (tmp_path / "xdg").exists()


def test_a_directory_is_created_and_probed_once(monkeypatch, tmp_path):
    monkeypatch.setenv(kc.ENV, str(tmp_path / "a" / "b"))
    with no_warnings():
        assert kc.usable_dir() == (tmp_path / "a" / "b", True)
    assert (tmp_path / "a" / "b").is_dir() and cache_files(tmp_path / "a" / "b") == []  # no probe
    calls = []
    monkeypatch.setattr(kc, "_probe", lambda d: calls.append(d) or ("rw", None))
    assert kc.usable_dir() == (tmp_path / "a" / "b", True) and calls == []   # kept per process


def test_a_directory_that_cannot_be_created_falls_back_with_one_warning(monkeypatch, tmp_path):
    """A read-only home, here a path under a regular file (refused to root as well): no cache,
    one KernelCacheWarning, and load_or_compile still returns the compiled kernel."""
    (tmp_path / "file").write_text("not a directory")
    monkeypatch.setenv(kc.ENV, str(tmp_path / "file" / "cache"))
    kern = FakeKernel()
    with pytest.warns(kc.KernelCacheWarning, match="cannot create it") as caught:
        assert kc.load_or_compile(kern, ("sig",)) == "compiled"
    assert len(caught) == 1 and f"{kc.ENV}=off" in str(caught[0].message)
    with no_warnings():   # once a process
        assert kc.load_or_compile(kern, ("sig",)) == "compiled"
        assert kc.usable_dir() == (None, False)
    assert kern.compiles == 2


def test_a_directory_that_cannot_be_written_serves_loads_only(monkeypatch, tmp_path):
    directory = tmp_path / "shared"
    directory.mkdir()
    kc.store(directory, "k-1", b"CUBIN", "entry_k", limit=float("inf"))
    monkeypatch.setenv(kc.ENV, str(directory))

    def refuse(**kwargs):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(kc.tempfile, "mkstemp", refuse)   # a read-only directory, even to root
    with pytest.warns(kc.KernelCacheWarning, match="cannot write there.*loaded, new ones"):
        assert kc.usable_dir() == (directory, False)
    fake_device(monkeypatch, key="k-1")
    kern = FakeKernel()
    with no_warnings():
        assert kc.load_or_compile(kern, ("sig",)) == ("loaded", b"CUBIN", "entry_k")
    fake_device(monkeypatch, key="k-2")
    with no_warnings():
        assert kc.load_or_compile(kern, ("sig",)) == "compiled"
    assert kern.compiles == 1 and not (directory / "k-2.cubin").exists()   # compiled, not kept


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes anywhere")
def test_a_read_only_home_falls_back(monkeypatch, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    home.chmod(0o555)
    try:
        with pytest.warns(kc.KernelCacheWarning, match="cannot create it"):
            assert kc.usable_dir() == (None, False)
    finally:
        home.chmod(0o755)


def test_a_failed_store_warns_once_and_stops_storing(monkeypatch, tmp_path):
    monkeypatch.setenv(kc.ENV, str(tmp_path))
    assert kc.usable_dir() == (tmp_path, True)
    (tmp_path / "k-1.cubin").mkdir()   # the rename onto it fails (as a full disk would)
    with pytest.warns(kc.KernelCacheWarning, match="cannot store a kernel"):
        assert kc.store(tmp_path, "k-1", b"x" * 10, "e") is False
    assert kc.usable_dir() == (tmp_path, False)
    assert not list(tmp_path.glob("*.tmp"))   # its temporary file removed
    with no_warnings():
        assert kc.store(tmp_path, "k-1", b"x", "e") is False


# --------------------------------------------------------------------------- bounded, LRU

def test_max_bytes_reads_the_environment(monkeypatch):
    assert kc.max_bytes() == 2048 * 2 ** 20
    monkeypatch.setenv(kc.MAX_ENV, "512")
    assert kc.max_bytes() == 512 * 2 ** 20
    monkeypatch.setenv(kc.MAX_ENV, "0.5")
    assert kc.max_bytes() == 2 ** 19
    monkeypatch.setenv(kc.MAX_ENV, "inf")
    assert kc.max_bytes() == float("inf")
    for bad in ("lots", "0", "-3", "nan"):
        monkeypatch.setenv(kc.MAX_ENV, bad)
        with pytest.warns(kc.KernelCacheWarning, match="not a positive number"):
            assert kc.max_bytes() == 2048 * 2 ** 20


def fill(directory, keys, size=1000, start=1_000_000.0):
    """Entries of `size` cubin bytes (+ a 7-byte entry file), each used a second after the last."""
    for i, key in enumerate(keys):
        assert kc.store(directory, key, bytes([i % 256]) * size, "entry_" + key[-1],
                        limit=float("inf"))
        for suffix in kc.SUFFIXES:
            os.utime(directory / f"{key}{suffix}", (start + i, start + i))


def test_eviction_removes_the_oldest_pairs_to_the_bound(tmp_path):
    keys = [f"kern-{i}" for i in range(6)]
    fill(tmp_path, keys)
    assert sum(e.bytes for e in kc.entries(tmp_path)) == 6 * 1007
    removed = kc.evict(tmp_path, 3 * 1007 + 500)
    assert [e.key for e in removed] == keys[:3]
    assert [e.key for e in kc.entries(tmp_path)] == keys[3:]
    assert cache_files(tmp_path) == sorted(f"{k}{s}" for k in keys[3:] for s in kc.SUFFIXES)
    assert kc.evict(tmp_path, 3 * 1007) == []   # at the bound: nothing more


def test_a_load_makes_an_entry_the_most_recent(tmp_path):
    fill(tmp_path, ["a-0", "b-1", "c-2"])
    assert kc.load(tmp_path, "a-0") == (bytes([0]) * 1000, "entry_0")
    assert [e.key for e in kc.entries(tmp_path)] == ["b-1", "c-2", "a-0"]
    assert [e.key for e in kc.evict(tmp_path, 2 * 1007)] == ["b-1"]
    assert kc.load(tmp_path, "b-1") is None and kc.load(tmp_path, "c-2") is not None


def test_a_store_holds_the_cache_to_the_bound_and_keeps_what_it_stored(monkeypatch, tmp_path):
    monkeypatch.setenv(kc.MAX_ENV, str(2500 / 2 ** 20))   # room for two entries of ~1 KB
    for i in range(5):
        assert kc.store(tmp_path, f"k-{i}", b"x" * 1000, "e")
        for suffix in kc.SUFFIXES:
            os.utime(tmp_path / f"k-{i}{suffix}", (1e6 + i, 1e6 + i))
    assert [e.key for e in kc.entries(tmp_path)] == ["k-3", "k-4"]
    assert kc.store(tmp_path, "big-0", b"y" * 5000, "e")   # over the bound alone: kept
    assert [e.key for e in kc.entries(tmp_path)] == ["big-0"]


def test_orphans_count_and_stale_temporary_files_go(tmp_path):
    fill(tmp_path, ["a-0", "b-1"])
    (tmp_path / "b-1.entry").unlink()                   # a writer that died between its renames
    old, new = tmp_path / "x-0.1-2.tmp", tmp_path / "x-0.3-4.tmp"
    old.write_bytes(b"o")
    new.write_bytes(b"n")
    os.utime(old, (time.time() - 2 * kc.STALE_TMP_SECONDS,) * 2)
    found = {e.key: e for e in kc.entries(tmp_path)}
    assert found["a-0"].complete and not found["b-1"].complete and found["b-1"].bytes == 1000
    assert kc.info(tmp_path)["entries"] == 1 and kc.info(tmp_path)["bytes"] == 2007
    kc.evict(tmp_path, float("inf"))
    assert not old.exists() and new.exists()


# --------------------------------------------------------------------------- many writers

PAYLOAD = 1 << 20


def payload(key, writer):
    """1 MiB that names its writer in every byte block: a torn or mixed file shows."""
    block = f"{key}:{writer};".encode()
    return (block * (PAYLOAD // len(block) + 1))[:PAYLOAD]


def check_intact(directory, keys, writers):
    for key in keys:
        cubin = (directory / f"{key}.cubin").read_bytes()
        assert any(cubin == payload(key, w) for w in writers), (key, len(cubin), cubin[:40])
        assert (directory / f"{key}.entry").read_text() == f"entry_{key}"
    assert not list(directory.glob("*.tmp"))


def test_threads_storing_the_same_keys_leave_whole_pairs(tmp_path):
    keys = [f"kern-{i}" for i in range(4)]
    writers = [f"t{i}" for i in range(8)]
    errors, seen = [], []
    go = threading.Barrier(len(writers) + 1)

    def write(writer):
        go.wait()
        try:
            for _ in range(3):
                for key in keys:
                    assert kc.store(tmp_path, key, payload(key, writer), f"entry_{key}",
                                    limit=float("inf"))
        except BaseException as e:   # noqa: BLE001 - reported below
            errors.append(e)

    def read():
        go.wait()
        for _ in range(40):
            for key in keys:
                got = kc.load(tmp_path, key)
                if got is not None:
                    seen.append((key, got))

    threads = [threading.Thread(target=write, args=(w,)) for w in writers]
    threads.append(threading.Thread(target=read))
    with no_warnings():
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert errors == []
    check_intact(tmp_path, keys, writers)
    for key, (cubin, name) in seen:   # what a reader got was a whole pair too
        assert name == f"entry_{key}" and any(cubin == payload(key, w) for w in writers)


WRITER = """
import sys, threading
from common.host import kernel_cache as kc
from tests.test_kernel_cache import payload
directory, proc = sys.argv[1], sys.argv[2]
keys = [f"kern-{i}" for i in range(4)]
def write(w):
    for _ in range(3):
        for key in keys:
            assert kc.store(directory, key, payload(key, w), f"entry_{key}", limit=3.5 * 2 ** 20)
threads = [threading.Thread(target=write, args=(f"{proc}.{t}",)) for t in range(3)]
[t.start() for t in threads]
[t.join() for t in threads]
print("done")
"""


def test_processes_storing_and_evicting_at_once_leave_whole_pairs(tmp_path):
    """Three processes of three threads each store the same four 1 MiB entries with a 3.5 MiB
    bound: every pair left is one writer's whole payload, and the bound holds."""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), f"p{p}"], cwd=ROOT,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for p in range(3)]
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0 and out.strip() == "done", err[-2000:]
    found = kc.entries(tmp_path)
    assert sum(e.bytes for e in found) <= 3.5 * 2 ** 20
    # (an eviction racing a store of the same key may leave that key's entry file alone: a miss)
    complete = [e.key for e in found if e.complete]
    assert 1 <= len(complete) <= 3, found
    check_intact(tmp_path, complete, [f"p{p}.{t}" for p in range(3) for t in range(3)])


# --------------------------------------------------------------------------- load_or_compile

class FakeKernel:
    """What load_or_compile asks of a Numba kernel: compile(sig)._codelibrary."""

    def __init__(self):
        self.compiles = 0

    def compile(self, sig):
        self.compiles += 1
        kernel = self

        class Library:
            _entry_name = "entry_fake"

            def get_cufunc(self):
                return "compiled"

            def get_cubin(self):
                return type("ObjectCode", (), {"code": b"CUBIN-%d" % kernel.compiles})()

        return type("Compiled", (), {"_codelibrary": Library()})()


def fake_device(monkeypatch, key="fake-0123", load=None):
    monkeypatch.setattr(kc, "cache_key", lambda kern, sig, cc: key)
    monkeypatch.setattr(kc, "device_compute_capability", lambda: (9, 0))
    monkeypatch.setattr(kc, "module_function",
                        load or (lambda cubin, name: ("loaded", cubin, name)))


def test_load_or_compile_stores_then_loads(monkeypatch, tmp_path):
    monkeypatch.setenv(kc.ENV, str(tmp_path))
    fake_device(monkeypatch)
    kern = FakeKernel()
    with no_warnings():
        assert kc.load_or_compile(kern, ("sig",)) == "compiled"
        assert cache_files(tmp_path) == ["fake-0123.cubin", "fake-0123.entry"]
        os.utime(tmp_path / "fake-0123.entry", (1e6, 1e6))
        assert kc.load_or_compile(kern, ("sig",)) == ("loaded", b"CUBIN-1", "entry_fake")
    assert kern.compiles == 1
    assert (tmp_path / "fake-0123.entry").stat().st_mtime > time.time() - 60   # touched


def test_load_or_compile_recompiles_a_damaged_cubin(monkeypatch, tmp_path):
    monkeypatch.setenv(kc.ENV, str(tmp_path))
    kc.store(tmp_path, "fake-0123", b"garbage", "entry_fake")

    def refuse(cubin, name):
        raise RuntimeError("CUDA_ERROR_INVALID_IMAGE")
    fake_device(monkeypatch, load=refuse)
    kern = FakeKernel()
    assert kc.load_or_compile(kern, ("sig",)) == "compiled" and kern.compiles == 1
    assert (tmp_path / "fake-0123.cubin").read_bytes() == b"CUBIN-1"   # stored over it


def test_load_or_compile_without_a_cache_or_a_key_only_compiles(monkeypatch, tmp_path):
    monkeypatch.setenv(kc.ENV, "off")
    fake_device(monkeypatch)
    kern = FakeKernel()
    assert kc.load_or_compile(kern, ()) == "compiled"
    monkeypatch.setenv(kc.ENV, str(tmp_path))

    def undescribable(kern, sig, cc):
        raise TypeError("cannot describe closure constant")
    monkeypatch.setattr(kc, "cache_key", undescribable)
    assert kc.load_or_compile(kern, ()) == "compiled" and kern.compiles == 2
    assert cache_files(tmp_path) == []


def test_launch_reaches_the_cache_only_on_a_gpu():
    """In the simulator `launch` runs the kernel through Numba's simulator and never builds a
    _Launcher (the one caller of load_or_compile), so the simulated suite reads and writes no
    cache."""
    import inspect

    from common.host import launching
    source = inspect.getsource(launching.launch)
    assert source.index("if SIMULATOR:") < source.index("return\n") < source.index("_Launcher(")
    assert "load_or_compile" in inspect.getsource(launching._Launcher.__init__)


# --------------------------------------------------------------------------- the key

def test_the_key_reads_the_real_sources_and_the_toolchain(monkeypatch):
    from numba import types

    from variants import fa2
    assert (kc._PACKAGE_ROOT / "common" / "hardware" / "target.py").is_file()
    assert (kc._PACKAGE_ROOT / "variants" / "fa2.py").is_file()
    assert kc.source_digest(("variants.fa2",)) != kc.source_digest(("variants.fa1",))
    from importlib import metadata
    version = kc.toolchain_version()
    assert f"numba-cuda={metadata.version('numba-cuda')}" in version and "linker=" in version
    kern = fa2.build(fa2.default_config(64, "bfloat16", False))
    key = kc.cache_key(kern, (types.int32,), (9, 0))
    assert key.startswith("fa2_forward-") and key == kc.cache_key(kern, (types.int32,), (9, 0))
    assert key != kc.cache_key(kern, (types.int32,), (8, 0))
    monkeypatch.setattr(kc, "toolchain_version", lambda: "numba-cuda=9.9;nvvm=(9, 9)")
    assert key != kc.cache_key(kern, (types.int32,), (9, 0))


# --------------------------------------------------------------------------- the command

def test_precompile_in_the_simulator_says_there_is_nothing_to_do(tmp_path):
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", FA_KERNEL_CACHE=str(tmp_path / "kc"))
    out = subprocess.run([sys.executable, "-m", "variants.precompile"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "No CUDA GPU here: nothing to precompile" in out.stdout
    assert not (tmp_path / "kc").exists()


def test_precompile_refuses_what_it_cannot_compile(capsys):
    from variants import precompile
    for argv, message in ((["--variants", "fa9"], "not registered"),
                          (["--dtypes", "float32"], "not among bfloat16, float16"),
                          (["--passes", "fwd,sideways"], "not among fwd, bwd"),
                          (["--head-dims", "sixty"], "takes integers"),
                          (["--info", "--clear"], "not allowed with")):
        with pytest.raises(SystemExit) as exit_:
            precompile.main(argv)
        assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_precompile_covers_the_default_set(monkeypatch):
    """The default set: fa2 and fa3 x d 64, 128 x bf16, fp16 x causal or not x fwd, bwd (32), the
    longest (fa3's backward) first; fa3 left out, with a line saying so, off sm_90."""
    from numba import cuda

    from variants import precompile
    device = type("Device", (), {"compute_capability": (9, 0)})
    monkeypatch.setattr(cuda, "list_devices", lambda: [device])
    units, skipped = precompile.configurations(precompile.parse([]))
    assert len(units) == len(set(units)) == 32 and skipped == []
    assert {u[0] for u in units} == {"fa2", "fa3"} and {u[2] for u in units} == {64, 128}
    assert {(u[3], u[4]) for u in units} == {(t, c) for t in ("bfloat16", "float16")
                                            for c in (False, True)}
    assert units[0][:2] == ("fa3", "bwd") and units[-1][:2] == ("fa2", "fwd")
    device.compute_capability = (8, 0)
    units, skipped = precompile.configurations(precompile.parse(
        ["--causal", "true", "--passes", "fwd", "--head-dims", "64,300"]))
    assert sorted(units) == [("fa2", "fwd", 64, t, True) for t in ("bfloat16", "float16")]
    assert skipped == ["fa2: head dims [300] skipped (not among its HEAD_DIMS)",
                       "fa3: skipped (its kernels need sm_90; this GPU is sm_80)"]


@pytest.mark.parametrize("pass_", ["fwd", pytest.param("bwd", marks=pytest.mark.slow)])
def test_a_configuration_runs_through_the_real_entry_point(pass_):
    """compile_configuration's inputs are taken by variants.forward / backward (here simulated,
    on a smaller problem): the call a worker makes on a GPU."""
    from variants import precompile
    seconds = precompile.compile_configuration("fa2", pass_, 64, "bfloat16", True, seqlen=64)
    assert seconds > 0


def test_info_and_clear(monkeypatch, tmp_path, capsys):
    from variants import precompile
    monkeypatch.setenv(kc.ENV, str(tmp_path))
    fill(tmp_path, ["a-0", "b-1"], size=2 ** 20)
    (tmp_path / "notes.txt").write_text("the user's own")
    assert precompile.main(["--info"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"kernel cache: {tmp_path}", "entries: 2", "size: 2.0 MB (limit 2048 MB)"]
    assert precompile.main(["--clear"]) == 0
    assert capsys.readouterr().out.strip() == f"removed 2 entries (2.0 MB) from {tmp_path}"
    assert cache_files(tmp_path) == ["notes.txt"]
    assert precompile.main(["--info"]) == 0
    assert "entries: 0" in capsys.readouterr().out
    monkeypatch.setenv(kc.ENV, "0")
    assert precompile.main(["--info"]) == 0 and precompile.main(["--clear"]) == 0
    assert capsys.readouterr().out.splitlines() == [f"kernel cache: off ({kc.ENV}='0')"] * 2


# --------------------------------------------------------------------------- on a GPU

@pytest.mark.gpu
def test_precompile_caches_what_a_first_call_needs(tmp_path):
    """precompile of one configuration into an empty cache, then a fresh process's first call of
    that configuration with its own shapes (flash_attn's layout) compiles nothing new: the cache
    held exactly its kernels."""
    env = dict(os.environ, FA_KERNEL_CACHE=str(tmp_path))
    out = subprocess.run([sys.executable, "-m", "variants.precompile", "--variants", "fa2",
                          "--head-dims", "64", "--dtypes", "bfloat16", "--causal", "false",
                          "--passes", "fwd,bwd", "--jobs", "2"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]
    assert "total: 2 of 2 configurations" in out.stdout
    stored = sorted(e.key for e in kc.entries(tmp_path) if e.complete)
    assert stored
    call = ("import numpy as np, variants\n"
            "from common.host.arrays import DTYPES, to_device\n"
            "rng = np.random.default_rng(1)\n"
            "x = [to_device(rng.standard_normal((2, 1000, 4, 64), dtype=np.float32)"
            ".astype(DTYPES['bfloat16']), 'numba') for _ in range(4)]\n"
            "o, lse = variants.forward(*x[:3], variant='fa2')\n"
            "variants.backward(x[3], *x[:3], o, lse, variant='fa2')\n")
    run = subprocess.run([sys.executable, "-c", call], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert sorted(e.key for e in kc.entries(tmp_path) if e.complete) == stored
