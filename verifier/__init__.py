"""The verifier side, and the lower layer that both sides stand on.

Pure core (tensors in, tensors out): `sampling` (logits to the distribution actually used),
`rejection` (the lossless acceptance rule). Shared model runtime, used by the drafter too so
that it lives once: `models` (loading), `tiny` (the test pair), `kv_cache` (per-sequence KV
cache), `session` (per-session state and checks), `block` (draft block and verdict), `errors`.
Component: `verifier.Verifier`. Nothing here imports `drafter` or `cluster`.
"""
