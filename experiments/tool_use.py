"""Tool use with `tool_choice: "auto"`: valid calls, acceptance and speed, with speculation and
without.

`python -m experiments.tool_use --preset qwen-coder` renders each prompt of a set
(`prompts/tool-use-10.jsonl`: a user's request and the tools a client would send as OpenAI's
`tools`) with the target's chat template and its tools, and generates, through one in-process
Tandem, in three modes, interleaved per prompt, their order alternated per prompt and repeat,
all greedy:

- `auto_spec`: the grammar `tool_choice: "auto"` sends (the model's tool-call format:
  `--tool-parser`, else the preset's, else the one its chat template asks for: text, or text
  then calls whose names and arguments follow the tools), speculation as `tandem serve` runs
  it (default block length, prompt lookup and the adaptive plan on, pipelined);
- `free_spec`: the same without the grammar (what a server that only parses the output gets);
- `auto_target`: the grammar, the target alone (`draft_tokens=0`).

Per mode: the share of requests that made a call, the share of calls that are valid (a known
tool, arguments that are JSON and validate against its parameters with `jsonschema`), finish
reasons, acceptance (accepted over drafted tokens), tokens per verify pass and generated tokens
per second, and the masks' cost (`MASK_TIMES` around each request: compute milliseconds per
generated token on the mask workers, and what callers still waited for after their forward
pass); and the speed of `auto_spec` over `auto_target`. The output is read by the format's
own reader (`cluster.api.auto_tool_calls.auto_message`), as the API reads it. Progress goes to
stderr. Needs the dev extra (jsonschema).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jsonschema  # type: ignore[import-untyped]  # the dev extra's, no stubs

from cluster.api.auto_tool_calls import auto_message
from cluster.api.tool_format import ToolFormat
from cluster.api.tool_formats import DETECT, TOOL_FORMATS, choose_format
from cluster.runtime.errors import InvalidArgumentError
from cluster.tools.bench.output import figure, progress
from cluster.tools.prompt_files import prompt_rows

if TYPE_CHECKING:
    from cluster.local import LocalTandem

MODES = ("auto_spec", "free_spec", "auto_target")
DEFAULT_PROMPTS = "prompts/tool-use-10.jsonl"
SYSTEM = "You are a helpful assistant. Use the tools when they help."


@dataclass(frozen=True)
class ToolPrompt:
    """One line of a prompt set: the user's request and the tools offered."""

    category: str
    prompt: str
    tools: tuple[dict[str, Any], ...]

    def schemas(self) -> dict[str, dict[str, Any]]:
        """Each tool's parameter schema by name."""
        return {t["function"]["name"]: t["function"].get("parameters") or {} for t in self.tools}


def load_tool_prompts(path: str | None) -> list[ToolPrompt]:
    """The prompts of a jsonl file with 'category', 'prompt' and 'tools' (default: ours)."""
    prompts = []
    for number, row in prompt_rows(path, DEFAULT_PROMPTS):
        try:
            tools = tuple(row["tools"])
            for tool in tools:
                jsonschema.Draft202012Validator.check_schema(tool["function"]["parameters"])
            prompts.append(ToolPrompt(str(row["category"]), str(row["prompt"]), tools))
        except (ValueError, KeyError, TypeError, jsonschema.SchemaError) as error:
            raise InvalidArgumentError(f"prompts line {number}: {error}") from error
    if not prompts:
        raise InvalidArgumentError(f"no prompts in {path}")
    return prompts


def judge_calls(calls: list[dict[str, Any]], schemas: dict[str, dict[str, Any]]) -> int:
    """How many of `calls` (OpenAI's `tool_calls`) name a tool and carry valid arguments."""
    valid = 0
    for call in calls:
        schema = schemas.get(call["function"]["name"])
        try:
            arguments = json.loads(call["function"]["arguments"])
            if schema is not None:
                jsonschema.validate(arguments, schema)
                valid += 1
        except (ValueError, jsonschema.ValidationError):
            continue
    return valid


