"""Peak memory per log window, for the step line and `mem_*` metrics.

Protocol: on CUDA the caching allocator's peak allocated/reserved bytes since the last log; on CPU the
process's peak resident set size (`VmHWM`, reset after every log through /proc/self/clear_refs). The
logger reads the peak (`peak_gib`) and then resets it, so each log reports its own window.
"""

from __future__ import annotations

import torch


class MemoryMonitor:
    """Peak memory since the last `reset()`, in GiB."""

    def __init__(self, device: torch.device):
        self.device = device
        self.kind = "cuda max allocated" if device.type == "cuda" else "cpu peak RSS (VmHWM)"
        self.capacity = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
        self.reset()

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
            except OSError:
                pass

    def peak_gib(self) -> tuple[float, float | None]:
        """(peak GiB, peak reserved GiB on CUDA / None on CPU)."""
        if self.device.type == "cuda":
            return (
                torch.cuda.max_memory_allocated(self.device) / 2**30,
                torch.cuda.max_memory_reserved(self.device) / 2**30,
            )
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) / 2**20, None
        except OSError:
            pass
        return 0.0, None
