"""Weight streaming: the weights of chosen blocks live in a TierStore (pinned RAM or NVMe) and
reach the compute device only while their block runs, in execution order, prefetched ahead;
their gradients leave the device as they are produced (docs/streaming.md)."""

from tiermem.stream.residency import ResidencyPlan, plan_residency
from tiermem.stream.weights import WeightStream, stream_weights

__all__ = ["stream_weights", "WeightStream", "plan_residency", "ResidencyPlan"]
