"""Load tests: locust scenarios, a headless runner and the side-by-side benchmark report.

- :mod:`loadtest.locustfile` — user classes and the load shape (``locust -f`` it directly);
- :mod:`loadtest.scenarios` — load shapes, user mixes and baselines, as data;
- :mod:`loadtest.outcomes` — how a response is classified (ok, refused, oom, ...);
- :mod:`loadtest.payloads` — seeded request bodies;
- :mod:`loadtest.summary` — the maths of a run's summary (pure);
- :mod:`loadtest.prices` — the slot-count baseline's budget / average request price;
- :mod:`loadtest.run` — ``python -m loadtest.run {one,report}``: starts the service, runs
  locust headless, scrapes ``/metrics``, writes CSV, JSON and PNG;
- :mod:`loadtest.report`, :mod:`loadtest.markdown`, :mod:`loadtest.plots` — every baseline
  side by side, BENCHMARKS.md and its figures;
- ``loadtest/configs/`` — the ``serve run`` configs the report deploys.

Pure modules (outcomes, scenarios, payloads, summary, markdown) import neither Ray nor locust,
so unit tests can import them.
"""
