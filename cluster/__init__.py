"""The router side: requests, the draft/verify loop, presets, in-process wiring and the CLI.

`router.Router` owns each request's committed tokens and drives a drafter and a verifier through
the protocols in `ports`; `local` wires the plain components in one process; `cli` is `tandem`.
"""
