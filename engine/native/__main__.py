"""Build the native guide kernels ahead of time: ``python -m engine.native [--force]``.

Prints the library's path and instruction set, then calibrates which decode linears take the
native kernel (engine/native/calibrate.py; once per library, about a second) unless
$SPECACHE_NATIVE_CALIBRATE is 0; exits 1 (with the reason on stderr) when it cannot be built,
in which case the torch kernels are used."""
from __future__ import annotations

import argparse
import sys

from engine import native
from engine.native import calibrate


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine.native", description=__doc__.splitlines()[0])
    ap.add_argument("--force", action="store_true", help="recompile even if a cached library exists")
    args = ap.parse_args(argv)
    try:
        path = native.build(force=args.force)
        native._load(path)
    except Exception as exc:
        print(f"native guide kernels not built ({type(exc).__name__}: {exc}); the torch kernels will be used",
              file=sys.stderr)
        return 1
    print(f"{path} ({native.isa()})")
    if calibrate.enabled():
        print("decode linears:", ", ".join(f"{k} {v}" for k, v in calibrate.paths().items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
