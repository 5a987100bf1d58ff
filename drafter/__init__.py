"""The drafter side: proposers that draft blocks of tokens for a session.

Component: `drafter.Drafter` (a small causal LM with a per-session KV cache). It builds on the
shared runtime in `verifier` (models, KV cache, sampling) and never imports `cluster`.
"""
