"""Ports whose calls are steps (`cluster.routing.waits`) over in-process components, so that a
test can leave a request at a wait of its choosing."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from cluster.routing.waits import Waits, answer, run
from tests.cluster.routing.fake_ports import Wrapper


class OpensOnSteps(Wrapper):
    """An in-process component as a port (`fake_ports.Wrapper`) whose sessions open only once
    `released` is set (an open in flight on a replica that answers on frames, or a prefill
    still running): the open's steps wait on a future that a thread of its own settles.
    With `error`, the open then fails with it instead. `opening`: the opens' futures."""

    def __init__(self, component: Any, error: Exception | None = None) -> None:
        super().__init__(component)
        self.released = threading.Event()
        self._error = error
        self._pool = ThreadPoolExecutor(1)
        self.opening: list[Future[int]] = []

    def open_session(self, *args: Any, **kwargs: Any) -> Waits[int]:
        def open_once_released() -> int:
            assert self.released.wait(30), "never released"
            if self._error is not None:
                raise self._error
            return run(super(OpensOnSteps, self).open_session(*args, **kwargs))

        opening = self._pool.submit(open_once_released)
        self.opening.append(opening)
        return (yield from answer(opening))

    def settle(self) -> None:
        """Wait for every open begun to end."""
        self._pool.shutdown(wait=True)
