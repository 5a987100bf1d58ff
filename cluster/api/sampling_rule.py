"""Which acceptance rule a request's sampled tokens follow: seed-exact or rejection sampling.

Both rules draw exact samples from the target's distribution. Seed-exact
(`cluster.runtime.gumbel`) also makes a seeded request's output a function of its prompt, seed,
sampling settings and target model alone, whatever drafted it; rejection sampling accepts more
drafts. A request names its rule in `SamplingParams.rule`; an unnamed rule takes the server's
default (`ServiceConfig.sampling_rule`), whose own default, `auto`, is seed-exact exactly when
the request carries a seed.
"""

from __future__ import annotations

from cluster.runtime.errors import InvalidArgumentError
from protos import sampling_pb2

AUTO = "auto"
SEED_EXACT = "seed_exact"
REJECTION = "rejection"
SAMPLING_RULES = (AUTO, SEED_EXACT, REJECTION)
"""Values of `ServiceConfig.sampling_rule` and of the OpenAI API's `sampling_rule` field."""

_BY_NAME: dict[str, sampling_pb2.SamplingRule] = {
    AUTO: sampling_pb2.SAMPLING_RULE_UNSPECIFIED,
    SEED_EXACT: sampling_pb2.SAMPLING_RULE_SEED_EXACT,
    REJECTION: sampling_pb2.SAMPLING_RULE_REJECTION,
}


def check_rule_name(name: object, field: str) -> str:
    """`name` if it is one of `SAMPLING_RULES`; InvalidArgumentError naming `field` if not."""
    if name not in SAMPLING_RULES:
        raise InvalidArgumentError(
            f"{field} must be one of {', '.join(SAMPLING_RULES)}, got {name!r}"
        )
    assert isinstance(name, str)
    return name


def rule_to_proto(name: str) -> sampling_pb2.SamplingRule:
    """The wire value of a rule name (`auto` is the unspecified rule)."""
    return _BY_NAME[check_rule_name(name, "sampling_rule")]


def rule_name(seed_exact: bool) -> str:
    """The name of a resolved rule."""
    return SEED_EXACT if seed_exact else REJECTION


def rule_from_proto(rule: int) -> str:
    """The name of a wire value (the unspecified rule is `auto`); InvalidArgumentError for a
    value that is no `SamplingRule`."""
    for name, value in _BY_NAME.items():
        if rule == value:
            return name
    raise InvalidArgumentError(f"sampling.rule {rule} is not a SamplingRule")


def resolve_rule(rule: str, seeded: bool, default: str = AUTO) -> bool:
    """Whether a request follows the seed-exact rule: its own `rule` when it names one (not
    `auto`), else the server's `default`, where `auto` means seed-exact exactly when the
    request is `seeded`."""
    default = check_rule_name(default, "sampling_rule")
    rule = check_rule_name(rule, "sampling_rule")
    if rule != AUTO:
        return rule == SEED_EXACT
    return seeded if default == AUTO else default == SEED_EXACT


def resolve_seed_exact(rule: int, seeded: bool, default: str = AUTO) -> bool:
    """`resolve_rule` for a rule's wire value."""
    default = check_rule_name(default, "sampling_rule")
    return resolve_rule(rule_from_proto(rule), seeded, default)
