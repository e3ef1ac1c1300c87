"""Which kernels a job's models run on: chosen once per job, handed to every model it loads.

The job says it in `target.kernels` (config/sections.py):
- `auto`: on CPU, per model, the path measured fastest there (cpu_plan.py: the C decoder, oneDNN and
  torch, or a mix); on CUDA, the Triton kernels (spin_kernels) with CUDA graphs where Triton imports,
  else torch.
- `c`: the C decoder (cpu_decoder.py) wherever it takes a model; CPU only, and it must build.
- `torch`: none of our kernels: oneDNN and torch on CPU, torch on CUDA.
- `triton`: the Triton kernels (attention, KV writes, acceptance) with torch for the rest; on CPU
  only under the Triton interpreter (TRITON_INTERPRET=1), which is slow: a mode for tests.

Environment variables override the job, each for its own part (`auto` or unset leaves the job's
choice): SPIN_BATCH_CPU_GEMM=on|off (the C decoder on CPU, or oneDNN and torch), SPIN_BATCH_KERNELS=
on|off (the Triton kernels), SPIN_BATCH_CUDA_GRAPHS=on|off. loader.resolve_execution reads them, checks
the result can run here and makes the Execution; nothing below it reads the environment.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import torch

from . import cpu_decoder

CHOICES = ("auto", "c", "torch", "triton")  # target.kernels
CPU_PATHS = ("auto", "c", "torch")  # auto: measured per model (cpu_plan.py)

ENV_CPU = "SPIN_BATCH_CPU_GEMM"
ENV_TRITON = "SPIN_BATCH_KERNELS"
ENV_GRAPHS = "SPIN_BATCH_CUDA_GRAPHS"


@dataclass(frozen=True)
class Execution:
    """The resolved choice. The default is a model built outside the loader (tests, the planner's timed
    layer): the C decoder wherever it takes the model on CPU, no Triton."""

    kernels: str = "auto"  # target.kernels, as the job set it
    cpu: str = "c"  # the CPU path, one of CPU_PATHS
    triton: bool = False  # attention, KV writes and acceptance on the Triton kernels
    cuda_graphs: bool = False  # short forwards replayed from CUDA graphs (Triton on CUDA only)
    overrides: tuple[str, ...] = ()  # the environment settings that overrode the job, as NAME=value

    def __post_init__(self) -> None:
        if self.kernels not in CHOICES or self.cpu not in CPU_PATHS:
            raise ValueError(f"kernels {self.kernels!r}, cpu {self.cpu!r}: use one of {CHOICES} and {CPU_PATHS}")

    def cpu_reason(self) -> str:
        """What set the CPU path: an environment override, else the job."""
        return next((o for o in self.overrides if o.startswith(ENV_CPU + "=")), f"target.kernels: {self.kernels}")

    def describe(self) -> dict:
        """For summary.json's `backends`, beside the CPU plan."""
        out = {"kernels": self.kernels, "triton": self.triton, "cuda_graphs": self.cuda_graphs}
        if self.overrides:
            out["overridden_by"] = list(self.overrides)
        return out


# -- the CPU path of one model (measured by cpu_plan.py, or forced) ------------------------------

LAYERS = ("c", "torch+c_attention", "torch")


def forced(layers: str, lm_head: str | None = None) -> CpuPlan:
    """A plan not measured (tests, and `--set`-style overrides): layers one of LAYERS."""
    if layers not in LAYERS:
        raise ValueError(f"CPU path {layers!r}: use one of {', '.join(LAYERS)}")
    return CpuPlan(layers, lm_head or ("c" if layers == "c" else "torch"), "forced")


@dataclass(frozen=True)
class CpuPlan:
    layers: str  # one of LAYERS
    lm_head: str  # "c" or "torch"
    why: str
    ms: dict | None = None  # measured milliseconds per candidate, when measured

    @property
    def c_linears(self) -> bool:
        return self.layers == "c"

    @property
    def c_attention(self) -> bool:
        return self.layers in ("c", "torch+c_attention")

    def describe(self) -> dict:
        """For summary.json and `spin-batch env`."""
        out = {"layers": self.layers, "lm_head": self.lm_head, "why": self.why}
        if self.ms:
            out["measured_ms"] = self.ms
        lib = cpu_decoder.library() if self.layers != "torch" or self.lm_head != "torch" else None
        if lib is not None:
            out["c_build"] = cpu_decoder.build_info(lib)
        return out


