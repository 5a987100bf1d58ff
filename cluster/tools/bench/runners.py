"""How each configuration of `tandem bench` runs one prompt: a `Runner`, prompt ids in,
(tokens, counters) out.

`hf_runner` is Hugging Face `generate`, greedy, the target alone or assisted by a draft model;
`local_runner` is Tandem's router in this process, each pass over the prompts a tenant of its
own; `service_runner` is a `tandem serve` through the Python client. Tandem's counters
(`drafted`, `accepted`, `passes`, `hits`, `misses`, the suffix drafter's, and both by
position) read the same from a client `GenerateResult` and a router `SpeculationStats`; Hugging
Face's runs have none. torch and the router are imported inside, when a runner is made.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

Runner = Callable[[tuple[int, ...]], tuple[tuple[int, ...], dict[str, Any]]]


def hf_runner(model: Any, max_tokens: int, assistant: Any = None) -> Runner:
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


def local_runner(
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


def service_runner(client: Any, max_tokens: int, draft_tokens: int, pipelined: bool) -> Runner:
    def run(ids: tuple[int, ...]) -> tuple[tuple[int, ...], dict[str, Any]]:
        result = client.generate(
            list(ids), max_tokens=max_tokens, draft_tokens=draft_tokens, pipelined=pipelined
        )
        return result.tokens, _stats(result)

    return run
