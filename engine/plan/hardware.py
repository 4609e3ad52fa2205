"""This machine as a hardware profile: the CUDA device 0 (its memory, a measured host-to-device
bandwidth), else the CPU with this machine's RAM as device memory."""
from __future__ import annotations

import math
from dataclasses import replace

from engine.errors import BadArgument
from engine.machine import machine_ram_bytes
from engine.plan.profiles import HardwareProfile, load_hardware, match_cuda_device

MIB = 1024**2


def measure_h2d_bandwidth(nbytes: int = 256 * MIB, repeats: int = 5) -> float:
    """Median pinned host -> device copy rate of the current CUDA device, GB/s (CUDA only)."""
    import torch

    if not torch.cuda.is_available():
        raise BadArgument("measuring host-to-device bandwidth needs a CUDA device")
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst.copy_(src, non_blocking=True)  # warm-up
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return nbytes / sorted(times)[len(times) // 2] / 1e9


def detect_hardware(measure: bool = True) -> HardwareProfile:
    """This machine: the CUDA device 0 (memory from mem_get_info, measured H2D bandwidth), else the CPU
    profile with this machine's RAM as device memory. Unrecognized GPUs get the cuda-generic profile."""
    import torch

    ram_total, ram_available = machine_ram_bytes()
    if not torch.cuda.is_available():
        cpu = load_hardware("cpu")
        return replace(cpu, device_memory_bytes=ram_total, free_memory_bytes=min(ram_available, ram_total),
                       host_ram_bytes=ram_total,
                       source=f"detected: no CUDA device; RAM as device memory ({cpu.source})")
    name = torch.cuda.get_device_name(0)
    free, total = torch.cuda.mem_get_info(0)
    base = match_cuda_device(name) or load_hardware("cuda-generic")
    h2d = base.h2d_gbps
    if measure:
        h2d = round(min(measure_h2d_bandwidth(), base.pcie_link_gbps or math.inf), 2)
    return replace(base, device_memory_bytes=total, free_memory_bytes=free, h2d_gbps=h2d,
                   host_ram_bytes=ram_total, source=f"detected: {name} ({base.source})")
