"""Capacity planning for a Tandem service: which drafter kind and block length to use per
workload category, how many drafter replicas and streams a verifier needs and serves, and the
tokens/s and ITL to expect, with the host's CPU in the loop.

- `inputs`: what a plan is computed from (drafter kinds' costs, the host, acceptance);
- `model`: the math, pure functions with their formulas (`estimate`, `best_estimate`,
  `clients_per_verifier`, `closed_loop_rate`);
- `level`: a plan of one load across categories (`plan_level`);
- `check`: a plan beside a measured `tandem loadtest` result, each level priced as it ran;
- `calibrate`: the host term fitted to such a result (`tandem plan --calibrate`);
- `solve`: the shared solvers (a root by bisection, golden section, least squares);
- `defaults`: the shipped figures per preset, each with where it was measured.

`tandem plan` (`cluster.cli.plan`) is the command line; docs/planning.md the method and its
check against measured runs.
"""
