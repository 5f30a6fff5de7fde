"""Crash safety of checkpoints: SIGKILL at every point of a save and at random moments of a
training loop that saves after every step; resuming gives the uninterrupted loss trajectory."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from _server import get_server
from models import TinyGPT, make_batch
from tiermem._leftovers import Owner, write_marker
from tiermem.checkpoint import cleanup_temp_files, load_checkpoint, save_checkpoint
from tiermem.optim import HybridAdam

HP = dict(lr=3e-3, weight_decay=0.1, offload_fraction=0.5, chunk_numel=1024)


@pytest.fixture(scope="module")
def server():
    """The fork server, started right after collection by conftest.py (it warms up while
    earlier tests run)."""
    return get_server()


def reference_losses(spill_dir: str, steps: int) -> tuple[list[float], TinyGPT]:
    """The uninterrupted run, as the worker does it (one thread, the same seed and batches)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        model = TinyGPT()
        opt = HybridAdam(model.parameters(), **HP, state_tier="nvme", nvme_dir=spill_dir)
        losses = []
        for step in range(steps):
            idx, tgt = make_batch(step)
            _, loss = model(idx, tgt)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        opt.close()
        return losses, model
    finally:
        torch.set_num_threads(threads)


def test_sigkill_at_each_point_of_a_save_leaves_a_loadable_checkpoint(server, tmp_path):
    server.send("killpoints", tmp_path)
    results = json.loads(server.expect("{"))
    assert set(results) == {"after_create", "mid_write", "before_fsync", "before_rename",
                            "after_rename"}
    for point, r in results.items():
        assert r["signal"] == signal.SIGKILL, point
        assert r["error"] is None, (point, r["error"])
        assert r["consistent"], point  # never a mix of the old and the new save
        # before the rename the previous checkpoint is what loads; after it, the new one
        assert r["loaded"] == (r["before"] + 1 if point == "after_rename" else r["before"]), point
        # an interrupted save leaves its temporary file; the cleanup removes it (writer dead)
        assert r["temps"] == r["removed"] == (0 if point == "after_rename" else 1), point
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt"]


def test_random_sigkills_during_training_resume_the_same_trajectory(server, tmp_path):
    rng = random.Random(8)
    ckpt, spill = tmp_path / "train.pt", tmp_path / "spill"
    spill.mkdir()
    steps, kills, interrupted_saves, seen = 16, 4, 0, 0
    for n in range(kills):
        server.send("train", ckpt, spill, steps, 1 << 20)
        pid = int(server.expect("child").split()[1])
        seen = max(seen, int(server.expect("saved").split()[1]))
        if n % 2:  # at a random moment
            time.sleep(rng.uniform(0.0, 0.2))
        else:  # at a random moment inside a save: once its temporary file exists
            deadline = time.monotonic() + 10
            while not any(".tiermem-tmp-" in name for name in os.listdir(tmp_path)):
                assert time.monotonic() < deadline, "no save started"
                time.sleep(0.0005)
            time.sleep(rng.uniform(0.0, 0.01))
        os.kill(pid, signal.SIGKILL)
        assert server.expect("exit") in ("exit -9", "exit 0")
        # the previous (or the latest) checkpoint loads, whole, and never goes backwards
        extra = load_checkpoint(ckpt)["extra"]
        assert extra["step"] >= seen and len(extra["losses"]) == extra["step"]
        assert float(extra["pad"][0]) == extra["step"]
        seen = extra["step"]
        temps = [n for n in os.listdir(tmp_path) if ".tiermem-tmp-" in n]
        interrupted_saves += bool(temps)
        assert len(temps) <= 1
        # the killed process left its spill directory; the next store removes it (dead pid)
        assert len(os.listdir(spill)) <= 1
    assert seen < steps, "every run finished before its kill: raise `steps`"
    server.send("train", ckpt, spill, steps, 1 << 20)
    server.expect("resumed")
    assert server.expect("exit") == "exit 0"
    assert not [n for n in os.listdir(tmp_path) if ".tiermem-tmp-" in n]  # cleaned by the saves
    assert os.listdir(spill) == []  # normal exit removed the last spill directory
    assert interrupted_saves >= 1  # a kill really landed inside a save

    payload = load_checkpoint(ckpt)
    ref, ref_model = reference_losses(str(spill), steps)
    assert payload["extra"]["losses"] == ref  # bit-identical across 4 kills and 5 resumes
    for name, value in ref_model.state_dict().items():
        assert torch.equal(payload["model"][name], value), name


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_resume_from_step_3_matches_uninterrupted_losses_4_to_6(tmp_path, tier):
    def build(seed):
        torch.manual_seed(seed)
        model = TinyGPT()
        opt = HybridAdam(model.parameters(), **HP, state_tier=tier, nvme_dir=str(tmp_path))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
        return model, opt, sched

    def run(model, opt, sched, start, stop):
        out = []
        for step in range(start, stop):
            _, loss = model(*make_batch(step))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            out.append(loss.item())
        return out

    model, opt, sched = build(0)
    first = run(model, opt, sched, 0, 3)
    path = tmp_path / "step3.pt"
    save_checkpoint(path, model=model, optimizer=opt,
                    extra={"step": 3, "losses": first, "sched": sched.state_dict()})
    uninterrupted = run(model, opt, sched, 3, 6)
    opt.close()

    model2, opt2, sched2 = build(1)  # other initial weights: everything must come from the file
    extra = load_checkpoint(path, model=model2, optimizer=opt2)["extra"]
    sched2.load_state_dict(extra["sched"])
    assert extra["step"] == 3 and extra["losses"] == first
    assert run(model2, opt2, sched2, 3, 6) == uninterrupted  # exactly, not approximately
    for (name, a), b in zip(model.named_parameters(), model2.parameters()):
        assert torch.equal(a, b), name
    opt2.close()


