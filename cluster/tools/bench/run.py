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

Here: the run itself (`run_bench`: load, measure, summarize, check). Each configuration's
`Runner` is `cluster.tools.bench.runners`, the settings `cluster.tools.bench.settings`, the
summaries `cluster.tools.bench.summary`, the service `cluster.tools.bench.private_service`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from cluster.tools.bench.private_service import private_service
from cluster.tools.bench.process_cpu import CpuCalls, cluster_scope
from cluster.tools.bench.runners import Runner, hf_runner, local_runner, service_runner
from cluster.tools.bench.settings import (
    bench_settings,
    plain_draft,
    router_settings,
    serve_flags,
    with_draft,
)
from cluster.tools.bench.summary import RUNS, TANDEM_RUNS, Sample, by_category, summarize_run
from cluster.tools.prompt_files import load_prompts


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


def run_bench(args: Any, progress: Callable[[str], None]) -> dict[str, Any]:
    from cluster.local import build_local
    from cluster.presets import PRESETS, resolve_pair
    from cluster.runtime.models import load_model

    prompts = load_prompts(args.prompts)
    settings = bench_settings(args)
    dtype = args.dtype or PRESETS[args.preset].default_dtype if args.preset in PRESETS else None
    plain = plain_draft(resolve_pair(args.preset, dtype=dtype))
    ours = with_draft(plain, settings)
    progress(f"loading the {args.preset} pair ({dtype}); Tandem runs with {settings}")
    local = args.mode == "local"
    tandem = build_local(ours if local else plain, **router_settings(settings))
    ids = [tuple(tandem.tokenizer.encode(p.text, add_special_tokens=False)) for p in prompts]
    target = tandem.target.model
    draft = tandem.draft.model if not local or ours == plain else load_model(plain.draft).model
    runners: dict[str, Runner] = {
        "hf_target": hf_runner(target, args.max_tokens),
        "hf_assisted": hf_runner(target, args.max_tokens, assistant=draft),
    }
    with _maybe_service(args, settings, progress) as (client, cpu):
        for name, k, pipelined in (("tandem_target", 0, False),
                                   ("tandem_serial", args.draft_tokens, False),
                                   ("tandem_pipelined", args.draft_tokens, True)):  # fmt: skip
            runners[name] = (
                local_runner(tandem, args.max_tokens, k, pipelined, name)
                if client is None
                else service_runner(client, args.max_tokens, k, pipelined)
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
        "by_category": by_category(prompts, samples),
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
        private_service(args.preset, serve_flags(args, settings), progress) as (
            address,
            api_key,
            home,
        ),
        TandemClient(address, timeout_s=3600, api_key=api_key) as client,
    ):
        yield client, CpuCalls(cluster_scope(str(home / "ray")), TANDEM_RUNS)


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
    exact_pair = with_draft(resolve_pair(args.preset, dtype="float32"), settings)
    exact = build_local(exact_pair, **router_settings(settings))
    hf = hf_runner(exact.target.model, args.max_tokens)
    ours = local_runner(exact, args.max_tokens, args.draft_tokens, True)
    matched = 0
    for index, prompt in enumerate(ids):
        same = hf(prompt)[0] == ours(prompt)[0]
        matched += same
        progress(f"greedy match {index + 1}/{len(ids)}: {'same' if same else 'DIFFERENT'}")
    return {"matched": matched, "total": len(ids)}


def _float32() -> Any:
    import torch

    return torch.float32
