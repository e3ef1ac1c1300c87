"""The methods `spin-batch bench` times: our loop under a policy, the device step (engine/device_step.py),
transformers' generate, llama.cpp, and the hindsight oracle; each run gives a MethodRun (generated ids per
request, wall time, stats).
"""

from __future__ import annotations

import resource
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from .bench_policies import assigned_policy
from .config import JobConfig
from .engine.device_step import DeviceDrafting, DeviceLoop
from .engine.loop import BatchLoop
from .engine.prefix_cache import PrefixCache
from .memory import recall
from .records import Completion, Request
from .build import Engine
from .selection.factory import gated_drafters, make_policy, tree_drafters
from .stats import RunStats


@dataclass
class MethodRun:
    method: str
    slots: int
    repeat: int
    wall_s: float
    tokens: dict[str, list[int]]  # generated ids per request id (EOS included when it ended the text)
    share_s: dict[str, float] = field(default_factory=dict)  # per request id
    summary: dict = field(default_factory=dict)
    peak_rss_mb: float = 0.0

    @property
    def generated(self) -> int:
        return sum(len(t) for t in self.tokens.values())

    @property
    def tok_s(self) -> float:
        return self.generated / self.wall_s if self.wall_s > 0 else 0.0


@dataclass
class BenchInput:
    requests: list[Request]
    encode: Callable[[Request], list[int]]


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


# -- methods ------------------------------------------------------------------------------


def run_loop(engine: Engine, selector: str, gamma: int, data: BenchInput, slots: int, repeat: int,
             label: str, pipeline: bool, gate: bool = True, assign: dict[str, str | None] | None = None,
             backoff: bool = True, tree_nodes: int = 0, prefix: PrefixCache | None = None) -> MethodRun:
    """One timed run of our loop: a fresh BatchLoop over the engine's target, drafters and cache, with its
    own policy and stats (and `prefix`, a prefix cache, empty, or None: off); each request's generated ids
    and share of step time come from its Completion."""
    drafters = engine.loop.drafters
    policy = assigned_policy(drafters, gamma, assign, gate) if assign is not None else \
        make_policy(selector, drafters, gamma, confidence_gate=gate, backoff=backoff, tree_nodes=tree_nodes,
                    target_trees=engine.target.tree_segments)
    memory = engine.memory if assign is None and selector in ("ucb", "thompson") else None  # the bandits
    if memory is not None and not memory.fits(gamma, gate, backoff, tree_nodes):
        memory = None  # a variant of the job's spin settings (spin-nobackoff, ...): learns from scratch
    # the job's selection memory (memory.py): each run starts from what the runs before it learnt
    started_from = memory.runs if memory is not None and recall(memory, policy) else 0
    loop = BatchLoop(engine.target, engine.tokenizer, replace(engine.loop.cfg, pipeline=pipeline), policy, drafters,
                     cache=engine.loop.cache, stats=RunStats(), prefix_cache=prefix,
                     remember=memory.save if memory is not None else None)
    tokens: dict[str, list[int]] = {}
    shares: dict[str, float] = {}

    def record(c: Completion) -> None:
        if c.status == "ok":  # a bad row has no tokens to compare
            tokens[c.request.id] = list(c.token_ids)
            shares[c.request.id] = c.share_s

    graphs = getattr(engine.target, "graphs", None)
    before = graphs.stats() if graphs is not None else None
    t0 = time.perf_counter()
    loop.run(iter(data.requests), data.encode, record)
    wall = time.perf_counter() - t0
    summary = loop.stats.summary()
    if graphs is not None:  # the target's CUDA graphs during this run: shapes captured, replays, eager short forwards
        summary["cuda_graphs"] = {k: v - before[k] for k, v in graphs.stats().items()}
    if memory is not None:
        summary["selection_memory"] = {"path": str(memory.path), "started_from_runs": started_from}
    return MethodRun(label, slots, repeat, wall, tokens, shares, summary, peak_rss_mb())


DEVICE_PREFIX = "device:"
DEVICE_KINDS = ("ngram", "model", "early_exit", "cascade", "vote")  # the drafter kinds a device:<name> method takes
MIX_KINDS = ("ngram", "model", "early_exit")  # the kinds device:spin's draft mix takes
DEVICE_SPIN = DEVICE_PREFIX + "spin"  # the SPIN bandit over every drafter of the job, on the device step


def is_device(method: str) -> bool:
    return method.startswith(DEVICE_PREFIX)


def device_methods(job: JobConfig) -> list[str]:
    """The device methods a job offers: device:autoregressive, device:<name> per n-gram, model, cascade or vote
    drafter (one the device step cannot run, a transformers-backend draft say, is refused when built), and
    device:spin."""
    return [f"{DEVICE_PREFIX}autoregressive", *(DEVICE_PREFIX + d.name for d in job.drafters if d.kind in DEVICE_KINDS),
            *([DEVICE_SPIN] if job.drafters else [])]


