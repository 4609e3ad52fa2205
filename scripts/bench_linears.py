"""Micro-benchmark of a decode step's linears on the embedded model (engine/model/linears.py).

For 1, 2, 4 and 8 activation rows, times all 211 linears of SmolLM2-135M once each (what one
decode step of a batch does) three ways, taking turns: torch's ``x @ W^T`` (stock nn.Linear),
the native fp32 kernel, and the native kernel on the exactly packed weights (Q4_1 linears,
Q8_0 embedding/lm_head). Checks that the packed and fp32 kernels return the same floats.
Prints medians in ms per step, the machine's load average, the instruction set the native kernels
were built for ($SPECACHE_NATIVE_ARCH) and the path each row class takes in the engine (the
calibration, engine/native/calibrate.py), and the read bound: the time to read the packed weights
once at this machine's read bandwidth, measured as torch.sum over 512 MiB on the same thread count.

With --superblocks N (--q6k N) it times instead one decode call of a random GGUF weight [N, 4096] of
--kind Q6_K (the default; an output layer: N 128256 for a Llama 3 vocabulary), Q5_K, Q4_K, Q4_0, Q4_1,
Q8_0, Q5_0 or Q5_1 (N 14336: a Llama-3-8B MLP projection) held in the file's own blocks (engine.model.kquant_weights.Q6KWeight,
KQuantWeight, PackedWeight fmt 2 / 3 / 9 / 10 / 11), or F16 / BF16 held as they are (DenseWeight, fmt 13 / 12), three ways: the tiles rebuilt by torch and multiplied (the path without the native library), the
tiles rebuilt by the native specache_unpack and multiplied, and the native decode kernel on the
blocks; medians in ms and GB/s of block bytes, and whether the kernel gives the fp32 kernel's floats.
Q4_K, Q4_0, Q4_1 and Q8_0 add a fourth: the kernel on the affine4 / scaled8 records (fp32 scales) these
were held in before their own blocks (the same floats, 0.75 / 1.125 bytes a weight).

    python scripts/bench_linears.py [--rows 1 2 4 8] [--repeats 7] [--threads 1]
                                    [--superblocks 128256 [--kind Q6_K|Q5_K|Q4_K|Q4_0|Q4_1|Q8_0|Q5_0|Q5_1|F16|BF16]]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from scripts.make_random_gguf import random_blocks  # noqa: E402
from engine.model.gguf_tensors import held_from_raw  # noqa: E402
from engine.model.held_weights import PackedWeight, native_linear, packed_linear  # noqa: E402
from engine.model.linears import SkinnyLinear, packed_summary  # noqa: E402
from engine.model.loading import load_model  # noqa: E402
from engine.native import calibrate  # noqa: E402


def read_bandwidth(mib: int = 512, repeats: int = 5) -> float:
    """GB/s of torch.sum over a buffer much larger than the caches (best of `repeats`)."""
    buf = torch.ones(mib * 2**20 // 4)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t)
    return buf.numel() * 4 / best / 1e9


def random_superblocks(kind: str, n: int, k: int, seed: int = 0) -> PackedWeight:
    """A Q4_K / Q5_K / Q6_K weight [n, k] of random blocks, as scripts/make_random_gguf.py writes them."""
    q = GGMLQuantizationType[kind]
    if kind in ("F16", "BF16"):  # 16-bit weights as they are (a GGUF's F16 / BF16, a folder's safetensors)
        w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.02
        raw = w.to(torch.float16 if kind == "F16" else torch.bfloat16).view(torch.uint8).numpy()
        return held_from_raw(raw, q, n, k)
    return held_from_raw(random_blocks(q, n, k, np.random.default_rng(seed)), q, n, k)


FORMER = {"Q4_K": "affine4", "Q4_0": "affine4", "Q4_1": "affine4", "Q8_0": "scaled8"}  # held before their own blocks


def former_records(kind: str, held: PackedWeight) -> PackedWeight:
    """The weight as the affine4 (fp32 d, fp32 m, 16 bytes of nibbles per 32) or scaled8 (fp32 d, 32 int8)
    records the engine held it in before the file's own blocks; the same floats."""
    n = held.shape[0]
    if kind == "Q4_K":
        q, scale, minus = held.chunks(0, n)  # [n, nb, 32], [n, nb], [n, nb]
        d, m = scale, -minus
    else:  # the file's own blocks: their codes and scales
        codes, d, m = held.gguf_parts(0, n)
        if kind == "Q8_0":
            out = torch.cat([d[..., None].view(torch.uint8), codes], dim=-1)
            return PackedWeight(8, out.reshape(n, -1).contiguous(), held.shape)
        return PackedWeight(4, torch.cat([d[..., None].view(torch.uint8), m[..., None].view(torch.uint8), codes],
                                         dim=-1).reshape(n, -1).contiguous(), held.shape)
    nib = q[..., :16] | (q[..., 16:] << 4)
    rec = torch.cat([d[..., None].view(torch.uint8), m[..., None].view(torch.uint8), nib], dim=-1)
    return PackedWeight(4, rec.reshape(n, -1).contiguous(), held.shape)


class _TorchTiles:
    """A weight whose tiles torch rebuilds (torch_rows: what runs without the native library)."""

    def __init__(self, held: PackedWeight):
        self.shape, self.rows = held.shape, held.torch_rows


