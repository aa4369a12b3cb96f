"""The ``auth:`` section of a config: bearer keys and the tenants they name. Pure pydantic.

A request's tenant is its key's: the tenant whose ``api_keys`` (or ``api_key_env``) hold it,
or :data:`~serve_app.admission.fair.DEFAULT_TENANT` for ``auth.api_key``. With no key
configured at all, every request is the default tenant and needs no key. Tenants share each
replica's budget by weight (:mod:`serve_app.admission.fair`).
"""

from __future__ import annotations

import os

from pydantic import BaseModel, ConfigDict, Field, model_validator

from serve_app.admission.fair import DEFAULT_TENANT, TenantQuota
from serve_app.admission.priority import Priority


class TenantConfig(BaseModel):
    """One tenant: who it is, how it is recognised, its share."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$", description="The tenant's name, in "
        "logs, metrics' `tenant` label and the `X-Tenant` response header.")
    api_keys: tuple[str, ...] = Field(
        (), description="Its bearer keys (`Authorization: Bearer <key>`).")
    api_key_env: str = Field(
        "", description="An environment variable holding more of its keys, comma-separated "
        "(keeps them out of the config file).")
    weight: float = Field(
        1.0, gt=0, allow_inf_nan=False, description="Its share of each replica's device "
        "memory-time against the other backlogged tenants (byte-seconds per unit of weight).")
    max_share: float = Field(
        1.0, gt=0, le=1, description="Quota: the largest share of each replica's budget its "
        "requests may hold and wait for at once; more is refused with 429 `tenant_quota`.")
    max_waiting: int | None = Field(
        None, ge=0, description="Quota: the most of its requests that may wait on each "
        "replica; more is refused with 429 `tenant_quota`. Unset: no bound but the queue's.")
    priority: Priority | None = Field(
        None, description="Its requests' priority class when they name none (`Prefer: "
        "priority=...`): `interactive` (admitted first) or `batch` (admitted only while no "
        "interactive request waits). Unset: `interactive`, and `batch` for durable jobs.")

    def resolved_keys(self) -> tuple[str, ...]:
        """``api_keys`` and those of ``api_key_env``, stripped, empty ones left out."""
        from_env = os.environ.get(self.api_key_env, "") if self.api_key_env else ""
        keys = (k.strip() for k in (*self.api_keys, *from_env.split(",")))
        return tuple(k for k in keys if k)


class AuthConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    api_key: str = Field(
        "", description="Bearer key clients must send (`Authorization: Bearer <key>`) on every "
        "route but /healthz and /readyz. Empty: no key (unless `api_key_env` names one). Its "
        "requests are the `default` tenant's.")
    api_key_env: str = Field(
        "VRAMGATE_API_KEY", description="Environment variable read for the key when `api_key` "
        "is empty (keeps the key out of the config file).")
    tenants: tuple[TenantConfig, ...] = Field(
        (), description="Tenants, each with its own keys and weight. A key configured "
        "anywhere makes every route but the probes need one.")

    def resolved_key(self) -> str:
        """The configured key: ``api_key``, else the environment variable, else ``""``."""
        return self.api_key or os.environ.get(self.api_key_env, "")

    def tenant_keys(self) -> dict[str, str]:
        """Every key and its tenant's name (``auth.api_key``'s: ``default``); empty: no key
        is needed.

        Raises:
            ValueError: a key of two tenants.
        """
        keys: dict[str, str] = {}
        named = [(DEFAULT_TENANT, (self.resolved_key(),) if self.resolved_key() else ()),
                 *((t.name, t.resolved_keys()) for t in self.tenants)]
        for name, tenant_keys in named:
            for key in tenant_keys:
                if keys.setdefault(key, name) != name:
                    raise ValueError(f"a key of tenant {keys[key]!r} is also one of "
                                     f"{name!r}: each key names one tenant")
        return keys

    def weights(self) -> dict[str, float]:
        """Each tenant's weight (the default tenant weighs 1)."""
        return {t.name: t.weight for t in self.tenants}

    def quotas(self) -> dict[str, TenantQuota]:
        """Each tenant's quota, where it has one."""
        return {t.name: TenantQuota(t.max_share, t.max_waiting) for t in self.tenants
                if t.max_share < 1.0 or t.max_waiting is not None}

    def priorities(self) -> dict[str, Priority]:
        """Each tenant's configured priority class, where it has one."""
        return {t.name: t.priority for t in self.tenants if t.priority is not None}

    @model_validator(mode="after")
    def _check_tenants(self) -> AuthConfig:
        names = [t.name for t in self.tenants]
        if len(set(names)) != len(names):
            raise ValueError(f"tenants: names must be unique, got {names}")
        if DEFAULT_TENANT in names and self.resolved_key():
            raise ValueError(f"tenants: {DEFAULT_TENANT!r} is auth.api_key's tenant; name "
                             "the tenant otherwise or move the key into its api_keys")
        self.tenant_keys()
        return self
