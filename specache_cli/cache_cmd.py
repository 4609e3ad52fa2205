"""`specache cache ls|rm|clear|verify`: the persistent document KV store (engine/docstore/store.py).

Entries are listed least recently used first (the next to be evicted under the size cap)."""
from __future__ import annotations

import sys
import time
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from engine.docstore.store import DocStore, check_folder, max_bytes_from
from engine.docstore.verify import entry_damage
from engine.errors import BadArgument, InputNotFound
from specache_cli.console import err_console, guarded, print_warning
from specache_cli.render import emit_json

cache_app = typer.Typer(name="cache", help="The document KV store: list, remove, clear, verify (sizes included).",
                        no_args_is_help=True)

CAP = typer.Option(None, "--cache-max-gb", help="The size cap (default: $SPECACHE_CACHE_MAX_GB, else 20); "
                   "entries over it are evicted, least recently used first, as on every open of the store.")


def _note(message: str) -> None:
    err_console.print(message, highlight=False, soft_wrap=True, markup=False)


def _store(cache_max_gb: Optional[float] = None) -> DocStore:
    """The store as every command opens it: the cap applied, debris of killed writes swept,
    anything in the folder that is not an entry reported on stderr and skipped."""
    try:
        store = DocStore(max_bytes=max_bytes_from(cache_max_gb), warn=print_warning, note=_note)
    except ValueError as exc:
        raise BadArgument(f"--cache-max-gb: {exc}") from None
    check_folder(store.root)
    store.tidy()
    return store


def human(nbytes: int | None) -> str:
    """Bytes in decimal units (the cap is given in GB)."""
    if nbytes is None:
        return "-"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes} B"


def _ago(t: float) -> str:
    s = max(0.0, time.time() - t)
    for unit, scale in (("d", 86400), ("h", 3600), ("min", 60)):
        if s >= scale:
            return f"{s / scale:.0f} {unit} ago"
    return f"{s:.0f} s ago"


def _settings(meta: dict) -> str:
    mode = meta.get("mode", "?")  # the store key's fields (engine.generate.prefixes.store_settings) say what it has
    windows = " +windows" if meta.get("windows") else ""
    if meta.get("bits") is not None:
        return f"{mode} {meta.get('bits')}b g{meta.get('group')} R{meta.get('residual')} S{meta.get('sinks')}{windows}"
    if meta.get("residual") is not None:
        return f"{mode} {meta.get('residual')} S{meta.get('sinks')}{windows}"
    return mode + windows


