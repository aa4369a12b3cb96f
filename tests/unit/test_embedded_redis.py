"""The local Redis: only a unix socket, data kept across a stop and a start, a live server
reused, a server that went away started again, one server for starts at the same time, a
failed start named with its log file, a server whose owner died adopted."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest
import redis

from serve_app.jobs.embedded import EmbeddedRedis
from tests.support import read_job, write_job

REPO = Path(__file__).resolve().parents[2]


def test_data_outlives_a_stop_and_a_start_in_the_same_directory(tmp_path) -> None:
    with EmbeddedRedis(tmp_path) as server:
        assert server.owned and server.url == f"unix://{tmp_path.resolve()}/redis.sock"
        client = redis.Redis.from_url(server.url)
        assert client.config_get("port") == {"port": "0"}  # no TCP listener
        assert client.config_get("appendonly") == {"appendonly": "yes"}
        client.hset("vramgate:m:job:1", mapping={"status": "queued", "request": b"\x00\xff"})
        client.rpush("vramgate:m:queued", "1")
        client.close()
    assert not server.ping()
    assert (tmp_path / "appendonly.aof").stat().st_size > 0
    with EmbeddedRedis(tmp_path) as again:
        client = redis.Redis.from_url(again.url)
        assert client.hgetall("vramgate:m:job:1") == {b"status": b"queued",
                                                      b"request": b"\x00\xff"}
        assert client.lrange("vramgate:m:queued", 0, -1) == [b"1"]
        client.close()


def test_a_server_already_answering_on_the_socket_is_reused(tmp_path) -> None:
    first = EmbeddedRedis(tmp_path).start()
    try:
        second = EmbeddedRedis(tmp_path).start()
        assert (first.owned, second.owned) == (True, False)
        second.stop()  # not its server: left running
        assert first.ping()
    finally:
        first.stop()
    assert not first.ping()
    assert not (tmp_path / "redis.sock").exists()


def test_a_killed_server_leaves_nothing_that_blocks_the_next_start(tmp_path) -> None:
    server = EmbeddedRedis(tmp_path).start()
    server._process.kill()  # the server this test started: its socket and pid file stay
    server._process.wait()
    assert (tmp_path / "redis.sock").exists() and not server.ping()
    again = EmbeddedRedis(tmp_path).start()
    try:
        assert again.owned and again.ping()
    finally:
        again.stop()


def test_a_server_that_does_not_start_is_named_with_its_log(tmp_path) -> None:
    server = EmbeddedRedis(tmp_path, executable="/bin/false", start_timeout_s=5.0)
    with pytest.raises(RuntimeError, match=r"exit status 1.*redis\.log"):
        server.start()
    assert not server.owned


def test_a_socket_path_too_long_is_refused(tmp_path) -> None:
    with pytest.raises(ValueError, match="shorter data directory"):
        EmbeddedRedis(tmp_path / ("d" * 120))


def test_start_again_brings_back_a_server_this_object_started_that_died(tmp_path) -> None:
    server = EmbeddedRedis(tmp_path).start()
    try:
        write_job(server.url)
        server._process.kill()  # killed from outside (the OOM killer, say): nothing flushed
        server._process.wait()
        assert not server.ping()
        assert server.start() is server
        assert server.owned and server.ping()
        # appendfsync everysec: a write is in the file (the OS's cache) before its reply, so
        # a killed process loses nothing; only the machine going down loses up to a second.
        assert read_job(server.url) == {b"status": b"queued"}
    finally:
        server.stop()


def test_a_reused_server_that_its_owner_stops_is_started_again_by_the_reuser(tmp_path) -> None:
    """A redeploy's hand-off: the new broker finds the old one's server and reuses it, then the
    old broker stops it; the new broker's next start runs its own, on the same file."""
    old = EmbeddedRedis(tmp_path).start()
    new = EmbeddedRedis(tmp_path).start()
    try:
        assert not new.owned
        write_job(new.url)
        old.stop()
        assert not new.ping()
        new.start()
        assert new.owned and read_job(new.url) == {b"status": b"queued"}
    finally:
        new.stop()
        old.stop()


