"""Cache policies by name, the one list of `--cache` modes. Each module of engine/kvcache/policies/
registers its layer class here (`@register("name")`); `discover` imports every such module, so a
new policy is a new file there, with no import list to edit. `--cache` lists the policies by their
`listed` place (then by name). Whatever else knows the modes asks this registry and the classes'
declarations (engine.kvcache.base.CacheLayer's ClassVars), never a list of names: CacheConfig's
mode is turned into its class by `policy` once, where a run starts (the config sits below the
caches, so it cannot know them), `--cache`'s help is `describe`, the planner's columns are the
classes' `plan_column` and their memory their `plan_sizing`, the document store's key the layers'
`store_key`."""
from __future__ import annotations

import importlib
import pkgutil

from engine.errors import BadArgument
from engine.kvcache.base import CacheLayer

POLICIES: dict[str, type] = {}
PACKAGE = "engine.kvcache.policies"
LAST = 100  # the place of a policy that names none


def register(name: str):
    """Class decorator: make a cache-layer class the policy for `--cache name` (its `policy`; its
    `plan_mode`, the planner's column a run of it is sized by, is its own name unless it names one).
    A class that leaves a hook of engine.kvcache.base.CacheLayer abstract is refused here, when its
    module is imported, not at its first decode."""

    def add(cls: type) -> type:
        if name in POLICIES:
            raise ValueError(f"cache policy {name!r} is registered twice")
        missing = sorted(getattr(cls, "__abstractmethods__", ()))
        if missing:
            raise TypeError(f"cache policy {name!r} ({cls.__name__}) does not define {', '.join(missing)}")
        if cls.plan_column and cls.plan_sizing.__func__ is CacheLayer.plan_sizing.__func__:
            raise TypeError(f"cache policy {name!r} ({cls.__name__}) has a plan column but no plan_sizing")
        cls.policy = name
        cls.plan_mode = cls.plan_mode or name
        POLICIES[name] = cls
        ranked = sorted(POLICIES.items(), key=lambda item: (listed(item[1]), item[0]))
        POLICIES.clear()
        POLICIES.update(ranked)
        return cls

    return add


def listed(cls: type) -> int:
    """A policy's place in `--cache`'s list: its own `listed` (not a parent's), else after the others."""
    return cls.__dict__.get("listed", LAST)


def discover() -> None:
    """Import every module of engine/kvcache/policies/ (each registers its policy)."""
    package = importlib.import_module(PACKAGE)
    for module in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{PACKAGE}.{module.name}")


def names() -> tuple[str, ...]:
    """The registered modes, in `--cache`'s order."""
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
