"""The packed (decomposed) batch: one flat token batch made of per-slot segments.

A segment is the run of new tokens one slot feeds to a forward: a prefill chunk, a single
decode token, or a verify run (last committed token + gamma draft tokens). Segments are laid
end to end in a flat batch of N tokens; nothing is padded to the longest segment or the
longest context. Each segment attends to its own slot's cache plus itself (causally).

A segment may instead be a token tree (`parents`, opt-in; the loop's verify segment of a slot whose
drafter proposed a tree): token i of a tree segment is written to its slot's cache at
row cache_len + i (scratch order), takes RoPE position cache_len + depth(i), and attends to the
slot's rows [0, cache_len) plus its own ancestors and itself only. The torch attention (attention.py),
the C attention and decoder (cpu_decoder.c) and the Triton kernels (spin_kernels, eagerly: no CUDA
graph) honour trees, the last two trees of at most 64 tokens.
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
    # [S] per segment: None for an ordinary segment; for a tree segment of n tokens, n ints: the parent
    # of token i among the segment's tokens (-1 for token 0, the last committed token; a parent
    # precedes its children). None here: no tree segment at all.
    parents: list[list[int] | None] | None = None
    slot_list: list[int] = field(init=False, repr=False)  # [N] slot of each flat token
    position_list: list[int] = field(init=False, repr=False)  # [N] RoPE position of each flat token
    row_list: list[int] = field(init=False, repr=False)  # [N] cache row each flat token is written to
    trees: list[int] = field(init=False, repr=False)  # indices of the tree segments, in order

    def __post_init__(self) -> None:
        if len(self.starts) != len(self.slots) + 1 or len(self.cache_lens) != len(self.slots):
            raise ValueError("Segments: starts must have S + 1 entries and cache_lens S entries")
        if self.parents is not None and len(self.parents) != len(self.slots):
            raise ValueError("Segments: parents must have S entries (None for an ordinary segment)")
        slot_list: list[int] = []
        pos_list: list[int] = []
        for slot, a, b, c in zip(self.slots, self.starts[:-1], self.starts[1:], self.cache_lens):
            slot_list.extend([slot] * (b - a))
            pos_list.extend(range(c, c + b - a))
        self.slot_list, self.position_list, self.row_list = slot_list, pos_list, pos_list
        self.trees = [] if self.parents is None else [i for i, p in enumerate(self.parents) if p is not None]
        if self.trees:
            self._place_trees()
        self._tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def _place_trees(self) -> None:
        """Tree segments: rows stay cache_len + i, RoPE positions become cache_len + depth(i)."""
        pos_list = list(self.row_list)
        for i in self.trees:
            a, b, c = self.starts[i], self.starts[i + 1], self.cache_lens[i]
            problem = tree_problem(self.parents[i], b - a)
            if problem:
                raise ValueError(f"Segments: segment {i}: {problem}")
            pos_list[a:b] = [c + d for d in tree_depths(self.parents[i])]
        self.position_list = pos_list

    def _device_tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # Made on first use: a forward replayed from a CUDA graph copies the lists into its own
        # buffers and never needs these (on a GPU each is a host-to-device copy).
        if self._tensors is None:
            lists = [self.slot_list, self.position_list] + ([self.row_list] if self.trees else [])
            both = torch.tensor(lists, dtype=torch.long).to(self.device)
            pos = both[1]
            self._tensors = (both[0], pos, both[2] if self.trees else pos)
        return self._tensors

    @property
    def token_slots(self) -> torch.Tensor:
        """[N] long: slot of each flat token, on the segments' device."""
        return self._device_tensors()[0]

    @property
    def positions(self) -> torch.Tensor:
        """[N] long: RoPE position of each flat token, on the segments' device (cache_len + i, or
        cache_len + depth(i) in a tree segment)."""
        return self._device_tensors()[1]

    @property
    def rows(self) -> torch.Tensor:
        """[N] long: cache row each flat token's K/V is written to (cache_len + i); the same tensor as
        positions unless some segment is a tree."""
        return self._device_tensors()[2]

    @property
    def has_trees(self) -> bool:
        return bool(self.trees)

    def is_tree(self, i: int) -> bool:
        return self.parents is not None and self.parents[i] is not None

    def tree_mask(self, i: int) -> torch.Tensor:
        """[n, n] bool, on the segments' device, for tree segment i: entry (q, k) is whether token k is
        token q or one of its ancestors."""
        return ancestor_mask(self.parents[i]).to(self.device)

    def packed_index(self) -> torch.Tensor:
        """[2 N + 3 S + 1] long, on the host: token slots, positions, then the segment table (slots,
        starts, cache lengths). The Triton path copies it to the device in one transfer
        (LlamaModel.kernel_hidden reads it back apart)."""
        return torch.tensor(self.slot_list + self.position_list + self.slots + self.starts + self.cache_lens,
                            dtype=torch.long)

    @classmethod
    def build(cls, parts: list[tuple[int, int, int]], device: torch.device | str = "cpu",
              parents: list[list[int] | None] | None = None) -> "Segments":
        """parts: (slot, num_new_tokens, cache_len) per segment, in flat-batch order; parents as the field."""
        starts = [0]
        for _, n, _ in parts:
            starts.append(starts[-1] + n)
        return cls([p[0] for p in parts], starts, [p[2] for p in parts], device, parents)

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


# -- token trees ------------------------------------------------------------------------------


def tree_problem(parents: list[int], n: int) -> str | None:
    """Why `parents` is not a tree over a segment of n tokens, or None."""
    if len(parents) != n:
        return f"parents has {len(parents)} entries for {n} tokens"
    if n == 0 or parents[0] != -1:
        return "token 0 (the last committed token) is the root: its parent must be -1"
    bad = next((i for i in range(1, n) if not 0 <= parents[i] < i), None)
    if bad is not None:
        return f"token {bad}: parent {parents[bad]} must be an earlier token of the segment (0..{bad - 1})"
    return None


def tree_depths(parents: list[int]) -> list[int]:
    """[n] depth of each token (0 for the root); parents as checked by tree_problem."""
    depths: list[int] = []
    for p in parents:
        depths.append(0 if p < 0 else depths[p] + 1)
    return depths


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    """[n, n] bool: entry (q, k) is whether token k is token q or one of its ancestors."""
    n = len(parents)
    mask = torch.eye(n, dtype=torch.bool)
    for q in range(1, n):
        mask[q] |= mask[parents[q]]
    return mask
