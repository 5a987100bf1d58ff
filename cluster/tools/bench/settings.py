"""What Tandem runs with in `tandem bench`: the settings, the model pair, and how they reach
the router or the service.

`bench_settings(args)` takes each flag given, else what `tandem serve` would use (its config
file's, else the defaults, else the preset's draft): prompt lookup, the adaptive plan, the
suffix drafter (in process only), the draft's quantization and vocabulary, and with `--mode
service` each side's threads and CPUs. `plain_draft` is the pair as Hugging Face's assisted
generation drafts with it (unquantized, untrimmed), `with_draft` the pair with Tandem's draft;
`router_settings` are `build_local`'s arguments for the router features, and `serve_flags` the
`tandem serve` flags that state every setting (so that the JSON's record is what ran). Plain
data; the config, presets and router configs are imported inside.
"""

from __future__ import annotations

import dataclasses
from typing import Any


def bench_settings(args: Any) -> dict[str, Any]:
    """What Tandem runs with: each flag given, else what `tandem serve` would use (its config
    file's, else the defaults, else the preset's draft), so that the bench measures what users
    get."""
    from cluster.config import TandemConfig
    from cluster.replica.placement import fitted_threads

    config = TandemConfig.from_yaml(args.serve_config) if args.serve_config else TandemConfig()
    config = dataclasses.replace(
        config, models=dataclasses.replace(config.models, preset=args.preset)
    )
    draft = config.pair().draft

    def given(flag: Any, default: Any) -> Any:
        return default if flag is None else flag

    settings: dict[str, Any] = {
        "prompt_lookup": given(args.prompt_lookup, config.prompt_lookup.enabled),
        "adaptive_draft": given(args.adaptive_draft, config.draft_length.enabled),
        # The service's tenants cannot be told apart per repeat, so a repeat there would draft
        # from the same prompt's answer the repeat before: the suffix drafter runs in process.
        "suffix_drafter": args.mode == "local"
        and given(getattr(args, "suffix_drafter", None), config.suffix_drafter.enabled),
        "draft_quantization": given(args.draft_quantization, draft.quantization),
        "draft_vocab": given(args.draft_vocab, draft.trimmed_vocab),
    }
    if args.mode == "service":
        for side in ("drafter", "verifier"):
            group = getattr(config, side)
            settings[f"{side}_threads"] = group.torch_threads or fitted_threads()
            settings[f"{side}_cpus"] = list(group.cpus)
    return settings


def plain_draft(pair: Any) -> Any:
    """`pair` with its draft unquantized and untrimmed: what HF assisted drafts with."""
    from cluster.presets import ModelPair

    draft = dataclasses.replace(pair.draft, quantization="none", trimmed_vocab=0)
    return ModelPair(pair.target, draft)


def with_draft(pair: Any, settings: dict[str, Any]) -> Any:
    """`pair` with the draft Tandem runs with."""
    from cluster.presets import ModelPair

    draft = dataclasses.replace(
        pair.draft,
        quantization=settings["draft_quantization"],
        trimmed_vocab=settings["draft_vocab"],
    )
    return ModelPair(pair.target, draft)


def router_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """`build_local` arguments for the router features Tandem runs with."""
    from cluster.routing.draft_length_config import DraftLengthConfig
    from drafter.config import NgramConfig, SuffixConfig

    return {
        "prompt_lookup": NgramConfig(enabled=settings["prompt_lookup"]),
        "draft_length": DraftLengthConfig(enabled=settings["adaptive_draft"]),
        "suffix": SuffixConfig(enabled=settings.get("suffix_drafter", False)),
    }


def serve_flags(args: Any, settings: dict[str, Any]) -> list[str]:
    """`tandem serve` flags: every setting stated (so that the JSON's record is what ran), and
    the service's config file."""
    flags = {
        "prompt-lookup": settings["prompt_lookup"],
        "adaptive-draft": settings["adaptive_draft"],
        "suffix-drafter": settings["suffix_drafter"],
    }
    stated = [f"--{name}" if on else f"--no-{name}" for name, on in flags.items()]
    stated += ["--draft-quantization", settings["draft_quantization"]]
    stated += ["--draft-vocab", str(settings["draft_vocab"])]
    config = ["--config", args.serve_config] if args.serve_config else []
    return stated + config
