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

# The suffix drafter's cost: its replica's CPU at 16 and 64 streams came to 0.41-0.45 ms a
# round (0.050 ms a token at 8.3-9.1 tokens a round, docs/runs/loadtest-sim-h100-8b-calibration-
# greedy.json), plus a loopback gRPC hop (~0.1 ms each way, the router's send and read in
# docs/simulated-device.md's timeline).
SUFFIX = DrafterCost(
    kind="suffix",
    placement="host_cpu",
    cpu_ms_per_round=0.45,
    hop_ms=0.2,
    replica_cpu_ms_per_token=0.05,
    source="measured: 0.41-0.45 ms of its replica's CPU a round at 16-64 streams; "
    "0.1 ms a gRPC hop each way",
)
# The target's own int4 copy (groups of 32, torch's CPU int4 kernel) against the bf16 target,
# each alone on one thread of this 2-core CPU: 125 against 380 ms a decoded token (0.33), and
# 19.1 against 15.8 s to prefill a 396-token agentic prompt (1.21: the kernel is built for
# decode). A drafter replica beside the verifier on the two shared cores runs slower than
# alone: the 0.5B draft costs 0.49 of a target step in the service against 0.19 alone (72 ms a
# token on the same run), so the int4 copy's 0.33 scales to 0.85, which matches what the
# service measured with it (0.83-0.91x the target alone, docs/runs/drafter-kinds-qwen-coder.json).
SELF_INT4 = DrafterCost(
    kind="self-int4",
    placement="verifier_device",
    target_ratio=0.85,
    prefill_ratio=1.21,
    source="one thread: 125 / 380 ms a decoded token (0.33), 19.1 / 15.8 s a 396-token "
    "prefill, against the bf16 target; decode scaled x 0.49 / 0.19 as the 0.5B draft's is "
    "in the service",
)

SIM_H100_8B = PlanInputs(
    name="sim-h100-8b",
    target=PROFILES["h100-8b"],
    drafters={
        # The drafter process at 16-64 streams: 0.04-0.21 ms a token. On this one host, at 16
        # streams greedy with the suffix drafter off (docs/runs/loadtest-sim-h100-8b-model-
        # calibration.json, 1.28 drafted tokens and 1.64 committed a round): the drafter's
        # process 0.41 ms a drafted token (its simulated logits), and the router 0.43 ms more
        # a drafting round than a target-alone one (the draft calls and their frames).
        "model": DrafterCost(
            kind="model",
            placement="own_device",
            device=PROFILES["a10g-0.5b"],
            replica_cpu_ms_per_token=0.1,
            exchange_cpu_ms_per_round=0.43,
            cpu_ms_per_drafted_token=0.41,
            source="sim profile a10g-0.5b (cluster/runtime/sim_source.py); its CPU on this "
            "host from docs/runs/loadtest-sim-h100-8b-model-calibration.json",
        ),
        "suffix": SUFFIX,
        "self-int4": SELF_INT4,
    },
    # `tandem plan --calibrate` on a fresh `tandem serve --preset sim-h100-8b` under `tandem
    # loadtest --preset sim-h100-8b --concurrency 1 16 64 --duration 20 --max-tokens 64
    # --compare` (this repository's 2-core machine, nothing else running), greedy (the load
    # test's default) and at --temperature 1.0: docs/planning.md has both and the runs that
    # checked them.
    host=HostCost(
        usable_cores=1.56,
        cpu_ms_per_token=0.334,
        cpu_ms_per_round=0.999,
        cpu_ms_per_step=6.10,
        critical_share=0.56,
        source="fitted to docs/runs/loadtest-sim-h100-8b-calibration-greedy.json (2 cores)",
    ),
    sampled_host=HostCost(
        usable_cores=1.33,
        cpu_ms_per_token=2.60,
        cpu_ms_per_round=0.0,
        cpu_ms_per_step=12.57,
        critical_share=0.135,
        source="fitted to docs/runs/loadtest-sim-h100-8b-calibration-sampled.json (2 cores)",
    ),
    acceptance={
        # The sim draft agrees with the target at the preset's alpha whatever the text is. The
        # sim has no int4 copy of its target (no `self-int4`), and its text is no category's:
        # the suffix drafter's alphas are the qwen-coder categories' stand-ins.
        "agentic": {"model": 0.8, "suffix": 0.7},
        "summarise": {"model": 0.8, "suffix": 0.4},
        "reasoning": {"model": 0.8, "suffix": 0.05},
    },
    context_tokens=124,
    prompt_tokens=92,
    output_tokens=64,
    sources={
        "target": "sim profile h100-8b (cluster/runtime/sim_source.py)",
        "acceptance": "model: the sim draft's alpha 0.8 by construction; suffix: assumed "
        "per category (the sim's text is synthetic); no self-int4 on the sim",
        "context": "the loadtest default prompts' 92 tokens + half of 64 max_tokens",
        "prefill": "the sim engine's own price: per_token_s a prompt token",
    },
)