@dataclass
class ModeTally:
    """One mode's counters over some requests."""

    requests: int = 0
    with_calls: int = 0
    calls: int = 0
    valid_calls: int = 0
    tokens: int = 0
    seconds: float = 0.0
    drafted: int = 0
    accepted: int = 0
    passes: int = 0
    mask_compute_s: float = 0.0
    mask_waited_s: float = 0.0
    finish_reasons: Counter[str] = field(default_factory=Counter)

    def add(self, record: dict[str, Any]) -> None:
        self.requests += 1
        self.with_calls += record["calls"] > 0
        self.calls += record["calls"]
        self.valid_calls += record["valid_calls"]
        self.tokens += record["tokens"]
        self.seconds += record["seconds"]
        self.drafted += record["drafted"]
        self.accepted += record["accepted"]
        self.passes += record["passes"]
        self.mask_compute_s += record["mask_compute_s"]
        self.mask_waited_s += record["mask_waited_s"]
        self.finish_reasons[record["finish_reason"]] += 1

    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def summary(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "call_rate": _ratio(self.with_calls, self.requests),
            "calls": self.calls,
            "valid_call_share": _ratio(self.valid_calls, self.calls),
            "finish_reasons": dict(self.finish_reasons),
            "acceptance": _ratio(self.accepted, self.drafted),
            "tokens_per_pass": _ratio(self.tokens, self.passes),
            "tokens_per_s": self.tokens_per_s(),
            "mask_compute_ms_per_token": _ratio(1e3 * self.mask_compute_s, self.tokens),
            "mask_waited_ms_per_token": _ratio(1e3 * self.mask_waited_s, self.tokens),
            "tokens": self.tokens,
            "seconds": self.seconds,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "passes": self.passes,
        }


def _ratio(part: float, whole: float) -> float | None:
    return part / whole if whole else None


def prompt_ids(tandem: LocalTandem, prompt: ToolPrompt) -> tuple[int, ...]:
    """The prompt's tokens: the chat and its tools rendered with the target's template."""
    from cluster.api.chat import render_chat

    messages = [("system", SYSTEM), ("user", prompt.prompt)]
    text = render_chat(tandem.tokenizer, messages, prompt.tools)
    return tuple(tandem.tokenizer.encode(text, add_special_tokens=False))


