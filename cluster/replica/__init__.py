"""Hosting a drafter or verifier replica: the gRPC server, heartbeats, the Serve body.

`rpc` (the call guard, the server), `host` (a replica's own server, registry heartbeats, load,
draining), `placement` (where it runs, its threads), `registration` (the registry it heartbeats
to), `load` (KV bytes, calls in flight), `servicer` (the session RPCs both sides serve),
`frames` (one Frames stream served), `stream_limits` (what one stream may hold),
`outgoing_frames` (its queue to the transport), `deployment` (the Serve body both sides share).
Imports the runtime and the wire (`cluster.wire`), never a side's component.
"""
