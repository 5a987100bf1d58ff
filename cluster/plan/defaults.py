"""The figures `tandem plan` uses when none are given: one `PlanInputs` per preset, each group
of figures with where it was measured, or marked as assumed until it is.

Plain data, shipped in the repository, so a plan runs from a fresh clone with no download.
docs/planning.md has the tables these come from and how to measure them again.
"""

from __future__ import annotations

from cluster.plan.inputs import DrafterCost, HostCost, PlanInputs
from cluster.runtime.sim_source import PROFILES, DeviceProfile

CATEGORIES = ("agentic", "summarise", "reasoning")
"""The workload categories of the shipped prompt sets (`cluster/tools/prompts/`)."""

# The suffix drafter's cost: a lookup in a suffix tree over earlier requests' text is 0.1-1 ms
# of one core a round (0.5 taken), plus a loopback gRPC hop (~0.1 ms each way, the router's
# send and read in docs/simulated-device.md's timeline).
SUFFIX = DrafterCost(
    kind="suffix",
    placement="host_cpu",
    cpu_ms_per_round=0.5,
    hop_ms=0.2,
    replica_cpu_ms_per_token=0.05,
    source="assumed: 0.1-1 ms a lookup (its design), 0.1 ms a gRPC hop each way",
)
SELF_INT4 = DrafterCost(
    kind="self-int4",
    placement="verifier_device",
    target_ratio=0.3,
    source="assumed until measured: an int4 copy of the target costs ~0.3 of its step",
)

SIM_H100_8B = PlanInputs(
    name="sim-h100-8b",
    target=PROFILES["h100-8b"],
    drafters={
        "model": DrafterCost(
            kind="model",
            placement="own_device",
            device=PROFILES["a10g-0.5b"],
            # The drafter process at 16-64 streams: 0.04-0.21 ms a token.
            replica_cpu_ms_per_token=0.1,
            source="sim profile a10g-0.5b (cluster/runtime/sim_source.py)",
        ),
        "suffix": SUFFIX,
        "self-int4": SELF_INT4,
    },
    # Calibrated on docs/loadtest-sim-h100-8b-predraft.json (this repository's 2-core machine,
    # a fresh `tandem serve --preset sim-h100-8b`, 1/16/64 streams, speculative and target-only
    # levels): the CPU a token at 16 and 64 streams fitted as a + b / N (service_total plus the
    # load client), the cores and the latency fitted to the six levels' tokens/s.
    host=HostCost(
        usable_cores=1.48,
        cpu_ms_per_token=0.98,
        cpu_ms_per_step=1.97,
        latency_ms_per_round=0.0,
        source="fitted to docs/loadtest-sim-h100-8b-predraft.json (2 shared cores)",
    ),
    acceptance={
        # The sim draft agrees with the target at the preset's alpha whatever the text is.
        "agentic": {"model": 0.8, "suffix": 0.7, "self-int4": 0.95},
        "summarise": {"model": 0.8, "suffix": 0.4, "self-int4": 0.95},
        "reasoning": {"model": 0.8, "suffix": 0.05, "self-int4": 0.95},
    },
    context_tokens=124,
    sources={
        "target": "sim profile h100-8b (cluster/runtime/sim_source.py)",
        "acceptance": "model: the sim draft's alpha 0.8 by construction; suffix and "
        "self-int4: assumed until measured on cluster/tools/prompts/categories-mix.jsonl",
        "context": "the loadtest default prompts' 92 tokens + half of 64 max_tokens",
    },
)

# Qwen2.5-Coder 1.5B (bf16) and its 0.5B int8 draft on this 2-core CPU: the "device" is the
# host's own cores, so the cost curves are measured wall times of the service's forward passes.
QWEN_CODER = PlanInputs(
    name="qwen-coder",
    # Target-only levels of docs/loadtest-qwen-coder-steps.json: 172, 186, 198, 238 and 305 ms
    # a step at 1, 2, 4, 8 and 16 streams, fitted as 165 ms + 8.8 ms a token of the batch.
    target=DeviceProfile(
        base_s=0.165,
        per_token_s=8.8e-3,
        per_context_s=0.0,
        source="fitted to docs/loadtest-qwen-coder-steps.json target-only levels",
    ),
    drafters={
        # The draft's forward passes run on the same two cores as the target's: its block
        # cannot overlap a verify pass at load, so it prices as a share of the target's step:
        # 84 ms a token on one thread, int8 (docs/models.md), against the target's 172.
        "model": DrafterCost(
            kind="model",
            placement="verifier_device",
            target_ratio=0.49,
            source="docs/models.md: the int8 0.5B draft, 84 ms a token on one thread",
        ),
        "suffix": SUFFIX,
        "self-int4": SELF_INT4,
    },
    # Tandem's own CPU beside the forward passes: service_total less verifier and drafter,
    # 3.5 ms a token at 8 streams target-only (docs/loadtest-qwen-coder-steps.json); the
    # forward passes already hold the cores, which the fitted step times include.
    host=HostCost(
        usable_cores=2.0,
        cpu_ms_per_token=3.5,
        source="docs/loadtest-qwen-coder-steps.json: service_total - verifier - drafter",
    ),
    acceptance={
        # docs/bench-qwen-coder-service-64.json, 4-token blocks: code 0.88 of drafted tokens
        # accepted (alpha 0.95), prose 0.34 (alpha 0.62); the nearest categories stand in.
        "agentic": {"model": 0.95, "suffix": 0.7, "self-int4": 0.95},
        "summarise": {"model": 0.62, "suffix": 0.4, "self-int4": 0.95},
        "reasoning": {"model": 0.62, "suffix": 0.05, "self-int4": 0.95},
    },
    context_tokens=110,
    sources={
        "acceptance": "model: docs/bench-qwen-coder-service-64.json code (agentic) and prose "
        "(summarise, reasoning) as stand-ins; suffix and self-int4: assumed until measured",
        "context": "the default prompts' ~94 tokens + half of 32 max_tokens",
    },
)

PRESETS: dict[str, PlanInputs] = {p.name: p for p in (SIM_H100_8B, QWEN_CODER)}