def bench_superblocks(kind: str, n: int, rows_list: list[int], repeats: int) -> None:
    """One decode call of a random superblock weight [n, 4096], three ways (module docstring)."""
    held = random_superblocks(kind, n, 4096)
    print(f"{kind} weight [{n}, 4096]: {held.nbytes / 1e6:.0f} MB of blocks ({held.nbytes * 8 / (n * 4096):.2f} bits "
          f"a weight; fp32 {n * 4096 * 4 / 1e6:.0f} MB)")
    ways_held = [("torch tiles", _TorchTiles(held)), ("native tiles", held), ("native kernel", held)]
    former = former_records(kind, held) if kind in FORMER else None
    if former is not None:  # also as the records it was held in before its own blocks
        assert torch.equal(former.unpack()[:512], held.rows(0, 512)), "the former records are other floats"
        print(f"  and as {FORMER[kind]} records: {former.nbytes / 1e6:.0f} MB")
    lins = {}
    for name, h in ways_held:
        lin = SkinnyLinear(4096, n, bias=False)
        lin.weight, lin.held = None, h
        lins[name] = lin
    ways = {"torch tiles": lambda x: lins["torch tiles"].tiled_forward(x, None),
            "native tiles": lambda x: lins["native tiles"].tiled_forward(x, None),
            "native kernel": lambda x: held.decode(x, None)}
    if former is not None:
        ways[f"{FORMER[kind]} kernel"] = lambda x: former.decode(x, None)
    print(f"{'rows':>4} " + " ".join(f"{w:>22}" for w in ways) + "   kernel == fp32 kernel")
    for rows in rows_list:
        x = torch.randn(rows, 4096)
        times = {w: [] for w in ways}
        for i in range(repeats):
            for name, fn in ways.items():
                if not name.endswith("kernel") and i >= max(3, repeats // 2):
                    continue  # the slow ways: fewer runs
                t = time.perf_counter()
                fn(x)
                times[name].append(time.perf_counter() - t)
        med = {w: statistics.median(v) for w, v in times.items()}
        part = held.rows(0, 512)  # the first 512 output rows, checked bit for bit
        same = torch.equal(held.decode(x, None)[:, :512], native_linear(x, part, None))
        print(f"{rows:>4} " + " ".join(f"{med[w] * 1000:>9.1f} ms {held.nbytes / med[w] / 1e9:>6.2f} GB/s" for w in ways)
              + f"   {same}")
    print(f"load average {os.getloadavg()[0]:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--superblocks", "--q6k", type=int, metavar="N",
                    help="time a random GGUF superblock weight [N, 4096] instead (see above)")
    ap.add_argument("--kind", default="Q6_K", choices=("Q4_K", "Q5_K", "Q6_K", "Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1",
                                                       "F16", "BF16"),
                    help="its format (--superblocks)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    print(f"CPU: {calibrate.describe_line()}")
    if args.superblocks:
        bench_superblocks(args.kind, args.superblocks, args.rows, args.repeats)
        return
    gbs = read_bandwidth()
    lm = load_model(device="cpu", dtype="float32")  # fp32 weights and their packed copy, side by side
    mods = [m for m in lm.model.modules() if isinstance(m, SkinnyLinear)]
    info = packed_summary(lm.model)
    print(f"{info['packed']} of {info['linears']} linears packed: {info['packed_bytes'] / 2**20:.0f} MiB "
          f"instead of {info['fp32_bytes'] / 2**20:.0f} MiB of fp32 weights")
    bound = info["packed_bytes"] / (gbs * 1e9) * 1000
    print(f"read bandwidth {gbs:.1f} GB/s ({args.threads} thread(s)): reading the packed weights once takes "
          f"{bound:.1f} ms, the fp32 ones {info['fp32_bytes'] / (gbs * 1e9) * 1000:.1f} ms")
    if not info["packed"]:
        sys.exit("no packed weights (native kernels unavailable or SPECACHE_PACK_WEIGHTS=0)")
    ways = {"torch x@W^T": lambda m, x: torch.nn.functional.linear(x, m.weight, m.bias),
            "native fp32": lambda m, x: native_linear(x, m.weight, m.bias),
            "native packed": lambda m, x: packed_linear(x, m.packed, m.bias)}
    print(f"{'rows':>4} " + " ".join(f"{w:>14}" for w in ways) + "   packed vs fp32 / torch   same floats   vs bound")
    for rows in args.rows:
        xs = {m.in_features: torch.randn(rows, m.in_features) for m in mods}
        times = {w: [] for w in ways}
        for _ in range(args.repeats):
            for name, fn in ways.items():
                t = time.perf_counter()
                for m in mods:
                    fn(m, xs[m.in_features])
                times[name].append(time.perf_counter() - t)
        med = {w: statistics.median(v) * 1000 for w, v in times.items()}
        same = all(torch.equal(packed_linear(xs[m.in_features], m.packed, m.bias),
                               native_linear(xs[m.in_features], m.weight, m.bias)) for m in mods if m.packed)
        print(f"{rows:>4} " + " ".join(f"{med[w]:>11.1f} ms" for w in ways)
              + f"   {med['native fp32'] / med['native packed']:.2f}x / {med['torch x@W^T'] / med['native packed']:.2f}x"
              + f"   {same}   packed {med['native packed'] / bound:.2f}x the read bound")
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
