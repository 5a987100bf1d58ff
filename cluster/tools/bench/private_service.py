"""A `tandem serve` of its own for a bench: started in a private TANDEM_HOME, always stopped.

`private_service(preset, flags, progress)` runs `tandem serve --preset <preset> --detach` with
`flags` on free ports, in a home made for it under /tmp (short: Ray's sockets live there), and
yields the gRPC address, the API key it made for its local tenant, and the home. Whatever ends
the block (its end, an error, Ctrl-C, SIGTERM), everything the service runs is stopped and the
home removed (`cluster.tools.cleanup`). A start that fails is `InvalidArgumentError` with the end
of `tandem serve`'s stderr. `tandem bench --mode service` and the simulated bench use it.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from cluster.runtime.errors import InvalidArgumentError


@contextmanager
def private_service(
    preset: str, flags: list[str], progress: Callable[[str], None]
) -> Iterator[tuple[str, str, Path]]:
    """A `tandem serve` of `preset` in a private home; yields its address, the API key it
    made for its local tenant and the home. Whatever ends the block (its end, an error,
    Ctrl-C, SIGTERM), everything the service runs is stopped and the home removed
    (`cluster.tools.cleanup`)."""
    from cluster.serve import loopback
    from cluster.serve.ray_cluster import HOME_ENV
    from cluster.tools import cleanup

    with cleanup.signals_raise():
        home = Path(tempfile.mkdtemp(prefix="tandem-bench-", dir="/tmp"))  # short: Ray's sockets
        env = {**os.environ, HOME_ENV: str(home)}
        try:
            ports = loopback.free_door_ports()
            port = ports["--port"]
            progress(f"starting tandem serve --preset {preset} in {home} (takes a minute)")
            # Interrupted, `subprocess.run` kills `tandem serve`; what it started is stopped
            # below all the same.
            started = subprocess.run(
                [cleanup.tandem_command(), "serve", "--preset", preset,
                 *loopback.port_arguments(ports), "--detach", *flags],
                env=env, capture_output=True, text=True, check=False,
            )  # fmt: skip
            if started.returncode != 0:
                raise InvalidArgumentError(f"tandem serve failed:\n{started.stderr[-2000:]}")
            yield f"{loopback.LOOPBACK}:{port}", (home / "api_key").read_text(), home
        finally:
            with cleanup.signals_held():
                progress(f"stopping the service in {home}")
                cleanup.stop_private_service(home, env)
