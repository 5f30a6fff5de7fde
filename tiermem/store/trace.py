"""The access trace of one training step, and next-use (Belady / MIN) eviction keyed to it.

A training step touches the same tensors in the same order every time. :class:`TracePolicy`
records the accesses of the first step (the step ends at ``TierStore.mark_step()``), and in
later steps, while the accesses follow that recording, evicts the resident key whose next use is
furthest in the future (Belady's MIN, optimal for equal-sized keys). When a step diverges from
the recording (another key than the one expected, or more accesses than recorded) it falls back
to LRU until the next step boundary, where it starts following again; after ``retrace_after``
diverging steps in a row the last of them becomes the new recording. A recording that no step
has followed yet is replaced by the first step that diverges from it: the first step often
includes setup work (the optimizer's first puts), so the trace policy typically records step 1,
re-records step 2 and follows from step 3 on.

Keys that are regenerated each step (activation keys carry a counter) are matched through a
*key normaliser* ``key_fn`` (a :class:`KeyNormaliser`) that maps a key to a step-invariant id;
:class:`StepOrdinalKeys` is one for keys whose identity is "the n-th new key of its group in
this step".

Note [next use] (referred to from prefetch.py): the policy keeps ``position``, the index in the
recording of the next access it expects. The next use of a key is the first recorded access of
its id at or after ``position``; steps repeat, so past the end it wraps into the next step
(distance ``first index + len - position``). Ids absent from the recording are never used again
(distance infinity) and are evicted first, least recently used first. Inside an access the store
chooses victims before the policy sees the access, so ``position`` then still points at the
accessed key itself, which the store never picks as its own victim.

Note [deaths] (referred to from prefetch.py): the recording also keeps when each id's value
leaves the store (``delete``, or a ``put`` replacing it), as the number of accesses before it.
A key whose value leaves before its next use is dead: its next use is infinity (the cheapest
victim: one write-back, nothing to read again), and while a dead key of a tier leaves before a
prefetched access, a lookahead prefetch into that tier evicts nothing (the room frees by itself
then; an eviction now could only add moves). Activation keys are the typical case: deleted
right after their last backward use, while a new key takes their id in the next step.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tiermem.config import TIERS
from tiermem.store.policy import LRUPolicy, Policy

PHASES = ("forward", "backward", "step")
"""Phases of a training step an access can belong to."""

_RANK = {t: i for i, t in enumerate(TIERS)}
_MAX_STEP_ACCESSES = 1 << 22  # a "step" longer than this is not recorded (mark_step missing?)


@dataclass(frozen=True)
class Access:
    """One recorded access.

    Attributes:
        key: the step-invariant id of the key (``key_fn(key)``).
        nbytes: size of the key's tensor in bytes (0 when unknown).
        tier: the tier the key was in right after the access (where the step needs it).
        layer: the layer the access belongs to (None: unknown / not in a layer).
        phase: ``"forward"``, ``"backward"`` or ``"step"``.
        time_s: seconds since the start of the step (``time.perf_counter`` clock).
    """

    key: Hashable
    nbytes: int
    tier: str
    layer: int | None
    phase: str
    time_s: float


class AccessTrace:
    """The recorded accesses of one step, with next-use lookups.

    Args:
        accesses: :class:`Access` records in execution order.
        deaths: ``(key id, index)`` of each removal from the store (delete, or a put replacing
            the value), ``index`` being the number of accesses before it (see Note [deaths]).
    """

    def __init__(self, accesses: Iterable[Access],
                 deaths: Iterable[tuple[Hashable, int]] = ()) -> None:
        self.accesses: list[Access] = list(accesses)
        self._uses: dict[Hashable, list[int]] = {}
        for i, acc in enumerate(self.accesses):
            self._uses.setdefault(acc.key, []).append(i)
        self._deaths: dict[Hashable, list[int]] = {}
        for key_id, i in sorted(deaths, key=lambda d: d[1]):
            self._deaths.setdefault(key_id, []).append(i)

    @classmethod
    def from_keys(cls, keys: Iterable[Hashable], nbytes: int | Sequence[int] = 0,
                  tier: str = "gpu") -> "AccessTrace":
        """Build a trace from key ids alone (tests, traces saved elsewhere).

        Args:
            keys: step-invariant key ids in access order.
            nbytes: size of every key in bytes, or one size per access.
            tier: the tier every access needs.

        Raises:
            ValueError: ``tier`` unknown, or a size list of another length than ``keys``.
        """
        keys = list(keys)
        if tier not in TIERS:
            raise ValueError(f"AccessTrace.from_keys: tier={tier!r} is unknown; use one of {TIERS}")
        sizes = [nbytes] * len(keys) if isinstance(nbytes, int) else list(nbytes)
        if len(sizes) != len(keys):
            raise ValueError(f"AccessTrace.from_keys: {len(sizes)} sizes for {len(keys)} keys")
        return cls(Access(k, n, tier, None, "forward", 0.0) for k, n in zip(keys, sizes))

    def __len__(self) -> int:
        return len(self.accesses)

    def __getitem__(self, index: int) -> Access:
        return self.accesses[index]

    def __iter__(self) -> Iterator[Access]:
        return iter(self.accesses)

    def keys(self) -> list[Hashable]:
        """Return the key ids in access order."""
        return [a.key for a in self.accesses]

    def uses(self, key_id: Hashable) -> list[int]:
        """Return the indices of the accesses of ``key_id`` (ascending; empty if never)."""
        return list(self._uses.get(key_id, ()))

    def next_use(self, key_id: Hashable, position: int, cyclic: bool = True) -> float:
        """Return how many accesses after ``position`` the next use of ``key_id`` comes.

        0 means the access at ``position`` itself. See Note [next use]: with ``cyclic`` the
        step repeats after its end; ids never accessed give ``math.inf``.
        """
        return self._next(self._uses.get(key_id), position, cyclic)

    def next_death(self, key_id: Hashable, position: int, cyclic: bool = True) -> float:
        """Return how many accesses after ``position`` the value of ``key_id`` next leaves the
        store (0: before the access at ``position``; ``math.inf``: never recorded). See
        Note [deaths]; with ``cyclic`` the step repeats after its end."""
        return self._next(self._deaths.get(key_id), position, cyclic)

    def _next(self, indices: list[int] | None, position: int, cyclic: bool) -> float:
        if not indices:
            return math.inf
        i = bisect.bisect_left(indices, position)
        if i < len(indices):
            return indices[i] - position
        return indices[0] + len(self.accesses) - position if cyclic else math.inf

    def _raise_tier(self, index: int, tier: str) -> None:
        """Record that access ``index`` needed ``tier`` (kept if higher than recorded): the
        prefetch target is the highest tier an access has needed."""
        acc = self.accesses[index]
        if _RANK[tier] < _RANK[acc.tier]:
            self.accesses[index] = dataclasses.replace(acc, tier=tier)

    def bytes_by_phase(self) -> dict[str, int]:
        """Return the accessed bytes per phase (one count per access)."""
        out = dict.fromkeys(PHASES, 0)
        for a in self.accesses:
            out[a.phase] = out.get(a.phase, 0) + a.nbytes
        return out


class KeyNormaliser:
    """Maps a store key to a step-invariant id for :class:`TracePolicy`; this base maps every key
    to itself.

    The policy calls ``mark_step()`` at each step boundary and ``forget(key)`` when a key leaves
    the store; both do nothing here. A subclass that keeps per-step state (like
    :class:`StepOrdinalKeys`) overrides them; a plain function given as ``key_fn`` is wrapped in
    a :class:`FunctionKeys`, which is told nothing.
    """

    def __call__(self, key: Hashable) -> Hashable:
        """Return the step-invariant id of ``key`` (here: ``key`` itself).

        Raises:
            Nothing here; a subclass may raise on keys it cannot map.
        """
        return key

    def mark_step(self) -> None:
        """A step ended (the policy's ``mark_step``); nothing to do here.

        Raises:
            Nothing here.
        """

    def forget(self, key: Hashable) -> None:
        """``key`` left the store; nothing to do here.

        Raises:
            Nothing here.
        """


class FunctionKeys(KeyNormaliser):
    """A :class:`KeyNormaliser` that calls a plain function (no per-step state).

    Args:
        fn: maps a key to its step-invariant id.

    Raises:
        TypeError: ``fn`` is not callable.
    """

    def __init__(self, fn: Callable[[Hashable], Hashable]) -> None:
        if not callable(fn):
            raise TypeError(f"FunctionKeys: fn must be callable, got {type(fn).__name__}")
        self._fn = fn

    def __call__(self, key: Hashable) -> Hashable:
        """Return ``fn(key)``.

        Raises:
            Whatever ``fn`` raises.
        """
        return self._fn(key)


class StepOrdinalKeys(KeyNormaliser):
    """A key normaliser for keys made anew each step: the n-th new key of a group in a step.

    ``StepOrdinalKeys(group)`` maps a key for which ``group(key)`` returns a group id ``g`` to
    ``(g, n)``, where ``n`` counts the keys of group ``g`` first seen since the last step
    boundary; keys for which ``group`` returns None map to themselves. The mapping of a key is
    fixed when first seen and forgotten when the key leaves the store.

    ``StepOrdinalKeys.activations()`` handles the keys of
    :func:`tiermem.offload.offload_activations` (``("act", offloader_id, counter)``).

    Args:
        group: function from a key to its group id (None: a stable key).

    Raises:
        Nothing on construction; ``group``'s errors surface when a key is mapped.
    """

    def __init__(self, group: Callable[[Hashable], Hashable | None]) -> None:
        self._group = group
        self._ids: dict[Hashable, Hashable] = {}
        self._counts: dict[Hashable, int] = {}

    @classmethod
    def activations(cls) -> "StepOrdinalKeys":
        """Return a normaliser for activation-offload keys ``("act", uid, counter)``.

        Raises:
            Nothing.
        """
        return cls(lambda k: ("act", k[1]) if isinstance(k, tuple) and len(k) == 3
                   and k[0] == "act" else None)

    def __call__(self, key: Hashable) -> Hashable:
        """Return ``(group, n)`` for a key of a group, ``key`` itself otherwise.

        Raises:
            Whatever ``group`` raises.
        """
        kid = self._ids.get(key)
        if kid is not None:
            return kid
        g = self._group(key)
        if g is None:
            return key
        n = self._counts.get(g, 0)
        self._counts[g] = n + 1
        self._ids[key] = kid = (g, n)
        return kid

    def mark_step(self) -> None:
        """Start counting new keys from 0 again (the policy calls it at each step boundary).

        Raises:
            Nothing.
        """
        self._counts.clear()

    def forget(self, key: Hashable) -> None:
        """Drop the id of a key that left the store.

        Raises:
            Nothing.
        """
        self._ids.pop(key, None)


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class TracePolicy(Policy):
    """Next-use (Belady) eviction while a step follows the recorded one, LRU otherwise.

    Use it as ``StoreConfig(policy="trace")`` or pass an instance (``policy=TracePolicy(...)``)
    and call ``store.mark_step()`` once per training step. See the module docstring.

    Args:
        trace: a recording to follow from the start (e.g. made by another run); None records the
            first step.
        key_fn: maps a key to a step-invariant id (default: the key itself): a
            :class:`KeyNormaliser` (like :class:`StepOrdinalKeys`), told about step boundaries
            and removed keys, or a plain function (wrapped in a :class:`FunctionKeys`).
        retrace_after: diverging steps in a row after which the last one becomes the recording
            (>= 1).

    Raises:
        TypeError: ``trace`` is not an :class:`AccessTrace`; ``key_fn`` is not callable, or has
            ``mark_step``/``forget`` methods without being a :class:`KeyNormaliser` (they would
            never be called).
        ValueError: ``retrace_after`` < 1.
    """

    def __init__(self, trace: AccessTrace | None = None, *,
                 key_fn: KeyNormaliser | Callable[[Hashable], Hashable] | None = None,
                 retrace_after: int = 2) -> None:
        if trace is not None and not isinstance(trace, AccessTrace):
            raise TypeError(f"TracePolicy: trace must be an AccessTrace, got "
                            f"{type(trace).__name__}")
        if key_fn is not None and not callable(key_fn):
            raise TypeError(f"TracePolicy: key_fn must be callable, got "
                            f"{type(key_fn).__name__}")
        if not isinstance(key_fn, KeyNormaliser) \
                and any(hasattr(key_fn, m) for m in ("mark_step", "forget")):
            raise TypeError(f"TracePolicy: key_fn={type(key_fn).__name__} has mark_step/forget "
                            f"but is not a KeyNormaliser; subclass "
                            f"tiermem.store.trace.KeyNormaliser so the policy calls them")
        if isinstance(retrace_after, bool) or not isinstance(retrace_after, int) \
                or retrace_after < 1:
            raise ValueError(f"TracePolicy: retrace_after={retrace_after!r} must be an int >= 1")
        self.trace: AccessTrace | None = trace
        if key_fn is None:
            key_fn = KeyNormaliser()
        elif not isinstance(key_fn, KeyNormaliser):
            key_fn = FunctionKeys(key_fn)
        self.key_fn: KeyNormaliser = key_fn
        self.retrace_after = retrace_after
        self._lru = LRUPolicy()
        self._store: Any = None
        self._position = 0
        self._diverged = False
        self._diverged_run = 0
        self._unproven = False  # the recording is our own and no step has followed it yet
        self._step: list[Access] = []
        self._step_deaths: list[tuple[Hashable, int]] = []
        self._step_start_s = time.perf_counter()
        self._phase = "forward"
        self._layer: int | None = None
        self._latest: dict[Hashable, Hashable] = {}  # id -> the newest key with it
        self.counts = dict(steps=0, followed_steps=0, diverged_steps=0, retraces=0,
                           belady_victims=0, lru_victims=0)
        """Step and decision counts, for tests and benchmarks."""

    # ------------------------------------------------------------------ context

    def bind(self, store: Any) -> None:
        """Attach to the store that uses this policy (see :meth:`Policy.bind`; the sizes of the
        recorded accesses come from it).

        Raises:
            ValueError: already bound to another store.
        """
        if self._store is not None and self._store is not store:
            raise ValueError("TracePolicy: this policy already serves another TierStore; make one "
                             "TracePolicy per store")
        self._store = store

    def set_context(self, phase: str | None = None, layer: int | None = None) -> None:
        """Set the phase and layer recorded with the next accesses.

        Accesses made while autograd runs backward are recorded as ``"backward"`` whatever the
        phase set here.

        Raises:
            ValueError: unknown phase.
        """
        if phase is not None:
            if phase not in PHASES:
                raise ValueError(f"TracePolicy.set_context: phase={phase!r} is not one of {PHASES}")
            self._phase = phase
        self._layer = layer

    @property
    def following(self) -> bool:
        """True while the current step follows the recording (Belady decisions in effect)."""
        return self.trace is not None and not self._diverged

    @property
    def position(self) -> int:
        """Index in the recording of the next expected access (see Note [next use])."""
        return self._position

    # ------------------------------------------------------------------ Policy

    def on_access(self, key: Hashable, tier: str) -> None:
        kid = self.key_fn(key)
        self._latest[kid] = key
        if len(self._step) < _MAX_STEP_ACCESSES:
            nbytes = self._store.nbytes_of(key) if self._store is not None else 0
            phase = "backward" if _in_backward() else self._phase
            self._step.append(Access(kid, nbytes, tier, self._layer, phase,
                                     time.perf_counter() - self._step_start_s))
        if self.following:
            trace = self.trace
            if self._position < len(trace) and trace[self._position].key == kid:
                trace._raise_tier(self._position, tier)
                self._position += 1
            else:
                self._diverged = True  # LRU until the next step boundary
        self._lru.on_access(key, tier)

    def on_move(self, key: Hashable, old_tier: str | None, new_tier: str | None) -> None:
        self._lru.on_move(key, old_tier, new_tier)
        if new_tier is None:
            kid = self.key_fn(key)
            if len(self._step) < _MAX_STEP_ACCESSES:
                self._step_deaths.append((kid, len(self._step)))
            if self._latest.get(kid) == key:
                del self._latest[kid]
            self.key_fn.forget(key)
        elif old_tier is None:
            self._latest[self.key_fn(key)] = key

    def victims(self, tier: str) -> Iterator[Hashable]:
        candidates = list(self._lru.victims(tier))
        if not self.following:
            self.counts["lru_victims"] += 1
            return iter(candidates)
        self.counts["belady_victims"] += 1
        # furthest next use first; stable sort keeps LRU order among ties (never-used keys)
        return iter(sorted(candidates, key=lambda k: -self.next_use(k)))

    # ------------------------------------------------------------------ steps

    def mark_step(self) -> None:
        """End the current step: the first one becomes the recording; start following again."""
        step, self._step = self._step, []
        deaths, self._step_deaths = self._step_deaths, []
        self._step_start_s = time.perf_counter()
        self.key_fn.mark_step()
        if not step:
            return  # an empty step (mark_step twice) changes nothing
        self.counts["steps"] += 1
        if self.trace is None:
            self.trace = AccessTrace(step, deaths)
            self._unproven = True
        elif not self._diverged and self._position == len(self.trace):
            self.counts["followed_steps"] += 1
            self._diverged_run = 0
            self._unproven = False
        else:
            self.counts["diverged_steps"] += 1
            self._diverged_run += 1
            # a recording no step ever followed (e.g. the first step plus setup work) is
            # replaced at once; a proven one only after retrace_after divergences in a row
            if (self._unproven or self._diverged_run >= self.retrace_after) \
                    and len(step) < _MAX_STEP_ACCESSES:
                self.trace = AccessTrace(step, deaths)
                self.counts["retraces"] += 1
                self._diverged_run = 0
        self._position = 0
        self._diverged = False

    # ------------------------------------------------------------------ queries

    def next_use(self, key: Hashable) -> float:
        """Accesses until ``key`` is needed again (``math.inf``: never, or its value leaves the
        store first; see Note [next use] and Note [deaths]).

        Only meaningful while :attr:`following`; otherwise returns ``math.inf``.
        """
        if not self.following:
            return math.inf
        kid = self.key_fn(key)
        use = self.trace.next_use(kid, self._position)
        return math.inf if self.trace.next_death(kid, self._position) <= use else use

    def frees_room(self, tier: str, within: float) -> bool:
        """True if a dead key resident in ``tier`` leaves the store within ``within`` accesses
        (its value leaves before its next use, see Note [deaths]); False unless
        :attr:`following`."""
        if not self.following:
            return False
        for key in self._lru.victims(tier):
            kid = self.key_fn(key)
            death = self.trace.next_death(kid, self._position)
            if death <= within and death <= self.trace.next_use(kid, self._position):
                return True
        return False

    def upcoming(self, count: int) -> list[Access]:
        """Return up to ``count`` recorded accesses from the current position (empty unless
        :attr:`following`)."""
        if not self.following:
            return []
        return self.trace.accesses[self._position:self._position + count]

    def key_of(self, key_id: Hashable) -> Hashable | None:
        """Return the newest stored key with id ``key_id`` (None: none seen, or it was deleted)."""
        return self._latest.get(key_id)

    def current_step(self) -> AccessTrace:
        """Return the accesses recorded so far in the current step."""
        return AccessTrace(self._step)
