"""The simulated device: deterministic logits, a draft at the requested agreement, modelled time
honoured (on a fake clock), greedy output through the router equal to the sim target alone, and
rows equal to a plain-integer reference of the hashing at any batch size."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from cluster.local import build_local, local_router
from cluster.presets import resolve_pair
from cluster.routing.request import GenerationRequest
from cluster.runtime import sim, sim_source
from cluster.runtime.block_runner import SequenceWork
from cluster.runtime.errors import InvalidArgumentError
from cluster.runtime.model_spec import ModelSpec
from cluster.runtime.models import LoadedModel, load_model
from cluster.runtime.runner import build_runner
from cluster.runtime.sampling_params import SamplingParams
from cluster.runtime.sim_model import SimCausalLM, SimModelRunner

VOCAB = 4_000


def _model(source: str) -> LoadedModel:
    return load_model(ModelSpec(source, device="cpu"))


def _greedy(model: SimCausalLM, prompt: list[int], num_tokens: int) -> list[int]:
    """The sim target alone: a full forward over the whole history for every token."""
    ids = list(prompt)
    for _ in range(num_tokens):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def test_sources_parse_and_bad_ones_are_refused() -> None:
    parsed = sim_source.SimSource.parse("sim://draft/a10g-0.5b?alpha=0.6&vocab=5000&seed=3")
    assert (parsed.role, parsed.profile_name, parsed.alpha, parsed.vocab_size, parsed.seed) == (
        "draft", "a10g-0.5b", 0.6, 5000, 3,
    )  # fmt: skip
    for bad, words in [
        ("sim://drafter/h100-8b", "role"),
        ("sim://target/h200", "unknown device profile"),
        ("sim://draft/instant?alpha=1.5", "alpha"),
        ("sim://draft/instant?beta=1", "unknown options"),
        ("sim://target/instant?vocab=10", "vocab"),
    ]:
        with pytest.raises(InvalidArgumentError, match=words):
            ModelSpec(bad)
    with pytest.raises(InvalidArgumentError, match="no quantization"):
        ModelSpec("sim://draft/instant", quantization="int8")


def test_logits_are_a_function_of_context_and_position_alone() -> None:
    a = _model(f"sim://target/instant?vocab={VOCAB}").model
    b = _model(f"sim://target/instant?vocab={VOCAB}").model  # another load, same function
    ids = torch.tensor([[5, 9, 300, 17, 17, 2000]])
    first, again = a(ids).logits, b(ids).logits
    assert torch.equal(first, again)
    assert first.shape == (1, 6, VOCAB)
    # A row depends on the last two tokens and the position: change an earlier token and the
    # later rows stay; change the position and they move.
    other = a(torch.tensor([[6, 9, 300, 17, 17, 2000]])).logits
    assert torch.equal(other[0, 2:], first[0, 2:]) and not torch.equal(other[0, :2], first[0, :2])
    shifted = a(torch.tensor([[1, 5, 9, 300, 17, 17, 2000]])).logits
    assert not torch.equal(shifted[0, 1:], first[0])
    probs = first.softmax(-1)
    assert 0.3 < float(probs.max(-1).values.mean()) < 0.9  # peaked, yet sampling varies
    assert float(probs[..., sim_source.END_OF_TEXT_ID].max()) < 1e-12  # texts run to max_tokens


@pytest.mark.parametrize("alpha", [0.6, 0.8])
def test_the_draft_agrees_with_the_target_at_the_requested_rate(alpha: float) -> None:
    target = _model(f"sim://target/instant?vocab={VOCAB}").model
    draft = _model(f"sim://draft/instant?vocab={VOCAB}&alpha={alpha}").model
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (1, 20_000), generator=generator)
    agree = (target(ids).logits.argmax(-1) == draft(ids).logits.argmax(-1)).double().mean()
    # 20,000 independent positions: the standard error is at most 0.0035, so 0.015 is > 4 sigma.
    assert abs(float(agree) - alpha) < 0.015


def test_the_runner_returns_the_full_forward_rows_and_rolls_back() -> None:
    loaded = _model(f"sim://target/instant?vocab={VOCAB}")
    runner = build_runner(loaded, kv_cache_bytes=1 << 20)
    assert isinstance(runner, SimModelRunner) and runner.kind == "sim"
    a, b = [3, 7, 400, 401, 9, 10, 11], [50, 60]
    rows = runner.forward(
        [SequenceWork("a", tuple(a[:4]), (3,)), SequenceWork("b", tuple(b), (0, 1))]
    )
    full_a = loaded.model(torch.tensor([a])).logits[0]
    full_b = loaded.model(torch.tensor([b])).logits[0]
    assert torch.equal(rows, torch.stack([full_a[3], full_b[0], full_b[1]]))
    runner.forward([SequenceWork("a", (999, 998), (1,))])  # a block that will be rejected
    runner.truncate("a", 4)
    rows = runner.forward([SequenceWork("a", tuple(a[4:]), (0, 1, 2))])
    assert torch.equal(rows, full_a[4:7])
    assert runner.length("a") == 7
    runner.release("a")
    assert runner.length("a") == 0
    # A fork starts from the parent's first positions and goes on apart from it.
    runner.forward([SequenceWork("p", tuple(a), ())])
    runner.fork("p", "c", 3)
    rows = runner.forward([SequenceWork("c", (77, 78), (0, 1)), SequenceWork("p", (5,), (0,))])
    forked = loaded.model(torch.tensor([[*a[:3], 77, 78]])).logits[0]
    parent = loaded.model(torch.tensor([[*a, 5]])).logits[0]
    assert torch.equal(rows, torch.stack([forked[3], forked[4], parent[7]]))


def test_the_modelled_time_is_honoured() -> None:
    loaded = _model(f"sim://target/h100-8b?vocab={VOCAB}")
    now = [100.0]
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += seconds

    runner = SimModelRunner(
        loaded.model, num_blocks=64, block_size=16, sleep=sleep, clock=lambda: now[0]
    )
    profile = sim_source.PROFILES["h100-8b"]
    runner.forward([SequenceWork("a", tuple(range(10)), (9,))])
    runner.forward(
        [SequenceWork("a", (1, 2, 3), (0, 1, 2)), SequenceWork("b", (4,), (0,))]
    )  # 4 new tokens; "a" reads 13 KV entries, "b" one
    want = [profile.step_s(10, 10), profile.step_s(4, 14)]
    assert slept == pytest.approx(want)
    assert runner.device_s == pytest.approx(sum(want))
    assert want[0] == pytest.approx(6.3e-3 + 10 * 3e-5 + 10 * 4e-8)


def test_greedy_through_the_router_equals_the_sim_target_alone() -> None:
    local = build_local(resolve_pair("sim-instant", device="cpu"))
    prompt = list(local.tokenizer.encode("def add(a, b):", add_special_tokens=False))
    reference = _greedy(local.target.model, prompt, 40)
    # The default router's sessions run, so the instant drafter's blocks mostly come after the
    # verifier took those tokens alone; the lockstep router verifies every token from a posted
    # block, so there drafted tokens must have been accepted.
    lockstep = local_router(local.verifier, local.drafter, local.target, verifier_advances=False)
    for router in (local.router, lockstep):
        for k, pipelined in [(0, False), (1, False), (4, False), (4, True), (8, True)]:
            result = router.generate(
                GenerationRequest(tuple(prompt), 40, draft_tokens=k), pipelined=pipelined
            )
            assert list(result.tokens) == reference, (router.verifier_advances, k, pipelined)
            if k and router is lockstep:
                assert result.stats.num_accepted > 0
    assert local.tokenizer.decode(reference).startswith(" ")  # ids decode to words
    verifier, drafter = local.verifier.engine.stats(), local.drafter.engine.stats()
    assert verifier.runner == "sim" and verifier.device_s == 0.0  # the instant profile
    for engine in (verifier, drafter):
        assert engine.busy_s >= engine.forward_s + engine.batched_s > 0
    assert verifier.batched_s == 0  # greedy acceptance runs in each block's own task
    sampled = GenerationRequest(tuple(prompt), 8, sampling=SamplingParams(temperature=1.0))
    local.router.generate(sampled, pipelined=False)
    assert local.verifier.engine.stats().batched_s > 0  # sampled blocks: one batched call


def test_ideal_rates_follow_the_acceptance_model() -> None:
    target, draft = sim_source.PROFILES["h100-8b"], sim_source.PROFILES["a10g-0.5b"]
    rates = sim.ideal_rates(target, draft, alpha=0.8, k=4, context_tokens=0)
    assert rates.target_only == pytest.approx(1 / target.step_s(1, 0))
    assert rates.tokens_per_verify == pytest.approx((1 - 0.8**5) / 0.2)
    serial_s = 4 * draft.step_s(1, 0) + target.step_s(5, 0)
    assert rates.serial == pytest.approx(rates.tokens_per_verify / serial_s)
    assert rates.target_only < rates.serial < rates.pipelined
    assert sim.ideal_rates(target, draft, alpha=1.0, k=4).tokens_per_verify == 5
    batched = sim.ideal_rates(target, draft, alpha=0.8, k=0, streams=64, context_tokens=0)
    assert batched.target_only == pytest.approx(64 / target.step_s(64, 0))


# The hashing and row building as they were first written, one row at a time in plain integers:
# `sim.sim_logits` (in numpy arrays from `VECTOR_MIN_ROWS` rows on) must give the same rows, so
# that outputs recorded with the simulated models stay valid.
_MASK_62 = (1 << 62) - 1


def _reference_mix(x: int) -> int:
    x &= _MASK_62
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B) & _MASK_62
    x = ((x ^ (x >> 27)) * 0x94D049BB133111E) & _MASK_62
    return x ^ (x >> 31)


def _reference_key(seed: int, previous: int, current: int, position: int) -> int:
    x = _reference_mix(position * 0x9E3779B97F4A7C1 + seed)
    x = _reference_mix(x ^ ((previous + 2) * 0x632BE59BD9B4E01))
    return _reference_mix(x ^ ((current + 1) * 0x2545F4914F6CDD1))


def _reference_row(
    table: torch.Tensor, seed: int, context: tuple[int, int, int], alpha: float | None
) -> torch.Tensor:
    vocab = table.shape[1]
    words = vocab - sim_source.FIRST_WORD_ID
    key = _reference_key(seed, *context)
    row = table[key % sim.NUM_TAIL_ROWS].clone()
    favoured: dict[int, float] = {}  # the higher rank wins an id
    chained, top = key, -1
    for rank, value in enumerate(sim_source.FAVOURED):
        chained = _reference_mix(chained + 1)
        token = sim_source.FIRST_WORD_ID + chained % words
        favoured.setdefault(token, value)
        top = token if rank == 0 else top
    if alpha is not None and alpha < 1.0:
        draw = _reference_mix(key ^ sim.DRAFT_SALT)
        if (draw % (1 << 24)) / (1 << 24) >= alpha:
            offset = 1 + _reference_mix(draw) % (words - 1)
            other = sim_source.FIRST_WORD_ID + (top - sim_source.FIRST_WORD_ID + offset) % words
            favoured[other] = sim_source.FAVOURED[0] + 1.0
    for token, value in favoured.items():
        row[token] = value
    return row


def test_the_hash_over_arrays_gives_the_plain_integer_values() -> None:
    edges = [0, 1, (1 << 62) - 1, 1 << 62, (1 << 63) + 5, (1 << 64) - 1]
    values = edges + [random.Random(0).getrandbits(64) for _ in range(200)]
    mixed = sim._mix(np.array(values, dtype=np.uint64))
    assert mixed.tolist() == [_reference_mix(v) for v in values]
    assert [sim._mix(v) for v in values] == [_reference_mix(v) for v in values]


@pytest.mark.parametrize("vocab", [260, VOCAB, 32_000])
@pytest.mark.parametrize("alpha", [None, 0.0, 0.6, 1.0])
def test_rows_are_the_plain_integer_reference_at_any_batch(vocab: int, alpha: float | None) -> None:
    rng = random.Random(vocab)
    for seed in (0, 3, -7, (1 << 70) + 11):  # a seed is any integer; only 62 bits of it count
        table = sim.tail_table(vocab, seed % 1000)
        for rows in (1, sim.VECTOR_MIN_ROWS - 1, sim.VECTOR_MIN_ROWS, 97):
            contexts = [
                (rng.choice([-1, rng.randrange(vocab)]), rng.randrange(vocab),
                 rng.choice([0, rng.randrange(1 << 20), rng.getrandbits(48)]))
                for _ in range(rows)
            ]  # fmt: skip
            got = sim.sim_logits(table, seed, *zip(*contexts, strict=True), alpha)
            reference = torch.from_numpy(table)
            want = torch.stack([_reference_row(reference, seed, c, alpha) for c in contexts])
            assert torch.equal(got, want), (seed, rows)


def test_the_background_is_the_seeded_normal_table() -> None:
    # The table is what it always was (with the hashing, recorded outputs stay valid); a
    # smaller vocabulary holds less background mass, so its top token holds more.
    generator = torch.Generator().manual_seed(5)
    first = torch.randn(sim.NUM_TAIL_ROWS, 4_096, generator=generator) - 8.0
    first[:, sim_source.END_OF_TEXT_ID] = sim.END_OF_TEXT_LOGIT
    assert torch.equal(torch.from_numpy(sim.tail_table(4_096, 5)), first)
    shares = []
    for vocab in (4_096, 32_000):
        positions = list(range(2_000))
        rows = sim.sim_logits(sim.tail_table(vocab, 0), 0, [7] * 2_000, [300] * 2_000, positions)
        shares.append(float(rows.softmax(-1).max(-1).values.mean()))
    assert shares[0] == pytest.approx(0.65, abs=0.01)
    assert shares[1] == pytest.approx(0.55, abs=0.01)
