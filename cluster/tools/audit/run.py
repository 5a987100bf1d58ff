"""Run an audit: send requests to a service, replay each through the plain target, compare.

Contract: the service is a function from a `GenerateRequest` to a `GenerateResult` (a
`TandemClient`'s `generate_request`, or an in-process `TandemService`), so the same code
audits a remote server and an in-process Tandem. Prompts go out as token ids, tokenized here
with the reference's tokenizer (`add_special_tokens=False`, as the service tokenizes text), so
the service and the replay see the same prompt. `audit_cases` gives an `AuditReport` per case
(`cluster.runtime.audit`); `sample_first_two` collects unseeded rejection-rule samples for the
statistical audit (`cluster.tools.audit.stats`). Progress goes to the `progress` callback.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from cluster.api.client_types import GenerateResult, build_request
from cluster.runtime.audit import AuditReport, cause, compare
from cluster.runtime.errors import InvalidArgumentError
from cluster.runtime.models import LoadedModel
from cluster.runtime.sampling_params import SamplingParams
from protos import generate_pb2
from verifier.reference import replay

DEFAULT_PROMPTS = "prompts/one-per-category.jsonl"
"""The built-in prompts (one per category: code, structured, prose, creative)."""

SAMPLE_MAX_TOKENS = 4
"""Tokens each statistical sample asks for, of which the first two are tested. More than two:
a draft block never reaches a request's last token (that one is the target's own), so with
max_tokens 2 the second token would never be a drafted one."""

Generate = Callable[[generate_pb2.GenerateRequest], GenerateResult]
Progress = Callable[[str], None]


@dataclass(frozen=True)
class AuditCase:
    """One request to audit."""

    label: str
    prompt_index: int
    prompt_tokens: tuple[int, ...]
    sampling: SamplingParams
    seed: int | None
    """None for greedy (no noise to seed)."""

    @property
    def rule(self) -> str:
        return "greedy" if self.sampling.is_greedy else "seed_exact"


def read_prompts(path: str | None) -> list[str]:
    """The prompts of `path`: a `.jsonl` file of {"prompt": ...} rows (as `tandem bench`
    takes), else one prompt per non-empty line; None: the built-in prompts."""
    if path is None:
        text = resources.files("cluster.tools").joinpath(DEFAULT_PROMPTS).read_text()
        return [str(json.loads(line)["prompt"]) for line in text.splitlines() if line.strip()]
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise InvalidArgumentError(f"cannot read prompts {path}: {error}") from error
    if not path.endswith(".jsonl"):
        prompts = [line for line in text.splitlines() if line.strip()]
    else:
        prompts = []
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                prompts.append(str(json.loads(line)["prompt"]))
            except (ValueError, KeyError, TypeError) as error:
                raise InvalidArgumentError(f"{path} line {number}: {error!r}") from error
    if not prompts:
        raise InvalidArgumentError(f"{path} holds no prompts")
    return prompts


def encode(reference: LoadedModel, text: str) -> tuple[int, ...]:
    ids = tuple(int(t) for t in reference.tokenizer.encode(text, add_special_tokens=False))
    if not ids:
        raise InvalidArgumentError(f"prompt {text!r} encodes to no tokens")
    return ids


def plan_cases(
    prompts: Sequence[tuple[int, ...]],
    seeds: Sequence[int],
    sampled: SamplingParams,
    greedy: bool,
) -> list[AuditCase]:
    """Per prompt: one seed-exact request per seed with `sampled`'s settings, then one greedy
    request if `greedy`."""
    if sampled.is_greedy and seeds:
        raise InvalidArgumentError("seeded requests need a temperature > 0 (0 is greedy)")
    cases = []
    for index, tokens in enumerate(prompts):
        for seed in seeds:
            cases.append(AuditCase(f"p{index} seed {seed}", index, tokens, sampled, seed))
        if greedy:
            cases.append(AuditCase(f"p{index} greedy", index, tokens, SamplingParams(), None))
    if not cases:
        raise InvalidArgumentError("nothing to audit: give --seeds, or leave greedy requests on")
    return cases


def case_request(
    case: AuditCase, max_tokens: int, draft_tokens: int | None
) -> generate_pb2.GenerateRequest:
    s = case.sampling
    return build_request(
        case.prompt_tokens,
        max_tokens=max_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        seed=case.seed,
        draft_tokens=draft_tokens,
        sampling_rule="auto" if case.seed is None else "seed_exact",
    )


def audit_cases(
    cases: Sequence[AuditCase],
    generate: Generate,
    reference: LoadedModel,
    drafter: str,
    *,
    max_tokens: int,
    draft_tokens: int | None = None,
    progress: Progress = lambda line: None,
) -> list[AuditReport]:
    """Serve each case, replay it through `reference`, and compare."""
    reports = []
    for number, case in enumerate(cases, 1):
        result = generate(case_request(case, max_tokens, draft_tokens))
        if result.num_prompt_tokens != len(case.prompt_tokens):
            raise InvalidArgumentError(
                f"{case.label}: the service counted {result.num_prompt_tokens} prompt tokens, "
                f"the audit sent {len(case.prompt_tokens)}"
            )
        replayed = replay(
            reference, case.prompt_tokens, result.tokens, case.sampling, case.seed or 0
        )
        report = compare(result.tokens, replayed, case.rule, drafter)
        reports.append(report)
        where = "" if report.ok else f", first at {report.first_divergence}"
        progress(
            f"[{number}/{len(cases)}] {case.label} {case.rule}: "
            f"{report.matched}/{report.total} matched{where} ({cause(report)})"
        )
    return reports


def sample_first_two(
    generate: Generate,
    prompt_tokens: Sequence[int],
    sampling: SamplingParams,
    num_samples: int,
    *,
    progress: Progress = lambda line: None,
) -> list[tuple[int, ...]]:
    """The first two tokens of `num_samples` unseeded rejection-rule requests of
    `SAMPLE_MAX_TOKENS` tokens (one token when the first ended the sequence)."""
    if num_samples < 1:
        raise InvalidArgumentError(f"--samples must be >= 1, got {num_samples}")
    if sampling.is_greedy:
        raise InvalidArgumentError("the statistical audit needs a temperature > 0")
    request = build_request(
        list(prompt_tokens),
        max_tokens=SAMPLE_MAX_TOKENS,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        sampling_rule="rejection",
    )
    samples = []
    step = max(num_samples // 10, 1)
    for number in range(1, num_samples + 1):
        samples.append(generate(request).tokens[:2])
        if number % step == 0 or number == num_samples:
            progress(f"[{number}/{num_samples}] samples")
    return samples