def ls_cmd(json_out: bool = typer.Option(False, "--json", help="Print the listing as JSON."),
           cache_max_gb: Optional[float] = CAP) -> None:
    """List the stored documents: key, document, model, settings, tokens, size, last use."""
    store = _store(cache_max_gb)
    entries = store.entries()
    total = sum(e.bytes for e in entries)
    parts, part_bytes = len(store.part_files()), store.part_bytes()  # writes in progress count on disk too
    if json_out:
        emit_json({"path": str(store.root), "bytes": total, "max_bytes": store.max_bytes,
                   "unfinished_writes": parts, "unfinished_bytes": part_bytes,
                   "entries": [{"key": e.key, "bytes": e.bytes, "tokens": e.tokens, "last_used": round(e.last_used, 3),
                                "label": e.meta.get("label"), "model": e.meta.get("model_name"),
                                "model_fingerprint": e.meta.get("model"), "mode": e.meta.get("mode"),
                                "dtype": e.meta.get("dtype"),
                                "bytes_per_token": round(e.bytes / e.tokens, 1) if e.tokens else None,
                                "unreadable": bool(e.meta.get("unreadable"))} for e in entries]}, lines=False)
        return
    console = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 200)  # pipes: no truncated columns
    table = Table(box=None, pad_edge=False)
    for col, justify in (("key", "left"), ("document", "left"), ("model", "left"), ("settings", "left"),
                         ("dtype", "left"), ("tokens", "right"), ("size", "right"), ("per token", "right"),
                         ("last used", "right")):
        table.add_column(col, justify=justify)
    for e in entries:
        if e.meta.get("unreadable"):
            table.add_row(e.key[:12], "(unreadable header)", "", "", "", "", human(e.bytes), "", _ago(e.last_used))
            continue
        table.add_row(e.key[:12], str(e.meta.get("label") or ""), str(e.meta.get("model_name") or ""),
                      _settings(e.meta), str(e.meta.get("dtype", "")), str(e.tokens), human(e.bytes),
                      human(e.bytes // e.tokens) if e.tokens else "-", _ago(e.last_used))
    if entries:
        console.print(table)
    writing = f"; {parts} write{'s' if parts != 1 else ''} in progress, {human(part_bytes)}" if parts else ""
    console.print(f"{len(entries)} entr{'y' if len(entries) == 1 else 'ies'}, {human(total)} of "
                  f"{human(store.max_bytes)} (cap) in {store.root}{writing}", highlight=False, markup=False)


def _chosen(known: list[str], prefixes: list[str]) -> list[str]:
    """The keys among `known` (the store's entries') named by key prefixes (at least 4 characters, each matching
    one entry)."""
    chosen = []
    for prefix in prefixes:
        if len(prefix) < 4:
            raise BadArgument(f"key prefix {prefix!r} is too short (at least 4 characters)")
        matches = [k for k in known if k.startswith(prefix.lower())]
        if not matches:
            raise InputNotFound(f"no store entry with key {prefix}")
        if len(matches) > 1:
            raise BadArgument(f"key prefix {prefix} matches {len(matches)} entries; give more characters")
        chosen.append(matches[0])
    return list(dict.fromkeys(chosen))


def rm_cmd(keys: list[str] = typer.Argument(..., help="Keys or unique key prefixes (as `specache cache ls` shows).")
           ) -> None:
    """Remove entries by key."""
    store = _store()
    chosen = _chosen([e.key for e in store.entries(with_meta=False)], keys)
    freed = store.remove(chosen)
    print(f"removed {len(chosen)} entr{'y' if len(chosen) == 1 else 'ies'} ({human(freed)})")


def verify_cmd(keys: Optional[list[str]] = typer.Argument(None, help="Keys or unique key prefixes (default: all)."),
               json_out: bool = typer.Option(False, "--json", help="Print the results as JSON.")) -> None:
    """Check every CRC of the entries, the exact rows' included (a load does not read those); a damaged entry is
    removed, as a load removes one, and rebuilt by the next run that needs it."""
    store = _store()
    entries = {e.key: e for e in store.entries()}
    chosen = _chosen(list(entries), keys) if keys else list(entries)
    results = []
    for i, key in enumerate(chosen, 1):
        entry = entries[key]
        _note(f"[{i}/{len(chosen)}] checking {key[:12]} ({human(entry.bytes)})")
        damage, seen = entry_damage(entry.path, key)
        if seen is not None and damage is not None:  # (a writer's new file under the same name is kept)
            store.delete_if_unchanged(entry.path, seen)
        results.append({"key": key, "label": entry.meta.get("label"), "bytes": entry.bytes, "damage": damage,
                        "removed": seen is not None and damage is not None})
    damaged = [r for r in results if r["damage"] is not None]
    if json_out:
        emit_json({"checked": len(results), "damaged": len(damaged), "entries": results}, lines=False)
        return
    for r in results:
        said = "ok" if r["damage"] is None else f"damaged ({r['damage']})" + ("; removed" if r["removed"] else "")
        print(f"{r['key'][:12]}  {r['label'] or ''}  {human(r['bytes'])}  {said}")
    print(f"{len(results)} checked, {len(damaged)} damaged, {sum(r['removed'] for r in results)} removed")


def clear_cmd() -> None:
    """Remove every entry (and unfinished writes)."""
    n, freed = _store().clear()
    print(f"removed {n} entr{'y' if n == 1 else 'ies'} ({human(freed)})")


cache_app.command("ls")(guarded(ls_cmd))
cache_app.command("rm")(guarded(rm_cmd))
cache_app.command("clear")(guarded(clear_cmd))
cache_app.command("verify")(guarded(verify_cmd))


def register(app: typer.Typer) -> None:
    app.add_typer(cache_app, name="cache")
