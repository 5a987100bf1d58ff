"""Structured outputs: what a JSON schema costs and keeps, with speculation and without.

`python -m experiments.structured --preset qwen-coder` asks the target, through one
in-process Tandem, to extract JSON from each prompt of a set (`prompts/json-extraction-10.jsonl`:
a passage, an instruction and the JSON schema a client would send as OpenAI's
`response_format`), rendered with the target's chat template, the schema stated in the user's
message so that the unconstrained mode knows it too. Three modes, interleaved per prompt, their
order alternated per prompt and repeat, all greedy:

- `constrained_spec`: the schema as the request's grammar, speculation as `tandem serve` runs
  it: the default block length, prompt lookup and the adaptive plan as `TandemConfig`'s defaults
  (both on), pipelined;
- `unconstrained_spec`: the same without the grammar;
- `constrained_target`: the grammar, the target alone (`draft_tokens=0`).

Per mode: validity (the whole text through `json.loads` and `jsonschema.validate` against the
prompt's schema; also counted after stripping a Markdown code fence, which unconstrained chat
models like to add), finish reasons, acceptance (accepted over drafted tokens), tokens per verify
pass, generated tokens per second (all tokens over all seconds), and the masks' cost from
`MASK_TIMES` snapshots around each request: rows masked (drafter and verifier together, both in
this process), compute seconds on the mask workers, and seconds the callers still waited for
masks after their forward pass (the part not hidden). Progress goes to stderr, one line per
prompt and repeat; Ctrl-C stops the engines and exits. Needs the dev extra (jsonschema).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jsonschema  # type: ignore[import-untyped]  # the dev extra's, no stubs

from cluster.runtime.errors import InvalidArgumentError
from cluster.tools.bench.output import figure, progress
from cluster.tools.prompt_files import prompt_rows

if TYPE_CHECKING:
    from cluster.local import LocalTandem

MODES = ("constrained_spec", "unconstrained_spec", "constrained_target")
DEFAULT_PROMPTS = "prompts/json-extraction-10.jsonl"
SYSTEM = "You extract structured data from text. Reply with a JSON object only."
VALID = "valid"
NOT_JSON = "not_json"
SCHEMA_MISMATCH = "schema_mismatch"


@dataclass(frozen=True)
class ExtractionPrompt:
    """One line of a prompt set: the user's request and the schema its answer must follow."""

    category: str
    prompt: str
    schema: dict[str, Any]

    def message(self) -> str:
        """The user's message: the request, then the schema."""
        schema = json.dumps(self.schema, separators=(",", ":"))
        ask = "Reply with only a JSON object that follows this JSON schema:"
        return f"{self.prompt}\n\n{ask}\n{schema}"


def load_extraction_prompts(path: str | None) -> list[ExtractionPrompt]:
    """The prompts of a jsonl file with 'category', 'prompt' and 'schema' (default: ours)."""
    prompts = []
    for number, row in prompt_rows(path, DEFAULT_PROMPTS):
        try:
            schema = row["schema"]
            jsonschema.Draft202012Validator.check_schema(schema)
            prompts.append(ExtractionPrompt(str(row["category"]), str(row["prompt"]), schema))
        except (ValueError, KeyError, TypeError, jsonschema.SchemaError) as error:
            raise InvalidArgumentError(f"prompts line {number}: {error}") from error
    if not prompts:
        raise InvalidArgumentError(f"no prompts in {path}")
    return prompts


def check_output(text: str, schema: dict[str, Any]) -> str:
    """`VALID`, `NOT_JSON` or `SCHEMA_MISMATCH`: the whole of `text` judged as the answer."""
    try:
        value = json.loads(text)
    except ValueError:
        return NOT_JSON
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError:
        return SCHEMA_MISMATCH
    return VALID


def unfenced(text: str) -> str:
    """`text` without a Markdown code fence around it (```json ... ```), if it has one."""
    body = text.strip()
    if not body.startswith("```"):
        return text
    body = body.split("\n", 1)[1] if "\n" in body else ""
    return body[: body.rfind("```")] if "```" in body else body


