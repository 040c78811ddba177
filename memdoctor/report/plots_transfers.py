"""Charts of the transfers section: bytes moved per step, and the PCIe throughput samples."""

from __future__ import annotations

from typing import Any

import matplotlib

from memdoctor.report.plots import _RC, _figure, byte_unit, svg_data_uri

H2D_COLOR = "#4e79a7"
D2H_COLOR = "#f28e2b"


def bytes_per_step(steps: list[dict[str, Any]]) -> str | None:
    """Grouped bars: host-to-device and device-to-host bytes of each profiled step; None when nothing
    moved."""
    largest = max((max(s["h2d_bytes"], s["d2h_bytes"]) for s in steps), default=0)
    if largest <= 0:
        return None
    scale, unit = byte_unit(largest)
    with matplotlib.rc_context(_RC):
        fig = _figure(7.0, 2.4)
        ax = fig.axes[0]
        x = list(range(len(steps)))
        ax.bar(
            [i - 0.2 for i in x],
            [s["h2d_bytes"] / scale for s in steps],
            0.4,
            color=H2D_COLOR,
            label="host to device",
        )
        ax.bar(
            [i + 0.2 for i in x],
            [s["d2h_bytes"] / scale for s in steps],
            0.4,
            color=D2H_COLOR,
            label="device to host",
        )
        ax.set_xticks(x, [str(s["step"]) for s in steps])
        ax.set_xlabel("step")
        ax.set_ylabel(unit)
        ax.grid(axis="y", color="#dddddd", linewidth=0.6)
        ax.legend(loc="lower right", frameon=False, ncols=2, bbox_to_anchor=(1.0, 1.0))
    return svg_data_uri(fig)


def pcie_throughput(samples: list[tuple[float, float, float]]) -> str | None:
    """NVML's PCIe throughput over the run: RX (host to device) and TX (device to host); None without
    samples."""
    if not samples:
        return None
    scale, unit = byte_unit(max(max(tx, rx) for _, tx, rx in samples) or 1)
    t = [s[0] / 1000.0 for s in samples]
    with matplotlib.rc_context(_RC):
        fig = _figure(9.0, 2.4)
        ax = fig.axes[0]
        ax.plot(
            t, [s[2] / scale for s in samples], color=H2D_COLOR, linewidth=1.0, label="RX: host to device"
        )
        ax.plot(
            t, [s[1] / scale for s in samples], color=D2H_COLOR, linewidth=1.0, label="TX: device to host"
        )
        ax.set_xlabel("seconds since profiling started")
        ax.set_ylabel(f"{unit}/s")
        ax.set_ylim(bottom=0)
        ax.grid(axis="y", color="#dddddd", linewidth=0.6)
        ax.legend(loc="lower right", frameon=False, ncols=2, bbox_to_anchor=(1.0, 1.0))
    return svg_data_uri(fig)
