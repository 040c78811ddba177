"""The device layer: every touch of CUDA and NVML (devices.py, nvml.py); FakeDevice stands in on a CPU.
Imports only the base modules; knows nothing of modules or plans (docs/architecture.md).
"""

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
