"""Cache policies by name: each policy module registers its layer class here (`@register("name")`);
`engine.kvcache.make_cache` builds a cache from the registered class of `CacheConfig.mode`."""
from __future__ import annotations

POLICIES: dict[str, type] = {}


def register(name: str):
    """Class decorator: make a cache-layer class the policy for `--cache name`."""

    def add(cls: type) -> type:
        if name in POLICIES:
            raise ValueError(f"cache policy {name!r} is registered twice")
        cls.policy = name
        POLICIES[name] = cls
        return cls

    return add
