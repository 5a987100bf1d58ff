"""Ports whose calls are steps (`cluster.routing.waits`) over in-process components, so that a
test can leave a request at a wait of its choosing."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from cluster.routing.waits import Steps, answer


class OpensOnSteps:
    """The in-process verifier, its sessions opened as steps that wait until `released` (an
    open in flight on a replica that answers on frames)."""

    def __init__(self, verifier: Any) -> None:
        self._verifier = verifier
        self.released = threading.Event()
        self._pool = ThreadPoolExecutor(1)
        self.opening: list[Future[int]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._verifier, name)

    def open_session_steps(self, *args: Any, **kwargs: Any) -> Steps[int]:
        def open_once_released() -> int:
            self.released.wait(10)
            return self._verifier.open_session(*args, **kwargs)

        opening = self._pool.submit(open_once_released)
        self.opening.append(opening)
        return (yield from answer(opening))

    def settle(self) -> None:
        """Wait for every open begun to end."""
        self._pool.shutdown(wait=True)
