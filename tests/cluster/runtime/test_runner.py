"""Model runners: logits equal a plain full forward, whatever the batch, rollback and chunking.

Every exactness test runs on both runners. The reference is a separate, freshly built tiny target
(same seed, same weights, default attention, no cache) run on each sequence's whole history; the
runner gets a model object of its own, since the paged runner switches its attention for good.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from cluster.runtime import kv_pool, tiny
from cluster.runtime import runner as runner_module
from cluster.runtime.block_runner import ModelRunner, PoolExhaustedError, SequenceWork
from cluster.runtime.errors import InvalidArgumentError, ResourceExhaustedError
from cluster.runtime.kv_pool import kv_bytes_per_token, pool_blocks
from cluster.runtime.models import LoadedModel
from cluster.runtime.paged_attention import ATTENTION_NAME
from cluster.runtime.runner import PagedModelRunner, SerialModelRunner, build_runner, split_rows

ATOL = 2e-5  # fp32: a batched or cached forward differs from a full one by summation order

RUNNERS: dict[str, type[PagedModelRunner] | type[SerialModelRunner]] = {
    "paged": PagedModelRunner,
    "serial": SerialModelRunner,
}
MakeRunner = Callable[..., ModelRunner]


def stream(seed: int, length: int = 80) -> list[int]:
    """A deterministic token sequence, different per seed."""
    return [(i * (31 + 2 * seed) + 7 * seed + 3) % tiny.VOCAB_SIZE for i in range(length)]


@pytest.fixture(scope="module")
def reference() -> Qwen2ForCausalLM:
    return tiny.build_target()


@pytest.fixture(params=sorted(RUNNERS))
def make_runner(request: pytest.FixtureRequest) -> MakeRunner:
    def make(num_blocks: int = 64, block_size: int = 4) -> ModelRunner:
        cls = RUNNERS[request.param]
        return cls(tiny.build_target(), num_blocks=num_blocks, block_size=block_size)

    return make


class Checked:
    """A runner plus each sequence's token history: every step's rows are checked against a
    full forward of the reference model over that history."""

    def __init__(self, runner: ModelRunner, reference: Qwen2ForCausalLM) -> None:
        self.runner = runner
        self.reference = reference
        self.history: dict[str, list[int]] = {}

    def step(self, batch: Sequence[SequenceWork]) -> list[torch.Tensor]:
        logits = self.runner.forward(batch)
        assert logits.dtype == torch.float32
        assert logits.shape == (sum(len(w.logits_at) for w in batch), self.runner.vocab_size)
        rows = split_rows(batch, logits)
        for work, got in zip(batch, rows, strict=True):
            past = self.history.setdefault(work.seq_id, [])
            full = past + list(work.tokens)
            assert self.runner.length(work.seq_id) == len(full)
            if work.logits_at:
                with torch.inference_mode():
                    want = self.reference(torch.tensor([full])).logits[0]
                positions = [len(past) + i for i in work.logits_at]
                torch.testing.assert_close(got, want[positions], atol=ATOL, rtol=0)
            self.history[work.seq_id] = full
        return rows

    def truncate(self, seq_id: str, length: int) -> None:
        self.runner.truncate(seq_id, length)
        del self.history[seq_id][length:]
        assert self.runner.length(seq_id) == length

    def fork(self, parent: str, child: str, length: int) -> None:
        self.runner.fork(parent, child, length)
        self.history[child] = self.history[parent][:length]
        assert self.runner.length(child) == length


def work(
    seq_id: str, tokens: Sequence[int], logits_at: Sequence[int] | None = None
) -> SequenceWork:
    at = range(len(tokens)) if logits_at is None else logits_at
    return SequenceWork(seq_id, tuple(tokens), tuple(at))


def test_prefill_verify_decode(make_runner: MakeRunner, reference: Qwen2ForCausalLM) -> None:
    checked = Checked(make_runner(), reference)
    a = stream(1)
    checked.step([work("a", a[:11], [10])])  # prefill: logits at the last token
    checked.step([work("a", a[11:16])])  # a verify block: logits everywhere
    checked.step([work("a", a[16:17])])  # decode
    checked.step([work("a", a[17:18], [0])])
    assert checked.runner.length("a") == 18


def test_rollback_then_regrow(make_runner: MakeRunner, reference: Qwen2ForCausalLM) -> None:
    runner = make_runner(num_blocks=16, block_size=4)
    checked = Checked(runner, reference)
    a, b = stream(2), stream(3)
    checked.step([work("a", a[:12], [11]), work("b", b[:15], [14])])
    assert runner.num_free_blocks == 16 - 3 - 4
    checked.truncate("b", 13)  # 15 -> 13: still 4 blocks
    assert runner.num_free_blocks == 9
    checked.truncate("a", 7)  # 12 -> 7: one block freed
    assert runner.num_free_blocks == 10
    # Regrow with different tokens than before: the stale K/V must not leak in.
    checked.step([work("a", b[40:46]), work("b", a[50:53])])
    checked.truncate("a", 0)
    checked.step([work("a", a[:5])])
    with pytest.raises(InvalidArgumentError):
        runner.truncate("a", 6)
    with pytest.raises(InvalidArgumentError):
        runner.truncate("a", -1)
    runner.release("a")
    runner.release("b")
    runner.release("never-seen")
    assert runner.num_free_blocks == 16
    assert runner.length("a") == 0


def test_mixed_step(make_runner: MakeRunner, reference: Qwen2ForCausalLM) -> None:
    checked = Checked(make_runner(), reference)
    long, dec, ver, new = stream(4), stream(5), stream(6), stream(7)
    checked.step([work("long", long[:9], []), work("dec", dec[:6], [5]), work("ver", ver[:8], [7])])
    # One forward: a middle prefill chunk (no logits), a decode, a verify block, a new prefill.
    checked.step(
        [
            work("long", long[9:20], []),
            work("dec", dec[6:7]),
            work("ver", ver[8:13]),
            work("new", new[:10], [9]),
        ]
    )
    # The final chunk of the long prefill, logits at its end, next to decodes.
    checked.step([work("long", long[20:27], [6]), work("dec", dec[7:8]), work("new", new[10:11])])
    # Logits at chosen (not all, not last) positions of a block.
    checked.step([work("ver", ver[13:18], [0, 2, 3]), work("long", long[27:30], [1])])


def test_a_step_of_only_middle_chunks_returns_no_rows(make_runner: MakeRunner) -> None:
    runner = make_runner()
    logits = runner.forward([work("a", stream(1)[:9], []), work("b", stream(2)[:3], [])])
    assert logits.shape == (0, runner.vocab_size)
    assert (runner.length("a"), runner.length("b")) == (9, 3)
    assert runner.forward([]).shape == (0, runner.vocab_size)


@pytest.mark.parametrize("num_sequences", [1, 2, 7, 16])
def test_many_sequences_of_different_lengths(
    make_runner: MakeRunner, reference: Qwen2ForCausalLM, num_sequences: int
) -> None:
    checked = Checked(make_runner(num_blocks=256), reference)
    seqs = {f"s{i}": stream(i) for i in range(num_sequences)}
    prompt_lengths = {s: 1 + (5 * i) % 17 for i, s in enumerate(seqs)}
    checked.step([work(s, t[: prompt_lengths[s]], [prompt_lengths[s] - 1])
                  for s, t in seqs.items()])  # fmt: skip
    # Then verify blocks of 1..5 tokens, different per sequence.
    steps = []
    for i, (s, t) in enumerate(seqs.items()):
        start = prompt_lengths[s]
        steps.append(work(s, t[start : start + 1 + i % 5]))
    checked.step(steps)


def test_greedy_decode_equals_generate(
    make_runner: MakeRunner, reference: Qwen2ForCausalLM
) -> None:
    runner = make_runner(num_blocks=256, block_size=8)
    new_tokens = 12
    prompts = {f"p{i}": stream(i + 20)[: 1 + 3 * i] for i in range(16)}
    expected = {}
    for seq_id, prompt in prompts.items():
        with torch.inference_mode():
            out = reference.generate(  # type: ignore[misc]  # transformers' self-typed mixin
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=new_tokens,
                do_sample=False,
            )
        expected[seq_id] = out[0, len(prompt) :].tolist()
    logits = runner.forward([work(s, p, [len(p) - 1]) for s, p in prompts.items()])
    generated = {s: [int(row.argmax())] for s, row in zip(prompts, logits, strict=True)}
    for _ in range(new_tokens - 1):
        logits = runner.forward([work(s, g[-1:]) for s, g in generated.items()])
        for seq_id, row in zip(generated, logits, strict=True):
            generated[seq_id].append(int(row.argmax()))
    for seq_id, tokens in generated.items():
        if tiny.END_OF_TEXT_ID in tokens:  # generate stops at the end-of-text token
            tokens = tokens[: tokens.index(tiny.END_OF_TEXT_ID) + 1]
        assert tokens == expected[seq_id], seq_id


def test_exhausted_pool_raises_with_nothing_changed(
    make_runner: MakeRunner, reference: Qwen2ForCausalLM
) -> None:
    runner = make_runner(num_blocks=5, block_size=4)
    checked = Checked(runner, reference)
    a, b = stream(1), stream(2)
    checked.step([work("a", a[:10], [9])])  # 3 blocks
    with pytest.raises(PoolExhaustedError) as raised:
        runner.forward([work("a", a[10:13]), work("b", b[:9], [8])])  # needs 1 + 3, 2 free
    assert isinstance(raised.value, ResourceExhaustedError)
    assert raised.value.status == "RESOURCE_EXHAUSTED"
    assert (runner.length("a"), runner.length("b"), runner.num_free_blocks) == (10, 0, 2)
    assert runner.blocks_needed("b", 9) == 3
    checked.step([work("a", a[10:13]), work("b", b[:4], [3])])  # what fits still runs exactly
    assert runner.num_free_blocks == 0


def test_a_failed_model_call_changes_nothing(
    make_runner: MakeRunner, reference: Qwen2ForCausalLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = make_runner(num_blocks=16, block_size=4)
    checked = Checked(runner, reference)
    a = stream(3)
    checked.step([work("a", a[:6], [5])])
    model = runner.model  # type: ignore[attr-defined]

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("device lost")

    with monkeypatch.context() as patch:
        patch.setattr(model.model.layers[2], "forward", broken)  # fails mid-model
        with pytest.raises(RuntimeError, match="device lost"):
            runner.forward([work("a", a[6:12]), work("new", a[:5])])
    assert (runner.length("a"), runner.length("new"), runner.num_free_blocks) == (6, 0, 14)
    checked.step([work("a", a[6:12]), work("new", a[:5])])


def test_bad_steps_are_invalid_arguments(make_runner: MakeRunner) -> None:
    runner = make_runner()
    bad = [
        [work("a", [1]), work("a", [2])],  # two items for one sequence
        [SequenceWork("a", (), ())],
        [work("a", [1, 2], [2])],
        [work("a", [1, 2], [1, 0])],
        [work("a", [1, 2], [-1])],
        [work("a", [tiny.VOCAB_SIZE])],
    ]
    for batch in bad:
        with pytest.raises(InvalidArgumentError):
            runner.forward(batch)
    assert runner.num_free_blocks == 64
    assert runner.length("a") == 0


def test_a_paged_model_still_serves_plain_calls_exactly() -> None:
    # One loaded model backs a runner and plain calls (generate, a reference forward) at once.
    model, fresh = tiny.build_target(), tiny.build_target()
    runner = PagedModelRunner(model, num_blocks=8)
    runner.forward([SequenceWork("s", (1, 2, 3, 4, 5), (4,))])
    prompt = torch.tensor([[5, 9, 33, 7, 1, 2]])
    with torch.inference_mode():
        torch.testing.assert_close(model(prompt).logits, fresh(prompt).logits, atol=2e-5, rtol=0)
        mask = torch.ones_like(prompt)
        generated = model.generate(prompt, attention_mask=mask, max_new_tokens=8, do_sample=False)
        expected = fresh.generate(prompt, attention_mask=mask, max_new_tokens=8, do_sample=False)
    assert generated.tolist() == expected.tolist()
    with pytest.raises(InvalidArgumentError):
        SerialModelRunner(model, num_blocks=4)


def loaded(model: Qwen2ForCausalLM) -> LoadedModel:
    return LoadedModel(model=model, tokenizer=tiny.build_tokenizer(), device=torch.device("cpu"))


class RefusingQwen2(Qwen2ForCausalLM):
    """Stands for a model that cannot switch its attention function (remote code, Mamba...)."""

    @classmethod
    def _can_set_attn_implementation(cls) -> bool:
        return False


def test_build_runner_picks_paged_for_the_tiny_model(reference: Qwen2ForCausalLM) -> None:
    model = loaded(tiny.build_target())
    runner = build_runner(model, kv_cache_bytes=1 << 20, max_sequence_tokens=64)
    assert runner.kind == "paged"
    assert model.model.config._attn_implementation == ATTENTION_NAME
    assert runner.num_free_blocks == runner.num_blocks  # the self-test left nothing behind
    Checked(runner, reference).step([work("a", stream(1)[:20])])
    for block_size in (1, 2, 5):  # the self-test fits any block size
        assert runner_module.paged_self_test(tiny.build_target(), block_size) is None


def test_a_model_that_refuses_the_switch_gets_the_serial_runner(
    reference: Qwen2ForCausalLM,
) -> None:
    base = tiny.build_target()
    model = RefusingQwen2(copy.deepcopy(base.config)).eval()
    model.load_state_dict(base.state_dict())
    runner = build_runner(loaded(model), kv_cache_bytes=1 << 20, max_sequence_tokens=64)
    assert runner.kind == "serial"
    assert model.config._attn_implementation == "sdpa"
    Checked(runner, reference).step([work("a", stream(1)[:20])])


def test_a_failed_self_test_gets_the_serial_runner_and_restores_attention(
    monkeypatch: pytest.MonkeyPatch, reference: Qwen2ForCausalLM
) -> None:
    model = tiny.build_target()
    original = runner_module.paged_self_test
    monkeypatch.setattr(runner_module, "_SELF_TEST_TOLERANCE", {torch.float32: -1.0})
    assert original(model, 16) is not None  # an impossible tolerance fails the real self-test
    assert model.config._attn_implementation == "sdpa"
    monkeypatch.setattr(runner_module, "paged_self_test", lambda model, block_size: "broken")
    runner = build_runner(loaded(model), kv_cache_bytes=1 << 20, max_sequence_tokens=64)
    assert runner.kind == "serial"
    Checked(runner, reference).step([work("a", stream(1)[:20])])


def test_pool_sizing(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny.build_target()
    block_bytes = kv_bytes_per_token(model) * 16

    def size(**overrides: int | float | None) -> int:
        args: dict[str, object] = {"kv_cache_bytes": 0, "kv_cache_fraction": 0.2,
                                   "max_tokens_needed": None, "max_sequence_tokens": 64,
                                   "block_size": 16}  # fmt: skip
        args.update(overrides)
        return pool_blocks(model, **args)  # type: ignore[arg-type]

    assert size(kv_cache_bytes=100 * block_bytes + 5) == 100
    assert size(kv_cache_bytes=100 * block_bytes, max_tokens_needed=320) == 20  # the cap
    assert size(kv_cache_bytes=100 * block_bytes, max_tokens_needed=321) == 21
    assert size(kv_cache_bytes=block_bytes, max_sequence_tokens=160) == 10  # one long sequence
    assert size(kv_cache_bytes=block_bytes, max_sequence_tokens=None) == 4096 // 16  # model's
    monkeypatch.setattr(kv_pool, "free_memory_bytes", lambda device: 1000 * block_bytes)
    assert size(kv_cache_fraction=0.25) == 250
    for bad in ({"kv_cache_bytes": -1}, {"kv_cache_fraction": 0.0}, {"block_size": 0}):
        with pytest.raises(InvalidArgumentError):
            size(**bad)
    built = build_runner(loaded(model), kv_cache_bytes=30 * block_bytes, max_sequence_tokens=64)
    assert built.num_blocks == 30
    assert built.pool.key.shape[1] == 30 * 16  # type: ignore[attr-defined]


def test_free_memory_is_measured_on_the_cpu() -> None:
    assert kv_pool.free_memory_bytes(torch.device("cpu")) > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", sorted(RUNNERS))
def test_runners_on_cuda(kind: str) -> None:
    device = torch.device("cuda")
    reference, model = tiny.build_target(), tiny.build_target()
    for each in (reference, model):
        torch.nn.Module.to(each, device)  # transformers' decorated `to` is opaque to mypy
    runner = RUNNERS[kind](model, num_blocks=64, block_size=4)
    a, b = stream(1), stream(2)
    runner.forward([work("a", a[:9], [8])])
    logits = runner.forward([work("a", a[9:14]), work("b", b[:7], [6])])
    assert logits.device.type == "cuda"
    with torch.inference_mode():
        want_a = reference(torch.tensor([a[:14]], device=device)).logits[0, 9:14]
        want_b = reference(torch.tensor([b[:7]], device=device)).logits[0, 6:7]
    torch.testing.assert_close(logits, torch.cat([want_a, want_b]), atol=1e-4, rtol=0)


def test_sliding_window_layers_match_a_full_forward() -> None:
    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True,
                         sliding_window=3, max_window_layers=1)  # fmt: skip
    assert config.layer_types == ["full_attention", "sliding_attention"]
    torch.manual_seed(0)
    window_reference = Qwen2ForCausalLM(config).eval()
    # A config object of its own: switching attention writes to the config.
    model = Qwen2ForCausalLM(copy.deepcopy(config)).eval()
    model.load_state_dict(window_reference.state_dict())
    checked = Checked(PagedModelRunner(model, num_blocks=16, block_size=4), window_reference)
    tokens = [(i * 5 + 1) % 64 for i in range(20)]
    checked.step([work("a", tokens[:9]), work("b", tokens[3:5])])
    checked.step([work("a", tokens[9:14]), work("b", tokens[5:6])])


@pytest.mark.parametrize("at", [0, 5, 8, 13])
def test_a_forked_sequence_goes_on_apart_from_its_parent(
    make_runner: MakeRunner, reference: Qwen2ForCausalLM, at: int
) -> None:
    """A fork (the branches of a draft) holds a copy of its parent's first positions: both
    then extend apart, in one step or alone, and the child outlives its parent's blocks
    being reused by another sequence."""
    checked = Checked(make_runner(num_blocks=64, block_size=4), reference)
    checked.step([work("p", stream(1, 13))])
    checked.fork("p", "c", at)
    checked.step([work("p", stream(2, 5)), work("c", stream(3, 6))])
    checked.step([work("c", stream(4, 3), [2])])
    checked.runner.release("p")
    checked.step([work("q", stream(5, 24), [23])])  # takes the parent's blocks
    checked.step([work("c", stream(6, 2))])


def test_a_fork_that_does_not_fit_or_is_malformed_changes_nothing(make_runner: MakeRunner) -> None:
    runner = make_runner(num_blocks=6, block_size=4)
    runner.forward([work("p", stream(1, 13), [])])  # 4 blocks of 6
    with pytest.raises(PoolExhaustedError):
        runner.fork("p", "c", 12)  # 3 more blocks, 2 free
    assert runner.sequences() == ("p",) and runner.num_free_blocks == 2
    for child, length in (("p", 4), ("c", 14), ("c", -1)):
        with pytest.raises(InvalidArgumentError):
            runner.fork("p", child, length)
    assert runner.sequences() == ("p",) and runner.num_free_blocks == 2
    runner.fork("p", "c", 8)
    assert runner.num_free_blocks == 0 and runner.length("c") == 8
