"""Pinned host staging of the fast runner's step inputs: all of a step's host values go to the GPU in one
copy from a pinned buffer. `HostInputs` is the fixed layout a captured decode graph reads
(engine/cuda_graphs.py); `PinnedStaging` the growing buffer of an eager step (engine/fast_model_runner.py).
Invariant: two host buffers take turns, and one is refilled only once its last copy can no longer read it.
"""

from __future__ import annotations

import numpy as np
import torch


class HostInputs:
    """A decode step's host inputs in one pinned buffer (int64 part, then float32 temperatures), copied to
    the device buffer in one go. Two host buffers take turns: the host fills step n+1's while the copy
    of step n's may still be queued (step n-1's read-back, which the host has waited for, precedes it)."""

    def __init__(self, max_batch: int, width: int, device: torch.device):
        m = max_batch
        self.num_ints = 5 * m + 1 + m * width
        num_bytes = self.num_ints * 8 + m * 4
        self.hosts = [torch.zeros(num_bytes, dtype=torch.uint8).pin_memory() for _ in range(2)]
        self.dev = torch.zeros(num_bytes, dtype=torch.uint8, device=device)
        self.turn = 0
        # whose block table each row of each host buffer holds: rows are rewritten only when it changed
        self.row_keys: list[list[tuple | None]] = [[None] * m for _ in range(2)]
        dev_ints = self.dev[: self.num_ints * 8].view(torch.long)
        self.temps_B = self.dev[self.num_ints * 8 :].view(torch.float32)
        # ids known on the host | row of a pending id in tokens_B (-1: none) | positions | slots | context
        # lengths | sampling seed | block tables
        self.ids, self.src = dev_ints[:m], dev_ints[m : 2 * m]
        self.positions, self.slots = dev_ints[2 * m : 3 * m], dev_ints[3 * m : 4 * m]
        self.context_lens, self.seed = dev_ints[4 * m : 5 * m], dev_ints[5 * m : 5 * m + 1]
        self.tables = dev_ints[5 * m + 1 :].view(m, width)

    def next_host(self) -> tuple[torch.Tensor, np.ndarray, np.ndarray, list[tuple | None]]:
        """The host buffer to fill for the next step: (tensor, int64 view, float32 view, its row keys)."""
        self.turn ^= 1
        host = self.hosts[self.turn]
        ints = host[: self.num_ints * 8].view(torch.long).numpy()
        return host, ints, host[self.num_ints * 8 :].view(torch.float32).numpy(), self.row_keys[self.turn]


class PinnedStaging:
    """An eager step's host inputs (int64 values, then float32 values) in one pinned buffer, copied to a
    device buffer in one go. Fresh pinned tensors per step cost about a millisecond each to allocate; these
    buffers grow to the largest step seen and are kept. Two host buffers take turns, and a buffer is
    refilled only once its last copy has run (its event; two steps back, so it has). The device buffer
    is rewritten by the next step's copy, which the stream orders after this step's kernels."""

    def __init__(self, device: torch.device):
        self.device = device
        self.hosts: list[torch.Tensor | None] = [None, None]
        self.events: list[torch.cuda.Event | None] = [None, None]
        self.dev = torch.empty(0, dtype=torch.uint8, device=device)
        self.turn = 0

    def copy(self, ints: np.ndarray, floats: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Device copies of `ints` (int64) and `floats` (float32), in that order in one buffer."""
        int_bytes = len(ints) * 8
        num_bytes = int_bytes + len(floats) * 4
        self.turn ^= 1
        host, event = self.hosts[self.turn], self.events[self.turn]
        if event is not None:
            event.synchronize()
        if host is None or host.numel() < num_bytes:
            capacity = 1 << (num_bytes - 1).bit_length()
            host = self.hosts[self.turn] = torch.empty(capacity, dtype=torch.uint8, pin_memory=True)
        if self.dev.numel() < num_bytes:
            self.dev = torch.empty(host.numel(), dtype=torch.uint8, device=self.device)
        array = host.numpy()
        array[:int_bytes].view(np.int64)[:] = ints
        array[int_bytes:num_bytes].view(np.float32)[:] = floats
        dev = self.dev[:num_bytes]
        dev.copy_(host[:num_bytes], non_blocking=True)
        self.events[self.turn] = torch.cuda.Event()
        self.events[self.turn].record()
        return dev[:int_bytes].view(torch.long), dev[int_bytes:].view(torch.float32)
