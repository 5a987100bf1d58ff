"""The drafter side: proposers that draft blocks of tokens for a session.

Core: `ngram` (prompt lookup, no model) and `drafter.Drafter` (a small causal LM with a
per-session KV cache; a plain class). Shell: `servicer` (gRPC) and `deployment` (Serve body).
Their configs (`DrafterConfig`, `NgramConfig`) are `config`: plain data, no torch, no component.
It builds on the shared runtime (`cluster.runtime`, `cluster.replica`), never on the
verifier, and never imports the router side of `cluster`.
"""
