"""Security of the spill directory and of checkpoint loading, through the public API."""

from __future__ import annotations

import hashlib
import io
import os
import pathlib
import pickle
import stat
import subprocess
import sys

import pytest
import torch

import tiermem._leftovers as leftovers
import tiermem.store.nvme as nvme
from _faults import rand, small_store
from tiermem.checkpoint import (CheckpointCorruption, UnsafeCheckpointError, atomic_save,
                                load_checkpoint, load_store, save_checkpoint)

HERE = pathlib.Path(__file__).resolve().parent


def _mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_spill_dir_is_private_and_file_0600_even_with_umask_0(tmp_path):
    old = os.umask(0)
    try:
        store = small_store(tmp_path)
        store.put("k", rand(1000), tier="nvme")
        store.synchronize()
        spill_dir = store._spill.dir_path
        assert os.path.dirname(spill_dir) == str(tmp_path)  # under the configured base
        assert _mode(spill_dir) == 0o700 and _mode(store._spill.path) == 0o600
        assert sorted(os.listdir(spill_dir)) == [".tiermem-owner", "spill.bin"]
        assert _mode(os.path.join(spill_dir, ".tiermem-owner")) == 0o600
        save_checkpoint(tmp_path / "c.pt", extra=1)
        assert _mode(tmp_path / "c.pt") == 0o600
    finally:
        os.umask(old)
    store.close()
    assert not os.path.exists(spill_dir)  # removed on close
    assert os.listdir(tmp_path) == ["c.pt"]


def test_planted_symlink_instead_of_the_spill_dir_is_refused(tmp_path, monkeypatch):
    victim = tmp_path / "victim"
    victim.mkdir()
    base = tmp_path / "base"
    base.mkdir()
    monkeypatch.setattr(leftovers.secrets, "token_hex", lambda n: "abad1dea")  # a predicted name
    os.symlink(victim, base / f"tiermem-{os.getpid()}-abad1dea")
    with pytest.raises(ValueError, match="nvme_dir=.* is not writable: cannot create .* exists"):
        small_store(base)
    assert os.listdir(victim) == []  # nothing was created through the link
    assert os.path.islink(base / f"tiermem-{os.getpid()}-abad1dea")  # and it was not followed


def test_planted_symlink_instead_of_the_spill_file_is_refused(tmp_path, monkeypatch):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    planted = tmp_path / "planted"

    def make_dir(base):  # the private dir already holds an attacker's link named spill.bin
        planted.mkdir(mode=0o700)
        os.symlink(victim, planted / nvme.SPILL_FILE_NAME)
        return str(planted)

    monkeypatch.setattr(nvme.SpillSpace, "_make_private_dir", staticmethod(make_dir))
    with pytest.raises(FileExistsError):  # O_CREAT | O_EXCL | O_NOFOLLOW
        small_store(tmp_path)
    assert victim.read_text() == "precious"


def test_planted_symlink_at_checkpoint_temp_name_is_refused(tmp_path, monkeypatch):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    save_checkpoint(tmp_path / "c.pt", extra={"step": 1})
    monkeypatch.setattr(leftovers.secrets, "token_hex", lambda n: "0badcafe")
    os.symlink(victim, tmp_path / f".c.pt.tiermem-tmp-{os.getpid()}-0badcafe")
    with pytest.raises(FileExistsError):
        save_checkpoint(tmp_path / "c.pt", extra={"step": 2})
    assert victim.read_text() == "precious"
    assert load_checkpoint(tmp_path / "c.pt")["extra"] == {"step": 1}


