"""Stand-ins for `AsyncTandemClient` in `tandem loadtest` tests, made from a blocking fake.

`tandem loadtest` asks the blocking client (`cluster.api.client.TandemClient`) for the
reference outputs and streams the load through the asyncio one (`AsyncTandemClient`); a test
patches both with one fake class: `as_async(Fake)` has Fake's constructor and gives Fake's
`stream` chunks from an async generator.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any


def as_async(fake: type) -> type:
    class AsyncFake:
        def __init__(self, address: str, **options: Any) -> None:
            self.blocking = fake(address, **options)

        async def stream(self, prompt: str, **settings: Any) -> AsyncIterator[Any]:
            for chunk in self.blocking.stream(prompt, **settings):
                yield chunk
                await asyncio.sleep(0)  # let the other streams run, as a real client does

        async def close(self) -> None:
            pass

    return AsyncFake
