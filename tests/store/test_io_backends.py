"""I/O backends: exact byte counts for odd sizes, exclusive 0600 creation, errors, make_backend."""

import errno
import os
import stat

import pytest
import torch

from tiermem.store.io import make_backend, resolve_backend_name
from tiermem.store.io.kvikio_backend import kvikio_usable
from tiermem.store.io.posix import PosixBackend, ShortReadError
from tiermem.store.nvme import aligned_empty

SIZES = [1, 4095, 4096, 4097, 3 * (1 << 20) + 5]
KVIKIO_OK, KVIKIO_WHY = kvikio_usable()


def _backends():
    params = [pytest.param("posix", id="posix"), pytest.param("aiofiles", id="aiofiles")]
    params.append(pytest.param("kvikio", id="kvikio", marks=[
        pytest.mark.cuda, pytest.mark.skipif(not KVIKIO_OK, reason=f"kvikio: {KVIKIO_WHY}")]))
    return params


@pytest.fixture(params=_backends())
def backend(request):
    be = make_backend(request.param, 2)
    yield be
    be.shutdown()


def test_roundtrip_exact_counts_buffered(backend, tmp_path):
    path = str(tmp_path / "f.bin")
    h = backend.open(path, create=True, o_direct=False)
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        offset = 0
        for n in SIZES:
            src = torch.randint(0, 256, (n,), dtype=torch.uint8)
            assert backend.pwrite(h, src, offset).result() == n
            dst = torch.zeros(n, dtype=torch.uint8)
            assert backend.pread(h, dst, offset).result() == n
            assert torch.equal(src, dst)
            offset += n + 7                       # odd offsets too (buffered I/O)
        end = os.path.getsize(path)
        with pytest.raises(ShortReadError, match="short read") as ei:
            backend.pread(h, torch.empty(10, dtype=torch.uint8), end - 3).result()
        assert ei.value.filename == path and ei.value.errno == errno.ENODATA
    finally:
        backend.close_file(h)


def test_roundtrip_o_direct_aligned(backend, tmp_path):
    path = str(tmp_path / "d.bin")
    try:
        h = backend.open(path, create=True, o_direct=True)
    except OSError as exc:
        pytest.skip(f"filesystem refuses O_DIRECT: {exc}")
    try:
        n = 3 * (1 << 20)
        src = aligned_empty(n)
        src.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8))
        assert backend.pwrite(h, src, 8192).result() == n
        dst = aligned_empty(n)
        assert backend.pread(h, dst, 8192).result() == n
        assert torch.equal(src, dst)
    finally:
        backend.close_file(h)


def test_open_is_exclusive_and_refuses_symlinks(backend, tmp_path):
    path = str(tmp_path / "x.bin")
    backend.close_file(backend.open(path, create=True, o_direct=False))
    with pytest.raises(FileExistsError):
        backend.open(path, create=True, o_direct=False)
    link = str(tmp_path / "link.bin")
    os.symlink(path, link)
    with pytest.raises(OSError):
        backend.open(link, create=False, o_direct=False)


def test_bad_buffer_rejected(tmp_path):
    be = PosixBackend(1)
    h = be.open(str(tmp_path / "b.bin"), create=True, o_direct=False)
    try:
        with pytest.raises(TypeError, match="torch.uint8 CPU tensor, got a torch.float32"):
            be.pwrite(h, torch.zeros(4), 0)
        with pytest.raises(ValueError, match="contiguous"):
            be.pwrite(h, torch.zeros(4, 4, dtype=torch.uint8).t(), 0)
    finally:
        be.close_file(h)
        be.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        be.pwrite(h, torch.zeros(4, dtype=torch.uint8), 0)


def test_write_error_names_file_and_offset(tmp_path):
    be = PosixBackend(1)
    path = str(tmp_path / "ro.bin")
    with open(path, "wb"):
        pass
    fd = os.open(path, os.O_RDONLY)           # writing to a read-only fd: EBADF from pwritev
    from tiermem.store.io.posix import PosixHandle
    h = PosixHandle(fd, path, False)
    try:
        with pytest.raises(OSError, match=r"writing 4 bytes at offset 12288") as ei:
            be.pwrite(h, torch.zeros(4, dtype=torch.uint8), 12288).result()
        assert ei.value.errno == errno.EBADF and ei.value.filename == path
    finally:
        be.close_file(h)
        be.shutdown()


def test_make_backend_names():
    be = make_backend("posix", 1)
    assert isinstance(be, PosixBackend) and be.name == "posix"
    be.shutdown()
    with pytest.raises(ValueError,
                       match=r"io_backend='nvme'.*'auto', 'posix', 'kvikio', 'aiofiles'"):
        make_backend("nvme", 1)
    with pytest.raises(ValueError, match="io_threads=0"):
        make_backend("posix", 0)
    assert resolve_backend_name("auto") == "posix"  # whether or not kvikio imports
    if not KVIKIO_OK:
        with pytest.raises(ValueError, match=r"io_backend='kvikio' is not usable here: .*"
                                             r"fix: set io_backend='posix'"):
            make_backend("kvikio", 1)


def test_kvikio_usable_reason_without_driver():
    ok, why = kvikio_usable()
    assert ok == (why == "")
    if not ok:
        assert "kvikio" in why or "libcuda" in why
