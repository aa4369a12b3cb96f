"""Which signal ends a ``serve run`` driver: ``SIGHUP``, unless the driver ignores it (started
under ``nohup``), which would leave it waiting forever on a failed application."""

from __future__ import annotations

import signal
import subprocess

from deployments.cluster.fail_fast import stop_signal


def _sleeper(ignore_sighup: bool) -> subprocess.Popen:
    def ignore() -> None:
        signal.signal(signal.SIGHUP, signal.SIG_IGN)

    return subprocess.Popen(["sleep", "60"], preexec_fn=ignore if ignore_sighup else None)


def test_a_driver_that_ignores_sighup_gets_sigterm() -> None:
    plain, under_nohup = _sleeper(False), _sleeper(True)
    try:
        assert stop_signal(plain.pid) is signal.SIGHUP
        assert stop_signal(under_nohup.pid) is signal.SIGTERM
        under_nohup.send_signal(stop_signal(under_nohup.pid))
        assert under_nohup.wait(timeout=10) == -signal.SIGTERM  # it does end it
    finally:
        for process in (plain, under_nohup):
            process.kill()
            process.wait()


def test_a_driver_whose_status_cannot_be_read_gets_sighup() -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()
    assert stop_signal(gone.pid) is signal.SIGHUP
