"""The fake engine: exact, known memory costs on a simulated device, deterministic outputs, and
nothing left allocated on any path."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch

from deployments.engines.base import AsyncScheduler, PassRunner
from deployments.engines.fake import FakeEngine
from deployments.engines.stepping import DecodeStepper
from serve_app.memory.cost_model import AnalyticCostModel, Shape
from serve_app.memory.profiler import profile_memory
from serve_app.memory.simulated import SimulatedDevice, SimulatedDeviceProbe
from serve_app.request import GenerationParams, InferenceRequest

CAPACITY = 10_000_000
WEIGHTS = 1_000_000
PER_TOKEN = 1_000
PER_REQUEST = 500
LATENCY_S = 0.01


class SleepLog:
    """A no-op ``sleep`` that records what it was asked to wait."""

    def __init__(self) -> None:
        self.calls: list[float] = []

    def __call__(self, seconds: float) -> None:
        self.calls.append(seconds)

    @property
    def total_s(self) -> float:
        return sum(self.calls)


@pytest.fixture
def sleep() -> SleepLog:
    return SleepLog()


@pytest.fixture
def device() -> SimulatedDevice:
    return SimulatedDevice(CAPACITY)


@pytest.fixture
def engine(device: SimulatedDevice, sleep: SleepLog) -> Iterator[FakeEngine]:
    engine = FakeEngine(device, weights_bytes=WEIGHTS, bytes_per_token=PER_TOKEN,
                        bytes_per_request=PER_REQUEST, latency_per_token_s=LATENCY_S,
                        dimensions=32, sleep=sleep)
    yield engine
    assert device.allocated_bytes == WEIGHTS, "a run left memory allocated"
    engine.close()
    engine.close()
    assert device.allocated_bytes == 0


def collector(pieces: list[str]) -> Callable[[str], bool]:
    """An ``on_text`` that keeps every piece and never cancels."""
    def on_text(piece: str) -> bool:
        pieces.append(piece)
        return True
    return on_text


def greedy(max_tokens: int = 12, stop: tuple[str, ...] = ()) -> GenerationParams:
    return GenerationParams(max_tokens=max_tokens, temperature=0.0, stop=stop)


def test_serves_both_kinds_through_the_engine_protocol(engine: FakeEngine) -> None:
    assert isinstance(engine, PassRunner) and isinstance(engine, DecodeStepper)
    assert not isinstance(engine, AsyncScheduler) and engine.kinds == ("embed", "generate")
    assert engine.shape.hidden_size == engine.dimensions == 32
    assert AnalyticCostModel(engine.shape).request_bytes(1, 8, 8) > 0
    ids = engine.front.tokenize(["a b", "c"])
    embed = InferenceRequest("embed", tuple(map(tuple, ids)), Shape(2, 4, 0))
    generate = InferenceRequest("generate", (tuple(ids[0]),), Shape(1, 4, 3), greedy(3))
    [embedded] = engine.run_batch([embed])
    np.testing.assert_array_equal(embedded.embeddings, engine.embed(["a b", "c"]))
    assert embedded.prompt_tokens == 7
    assert engine.run_batch([generate]) == [engine.generate("a b", greedy(3))]


def test_the_weights_are_held_from_construction(device: SimulatedDevice) -> None:
    engine = FakeEngine(device, weights_bytes=WEIGHTS, bytes_per_token=1)
    assert device.allocated_bytes == WEIGHTS
    engine.close()
    assert device.allocated_bytes == 0
    with pytest.raises(torch.OutOfMemoryError):
        FakeEngine(device, weights_bytes=CAPACITY + 1, bytes_per_token=1)
    assert device.allocated_bytes == 0


def test_counts_words_plus_two_special_tokens(engine: FakeEngine) -> None:
    ids = engine.front.tokenize(["hello world", "", "  one\ttwo\nthree ", "world"])
    assert [len(i) for i in ids] == [4, 2, 5, 3]
    assert ids[0][2] == ids[3][1] and ids[0][1] != ids[0][2]  # one id per word


@pytest.mark.parametrize("shape", [(1, 8, 0), (4, 17, 0), (2, 10, 30), (8, 64, 16)])
def test_profile_run_peaks_at_exactly_the_request_cost(
        engine: FakeEngine, device: SimulatedDevice, sleep: SleepLog,
        shape: tuple[int, int, int]) -> None:
    b, p, n = shape
    probe = SimulatedDeviceProbe(device)
    baseline = probe.start_peak()
    engine.profile_run(b, p, n)
    assert baseline == WEIGHTS
    assert probe.peak_bytes() - baseline == b * (p + n) * PER_TOKEN + PER_REQUEST
    assert sleep.total_s == pytest.approx(b * (p + n) * LATENCY_S)


def test_the_profiler_fits_the_true_cost(engine: FakeEngine, device: SimulatedDevice) -> None:
    profile = profile_memory(engine.profile_run, SimulatedDeviceProbe(device, share=0.5),
                             engine.analytic_model(), features=engine.fit_features,
                             ladder=engine.profile_ladder(Shape(8, 64, 32)), task="fake",
                             model_path="fake", held_bytes=WEIGHTS, on_progress=lambda _: None)
    assert profile.capacity_bytes == CAPACITY // 2
    assert profile.held_out_error < 1e-6
    for point in profile.points:
        assert point.measured_bytes == engine.request_bytes(
            point.batch, point.prompt_tokens, point.new_tokens)


def test_embed_returns_unit_float32_rows_deterministically(
        engine: FakeEngine, device: SimulatedDevice, sleep: SleepLog) -> None:
    texts = ["a cat", "a dog sat down", "a cat"]
    vectors = engine.embed(texts)
    assert vectors.shape == (3, 32) and vectors.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-6)
    np.testing.assert_array_equal(vectors[0], vectors[2])
    assert not np.allclose(vectors[0], vectors[1])
    other = FakeEngine(device, weights_bytes=0, bytes_per_token=1, dimensions=32)
    np.testing.assert_array_equal(other.embed(["a dog sat down"])[0], vectors[1])
    assert sleep.total_s == pytest.approx(3 * 6 * LATENCY_S)  # padded to the longest: 4+2


def test_embed_holds_the_padded_batch_while_running(
        engine: FakeEngine, device: SimulatedDevice) -> None:
    probe = SimulatedDeviceProbe(device)
    baseline = probe.start_peak()
    engine.embed(["one", "one two three four"])  # 3 and 6 tokens: padded to 6
    assert probe.peak_bytes() - baseline == 2 * 6 * PER_TOKEN + PER_REQUEST
    assert engine.embed([]).shape == (0, 32)


def test_embed_truncates_to_max_seq_tokens(device: SimulatedDevice) -> None:
    engine = FakeEngine(device, weights_bytes=0, bytes_per_token=10, max_seq_tokens=8)
    device.reset_peak()
    engine.embed(["word " * 100])
    assert device.peak_allocated_bytes == 8 * 10


def test_generate_is_deterministic_at_temperature_zero(
        engine: FakeEngine, sleep: SleepLog) -> None:
    pieces: list[str] = []
    first = engine.generate("tell me a story", greedy(), collector(pieces))
    second = engine.generate("tell me a story", greedy())
    assert first == second
    assert first.finish_reason == "length"
    assert (first.prompt_tokens, first.completion_tokens) == (6, 12)
    assert len(first.text.split()) == 12
    assert "".join(pieces) == first.text
    assert engine.generate("another prompt", greedy()).text != first.text
    assert sleep.calls[:1] == [pytest.approx(6 * LATENCY_S)]  # the prompt, then per token


def test_generate_holds_prompt_plus_max_tokens(
        engine: FakeEngine, device: SimulatedDevice) -> None:
    probe = SimulatedDeviceProbe(device)
    baseline = probe.start_peak()
    engine.generate("three word prompt", greedy(max_tokens=20))
    assert probe.peak_bytes() - baseline == (5 + 20) * PER_TOKEN + PER_REQUEST


def test_a_seed_makes_sampling_reproducible(engine: FakeEngine) -> None:
    def sample(seed: int) -> str:
        params = GenerationParams(max_tokens=16, temperature=0.8, seed=seed)
        return engine.generate("hi", params).text

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_generate_stops_at_a_stop_string_without_including_it(engine: FakeEngine) -> None:
    full = engine.generate("stop test", greedy(max_tokens=12)).text
    words = full.split()
    stop = f" {words[5]} {words[6][:2]}"  # spans two words
    cut = full.find(stop)
    pieces: list[str] = []
    out = engine.generate("stop test", greedy(max_tokens=12, stop=("zzz", stop)),
                          collector(pieces))
    assert out.finish_reason == "stop"
    assert out.text == full[:cut]
    assert out.completion_tokens == full[:cut + len(stop)].count(" ") + 1
    assert "".join(pieces) == out.text


def test_generate_stops_early_when_on_text_returns_false(
        engine: FakeEngine, device: SimulatedDevice) -> None:
    pieces: list[str] = []

    def on_text(piece: str) -> bool:
        pieces.append(piece)
        return len(pieces) < 3

    out = engine.generate("go on", greedy(max_tokens=50), on_text)
    assert out.finish_reason == "cancelled"
    assert out.completion_tokens == 3 and len(pieces) == 3
    assert out.text.startswith("".join(pieces))


def test_an_on_text_returning_none_cancels_like_the_real_engine(engine: FakeEngine) -> None:
    pieces: list[str] = []
    out = engine.generate("go on", greedy(max_tokens=50), pieces.append)
    assert (out.finish_reason, out.completion_tokens, len(pieces)) == ("cancelled", 1, 1)


def test_a_request_bigger_than_free_memory_raises_oom_and_leaks_nothing(
        engine: FakeEngine, device: SimulatedDevice) -> None:
    free_tokens = (CAPACITY - WEIGHTS) // PER_TOKEN
    with pytest.raises(torch.OutOfMemoryError, match="CUDA out of memory"):
        engine.generate("big", greedy(max_tokens=free_tokens))
    assert device.allocated_bytes == WEIGHTS
    with pytest.raises(torch.OutOfMemoryError):
        engine.profile_run(10, free_tokens, 0)
    assert device.allocated_bytes == WEIGHTS
    assert device.oom_count == 2


def test_an_error_mid_run_frees_the_request_memory(
        engine: FakeEngine, device: SimulatedDevice, sleep: SleepLog) -> None:
    def explode(piece: str) -> bool:
        raise RuntimeError("client callback failed")

    with pytest.raises(RuntimeError, match="client callback failed"):
        engine.generate("x", greedy(), explode)
    assert device.allocated_bytes == WEIGHTS

    def failing_sleep(seconds: float) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. (mid-run)")

    engine.sleep = failing_sleep
    with pytest.raises(torch.OutOfMemoryError, match="mid-run"):
        engine.embed(["a b c"])
    assert device.allocated_bytes == WEIGHTS


def test_a_prompt_longer_than_max_seq_tokens_is_refused(device: SimulatedDevice) -> None:
    engine = FakeEngine(device, weights_bytes=0, bytes_per_token=1, max_seq_tokens=4)
    with pytest.raises(ValueError, match="exceeds max_seq_tokens 4"):
        engine.generate("one two three", greedy())
    assert device.allocated_bytes == 0


def test_injected_faults_raise_and_leave_only_the_weights(engine: FakeEngine,
                                                         device: SimulatedDevice,
                                                         sleep: SleepLog) -> None:
    import torch

    engine.cuda_error_probability = 1.0
    with pytest.raises(RuntimeError, match="device-side assert triggered"):
        engine.embed(["a b"])
    engine.cuda_error_probability, engine.oom_probability = 0.0, 1.0
    ooms = device.oom_count
    with pytest.raises(torch.OutOfMemoryError, match="CUDA out of memory"):
        engine.generate("a b", greedy())
    assert device.oom_count == ooms + 1
    engine.oom_probability, engine.hang_probability, engine.hang_s = 0.0, 1.0, 600.0
    engine.embed(["a b"])
    assert 600.0 in sleep.calls
    assert device.allocated_bytes == WEIGHTS


def test_profiling_measures_the_model_not_the_injected_faults(
        engine: FakeEngine, device: SimulatedDevice, sleep: SleepLog) -> None:
    engine.oom_probability = engine.cuda_error_probability = engine.hang_probability = 1.0
    probe = SimulatedDeviceProbe(device)
    baseline = probe.start_peak()
    engine.profile_run(2, 8, 4)
    assert probe.peak_bytes() - baseline == 2 * (8 + 4) * PER_TOKEN + PER_REQUEST
    assert engine.hang_s not in sleep.calls
    assert engine.canary() is True
    with pytest.raises(RuntimeError, match="device-side assert"):  # traffic still gets them
        engine.embed(["a b"])


def test_the_canary_sees_nan_output_after_an_oom_only_when_asked_to(
        engine: FakeEngine, device: SimulatedDevice) -> None:
    free_tokens = (CAPACITY - WEIGHTS) // PER_TOKEN
    assert engine.canary() is True
    with pytest.raises(torch.OutOfMemoryError):
        engine.profile_run(10, free_tokens, 0)
    assert engine.canary() is True  # a plain OOM leaves the output intact
    engine.nan_after_oom = True
    with pytest.raises(torch.OutOfMemoryError):
        engine.profile_run(10, free_tokens, 0)
    assert engine.canary() is False
    assert np.isnan(engine.embed(["a b"])).all()
    assert device.allocated_bytes == WEIGHTS


def test_a_generation_batch_holds_one_padded_cache_and_answers_each_prompt_as_alone(
        engine: FakeEngine) -> None:
    prompts = ["one two three four five", "six", "seven eight"]
    params = [GenerationParams(max_tokens=n, temperature=0.0) for n in (5, 2, 4)]
    alone = [engine.generate(prompt, p) for prompt, p in zip(prompts, params, strict=True)]
    before = engine.device.reset_peak()
    together = engine.generate_batch(prompts, params)
    assert together == alone
    assert [o.completion_tokens for o in together] == [5, 2, 4]
    longest = max(len(ids) for ids in engine.front.tokenize(prompts))
    assert engine.device.peak_allocated_bytes - before == \
        engine.request_bytes(3, longest, 5)  # every row's cache is as long as the largest
    for bad in ([GenerationParams(stop=("six",))] * 3,
                [GenerationParams(temperature=0.0)] * 2 + [GenerationParams(temperature=1.0)]):
        with pytest.raises(ValueError):
            engine.generate_batch(prompts, bad)


def test_a_fixed_cost_per_pass_makes_a_batch_cheaper_than_its_members_apart(
        device: SimulatedDevice, sleep: SleepLog) -> None:
    engine = FakeEngine(device, weights_bytes=0, bytes_per_token=1, latency_per_token_s=0.001,
                        latency_per_pass_s=0.5, sleep=sleep)
    texts = ["a b", "c d", "e f"]  # 2 words + 2 special tokens each
    engine.embed(texts)
    batched_s = sleep.total_s
    for text in texts:
        engine.embed([text])
    assert batched_s == pytest.approx(3 * 4 * 0.001 + 0.5)
    assert sleep.total_s - batched_s == pytest.approx(3 * (4 * 0.001 + 0.5))
    sleep.calls.clear()
    engine.generate_batch(texts, [greedy(max_tokens=5), greedy(max_tokens=2),
                                  greedy(max_tokens=1)])  # a prefill + 5 decode passes
    assert sleep.total_s == pytest.approx(3 * (4 + 5) * 0.001 + 6 * 0.5)
    engine.close()
