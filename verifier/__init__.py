"""The verifier side: the target checks a draft block in one forward pass.

- Core: `rejection` (the lossless acceptance rule, pure tensors), `batch_rejection`,
  `batch_layout` and `batch_inputs` (the same rule over a step's blocks at once) and
  `verifier.Verifier` (a plain class), with `running_sessions` (its sessions that advance on
  their own).
- Shell: `servicer` (the gRPC adapter) and `deployment` (the Serve body).
- Config: `config` (`VerifierConfig`, the reference dtypes): plain data, no torch, no component.

It stands on `cluster.runtime` (the model runtime both sides share) and `cluster.replica` (the
replica host both sides share); it never imports `drafter` or the router side of `cluster`.
"""
