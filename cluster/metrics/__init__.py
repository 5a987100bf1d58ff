"""Tandem's metrics: their names and labels, what a request, a round or a heartbeat adds to them,
and how `tandem status` reads them back.

Glossary (the words of `cluster.routing.request.SpeculationStats`): a verify pass checks one drafted
block; of its drafted tokens the first `accepted` are kept, and the pass commits those plus one
token of the target's own. Acceptance at draft position i is accepted_by_position[i] over
drafted_by_position[i]; tokens per verify pass is generated tokens over verify passes.

Four modules:
- `catalog`: every fixed metric (`METRICS`: name, kind, labels, description), the one list the
  Grafana dashboard's queries must stay within (a test checks), plus one gauge per numeric field
  of the replicas' heartbeats (`replica_gauge`) and one per figure of a heartbeat's `engine`.
- `recorder`: `TandemMetrics`, which turns the events of the service, the router, its admission
  queue and the registry into increments of named metrics on a `Sink`; pure, so tests check it
  over a `MemorySink`.
- `sinks`: where the values go: `RaySink` (`ray.util.metrics`), `MemorySink` (tests), `NullSink`
  (no Ray here: `default_sink`).
- `scrape`: reading Prometheus' text format back (`parse_prometheus`, `tandem_exposition`) and
  what `tandem status` shows of it (`summarize`).

Importing the package imports none of them; none imports Ray or torch at import time.
"""
