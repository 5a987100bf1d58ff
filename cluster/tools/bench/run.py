"""`tandem bench`: Tandem against Hugging Face on the same prompts, in one run.

Five configurations, interleaved per prompt and repeated (the order rotates each time):
`hf_target` (HF `generate`, target alone), `hf_assisted` (HF assisted generation with the same
draft), `tandem_target` (Tandem with draft length 0: the same path, no speculation),
`tandem_serial` and `tandem_pipelined`. All greedy, so every repeat does identical work; each
prompt's time is the median over repeats. `--mode local` runs Tandem in-process; `--mode
service` through a `tandem serve` it starts in a private TANDEM_HOME and stops afterwards, also
when the bench is interrupted (Ctrl-C) or terminated (SIGTERM); HF runs always in this process.
`greedy_match` compares Tandem's tokens with HF's target alone in float32 (loading float32
copies when the timed runs used another dtype).

Tandem runs with what `tandem serve` would use (`bench_settings`): prompt lookup, the adaptive
plan and the preset's draft (precision, trimmed vocabulary), each changed only by a flag, and
the result's `config.settings` records them. HF assisted drafts with the plain draft model in
the bench's dtype, as Hugging Face users run it. `--draft-forms` adds `draft_forms`: each draft
precision and vocabulary's ms/token and agreement with the target
(`cluster.tools.bench.draft_forms`),
measured after the timed runs, with nothing else running.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cluster.runtime.errors import InvalidArgumentError
from cluster.tools.bench.process_cpu import CpuCalls, cluster_scope
from cluster.tools.prompt_files import Prompt, load_prompts

RUNS = ("hf_target", "hf_assisted", "tandem_target", "tandem_serial", "tandem_pipelined")
TANDEM_RUNS = RUNS[2:]


@dataclass
class Sample:
    """One configuration on one prompt: its repeats' times and its tokens and counters."""

    seconds: list[float] = field(default_factory=list)
    tokens: tuple[int, ...] = ()
    stats: dict[str, Any] = field(default_factory=dict)


Runner = Callable[[tuple[int, ...]], tuple[tuple[int, ...], dict[str, Any]]]


def _hf_runner(model: Any, max_tokens: int, assistant: Any = None) -> Runner:
    import torch

    def run(ids: tuple[int, ...]) -> tuple[tuple[int, ...], dict[str, Any]]:
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([ids], device=model.device),
                max_new_tokens=max_tokens,
                do_sample=False,
                assistant_model=assistant,
            )
        return tuple(out[0, len(ids) :].tolist()), {}

    return run


def _stats(result: Any) -> dict[str, Any]:
    """Counters of a client `GenerateResult` or a router `SpeculationStats` (same names)."""
    return {
        "drafted": result.num_drafted,
        "accepted": result.num_accepted,
        "passes": result.num_verify_passes,
        "hits": result.pipeline_hits,
        "misses": result.pipeline_misses,
        "suffix_drafted": result.suffix_drafted,
        "suffix_accepted": result.suffix_accepted,
        "drafted_by_position": list(result.drafted_by_position),
        "accepted_by_position": list(result.accepted_by_position),
    }


def _local_runner(
    tandem: Any, max_tokens: int, draft_tokens: int, pipelined: bool, name: str = ""
) -> Runner:
    """A runner in process. Each of its passes over the prompts is a tenant of its own
    (`name` and the pass), so the suffix drafter drafts from the prompts and answers before
    it in the same pass (an agent's earlier turns), never from the same prompt's answer in an
    earlier repeat or another run."""
    from cluster.routing.request import GenerationRequest

    passes: Counter[tuple[int, ...]] = Counter()

    def run(ids: tuple[int, ...]) -> tuple[tuple[int, ...], dict[str, Any]]:
        tenant = f"{name}-{passes[ids]}"
        passes[ids] += 1
        request = GenerationRequest(ids, max_tokens, draft_tokens=draft_tokens, tenant=tenant)
        result = tandem.router.generate(request, pipelined=pipelined)
        return result.tokens, _stats(result.stats)

    return run


