"""Which engine serves a model: the one place an engine is chosen by name.

``model.engine`` (or, when it is empty, ``model.task``) is a registered name from
:data:`BUILTIN_ENGINES`, or your own engine class as ``package.module:ClassName``: a subclass
of :class:`deployments.engines.base.PassRunner` or
:class:`~deployments.engines.base.AsyncScheduler` importable on every node (installed, or on the
Python path the driver gives Ray's workers). Modules are imported only when asked for, so
choosing the fake engine loads no torch model code.
"""

from __future__ import annotations

import importlib

from deployments.engines.base import AsyncScheduler, Engine, PassRunner
from serve_app.config import AppArgs, config_error
from serve_app.kinds import KINDS

BUILTIN_ENGINES = {
    "embed": "deployments.engines.embeddings:EmbeddingEngine",
    "generate": "deployments.engines.generation:GenerationEngine",
    "fake": "deployments.engines.fake:FakeEngine",
    "transcribe": "deployments.engines.transcribe:TranscribeEngine",
    "vllm": "deployments.engines.vllm_engine:VLLMEngine",
}
"""Registered engine names and the classes they stand for."""


def engine_class(args: AppArgs) -> type[Engine]:
    """The engine class ``args`` name, checked against ``args``
    (:meth:`~deployments.engines.base.Engine.check_args`).

    Raises:
        serve_app.config.ConfigError: an unknown name, a class that cannot be imported, is
            neither a :class:`PassRunner` nor an :class:`AsyncScheduler`, serves an unknown
            request kind (or, scheduling itself, one that does not generate), or ``args`` the
            engine refuses (the message names the key).
    """
    name = args.model.engine_name
    key = "model.engine" if args.model.engine else "model.task"
    path = BUILTIN_ENGINES.get(name, name)
    module_name, _, attribute = path.partition(":")
    if not module_name or not attribute:
        raise config_error(key, f"unknown engine {name!r}: use one of "
                           f"{sorted(BUILTIN_ENGINES)} or package.module:ClassName")
    try:
        cls = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as exc:
        raise config_error(key, f"cannot import the engine {path}: {exc}") from None
    _check_capability(cls, path, key)
    unknown = [kind for kind in cls.kinds if kind not in KINDS] if cls.kinds else ["none"]
    if unknown:
        raise config_error(key, f"{path} serves request kinds {list(cls.kinds)}; each must be "
                           f"one of {sorted(KINDS)}")
    cls.check_args(args)
    adm = args.admission
    if "kv_lease" in adm.model_fields_set and adm.kv_lease == "expected" \
            and not issubclass(cls, AsyncScheduler):  # set, not the default
        raise config_error("admission.kv_lease", "`expected` needs an engine that pages its "
                           f"own KV cache and preempts (model.engine: vllm), not {name!r}")
    return cls


def _check_capability(cls: object, path: str, key: str) -> None:
    """``cls`` is an engine the replica can run: a pass runner, or a scheduler of its own
    whose kinds all generate (its events are text).

    Raises:
        serve_app.config.ConfigError: it is not.
    """
    if not (isinstance(cls, type) and issubclass(cls, (PassRunner, AsyncScheduler))):
        raise config_error(key, f"{path} is neither a deployments.engines.base.PassRunner "
                           "nor an AsyncScheduler: subclass one (docs/engines.md)")
    if issubclass(cls, AsyncScheduler) and not all(KINDS[k].generates for k in cls.kinds
                                                   if k in KINDS):
        raise config_error(key, f"{path} schedules itself, so it serves kinds that generate "
                           f"only, not {list(cls.kinds)}")
