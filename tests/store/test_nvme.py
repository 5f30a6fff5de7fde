"""SpillSpace: round trips, the private directory, cleanup, injected faults, bad input."""

import errno
import gc
import os
import stat
import subprocess
import sys
import threading
from concurrent.futures import Future

import pytest
import torch

import tiermem.store.nvme as nvme
from tiermem._leftovers import Owner, write_marker
from tiermem.store.io import make_backend
from tiermem.store.io.kvikio_backend import kvikio_usable
from tiermem.store.io.posix import PosixBackend
from tiermem.store.nvme import (Extent, SpillCorruption, SpillError, SpillFull, SpillSpace,
                                aligned_empty, cleanup_stale)

CHUNK = 64 * 1024
SIZES = [1, 4095, 4096, 4097, 3 * CHUNK + 5]
KVIKIO_OK, KVIKIO_WHY = kvikio_usable()


def _rand(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)


def _unaligned(n):
    """A uint8 tensor whose data pointer is 1 byte past a page boundary."""
    t = aligned_empty(n + 1)[1:]
    assert t.data_ptr() % 4096 == 1
    return t


class FaultyBackend(PosixBackend):
    """PosixBackend whose first ``fail_writes`` writes / ``fail_reads`` reads fail with ``err``
    in the worker thread (the way a real failing syscall shows up)."""

    def __init__(self, threads=2, *, write_errno=None, read_errno=None, times=10**9):
        super().__init__(threads)
        self.write_errno, self.read_errno, self.left = write_errno, read_errno, times
        self.calls = 0
        self._lock = threading.Lock()

    def _should_fail(self, err):
        with self._lock:  # calls come from several threads (retries in callbacks)
            self.calls += 1
            if err is None or self.left <= 0:
                return False
            self.left -= 1
            return True

    def _fail(self, err, handle, offset):
        def boom():
            raise OSError(err, f"{os.strerror(err)} (injected at offset {offset})", handle.path)
        return self._pool.submit(boom)

    def pwrite(self, handle, buf, offset):
        if self._should_fail(self.write_errno):
            return self._fail(self.write_errno, handle, offset)
        return super().pwrite(handle, buf, offset)

    def pread(self, handle, buf, offset):
        if self._should_fail(self.read_errno):
            return self._fail(self.read_errno, handle, offset)
        return super().pread(handle, buf, offset)


@pytest.fixture
def posix():
    be = PosixBackend(2)
    yield be
    be.shutdown()


def _space(base, backend, capacity=64 << 20, **kw):
    kw.setdefault("chunk_bytes", CHUNK)
    return SpillSpace(str(base), capacity, backend=backend, **kw)


# ---------------------------------------------------------------------------------------------
# round trips


@pytest.mark.parametrize("name", [
    "posix", "aiofiles",
    pytest.param("kvikio", marks=[pytest.mark.cuda, pytest.mark.skipif(
        not KVIKIO_OK, reason=f"kvikio: {KVIKIO_WHY}")])])