# Qwen2.5-Coder 1.5B (bf16) and its 0.5B int8 draft on this 2-core CPU: the "device" is the
# host's own cores, so the cost curves are measured wall times of the service's forward passes.
QWEN_CODER = PlanInputs(
    name="qwen-coder",
    # Target-only levels of docs/runs/loadtest-qwen-coder-steps.json: decode steps (ITL p50) of
    # 165, 166, 174, 201 and 247 ms at 1, 2, 4, 8 and 16 streams, fitted as 155 ms + 5.7 ms a
    # token of the batch; prefills are priced apart (`prefill_s_per_token` below).
    target=DeviceProfile(
        base_s=0.155,
        per_token_s=5.7e-3,
        per_context_s=0.0,
        source="fitted to docs/runs/loadtest-qwen-coder-steps.json target-only ITL p50",
    ),
    drafters={
        # The draft's forward passes run on the same two cores as the target's: its block
        # cannot overlap a verify pass at load, so it prices as a share of the target's step:
        # 84 ms a token on one thread, int8 (docs/models.md), against the target's 172.
        # Its prefill, measured on one thread beside the target's: 5.7 against 15.8 s for a
        # 396-token prompt (0.36).
        "model": DrafterCost(
            kind="model",
            placement="verifier_device",
            target_ratio=0.49,
            prefill_ratio=0.36,
            source="docs/models.md: the int8 0.5B draft, 84 ms a token on one thread; "
            "its prefill 0.36 of the target's",
        ),
        "suffix": SUFFIX,
        "self-int4": SELF_INT4,
    },
    # Tandem's own CPU beside the forward passes: service_total less verifier and drafter,
    # 3.5 ms a token at 8 streams target-only (docs/runs/loadtest-qwen-coder-steps.json); the
    # forward passes already hold the cores, which the fitted step times include.
    host=HostCost(
        usable_cores=2.0,
        cpu_ms_per_token=3.5,
        source="docs/runs/loadtest-qwen-coder-steps.json: service_total - verifier - drafter",
    ),
    acceptance={
        # model: docs/runs/bench-qwen-coder-service-64.json, 4-token blocks: code 0.88 of drafted
        # tokens accepted (alpha 0.95), prose 0.34 (alpha 0.62); the nearest categories stand
        # in. self-int4: its greedy agreement with the target (docs/models.md), code 97.2%,
        # prose 93.8%. suffix: on the agentic prompts it drafts nearly every round and 96% of
        # its tokens are accepted (docs/runs/drafter-kinds-qwen-coder-hf-assisted.json: alpha 0.99
        # at 8-token blocks); on summaries and reasoning it drafts in few rounds (53% and 24%
        # of what it drafts accepted), which per-round alphas of 0.4 and 0.05 stand for.
        "agentic": {"model": 0.95, "suffix": 0.99, "self-int4": 0.97},
        "summarise": {"model": 0.62, "suffix": 0.4, "self-int4": 0.94},
        "reasoning": {"model": 0.62, "suffix": 0.05, "self-int4": 0.94},
    },
    context_tokens=110,
    prompt_tokens=94,
    output_tokens=32,
    # Prefills at one stream, target alone (time to first token at p50 less a step's base):
    # ~190 ms for the default prompts' 94 tokens (docs/runs/loadtest-qwen-coder-steps.json) and
    # ~1,690 ms for the agentic prompts' 422
    # (docs/runs/loadtest-qwen-coder-agentic-plan-check.json): 1.43 ms a prompt token plus
    # 0.0061 ms a token squared (attention over the prompt).
    prefill_s_per_token=1.43e-3,
    prefill_s_per_token_squared=6.1e-6,
    device_is_host=True,
    sources={
        "acceptance": "model: docs/runs/bench-qwen-coder-service-64.json code (agentic) and prose "
        "(summarise, reasoning) as stand-ins; self-int4: its agreement (docs/models.md); "
        "suffix: measured on agentic, per-round stand-ins elsewhere",
        "context": "the default prompts' ~94 tokens + half of 32 max_tokens",
        "prefill": "1.43 ms a prompt token + 0.0061 ms a token squared: one stream's time to "
        "first token on 94-token (docs/runs/loadtest-qwen-coder-steps.json) and 422-token prompts "
        "(docs/runs/loadtest-qwen-coder-agentic-plan-check.json)",
    },
)

PRESETS: dict[str, PlanInputs] = {p.name: p for p in (SIM_H100_8B, QWEN_CODER)}
