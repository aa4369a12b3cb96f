"""The local Redis: only a unix socket, data kept across a stop and a start, a live server
reused, a failed start named with its log file."""

from __future__ import annotations

import pytest
import redis

from serve_app.jobs.embedded import EmbeddedRedis


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
