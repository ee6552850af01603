"""DeepSpeed's CPU op build (comm/deepspeed.py) as a user meets it, without building it.

* a stale build lock (no process holds it) is an error naming the lock and the command that removes it, raised by
  the real path of ``comm="deepspeed"`` (``prebuild_ops``), not a wait without end;
* a lock a live process holds is waited for, and the build goes on once it is released;
* a build cut short in this process (Ctrl-C or an exit while it runs on another thread, SIGTERM from torchrun)
  leaves no lock; a lock another process holds is never removed;
* rank 0 says that the build starts; set-up prints are filtered line by line into the real stdout.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading

import pytest

pytest.importorskip("deepspeed")

from torch.utils.file_baton import FileBaton  # noqa: E402

from dilated_attention.comm import deepspeed as ds  # noqa: E402
from dilated_attention.comm.base import without_setup_prints  # noqa: E402
from dilated_attention.testing.spawn import environ_with  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HOLD = "import sys, time; from torch.utils.file_baton import FileBaton; b = FileBaton(sys.argv[1]); " \
       "assert b.try_acquire(); print('held', flush=True); sys.stdin.readline(); b.release()"


@pytest.fixture
def extensions(tmp_path, monkeypatch):
    """A private TORCH_EXTENSIONS_DIR and the op's folder in it."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    folder = ds.shm_op_dir()
    if folder is None:
        pytest.skip("this DeepSpeed does not JIT-build its shared-memory op here")
    assert folder == os.path.join(str(tmp_path), "deepspeed_shm_comm")
    os.makedirs(folder)
    return folder


def _in_thread(fn, limit: float = 120.0):
    """Run ``fn`` on a thread; its exception or result (a hang is a test failure, not a stuck suite)."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit)
    assert not thread.is_alive(), f"still waiting after {limit} s"
    return box


def test_a_stale_lock_is_an_error_naming_it_and_its_removal(extensions, monkeypatch):
    lock = os.path.join(extensions, "lock")
    open(lock, "w").close()  # what a build killed mid-way leaves: the file, no process holding it
    monkeypatch.setattr(ds, "STALE_LOCK_GRACE_S", 0.5)
    box = _in_thread(ds.prebuild_ops)  # the real path comm="deepspeed" takes before DeepSpeed builds
    error = box.get("error")
    assert isinstance(error, RuntimeError), box
    assert f"the build lock {lock} exists and no process of this host has had it open" in str(error)
    assert str(error).endswith(f"remove it and run again: rm -f {lock}")
    assert os.path.exists(lock)  # reported, never removed behind the user's back


def test_a_lock_a_live_build_holds_is_waited_for(extensions):
    lock = os.path.join(extensions, "lock")
    holder = subprocess.Popen([sys.executable, "-c", HOLD, lock], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert ds._lock_holders(lock) == [holder.pid]
        done = threading.Event()
        box: dict = {}

        def wait():
            try:
                ds.check_build_lock(extensions, grace=0.2, poll=0.05)
            except BaseException as exc:  # noqa: BLE001
                box["error"] = exc
            done.set()

        threading.Thread(target=wait, daemon=True).start()
        assert not done.wait(1.0), box  # well past the grace: a held lock is a build under way
        assert not ds.release_build_lock(extensions)  # another process's lock stays
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert done.wait(60) and "error" not in box, box
    finally:
        holder.kill()
        holder.wait()
    assert not os.path.exists(lock)


def test_release_removes_only_a_lock_this_process_holds(extensions):
    lock = os.path.join(extensions, "lock")
    assert not ds.release_build_lock(extensions)  # no lock
    open(lock, "w").close()
    assert not ds.release_build_lock(extensions)  # a lock nobody holds is not this process's to remove
    os.remove(lock)
    baton = FileBaton(lock)
    assert baton.try_acquire()
    assert ds.release_build_lock(extensions) and not os.path.exists(lock)
    os.close(baton.fd)


BUILD = textwrap.dedent("""
    import os, sys, threading, time
    from torch.utils.file_baton import FileBaton
    from dilated_attention.comm import deepspeed as ds

    def build():  # what torch does inside the guard: hold the lock while it compiles
        with ds._op_build():
            FileBaton(os.path.join(ds.shm_op_dir(), "lock")).try_acquire()
            print("building", flush=True)
            time.sleep(120)

    if sys.argv[1] == "thread":  # a tool's watchdog thread builds; the main thread is interrupted
        lock = os.path.join(ds.shm_op_dir(), "lock")
        threading.Thread(target=build, daemon=True).start()
        while not os.path.exists(lock):
            time.sleep(0.05)
        raise KeyboardInterrupt
    build()  # the main thread builds; torchrun sends SIGTERM
""")


@pytest.mark.parametrize("how", ["thread", "sigterm"])
def test_a_build_cut_short_leaves_no_lock(extensions, how, tmp_path):
    env = environ_with({"TORCH_EXTENSIONS_DIR": str(tmp_path), "DS_ACCELERATOR": "cpu", "RANK": "0",
                        "PYTHONPATH": ROOT})
    proc = subprocess.Popen([sys.executable, "-c", BUILD, how], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "building", proc.stderr.read() if proc.poll() is not None else ""
        if how == "sigterm":
            proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == -(signal.SIGTERM if how == "sigterm" else signal.SIGINT), err
    assert not os.path.exists(os.path.join(extensions, "lock")), err
    assert err.count("DeepSpeed is building its shared-memory communication op for CPU: usually 1-3 min") == 1, err
    assert f"(cached in {extensions})" in err


def test_setup_prints_reach_stdout_as_they_are_written(capsys):
    with without_setup_prints("built successfully"):
        print("DeepSpeed deepspeed_shm_comm built successfully")
        print("a line of another thread, or a tool's failure message")
        assert capsys.readouterr().out == "a line of another thread, or a tool's failure message\n"  # not held back
        print("an unfinished line", end="")
    assert capsys.readouterr().out == "an unfinished line"
