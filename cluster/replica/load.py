"""What a replica's load is measured with, beyond the component's own stats.

Contract: `kv_cache_bytes_per_token` is pure arithmetic on a model's config (0 when the config
lacks a figure); `InFlightCalls` counts the calls inside a server's unary handlers, exactly and
cheaply, from any thread. The replica host turns these into a heartbeat's `kv_bytes` and
`queue_depth` (`cluster.replica.host`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import grpc
from transformers import PreTrainedModel


def kv_cache_bytes_per_token(model: PreTrainedModel) -> int:
    """KV cache bytes per cached token: layers x 2 (key and value) x KV heads x head size x
    element size, from the model's config; 0 if the config lacks one of them."""
    config = model.config
    layers = getattr(config, "num_hidden_layers", None)
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None)
    hidden = getattr(config, "hidden_size", None)
    if head_dim is None and hidden is not None and heads:
        head_dim = hidden // heads
    if not (layers and kv_heads and head_dim):
        return 0
    return int(layers) * 2 * int(kv_heads) * int(head_dim) * model.dtype.itemsize


class InFlightCalls(grpc.ServerInterceptor):
    """Counts the calls inside a server's unary handlers (running, or waiting for the
    component's lock): cheap, exact, and what tells a queue from a busy replica."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = 0

    @property
    def count(self) -> int:
        return self._count

    def _add(self, delta: int) -> None:
        with self._lock:
            self._count += delta

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Any:
        handler = continuation(handler_call_details)
        if handler is None or handler.unary_unary is None:
            return handler
        unary = handler.unary_unary

        def counted(request: Any, context: grpc.ServicerContext) -> Any:
            self._add(1)
            try:
                return unary(request, context)
            finally:
                self._add(-1)

        return grpc.unary_unary_rpc_method_handler(
            counted,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
