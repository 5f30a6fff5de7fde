"""The eviction policies ``StoreConfig.policy`` can name, and :func:`make_policy`.

Apart from :mod:`tiermem.store.policy` (the interface and LRU) because it makes the trace policy
too, which subclasses that interface: kept here, neither module imports the other in a circle.
"""

from __future__ import annotations

from tiermem.store.policy import LRUPolicy, Policy
from tiermem.store.trace import StepOrdinalKeys, TracePolicy


def make_policy(policy: str | Policy) -> Policy:
    """Return a policy object for a name (``"lru"``, ``"trace"``) or pass an instance through.

    Raises:
        ValueError: unknown policy name.
        TypeError: an object that is not a :class:`Policy`.
    """
    if isinstance(policy, Policy):
        return policy
    if policy == "lru":
        return LRUPolicy()
    if policy == "trace":
        # activation-offload keys are new each step: match them by their order in the step
        return TracePolicy(key_fn=StepOrdinalKeys.activations())
    if isinstance(policy, str):
        raise ValueError(f"StoreConfig.policy={policy!r} is unknown; use 'lru', 'trace' or a "
                         f"Policy")
    raise TypeError(f"StoreConfig.policy must be 'lru', 'trace' or a tiermem Policy, "
                    f"got {type(policy).__name__}")