@dataclass
class ModeTally:
    """One mode's counters over some requests."""

    requests: int = 0
    tokens: int = 0
    seconds: float = 0.0
    drafted: int = 0
    accepted: int = 0
    passes: int = 0
    mask_rows: int = 0
    mask_compute_s: float = 0.0
    mask_waited_s: float = 0.0
    verdicts: Counter[str] = field(default_factory=Counter)
    valid_unfenced: int = 0
    finish_reasons: Counter[str] = field(default_factory=Counter)
    speeds: list[float] = field(default_factory=list)

    def add(self, record: dict[str, Any]) -> None:
        self.requests += 1
        self.tokens += record["tokens"]
        self.seconds += record["seconds"]
        self.drafted += record["drafted"]
        self.accepted += record["accepted"]
        self.passes += record["passes"]
        self.mask_rows += record["mask_rows"]
        self.mask_compute_s += record["mask_compute_s"]
        self.mask_waited_s += record["mask_waited_s"]
        self.verdicts[record["verdict"]] += 1
        self.valid_unfenced += record["valid_unfenced"]
        self.finish_reasons[record["finish_reason"]] += 1
        self.speeds.append(record["tokens"] / record["seconds"])

    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def summary(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "validity": self.verdicts[VALID] / self.requests if self.requests else None,
            "validity_unfenced": self.valid_unfenced / self.requests if self.requests else None,
            "verdicts": dict(self.verdicts),
            "finish_reasons": dict(self.finish_reasons),
            "acceptance": _ratio(self.accepted, self.drafted),
            "tokens_per_pass": _ratio(self.tokens, self.passes),
            "tokens_per_s": self.tokens_per_s(),
            "median_request_tokens_per_s": statistics.median(self.speeds) if self.speeds else None,
            "mask_compute_ms_per_row": _ratio(1e3 * self.mask_compute_s, self.mask_rows),
            "mask_compute_ms_per_token": _ratio(1e3 * self.mask_compute_s, self.tokens),
            "mask_compute_ms_per_pass": _ratio(1e3 * self.mask_compute_s, self.passes),
            "mask_waited_ms_per_token": _ratio(1e3 * self.mask_waited_s, self.tokens),
            "mask_waited_ms_per_pass": _ratio(1e3 * self.mask_waited_s, self.passes),
            "tokens": self.tokens,
            "seconds": self.seconds,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "passes": self.passes,
            "mask_rows": self.mask_rows,
            "mask_compute_s": self.mask_compute_s,
            "mask_waited_s": self.mask_waited_s,
        }


def _ratio(part: float, whole: float) -> float | None:
    return part / whole if whole else None


def prompt_ids(tandem: LocalTandem, prompt: ExtractionPrompt) -> tuple[int, ...]:
    """The prompt's tokens: the chat rendered with the target's template."""
    from cluster.api.chat import render_chat

    text = render_chat(tandem.tokenizer, [("system", SYSTEM), ("user", prompt.message())])
    return tuple(tandem.tokenizer.encode(text, add_special_tokens=False))


def measure(
    tandem: LocalTandem,
    prompts: list[ExtractionPrompt],
    max_tokens: int,
    repeats: int,
    progress: Callable[[str], None],
) -> dict[str, Any]:
    """Run every prompt in every mode `repeats` times through `tandem`; the per-mode summaries,
    the speed ratios and one record per request."""
    from cluster.routing.draft_length_config import DEFAULT_DRAFT_TOKENS
    from cluster.routing.request import GenerationRequest
    from cluster.runtime.constraint import MASK_TIMES, Grammar

    tallies = {mode: ModeTally() for mode in MODES}
    records: list[dict[str, Any]] = []
    ids = [prompt_ids(tandem, prompt) for prompt in prompts]
    # Builds llguidance's view of both vocabularies (seconds for 152k ids): not a request's.
    warm = Grammar("json_schema", json.dumps(prompts[0].schema))
    tandem.router.generate(GenerationRequest(ids[0], 2, grammar=warm))
    for repeat in range(repeats):
        for index, prompt in enumerate(prompts):
            grammar = Grammar("json_schema", json.dumps(prompt.schema))
            order = MODES if (index + repeat) % 2 == 0 else MODES[::-1]
            for mode in order:
                request = GenerationRequest(
                    ids[index],
                    max_tokens,
                    grammar=None if mode == "unconstrained_spec" else grammar,
                    draft_tokens=0 if mode == "constrained_target" else DEFAULT_DRAFT_TOKENS,
                )
                rows, compute_s, waited_s = MASK_TIMES.snapshot()
                started = time.perf_counter()
                result = tandem.router.generate(request)
                seconds = time.perf_counter() - started
                after = MASK_TIMES.snapshot()
                record = {
                    "category": prompt.category,
                    "mode": mode,
                    "repeat": repeat,
                    "tokens": len(result.tokens),
                    "seconds": seconds,
                    "finish_reason": result.finish_reason.value,
                    "verdict": check_output(result.text, prompt.schema),
                    "valid_unfenced": check_output(unfenced(result.text), prompt.schema) == VALID,
                    "drafted": result.stats.num_drafted,
                    "accepted": result.stats.num_accepted,
                    "passes": result.stats.num_verify_passes,
                    "mask_rows": after[0] - rows,
                    "mask_compute_s": after[1] - compute_s,
                    "mask_waited_s": after[2] - waited_s,
                    "text": result.text,
                }
                tallies[mode].add(record)
                records.append(record)
            progress(
                f"[{index + 1}/{len(prompts)}] {prompt.category} repeat {repeat + 1}: "
                + ", ".join(_line(r) for r in records[-len(MODES) :])
            )
    summaries = {mode: tallies[mode].summary() for mode in MODES}
    speed = {mode: tallies[mode].tokens_per_s() for mode in MODES}
    return {
        "modes": summaries,
        "ratios": {
            "constrained_spec_over_unconstrained_spec": _ratio(
                speed["constrained_spec"], speed["unconstrained_spec"]
            ),
            "constrained_spec_over_constrained_target": _ratio(
                speed["constrained_spec"], speed["constrained_target"]
            ),
        },
        "requests": records,
    }


