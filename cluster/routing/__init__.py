"""Routing: a request's committed tokens and the draft/verify loop over pinned replicas.

`router` (a request's path: pin, open, run, close), `rounds` (its loop), `generation` (one
request's state) and `drafter_link` (its drafter), `request` (request, chunk and stats types),
`text` (tokens to streamed text, stop sequences), `draft_length` (the adaptive plan's
estimates, pure arithmetic), `goodput` (the plan's model: a plan's tokens per second, the best
plan), `draft_length_config` (its config and a request's draft bounds, plain data), `ports`
(the drafter and verifier interfaces), `grpc_drafter` and `grpc_verifier` (those ports over
gRPC, on `grpc_replica`), `registry` (where the replicas are), `directory` (pinning requests to
replicas).
"""
