"""Everything that is not one side's own component: the runtime and replica host both sides
stand on, and the router side.

Subpackages, imported in this order only (upward imports are refused by `make lint`):
`runtime` (the model runtime shared by drafter and verifier replicas: engine, paged KV, models,
sampling; plain Python and torch) -> `replica` (hosting a replica of either side: gRPC server,
wire, heartbeats) -> `routing` (the draft/verify loop over pinned replicas) -> `api` (the public
API as a plain class, tenants, clients) -> `serve` (Ray Serve deployments, ingress, autoscaling,
the local cluster) -> `tools` (bench, loadtest, profile...) -> `cli` (`tandem`). At the top:
`config` (the one `TandemConfig`; `config_parsing` reads one from plain data),
`autoscaling_config` (how Serve scales each side), `presets` (named model pairs), `metrics`
(names and recording), `local` (the plain components wired in one process). `drafter` and
`verifier` import `runtime` and `replica` only, never the router side.
"""