def device_spin_problem(job: JobConfig) -> str | None:
    """Why device:spin cannot run this job, told before any model loads: a drafter of a kind the draft mix cannot
    draft yet (a drafter whose checkpoint reads the target's features is found when the engine is built)."""
    bad = [f"{d.name!r} (kind {d.kind})" for d in job.drafters if d.kind not in MIX_KINDS]
    if not bad:
        return None
    return (f"bench method {DEVICE_SPIN!r}: the device step cannot draft with {', '.join(bad)} yet; it drafts with "
            f"{', '.join(MIX_KINDS)} drafters (remove the others from the job, e.g. with --set)")


class DeviceMethod:
    """A device:autoregressive or device:<drafter> method: the device step (DeviceLoop) over the engine's target,
    plain, or with that drafter at the job's gamma for every slot; an n-gram drafter drafts token trees of
    spin.tree_nodes nodes where the job gives it trees (selection.factory.tree_drafters). One DeviceLoop serves
    every run of the method at a slot count, so its CUDA graphs are captured once (in the warm-up pass on CUDA).
    Built at once: a drafter or target the device step cannot run raises ValueError before any timed run."""

    def __init__(self, engine: Engine, method: str, job: JobConfig):
        self.method = method
        name, gamma = method.removeprefix(DEVICE_PREFIX), job.spin.num_speculative_tokens
        # None: device:autoregressive or device:spin (device:spin is the mix, whatever the drafters are named)
        cfg = None if method == DEVICE_SPIN else {d.name: d for d in job.drafters}.get(name)
        drafter = None if cfg is None else engine.loop.drafters[name]
        mix = policy = None
        if method == DEVICE_SPIN:  # every drafter, each slot's chosen by the bandit (no selection memory, no gate)
            mix = {d.name: engine.loop.drafters[d.name] for d in job.drafters}
            policy = make_policy(job.spin.selector if job.spin.selector in ("ucb", "thompson") else "ucb", list(mix),
                                 gamma, backoff=job.spin.backoff)
            drafting = DeviceDrafting(gamma)
        elif cfg is None:
            drafting = DeviceDrafting()
        elif cfg.kind == "ngram":
            drafters = {name: drafter}
            trees = tree_drafters(drafters, job.spin.tree_nodes, gated_drafters(drafters, job.spin.confidence_gate),
                                  engine.target.tree_segments)
            drafting = DeviceDrafting(gamma, cfg.min_ngram, cfg.max_ngram, nodes=trees.get(name, 0))
        else:
            drafting = DeviceDrafting(gamma)
        try:
            self.loop = DeviceLoop(engine.target, engine.tokenizer, replace(engine.loop.cfg, pipeline=False), drafting,
                                   drafter, mix=mix, policy=policy)
        except ValueError as e:
            raise ValueError(f"bench method {method!r}: {e}") from None

    def run(self, data: BenchInput, slots: int, repeat: int) -> MethodRun:
        tokens: dict[str, list[int]] = {}
        use = {"pulls": 0, "spec_steps": 0, "draft_tokens": 0, "accepted_draft_tokens": 0}
        pulls: dict[str, int] = {}

        def record(c: Completion) -> None:
            if c.status == "ok":
                tokens[c.request.id] = list(c.token_ids)
                use["pulls"] += sum(c.drafter_pulls.values())
                for k, v in c.drafter_pulls.items():
                    pulls[k] = pulls.get(k, 0) + v
                use["spec_steps"] += c.num_spec_steps
                use["draft_tokens"] += c.num_draft_tokens
                use["accepted_draft_tokens"] += c.num_accepted_draft_tokens

        before = self.loop.stats()
        t0 = time.perf_counter()
        self.loop.run(iter(data.requests), data.encode, record)
        wall = time.perf_counter() - t0
        after = self.loop.stats()
        steps = after["steps"] - before["steps"]
        generated = sum(len(t) for t in tokens.values())
        summary = {"drafters": {self.loop.name: use} if use["spec_steps"] else {}, "steps": steps,
                   "target_forwards_per_generated_token": steps / generated if generated else None,
                   "device_step": {"host_reads": after["host_reads"] - before["host_reads"],
                                   "admission_reads": after["admission_reads"] - before["admission_reads"],
                                   "buckets": after["asked"], "captured": after["captured"],
                                   "replays": after["replays"] - before["replays"]}}
        if self.loop.mix is not None:  # per drafter, the steps its slots chose it; the chains' sub-buckets; replay times
            summary["drafters"] = {self.method: use} if use["spec_steps"] else {}
            summary["device_step"].update(pulls=pulls, chains={k: v["asked"] for k, v in after["chains"].items()},
                                          replay_ms=after["replay_ms"])
        return MethodRun(self.method, slots, repeat, wall, tokens, summary=summary, peak_rss_mb=peak_rss_mb())


