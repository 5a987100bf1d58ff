"""Replica wire messages built by hand, for tests that send what a broken peer would."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from protos import replica_pb2


def raw_sparse(
    token_ids: Sequence[int] = (), probs: Sequence[float] = ()
) -> replica_pb2.SparseDistribution:
    """A sparse row as it travels (little-endian int32 ids, float32 probabilities), built
    without any check, so tests can send what a broken drafter would."""
    return replica_pb2.SparseDistribution(
        token_ids=np.asarray(token_ids, dtype="<i4").tobytes(),
        probs=np.asarray(probs, dtype="<f4").tobytes(),
    )
