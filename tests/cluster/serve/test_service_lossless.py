"""Sampling through the service as `tandem serve` configures it follows the target alone.

`test_lossless_sampling.py` checks the acceptance rule in process, with fixed blocks. This test
takes a user's request's path with the service's defaults: the router ingress that
`RouterIngress` builds from a default `TandemConfig` (adaptive draft length, prompt lookup,
pipelining and the speculation gate on; one tenant added), over a drafter and a verifier
replica of the tiny pair (fp32) behind their own gRPC servers, listed as the registry lists
them. Requests go through `RouterIngress.Generate`, the method Serve's gRPC proxy calls; only
Serve's proxy and placement, which never see a token, are left out. They go one at a time: the
gate then stays open by design (run four at a time, it finds the target alone faster for these
three-token requests and stops speculating after its first epoch). Pipelining is on, but no
round within three tokens drafts ahead (the opening round never does, and the next block fills
the room left), so `test_lossless_sampling.py` alone covers that path.

The router's rounds run in lockstep (its `verifier_advances` option off): each token here is
decided by a posted block or the target's own pass, as the test needs. With the default option
the verifier advances a session by itself while a block is in flight, and a block then decides
tokens only after the token it guessed came out as the target's own sample; on the tiny pair
at temperature 1 that is rare within three tokens, so the sample would test almost nothing.
The exactness of a block verified from where a running session stands is shown by
`tests/verifier/test_running_sessions.py` and the routers' greedy and seed-exact tests.

The verifier replica waits VERIFY_DELAY_S in each engine step. The verifier advances a
running session by itself whenever no block has come for its next step, so a block decides
tokens only where it arrives within a step; and on the tiny pair a verify pass costs about as
much as a draft, so the adaptive plan soon stops speculating (and with it prompt lookup), and a
sample of the target alone would prove nothing. The wait makes the target dearer than its
draft, as it is where speculation pays. PROMPT repeats itself, so prompt lookup proposes the
opening block; when the target rejects it, the draft model proposes the next. The test asserts
that both proposed tokens in most requests (MIN_PROPOSED), and that some were accepted and some
rejected. With three CPU-bound processes beside it on 2 cores, the plan stopped drafting here
(the draft latency it inherits from request to request stays high while nothing is drafted),
and the test fails there rather than pass on a sample of the target alone.

The service runs four times (RUNS). `seed-exact`: the requests as sent, seeded, so under the
seed-exact rule, a seeded request's default; its output is the target's own draw whatever was
drafted, so this run shows the path serves the target's distribution, not that acceptance is
right. `rejection`: the same requests asking for the rejection rule, which reads each block's q:
this is the run that tests acceptance, and it asserts that most requests had a verified block
decide a token (MIN_PROPOSED). `wrong-q`, the negative control: the same, but every block the
draft model proposes carries a wrong q (`wrong_q`: each row's probabilities rolled by one over
its tokens), and the
test asserts that the sample fails (p-value below ALPHA); it shows that the other runs' test
can fail through this service at this size.

A fourth run (`predrafting`) takes the same path with outcome-keyed pre-drafting on
(`api.default_predraft_fan_out` 4) and Saguaro-style sampling on the drafter
(`saguaro_scale` 0.5), in fixed rounds (the adaptive plan could price pre-drafting out on a
busy machine), under rejection sampling, PREDRAFT_TOKENS long with one-token blocks:
after the opening round, each verify pass runs beside the drafter's branches and a hit
branch's block (with its q, over the wire) is verified next, deciding the third token
whenever the round before it committed one. It asserts that most requests hit.

Statistic: the exact joint distribution of the first three tokens,
P(t1, t2, t3) = p(t1 | prompt) p(t2 | prompt, t1) p(t3 | prompt, t1, t2), from the target's own
probabilities at temperature 1 (in process), against NUM_REQUESTS seeded requests by Pearson's
chi-square test. Cells are named by prefixes (`target_cells`): every triple, pair and first
token whose expected count is at least MIN_EXPECTED, each holding what its longer names do not,
and `()` the rest, so every cell's expected count is at least MIN_EXPECTED and the chi-square
approximation is sound. Under a lossless sampler the p-value is (asymptotically) uniform, so a
correct service fails with probability ALPHA = 1e-3. The seeds are fixed, but the plan follows
measured times, so reruns differ.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import pytest

import cluster.serve.ingress
from cluster.api.tenants import AuthConfig, TenantConfig, hash_api_key, new_api_key
from cluster.config import FrontConfig, TandemConfig
from cluster.runtime.draft_block import DraftBlock
from cluster.runtime.models import LoadedModel, load_model
from cluster.runtime.sampling_params import SamplingParams
from cluster.runtime.sparse_distribution import SparseDistribution
from cluster.serve.ingress import RouterIngress
from cluster.wire.replica_info import ReplicaInfo
from drafter.drafter import Drafter
from protos import generate_pb2, sampling_pb2
from tests.exact_cells import chi_square_p_value, target_cells
from tests.replicas import serve_drafter, serve_verifier
from verifier.verifier import Verifier

pytestmark = pytest.mark.slow

ALPHA = 1e-3
NUM_REQUESTS = 800
MIN_EXPECTED = 5.0
NUM_TOKENS = 3
PROMPT = "abcabcabc"
"""Its last two bytes recur, so prompt lookup proposes the opening block ("ab")."""
SAMPLING = SamplingParams(temperature=1.0)
VERIFY_DELAY_S = 0.03
"""A verify pass then takes about 36 ms here and a drafted token 4 to 8 ms; the plan drafts
while a token costs less than about 0.6 of a pass (its acceptance estimate after a rejection)."""
MIN_PROPOSED = NUM_REQUESTS // 2
"""Fewest tokens each proposer must have drafted: about 2 are looked up and 1 drafted a request
when the plan speculates, so the sample tests acceptance in at least half the requests."""
KEY = new_api_key()


class Context:
    """What the ingress uses of Serve's gRPC context: the caller's metadata, and setters for
    a failed call's status (the ingress then raises the error itself)."""

    def invocation_metadata(self) -> list[tuple[str, str]]:
        return [("authorization", f"Bearer {KEY}")]

    def set_code(self, code: Any) -> None:
        pass

    def set_details(self, details: str) -> None:
        pass

    def set_trailing_metadata(self, metadata: Any) -> None:
        pass