def _temp_dir(parent, pid, token, start=None):
    """A save's temporary directory as a writer ``pid`` leaves it when killed mid-save."""
    path = parent / f".c.pt.tiermem-tmp-{pid}-{token}"
    path.mkdir(mode=0o700)
    write_marker(str(path), Owner("checkpoint-tmp", pid, start, token))
    (path / "data").write_bytes(b"partial")
    return path


def test_cleanup_removes_temp_files_of_dead_writers_only(tmp_path):
    save_checkpoint(tmp_path / "c.pt", extra={"step": 1})
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead_pid = int(dead.stdout)
    stale = _temp_dir(tmp_path, dead_pid, "0badf00d")
    mine = _temp_dir(tmp_path, os.getpid(), "00c0ffee")              # a save in flight here
    reused = _temp_dir(tmp_path, os.getppid(), "deadbeef", start=1.0)  # pid of another process now
    other = tmp_path / "c.pt.tiermem-tmp-notes.txt"                  # not ours: kept
    other.write_bytes(b"partial")
    removed = cleanup_temp_files(tmp_path)
    assert sorted(removed) == sorted([str(stale), str(reused)])
    assert mine.exists() and other.exists()
    # load never looks at temporary directories, and a save cleans the directory too
    shutil.rmtree(mine)
    stale = _temp_dir(tmp_path, dead_pid, "0badf00d")
    assert load_checkpoint(tmp_path / "c.pt")["extra"] == {"step": 1}
    save_checkpoint(tmp_path / "c.pt", extra={"step": 2})
    assert not stale.exists()
    assert sorted(os.listdir(tmp_path)) == ["c.pt", "c.pt.tiermem-tmp-notes.txt"]


def test_cleanup_never_deletes_a_users_look_alike_files(tmp_path):
    """Issue 16.6: names matching the pattern without a marker that agrees with them, or
    holding anything a save does not write, are the user's."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead_pid = int(dead.stdout)
    notes = tmp_path / f".notes.tiermem-tmp-{dead_pid}-ab"          # a user's file
    notes.write_text("precious")
    folder = tmp_path / f".c.pt.tiermem-tmp-{dead_pid}-cd"          # a user's directory
    folder.mkdir()
    (folder / "data").write_text("precious")
    crowded = _temp_dir(tmp_path, dead_pid, "ef")                    # ours, plus a user's file
    (crowded / "keep.txt").write_text("precious")
    assert cleanup_temp_files(tmp_path) == []
    save_checkpoint(tmp_path / "c.pt", extra={"step": 1})
    assert notes.read_text() == (folder / "data").read_text() == "precious"
    assert (crowded / "keep.txt").read_text() == "precious"
