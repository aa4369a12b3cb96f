"""Headless load-test runner (command line): one scenario, or every baseline side by side.

    python -m loadtest.run one --config loadtest/configs/fake_small_card.yaml \\
        --baseline budget --mix mixed --shape spike --base-users 12 --pace-rps 1 --seconds 60
    python -m loadtest.run report            # every baseline side by side -> BENCHMARKS.md
    python -m loadtest.run report --quick    # a ~9-minute smoke run of the fake-engine part

How a run works and what it writes: :mod:`loadtest.runner`; the report: :mod:`loadtest.report`.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from loadtest.prices import slots_for
from loadtest.report import run_report
from loadtest.runner import (
    RESULTS,
    RunSpec,
    deploy,
    run_spec,
    saved_profile,
    start_serve,
    stop_serve,
    undeploy,
)
from loadtest.scenarios import BASELINES, MIXES, SHAPES

# --- command line -------------------------------------------------------------------------

def _one(options: argparse.Namespace) -> None:
    baseline = next(b for b in BASELINES if b.name.split("(")[0] == options.baseline)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    spec = RunSpec(label=f"{stamp}-{options.baseline}-{options.mix}-{options.shape}",
                   engine="custom", config=options.config, baseline=baseline, mix=options.mix,
                   shape=options.shape, base_users=options.base_users,
                   pace_rps=options.pace_rps, shape_seconds=options.seconds, seed=options.seed,
                   max_ongoing_requests=options.max_ongoing,
                   profile_path=saved_profile(options.config))
    results = Path(options.out or RESULTS)
    base_url = start_serve()
    try:
        if baseline.slot_count and spec.max_ongoing_requests is None:
            budget_spec = RunSpec(label=spec.label, engine=spec.engine, config=spec.config,
                                  baseline=BASELINES[0], mix=spec.mix, shape=spec.shape,
                                  base_users=1, pace_rps=1.0, profile_path=spec.profile_path)
            statuses = deploy(budget_spec.args(), base_url)
            undeploy()
            slots = slots_for(budget_spec.args(), statuses, spec.mix)
            spec = RunSpec(**{**spec.__dict__, "max_ongoing_requests": slots["slots"]})
        row = run_spec(spec, base_url, results)
    finally:
        stop_serve()
    row.pop("status_before", None)
    print(json.dumps(row, indent=2, default=str))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m loadtest.run",
                                     description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    one = sub.add_parser("one", help="one scenario against one config and baseline")
    one.add_argument("--config", default="loadtest/configs/fake_small_card.yaml")
    one.add_argument("--baseline", default="budget",
                     choices=[b.name.split("(")[0] for b in BASELINES])
    one.add_argument("--mix", default="mixed", choices=sorted(MIXES))
    one.add_argument("--shape", default="steady", choices=sorted(SHAPES))
    one.add_argument("--base-users", type=int, default=12)
    one.add_argument("--pace-rps", type=float, default=1.0)
    one.add_argument("--seconds", type=float, default=0.0,
                     help="stretch the shape to this many seconds (0: as defined)")
    one.add_argument("--max-ongoing", type=int, default=None,
                     help="slots baseline: max_ongoing_requests (default: budget / average "
                     "price, measured)")
    one.add_argument("--seed", type=int, default=0)
    one.add_argument("--out", default="", help=f"results folder (default {RESULTS})")
    report = sub.add_parser("report", help="every baseline side by side -> BENCHMARKS.md")
    report.add_argument("--quick", action="store_true",
                        help="a ~9-minute smoke run (fake engine, short runs)")
    report.add_argument("--engines", default="",
                        help="comma-separated subset of the report's sections (fake, "
                        "minilm, tenants, vllm; default: all, vllm where it is installed)")
    report.add_argument("--out", default="", help="plots and tables (default docs/benchmarks, "
                        "or loadtest/results/quick with --quick)")
    report.add_argument("--markdown", default="", help="the report (default BENCHMARKS.md, "
                        "or <out>/BENCHMARKS.md with --quick)")
    options = parser.parse_args(argv)
    if options.command == "one":
        _one(options)
    else:
        run_report(options)


if __name__ == "__main__":
    main()
