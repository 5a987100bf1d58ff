"""The replicas' internal wire: what the router's clients and the replica servers both import.

The conversions between `protos/replica.proto` messages and the runtime's plain types, each
kind of value in one place: `fields` (token ids, counts, session ids, time limits),
`sampling_settings` (sampling params, grammar, constraint), `distributions` (q rows, raw float32
arrays), `blocks` (draft blocks, pre-drafted branches, verdicts, step loads), `replica_stats`
(the Stats answer). Servicers and clients convert with these and nothing else: `*_to_wire`
builds a message from a plain value, `*_from_wire` reads one back, checking only what the wire
format can tell; everything else needs the replica's own state and is checked there. Each
failure is an `InvalidArgumentError` naming the field.

`requests` (the calls' messages both ends build and read, and the frame layout's version),
`status` (gRPC status codes <-> `TandemError`s, both directions), `metadata` (the metadata keys
and message-size limits of an internal call), `frame_budget` (splitting a frame's results
under the message limit), `replica_info` (`ReplicaInfo`, the heartbeat a replica sends the
registry). Imports the runtime and `protos`, never the replica host or the router side, so
neither side reaches into the other for them.
"""
