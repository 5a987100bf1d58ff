"""The replicas' internal wire: what the router's clients and the replica servers both import.

`convert` (protos <-> plain types, the one place that knows the layout), `requests` (the
calls' messages both ends build and read, and the frame layout's version), `status` (gRPC status
codes <-> `TandemError`s, both directions), `metadata` (the metadata keys and message-size
limits of an internal call), `replica_info` (`ReplicaInfo`, the heartbeat a replica sends the
registry). Imports the runtime and `protos`, never the replica host or the router side, so
neither side reaches into the other for them.
"""