DEFAULT_C = CpuPlan("c", "c", "the C kernels, not measured (a model built outside the loader)")
TORCH = CpuPlan("torch", "torch", "not on CPU")

# -- the whole plan of one model --------------------------------------------------------------

NATIVE, TRANSFORMERS = "native", "transformers"  # the backends a model runs on (target.backend)
ATTENTION = ("triton", "c", "torch")


@dataclass(frozen=True)
class ModelPlan:
    """How one model runs, decided once when it is built (ModelPlan.make) and read by the model: which
    kernels its attention, linears, LM head and norms run on. Nothing below re-derives it."""

    backend: str  # NATIVE or TRANSFORMERS
    device: torch.device
    dtype: torch.dtype
    execution: Execution  # the job's kernels (target.kernels and the environment's overrides)
    cpu: CpuPlan  # the CPU path of the layers and the LM head (TORCH off CPU)
    attention: str  # one of ATTENTION
    linears: bool | None  # the layers' linears on the C GEMM (llama.Linear's panel: None where it applies)
    lm_head: bool | None  # the LM head on the C GEMM, as `linears`
    projections: bool | None  # embed_proj and a draft's feature head on the C GEMM, as `linears`
    cuda_graphs: bool  # short forwards replayed from CUDA graphs
    why: str  # what chose this path, for people
    lib: ctypes.CDLL | None = field(default=None, repr=False, compare=False)  # the C library where it runs (CPU)

    @property
    def triton(self) -> bool:
        return self.execution.triton

    @property
    def c_library(self) -> bool:
        return self.lib is not None

    @classmethod
    def make(cls, backend: str, dtype: torch.dtype, device: torch.device, execution: Execution | None = None,
             cpu: CpuPlan | None = None, heads: tuple[int, int, int] | None = None) -> "ModelPlan":
        """The plan of a model of this dtype on device under the job's kernels (None: Execution(), a model
        built outside the loader), with its CPU path `cpu` (cpu_plan.py; None: the C kernels wherever they
        apply, TORCH off CPU or where the job says torch). heads (H, KV, D): the native decoder's attention
        shape, which the C attention must take."""
        execution = execution or Execution()
        on_cpu = device.type == "cpu"
        c_allowed = on_cpu and execution.cpu != "torch"
        if backend == TRANSFORMERS:  # its attention runs on Triton or C, never a mix of both
            c_allowed = c_allowed and not execution.triton
        lib = cpu_decoder.library() if c_allowed else None
        cpu = cpu or (DEFAULT_C if c_allowed else TORCH)
        if execution.triton:
            attention = "triton"
        elif lib is not None and (backend == TRANSFORMERS or cpu.c_attention and heads is not None
                                  and cpu_decoder.attention_applies(lib, dtype, *heads)):
            attention = "c"
        else:
            attention = "torch"
        measured = None if cpu is DEFAULT_C else cpu.c_linears
        why = cpu.why if on_cpu else f"{device.type}: {'the Triton kernels' if execution.triton else 'torch'}"
        return cls(backend, device, dtype, execution, cpu, attention, measured,
                   None if cpu is DEFAULT_C else cpu.lm_head == "c", None if execution.cpu != "torch" else False,
                   execution.cuda_graphs and device.type == "cuda" and execution.triton, why, lib)

    def with_cpu(self, cpu: CpuPlan, heads: tuple[int, int, int] | None = None) -> "ModelPlan":
        """This plan with another CPU path (an int8 copy of the model: quantize.INT8_C or TORCH)."""
        return ModelPlan.make(self.backend, self.dtype, self.device, self.execution, cpu, heads)

    def describe(self) -> dict:
        """For summary.json's `backends`: the CPU plan (layers, lm_head, why, ...) and the job's kernels."""
        return {**self.cpu.describe(), **self.execution.describe()}