PREDRAFT_TOKENS = 6
"""A pre-drafting request's length: the opening round, then a one-token block whose verify
pass runs beside its branches, then the hit branch's; the first NUM_TOKENS are tested."""


RUNS = ["seed-exact", "rejection", "wrong-q", "predrafting"]
"""The service's runs (see the module's docstring): the default path as a seeded request takes
it (the seed-exact rule) and under the rejection rule; the negative control, the rejection
rule with each drafted block carrying a wrong q; pre-drafting."""


@dataclass
class Served:
    ingress: RouterIngress
    target: LoadedModel
    model_drafted: list[int]
    """Tokens the draft model proposed (one count); the other drafted tokens were looked up."""
    run: str
    """One of RUNS."""

    @property
    def predrafting(self) -> bool:
        """Requests pre-draft (with Saguaro-style sampling on the drafter) under rejection
        sampling, PREDRAFT_TOKENS long with one-token blocks, so that pre-drafted blocks decide
        some of the first tokens."""
        return self.run == "predrafting"

    @property
    def rejection(self) -> bool:
        """Requests ask for the rejection rule (a seeded request's default is seed-exact)."""
        return self.run != "seed-exact"


def wrong_q(block: DraftBlock) -> DraftBlock:
    """The drafted block with a wrong q that still passes the verifier's checks: each row's
    probabilities rolled by one over its tokens, so the drafted token keeps a probability, but
    another token's. (A row from another block is refused outright where it gives the drafted
    token none: INVALID_ARGUMENT, "the drafter could not have sampled it".)"""
    if block.draft_probs is None:
        return block
    rows = [SparseDistribution(row.token_ids, row.probs.roll(1)) for row in block.draft_probs]
    return dataclasses.replace(block, draft_probs=tuple(rows))


@pytest.fixture(scope="module", params=RUNS)
def served(request: pytest.FixtureRequest) -> Iterator[Served]:
    tenant = TenantConfig("main", hash_api_key(KEY))
    # No front: requests go to the ingress's methods, not to servers on the default ports.
    no_front = FrontConfig(grpc_port=None, http_port=None)
    config = TandemConfig(auth=AuthConfig(tenants=(tenant,)), front=no_front).with_cluster_secret()
    predrafting = request.param == "predrafting"
    if predrafting:  # the default path, with pre-drafting and Saguaro-style sampling turned on
        config = dataclasses.replace(
            config,
            api=dataclasses.replace(config.api, default_predraft_fan_out=4),
            drafter_limits=dataclasses.replace(config.drafter_limits, saguaro_scale=0.5),
            # Fixed rounds: every pipelined round pre-drafts. The adaptive plan prices
            # pre-drafting from measured times, and on a CI machine busy with other tests it
            # may price it out (0 rounds pre-drafted), leaving nothing of this path to test.
            draft_length=dataclasses.replace(config.draft_length, enabled=False),
        )
    pair = config.pair()
    target, draft = load_model(pair.target), load_model(pair.draft)
    verifier = Verifier(target, config.verifier_limits)
    drafter = Drafter(draft, config.drafter_limits)
    # Every verifier step waits VERIFY_DELAY_S (the engine's forward pass, which the running
    # sessions' steps and posted blocks alike go through); the draft model's proposals are
    # counted where the replica's server reaches the drafter.
    runner = verifier._engine.runner
    forward, draft_block = runner.forward, drafter.submit_draft
    model_drafted = [0]

    def slow_forward(*args: Any, **kwargs: Any) -> Any:
        time.sleep(VERIFY_DELAY_S)
        return forward(*args, **kwargs)

    def counted_draft(*args: Any, **kwargs: Any) -> Future[DraftBlock]:
        def count(done: Future[DraftBlock]) -> None:
            if done.exception() is None:
                model_drafted[0] += len(done.result().tokens)

        future = draft_block(*args, **kwargs)
        future.add_done_callback(count)
        if request.param != "wrong-q":
            return future
        corrupted: Future[DraftBlock] = Future()
        future.add_done_callback(lambda done: corrupted.set_result(wrong_q(done.result())))
        return corrupted

    verifier_server, verifier_port = serve_verifier(verifier, secret=config.cluster_secret)
    drafter_server, drafter_port = serve_drafter(drafter, secret=config.cluster_secret)
    entries = [
        ReplicaInfo("verifier-0", "verifier", f"127.0.0.1:{verifier_port}", 0, 0).to_dict(),
        ReplicaInfo("drafter-0", "drafter", f"127.0.0.1:{drafter_port}", 0, 0).to_dict(),
    ]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(runner, "forward", slow_forward)
        patch.setattr(drafter, "submit_draft", counted_draft)
        # The registry actor's listing, without Ray: both replicas, always live.
        patch.setattr(cluster.serve.ingress, "get_registry", lambda app_name: None)
        patch.setattr(cluster.serve.ingress, "from_registry_actor", lambda actor: lambda: entries)
        served = Served(RouterIngress(config), target, model_drafted, request.param)
        # Lockstep rounds (see the module's docstring): a running session takes the target's
        # own token while a block is in flight, so a draft would decide none of the first
        # NUM_TOKENS tokens but where its first token guessed the target's own sample.
        patch.setattr(served.ingress._router, "verifier_advances", False)
        try:
            yield served
        finally:
            # RouterIngress has no close (Serve ends its process): stop what it started.
            served.ingress._router.close()
            served.ingress._pool.close()
            verifier_server.stop(None)
            drafter_server.stop(None)
            verifier.close()
            drafter.close()


