"""What every config section shares: the error type, the section base class, resource pools.

Owns: `ConfigError`, `_Section` (unknown keys rejected, naming the key), `ResourcePool` (which
Ray nodes may host a component), and the check that an optional extra is installed.

Must never: import a component or another config module.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator


class ConfigError(ValueError):
    """A configuration value is invalid. The message names the field path and the bad value."""


class _Section(BaseModel):
    # Unknown keys are typos until proven otherwise: reject them, naming the key.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)


# Ray's own resource names are set by the components' num_cpus / num_gpus fields, not by a pool.
_RAY_BUILTIN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")
_LABEL_VALUE = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
_LABEL_SELECTOR = re.compile(rf"^!?(in\({_LABEL_VALUE}(, ?{_LABEL_VALUE})*\)|{_LABEL_VALUE})$")


def _need_package(module: str, extra: str) -> None:
    """Fail at load, naming the field, when an optional extra the config asks for is not installed."""
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise ValueError(f"needs the `{module}` package, which is not installed: pip install 'asyncrl[{extra}]'")


class ResourcePool(_Section):
    """Which Ray nodes may host one component (its replicas, ranks or workers). Empty = any node.

    A node qualifies when it offers every custom resource (quantities are asked per replica / rank /
    worker and consumed while it runs) and carries every label. Checked against the live cluster
    when the app is built (asyncrl/cluster.py): a pool no live node offers fails there, naming the field.
    """

    resources: dict[str, float] = Field(
        default_factory=dict, description="Ray custom resources asked per replica / rank / worker, e.g. "
        "{inference_node: 0.1}; nodes offer them with `ray start --resources='{\"inference_node\": 1}'`.")
    labels: dict[str, str] = Field(
        default_factory=dict, description="Ray node-label selector, e.g. {pool: inference}; nodes get labels with "
        "`ray start --labels=pool=inference`. A value may be `v`, `!v`, `in(a,b)` or `!in(a,b)` (Ray's label selectors).")

    @field_validator("resources")
    @classmethod
    def _custom_resources(cls, value: dict[str, float]) -> dict[str, float]:
        for name, amount in value.items():
            if name in _RAY_BUILTIN_RESOURCES:
                raise ValueError(f"{name!r} is set by the component's num_cpus / num_gpus field, not by a pool")
            if not isinstance(amount, (int, float)) or isinstance(amount, bool) or not amount > 0:
                raise ValueError(f"{name}={amount!r} must be a positive number")
            if amount > 1 and amount != int(amount):
                raise ValueError(f"{name}={amount!r}: Ray accepts a fraction only below 1 (or a whole number)")
        return value

    @field_validator("labels")
    @classmethod
    def _selectors(cls, value: dict[str, str]) -> dict[str, str]:
        for key, selector in value.items():
            if not isinstance(selector, str) or not _LABEL_SELECTOR.match(selector):
                raise ValueError(f"{key}={selector!r} is not a label selector (`v`, `!v`, `in(a,b)`, `!in(a,b)`)")
        return value

    def is_set(self) -> bool:
        return bool(self.resources or self.labels)

    def actor_options(self) -> dict[str, Any]:
        """The Ray actor options (Serve `ray_actor_options` too) that place on this pool."""
        out: dict[str, Any] = {}
        if self.resources:
            out["resources"] = dict(self.resources)
        if self.labels:
            out["label_selector"] = dict(self.labels)
        return out
