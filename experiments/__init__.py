"""Studies: measurements that informed the design, run with `python -m experiments.<name>` from a
checkout. Not part of the installed package (`pyproject.toml` packages only `cluster`,
`drafter`, `verifier` and `protos`), and the product never imports them (an import contract).
What each measured and where its result is: `experiments/README.md`.
"""
