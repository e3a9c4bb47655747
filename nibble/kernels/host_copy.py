"""Host-to-device copies that never make the host wait for the stream.

A copy from pageable host memory may synchronise with the stream before it starts; the engine queues a
step while the one before it runs, and eager prefills send their launch metadata every layer, so small host
tensors go through pinned memory with a non-blocking copy instead.
"""

from __future__ import annotations

import torch


def to_device_async(x: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`x` on `device`: a CPU tensor headed for a GPU through pinned memory, without waiting; otherwise `.to`."""
    device = torch.device(device)
    if device.type == "cpu" or x.device.type != "cpu":
        return x.to(device)
    return x.pin_memory().to(device, non_blocking=True)