def _line(record: dict[str, Any]) -> str:
    speed = record["tokens"] / record["seconds"]
    return f"{record['mode']} {speed:.2f} tok/s ({record['verdict']}, {record['finish_reason']})"


def run(args: argparse.Namespace) -> dict[str, Any]:
    # Loading torch and the models takes seconds: only once the flags are known.
    from cluster.config import TandemConfig
    from cluster.local import build_local
    from cluster.presets import resolve_pair
    from cluster.routing.draft_length_config import DEFAULT_DRAFT_TOKENS

    prompts = load_extraction_prompts(args.prompts)
    pair = resolve_pair(args.preset, None, None, args.dtype, args.device)
    serve = TandemConfig()
    progress(f"loading the {args.preset} pair")
    tandem = build_local(pair, prompt_lookup=serve.prompt_lookup, draft_length=serve.draft_length)
    try:
        result = measure(tandem, prompts, args.max_tokens, args.repeats, progress)
    finally:
        close(tandem)
    return {
        "config": {
            "preset": args.preset,
            "target": pair.target.source,
            "draft": pair.draft.source,
            "dtype": pair.target.dtype,
            "draft_quantization": pair.draft.quantization,
            "draft_vocab": pair.draft.trimmed_vocab,
            "draft_tokens": DEFAULT_DRAFT_TOKENS,
            "prompt_lookup": serve.prompt_lookup.enabled,
            "adaptive_draft": serve.draft_length.enabled,
            "pipelined": tandem.router.pipelined,
            "temperature": 0.0,
            "max_tokens": args.max_tokens,
            "repeats": args.repeats,
            "prompts": args.prompts or DEFAULT_PROMPTS,
            "num_prompts": len(prompts),
        },
        **result,
    }


def close(tandem: LocalTandem) -> None:
    """Stop the engines (a request still running fails at once), then the router's pools."""
    tandem.verifier.engine.stop()
    tandem.drafter.engine.stop()
    tandem.router.close()


def table(result: dict[str, Any]) -> str:
    lines = [
        f"{'mode':<19} {'valid':>5} {'finish (stop/length)':>20} {'accept':>6} {'tok/pass':>8} "
        f"{'tok/s':>6} {'mask ms/row':>11} {'ms/token':>8} {'waited ms/token':>15}"
    ]
    for mode, row in result["modes"].items():
        finish = row["finish_reasons"]
        lines.append(
            f"{mode:<19} {figure(row['validity'], 2):>5} "
            f"{finish.get('stop', 0):>15}/{finish.get('length', 0):<4} "
            f"{figure(row['acceptance'], 3):>6} {figure(row['tokens_per_pass'], 2):>8} "
            f"{row['tokens_per_s']:>6.2f} {figure(row['mask_compute_ms_per_row'], 3):>11} "
            f"{figure(row['mask_compute_ms_per_token'], 3):>8} "
            f"{figure(row['mask_waited_ms_per_token'], 3):>15}"
        )
    for name, value in result["ratios"].items():
        lines.append(f"{name}: {figure(value, 2)}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.structured", description=__doc__)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--dtype", help="float32, bfloat16 or float16 (default: the preset's)")
    parser.add_argument("--device", help="cpu or cuda (default: the preset's)")
    parser.add_argument(
        "--prompts", help="jsonl with 'category', 'prompt' and 'schema' (default: ours)"
    )
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args(argv)
    try:
        result = run(args)
    except KeyboardInterrupt:
        print("interrupted: engines stopped, nothing written", file=sys.stderr)
        return 130
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
