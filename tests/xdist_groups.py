"""xdist's `--dist loadgroup`, made to work with this pytest.

xdist sends the tests of one `xdist_group` to one worker by appending `@group` to their node
ids on the workers; pytest 9 computes a node id from its structured id, so that rename no longer
takes and every grouped test is scheduled on its own (the session's service was then started on
both workers). Here the workers write the node ids of each group to a file the controller named
(`GROUPS_FILE_ENV`, inherited by the workers it spawns), and `GroupScheduling`, the controller's
scheduler for `--dist loadgroup`, reads it once every worker has collected: a group is one unit
of work, every other test its own, in collection order (`--no-loadscope-reorder`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from xdist.scheduler import LoadScopeScheduling

GROUPS_FILE_ENV = "TANDEM_XDIST_GROUPS_FILE"


def name_groups_file(config: pytest.Config) -> None:
    """On the controller, before its workers start: where they are to write the groups."""
    if hasattr(config, "workerinput") or GROUPS_FILE_ENV in os.environ:
        return
    path = Path(f"/tmp/tandem-xdist-groups-{os.getpid()}.json")
    os.environ[GROUPS_FILE_ENV] = str(path)
    config.add_cleanup(lambda: path.unlink(missing_ok=True))


def write_groups(config: pytest.Config, groups: dict[str, str]) -> None:
    """On a worker: node id -> group of the collected tests that have one."""
    path = os.environ.get(GROUPS_FILE_ENV)
    if path is None or not hasattr(config, "workerinput"):
        return
    scratch = Path(f"{path}.{os.getpid()}")
    scratch.write_text(json.dumps(groups))
    scratch.replace(path)  # atomic: the workers collect the same tests and write the same map


class GroupScheduling(LoadScopeScheduling):
    """`--dist loadgroup` with the groups the workers wrote."""

    _groups: dict[str, str] | None = None

    def _split_scope(self, nodeid: str) -> str:
        if self._groups is None:
            path = Path(os.environ.get(GROUPS_FILE_ENV, "/nonexistent"))
            self._groups = json.loads(path.read_text()) if path.exists() else {}
        return self._groups.get(nodeid, nodeid)
