"""TierStore: tensors kept in GPU memory, pinned host memory or NVMe files, under byte budgets.

Each key lives in exactly one tier. ``put`` places a tensor, ``get`` returns it on the compute
device (promoting it there), ``prefetch`` starts that promotion in the background and returns a
future, ``evict`` moves a key down, ``delete`` drops it. When a tier is full, victims chosen by
the eviction policy move down (gpu -> cpu -> nvme); keys held by a caller or in flight are never
chosen. Budgets are hard limits: a move reserves its destination bytes before it starts and
releases its source bytes only when the copy has finished, so no tier ever holds more than its
budget, even for an instant.

Its parts, each owned by the store and used under its lock: the in-flight move table
(``moves.py``: ``MoveTable``, how a move completes or reverts), the budgets and the eviction
engine (``budgets.py``: ``Budgets``, ``TierFullError``, Note [cascade]) and the placement that
starts each copy between tiers (``placement.py``: ``Placement``).

Note [fork]: a store belongs to the process that made it. A child forked while it is alive
inherits the object but not its I/O threads or device memory, and maybe its lock in the held
state (Note [inherited], ``fork.py``): every operation there raises :class:`StoreClosedError`
saying so before it takes any lock, and ``close()`` (or dropping the store, or the child's exit)
only forgets the child's copy, waiting for nothing: the parent's spill files stay (see
``nvme.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterator

import torch

from tiermem.config import TIERS, StoreConfig
from tiermem.names import resolve_device
from tiermem.store.fork import track as track_forks
from tiermem.store.budgets import Budgets, TierFullError
from tiermem.store.clean import note_read
from tiermem.store.io import make_backend
from tiermem.store.moves import MoveTable, _Move
from tiermem.store.nvme import Extent, SpillSpace
from tiermem.store.placement import Placement
from tiermem.store.policies import make_policy
from tiermem.store.pool import HostBlock, HostPool
from tiermem.store.prefetch import Prefetcher
from tiermem.store.transfer import Copier, TransferFuture

_RANK = {t: i for i, t in enumerate(TIERS)}


class StoreClosedError(RuntimeError):
    """An operation on a closed :class:`TierStore`, or on one made by the parent of a forked
    process (Note [fork])."""


def _inexact_kind(tensor: torch.Tensor) -> tuple[str, str] | None:
    """``(kind, fix)`` when the store cannot keep ``tensor`` exactly as dense bytes with a dtype
    and a shape (quantized, sparse, nested, conjugate or negative views), else None."""
    if tensor.is_nested:
        return ("nested", "store its components (tensor.unbind()) or a padded tensor "
                          "(tensor.to_padded_tensor(0.0))")
    if tensor.is_quantized:
        return (f"quantized ({tensor.dtype}, {tensor.qscheme()})",
                "store tensor.int_repr() and its scale/zero point, or tensor.dequantize()")
    if tensor.layout != torch.strided:
        return (f"sparse ({tensor.layout})",
                "store tensor.to_dense(), or its indices and values as separate keys")
    if tensor.is_conj():
        return "conjugate view", "store tensor.resolve_conj()"
    if tensor.is_neg():
        return "negative view", "store tensor.resolve_neg()"
    return None


@dataclass(eq=False)
class _Entry:
    key: Hashable
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    tier: str
    device_buf: torch.Tensor | None = None  # "gpu": uint8 tensor of nbytes on the device
    block: HostBlock | None = None          # "cpu": pool block
    extent: Extent | None = None            # "nvme": spill extent
    move: "_Move | None" = None             # in-flight move into ``tier``
    holds: int = 0
    kept: Extent | None = None              # clean NVMe copy while above nvme (clean.py)
    keep_extent: bool = False               # the last read only reads (Note [clean reads])


class TierStore:
    """A three-tier tensor store with byte budgets, eviction and asynchronous prefetch.

    Args:
        config: the store's :class:`~tiermem.StoreConfig`; keyword arguments build one instead
            (``TierStore(gpu_bytes="1GiB", cpu_bytes="8GiB")``).
        recorder: a :class:`tiermem.telemetry.Recorder` told about every memory change, move
            and stall (None: no telemetry; costs one ``if`` per event). Also settable later
            through the ``recorder`` attribute.

    Raises:
        ValueError: invalid config (negative budget, unwritable ``nvme_dir``, CUDA asked for
            but absent, ...), naming the field and the fix.
        TypeError: ``prefetch_lookahead`` > 0 with a policy that is not a ``TracePolicy``.

    Tensors come back with their dtype and shape; non-contiguous input is stored contiguous. A
    device tensor put into the ``"gpu"`` tier is kept by reference when it owns its storage
    exactly (no copy): do not modify it afterwards. Tensors returned by :meth:`get` share the
    store's memory; they stay valid while the key is held (:meth:`hold`) or until an operation
    may move the key.
    """

    def __init__(self, config: StoreConfig | None = None, *, recorder: Any = None,
                 **kwargs: Any) -> None:
        if config is not None and kwargs:
            raise TypeError("TierStore takes a StoreConfig or keyword fields, not both")
        if config is None:
            config = StoreConfig(**kwargs)
        if not isinstance(config, StoreConfig):
            raise TypeError(f"config must be a tiermem.StoreConfig, got {type(config).__name__}")
        self.config = config
        self.device = resolve_device(config.device, "StoreConfig.device")
        pin = self.device.type == "cuda" if config.pin_memory == "auto" else config.pin_memory
        if pin and not torch.cuda.is_available():
            raise ValueError("StoreConfig.pin_memory=True needs CUDA, which is not available "
                             "here; use pin_memory='auto' or False")
        self._lock = threading.RLock()  # guards entries, budgets, the pool and the policy
        self._pid = os.getpid()  # Note [fork]
        self._inherited = False  # set in a forked child (Note [inherited])
        self._entries: dict[Hashable, _Entry] = {}
        self._inflight = MoveTable(self)  # moves in flight (moves.py)
        self._budgets = Budgets(self, self._inflight)  # budgets and eviction (budgets.py)
        self._pool = HostPool(config.cpu_bytes, config.pool_slab_bytes, pin)
        self._spill: SpillSpace | None = None
        if config.nvme_bytes > 0:
            self._spill = SpillSpace(
                config.nvme_dir, config.nvme_bytes,
                backend=make_backend(config.io_backend, config.io_threads),
                o_direct=config.o_direct, checksum=config.checksum,
                chunk_bytes=config.io_chunk_bytes, owns_backend=True)  # close() stops its threads
        self._copier = Copier(self.device)
        self._policy = make_policy(config.policy)
        self._placer = Placement(self, self._inflight, self._budgets, self._copier, self._pool)
        self._stall_s = dict.fromkeys(TIERS, 0.0)
        self._closed = False
        self._recorder = None
        self.recorder = recorder
        self._policy.bind(self)  # the trace policy reads key sizes
        self._prefetcher = None
        if config.prefetch_lookahead:
            self._prefetcher = Prefetcher(self, self._policy, config.prefetch_lookahead)
        track_forks(self)

    def _after_fork_in_child(self) -> None:
        """In a forked child (Note [inherited]): refuse everything from now on; the lock copied
        from the parent, maybe held, is replaced and never taken."""
        self._inherited = True
        self._lock = threading.RLock()

    @property
    def recorder(self) -> Any:
        """The :class:`tiermem.telemetry.Recorder` this store reports to, or None."""
        return self._recorder

    @recorder.setter
    def recorder(self, recorder: Any) -> None:
        if recorder is not None:
            recorder.attach(self)
        self._recorder = recorder

    # ------------------------------------------------------------------ public API

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run (a closed store refuses every operation)."""
        return self._closed

    def put(self, key: Hashable, tensor: torch.Tensor, tier: str | None = None) -> None:
        """Store ``tensor`` under ``key``, replacing any old value once the new one is placed.

        Args:
            key: any hashable.
            tensor: any dtype and shape, on the CPU or on the store's device.
            tier: ``"gpu"``, ``"cpu"`` or ``"nvme"``; ``None`` places it in the fastest tier that
                can take it (evicting there if needed).

        Raises:
            TypeError: ``tensor`` is not a tensor, or of a kind the store cannot keep exactly
                (quantized, sparse, nested, a conjugate or negative view), naming the key, the
                kind and the fix.
            ValueError: unknown tier, a tensor on another device, a held key.
            TierFullError: it fits in no allowed tier (nothing stored is lost); the message
                says which budget blocked it.
            StoreClosedError: the store is closed, or was made by the parent of this forked
                process.
        """
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"put({key!r}): tensor must be a torch.Tensor, got {type(tensor).__name__}")
        inexact = _inexact_kind(tensor)
        if inexact is not None:
            raise TypeError(f"put({key!r}): a {inexact[0]} tensor cannot be stored exactly (the "
                            f"store keeps a dense tensor's bytes, dtype and shape); {inexact[1]}")
        self._check_tier(tier, allow_none=True)
        if tensor.device.type not in ("cpu", self.device.type) or (
                tensor.device.type == self.device.type != "cpu" and tensor.device != self.device):
            raise ValueError(f"put({key!r}): tensor is on {tensor.device} but this store's device "
                             f"is {self.device}; move it with .to({str(self.device)!r}) or make a "
                             f"store with StoreConfig.device={str(tensor.device)!r}")
        src = tensor.detach()
        if not src.is_contiguous():
            src = src.contiguous()
        nbytes = src.numel() * src.element_size()
        flat = src.reshape(-1).view(torch.uint8) if nbytes else src.new_empty(0, dtype=torch.uint8)
        self._check_open()  # Note [fork]: before the lock
        with self._lock:
            self._check_open()
            self._inflight.reap()
            old = self._entries.get(key)
            if old is not None and old.holds:
                raise ValueError(f"put({key!r}): the key is held by a caller; release it first")
            too_big = ({t: self._budgets.too_big(t, nbytes, key) for t in TIERS}
                       if tier is None else {})
            errors = [reason for reason in too_big.values() if reason]  # each tier says why
            candidates = [tier] if tier is not None else [t for t, r in too_big.items() if r is None]
            entry = _Entry(key, nbytes, src.dtype, tuple(src.shape), tier or "gpu")
            for t in candidates:
                try:
                    self._placer.place(entry, t, flat,
                                       owns=src.untyped_storage().nbytes() == nbytes)
                    break
                except TierFullError as exc:
                    errors.append(str(exc))
            else:
                raise TierFullError(f"put({key!r}): {nbytes} bytes fit in no tier: "
                                    + "; ".join(errors) + self._usage_hint())
            if old is not None:  # replaced only once the new value is placed: a failure keeps it
                self._drop(old)
            self._entries[key] = entry
            self._policy.on_move(key, None, entry.tier)
            self._policy.on_access(key, entry.tier)
            if self._recorder is not None:
                self._sample()
        if self._prefetcher is not None:
            self._prefetcher.after_access(key)

    def get(self, key: Hashable, tier: str = "gpu", *, hold: bool = False,
            keep_extent: bool = False) -> torch.Tensor:
        """Return the tensor of ``key``, moving it into ``tier`` first if it is lower.

        With ``tier="gpu"`` (default) the result is on the compute device and the calling
        thread's current stream has been made to wait for its copy (the host does not block on
        a device copy). With ``tier="cpu"`` it is a host tensor in the pool, ready to read.

        Args:
            key: a stored key.
            tier: ``"gpu"`` or ``"cpu"``; a key already in a higher tier, or held by a caller
                (:meth:`hold`; moving it would free the holder's memory), stays where it is and
                is returned from there.
            hold: keep the key from being evicted or moved until :meth:`release`.
            keep_extent: the caller only reads the result: a key read up from nvme keeps
                its extent, and evicting it there again unchanged writes nothing (Note [clean
                reads] in tiermem/store/clean.py). False (default): the result may be written,
                and any kept extent of the key is freed.

        Raises:
            KeyError: unknown key.
            ValueError: ``tier="nvme"`` (data is read through ``"cpu"`` or ``"gpu"``).
            TierFullError: no room in ``tier`` even after evicting (the message says what
                blocked it).
            SpillCorruption, SpillError: the key's spill extent failed its checksum or read.
            StoreClosedError: the store is closed, or was made by the parent of this forked
                process.
        """
        self._check_tier(tier)
        if tier == "nvme":
            raise ValueError("get(tier='nvme'): data is returned from 'gpu' or 'cpu'; to move a "
                             "key to disk use evict(key, 'nvme')")
        t0 = time.perf_counter()
        self._check_open()  # Note [fork]: before the lock
        with self._lock:
            self._check_open()
            self._inflight.reap()
            entry = self._lookup(key)
            from_tier = entry.tier
            note_read(entry, keep_extent, self._spill)
            if _RANK[entry.tier] > _RANK[tier] and not entry.holds:  # a held key stays put
                self._inflight.settle(entry)
                old_tier = entry.tier
                self._placer.promote(entry, tier)
                self._policy.on_move(key, old_tier, entry.tier)
            move = entry.move
            if hold:
                entry.holds += 1
            self._policy.on_access(key, entry.tier)
            out = self._view(entry)
        consumer = self._copier.consumer_stream() if entry.tier == "gpu" else None
        if move is not None:
            try:
                move.future.wait_stream(consumer)
            except BaseException:
                with self._lock:
                    if hold:
                        entry.holds -= 1
                    # reverts or keeps the key; re-raises read failures
                    self._inflight.settle(entry)
                raise
        if consumer is not None and out.device.type == "cuda":
            # every time, also when the move was already reaped: the buffer was allocated on
            # the H2D stream, and without this its memory returns to that stream's pool while
            # the consumer's kernels may still read it (Note [reaped reload])
            out.record_stream(consumer)
        t1 = time.perf_counter()
        with self._lock:
            self._stall_s[from_tier] += t1 - t0
        if self._recorder is not None and (move is not None or from_tier != entry.tier):
            self._recorder.stall(key, from_tier, t0, t1)
        if self._prefetcher is not None:
            self._prefetcher.after_access(key)
        return out

    def prefetch(self, key: Hashable, tier: str = "gpu", *,
                 keep_extent: bool = False) -> TransferFuture:
        """Start moving ``key`` up into ``tier`` and return a future (``wait()``/``done()``).

        A key already in ``tier`` or higher, or held by a caller, is left alone (a done future
        is returned). A later
        :meth:`get` waits for the prefetch. The future's buffers belong to the store.
        ``keep_extent``: as in :meth:`get` (Note [clean reads]).

        Raises:
            KeyError: unknown key.
            ValueError: unknown tier or ``tier="nvme"``.
            TierFullError: no room in ``tier`` even after evicting (the message says what
                blocked it).
            StoreClosedError: the store is closed, or was made by the parent of this forked
                process.
        """
        self._check_tier(tier)
        if tier == "nvme":
            raise ValueError("prefetch(tier='nvme') is not a prefetch; use evict(key, 'nvme')")
        self._check_open()  # Note [fork]: before the lock
        with self._lock:
            self._check_open()
            self._inflight.reap()
            entry = self._lookup(key)
            note_read(entry, keep_extent, self._spill)
            if _RANK[entry.tier] > _RANK[tier] and not entry.holds:  # a held key stays put
                self._inflight.settle(entry)
                old_tier = entry.tier
                self._placer.promote(entry, tier)
                self._policy.on_move(key, old_tier, entry.tier)
            self._policy.on_access(key, entry.tier)
            future = entry.move.future if entry.move is not None else TransferFuture.completed()
        if self._prefetcher is not None:
            self._prefetcher.after_access(key)
        return future

    def try_prefetch(self, key: Hashable, tier: str = "gpu", *,
                     evictable: Callable[[Hashable], bool] | None = None,
                     keep_extent: bool = False) -> TransferFuture | None:
        """Start moving ``key`` up into ``tier`` only if that needs no unwanted eviction.

        A hint, unlike :meth:`prefetch`: it never waits for in-flight moves to make room, never
        raises for lack of room, and does not count as an access for the policy (it reports the
        move through ``Policy.on_move`` only). Room comes from free bytes of ``tier`` (and of
        the ``"cpu"`` tier for an nvme -> gpu move's staging block) and, when ``evictable`` is
        given, from evicting (in policy order, cascading down) resident keys for which
        ``evictable(key)`` is True; the key itself and keys held or in flight are never evicted.
        ``keep_extent``: as in :meth:`get` (Note [clean reads]), for a key it starts moving.

        Returns:
            the move's future (a done one when ``key`` is already in ``tier`` or higher, the
            in-flight move's future when it is moving); None when nothing was started: unknown
            or held key, or no room without evicting a key ``evictable`` rejects.

        Raises:
            ValueError: unknown tier or ``tier="nvme"``.
            StoreClosedError: the store is closed.
        """
        self._check_tier(tier)
        if tier == "nvme":
            raise ValueError("try_prefetch(tier='nvme') is not a prefetch; use evict(key, 'nvme')")
        self._check_open()  # Note [fork]: before the lock
        with self._lock:
            self._check_open()
            self._inflight.reap()
            entry = self._entries.get(key)
            if entry is None:
                return None
            if entry.move is not None:
                return entry.move.future
            if _RANK[entry.tier] <= _RANK[tier]:
                return TransferFuture.completed()
            if entry.holds:
                return None
            note_read(entry, keep_extent, self._spill)
            old_tier = entry.tier
            self._budgets.evict_only = evictable if evictable is not None else (lambda k: False)
            try:
                self._placer.promote(entry, tier)
            except TierFullError:
                return None
            finally:
                self._budgets.evict_only = None
            self._policy.on_move(key, old_tier, entry.tier)
            return entry.move.future if entry.move is not None else TransferFuture.completed()

    def evict(self, key: Hashable, tier: str = "cpu") -> TransferFuture:
        """Move ``key`` down into ``tier`` (lower than where it is) and return a future.

        Raises:
            KeyError: unknown key.
            ValueError: unknown tier, a tier not lower than the key's, a held key, or
                ``"nvme"`` without an NVMe budget.
            TierFullError: no room in ``tier`` even after evicting (the key stays where it is).
            StoreClosedError: the store is closed.
        """
        self._check_tier(tier)
        self._check_open()  # Note [fork]: before the lock
        with self._lock:
            self._check_open()
            self._inflight.reap()
            entry = self._lookup(key)
            if tier == "nvme" and self._spill is None:
                raise ValueError(f"evict({key!r}, 'nvme'): this store has no nvme tier "
                                 f"(StoreConfig.nvme_bytes=0); set nvme_bytes and nvme_dir, or "
                                 f"evict to 'cpu'")
            if _RANK[tier] <= _RANK[entry.tier]:
                raise ValueError(f"evict({key!r}, {tier!r}): the key is in {entry.tier!r}; evict "
                                 f"moves down only (gpu -> cpu -> nvme); use prefetch to move up")
            if entry.holds:
                raise ValueError(f"evict({key!r}): the key is held by a caller; release it first")
            self._inflight.settle(entry)
            old_tier = entry.tier
            while entry.tier != tier:
                self._placer.demote(entry, TIERS[_RANK[entry.tier] + 1])
                if entry.tier != tier:
                    self._inflight.settle(entry)  # the staging hop must land before the next hop
            self._policy.on_move(key, old_tier, entry.tier)
            return entry.move.future if entry.move is not None else TransferFuture.completed()

    def delete(self, key: Hashable) -> None:
        """Remove ``key`` and free its memory (waits for an in-flight move of it).

        Raises:
            KeyError: unknown key.
            ValueError: the key is held by a caller.
            StoreClosedError: the store is closed.
        """
        self._check_open()  # Note [fork]: before the lock
        with self._lock:
            self._check_open()
            entry = self._lookup(key)
            if entry.holds:
                raise ValueError(f"delete({key!r}): the key is held by a caller; release it first")
            self._drop(entry)
            del self._entries[key]
            self._inflight.reap()

    def release(self, key: Hashable) -> None:
        """Undo one ``get(key, hold=True)``.

        Raises:
            KeyError: unknown key.
            ValueError: the key is not held.
            StoreClosedError: the store is closed.
        """
        self._check_open()  # Note [fork]: before the lock
        with self._lock:
            self._check_open()
            entry = self._lookup(key)
            if entry.holds == 0:
                raise ValueError(f"release({key!r}): the key is not held")
            entry.holds -= 1

    @contextlib.contextmanager
    def hold(self, key: Hashable, tier: str = "gpu") -> Iterator[torch.Tensor]:
        """Context manager: ``get(key, tier, hold=True)`` and release on exit."""
        tensor = self.get(key, tier, hold=True)
        try:
            yield tensor
        finally:
            self.release(key)

    def mark_step(self) -> None:
        """Mark a training-step boundary.

        The trace policy ends its recorded step here (and starts following it), and a recorder
        marks the step on its timeline. Call it once per training step, e.g. after
        ``optimizer.step()``; other policies ignore it.

        Raises:
            StoreClosedError: the store was made by the parent of this forked process.
        """
        self._check_inherited()
        with self._lock:
            self._policy.mark_step()
            if self._recorder is not None:
                self._recorder.mark_step()

    def tier_of(self, key: Hashable) -> str:
        """Return the tier ``key`` lives in (or is moving into).

        Raises:
            KeyError: unknown key.
            StoreClosedError: the store is closed.
        """
        self._check_open()  # Note [fork]: before the lock
        with self._lock:
            self._check_open()
            return self._lookup(key).tier

    def nbytes_of(self, key: Hashable) -> int:
        """Return the size of ``key``'s tensor in bytes.

        Raises:
            KeyError: unknown key.
            StoreClosedError: the store is closed.
        """
        self._check_open()  # Note [fork]: before the lock
        with self._lock:
            self._check_open()
            return self._lookup(key).nbytes

    def keys(self) -> list[Hashable]:
        """Return the stored keys.

        Raises:
            StoreClosedError: the store was made by the parent of this forked process.
        """
        self._check_inherited()
        with self._lock:
            return list(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def used_bytes(self, tier: str) -> int:
        """Return the bytes ``tier`` holds now, in-flight copies included (0 once closed).

        Raises:
            ValueError: unknown tier.
        """
        self._check_tier(tier)
        if self._closed or self._inherited:
            return 0
        if tier == "gpu":
            return self._budgets.gpu_used
        if tier == "cpu":
            return self._pool.used_bytes
        return self._spill.used_bytes if self._spill else 0

    def stats(self) -> dict:
        """Return per-tier usage and traffic.

        ``{tier: {"budget_bytes", "used_bytes", "peak_bytes", "stall_s"}, "moved_bytes":
        {"cpu->gpu": n, "gpu->cpu": n, "cpu->nvme": n, "nvme->cpu": n, ...},
        "pinned_bytes": n, "kept_bytes": n}``; ``stall_s`` is the time :meth:`get` blocked for
        keys that were in that tier; ``kept_bytes`` the bytes evicted to nvme into a kept
        extent, without a write (Note [clean reads]; not in ``moved_bytes``).

        Raises:
            StoreClosedError: the store was made by the parent of this forked process.
        """
        self._check_inherited()
        with self._lock:
            self._inflight.reap()
            out: dict = {t: {"budget_bytes": self._budgets.budget[t],
                             "used_bytes": self.used_bytes(t),
                             "peak_bytes": self._budgets.peak[t], "stall_s": self._stall_s[t]}
                         for t in TIERS}
            out["moved_bytes"] = dict(self._inflight.moved)
            out["pinned_bytes"] = self._pool.reserved_bytes if self._pool.pin else 0
            out["kept_bytes"] = self._inflight.kept_bytes
            return out

    def synchronize(self) -> None:
        """Wait for every in-flight move and apply its completion (nothing to do once closed).

        Raises:
            StoreClosedError: the store was made by the parent of this forked process.
        """
        self._check_inherited()
        with self._lock:
            if self._closed:
                return
            self._check_open()
            for move in list(self._inflight.moves):
                self._inflight.finish(move, wait=True)

    def close(self) -> None:
        """Wait for in-flight moves, free every tier and remove the spill files. Idempotent.

        In a child forked from the process that made the store it only forgets the child's
        copy (Note [fork]): no lock is taken, nothing is waited for and the parent's spill files
        stay.
        """
        if self._inherited or os.getpid() != self._pid:
            self._closed = True
            self._entries, self._inflight.moves = {}, []  # the parent's: forgotten, not freed
            if self._spill is not None:
                self._spill.close()  # inherited too: closes the child's descriptors only
            return
        with self._lock:
            if self._closed:
                return
            for move in list(self._inflight.moves):
                try:
                    self._inflight.finish(move, wait=True)
                except Exception:  # closing: failed moves have nothing left to keep
                    pass
            self._entries.clear()
            self._budgets.gpu_used = 0
            self._pool.close()
            if self._spill is not None:
                self._spill.close()
            self._closed = True

    def __enter__(self) -> "TierStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def aget(self, key: Hashable, tier: str = "gpu", *, hold: bool = False
                   ) -> torch.Tensor:
        """Asyncio twin of :meth:`get`: waits in a worker thread, never blocking the loop.

        Note [async results]: between the worker thread's ``get`` and the awaiting task's next
        line, other tasks and threads run and may move the key, so a view of the store's
        memory would be stale by the time the task reads it. ``aget`` therefore returns a copy
        of the key's tensor, made in the worker while the key is held, or, with ``hold=True``,
        the held view itself (undo with :meth:`release`, as for ``get(..., hold=True)``).

        Raises:
            the errors of :meth:`get`.
        """
        if hold:
            return await asyncio.to_thread(self.get, key, tier, hold=True)
        return await asyncio.to_thread(self._get_copy, key, tier)

    def _get_copy(self, key: Hashable, tier: str) -> torch.Tensor:
        """A private copy of ``key``'s tensor, taken while the key is held (Note [async
        results]); a device copy runs on the calling thread's stream, after the key's load."""
        with self.hold(key, tier) as view:
            return view.clone()

    async def aput(self, key: Hashable, tensor: torch.Tensor, tier: str | None = None) -> None:
        """Asyncio twin of :meth:`put`."""
        await asyncio.to_thread(self.put, key, tensor, tier)

    def _sample(self) -> None:
        """Report every tier's used bytes to the recorder (call only with one)."""
        self._recorder.memory({t: self.used_bytes(t) for t in TIERS})

    def _drop(self, entry: _Entry) -> None:
        try:
            self._inflight.settle(entry)
        except Exception:  # dropping: a failed move has nothing left to keep
            pass
        if entry.tier == "gpu" and entry.device_buf is not None:
            self._budgets.release_gpu(entry.nbytes)
        elif entry.tier == "cpu" and entry.block is not None:
            self._pool.free(entry.block)
        elif entry.tier == "nvme" and entry.extent is not None:
            self._spill.free(entry.extent)
        if entry.kept is not None:  # Note [clean reads]: the old value's NVMe copy
            self._spill.free(entry.kept)
        entry.device_buf = entry.block = entry.extent = entry.kept = None
        self._policy.on_move(entry.key, entry.tier, None)
        if self._recorder is not None:
            self._sample()

    # ------------------------------------------------------------------ helpers

    def _view(self, entry: _Entry) -> torch.Tensor:
        if entry.nbytes == 0:
            device = self.device if entry.tier == "gpu" else torch.device("cpu")
            return torch.empty(entry.shape, dtype=entry.dtype, device=device)
        buf = entry.device_buf if entry.tier == "gpu" else entry.block.tensor[:entry.nbytes]
        return buf.view(entry.dtype).view(entry.shape)

    def _lookup(self, key: Hashable) -> _Entry:
        try:
            return self._entries[key]
        except KeyError:
            raise KeyError(f"key {key!r} is not in this TierStore") from None

    def _check_open(self) -> None:
        self._check_inherited()
        if self._closed:
            raise StoreClosedError("this TierStore is closed; create a new one")

    def _check_inherited(self) -> None:
        """Raise in a forked child (Note [fork]); takes no lock."""
        if self._inherited or os.getpid() != self._pid:
            raise StoreClosedError(
                f"this TierStore was made by process {self._pid}; this is a child forked from "
                f"it (pid {os.getpid()}), which shares none of its I/O threads or device "
                f"memory: create a new TierStore in the child (or start it with the 'spawn' "
                f"method)")

    @staticmethod
    def _check_tier(tier: str | None, allow_none: bool = False) -> None:
        if tier is None and allow_none:
            return
        if tier not in TIERS:
            raise ValueError(f"tier={tier!r} is unknown; use one of {', '.join(map(repr, TIERS))}")

    def _usage_hint(self) -> str:
        used = ", ".join(f"{t} {self.used_bytes(t)}/{self._budgets.budget[t]}" for t in TIERS)
        return f" (used/budget bytes: {used}; raise a budget in StoreConfig or delete keys)"