async def sample(served: Served) -> list[generate_pb2.GenerateResponse]:
    """NUM_REQUESTS responses for PROMPT, seeds 0..NUM_REQUESTS-1, one after another."""
    responses = []
    for seed in range(NUM_REQUESTS):
        request = generate_pb2.GenerateRequest(
            text=PROMPT,
            max_tokens=PREDRAFT_TOKENS if served.predrafting else NUM_TOKENS,
            seed=seed,
            sampling=sampling_pb2.SamplingParams(temperature=SAMPLING.temperature),
        )
        if served.rejection:
            # The rule that reads the q a block carries over the wire (a pre-drafted branch's
            # Saguaro-style q' included). A seeded request's default, seed-exact, accepts by
            # equality: its output is the target's own draw whatever was drafted, so a wrong q
            # cannot show there.
            request.sampling.rule = sampling_pb2.SAMPLING_RULE_REJECTION
        if served.predrafting:
            request.speculation.draft_tokens = 1
        responses.append(await served.ingress.Generate(request, Context()))
    return responses


def test_the_first_tokens_through_the_default_service_follow_the_target(served: Served) -> None:
    prompt = tuple(served.target.tokenizer.encode(PROMPT, add_special_tokens=False))
    cells = target_cells(served.target, prompt, SAMPLING, NUM_TOKENS, NUM_REQUESTS, MIN_EXPECTED)
    responses = asyncio.run(sample(served))
    samples = [tuple(r.token_ids[:NUM_TOKENS]) for r in responses]
    assert all(len(tokens) == NUM_TOKENS for tokens in samples)
    drafted = sum(r.speculation.num_drafted for r in responses)
    accepted = sum(r.speculation.num_accepted for r in responses)
    model_drafted = served.model_drafted[0]
    p_value = chi_square_p_value(samples, cells, MIN_EXPECTED)
    print(
        f"\n{len(cells)} cells, p-value {p_value:.3g}; drafted {drafted} (looked up "
        f"{drafted - model_drafted}, by the draft model {model_drafted}), accepted {accepted}"
    )
    # The sample tests acceptance only where tokens were proposed.
    assert 0 < accepted < drafted
    # Samples a verified block decided (a drafted token accepted, or the target's resample
    # where one was rejected): every request whose block was verified within its NUM_TOKENS
    # (pre-drafting's longer requests: see its hits below).
    decided = sum(1 for r in responses if r.speculation.num_drafted > 0)
    print(f"requests with a verified block: {decided}")
    if served.predrafting:
        # Pre-drafted rounds happened, hit and missed: a hit's block (drawn with its q, damped
        # by Saguaro-style sampling) is verified next, and decides the third token whenever the
        # round before committed one.
        hits = sum(r.speculation.predraft_hits for r in responses)
        misses = sum(r.speculation.predraft_misses for r in responses)
        print(f"pre-drafted rounds: {hits} hits, {misses} misses")
        assert hits >= MIN_PROPOSED // 2 and misses > 0
    else:
        assert min(drafted - model_drafted, model_drafted) >= MIN_PROPOSED
        assert decided >= MIN_PROPOSED
    if served.run == "wrong-q":
        # The negative control: the acceptance test and the residual read a q that did not
        # draw the token, and the sample departs from the target's distribution.
        assert p_value < ALPHA, "a q from the wrong block passed the lossless test"
    else:
        assert p_value > ALPHA
