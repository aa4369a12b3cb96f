"""Continuous batching on real transformers models, built offline: sequences that join and
leave a running batch between decode steps get exactly the tokens ``generate`` gives each
prompt alone (greedy), in every family whose cache can step; through a replica's decode loop
too, 16 concurrent completions of mixed ``max_tokens``, some streamed, some with stop
strings.
"""

from __future__ import annotations

import asyncio
import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from deployments.engines.fake import exact_cost_model
from deployments.engines.generation import GenerationEngine
from deployments.engines.stepping import SequenceStart
from deployments.replica.parts import Replica, ReplicaIdentity
from serve_app.config import parse_args
from serve_app.kinds import build_request
from serve_app.memory.simulated import SimulatedDevice, SimulatedDeviceProbe
from serve_app.metrics import ProcessMetrics
from serve_app.request import GenerationOutput, GenerationParams
from tests.model_dirs import FAMILIES, build_causal_lm
from tests.unit.conftest import assert_idle, completion_of


@pytest.fixture(scope="module", params=FAMILIES)
def engine(request, tmp_path_factory) -> GenerationEngine:
    path = build_causal_lm(tmp_path_factory.mktemp(request.param) / "model", request.param)
    engine = GenerationEngine(path, "cpu", "float32", num_threads=1)
    engine.family = request.param
    return engine


def prompts(engine: GenerationEngine, count: int, seed: int = 0) -> list[tuple[int, ...]]:
    rng = random.Random(seed)
    return [tuple(rng.randrange(5, engine.front.vocab_size) for _ in range(rng.randint(2, 20)))
            for _ in range(count)]


def test_sequences_joining_and_leaving_between_steps_get_their_lone_tokens(engine) -> None:
    if engine.family == "mistral":  # sliding-window layers: whole passes instead
        assert not engine.decode_steps
        return
    assert engine.decode_steps
    rng = random.Random(1)
    ids = prompts(engine, 10)
    params = [GenerationParams(max_tokens=rng.choice([1, 3, 8, 17, 30]), temperature=0.0)
              for _ in ids]
    alone = [engine.generate_ids(p, q) for p, q in zip(ids, params, strict=True)]
    waiting = [SequenceStart(i, p, q) for i, (p, q) in enumerate(zip(ids, params, strict=True))]
    texts, done, cancelled, step = dict.fromkeys(range(len(ids)), ""), {}, 7, 0
    while waiting or engine.kv_tokens_held():
        joining = [waiting.pop(0) for _ in range(rng.randint(0, 3)) if waiting]
        leaving = [cancelled] if step == 4 else []  # one leaves mid-way
        for seq_id, update in engine.decode_step(joining, leaving).items():
            texts[seq_id] += update.text
            if update.finish_reason:
                done[seq_id] = GenerationOutput(texts[seq_id], update.finish_reason,
                                                len(ids[seq_id]), update.completion_tokens)
        step += 1
    for i, expected in enumerate(alone):
        if i != cancelled or i in done:
            assert done[i] == expected, (engine.family, i)
    assert engine.kv_tokens_held() == 0


def test_a_dense_batch_counts_its_padding_until_rows_leave() -> None:
    from deployments.engines.decode_batch import DenseDecodeBatch
    peak = DenseDecodeBatch.kv_tokens_for
    # Every row is as long as the longest: 3 rows x 40 now; the longest grows 5 more steps,
    # the others leave after 2 and 1: 3 x 41 after one step, 2 x 42, then 1 x 45.
    assert peak([(10, 1), (40, 5), (12, 2)]) == max(3 * 40, 3 * 41, 2 * 42, 1 * 45)
    # A short row beside a long one: padded to it only while it runs (8 steps).
    assert peak([(150, 100), (24, 8)]) == max(2 * (150 + 8), 150 + 100)
    assert peak([(24, 8)]) == 24 + 8 and peak([]) == 0


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> GenerationEngine:
    path = build_causal_lm(tmp_path_factory.mktemp("llama") / "model", "llama")
    return GenerationEngine(path, "cpu", "float32", num_threads=1)


