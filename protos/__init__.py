"""Tandem's wire types: the only definition of what crosses a process boundary.

Three proto3 files, all in package `tandem.v1`:

- `sampling.proto`: `SamplingParams`, shared by both APIs.
- `generate.proto`: the public `Tandem` service (`Generate`, `GenerateStream`).
- `replica.proto`: the internal `Drafter` and `Verifier` services. Every draft block and verdict
  carries the committed length (`base_length`) it was based on, and a replica refuses work whose
  base does not match its session.

The `*_pb2.py`, `*_pb2_grpc.py` and `*_pb2.pyi` modules are generated and committed; never edit
them by hand. After changing a .proto, run `python -m protos.build`; `python -m protos.build
--check` fails if they are stale. Import them as `from protos import generate_pb2`.
"""