def _service_runner(client: Any, max_tokens: int, draft_tokens: int, pipelined: bool) -> Runner:
    def run(ids: tuple[int, ...]) -> tuple[tuple[int, ...], dict[str, Any]]:
        result = client.generate(
            list(ids), max_tokens=max_tokens, draft_tokens=draft_tokens, pipelined=pipelined
        )
        return result.tokens, _stats(result)

    return run


@contextmanager
def _service(
    preset: str, flags: list[str], progress: Callable[[str], None]
) -> Iterator[tuple[str, str, Path]]:
    """A `tandem serve` of `preset` in a private home; yields its address, the API key it
    made for its local tenant and the home. Whatever ends the block (its end, an error,
    Ctrl-C, SIGTERM), everything the service runs is stopped and the home removed
    (`cluster.tools.cleanup`)."""
    from cluster.serve.local_cluster import HOME_ENV, free_port
    from cluster.tools import cleanup

    with cleanup.signals_raise():
        home = Path(tempfile.mkdtemp(prefix="tandem-bench-", dir="/tmp"))  # short: Ray's sockets
        env = {**os.environ, HOME_ENV: str(home)}
        try:
            port = free_port()
            progress(f"starting tandem serve --preset {preset} in {home} (takes a minute)")
            # Interrupted, `subprocess.run` kills `tandem serve`; what it started is stopped
            # below all the same.
            started = subprocess.run(
                [cleanup.tandem_command(), "serve", "--preset", preset, "--port", str(port),
                 "--http-port", str(free_port()), "--detach", *flags],
                env=env, capture_output=True, text=True, check=False,
            )  # fmt: skip
            if started.returncode != 0:
                raise InvalidArgumentError(f"tandem serve failed:\n{started.stderr[-2000:]}")
            yield f"127.0.0.1:{port}", (home / "api_key").read_text(), home
        finally:
            with cleanup.signals_held():
                progress(f"stopping the service in {home}")
                cleanup.stop_private_service(home, env)


def _measure(
    runners: dict[str, Runner],
    prompt_ids: list[tuple[int, ...]],
    repeats: int,
    progress: Callable[[str], None],
    cpu: CpuCalls | None = None,
) -> dict[str, list[Sample]]:
    """Every runner on every prompt, `repeats` times, the order rotated; with `cpu`, the CPU
    of each call of the runners it names, read outside the timed region."""
    samples = {name: [Sample() for _ in prompt_ids] for name in runners}
    names = list(runners)
    total, done = repeats * len(prompt_ids) * len(names), 0
    for repeat in range(repeats):
        for index, ids in enumerate(prompt_ids):
            shift = (repeat + index) % len(names)
            for name in names[shift:] + names[:shift]:
                counted = cpu.open(name) if cpu is not None else None
                start = time.perf_counter()
                tokens, stats = runners[name](ids)
                seconds = time.perf_counter() - start
                if counted is not None:
                    counted(len(tokens), seconds)
                sample = samples[name][index]
                sample.seconds.append(seconds)
                sample.tokens, sample.stats = tokens, stats
                done += 1
                progress(
                    f"[{done}/{total}] repeat {repeat + 1} prompt {index + 1} {name}: "
                    f"{len(tokens)} tokens in {seconds:.2f} s"
                )
    return samples


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def summarize_run(samples: list[Sample], tandem: bool, pipelined: bool) -> dict[str, Any]:
    tokens = sum(len(s.tokens) for s in samples)
    seconds = sum(statistics.median(s.seconds) for s in samples)
    run: dict[str, Any] = {
        "tokens_per_s": tokens / seconds,
        "ms_per_token": 1000 * seconds / tokens,
        "num_tokens": tokens,
    }
    if tandem:
        run.update(speculation_summary(samples))
        if not pipelined:
            run.pop("pipeline_hit_rate")
    return run


