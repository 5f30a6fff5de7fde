"""The weight stream's copies: host -> device on one stream, gradients device -> host on
another, each ordered against the compute stream by events (CUDA); plain synchronous copies on a
machine without CUDA, where the "device" is the CPU and every copy has landed when it returns.

Every wait says why in a comment on its line. Memory for a block's weights is allocated on the
compute stream (the caching allocator's stream of the block's storage), so the copy stream first
waits for the compute work queued before the allocation: that memory may have belonged to a block
whose kernels are still queued.
"""

from __future__ import annotations

from typing import Callable

import torch


class StreamCopies:
    """Issues the weight stream's copies for ``device``.

    Args:
        device: the compute device (``cuda``/``cuda:N`` or ``cpu``).

    Raises:
        nothing: on a CUDA device the two streams are created here.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.h2d_stream = torch.cuda.Stream(device) if self.cuda else None
        self.d2h_stream = torch.cuda.Stream(device) if self.cuda else None
        self.sleep_cycles = 0  # tests: torch.cuda._sleep on the copy stream before each fill

    def fill(self, pairs: list[tuple[torch.Tensor, torch.Tensor]],
             then: Callable[[], None] | None = None) -> torch.cuda.Event | None:
        """Copy each host tensor into its (freshly allocated) device tensor, then run ``then()``
        (on the copy stream: its kernels are ordered after the copies and before the event);
        return the event that marks all of them landed (None on the CPU, where they have landed
        already).

        Raises:
            RuntimeError: torch's copy errors (a dtype or shape that does not match).
        """
        if not self.cuda:
            for dst, src in pairs:
                dst.copy_(src)
            if then is not None:
                then()
            return None
        allocated = torch.cuda.current_stream(self.device).record_event()
        self.h2d_stream.wait_event(allocated)  # dst memory may still be read by queued kernels
        with torch.cuda.stream(self.h2d_stream):
            if self.sleep_cycles:
                torch.cuda._sleep(self.sleep_cycles)
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            if then is not None:
                then()  # e.g. checksums of the copied weights: before the event, so compute
            return self.h2d_stream.record_event()  # that waits for it waits for them too

    def use(self, event: torch.cuda.Event | None) -> None:
        """Make the caller's stream wait for a fill before its kernels read the weights.

        Raises:
            nothing.
        """
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)  # read only landed weights

    def grad_out(self, dst: torch.Tensor, src: torch.Tensor) -> torch.cuda.Event | None:
        """Copy the device gradient ``src`` into the host tensor ``dst``; return its event
        (None on the CPU: done). ``src``'s memory is not reused before the copy read it.

        Raises:
            RuntimeError: torch's copy errors.
        """
        if not self.cuda:
            dst.copy_(src)
            return None
        produced = torch.cuda.current_stream(self.device).record_event()
        self.d2h_stream.wait_event(produced)  # the gradient is complete only at this event
        with torch.cuda.stream(self.d2h_stream):
            dst.copy_(src, non_blocking=True)
            event = self.d2h_stream.record_event()
        src.record_stream(self.d2h_stream)  # the allocator keeps src until the copy read it
        return event

    @staticmethod
    def finished(event: torch.cuda.Event | None) -> bool:
        """Whether a copy has landed, without waiting (always on the CPU).

        Raises:
            nothing.
        """
        return event is None or event.query()

    @staticmethod
    def landed(event: torch.cuda.Event | None) -> None:
        """Block the calling thread until a copy has landed (nothing to do on the CPU); the
        gradient adder thread waits here for each staged gradient (Note [gradient adder]),
        with the GIL released by torch while it waits.

        Raises:
            nothing.
        """
        if event is not None:
            event.synchronize()  # the host reads (or frees) the copy's bytes next
