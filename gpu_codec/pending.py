"""A compressed update whose bytes may still be in flight on the GPU: what ``compress(..., blocking=False)``
returns.

A compress on the GPU waits on the host twice over: for the small words it reads back while selecting (the
first of these waits for everything the caller queued on its stream before the call, an optimizer step say),
and, at its end, for the whole stream, so that the payload's device buffers are complete. With
``blocking=False`` the second wait is skipped: the call returns once its last kernel is queued, with an event
recorded after it on the caller's stream. :meth:`PendingPayload.ready` asks whether the event has passed,
:meth:`~PendingPayload.wait` blocks until it has and returns the :class:`~gpu_codec.Payload`, and
:meth:`~PendingPayload.to_bytes` waits, then serializes. Work queued later on the caller's stream runs after
the call's (same stream); error-feedback residuals carry their own event. On the CPU there is nothing in flight:
the payload is ready at once.

>>> import numpy as np, gpu_codec
>>> pending = gpu_codec.compress({"w": np.arange(8, dtype=np.float32)}, fraction=0.25, blocking=False)
>>> pending.ready(), pending.to_bytes() == gpu_codec.compress({"w": np.arange(8, dtype=np.float32)},
...                                                           fraction=0.25).to_bytes()
(True, True)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .backends import events

__all__ = ["PendingPayload"]


class PendingPayload:
    """A :class:`~gpu_codec.Payload` and the events after which its device buffers are complete."""

    def __init__(self, payload: Any, ready_events: list[Any]):
        self._payload = payload
        self._events = [e for e in ready_events if e is not None]

    @classmethod
    def run(cls, make: Callable[[], Any]) -> PendingPayload:
        """``make()`` (a blocking compress) with its end-of-call wait turned into an event."""
        with events.deferred() as recorded:
            payload = make()
        return cls(payload, recorded)

    def ready(self) -> bool:
        """Whether the bytes are complete (never blocks)."""
        return all(bool(e.done) for e in self._events)

    def wait(self) -> Any:
        """Block until the bytes are complete; the :class:`~gpu_codec.Payload`."""
        for e in self._events:
            e.synchronize()
        self._events = []
        return self._payload

    def to_bytes(self, version: int | None = None) -> bytes:
        """:meth:`wait`, then :meth:`gpu_codec.Payload.to_bytes`."""
        return self.wait().to_bytes(version)

    def __repr__(self) -> str:
        return f"PendingPayload({'ready' if self.ready() else 'in flight'}, {len(self._payload.tensors)} tensors)"
