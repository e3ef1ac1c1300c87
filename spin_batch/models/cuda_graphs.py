"""CUDA graphs of the target's short forwards: decode steps and verify runs.

On a GPU the packed forward of a small model at decode sizes is all launch overhead: SmolLM2-135M
runs 30 layers of about 15 kernels each, which took 9-13 ms per step on an H200 whatever the
batch (1 to 64 slots), while its arithmetic needs a small fraction of a millisecond. A CUDA
graph records those launches once for a shape and replays them in one call.

What a graph fixes is the shape: N flat tokens, S segments, the longest segment (it sizes the
attention grid), the number of layers run, the cache it writes, and the width of any extra
input. The values change every step: token ids, slots, positions and the segment table are
copied into the graph's own input buffers before each replay. The Triton attention reads each
segment's cache length from that table on the device, so one graph serves every context length.

Only short forwards are captured (every segment at most MAX_SEGMENT tokens, at most MAX_TOKENS
in all): prefill chunks vary too much in shape to repay a capture and already use the GPU well.
A shape is captured the second time it is seen, so one-off shapes never pay for a capture, and
at most MAX_GRAPHS shapes per model are kept; past that, new shapes run eagerly. A replay runs
the same kernels on the same shapes as the eager path, so its output is the same bit for bit
(tests/test_cuda_graphs.py checks this on a GPU). Forwards with a token-tree segment (segments.py)
are never captured: they run eagerly, with their rows and tree mask.

A model replays graphs where the job's execution (execution.py) has them: by default wherever the
Triton kernels run on CUDA; SPIN_BATCH_CUDA_GRAPHS=on|off overrides that (loader.resolve_execution).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

MAX_SEGMENT = 16  # longest segment captured (decode is 1, a verify run 1 + gamma)
MAX_TOKENS = 1024  # most flat tokens in a captured forward
MAX_GRAPHS = 256  # shapes kept per model
CAPTURE_AFTER = 2  # a shape is captured when it is seen this many times

@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    tokens: torch.Tensor  # [N] long: input
    index: torch.Tensor  # [2 N + 3 S + 1] long: Segments.packed_index()
    extra: torch.Tensor | None  # [N, X]: input
    out: torch.Tensor  # [N, C]: the residual the replay writes


class StepGraphs:
    """The captured forwards of one model, by shape; see the module docstring."""

    def __init__(self, model, max_graphs: int = MAX_GRAPHS, capture_after: int = CAPTURE_AFTER):
        self.model = model
        self.max_graphs = max_graphs
        self.capture_after = capture_after
        self.graphs: dict[tuple, _Graph] = {}
        self.seen: Counter = Counter()
        self.pool = None  # one memory pool shared by this model's graphs (each output is copied out at once)
        self.replays = 0
        self.eager = 0  # short forwards that ran eagerly (shape not captured yet, or the cap reached)

    @torch.inference_mode()
    def hidden(self, tokens: torch.Tensor, seg, cache, num_layers: int,
               extra: torch.Tensor | None = None) -> torch.Tensor | None:
        """model.hidden() for this forward from a graph, or None when it should run eagerly."""
        if seg.has_trees:
            # A graph's inputs are the token ids and packed_index alone: no cache rows apart from the
            # positions and no tree mask, so a tree forward replayed from one would write its K/V at
            # its depths and attend causally. Tree forwards run eagerly (kernel_hidden with the mask).
            return None
        lens = seg.lengths()
        N, S = seg.num_tokens, seg.num_segments
        longest = max(lens, default=0)
        if N == 0 or longest > MAX_SEGMENT or N > MAX_TOKENS:
            return None
        key = (N, S, longest, num_layers, cache.k.data_ptr(), cache.v.data_ptr(), tuple(cache.k.shape),
               None if extra is None else (extra.shape[1], extra.dtype))
        g = self.graphs.get(key)
        if g is None:
            if len(self.seen) >= 16 * self.max_graphs:  # shapes that never came back: forget them
                self.seen.clear()
            self.seen[key] += 1
            if self.seen[key] < self.capture_after or len(self.graphs) >= self.max_graphs:
                self.eager += 1
                return None
            g = self.graphs[key] = self._capture(tokens, seg, cache, num_layers, extra, longest)
            del self.seen[key]
        g.tokens.copy_(tokens)
        g.index.copy_(seg.packed_index())
        if extra is not None:
            g.extra.copy_(extra)
        g.graph.replay()
        self.replays += 1
        return g.out.clone()

    def _capture(self, tokens, seg, cache, num_layers, extra, longest) -> _Graph:
        m = self.model
        static_tokens = tokens.clone()
        index = seg.packed_index().to(m.device)
        static_extra = None if extra is None else extra.clone()

        def run() -> torch.Tensor:
            return m.kernel_hidden(m._embed(static_tokens, static_extra), index, longest, cache, num_layers)

        # Warm up on a side stream (Triton compiles and cuBLAS picks its kernels outside the capture).
        # The warm-up writes this step's K/V into the cache; the replay rewrites the same values.
        side = torch.cuda.Stream(m.device)
        side.wait_stream(torch.cuda.current_stream(m.device))
        with torch.cuda.stream(side):
            run()
        torch.cuda.current_stream(m.device).wait_stream(side)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = run()
        return _Graph(graph, static_tokens, index, static_extra, out)

    def stats(self) -> dict[str, int]:
        return {"graphs": len(self.graphs), "replays": self.replays, "eager": self.eager}
