"""Fixed-shape buckets for the device step (engine/device_step.py), and its graphs keyed by bucket.

A step verifies B rows of G + 1 tokens each: every slot in flight (padded up to a slot bucket, the
padding rows pointing at a scratch slot that is never live) with its last committed token and G
draft positions (padded up to a draft-width bucket; each row's own draft count masks the rest).
A handful of shapes therefore serve every step: with the default buckets, slots {1, 2, 4, 8, 16,
...} x draft widths {0, 4, 8, 16}. The rows' values (slots, positions, tokens) are computed on the
device from the step state, so no host list reaches the forward (PaddedSegments).

BucketGraphs runs a step body once per call: eagerly, or on CUDA replayed from a graph captured
for its bucket the second time the bucket is asked for (the first, eager call compiles the Triton
kernels and warms the allocator; capturing runs nothing, so the step's state advances once per
call either way). `asked` counts the calls per bucket: the graph inventory.

A step of token trees (engine/device_tree.py) verifies B rows of T + 1 tokens, the root and T tree nodes
(padded up to a node bucket, TREE_BUCKETS): a tree bucket (Bucket.tree), whose forward takes each token's
ancestor bitmask and depth from device tensors (PaddedTreeSegments).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

SLOT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DRAFT_BUCKETS = (0, 4, 8, 16)
TREE_BUCKETS = (4, 8, 16, 32, 63)  # tree nodes per row (the C and Triton attention take trees of up to 64 tokens)


@dataclass(frozen=True, order=True)
class Bucket:
    rows: int  # B: verified rows, live slots plus padding
    width: int  # G: draft positions per row (each row runs G + 1 tokens); in a tree bucket, tree nodes per row
    tree: bool = False  # whether each row's draft positions are a token tree (else a chain)

    @property
    def tokens(self) -> int:
        return self.rows * (self.width + 1)

    @property
    def label(self) -> str:
        """rows x width, a tree bucket's with a "t": the graph inventory's key."""
        return f"{self.rows}x{self.width}" + ("t" if self.tree else "")


def round_up(n: int, sizes: tuple[int, ...], what: str) -> int:
    """The smallest of `sizes` (ascending) that holds n."""
    for size in sizes:
        if n <= size:
            return size
    raise ValueError(f"{what} {n} is more than the largest bucket ({sizes[-1]})")


def bucket_of(rows: int, widths: Iterable[int] | int, slot_buckets: tuple[int, ...] = SLOT_BUCKETS,
              draft_buckets: tuple[int, ...] = DRAFT_BUCKETS) -> Bucket:
    """The bucket of a step of `rows` rows whose rows ask for these draft widths (gamma per row, or one for all)."""
    if rows < 1:
        raise ValueError(f"a step verifies at least one row, got {rows}")
    widest = widths if isinstance(widths, int) else max(widths, default=0)
    return Bucket(round_up(rows, slot_buckets, "rows"), round_up(max(widest, 0), draft_buckets, "draft width"))


class PaddedSegments:
    """The Segments interface of a bucket's forward, from device tensors: B segments of G + 1 tokens, segment r of
    slot rows[r] starting at cache row cache_lens[r]. What the C decoder, the C attention and the Triton
    kernels read of a Segments (token_slots, positions, rows, packed_index); no host list, no tree."""

    has_trees = False
    parents = None

    def __init__(self, rows: torch.Tensor, cache_lens: torch.Tensor, width: int):
        B, n = rows.shape[0], width + 1
        self.width = width
        self.num_segments, self.num_tokens = B, B * n
        offs = torch.arange(n, device=rows.device)
        self.token_slots = rows[:, None].expand(B, n).contiguous().view(-1)  # [B n]
        self.positions = (cache_lens[:, None] + offs).reshape(-1)  # [B n]
        self.rows = self.positions
        self._table = (rows, torch.arange(B + 1, device=rows.device) * n, cache_lens)

    def lengths(self) -> list[int]:
        return [self.width + 1] * self.num_segments

    def packed_index(self) -> torch.Tensor:
        """[2 N + 3 B + 1] long on the device, as Segments.packed_index()."""
        slots, starts, cache_lens = self._table
        return torch.cat([self.token_slots, self.positions, slots, starts, cache_lens]).long()


class PaddedTreeSegments(PaddedSegments):
    """A bucket's Segments of token trees: row r's segment is its root (at cache row cache_lens[r]) and T nodes;
    token i is written to cache row cache_lens[r] + i, takes RoPE position cache_lens[r] + depth[r, i] and attends
    to its slot's cached rows and to the tokens of its ancestor-and-self bitmask bits[r, i] (models/segments.py,
    spin_kernels.tree_layout). bits and depth [B, T + 1] are device tensors; packed_index carries the RoPE
    positions, `rows` the cache rows (kernel_hidden's rows), `bits` its tree_mask."""

    has_trees = True

    def __init__(self, rows: torch.Tensor, cache_lens: torch.Tensor, bits: torch.Tensor, depth: torch.Tensor):
        super().__init__(rows, cache_lens, bits.shape[1] - 1)
        self.positions = (cache_lens[:, None] + depth).reshape(-1)  # [B (T + 1)]
        self.rows = (cache_lens[:, None] + torch.arange(self.width + 1, device=rows.device)).reshape(-1)
        self.bits = bits.reshape(-1).contiguous()  # [B (T + 1)] int64


def padded_problem(model) -> str | None:
    """Why a model cannot run a bucket's forward from device tensors, or None: it needs the Triton kernels or the C
    attention (the torch attention plans its batch from host lists)."""
    if model.kernels or model.c_decoder is not None or model.plan.attention == "c":
        return None
    return ("the device step runs on the Triton kernels (CUDA, or target.kernels: triton) or on the C kernels "
            "(target.kernels: c or auto on CPU); the torch attention path plans its batch on the host")


def padded_hidden(model, tokens: torch.Tensor, seg: PaddedSegments, cache,
                  layers: int | None = None, extra: torch.Tensor | None = None) -> torch.Tensor:
    """The residual [B (G + 1), C] of a bucket's forward: the first `layers` layers (default all), K/V written, no
    host read. extra [B (G + 1), X]: the rows' extra inputs (a draft that reads the target's features)."""
    layers = layers or model.spec.num_layers
    if model.kernels:  # not model.hidden: its per-shape graphs would capture inside the bucket's graph
        trees = (seg.rows, seg.bits) if seg.has_trees else ()
        return model.kernel_hidden(model._embed(tokens, extra), seg.packed_index(), seg.width + 1, cache, layers,
                                   *trees)
    problem = padded_problem(model)
    if problem:
        raise ValueError(problem)
    return model.hidden(tokens, seg, cache, layers, extra)


def step_ops(model):
    """(accept_commit, ngram_draft): the Triton kernels where the model runs on them, else their torch references."""
    import spin_kernels

    if model.kernels:
        return spin_kernels.accept_commit, spin_kernels.ngram_draft
    return spin_kernels.accept_commit_ref, spin_kernels.ngram_draft_ref


def tree_ops(model):
    """(ngram_tree, tree_layout, tree_walk, keep_path) of a tree step (spin_kernels.ngram_tree, spin_kernels.tree):
    the walk and keep_path as Triton kernels where the model runs on them, else their torch references."""
    import spin_kernels

    if model.kernels:
        return spin_kernels.ngram_tree, spin_kernels.tree_layout, spin_kernels.tree_walk, spin_kernels.keep_path
    return spin_kernels.ngram_tree, spin_kernels.tree_layout, spin_kernels.tree_walk_ref, spin_kernels.keep_path_ref


class BucketGraphs:
    """A step body per bucket: eager, or from a CUDA graph captured the second time its bucket is asked for."""

    def __init__(self, device: torch.device, capture: bool):
        self.capture = capture and torch.device(device).type == "cuda"
        self.graphs: dict[Bucket, torch.cuda.CUDAGraph] = {}
        self.asked: Counter = Counter()
        self.pool = None
        self.replays = 0

    def run(self, bucket: Bucket, body: Callable[[], None]) -> None:
        self.asked[bucket] += 1
        graph = self.graphs.get(bucket)
        if graph is None:
            if not self.capture or self.asked[bucket] < 2:
                body()
                return
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                body()
            self.graphs[bucket] = graph
        graph.replay()
        self.replays += 1

    def inventory(self) -> dict:
        """Buckets asked for (with counts), those captured, and the replays."""
        return {"asked": {b.label: n for b, n in sorted(self.asked.items())},
                "captured": sorted(b.label for b in self.graphs), "replays": self.replays}
