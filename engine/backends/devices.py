"""--device resolved to a torch device, in one place: its name checked against the devices present, and
"auto" taking CUDA where there is one. The run's preparation (engine.jobs.prepare) checks the flag before
anything loads; the loader (engine.model.loading) asks pick_device for the device it loads on. Neither tests
for CUDA itself: the backends' modules are where a device type is told apart."""
from __future__ import annotations

import re

import torch

from engine.errors import BadArgument, ModelLoadError

DEVICES = re.compile(r"auto|cpu|cuda(:\d+)?")  # what --device takes


def check_device(device: str) -> None:
    """--device, before anything is loaded: a name DEVICES takes (check_name), and CUDA (and its index) only where
    present (check_present)."""
    check_name(device)
    check_present(device)


def check_name(device: str) -> None:
    if not DEVICES.fullmatch(device):
        raise BadArgument(f"--device must be auto, cpu, cuda or cuda:N, not {device!r}")


def check_present(device: str) -> None:
    """A CUDA --device (and its index) only where there is one."""
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ModelLoadError(f"--device {device} was asked for but no CUDA device is available")
        index = int(device.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            raise BadArgument(f"--device {device}: there are {torch.cuda.device_count()} CUDA device(s)")


def pick_device(device: str) -> torch.device:
    """The torch device --device names: 'auto' takes CUDA when present, else the CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError("--device cuda was asked for but no CUDA device is available")
    return torch.device(device)
