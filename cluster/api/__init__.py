"""The public API: `tandem.v1.Tandem` as a plain class, its tenants, queue and clients, and
OpenAI's completions and chat mapped onto it.

`service` (requests in, chunks out), `caller` (who sent a call, and its deadline), `audit` and
`online_audit` (served requests replayed through the target alone), `request_reader` (a request
validated and turned into the router's), `service_config` (the API's defaults and limits),
`convert` (router results <-> public messages), `tenants` (keys, limits, usage), `admission`
(the bounded fair queue), `running` (which tenant owns which request), `status` (errors to gRPC
status codes), `client` and `client_types` (the Python clients and what they return), `chat`
(chat templates), `openai_schema` (with `openai_fields`, `openai_messages` and `openai_errors`)
and `openai` (OpenAI request bodies validated, answered through `service`, and errors in
OpenAI's shape). No HTTP server and no Ray here:
`cluster.serve` adapts them.
"""
