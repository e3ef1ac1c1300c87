"""Acceptance replayed on the device step, for the speed-only bench (bench_speed.py): each verify step of
a slot accepts the next length of a recorded trace, whatever the target's argmax says.

A random-weight target accepts nothing, so a bench at the sizes GPU users run (Llama-3.1-8B shapes) cannot
measure acceptance; it measures speed. Replay makes the step commit what a real run accepted: row r's
accepted length is k = trace[cursor[slot] mod T] (capped by its draft count in the commit), and the verdicts
handed to the accept and commit kernel are the drafts for positions below k, a token that differs from the
draft at position k, and the target's own argmax elsewhere (the bonus token). The kernel then accepts exactly
min(k, drafted). Each slot's cursor starts at its own offset into the trace (slots do not move in lockstep)
and advances by one per step it is in; all of it on the device, no host read, fixed shapes: the step's graph
replays it. Never part of a real run: its output is not the target's text.
"""

from __future__ import annotations

import torch

from ..drafters.model import ModelDrafter
from ..drafters.ngram import NgramDrafter
from ..models.llama import LlamaModel
from ..sampling import SamplingParams
from .device_step import DeviceDrafting, DeviceLoop
from .settings import LoopSettings


class Replay:
    """A trace of accepted lengths [T] and a cursor per slot [P], on the device."""

    def __init__(self, trace: list[int], slots: int, vocab: int, device: torch.device):
        if not trace or min(trace) < 0:
            raise ValueError(f"a replayed trace needs at least one accepted length, each >= 0, got {trace[:8]}")
        self.vocab = vocab
        self.trace = torch.tensor(trace, dtype=torch.long, device=device)  # [T]
        T = len(trace)
        self.cursor = torch.tensor([(s * T) // max(slots, 1) for s in range(slots)], dtype=torch.long,
                                   device=device)  # [P]: slot s starts at its own offset

    def set_trace(self, trace: list[int]) -> None:
        """Replay another trace of the same length, in place (a captured graph keeps reading this buffer)."""
        if len(trace) != self.trace.shape[0]:
            raise ValueError(f"set_trace: {len(trace)} lengths for a buffer of {self.trace.shape[0]}")
        self.trace.copy_(torch.as_tensor(trace, dtype=torch.long))

    def lengths(self, rows: torch.Tensor) -> torch.Tensor:
        """[B] long: the accepted length each row replays at this step (before the commit's cap by its drafts)."""
        return self.trace[self.cursor[rows] % self.trace.shape[0]]

    def verdicts(self, rows: torch.Tensor, drafts: torch.Tensor, best: torch.Tensor) -> torch.Tensor:
        """[B, G + 1] long: the target tokens that make the commit accept each row's replayed length; advances the
        rows' cursors. rows [B], drafts [B, G], best [B, G + 1]: the target's argmax."""
        B, G1 = best.shape
        k = self.lengths(rows)  # [B]
        self.cursor[rows] = self.cursor[rows] + 1  # a padding row's scratch slot advances too: it is never read
        d = torch.nn.functional.pad(drafts.long(), (0, 1))  # [B, G + 1]: a draft per verified position
        j = torch.arange(G1, device=best.device)
        other = torch.where(best.long() == d, (d + 1) % self.vocab, best.long())  # differs from the draft there
        return torch.where(j < k[:, None], d, other)


class _NoText:
    """The tokenizer of a random target: its tokens have no text."""

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return ""


def replay_loop(target, slots: int, max_model_len: int, prompt_len: int, gamma: int,
                draft: LlamaModel | str | None) -> DeviceLoop:
    """A DeviceLoop for the speed-only bench: greedy, EOS ignored, no text; plain (draft None), n-gram drafts
    ("ngram") or a draft model's chains, at `gamma`. Its `replay` is the caller's to set."""
    s = LoopSettings(slots=slots, max_model_len=max_model_len, max_num_batched_tokens=max(512, prompt_len),
                     max_tokens=max_model_len, sampling=SamplingParams(), ignore_eos=True)
    if draft is None:
        return DeviceLoop(target, _NoText(), s)
    if draft == "ngram":
        return DeviceLoop(target, _NoText(), s, DeviceDrafting(gamma), NgramDrafter("ngram"))
    name = "draft"
    return DeviceLoop(target, _NoText(), s, DeviceDrafting(gamma), ModelDrafter(name, draft, draft.allocate_cache(1, 8)))
