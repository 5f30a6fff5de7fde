"""Issue 16.1: a child forked from a process with a live TierStore never touches the parent's
spill directory, whichever way it ends, and refuses to use the store. Issue 27.5: nor does it
block when another thread was inside the store or a HybridAdam step at the fork."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent


def test_a_forked_child_leaves_the_parents_spill_files_alone(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(HERE.parent), str(HERE), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, str(HERE / "_worker.py"), "fork_child", str(tmp_path)],
                         capture_output=True, text=True, timeout=180, env=env)
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    results = lines[-1]["results"]
    assert set(results) == {f"{b}-{h}" for b in ("posix", "aiofiles")
                            for h in ("exit", "close", "drop", "use")} | {"optimizer"}
    for name, r in results.items():
        assert r["code"] == 0, name  # the child ended cleanly (no hang, no traceback)
        assert r["dir_kept"] is True, name  # its exit, close or drop left the parent's dir
        assert r["data_ok"] is True, (name, r["data_ok"])  # every spilled key reads back
        assert r["removed_on_close"], name  # and the parent's own close still removes it
    uses = [line["error"] for line in lines[:-1] if line["how"] == "use"]
    assert len(uses) == 2
    for error in uses:  # the child's get was refused, saying why and what to do instead
        assert error is not None and "child forked from it" in error
        assert "create a new TierStore in the child" in error
    # a HybridAdam's step in the child is refused too (its worker thread is not there)
    [error] = [line["error"] for line in lines[:-1] if line["how"] == "optimizer"]
    assert error is not None and "child forked from it" in error and "new optimizer" in error
    assert os.listdir(tmp_path) == ["opt"] and os.listdir(tmp_path / "opt") == []


# ------------------------------------------------------------------ forks racing another thread
# Issue 27.5: a child forked while another thread is inside the store (or inside a HybridAdam
# backward and step) inherits the store's lock, maybe held. Its close(), get() and exit must
# finish without touching it. Each scenario forks FORKS times from a subprocess while a thread
# hammers; a child blocked without using CPU time for CHILD_IDLE_S is a hang (a deadlock never
# wakes up; see _wait_child): it is killed and no more forks are made.

FORKS = 12
CHILD_IDLE_S = 60.0
CHILD_DEADLINE_S = 300.0
SCENARIOS = ("store-close", "store-get", "store-exit", "opt-close", "opt-exit")


def _cpu_ticks(pid: int) -> int | None:
    """CPU time (clock ticks, user + system) the process has used, or None when unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15 of stat(5)
    except (OSError, IndexError, ValueError):
        return None


def _wait_child(pid: int) -> int | None:
    """The child's exit code, or None when it hung and was killed: it used no CPU time for
    CHILD_IDLE_S (blocked on a lock: a deadlock never wakes up) or was not done in
    CHILD_DEADLINE_S. A child that is only slow (a loaded machine; finalizing a torch
    interpreter takes seconds there) keeps using CPU time and is waited for."""
    import signal  # noqa: PLC0415
    import time  # noqa: PLC0415

    start = last_change = time.monotonic()
    ticks = None
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        now, seen = time.monotonic(), _cpu_ticks(pid)
        if seen != ticks:
            ticks, last_change = seen, now
        if now - last_change > CHILD_IDLE_S or now - start > CHILD_DEADLINE_S:
            break
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None


def _child(scenario: str, target) -> None:
    """What a forked child does with the inherited store or optimizer; never returns."""
    from tiermem.store import StoreClosedError  # noqa: PLC0415

    how = scenario.split("-")[1]
    code = 0
    try:
        if how == "close":
            target.close()
            target.close()  # idempotent
        elif how == "get":
            try:
                target.get(0, "cpu")
                code = 3  # must have refused
            except StoreClosedError as exc:
                code = 0 if "child forked from it" in str(exc) else 4
        else:
            sys.exit(0)  # exit handlers: atexit, finalizers, threading's shutdown
    except SystemExit:
        raise
    except BaseException:  # noqa: BLE001  (reported as an exit code)
        code = 5
    os._exit(code)


def _race(scenario: str, base: str) -> None:
    import threading  # noqa: PLC0415

    from tiermem import StoreConfig, TierStore  # noqa: PLC0415

    import torch  # noqa: PLC0415

    torch.set_num_threads(1)  # no OpenMP worker threads: GNU OpenMP is not fork-safe

    stop = threading.Event()
    if scenario.startswith("store"):
        target = TierStore(StoreConfig(gpu_bytes=0, cpu_bytes=64 << 10, nvme_bytes=4 << 20,
                                       nvme_dir=base, io_backend="posix", io_threads=2,
                                       o_direct=False, pool_slab_bytes=64 << 10))
        xs = [torch.full((4096,), float(i)) for i in range(8)]  # 16 KiB each: 4 fit in cpu
        for i, x in enumerate(xs):
            target.put(i, x, "nvme")

        def hammer():
            n = 0
            while not stop.is_set():
                k = n % len(xs)
                target.put(k, xs[k], "cpu")
                target.get((k + 3) % len(xs), "cpu")
                n += 1
    else:
        from _worker import build, train_step  # noqa: PLC0415

        os.mkdir(os.path.join(base, "opt"))
        model, target = build(os.path.join(base, "opt"))

        def hammer():
            step = 0
            while not stop.is_set():
                train_step(model, target, step)
                step += 1
    thread = threading.Thread(target=hammer, daemon=True)
    thread.start()
    codes = []
    for _ in range(FORKS):
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(scenario, target)
        codes.append(_wait_child(pid))
        if codes[-1] is None:
            break  # one hang is enough to fail; more would only take longer
    stop.set()
    thread.join()
    target.close()
    print(json.dumps({"codes": codes}), flush=True)


def _run_race(scenario: str, tmp_path) -> list:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(HERE.parent), str(HERE), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, str(pathlib.Path(__file__)), scenario, str(tmp_path)],
                         capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.splitlines()[-1])["codes"]



@pytest.mark.parametrize("scenario", SCENARIOS)
def test_a_child_forked_while_another_thread_works_never_blocks(tmp_path, scenario):
    codes = _run_race(scenario, tmp_path)
    assert None not in codes, codes  # no child hung (None: killed at the deadline)
    assert codes == [0] * FORKS, codes  # each did what it should (get refused, close, exit)
    assert os.listdir(tmp_path) in ([], ["opt"])  # the parent's close removed its spill dir
    if "opt" in os.listdir(tmp_path):
        assert os.listdir(tmp_path / "opt") == []


if __name__ == "__main__":
    _race(sys.argv[1], sys.argv[2])