@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "unaligned"])
def test_roundtrip_odd_sizes(tmp_path, name, aligned):
    be = make_backend(name, 2)
    try:
        with _space(tmp_path, be) as sp:
            extents = []
            for i, n in enumerate(SIZES):
                src = aligned_empty(nvme.round_up(n, 4096)) if aligned else _unaligned(n)
                src[:n].copy_(_rand(n, i))
                ext = sp.write(("k", i), src, n).result()
                assert (ext.nbytes, ext.alloc_bytes) == (n, nvme.round_up(n, 4096))
                assert ext.offset % 4096 == 0 and len(ext.checksums) == -(-ext.alloc_bytes // CHUNK)
                extents.append(ext)
            assert sp.bytes_written == sum(SIZES)
            assert sp.used_bytes == sum(e.alloc_bytes for e in extents)
            for i, (n, ext) in enumerate(zip(SIZES, extents)):
                dst = aligned_empty(ext.alloc_bytes) if aligned else _unaligned(n)
                assert sp.read(("k", i), ext, dst).result() is None
                assert torch.equal(dst[:n], _rand(n, i))
            assert sp.bytes_read == sum(SIZES)
            for ext in extents:
                sp.free(ext)
            assert sp.used_bytes == 0
    finally:
        be.shutdown()


def test_zero_bytes_and_reuse_after_free(tmp_path, posix):
    with _space(tmp_path, posix, capacity=2 * 4096) as sp:
        ext0 = sp.write("empty", torch.empty(0, dtype=torch.uint8), 0).result()
        assert ext0 == Extent(0, 0, 0, ())
        sp.read("empty", ext0, torch.empty(0, dtype=torch.uint8)).result()
        sp.free(ext0)
        for i in range(5):                           # the same 2 pages over and over
            ext = sp.write(i, _rand(8192, i), 8192).result()
            out = torch.empty(8192, dtype=torch.uint8)
            sp.read(i, ext, out).result()
            assert torch.equal(out, _rand(8192, i))
            sp.free(ext)
        assert os.path.getsize(sp.path) == 8192       # grown once to the highest extent


def test_concurrent_writers_and_readers(tmp_path, posix):
    with _space(tmp_path, posix) as sp:
        errors = []

        def worker(t):
            try:
                for i in range(20):
                    n = 1000 * (i + 1) + t
                    ext = sp.write((t, i), _rand(n, 100 * t + i), n).result()
                    out = torch.empty(n, dtype=torch.uint8)
                    sp.read((t, i), ext, out).result()
                    assert torch.equal(out, _rand(n, 100 * t + i))
                    sp.free(ext)
            except Exception as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert errors == [] and sp.used_bytes == 0


# ---------------------------------------------------------------------------------------------
# the private directory and its cleanup


def test_private_dir_modes_and_removal(tmp_path, posix):
    sp = _space(tmp_path, posix)
    d = sp.dir_path
    assert os.path.dirname(d) == str(tmp_path)
    assert os.path.basename(d).startswith(f"tiermem-{os.getpid()}-")
    st = os.lstat(d)
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700
    assert st.st_uid == os.geteuid()
    assert stat.S_IMODE(os.lstat(sp.path).st_mode) == 0o600
    assert sp.o_direct is True                       # tmp_path is on ext4 here
    sp.write("k", _rand(10), 10).result()
    sp.close()
    assert not os.path.exists(d)
    sp.close()                                        # idempotent
    with pytest.raises(ValueError, match="is closed"):
        sp.write("k", _rand(10), 10)


def test_umask_does_not_weaken_or_break_modes(tmp_path, posix):
    old = os.umask(0o277)                             # would give a dir mode 0500
    try:
        with _space(tmp_path, posix) as sp:
            assert stat.S_IMODE(os.lstat(sp.dir_path).st_mode) == 0o700
            assert stat.S_IMODE(os.lstat(sp.path).st_mode) == 0o600
    finally:
        os.umask(old)


def test_dir_removed_when_garbage_collected(tmp_path, posix):
    sp = _space(tmp_path, posix)
    d = sp.dir_path
    del sp
    gc.collect()
    assert not os.path.exists(d)


def test_dir_removed_at_interpreter_exit(tmp_path):
    code = ("import sys; from tiermem.store.nvme import SpillSpace; "
            "from tiermem.store.io import make_backend; "
            "sp = SpillSpace(sys.argv[1], 1 << 20, backend=make_backend('posix', 1)); "
            "sp._keep = sp; print(sp.dir_path)")       # a cycle: only the atexit hook removes it
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                         text=True, check=True, cwd=os.path.dirname(os.path.dirname(
                             os.path.dirname(os.path.abspath(__file__)))))
    d = out.stdout.strip()
    assert d.startswith(str(tmp_path)) and not os.path.exists(d)


def _leftover(parent, pid, token, files=("spill.bin",), start=None):
    """A spill directory as a process ``pid`` would have left it: marker and spill file."""
    path = parent / f"tiermem-{pid}-{token}"
    path.mkdir(mode=0o700)
    write_marker(str(path), Owner("spill", pid, start, token))
    for name in files:
        (path / name).write_bytes(b"x" * 100)
    return path


