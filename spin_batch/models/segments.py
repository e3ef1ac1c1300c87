"""The packed (decomposed) batch: one flat token batch made of per-slot segments.

A segment is the run of new tokens one slot feeds to a forward: a prefill chunk, a single
decode token, or a verify run (last committed token + gamma draft tokens). Segments are laid
end to end in a flat batch of N tokens; nothing is padded to the longest segment or the
longest context. Each segment attends to its own slot's cache plus itself (causally).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Segments:
    slots: list[int]  # [S] cache slot that each segment reads and writes
    starts: list[int]  # [S + 1] offset of each segment in the flat batch; starts[-1] == N
    cache_lens: list[int]  # [S] tokens already in the slot's cache before this forward
    device: torch.device | str = "cpu"
    slot_list: list[int] = field(init=False, repr=False)  # [N] slot of each flat token
    position_list: list[int] = field(init=False, repr=False)  # [N] absolute position of each flat token

    def __post_init__(self) -> None:
        if len(self.starts) != len(self.slots) + 1 or len(self.cache_lens) != len(self.slots):
            raise ValueError("Segments: starts must have S + 1 entries and cache_lens S entries")
        slot_list: list[int] = []
        pos_list: list[int] = []
        for slot, a, b, c in zip(self.slots, self.starts[:-1], self.starts[1:], self.cache_lens):
            slot_list.extend([slot] * (b - a))
            pos_list.extend(range(c, c + b - a))
        self.slot_list, self.position_list = slot_list, pos_list
        self._tensors: tuple[torch.Tensor, torch.Tensor] | None = None

    def _device_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        # Made on first use: a forward replayed from a CUDA graph copies the lists into its own
        # buffers and never needs these (on a GPU each is a host-to-device copy).
        if self._tensors is None:
            both = torch.tensor([self.slot_list, self.position_list], dtype=torch.long).to(self.device)
            self._tensors = (both[0], both[1])
        return self._tensors

    @property
    def token_slots(self) -> torch.Tensor:
        """[N] long: slot of each flat token, on the segments' device."""
        return self._device_tensors()[0]

    @property
    def positions(self) -> torch.Tensor:
        """[N] long: absolute position of each flat token, on the segments' device."""
        return self._device_tensors()[1]

    def packed_index(self) -> torch.Tensor:
        """[2 N + 3 S + 1] long, on the host: token slots, positions, then the segment table (slots,
        starts, cache lengths). The Triton path copies it to the device in one transfer
        (LlamaModel.kernel_hidden reads it back apart)."""
        return torch.tensor(self.slot_list + self.position_list + self.slots + self.starts + self.cache_lens,
                            dtype=torch.long)

    @classmethod
    def build(cls, parts: list[tuple[int, int, int]], device: torch.device | str = "cpu") -> "Segments":
        """parts: (slot, num_new_tokens, cache_len) per segment, in flat-batch order."""
        starts = [0]
        for _, n, _ in parts:
            starts.append(starts[-1] + n)
        return cls([p[0] for p in parts], starts, [p[2] for p in parts], device)

    @property
    def num_segments(self) -> int:
        return len(self.slots)

    @property
    def num_tokens(self) -> int:
        return self.starts[-1]

    def lengths(self) -> list[int]:
        return [b - a for a, b in zip(self.starts[:-1], self.starts[1:])]

    def last_rows(self) -> list[int]:
        """Flat index of each segment's last token (where the next-token logits live)."""
        return [b - 1 for b in self.starts[1:]]

    def padded_tokens(self) -> int:
        """Query x key cells a padded [S, max_new] x [max_context] batch would have cost."""
        if not self.slots:
            return 0
        lens = self.lengths()
        max_ctx = max(c + n for c, n in zip(self.cache_lens, lens))
        return len(self.slots) * max(lens) * max_ctx

    def packed_tokens(self) -> int:
        """Query x key cells the packed batch actually computes."""
        return sum(n * (c + n) for c, n in zip(self.cache_lens, self.lengths()))
