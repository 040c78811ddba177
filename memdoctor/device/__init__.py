"""The device layer: every touch of CUDA and NVML, so the rest of memdoctor runs on a CPU."""

from __future__ import annotations

from memdoctor.device.devices import (
    CudaDevice,
    Device,
    FakeDevice,
    default_device,
)

__all__ = [
    "CudaDevice",
    "Device",
    "FakeDevice",
    "default_device",
]