def speculation_summary(samples: list[Sample]) -> dict[str, Any]:
    def total(key: str) -> int:
        return sum(int(s.stats[key]) for s in samples)

    width = max((len(s.stats["drafted_by_position"]) for s in samples), default=0)
    drafted = [sum(s.stats["drafted_by_position"][i] for s in samples
                   if i < len(s.stats["drafted_by_position"])) for i in range(width)]  # fmt: skip
    accepted = [sum(s.stats["accepted_by_position"][i] for s in samples
                    if i < len(s.stats["accepted_by_position"])) for i in range(width)]  # fmt: skip
    tokens = sum(len(s.tokens) for s in samples)
    return {
        "acceptance_rate": _ratio(total("accepted"), total("drafted")),
        "mean_tokens_per_verify": tokens / total("passes"),
        "acceptance_by_position": [a / d for a, d in zip(accepted, drafted, strict=True) if d],
        # Free drafting and a block verified at the cost of one target step would give
        # exactly this many tokens per target step.
        "ideal_speedup": tokens / total("passes"),
        "pipeline_hit_rate": _ratio(total("hits"), total("hits") + total("misses")),
        # The suffix drafter's share of the drafted tokens, and its own acceptance.
        "suffix_share": _ratio(total("suffix_drafted"), total("drafted")),
        "suffix_acceptance_rate": _ratio(total("suffix_accepted"), total("suffix_drafted")),
        "model_acceptance_rate": _ratio(
            total("accepted") - total("suffix_accepted"),
            total("drafted") - total("suffix_drafted"),
        ),
    }


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


def run_bench(args: Any, progress: Callable[[str], None]) -> dict[str, Any]:
    from cluster.local import build_local
    from cluster.presets import PRESETS, resolve_pair
    from cluster.runtime.models import load_model

    prompts = load_prompts(args.prompts)
    settings = bench_settings(args)
    dtype = args.dtype or PRESETS[args.preset].default_dtype if args.preset in PRESETS else None
    plain = _plain_draft(resolve_pair(args.preset, dtype=dtype))
    ours = _with_draft(plain, settings)
    progress(f"loading the {args.preset} pair ({dtype}); Tandem runs with {settings}")
    local = args.mode == "local"
    tandem = build_local(ours if local else plain, **_router_settings(settings))
    ids = [tuple(tandem.tokenizer.encode(p.text, add_special_tokens=False)) for p in prompts]
    target = tandem.target.model
    draft = tandem.draft.model if not local or ours == plain else load_model(plain.draft).model
    runners: dict[str, Runner] = {
        "hf_target": _hf_runner(target, args.max_tokens),
        "hf_assisted": _hf_runner(target, args.max_tokens, assistant=draft),
    }
    with _maybe_service(args, settings, progress) as (client, cpu):
        for name, k, pipelined in (("tandem_target", 0, False),
                                   ("tandem_serial", args.draft_tokens, False),
                                   ("tandem_pipelined", args.draft_tokens, True)):  # fmt: skip
            runners[name] = (
                _local_runner(tandem, args.max_tokens, k, pipelined, name)
                if client is None
                else _service_runner(client, args.max_tokens, k, pipelined)
            )
        samples = _measure(runners, ids, args.repeats, progress, cpu)
    runs = {
        name: summarize_run(samples[name], name in TANDEM_RUNS, name == "tandem_pipelined")
        for name in RUNS
    }
    if cpu is not None:
        for name, fields in cpu.fields().items():
            runs[name].update(fields)
    best = runs["tandem_pipelined"]["tokens_per_s"]
    result: dict[str, Any] = {
        "config": {
            "preset": args.preset, "mode": args.mode, "max_tokens": args.max_tokens,
            "draft_tokens": args.draft_tokens, "dtype": dtype, "repeats": args.repeats,
            "num_prompts": len(prompts), "prompts": args.prompts or "default",
            "prompt_lookup": settings["prompt_lookup"],
            "adaptive_draft": settings["adaptive_draft"],
            "serve_config": args.serve_config, "settings": settings,
        },
        "runs": runs,
        "speedup": {
            "vs_hf_target": best / runs["hf_target"]["tokens_per_s"],
            "vs_hf_assisted": best / runs["hf_assisted"]["tokens_per_s"],
            "vs_tandem_target": best / runs["tandem_target"]["tokens_per_s"],
            "pipelining": best / runs["tandem_serial"]["tokens_per_s"],
        },
        "by_category": _by_category(prompts, samples),
    }  # fmt: skip
    if cpu is not None:
        result["cpu_scope"] = cpu.scope.description
    if args.draft_forms:
        from cluster.tools.bench.draft_forms import Example, measure_forms

        examples = [
            Example(prompt, samples["hf_target"][i].tokens, prompts[i].category)
            for i, prompt in enumerate(ids)
        ]
        result["draft_forms"] = measure_forms(plain.draft, examples, progress)
    del target, draft
    result["greedy_match"] = _greedy_match(args, settings, tandem, ids, samples, progress)
    return result


