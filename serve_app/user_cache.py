"""Where vramgate keeps what outlives one run: measurements made before a deployment
(``memory.measurement_cache_dir``) and the embedded Redis of durable jobs (``jobs.data_dir``).

Both default to directories of the user, ``~/.cache/vramgate/<name>``, shared by every
checkout, virtual environment and app of that user on the machine: two apps serving a model
of the same name share its jobs (and their idempotency keys), and a measurement made by one
is reused by the other. ``VRAMGATE_CACHE_DIR`` in the environment where the application is
built (the ``serve run`` shell that starts Ray, ``ray start``'s, or the application's
``runtime_env.env_vars``) moves both defaults under another directory; the two config keys
set each one. Pure: reads the environment only.
"""

from __future__ import annotations

import os

CACHE_DIR_ENV = "VRAMGATE_CACHE_DIR"
DEFAULT_CACHE_DIR = "~/.cache/vramgate"


def user_cache_dir(name: str) -> str:
    """``$VRAMGATE_CACHE_DIR/<name>``, or ``~/.cache/vramgate/<name>`` when it is unset or
    empty (``~`` is expanded where the directory is used)."""
    root = os.environ.get(CACHE_DIR_ENV) or DEFAULT_CACHE_DIR
    return f"{root.rstrip('/')}/{name}"
