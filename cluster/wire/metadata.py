"""What rides beside a message on the replicas' internal gRPC API: metadata keys and size limits.

Both ends use these: the replica's server (`cluster.replica.rpc`) checks the secret, sends the
retry hint and applies the size limit; the router's clients (`cluster.routing.grpc_replica`)
send the secret, read the hint and open their channels with the same limit.
"""

from __future__ import annotations

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
"""Largest message a replica server or client sends or accepts. A block of `MAX_BLOCK_TOKENS`
(32) tokens, each with an untruncated q over a 150k vocabulary, is over 30 MiB; gRPC's default
limit is 4 MiB."""

MESSAGE_SIZE_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
)
"""Channel and server options that apply `MAX_MESSAGE_BYTES`."""

RETRY_AFTER_METADATA_KEY = "retry-after-ms"
"""Trailing metadata of a RESOURCE_EXHAUSTED that will pass: milliseconds to wait."""

SECRET_METADATA_KEY = "x-tandem-cluster-secret"
"""gRPC metadata key that carries the cluster's shared secret on internal calls."""