def test_concurrent_completions_through_the_decode_loop_match_generate_alone(llama) -> None:
    args = parse_args({"model": {"path": str(llama.path), "engine": "generate"},
                       "limits": {"max_tokens": 64, "max_input_tokens": 64},
                       "batching": {"max_batch_size": 16}})
    rng = random.Random(2)
    requests = []
    for i, ids in enumerate(prompts(llama, 16, seed=3)):
        params = GenerationParams(max_tokens=rng.choice([2, 8, 16, 33, 64]), temperature=0.0)
        if i % 4 == 1:  # a stop string from its own lone text, so that it hits
            text = llama.generate_ids(ids, params).text
            if len(text) > 6:
                params = GenerationParams(params.max_tokens, 0.0, stop=(text[3:6],))
        requests.append((ids, params, i % 3 == 0))
    expected = [llama.generate_ids(ids, params) for ids, params, _ in requests]
    outputs, steps, idle = asyncio.run(_serve(llama, args, requests))
    for (_, params, _), output, alone in zip(requests, outputs, expected, strict=True):
        if not params.stop:
            assert output == alone
            continue
        # transformers 5.24's generate hands its streamer each token one step late
        # (deferred stop checks), so the lone path notices a stop string a token after it
        # appeared and generates one more; the steps stop at the token that completed it.
        assert (output.text, output.finish_reason) == (alone.text, alone.finish_reason)
        assert alone.completion_tokens - 1 <= output.completion_tokens \
            <= alone.completion_tokens
    assert steps < sum(p.max_tokens for _, p, _ in requests) // 4  # they shared steps
    assert idle


async def _serve(engine, args, requests):
    executor = ThreadPoolExecutor(max_workers=1)
    replica = Replica(engine, SimulatedDeviceProbe(SimulatedDevice(1 << 40)),
                      exact_cost_model(1, 0), 1 << 40, args, executor,
                      ProcessMetrics("ModelServer", "test", use_ray=False),
                      ReplicaIdentity("test"))
    try:
        outputs = await asyncio.gather(*(_complete(replica, args, engine, *r)
                                         for r in requests))
        assert_idle(replica.gate.queue)
        return outputs, replica.decode.steps, engine.kv_tokens_held() == 0
    finally:
        replica.close()
        executor.shutdown(wait=True)


async def _complete(replica, args, engine, ids, params, stream) -> GenerationOutput:
    request = build_request("generate", [ids], params, stream, args, engine.max_seq_tokens)
    return await completion_of(replica.lifecycle, request)


def test_a_stop_string_completed_by_the_last_token_ends_with_stop(llama) -> None:
    """The streamer holds a word back until it ends; the last token's word is released only
    when the sequence ends at ``max_tokens``, and a stop string it completes is a ``stop``,
    as on the lone path (it was ``length``, the text cut)."""
    for ids in prompts(llama, 8, seed=7):
        full = llama.generate_ids(ids, GenerationParams(max_tokens=12, temperature=0.0))
        stop = full.text[-2:]
        if full.finish_reason != "length" or full.text.find(stop) != len(full.text) - 2:
            continue  # its last two characters also appear earlier: try the next prompt
        params = GenerationParams(max_tokens=12, temperature=0.0, stop=(stop,))
        alone = llama.generate_ids(ids, params)
        [output], _, _ = asyncio.run(_serve(llama, parse_args({
            "model": {"path": str(llama.path), "engine": "generate"}}), [(ids, params, False)]))
        assert (alone.text, alone.finish_reason) == (full.text[:-2], "stop")
        assert (output.text, output.finish_reason) == (alone.text, "stop")
        return
    pytest.fail("no prompt ended in two characters found nowhere else in its text")


def test_a_seeded_sample_does_not_depend_on_its_batch(llama) -> None:
    """Each seeded sequence draws from its own generator: the same text alone as beside
    other sampled sequences; another seed gives another text."""
    ids = prompts(llama, 4, seed=5)
    seeded = GenerationParams(max_tokens=12, temperature=1.0, seed=11)

    def run(starts: list[SequenceStart]) -> str:  # sequence 0's text, all run to the end
        text, updates = "", llama.decode_step(starts, [])
        while True:
            text += updates[0].text if 0 in updates else ""
            if not llama.kv_tokens_held():
                return text
            updates = llama.decode_step([], [])

    alone = run([SequenceStart(0, ids[0], seeded)])
    crowd = run([SequenceStart(0, ids[0], seeded)] + [
        SequenceStart(i, ids[i], GenerationParams(max_tokens=20, temperature=1.0))
        for i in (1, 2, 3)])
    other = run([SequenceStart(0, ids[0], GenerationParams(12, 1.0, seed=12))])
    assert alone == crowd
    assert alone != other