class HFGenerate:
    """transformers' generate with left padding, in static batches of `slots` prompts."""

    def __init__(self, engine: Engine, trust_remote_code: bool = False):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(str(engine.model_dir), dtype=engine.target.dtype,
                                                          trust_remote_code=trust_remote_code,
                                                          local_files_only=True).eval()
        self.tok = engine.tokenizer
        self.eos = sorted(engine.loop.cfg.eos_token_ids)
        self.pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.eos[0]

    def run(self, data: BenchInput, slots: int, max_tokens: int, repeat: int) -> MethodRun:
        torch = self.torch
        tokens: dict[str, list[int]] = {}
        reqs = data.requests
        t0 = time.perf_counter()
        for i in range(0, len(reqs), slots):
            batch = reqs[i : i + slots]
            ids = [data.encode(r) for r in batch]
            width = max(len(x) for x in ids)
            inp = torch.tensor([[self.pad] * (width - len(x)) + x for x in ids])
            mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
            with torch.inference_mode():
                out = self.model.generate(input_ids=inp, attention_mask=mask, max_new_tokens=max_tokens,
                                          do_sample=False, eos_token_id=self.eos, pad_token_id=self.pad)
            for r, row in zip(batch, out[:, width:].tolist()):
                tokens[r.id] = _until_eos(row, set(self.eos))
        wall = time.perf_counter() - t0
        return MethodRun("hf_generate", slots, repeat, wall, tokens, peak_rss_mb=peak_rss_mb())


class LlamaCppMethod:
    """A llamacpp:<format> method: llama.cpp sized for this run's slots, on the target's GGUF in that format.

    The GGUF is re-encoded (once, cached) and loaded on first use, outside the timed runs.
    """

    def __init__(self, job: JobConfig, engine: Engine, method: str):
        self.job, self.method, self.model_dir = job, method, engine.model_dir
        self.eos = set(engine.loop.cfg.eos_token_ids)
        self.engine = None

    def run(self, data: BenchInput, slots: int, repeat: int) -> MethodRun:
        import torch

        from . import llamacpp

        job = self.job
        if self.engine is None:
            path = llamacpp.reencoded(llamacpp.source_gguf(job.target.model, self.model_dir), self.method.split(":")[1])
            self.engine = llamacpp.LlamaCpp(path, slots, job.batch.max_model_len, job.batch.max_num_batched_tokens,
                                            threads=torch.get_num_threads())
        prompts = [data.encode(r) for r in data.requests]
        t0 = time.perf_counter()
        out = self.engine.generate(prompts, job.sampling.max_tokens, self.eos)
        wall = time.perf_counter() - t0
        return MethodRun(self.method, slots, repeat, wall, {r.id: o for r, o in zip(data.requests, out)},
                         peak_rss_mb=peak_rss_mb())

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()


def _until_eos(row: list[int], eos: set[int]) -> list[int]:
    for i, t in enumerate(row):
        if t in eos:
            return row[: i + 1]
    return row


def oracle(runs: list[MethodRun], slots: int, repeat: int) -> MethodRun | None:
    """Per request, the cheapest of the autoregressive and fixed-drafter runs (the oracle-bound run;
    its summary's `oracle_assign` maps each id to its drafter, None for no drafting)."""
    pool = [r for r in runs if r.method == "autoregressive" or r.method.startswith("fixed:")]
    if len(pool) < 2:
        return None
    ids = pool[0].tokens.keys()
    # scale each run's shares to sum to its wall time, so time spent between steps is charged too
    cost = {r.method: {i: s * r.wall_s / max(sum(r.share_s.values()), 1e-12) for i, s in r.share_s.items()}
            for r in pool}
    best = {i: min(pool, key=lambda r: cost[r.method].get(i, float("inf"))) for i in ids}
    wall = sum(cost[best[i].method][i] for i in ids)
    tokens = {i: best[i].tokens[i] for i in ids}
    chosen: dict[str, int] = {}
    for r in best.values():
        chosen[r.method] = chosen.get(r.method, 0) + 1
    assign = {i: (r.method.split(":", 1)[1] if r.method.startswith("fixed:") else None) for i, r in best.items()}
    return MethodRun("oracle-bound", slots, repeat, wall, tokens,
                     summary={"oracle_choices": chosen, "oracle_assign": assign},
                     peak_rss_mb=max(r.peak_rss_mb for r in pool))