def test_stop_leaves_alone_the_server_another_process_started_after_this_ones_died(
        tmp_path) -> None:
    first = EmbeddedRedis(tmp_path).start()
    first._process.kill()
    first._process.wait()
    second = EmbeddedRedis(tmp_path).start()
    try:
        assert second.owned
        first.stop()  # its own server is gone; the one answering is not its
        assert second.ping()
    finally:
        second.stop()


def _servers_in(data_dir) -> list[psutil.Process]:
    """The redis-server processes running in ``data_dir`` (their working directory: the server
    rewrites its command line, so that cannot be matched)."""
    servers = []
    for process in psutil.process_iter(["name", "cwd"]):
        if "redis-server" in (process.info["name"] or "") and process.info["cwd"] == data_dir:
            servers.append(process)
    return servers


@pytest.mark.parametrize("starters", [2, 4])
def test_starts_at_the_same_time_run_one_server(tmp_path, starters: int) -> None:
    """Two processes starting on one directory at once (brokers of a redeploy) must not run two
    servers: the second would take over the socket path and both would write the same file."""
    for attempt in range(5):
        barrier = threading.Barrier(starters)
        servers = [EmbeddedRedis(tmp_path) for _ in range(starters)]

        def start(server: EmbeddedRedis, barrier: threading.Barrier) -> None:
            barrier.wait()
            server.start()

        threads = [threading.Thread(target=start, args=(s, barrier)) for s in servers]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        try:
            assert sum(s.owned for s in servers) == 1, attempt
            assert len(_servers_in(str(tmp_path.resolve()))) == 1, attempt
            assert all(s.ping() for s in servers)
        finally:
            for server in servers:
                server.stop()


OWNER = """
import sys, time
from serve_app.jobs.embedded import EmbeddedRedis
EmbeddedRedis(sys.argv[1]).start()
print("started", flush=True)
time.sleep(600)
"""


def _exited(process: psutil.Process) -> bool:
    """Whether ``process`` (not this one's child) has exited: gone, or a zombie its parent
    has not reaped yet (a container's init may never)."""
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _owner_process(data_dir) -> subprocess.Popen:
    """Another process that starts the server on ``data_dir`` and keeps it (a JobBroker)."""
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(data_dir)], cwd=REPO,
                             stdout=subprocess.PIPE, text=True)
    assert owner.stdout.readline() == "started\n"
    return owner


def test_a_server_whose_owner_was_killed_is_adopted_and_stopped_with_its_adopter(
        tmp_path) -> None:
    """``ray stop --force`` or a SIGKILLed worker: the process that started the server dies
    without stopping it. The next start on the directory takes it over, so that it stops
    with the next app instead of running on for ever."""
    owner = _owner_process(tmp_path)
    owner.kill()  # no clean-up: SIGKILL
    owner.wait()
    [orphan] = _servers_in(str(tmp_path.resolve()))
    write_job(f"unix://{tmp_path.resolve()}/redis.sock")
    adopter = EmbeddedRedis(tmp_path).start()
    try:
        assert adopter.owned and adopter.ping()
        assert read_job(adopter.url) == {b"status": b"queued"}  # the same server, kept
    finally:
        adopter.stop()
    assert not adopter.ping()
    assert _exited(orphan) and _servers_in(str(tmp_path.resolve())) == []
    assert (tmp_path / "appendonly.aof").stat().st_size > 0


def test_a_server_whose_owner_lives_is_reused_not_adopted(tmp_path) -> None:
    owner = _owner_process(tmp_path)
    try:
        user = EmbeddedRedis(tmp_path).start()
        assert not user.owned
        user.stop()  # the owner's: left running
        assert user.ping()
    finally:
        owner.kill()
        owner.wait()
        EmbeddedRedis(tmp_path).start().stop()  # adopted, then stopped: nothing left
    assert _servers_in(str(tmp_path.resolve())) == []
