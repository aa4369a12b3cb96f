"""An application's models: one model (``args:`` as :class:`~serve_app.config.AppArgs`), or
several under ``args.models``.

With ``models:``, each entry is one model deployment and may hold the sections that belong to
one model (:data:`MODEL_SECTIONS`); every other section is the app's (the ingress's, the
auth, the idempotency store, the jobs' store) and lives only at the top level. A top-level
model section is the default of every entry: an entry's keys override it key by key::

    args:
      limits: {max_input_tokens: 256}        # every model's default
      models:
        - model: {name: minilm, task: embed}
        - model: {name: chat, task: generate, path: /models/tiny-llama}
          deployment: {num_gpus: 0.5}
          limits: {max_tokens: 128}          # max_input_tokens: 256 from the top

Pure pydantic: no Ray.
"""

from __future__ import annotations

from typing import Any

from serve_app.config import AppArgs, ConfigError, parse_args

MODEL_SECTIONS = frozenset({"model", "deployment", "limits", "memory", "batching",
                            "admission", "fake"})
"""Sections an entry of ``models:`` may set."""
APP_DEPLOYMENT_KEYS = frozenset({"ingress_replicas", "ingress_max_ongoing_requests",
                                 "ingress_max_queued_requests", "ingress_retry_after_s"})
"""``deployment`` keys of the app's ingress, not of one model: top level only."""


def parse_models(raw: dict[str, Any] | AppArgs | None) -> list[AppArgs]:
    """Each model's validated args, in the order of ``models:`` (one model without it).

    Raises:
        ConfigError: every invalid key of every model at once (``args.models[i].<key>``),
            an entry that sets an app-wide section, or two models of one name.
    """
    if not isinstance(raw, dict) or "models" not in raw:
        return [parse_args(raw)]
    entries, shared = raw["models"], {k: v for k, v in raw.items() if k != "models"}
    if not isinstance(entries, list) or not entries:
        raise ConfigError("invalid vramgate config:\n  args.models: a list of at least one "
                          "model (each a mapping of its sections)")
    problems: list[str] = []
    models: list[AppArgs] = []
    for i, entry in enumerate(entries):
        try:
            models.append(parse_args(_merged(shared, entry, f"args.models[{i}]")))
        except ConfigError as exc:
            problems += [line.replace("args.", f"args.models[{i}].", 1)
                         if not line.startswith(f"args.models[{i}]") else line
                         for line in _lines(exc)]
    names = [m.model.name for m in models]
    problems += [f"args.models: two models are named {name!r}: each needs its own "
                 "model.name (the request's `model` picks it)"
                 for name in sorted({n for n in names if names.count(n) > 1})]
    if problems:
        raise ConfigError("invalid vramgate config:\n  " + "\n  ".join(problems))
    return models


def _merged(shared: dict[str, Any], entry: Any, where: str) -> dict[str, Any]:
    """``shared`` with ``entry``'s model sections laid over it, key by key.

    Raises:
        ConfigError: ``entry`` is not a mapping or sets what only the app may set."""
    if not isinstance(entry, dict):
        raise ConfigError(f"invalid vramgate config:\n  {where}: a mapping of its sections")
    wrong = [f"{where}.{key}: app-wide, set it at the top level of args (an entry of models "
             f"may set {', '.join(sorted(MODEL_SECTIONS))})"
             for key in entry if key not in MODEL_SECTIONS]
    wrong += [f"{where}.deployment.{key}: the ingress's, set it in the top-level deployment"
              for key in (entry.get("deployment") or {}) if key in APP_DEPLOYMENT_KEYS]
    if wrong:
        raise ConfigError("invalid vramgate config:\n  " + "\n  ".join(wrong))
    merged = dict(shared)
    for section, values in entry.items():
        base = shared.get(section)
        merged[section] = {**base, **values} if isinstance(base, dict) and \
            isinstance(values, dict) else values
    return merged


def _lines(exc: ConfigError) -> list[str]:
    """The problem lines of a :func:`parse_args` error (after its heading)."""
    return [line.strip() for line in str(exc).splitlines()[1:] if line.strip()]
