"""A simulated pair behind real replica gRPC servers: the router's greedy output over the wire
equals the sim target alone, for target-only, serial and pipelined rounds, and the replicas'
engine counters (read over Stats) show the modelled device time."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from cluster.local import text_decoder
from cluster.presets import resolve_pair
from cluster.routing.grpc_drafter import GrpcDrafter
from cluster.routing.grpc_verifier import GrpcVerifier
from cluster.routing.request import GenerationRequest
from cluster.routing.router import Router
from cluster.runtime.models import load_model
from cluster.runtime.sim_source import PROFILES
from drafter.drafter import Drafter
from tests.replicas import serve_drafter, serve_verifier
from verifier.verifier import Verifier


def test_greedy_over_grpc_equals_the_sim_target_alone() -> None:
    pair = resolve_pair("sim-h100-8b", device="cpu")
    target, draft = load_model(pair.target), load_model(pair.draft)
    drafter_server, drafter_port = serve_drafter(Drafter(draft))
    verifier_server, verifier_port = serve_verifier(Verifier(target))
    try:
        with (
            GrpcDrafter(f"127.0.0.1:{drafter_port}", timeout_s=30.0) as drafter,
            GrpcVerifier(f"127.0.0.1:{verifier_port}", timeout_s=30.0) as verifier,
        ):
            router = Router(verifier, drafter, text_decoder(target.tokenizer), target.eos_token_ids)
            prompt = tuple(target.tokenizer.encode("def add(a, b):", add_special_tokens=False))
            ids = list(prompt)
            for _ in range(24):  # the sim target alone: a full forward per token
                ids.append(int(target.model(torch.tensor([ids])).logits[0, -1].argmax()))
            before = verifier.stats().engine
            for k, pipelined in [(0, False), (4, False), (4, True)]:
                result = router.generate(
                    GenerationRequest(prompt, 24, draft_tokens=k), pipelined=pipelined
                )
                assert list(result.tokens) == ids[len(prompt) :], (k, pipelined)
            after = verifier.stats().engine
            router.close()
    finally:
        drafter_server.stop(None)
        verifier_server.stop(None)
    assert before is not None and after is not None and after.runner == "sim"
    steps = after.steps - before.steps
    # Every verify step waited at least the profile's base time, which the counters record.
    assert after.device_s - before.device_s >= steps * PROFILES["h100-8b"].base_s
    assert after.forward_s - before.forward_s >= after.device_s - before.device_s
    assert steps > 0


STREAMS = 64
SIM_TOKENS = 16


def test_64_streams_over_frames_equal_the_sim_target_alone() -> None:
    # sim-instant models no device time: 64 requests at once cost only the system's own work,
    # all of it over one Frames stream per replica.
    pair = resolve_pair("sim-instant", device="cpu")
    target, draft = load_model(pair.target), load_model(pair.draft)
    drafter_server, drafter_port = serve_drafter(Drafter(draft))
    verifier_server, verifier_port = serve_verifier(Verifier(target))
    prompts = [
        tuple(target.tokenizer.encode(text, add_special_tokens=False))
        for text in ("def add(a, b):", "x = [", "Once upon a time", "SELECT id FROM")
    ]
    want = {}
    for prompt in prompts:
        ids = list(prompt)
        for _ in range(SIM_TOKENS):
            ids.append(int(target.model(torch.tensor([ids])).logits[0, -1].argmax()))
        want[prompt] = tuple(ids[len(prompt) :])
    try:
        with (
            GrpcDrafter(f"127.0.0.1:{drafter_port}", timeout_s=60.0) as drafter,
            GrpcVerifier(f"127.0.0.1:{verifier_port}", timeout_s=60.0) as verifier,
            ThreadPoolExecutor(STREAMS) as pool,
        ):
            router = Router(verifier, drafter, text_decoder(target.tokenizer), target.eos_token_ids)
            requests = [
                GenerationRequest(prompts[i % len(prompts)], SIM_TOKENS, draft_tokens=1 + i % 4)
                for i in range(STREAMS)
            ]
            results = list(pool.map(router.generate, requests))
            stats = verifier.stats()
            router.close()
    finally:
        drafter_server.stop(None)
        verifier_server.stop(None)
    for request, result in zip(requests, results, strict=True):
        assert tuple(result.tokens) == want[request.prompt_tokens]
    # Many sessions' entries shared frames: fewer frames than entries came in.
    assert stats.frames_received < stats.entries_received