def _plain_draft(pair: Any) -> Any:
    """`pair` with its draft unquantized and untrimmed: what HF assisted drafts with."""
    from cluster.presets import ModelPair

    draft = dataclasses.replace(pair.draft, quantization="none", trimmed_vocab=0)
    return ModelPair(pair.target, draft)


def _with_draft(pair: Any, settings: dict[str, Any]) -> Any:
    """`pair` with the draft Tandem runs with."""
    from cluster.presets import ModelPair

    draft = dataclasses.replace(
        pair.draft,
        quantization=settings["draft_quantization"],
        trimmed_vocab=settings["draft_vocab"],
    )
    return ModelPair(pair.target, draft)


def _router_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """`build_local` arguments for the router features Tandem runs with."""
    from cluster.routing.draft_length_config import DraftLengthConfig
    from drafter.config import NgramConfig, SuffixConfig

    return {
        "prompt_lookup": NgramConfig(enabled=settings["prompt_lookup"]),
        "draft_length": DraftLengthConfig(enabled=settings["adaptive_draft"]),
        "suffix": SuffixConfig(enabled=settings.get("suffix_drafter", False)),
    }


def _serve_flags(args: Any, settings: dict[str, Any]) -> list[str]:
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


@contextmanager
def _maybe_service(
    args: Any, settings: dict[str, Any], progress: Callable[[str], None]
) -> Iterator[Any]:
    """(client, CPU of its calls) of the service `--mode service` starts; (None, None) local."""
    if args.mode == "local":
        yield None, None
        return
    from cluster.api.client import TandemClient

    with (
        _service(args.preset, _serve_flags(args, settings), progress) as (address, api_key, home),
        TandemClient(address, timeout_s=3600, api_key=api_key) as client,
    ):
        yield client, CpuCalls(cluster_scope(str(home / "ray")), TANDEM_RUNS)


def _by_category(prompts: list[Prompt], samples: dict[str, list[Sample]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for category in dict.fromkeys(p.category for p in prompts):
        members = [i for i, p in enumerate(prompts) if p.category == category]
        pipelined = [samples["tandem_pipelined"][i] for i in members]
        summary = speculation_summary(pipelined)
        out[category] = {
            "acceptance_rate": summary["acceptance_rate"],
            "suffix_acceptance_rate": summary["suffix_acceptance_rate"],
            "model_acceptance_rate": summary["model_acceptance_rate"],
            "suffix_share": summary["suffix_share"],
            "acceptance_by_position": summary["acceptance_by_position"],
            "tokens_per_s": {
                name: summarize_run([samples[name][i] for i in members], False, False)[
                    "tokens_per_s"
                ]
                for name in RUNS
            },
        }
    return out


def _greedy_match(
    args: Any,
    settings: dict[str, Any],
    tandem: Any,
    ids: list[tuple[int, ...]],
    samples: dict[str, list[Sample]],
    progress: Callable[[str], None],
) -> dict[str, int]:
    """Tandem's greedy tokens (the bench's draft and router settings) against HF's target
    alone, both in float32."""
    from cluster.local import build_local
    from cluster.presets import resolve_pair

    if tandem.target.model.dtype == _float32():
        pairs = zip(samples["tandem_pipelined"], samples["hf_target"], strict=True)
        return {"matched": sum(a.tokens == b.tokens for a, b in pairs), "total": len(ids)}
    progress("checking greedy output against HF target-only in float32")
    del tandem
    exact_pair = _with_draft(resolve_pair(args.preset, dtype="float32"), settings)
    exact = build_local(exact_pair, **_router_settings(settings))
    hf = _hf_runner(exact.target.model, args.max_tokens)
    ours = _local_runner(exact, args.max_tokens, args.draft_tokens, True)
    matched = 0
    for index, prompt in enumerate(ids):
        same = hf(prompt)[0] == ours(prompt)[0]
        matched += same
        progress(f"greedy match {index + 1}/{len(ids)}: {'same' if same else 'DIFFERENT'}")
    return {"matched": matched, "total": len(ids)}


def _float32() -> Any:
    import torch

    return torch.float32
