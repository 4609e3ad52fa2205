"""Cache policies by name, the one list of `--cache` modes: each policy module registers its layer
class here (`@register("name")`), and `engine/kvcache/__init__.py` imports every policy module, in
the order `--cache` lists them. Whatever else knows the modes asks this registry and the classes'
declarations (engine.kvcache.base.CacheLayer's ClassVars), never a list of names: CacheConfig's
mode is checked by `policy` (the config sits below the caches, so it cannot know them), `--cache`'s
help is `describe`, the planner's columns and sizing branches read the flags (engine.plan.planner),
the document store's key the layers' `store_key`."""
from __future__ import annotations

from engine.errors import BadArgument

POLICIES: dict[str, type] = {}


def register(name: str):
    """Class decorator: make a cache-layer class the policy for `--cache name` (its `policy`; its
    `plan_mode`, the planner's column a run of it is sized by, is its own name unless it names one)."""

    def add(cls: type) -> type:
        if name in POLICIES:
            raise ValueError(f"cache policy {name!r} is registered twice")
        cls.policy = name
        cls.plan_mode = cls.plan_mode or name
        POLICIES[name] = cls
        return cls

    return add


def names() -> tuple[str, ...]:
    """The registered modes, in registration order."""
    return tuple(POLICIES)


def policy(name: str) -> type:
    """The layer class registered for `--cache name`; BadArgument (exit 2) for a name not registered."""
    cls = POLICIES.get(name)
    if cls is None:
        raise BadArgument(f"--cache must be one of {', '.join(POLICIES)}, not {name!r}")
    return cls


def describe() -> str:
    """The modes as `--cache`'s help lists them: "a, b or c (its summary)"."""
    items = [f"{name} ({cls.summary})" if cls.summary else name for name, cls in POLICIES.items()]
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} or {items[-1]}"
