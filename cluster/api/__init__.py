"""The public API: `tandem.v1.Tandem` as a plain class, its tenants, queue and clients.

`service` (requests in, chunks out), `tenants` (keys, limits, usage), `admission` (the bounded
fair queue), `running` (which tenant owns which request), `status` (errors to gRPC status codes),
`client` and `client_types` (the Python clients and what they return).
"""
