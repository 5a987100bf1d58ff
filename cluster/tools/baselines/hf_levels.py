"""The `hf_target_batched` baseline of a load test: which target the service runs, loaded once
here, and one run per concurrency level (`cluster.tools.baselines.hf_baseline` measures).

`service_target` finds what the service's verifier runs (`reported_model` asks the service
`tandem serve` started here for the model it serves): the model pair of its preset (the one
named, else the one the service reports), with the models section of the config it was started
with (`--serve-config`: target, dtype, device overrides). The baseline gets every core this
process may use (`machine_threads`): it stands for the single batched server one would run
instead of Tandem on the same machine, not for one Tandem replica (`--hf-threads` sets it to a
replica's share instead).
`HFLevels` loads that target and runs each level with one method: the one asked for, or (`auto`)
the faster of a short probe of both at the highest level, made before the first level's run
(at one stream there is no batching to tell them apart). Given the service's own target-alone
outputs, a level counts the prompts whose output here differs: the same weights and greedy
decoding give the same tokens (exactly in float32; in bfloat16 a near-tie may round apart).
"""

from __future__ import annotations

import dataclasses
import json
import os
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from cluster.runtime.errors import InvalidArgumentError
from cluster.runtime.model_spec import ModelSpec
from cluster.serve import loopback, ray_cluster
from cluster.tools.baselines.hf_baseline import METHODS, TargetBaseline, choose_method

AUTO = "auto"
MODELS_TIMEOUT_S = 5.0
MAX_PROBE_S = 10.0
"""How long each method is probed at most (`auto`); never longer than a level's duration."""


def service_target(
    preset: str | None, serve_config: str | None, reported: str | None
) -> tuple[ModelSpec, int]:
    """The target spec of the service's verifier and the baseline's torch threads (the
    machine's: `machine_threads`). `preset` is the pair it runs (given), `serve_config` the
    TandemConfig YAML it was started with, `reported` the model name it reports (None:
    unknown)."""
    from cluster.api.openai import served_model_name
    from cluster.config import TandemConfig
    from cluster.presets import PRESETS

    config = TandemConfig.from_yaml(serve_config) if serve_config else TandemConfig()
    models = config.models
    if preset is not None:
        models = dataclasses.replace(models, preset=preset)  # as `tandem serve --preset`
    elif reported in PRESETS and not models.target:
        models = dataclasses.replace(models, preset=reported)
    elif serve_config is None:
        found = f"it reports {reported!r}, not a preset" if reported else "it does not say"
        raise InvalidArgumentError(
            f"--hf-baseline needs the models the service runs ({found}): give --preset, or "
            "--serve-config with the config it was started with"
        )
    if reported is not None and reported != served_model_name(models):
        raise InvalidArgumentError(
            f"the service serves {reported!r}, not {served_model_name(models)!r}: "
            "give the --preset or --serve-config it was started with"
        )
    return models.pair().target, machine_threads()


def machine_threads() -> int:
    """The cores this process may run on: what a single-process server would use."""
    return max(len(os.sched_getaffinity(0)), 1)


def reported_model(address: str) -> str | None:
    """The model the service at `address` (its proxy's or its routers' own gRPC port) reports
    (`GET /v1/models`), when `tandem serve` started it here (that records its HTTP port); None
    if it cannot be asked."""
    state = ray_cluster.load_state()
    host, _, port = address.rpartition(":")
    if state is None or state.http_port is None or not state.serves_grpc_on(port):
        return None
    if host not in (loopback.LOOPBACK, "localhost"):
        return None
    key = ray_cluster.api_key()
    request = urllib.request.Request(
        f"http://{loopback.LOOPBACK}:{state.http_port}/v1/models",
        headers={"Authorization": f"Bearer {key}"} if key else {},
    )
    try:
        with urllib.request.urlopen(request, timeout=MODELS_TIMEOUT_S) as response:
            return str(json.loads(response.read())["data"][0]["id"])
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return None


class HFLevels:
    """The loaded target and the method every level runs with."""

    def __init__(
        self,
        spec: ModelSpec,
        threads: int,
        method: str,
        texts: Sequence[str],
        levels: Sequence[int],
        duration_s: float,
        max_tokens: int,
        progress: Callable[[str], None],
    ) -> None:
        if method != AUTO and method not in METHODS:
            raise InvalidArgumentError(f"--hf-method must be auto or one of {', '.join(METHODS)}")
        progress(
            f"loading the hf baseline's target {spec.source} ({spec.dtype}, {threads} threads)"
        )
        self.baseline = TargetBaseline.load(spec, threads)
        self.texts = list(texts)
        self.prompts = self.baseline.encode(texts)
        self.spec = spec
        self.method = method
        self.why = "chosen with --hf-method" if method != AUTO else ""
        self.probes: dict[str, float] | None = None
        self.levels = list(levels)
        self.duration_s = duration_s
        self.max_tokens = max_tokens
        self.progress = progress

    def level(
        self, concurrency: int, reference: Mapping[str, Sequence[int]] | None = None
    ) -> dict[str, Any]:
        """One level's run (the first `auto` call probes both methods first). With
        `reference` (the service's target-alone output per prompt text), `differs_from_service`
        counts the prompts whose output here was not the same."""
        if self.method == AUTO:
            probe_s = min(MAX_PROBE_S, self.duration_s)
            choice = choose_method(self.baseline, self.prompts, max(self.levels), probe_s,
                                   self.max_tokens, self.progress)  # fmt: skip
            self.method, self.why = choice["method"], choice["why"]
            self.probes = choice["probe_tokens_per_s"]
        self.progress(
            f"concurrency {concurrency} hf_target_batched: {self.method} for {self.duration_s:g} s"
        )
        run = self.baseline.run(
            self.method, self.prompts, concurrency, self.duration_s, self.max_tokens
        )
        summary = run.summary()
        if reference is not None:
            summary["differs_from_service"] = sum(
                tuple(reference[text]) != run.outputs[ids]
                for text, ids in zip(self.texts, self.prompts, strict=True)
                if ids in run.outputs and text in reference
            )
        return summary

    def describe(self) -> dict[str, Any]:
        """The JSON's `hf_baseline`: the method, why, and what was loaded."""
        return {
            "method": self.method, "why": self.why, "probe_tokens_per_s": self.probes,
            "target": self.spec.source, "dtype": self.spec.dtype,
            "threads": self.baseline.threads,
        }  # fmt: skip

    def close(self) -> None:
        self.baseline.close()
