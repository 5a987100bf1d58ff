"""Hosting a drafter or verifier replica: the gRPC server, the wire, heartbeats.

`rpc` (status codes, the call guard, the server), `wire` (protos <-> plain types, the one place
that knows the layout), `host` (a replica's own server, registry heartbeats, load, draining),
`servicer` (the session RPCs both sides serve), `deployment` (the Serve body both sides share).
Imports the runtime, never a side's component.
"""