def test_checkpoint_target_symlink_is_replaced_not_followed(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    os.symlink(victim, tmp_path / "c.pt")
    save_checkpoint(tmp_path / "c.pt", extra={"step": 1})
    assert victim.read_text() == "precious"
    assert not os.path.islink(tmp_path / "c.pt")
    assert load_checkpoint(tmp_path / "c.pt")["extra"] == {"step": 1}


def _store_exit(base, how):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(HERE.parent), str(HERE), os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen([sys.executable, str(HERE / "_worker.py"), "store_exit", str(base),
                             how], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)


def test_spill_dir_removed_at_exit_and_stale_dirs_of_killed_processes_cleaned(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    exiting, killed = _store_exit(tmp_path / "a", "exit"), _store_exit(tmp_path / "b", "kill")
    out, err = exiting.communicate(timeout=120)
    assert exiting.returncode == 0, err
    spill_dir = out.split()[-1]
    assert spill_dir.startswith(str(tmp_path / "a")) and not os.path.exists(spill_dir)  # at exit
    out, err = killed.communicate(timeout=120)
    assert killed.returncode == -9, err
    spill_dir, tmp_path = out.split()[-1], tmp_path / "b"
    assert os.path.isdir(spill_dir)  # SIGKILL leaves it behind...
    foreign = tmp_path / f"tiermem-{os.getpid()}-0000live"  # a live process's: kept
    foreign.mkdir(mode=0o700)
    store = small_store(tmp_path)  # ...and the next store removes it (dead pid)
    assert store._spill.removed_stale_dirs == [spill_dir]
    assert not os.path.exists(spill_dir) and foreign.exists()
    store.close()


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def _forge(obj, path):
    """What an attacker writes: torch.save plus a valid trailer (anyone can compute a SHA-256);
    tiermem's own writers refuse such objects (Note [checkpoint payload types])."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getvalue()
    trailer = b"TMCKPT\x00\x01" + len(data).to_bytes(8, "little") + hashlib.sha256(data).digest()
    pathlib.Path(path).write_bytes(data + trailer)


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_load_refuses_arbitrary_objects_and_runs_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # a file with a valid trailer but an object inside
    _forge({"format": "tiermem.checkpoint", "version": 1, "model": None, "optimizer": None,
            "extra": _Evil()}, tmp_path / "evil.pt")
    with pytest.raises(UnsafeCheckpointError, match="refused: it holds objects other than"):
        load_checkpoint(tmp_path / "evil.pt")
    _forge({"format": "tiermem.store", "version": 1, "entries": [_Evil()]}, tmp_path / "evil.snap")
    store = small_store(tmp_path)
    with pytest.raises(UnsafeCheckpointError):
        load_store(tmp_path / "evil.snap", store)
    assert len(store) == 0
    store.close()
    # a plain pickle (no trailer) is refused before unpickling, with or without verification
    with open(tmp_path / "plain.pkl", "wb") as f:
        pickle.dump({"extra": _Evil()}, f)
    with pytest.raises(CheckpointCorruption):
        load_checkpoint(tmp_path / "plain.pkl")
    with pytest.raises(UnsafeCheckpointError):
        load_checkpoint(tmp_path / "plain.pkl", verify=False)
    assert not os.path.exists(tmp_path / "pwned")


def test_saving_an_arbitrary_object_is_refused_and_runs_nothing(tmp_path, monkeypatch):
    # save checks the payload with the weights-only reader (Note [checkpoint payload types]):
    # the check itself must not execute what it refuses
    monkeypatch.chdir(tmp_path)
    for save in (lambda: atomic_save({"extra": _Evil()}, tmp_path / "evil.pt"),
                 lambda: save_checkpoint(tmp_path / "evil.pt", extra={"x": [_Evil()]})):
        with pytest.raises(TypeError, match=r"_Evil, which load_checkpoint would refuse .*"
                                            r"posix.system"):
            save()
    assert os.listdir(tmp_path) == []  # nothing written, nothing run


# ------------------------------------------------ a checkpoint directory writable by someone else
# Note [checkpoint directory fds] (tiermem/_ckpt_dir.py): a save works inside the temporary
# directory through its descriptor, never through its name, and fails loudly when the name no
# longer leads to it.


def _attacked_save(tmp_path, monkeypatch, attack):
    """A checkpoint in a directory an attacker controls (``shared``), a save during which
    ``attack(shared, temp_name)`` runs (as torch.save starts writing); returns the error."""
    import tiermem.checkpoint as ck  # noqa: PLC0415
    shared, victim = tmp_path / "shared", tmp_path / "home"
    shared.mkdir()
    victim.mkdir()
    (victim / "data").write_text("precious")  # a file of the user's that the old code moved
    path = shared / "c.pt"
    save_checkpoint(path, extra={"step": 1, "w": torch.arange(1000.0)})
    before = path.read_bytes()
    real_save = ck.torch.save

    def save_under_attack(obj, f, *args, **kwargs):
        temp = next(n for n in os.listdir(shared) if ".tiermem-tmp-" in n)
        attack(shared, temp, victim)
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(ck.torch, "save", save_under_attack)
    with pytest.raises(OSError) as info:
        save_checkpoint(path, extra={"step": 2, "w": torch.zeros(1000)})
    monkeypatch.undo()
    assert sorted(os.listdir(victim)) == ["data"] and (victim / "data").read_text() == "precious"
    return info.value, path, before


def test_temp_dir_swapped_for_a_symlink_mid_save_fails_and_writes_nothing_through_it(
        tmp_path, monkeypatch):
    def swap(shared, temp, victim):  # the temporary directory becomes a link to the user's dir
        os.rename(shared / temp, shared / "moved")
        os.symlink(victim, shared / temp)

    error, path, before = _attacked_save(tmp_path, monkeypatch, swap)
    assert "was replaced" in str(error) and str(path) in str(error), error
    assert path.read_bytes() == before  # the previous checkpoint, untouched
    assert load_checkpoint(path)["extra"]["step"] == 1
    assert os.listdir(path.parent / "moved") == []  # our files removed through the fd
    temp = next(n for n in os.listdir(path.parent) if ".tiermem-tmp-" in n)
    assert os.path.islink(path.parent / temp)  # the attacker's link: not followed, not deleted


def test_checkpoint_replaced_right_after_the_rename_fails_loudly(tmp_path, monkeypatch):
    import tiermem.checkpoint as ck  # noqa: PLC0415
    real_replace = os.replace

    def replace_then_swap(src, dst, **kwargs):  # someone puts another file in its place
        real_replace(src, dst, **kwargs)
        os.unlink(dst, dir_fd=kwargs.get("dst_dir_fd"))
        fd = os.open(dst, os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=kwargs.get("dst_dir_fd"))
        os.close(fd)

    save_checkpoint(tmp_path / "c.pt", extra={"step": 1})
    monkeypatch.setattr(ck.os, "replace", replace_then_swap)
    with pytest.raises(OSError, match=r"c.pt is not the file this save wrote"):
        save_checkpoint(tmp_path / "c.pt", extra={"step": 2})


def test_stale_temp_dir_swapped_for_a_symlink_before_cleanup_removes_nothing_through_it(
        tmp_path, monkeypatch):
    # a save's cleanup of a killed writer's temporary directory, in a directory someone else
    # can write: the directory is swapped for a link to the user's directory after it was
    # checked; removal goes through a descriptor opened with O_NOFOLLOW, so nothing is unlinked
    import tiermem.checkpoint as ck  # noqa: PLC0415
    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True, check=True).stdout)
    shared, victim = tmp_path / "shared", tmp_path / "home"
    shared.mkdir()
    victim.mkdir()
    stale = shared / f".c.pt.tiermem-tmp-{dead}-0badf00d"
    stale.mkdir(mode=0o700)
    leftovers.write_marker(str(stale), leftovers.Owner("checkpoint-tmp", dead, None, "0badf00d"))
    (stale / "data").write_bytes(b"partial")
    leftovers.write_marker(str(victim), leftovers.Owner("checkpoint-tmp", dead, None, "0badf00d"))
    (victim / "data").write_text("precious")  # the user's files with the names a save removes
    real = ck.stale_dirs

    def stale_then_swap(*args):
        found = real(*args)
        os.rename(stale, shared / "moved")
        os.symlink(victim, stale)
        return found

    monkeypatch.setattr(ck, "stale_dirs", stale_then_swap)
    assert ck.cleanup_temp_files(shared) == []
    assert sorted(os.listdir(victim)) == [".tiermem-owner", "data"]
    assert (victim / "data").read_text() == "precious"
    assert os.path.islink(stale)
