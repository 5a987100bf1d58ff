"""The router side: routing, the public API, the Serve application, the CLI and the tools.

Subpackages, imported in this order only (upward imports are refused by `make lint`):
`routing` (the draft/verify loop over pinned replicas) -> `api` (the public API as a plain
class, tenants, clients) -> `serve` (Ray Serve deployments, ingress, autoscaling, the local
cluster) -> `tools` (bench, loadtest, profile...) -> `cli` (`tandem`). At the top: `config`
(the one `TandemConfig`; `config_parsing` reads one from plain data), `presets` (named model
pairs), `metrics` (names and recording), `local` (the plain components wired in one process).
"""
