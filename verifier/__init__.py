"""The verifier side, and the shared runtime that both sides stand on.

- `verifier.runtime`: the model runtime both the drafter and the verifier use, so that it lives
  once: errors, sampling transforms (logits to the distribution actually used), draft blocks and
  verdicts, model loading, the tiny test pair, model packs, the per-sequence KV cache and the
  per-session state. No Ray, no gRPC (an import contract in `make lint`).
- `verifier.replica`: hosting a replica of either side: the gRPC server and status codes
  (`rpc`), proto <-> plain types (`wire`), heartbeats and draining (`host`), the session RPCs
  (`servicer`) and the Serve body (`deployment`) both sides share.
- Core: `rejection` (the lossless acceptance rule, pure tensors) and `verifier.Verifier` (the
  target checks a block in one forward pass; a plain class).
- Shell: `servicer` (the gRPC adapter) and `deployment` (the Serve body).

Nothing here imports `drafter` or `cluster`.
"""
