"""On a real GPU: profile a ~1B-parameter fp16 causal LM with random weights, compare the
fitted cost model with measured peaks across lengths, and run a burst of concurrent
completions on two half-card replicas that must cause no OOM (no 500).

Needs Ray: ``python -m pytest tests/gpu``; skipped without CUDA. The GPU check without Ray
(what runs on a machine without Ray) is ``scripts/gpu_check.sh``.
"""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest
import torch

from deployments.replica.profiling import measure_replica
from scripts.gpu_check.plan import GPU_FIT_ERROR_BOUND
from serve_app.config import parse_args

# Llama-shaped, ~1.1e9 parameters (TinyLlama-1.1B's dimensions), random weights.
ONE_B_CONFIG = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                    num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
                    max_position_embeddings=2048)


@pytest.fixture(scope="module")
def one_b_model(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.support import build_tiny_causal_lm

    path = build_tiny_causal_lm(tmp_path_factory.mktemp("one-b") / "model")  # its tokenizer
    config = LlamaConfig(**ONE_B_CONFIG, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float16)
    print(f"\nparameters: {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B")
    model.save_pretrained(str(path))
    del model
    return path


def test_profile_predicts_measured_peaks(one_b_model):
    args = parse_args({"model": {"task": "generate", "path": str(one_b_model),
                                 "device": "cuda", "dtype": "float16"},
                       "deployment": {"num_gpus": 0.5},
                       "limits": {"max_input_tokens": 1024, "max_tokens": 512}})
    measured = measure_replica(args, on_progress=print)
    print(measured.profile.table())
    print(measured.memory_status(args))
    assert measured.profile.held_out_error <= GPU_FIT_ERROR_BOUND
    total = torch.cuda.get_device_properties(0).total_memory
    assert measured.probe.capacity_bytes() <= total * 0.5


def test_concurrent_burst_on_two_half_card_replicas_has_no_oom(one_b_model, tmp_path):
    import ray
    from ray import serve

    from serve_app.app import build_app
    from tests.support import free_port, settled_status, wait_until_ready

    port = free_port()
    ray.init(num_gpus=1, include_dashboard=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    base_url = f"http://127.0.0.1:{port}"
    try:
        serve.run(build_app({
            "model": {"task": "generate", "path": str(one_b_model), "device": "cuda",
                      "dtype": "float16"},
            "limits": {"max_input_tokens": 1024, "max_tokens": 512},
            "admission": {"max_queue_len": 64, "max_queue_wait_s": 60},
            "deployment": {"num_replicas": 2, "num_gpus": 0.5},
        }), name="gpu", route_prefix="/", blocking=False)
        wait_until_ready(base_url, timeout_s=300)
        rng = random.Random(0)

        async def burst() -> list[int]:
            async with httpx.AsyncClient(base_url=base_url, timeout=300) as http:
                responses = await asyncio.gather(*(
                    http.post("/v1/completions", json={
                        "prompt": "fox " * rng.randint(8, 1000),
                        "max_tokens": rng.randint(16, 512), "temperature": 0})
                    for _ in range(64)))
            return [r.status_code for r in responses]

        statuses = asyncio.run(burst())
        print({s: statuses.count(s) for s in set(statuses)})
        assert set(statuses) <= {200, 503}
        replicas = settled_status(base_url)
        for replica in replicas:
            print(replica)
            assert replica["reserved_bytes"] == 0
            assert replica["peak_reserved_bytes"] <= replica["budget_bytes"]
    finally:
        serve.shutdown()
        ray.shutdown()