def test_stale_dirs_of_dead_processes_are_removed(tmp_path, posix):
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    dead = _leftover(tmp_path, proc.pid, "deadbeef")
    alive = _leftover(tmp_path, os.getppid(), "0123abcd")        # our parent is alive
    target = tmp_path / "not-ours"
    target.mkdir()
    (target / "keep").write_bytes(b"k")
    link = tmp_path / f"tiermem-{proc.pid}-cafe"                # a symlink: never followed
    link.symlink_to(target)
    other = tmp_path / "tiermem-notapid"
    other.mkdir()
    sp = _space(tmp_path, posix)
    try:
        assert sp.removed_stale_dirs == [str(dead)]
        assert not dead.exists() and alive.exists() and other.exists()
        assert link.is_symlink() and (target / "keep").exists()
        assert cleanup_stale(tmp_path) == []
        assert cleanup_stale(tmp_path / "missing") == []
    finally:
        sp.close()


def test_stale_cleanup_keeps_what_tiermem_did_not_make(tmp_path):
    """Issue 16.6: a name matching the pattern is not enough; marker, name and contents must
    all agree, and a pid reused by a process with another start time counts as dead."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    user = tmp_path / "tiermem-20240612-1a"                     # a user's dir: no marker
    user.mkdir()
    (user / "results.csv").write_text("precious")
    extra = _leftover(tmp_path, proc.pid, "00aa", files=("spill.bin", "notes.txt"))
    forged = _leftover(tmp_path, proc.pid, "00bb")
    os.rename(forged, tmp_path / f"tiermem-{proc.pid}-00cc")      # marker id != name's id
    reused = _leftover(tmp_path, os.getppid(), "00dd", start=1.0)  # pid now another process's
    unfinished = tmp_path / f"tiermem-{proc.pid}-00ee"           # killed before its marker
    unfinished.mkdir()
    (unfinished / ".tiermem-owner").touch()
    removed = cleanup_stale(tmp_path)
    assert sorted(removed) == sorted([str(reused), str(unfinished)])
    assert (user / "results.csv").read_text() == "precious"
    assert (extra / "notes.txt").exists() and (tmp_path / f"tiermem-{proc.pid}-00cc").exists()


def test_close_never_removes_a_file_tiermem_did_not_write(tmp_path, posix):
    sp = _space(tmp_path, posix)
    user_file = os.path.join(sp.dir_path, "mine.txt")
    with open(user_file, "w") as f:
        f.write("keep")
    sp.close()
    assert open(user_file).read() == "keep"
    assert sorted(os.listdir(sp.dir_path)) == ["mine.txt"]  # marker and spill file gone


# ---------------------------------------------------------------------------------------------
# corruption, truncation, injected faults


def _flip_bit(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


def test_bit_flip_detected(tmp_path, posix):
    with _space(tmp_path, posix) as sp:
        n = 3 * CHUNK + 5
        ext = sp.write("layer3.act", _rand(n), n).result()
        _flip_bit(sp.path, ext.offset + 2 * CHUNK + 17)
        with pytest.raises(SpillCorruption, match="corrupted") as ei:
            sp.read("layer3.act", ext, torch.empty(n, dtype=torch.uint8)).result()
        e = ei.value
        assert (e.key, e.path, e.offset) == ("layer3.act", sp.path, ext.offset + 2 * CHUNK)
        msg = str(e)
        assert "key='layer3.act'" in msg and sp.path in msg
        assert f"offset={ext.offset + 2 * CHUNK}" in msg
        assert "mismatch" in msg
        # the extent is still allocated and other extents still read fine
        assert sp.used_bytes == ext.alloc_bytes


def test_truncated_file_detected(tmp_path, posix):
    with _space(tmp_path, posix) as sp:
        n = 3 * CHUNK
        ext = sp.write(7, _rand(n), n).result()
        os.truncate(sp.path, ext.offset + CHUNK + 4096)
        with pytest.raises(SpillCorruption, match="truncated") as ei:
            sp.read(7, ext, torch.empty(n, dtype=torch.uint8)).result()
        assert ei.value.key == 7 and ei.value.path == sp.path
        assert ei.value.offset == ext.offset + CHUNK + 4096     # where the missing bytes start
        assert f"file={sp.path}" in str(ei.value)


def test_enospc_on_write_frees_extent_and_loses_nothing(tmp_path):
    be = FaultyBackend(write_errno=errno.ENOSPC, times=1)
    try:
        with _space(tmp_path, be) as sp:
            src = _rand(CHUNK - 3)                        # one chunk: one pwrite call
            before = src.clone()
            with pytest.raises(SpillError) as ei:
                sp.write("opt.m.12", src, src.numel()).result()
            e = ei.value
            assert e.errno == errno.ENOSPC and e.key == "opt.m.12" and e.path == sp.path
            assert "No space left on device" in str(e) and "key='opt.m.12'" in str(e)
            assert e.offset == 0
            assert sp.used_bytes == 0 and not sp._ops and torch.equal(src, before)
            assert be.calls == 1                           # ENOSPC is not retried
            ext = sp.write("opt.m.12", src, src.numel()).result()  # disk has room again
            out = torch.empty_like(src)
            sp.read("opt.m.12", ext, out).result()
            assert torch.equal(out, before)
    finally:
        be.shutdown()


def test_enospc_when_growing_the_file(tmp_path, posix, monkeypatch):
    with _space(tmp_path, posix) as sp:
        def no_space(fd, offset, nbytes):
            raise OSError(errno.ENOSPC, "No space left on device")
        monkeypatch.setattr(nvme.os, "posix_fallocate", no_space)
        with pytest.raises(SpillError, match="No space left on device") as ei:
            sp.write("big", _rand(8192), 8192).result()
        assert ei.value.errno == errno.ENOSPC and ei.value.key == "big"
        assert sp.used_bytes == 0
        monkeypatch.undo()
        assert sp.write("big", _rand(8192), 8192).result().nbytes == 8192


def test_eio_on_read_is_retried_then_raised(tmp_path):
    be = FaultyBackend(read_errno=errno.EIO)
    try:
        with _space(tmp_path, be, io_retries=2) as sp:
            ext = sp.write("w", _rand(5000), 5000).result()
            calls = be.calls
            with pytest.raises(SpillError) as ei:
                sp.read("w", ext, torch.empty(5000, dtype=torch.uint8)).result()
            e = ei.value
            assert not isinstance(e, SpillCorruption)
            assert (e.errno, e.key, e.path, e.offset) == (errno.EIO, "w", sp.path, ext.offset)
            assert "Input/output error" in str(e) and f"offset={ext.offset}" in str(e)
            assert be.calls - calls == 3                  # 1 try + 2 retries
    finally:
        be.shutdown()


def test_transient_eio_on_read_recovers(tmp_path):
    be = FaultyBackend(read_errno=errno.EIO, times=1)
    try:
        with _space(tmp_path, be) as sp:
            ext = sp.write("w", _rand(5000), 5000).result()
            out = torch.empty(5000, dtype=torch.uint8)
            sp.read("w", ext, out).result()
            assert torch.equal(out, _rand(5000))
    finally:
        be.shutdown()


def test_spill_full(tmp_path, posix):
    with _space(tmp_path, posix, capacity=3 * 4096 + 100) as sp:
        assert sp.capacity_bytes == 3 * 4096
        ext = sp.write("a", _rand(8000), 8000).result()
        assert not sp.fits(8000) and sp.fits(4096)
        with pytest.raises(SpillFull, match=r"no free extent of 8192 bytes.*nvme_bytes") as ei:
            sp.write("b", _rand(8000), 8000)
        assert ei.value.key == "b" and ei.value.errno is None and "key='b'" in str(ei.value)
        assert sp.used_bytes == 8192
        sp.free(ext)
        assert sp.fits(3 * 4096)


# ---------------------------------------------------------------------------------------------
# bad input, O_DIRECT choice


def test_unwritable_or_missing_base_dir(tmp_path, posix):
    (tmp_path / "file").write_bytes(b"")
    for bad in (tmp_path / "file" / "sub", tmp_path / "missing"):
        with pytest.raises(ValueError, match=r"StoreConfig.nvme_dir=.* is not writable: .*fix: "):
            _space(bad, posix)
    with pytest.raises(ValueError, match="StoreConfig.nvme_bytes=0"):
        _space(tmp_path, posix, capacity=0)
    with pytest.raises(ValueError, match="StoreConfig.io_chunk_bytes=1000"):
        _space(tmp_path, posix, chunk_bytes=1000)
    with pytest.raises(ValueError, match="StoreConfig.o_direct='yes'"):
        _space(tmp_path, posix, o_direct="yes")
    assert [p.name for p in tmp_path.iterdir()] == ["file"]   # nothing left behind


def test_bad_buffers_and_extents(tmp_path, posix):
    with _space(tmp_path, posix) as sp:
        with pytest.raises(TypeError, match="SpillSpace.write buf must be a torch.uint8"):
            sp.write("k", torch.zeros(10), 10)
        with pytest.raises(ValueError, match=r"nbytes=11 must be an int in \[0, buf.numel\(\)=10"):
            sp.write("k", _rand(10), 11)
        ext = sp.write("k", _rand(10), 10).result()
        with pytest.raises(ValueError, match="buf has 5 bytes, the extent holds 10"):
            sp.read("k", ext, torch.empty(5, dtype=torch.uint8))
        sp.free(ext)
        with pytest.raises(ValueError, match="not allocated"):
            sp.read("k", ext, torch.empty(10, dtype=torch.uint8))
        with pytest.raises(ValueError, match="double free"):
            sp.free(ext)
        assert not sp._ops


def _refuse_o_direct(monkeypatch):
    real_open = os.open

    def fake_open(path, flags, *args, **kw):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args, **kw)

    monkeypatch.setattr(nvme.os, "open", fake_open)


def test_o_direct_auto_falls_back_to_buffered(tmp_path, posix, monkeypatch):
    _refuse_o_direct(monkeypatch)                     # what older tmpfs / some FUSE fs do
    with _space(tmp_path, posix, o_direct="auto") as sp:
        assert sp.o_direct is False
        src = _unaligned(4097)
        src.copy_(_rand(4097))
        ext = sp.write("k", src, 4097).result()
        out = torch.empty(4097, dtype=torch.uint8)
        sp.read("k", ext, out).result()
        assert torch.equal(out, _rand(4097))
    with pytest.raises(ValueError, match=r"o_direct=True but .* does not support O_DIRECT.*"
                                         r"fix: o_direct='auto'"):
        _space(tmp_path, posix, o_direct=True)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")
@pytest.mark.parametrize("o_direct", ["auto", False])
def test_tmpfs_roundtrip(posix, o_direct):
    # tmpfs refuses O_DIRECT before Linux 6.6 and accepts it since; either way "auto" works.
    with SpillSpace("/dev/shm", 1 << 20, backend=posix, o_direct=o_direct, chunk_bytes=CHUNK) as sp:
        ext = sp.write("k", _rand(3 * CHUNK + 5), 3 * CHUNK + 5).result()
        out = torch.empty(3 * CHUNK + 5, dtype=torch.uint8)
        sp.read("k", ext, out).result()
        assert torch.equal(out, _rand(3 * CHUNK + 5))
        d = sp.dir_path
    assert not os.path.exists(d)


def test_checksum_off_still_detects_truncation(tmp_path, posix):
    with _space(tmp_path, posix, checksum=False) as sp:
        assert sp.checksum_name is None
        ext = sp.write("k", _rand(3 * CHUNK), 3 * CHUNK).result()
        assert ext.checksums == ()
        os.truncate(sp.path, ext.offset + CHUNK)
        with pytest.raises(SpillCorruption, match="truncated"):
            sp.read("k", ext, torch.empty(3 * CHUNK, dtype=torch.uint8)).result()


def test_checksum_impl_is_named():
    name, fn = nvme.checksum_impl()
    assert name in ("crc32c", "crc32")
    assert fn(_rand(100).numpy()) == fn(_rand(100).numpy())


def test_backend_shut_down_fails_future_not_caller(tmp_path):
    be = PosixBackend(1)
    sp = _space(tmp_path, be)
    be.shutdown()
    fut = sp.write("k", _rand(10), 10)
    assert isinstance(fut, Future)
    with pytest.raises(SpillError, match="shut down"):
        fut.result()
    assert sp.used_bytes == 0
    sp.close()
