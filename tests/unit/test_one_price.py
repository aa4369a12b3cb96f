"""One request, one price: for random requests, the ingress's estimate (what the budget-aware
router ranks replicas by) equals the lease the replica then takes.

Real parts on both sides, no Ray: the ingress's request factory with the engine's own front
end and the replica's published cost model (pickled, as it travels through the registry);
the replica's parts (:class:`deployments.replica.parts.Replica`) on the fake engine, admitting each
request through its lifecycle. The lease is read from the replica's gate (bytes charged).
"""

from __future__ import annotations

import asyncio
import pickle
import time
from concurrent.futures import ThreadPoolExecutor

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deployments.engines.fake import FakeEngine
from deployments.http.request_factory import RequestFactory
from deployments.replica.parts import Replica, ReplicaIdentity
from serve_app.admission.policy import policy_class
from serve_app.config import parse_args
from serve_app.kinds import KINDS
from serve_app.memory.cost_model import FittedCostModel
from serve_app.memory.simulated import SimulatedDevice, SimulatedDeviceProbe
from serve_app.metrics import ProcessMetrics
from serve_app.pricing import estimate_units
from serve_app.request import GenerationParams
from tests.unit.conftest import assert_idle

CONTEXT_TOKENS = 96
WORD = st.sampled_from(["alpha", "beta", "gamma", "delta", "x"])
TEXT = st.lists(WORD, min_size=1, max_size=40).map(" ".join)
EMBED = st.tuples(st.just("embed"), st.lists(TEXT, min_size=1, max_size=6), st.none(),
                  st.just(False))
PARAMS = st.builds(GenerationParams, max_tokens=st.integers(1, 48),
                   temperature=st.sampled_from([0.0, 0.7]),
                   seed=st.one_of(st.none(), st.integers(0, 9)),
                   stop=st.sampled_from([(), ("beta",)]))
GENERATE = st.tuples(st.just("generate"), st.lists(TEXT, min_size=1, max_size=1), PARAMS,
                     st.booleans())
COST_MODEL = st.builds(
    lambda c: FittedCostModel(("const", "batch_tokens", "batch_prompt", "batch_prompt_sq"), c),
    st.tuples(st.floats(0, 1e6), st.floats(0, 1e4), st.floats(0, 1e4), st.floats(0, 50)))


@settings(max_examples=40, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(requests=st.lists(st.one_of(EMBED, GENERATE), min_size=1, max_size=8),
       cost_model=COST_MODEL, correction=st.sampled_from([1.0, 1.37, 2.999]),
       policy=st.sampled_from(["budget", "semaphore"]), batching=st.booleans(),
       pad_to=st.sampled_from([1, 16]))
def test_the_routers_estimate_is_the_replicas_lease(requests, cost_model, correction, policy,
                                                     batching, pad_to) -> None:
    args = parse_args({
        "model": {"task": "fake"}, "admission": {"policy": policy},
        "batching": {"enabled": batching, "max_batch_size": 4, "pad_to_multiple_of": pad_to},
        "limits": {"max_inputs": 6, "max_input_tokens": 48, "max_tokens": 48},
        "fake": {"max_seq_tokens": CONTEXT_TOKENS}})
    asyncio.run(_compare(args, requests, cost_model, correction))


async def _compare(args, requests, cost_model: FittedCostModel, correction: float) -> None:
    device = SimulatedDevice(1 << 40)
    engine = FakeEngine(device, weights_bytes=0, bytes_per_token=1,
                        max_seq_tokens=CONTEXT_TOKENS)
    executor = ThreadPoolExecutor(max_workers=1)
    replica = Replica(engine, SimulatedDeviceProbe(device), cost_model, 1 << 60, args, executor,
                      ProcessMetrics("ModelServer", "test", use_ray=False), ReplicaIdentity())
    replica.cost_model.factor = correction  # as after OOM corrections
    factory = RequestFactory(args, FakeEngine.front_end(args))  # the ingress's
    published = pickle.loads(pickle.dumps(replica.state())).cost_model  # via the registry
    try:
        for kind, texts, params, stream in requests:
            request = await factory.build(KINDS[kind], texts, params, stream)
            estimate = estimate_units([published], request.shape,
                                      policy_class(args.admission.policy))
            charged = replica.gate.budget.charged_bytes_total
            if stream:
                async for _ in replica.lifecycle.infer_stream(request.sent(estimate, time.time())):
                    pass
            else:
                await replica.lifecycle.infer(request.sent(estimate, time.time()))
            lease = replica.gate.budget.charged_bytes_total - charged
            assert estimate == lease, (request.shape, estimate, lease)
        await asyncio.get_running_loop().run_in_executor(executor, lambda: None)
        for _ in range(3):
            await asyncio.sleep(0)
        assert_idle(replica.gate.queue)
    finally:
        replica.close()
        executor.shutdown(wait=True)
