"""Telemetry: per-tier memory timeline, transfers and stalls, as Chrome trace JSON and PNG."""

from tiermem.telemetry.recorder import Recorder, Stall, Transfer

__all__ = ["Recorder", "Transfer", "Stall"]
