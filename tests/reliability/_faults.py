"""Fault-injecting I/O backend and helpers shared by the reliability tests."""

from __future__ import annotations

import errno
import os
import threading
import time

import torch

import tiermem.store.store as store_mod
from tiermem import StoreConfig, TierStore
from tiermem.store.io.posix import PosixBackend, pread_all, pwrite_all


class FaultBackend(PosixBackend):
    """A :class:`PosixBackend` that injects faults the way a failing syscall shows them.

    Args:
        write_errno / read_errno: errno raised (in the worker thread, as an ``OSError`` naming
            the file and offset) by the next ``fail_writes`` / ``fail_reads`` requests.
        fail_writes / fail_reads: how many requests fail (``None``: all of them).
        delay_s: sleep this long in the worker before every request (a slow disk).
    """

    def __init__(self, threads: int = 2, *, write_errno: int | None = None,
                 read_errno: int | None = None, fail_writes: int | None = None,
                 fail_reads: int | None = None, delay_s: float = 0.0) -> None:
        super().__init__(threads)
        self.write_errno, self.read_errno = write_errno, read_errno
        self.writes_left = fail_writes if fail_writes is not None else 1 << 60
        self.reads_left = fail_reads if fail_reads is not None else 1 << 60
        self.delay_s = delay_s
        self.writes = self.reads = self.failed_writes = self.failed_reads = 0
        self._lock = threading.Lock()

    def _take(self, kind: str) -> int | None:
        with self._lock:  # requests and retries come from several threads
            if kind == "write":
                self.writes += 1
                if self.write_errno is None or self.writes_left <= 0:
                    return None
                self.writes_left -= 1
                self.failed_writes += 1
                return self.write_errno
            self.reads += 1
            if self.read_errno is None or self.reads_left <= 0:
                return None
            self.reads_left -= 1
            self.failed_reads += 1
            return self.read_errno

    def _run(self, kind, handle, buf, offset):
        from tiermem.store.io.posix import host_view  # noqa: PLC0415

        err = self._take(kind)
        view = host_view(buf)
        delay = self.delay_s

        def work():
            if delay:
                time.sleep(delay)
            if err is not None:
                action = "writing" if kind == "write" else "reading"
                raise OSError(err, f"{os.strerror(err)} (injected; {action} {view.nbytes} bytes "
                                   f"at offset {offset})", handle.path)
            fn = pwrite_all if kind == "write" else pread_all
            return fn(handle.fd, view, offset, handle.path)

        return self._submit(work)

    def pwrite(self, handle, buf, offset):
        return self._run("write", handle, buf, offset)

    def pread(self, handle, buf, offset):
        return self._run("read", handle, buf, offset)


def install_backend(monkeypatch, backend) -> None:
    """Make the next ``TierStore`` use ``backend`` for its spill space."""
    monkeypatch.setattr(store_mod, "make_backend", lambda name, threads: backend)


def small_store(tmp_path, **kw) -> TierStore:
    kw.setdefault("gpu_bytes", 64 << 10)
    kw.setdefault("cpu_bytes", 64 << 10)
    kw.setdefault("nvme_bytes", 1 << 20)
    kw.setdefault("nvme_dir", str(tmp_path) if kw["nvme_bytes"] else None)
    kw.setdefault("pool_slab_bytes", 64 << 10)
    kw.setdefault("io_backend", "posix")
    kw.setdefault("io_threads", 2)
    kw.setdefault("io_chunk_bytes", 16 << 10)
    kw.setdefault("o_direct", False)
    return TierStore(StoreConfig(**kw))


def rand(n: int, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g).to(dtype)


def check_budgets(store: TierStore) -> None:
    for tier in ("gpu", "cpu", "nvme"):
        used, budget = store.used_bytes(tier), store.config.budget(tier)
        assert used <= budget, f"{tier}: used {used} > budget {budget}"
    assert store._pool.reserved_bytes <= store.config.cpu_bytes


ENOSPC, EIO = errno.ENOSPC, errno.EIO
