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

from dataclasses import dataclass

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