def measure(
    tandem: LocalTandem,
    tool_format: ToolFormat,
    prompts: list[ToolPrompt],
    max_tokens: int,
    repeats: int,
) -> dict[str, Any]:
    """Every prompt in every mode `repeats` times: per-mode summaries, the speed ratio and one
    record per request."""
    from cluster.routing.draft_length_config import DEFAULT_DRAFT_TOKENS
    from cluster.routing.request import GenerationRequest
    from cluster.runtime.constraint import MASK_TIMES, Grammar

    tallies = {mode: ModeTally() for mode in MODES}
    records: list[dict[str, Any]] = []
    ids = [prompt_ids(tandem, prompt) for prompt in prompts]
    grammars = [
        Grammar("lark", tool_format.grammar([t["function"] for t in p.tools], True))
        for p in prompts
    ]
    # Builds llguidance's view of both vocabularies (seconds for 152k ids): not a request's.
    tandem.router.generate(GenerationRequest(ids[0], 2, grammar=grammars[0]))
    for repeat in range(repeats):
        for index, prompt in enumerate(prompts):
            order = MODES if (index + repeat) % 2 == 0 else MODES[::-1]
            for mode in order:
                request = GenerationRequest(
                    ids[index],
                    max_tokens,
                    grammar=None if mode == "free_spec" else grammars[index],
                    draft_tokens=0 if mode == "auto_target" else DEFAULT_DRAFT_TOKENS,
                )
                _, compute_s, waited_s = MASK_TIMES.snapshot()
                started = time.perf_counter()
                result = tandem.router.generate(request)
                seconds = time.perf_counter() - started
                _, compute_after, waited_after = MASK_TIMES.snapshot()
                reason = result.finish_reason.value
                message, _ = auto_message(tool_format, result.text, reason)
                calls = message.get("tool_calls", [])
                record = {
                    "category": prompt.category,
                    "mode": mode,
                    "repeat": repeat,
                    "tokens": len(result.tokens),
                    "seconds": seconds,
                    "finish_reason": reason,
                    "calls": len(calls),
                    "valid_calls": judge_calls(calls, prompt.schemas()),
                    "drafted": result.stats.num_drafted,
                    "accepted": result.stats.num_accepted,
                    "passes": result.stats.num_verify_passes,
                    "mask_compute_s": compute_after - compute_s,
                    "mask_waited_s": waited_after - waited_s,
                    "text": result.text,
                }
                tallies[mode].add(record)
                records.append(record)
            progress(
                f"[{index + 1}/{len(prompts)}] {prompt.category} repeat {repeat + 1}: "
                + ", ".join(
                    f"{r['mode']} {r['tokens'] / r['seconds']:.2f} tok/s "
                    f"({r['valid_calls']}/{r['calls']} valid calls)"
                    for r in records[-len(MODES) :]
                )
            )
    speed = {mode: tallies[mode].tokens_per_s() for mode in MODES}
    return {
        "modes": {mode: tallies[mode].summary() for mode in MODES},
        "ratios": {
            "auto_spec_over_auto_target": _ratio(speed["auto_spec"], speed["auto_target"]),
            "auto_spec_over_free_spec": _ratio(speed["auto_spec"], speed["free_spec"]),
        },
        "requests": records,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    # Loading torch and the models takes seconds: only once the flags are known.
    from cluster.config import TandemConfig
    from cluster.local import build_local
    from cluster.presets import PRESETS, resolve_pair
    from experiments.structured import close

    prompts = load_tool_prompts(args.prompts)
    pair = resolve_pair(args.preset, None, None, args.dtype, args.device)
    serve = TandemConfig()
    progress(f"loading the {args.preset} pair")
    tandem = build_local(pair, prompt_lookup=serve.prompt_lookup, draft_length=serve.draft_length)
    try:
        parser_name = args.tool_parser or PRESETS[args.preset].tool_parser
        tool_format = choose_format(parser_name, tandem.tokenizer.chat_template)
        if tool_format is None:
            raise InvalidArgumentError(
                "the target's chat template asks for no known tool-call format: pass "
                f"--tool-parser ({', '.join(TOOL_FORMATS)})"
            )
        result = measure(tandem, tool_format, prompts, args.max_tokens, args.repeats)
    finally:
        close(tandem)
    return {
        "config": {
            "preset": args.preset,
            "target": pair.target.source,
            "draft": pair.draft.source,
            "dtype": pair.target.dtype,
            "tool_parser": tool_format.name,
            "prompt_lookup": serve.prompt_lookup.enabled,
            "adaptive_draft": serve.draft_length.enabled,
            "temperature": 0.0,
            "max_tokens": args.max_tokens,
            "repeats": args.repeats,
            "prompts": args.prompts or DEFAULT_PROMPTS,
            "num_prompts": len(prompts),
        },
        **result,
    }


def table(result: dict[str, Any]) -> str:
    lines = [
        f"{'mode':<12} {'call rate':>9} {'valid calls':>11} {'finish (stop/length)':>20} "
        f"{'accept':>6} {'tok/pass':>8} {'tok/s':>7} {'mask ms/token':>13} {'waited':>6}"
    ]
    for mode, row in result["modes"].items():
        finish = row["finish_reasons"]
        lines.append(
            f"{mode:<12} {figure(row['call_rate'], 2):>9} {figure(row['valid_call_share'], 2):>11} "
            f"{finish.get('stop', 0):>15}/{finish.get('length', 0):<4} "
            f"{figure(row['acceptance'], 3):>6} {figure(row['tokens_per_pass'], 2):>8} "
            f"{row['tokens_per_s']:>7.2f} {figure(row['mask_compute_ms_per_token'], 3):>13} "
            f"{figure(row['mask_waited_ms_per_token'], 3):>6}"
        )
    for name, value in result["ratios"].items():
        lines.append(f"{name}: {figure(value, 2)}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.tool_use", description=__doc__)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--dtype", help="float32, bfloat16 or float16 (default: the preset's)")
    parser.add_argument("--device", help="cpu or cuda (default: the preset's)")
    parser.add_argument("--prompts", help="jsonl with 'category', 'prompt' and 'tools'")
    parser.add_argument(
        "--tool-parser",
        default=DETECT,
        choices=[DETECT, *TOOL_FORMATS],
        help="the tool-call format (default: the preset's, else the chat template's)",
    )
    parser.add_argument("--max-tokens", type=int, default=192)
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
