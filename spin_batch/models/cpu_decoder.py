"""The decoder on CPU in C (cpu_decoder.c, which includes its parts from csrc/: the float32 and bfloat16
GEMMs, the int8 and int4 GEMMs, argmax, attention): its GEMMs, norms and attention, and all its layers in
one call, compiled once per kind of machine as one translation unit.

What it holds, and why:
- Panel GEMMs in float32 and bfloat16 at the loop's batch sizes (1 to a few dozen rows), where oneDNN's
  prepacked GEMM streams the weights well below memory speed and costs tens of microseconds a call
  before it reads any. The micro-kernel is written for the build's register width: 12 rows x 32
  outputs with AVX-512, 3 rows x 32 outputs with AVX2 (and NEON), K walked in blocks so the
  weights stream once for any number of rows. The bfloat16 GEMM uses AVX512-BF16's dot
  products where the CPU has them, else widens the weights to float32 exactly.
- The RMS norm of the float32 residual stream, in one call.
- Attention over the per-slot KV cache, with the KV write.
- spin_decoder: all decoder layers of a forward in one call, so no Python runs between them.
Every result of a row is computed alone, in a fixed order (see the C file): a row's output does not
depend on the batch, the segment or the prefill chunk it arrives in, which oneDNN and SDPA do not
promise. That makes speculative greedy output exact in bfloat16 as well as float32.

Whether a model runs on these kernels or on oneDNN and torch is decided per model by measurement
(cpu_plan.py): a build that is slow on some CPU is never the default there. Timings are in
BENCHMARKS.md and docs/kernels.md.

The library is built with the system C compiler ($CC, else cc) with -O3 -march=$SPIN_BATCH_CPU_ARCH
(default native) -fopenmp into $SPIN_BATCH_CACHE/cpu_decoder/, keyed by the sources (every file), the flags and the CPU's
feature flags (a cache shared over NFS by different nodes keeps one build per kind). It links against
the OpenMP runtime torch has already loaded, so torch.set_num_threads applies to it.

Whether a job may use it is the job's choice (target.kernels, or SPIN_BATCH_CPU_GEMM: see execution.py):
`library()` is for the measured path, which warns once where the library cannot be built and falls back
to oneDNN and torch; `require()` for a job that asked for the C decoder, which then fails.

A job that never compares one forward with another (no speculation: `spin-batch distill`'s teacher
data) can trade that exactness for speed: models built inside `throughput_gemm()` hand bfloat16
weights to oneDNN where the CPU has AMX and oneDNN may use it, since its tile kernels outrun the panel
GEMM at every batch size measured.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import warnings
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path

import torch

from ..cachedir import cache_root, cached_file

SOURCE = Path(__file__).with_name("cpu_decoder.c")  # the translation unit; it includes PARTS/*.c, *.h
PARTS = "csrc"
CACHE = "cpu_decoder"  # the folder under $SPIN_BATCH_CACHE, and the builds' name
LEGACY_CACHE = "cpu_gemm"  # the same, while this module was cpu_gemm.py
BASE_FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC")


def arch() -> str:
    """The -march the library is built for: SPIN_BATCH_CPU_ARCH (default native). Another value builds
    for an older instruction set on this machine, e.g. x86-64-v3 (AVX2 and FMA, no AVX-512): the tests
    run the kernels and the greedy equality suite against that build too."""
    a = os.environ.get("SPIN_BATCH_CPU_ARCH", "").strip() or "native"
    if not all(c.isalnum() or c in "-_.+" for c in a):
        raise ValueError(f"SPIN_BATCH_CPU_ARCH={a!r} is not a -march value")
    return a


def flags() -> tuple[str, ...]:
    return (*BASE_FLAGS[:1], f"-march={arch()}", *BASE_FLAGS[1:])
PANEL = 32  # outputs per micro-kernel call: padded to a multiple of this
Q8_GROUP = 64  # inputs per activation scale in the int8 GEMM (QG in the C file)

_state: dict[str, object] = {}


class CpuDecoderUnavailable(RuntimeError):
    pass


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _digest(*parts: bytes) -> str:
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:12]


def _compiler() -> str:
    return os.environ.get("CC") or "cc"


def cpu_model_name() -> str:
    """The CPU's model name as the kernel reports it (lscpu's "Model name")."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine_key() -> str:
    """This kind of machine and build: the flags, the CPU's feature flags and the compiler."""
    return _digest(" ".join(flags()).encode(), platform.machine().encode(), _cpu_flags().encode(), _compiler().encode())


def sources() -> list[Path]:
    """Every file of the library: SOURCE and the parts it includes (what the build key covers)."""
    parts = SOURCE.parent / PARTS
    return [SOURCE, *sorted(p for p in parts.iterdir() if p.suffix in (".c", ".h"))]


def source_key() -> str:
    """The digest of every source file, by its path under SOURCE's folder and its bytes."""
    return _digest(*(p.relative_to(SOURCE.parent).as_posix().encode() + b"\0" + p.read_bytes() for p in sources()))


def build_key() -> str:
    """machine_key() and the sources: what a measured plan (cpu_plan.py) is valid for."""
    return f"{machine_key()}-{source_key()}"


def _build(compiler: str) -> Path:
    """The library for this kind of machine and this source, compiled once into the cache.

    Named cpu_decoder-<machine key>-<source key>.so: a build for a new source removes this machine kind's
    builds of older sources (a process that has one loaded keeps its mapping), so they do not pile up
    over upgrades, while other kinds of CPU sharing the cache keep theirs. That includes this machine
    kind's builds under the module's former name (LEGACY_CACHE), in any naming scheme it had.
    """
    machine = machine_key()
    folder = cache_root() / CACHE
    out = folder / f"{CACHE}-{build_key()}.so"

    def compile_to(tmp: Path) -> None:
        res = subprocess.run([compiler, *flags(), str(SOURCE), "-o", str(tmp)], capture_output=True, text=True,
                             timeout=300)
        if res.returncode != 0:
            raise CpuDecoderUnavailable(f"{compiler} failed: {res.stderr.strip()[-2000:]}")
        stale = [p for p in folder.glob(f"{CACHE}-{machine}-*.so") if p != out]
        legacy = cache_root() / LEGACY_CACHE
        stale += legacy.glob(f"{LEGACY_CACHE}-{machine}-*.so")
        stale += [p for p in legacy.glob(f"{LEGACY_CACHE}-*.so") if p.name.count("-") == 1]  # its first scheme
        for p in stale:
            for f in (p, p.with_name(f".{p.name}.lock")):
                f.unlink(missing_ok=True)

    return cached_file(out, compile_to)


def library() -> ctypes.CDLL | None:
    """The compiled library, or None where it cannot be built (said once, with why)."""
    if "lib" not in _state:
        _load()
        if _state["lib"] is None:
            warnings.warn(f"spin-batch: the C decoder library is unavailable, using oneDNN and torch instead "
                          f"({_state['error']})", stacklevel=2)
    return _state["lib"]


def require(why: str) -> ctypes.CDLL:
    """The compiled library for a job that asked for it (`why`: what asked, e.g. "target.kernels: c");
    CpuDecoderUnavailable, saying why, where it cannot be built."""
    if "lib" not in _state:
        _load()
    if _state["lib"] is None:
        raise CpuDecoderUnavailable(f"{why}, but the C decoder cannot be built here: {_state['error']}")
    return _state["lib"]


def _load() -> None:
    """Builds (or finds) and loads the library into _state: lib, or None and error."""
    try:
        compiler = _compiler()
        if shutil.which(compiler) is None:
            raise CpuDecoderUnavailable(f"no C compiler ({compiler!r} is not on PATH)")
        lib = ctypes.CDLL(str(_build(compiler)))
        lib.spin_gemm_pack.argtypes = [ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int64] * 3
        lib.spin_gemm.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3
        lib.spin_rms_norm.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_float]
        lib.spin_gemm_pack_bf16.argtypes = lib.spin_gemm_pack.argtypes
        lib.spin_gemm_bf16.argtypes = lib.spin_gemm.argtypes
        lib.spin_gemm_pack_q8.argtypes = lib.spin_gemm_pack.argtypes
        lib.spin_gemm_q8.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_void_p]
        lib.spin_gemm_q8_scratch.argtypes = [ctypes.c_int64] * 2
        lib.spin_gemm_q8_scratch.restype = ctypes.c_int64
        lib.spin_gemm_q8_kind.restype = ctypes.c_char_p
        lib.spin_gemm_pack_q4.argtypes = lib.spin_gemm_pack.argtypes
        lib.spin_head_q4.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 5 + [ctypes.c_void_p]
        lib.spin_argmax_rows.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_void_p]
        lib.spin_attention.argtypes = ([ctypes.c_void_p, ctypes.c_int64] * 3 + [ctypes.c_void_p] * 5
                                       + [ctypes.c_int64] * 5 + [ctypes.c_int])
        lib.spin_attention_max_head_dim.restype = ctypes.c_int
        lib.spin_attention.restype = ctypes.c_int
        lib.spin_decoder.argtypes = ([ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64]
                                     + [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 5 + [ctypes.c_void_p, ctypes.c_int64]
                                     + [ctypes.c_float, ctypes.c_int] + [ctypes.c_void_p] * 2
                                     + [ctypes.c_int64, ctypes.c_void_p])
        lib.spin_decoder.restype = ctypes.c_int
        lib.spin_attention_tree.argtypes = lib.spin_attention.argtypes[:11] + [ctypes.c_void_p] + lib.spin_attention.argtypes[11:]
        lib.spin_attention_tree.restype = ctypes.c_int
        lib.spin_decoder_tree.argtypes = lib.spin_decoder.argtypes + [ctypes.c_void_p]
        lib.spin_decoder_tree.restype = ctypes.c_int
        lib.spin_decoder_scratch.argtypes = [ctypes.c_int64] * 5 + [ctypes.c_void_p, ctypes.c_int]
        lib.spin_decoder_scratch.restype = ctypes.c_int64
        lib.spin_isa.restype = ctypes.c_char_p
        lib.spin_gemm_bf16_native.restype = ctypes.c_int
        for fn in (lib.spin_gemm_pack, lib.spin_gemm, lib.spin_gemm_pack_bf16, lib.spin_gemm_bf16, lib.spin_gemm_pack_q8,
                   lib.spin_gemm_q8, lib.spin_gemm_pack_q4, lib.spin_head_q4, lib.spin_argmax_rows, lib.spin_rms_norm):
            fn.restype = None
    except (CpuDecoderUnavailable, OSError, subprocess.SubprocessError) as e:
        _state["lib"], _state["error"] = None, str(e)
        return
    _state["lib"] = lib


def unavailable_reason() -> str:
    """Why library() returned None (after it did)."""
    return str(_state.get("error", "not built"))


def build_info(lib: ctypes.CDLL) -> dict:
    """What the loaded library was built for: -march, the GEMM's instruction set, the bfloat16 GEMM's kind,
    the int8 GEMM's instruction set."""
    return {"march": arch(), "isa": lib.spin_isa().decode(),
            "bf16_gemm": "avx512_bf16 dot products" if lib.spin_gemm_bf16_native() else "widened to float32",
            "int8_gemm": lib.spin_gemm_q8_kind().decode()}


def reset() -> None:
    """Forget the loaded library, so the next library() call looks again (tests)."""
    _state.clear()


class PanelWeight:
    """A [out, in] float32 or bfloat16 weight packed for spin_gemm / spin_gemm_bf16, or an int8 one with a
    float32 scale per output row (spin_gemm_q8: x is quantized to int8 in groups of 64 inputs per row, see
    quantize.py); called on x [M, in], returns [M, out] in act_dtype: the weight's dtype, float32 for int8."""

    def __init__(self, lib: ctypes.CDLL, weight: torch.Tensor, scale: torch.Tensor | None = None):
        self.lib = lib
        self.dtype = weight.dtype
        int8 = self.dtype == torch.int8
        if int8 != (scale is not None):
            raise ValueError("PanelWeight: an int8 weight takes a scale per output row, and only it")
        self.act_dtype = torch.float32 if int8 else self.dtype
        bf16 = self.dtype == torch.bfloat16
        pack = lib.spin_gemm_pack_q8 if int8 else lib.spin_gemm_pack_bf16 if bf16 else lib.spin_gemm_pack
        self.out_features, self.in_features = weight.shape
        self.padded = -(-self.out_features // PANEL) * PANEL
        w = weight.detach().contiguous()
        width = -(-self.in_features // Q8_GROUP) * Q8_GROUP if int8 else self.in_features  # int8: K padded
        self.packed = torch.empty(self.padded * width, dtype=torch.uint8 if int8 else self.dtype)
        pack(w.data_ptr(), self.packed.data_ptr(), self.out_features, self.in_features, self.padded)
        self.scale = None
        if int8:
            self.scale = torch.zeros(self.padded, dtype=torch.float32)
            self.scale[: self.out_features] = scale.float()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.act_dtype).contiguous()  # the C code reads rows of this dtype; a no-op in the loop
        M = x.shape[0]
        y = torch.empty(M, self.padded, dtype=self.act_dtype)
        if M and self.scale is not None:
            scratch = torch.empty(self.lib.spin_gemm_q8_scratch(M, self.in_features), dtype=torch.uint8)
            self.lib.spin_gemm_q8(x.data_ptr(), self.packed.data_ptr(), self.scale.data_ptr(), y.data_ptr(), M,
                                  self.padded, self.in_features, scratch.data_ptr())
        elif M:
            gemm = self.lib.spin_gemm_bf16 if self.dtype == torch.bfloat16 else self.lib.spin_gemm
            gemm(x.data_ptr(), self.packed.data_ptr(), y.data_ptr(), M, self.padded, self.in_features)
        return y if self.padded == self.out_features else y[:, : self.out_features]


_throughput: ContextVar[bool] = ContextVar("spin_batch_throughput_gemm", default=False)


@contextmanager
def throughput_gemm():
    """Inside this block, bfloat16 weights on an AMX CPU are left to oneDNN (see the module docstring):
    only for models whose outputs need not be batch-invariant."""
    token = _throughput.set(True)
    try:
        yield
    finally:
        _throughput.reset(token)


def _amx() -> bool:
    """AMX tiles that oneDNN's bfloat16 GEMM can use (oneDNN may be held below AVX-512 by ONEDNN_MAX_CPU_ISA)."""
    is_amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(is_amx and is_amx() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def panel_weight(weight: torch.Tensor, scale: torch.Tensor | None = None) -> PanelWeight | None:
    """weight packed for the kernel, when it applies and is available; else None.

    It applies to 2-D CPU weights in float32, in int8 with scale (PanelWeight), and in bfloat16 where the
    input width is even (the kernel reads inputs in pairs), except inside throughput_gemm() on an AMX CPU.
    """
    dtypes = (torch.int8,) if scale is not None else (torch.float32, torch.bfloat16)
    if weight.device.type != "cpu" or weight.dim() != 2 or weight.dtype not in dtypes:
        return None
    if weight.dtype == torch.bfloat16 and _throughput.get() and _amx():
        return None
    lib = library()
    if lib is None:
        return None
    if weight.dtype == torch.bfloat16 and weight.shape[1] % 2:
        return None
    return PanelWeight(lib, weight, scale)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [M, V] -> [M] int64: logits.argmax(-1) (the first maximum; a NaN counts as the maximum). In C for
    float32 rows on CPU where the library is loaded (it runs at every draft and verify)."""
    lib = _state.get("lib")
    if (lib is None or logits.dim() != 2 or logits.dtype != torch.float32 or logits.device.type != "cpu"
            or logits.stride(1) != 1 or logits.shape[1] == 0):
        return logits.argmax(-1)
    out = torch.empty(logits.shape[0], dtype=torch.long)
    lib.spin_argmax_rows(logits.data_ptr(), logits.shape[0], logits.shape[1], logits.stride(0), out.data_ptr())
    return out


def rms_norm(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [M, C] float32 normalised per row by its root mean square, times weight [C] float32."""
    x, weight = x.to(torch.float32).contiguous(), weight.to(torch.float32).contiguous()
    y = torch.empty_like(x)
    lib.spin_rms_norm(x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.shape[0], x.shape[1], eps)
    return y


ATTENTION_DTYPES = {torch.float32: 4, torch.bfloat16: 2}


def attention_applies(lib: ctypes.CDLL, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether spin_attention takes this model: float32 or bfloat16, D a multiple of 16 up to the
    library's limit, at most 16 query heads per KV head."""
    return (dtype in ATTENTION_DTYPES and head_dim % 16 == 0 and head_dim <= lib.spin_attention_max_head_dim()
            and heads % kv_heads == 0 and heads // kv_heads <= 16)


def attention(lib: ctypes.CDLL, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache_k: torch.Tensor,
              cache_v: torch.Tensor, slot: torch.Tensor, pos: torch.Tensor,
              anc: torch.Tensor | None = None) -> torch.Tensor:
    """Writes k, v [N, KV, D] into one layer's cache [slots, KV, max_len, D] at (slot, pos) per row,
    then returns every row's attention [N, H, D] over its slot's keys 0..pos (q [N, H, D]).

    anc [N] int64 (token trees, opt-in): 0 for an ordinary row; for token i of a tree segment, bit j set
    for each of its ancestors j and itself (tree_bits), so it attends keys [0, pos - i) and those."""
    N, H, D = q.shape
    KV, max_len = cache_k.shape[1], cache_k.shape[2]
    for t in (q, k, v):
        if t.stride(2) != 1 or t.stride(1) != D or t.dtype != cache_k.dtype:
            raise ValueError("spin_attention: rows of contiguous heads in the cache's dtype expected")
    if not (cache_k.is_contiguous() and cache_v.is_contiguous()):
        raise ValueError("spin_attention: the cache must be contiguous")
    if not all(t.dtype == torch.long and t.is_contiguous() and t.shape == (N,) for t in (slot, pos)):
        raise ValueError("spin_attention: slot and pos must be [N] contiguous int64")
    _check_anc(anc, N, "spin_attention")
    out = torch.empty(N, H, D, dtype=q.dtype)
    args = (q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
            cache_k.data_ptr(), cache_v.data_ptr(), out.data_ptr(), slot.data_ptr(), pos.data_ptr())
    rest = (N, H, KV, D, max_len, ATTENTION_DTYPES[q.dtype])
    if N and (lib.spin_attention(*args, *rest) if anc is None else lib.spin_attention_tree(*args, anc.data_ptr(), *rest)):
        raise MemoryError("spin_attention: out of memory")
    return out


MAX_TREE = 64  # tokens of one tree segment the C attention takes (one uint64 ancestor mask a token)


def tree_bits(parents_per_segment, lengths: list[int]) -> torch.Tensor:
    """[N] int64 for spin_attention_tree: 0 for each token of an ordinary segment (parents None), the
    ancestor-and-self bitmask for each token of a tree segment (bit j: token j of its segment)."""
    out: list[int] = []
    for parents, n in zip(parents_per_segment, lengths):
        if parents is None:
            out.extend([0] * n)
            continue
        if n > MAX_TREE:
            raise NotImplementedError(f"the C and Triton attention take token trees of at most {MAX_TREE} tokens; "
                                      f"this tree segment has {n} (use the torch path: target.kernels: torch)")
        bits: list[int] = []
        for i, p in enumerate(parents):
            bits.append((1 << i) | (bits[p] if p >= 0 else 0))
        out.extend(b - (1 << 64) if b >> 63 else b for b in bits)  # as int64
    return torch.tensor(out, dtype=torch.long)


def _check_anc(anc: torch.Tensor | None, N: int, what: str) -> None:
    if anc is not None and not (anc.dtype == torch.long and anc.is_contiguous() and anc.shape == (N,)):
        raise ValueError(f"{what}: anc must be [N] contiguous int64")


class _Layer(ctypes.Structure):
    _fields_ = [("attn_norm", ctypes.c_void_p), ("mlp_norm", ctypes.c_void_p), ("qkv", ctypes.c_void_p),
                ("o", ctypes.c_void_p), ("gate_up", ctypes.c_void_p), ("down", ctypes.c_void_p),
                ("qkv_bias", ctypes.c_void_p), ("qkv_s", ctypes.c_void_p), ("o_s", ctypes.c_void_p),
                ("gate_up_s", ctypes.c_void_p), ("down_s", ctypes.c_void_p)]


class _Widths(ctypes.Structure):
    _fields_ = [("qkv", ctypes.c_int64), ("gate_up", ctypes.c_int64), ("out", ctypes.c_int64)]


class Decoder:
    """A model's decoder layers run by spin_decoder: one C call a forward for all layers (cpu_decoder.c).

    Built from LlamaModel layers whose four linears are all PanelWeights of one dtype; holds the
    pointers, so the layers must outlive it (the model owns both).
    """

    def __init__(self, lib: ctypes.CDLL, layers, *, heads: int, kv_heads: int, head_dim: int, intermediate: int,
                 eps: float, dtype: torch.dtype | None = None):
        """dtype: of the rows and the cache (the model's); None: the weights' (float32 for int8 weights)."""
        self.lib = lib
        self.H, self.KV, self.D, self.I, self.eps = heads, kv_heads, head_dim, intermediate, eps
        self.dtype = dtype or layers[0].qkv.panel.act_dtype
        self.es = ATTENTION_DTYPES[self.dtype]
        first = layers[0]
        self.widths = _Widths(first.qkv.panel.padded, first.gate_up.panel.padded, first.o.panel.padded)
        self._keep = []  # contiguous copies the structs point at
        self.layers = (_Layer * len(layers))()
        for st, lw in zip(self.layers, layers):
            norms = [lw.attn_norm.float().contiguous(), lw.mlp_norm.float().contiguous()]
            bias = None if lw.qkv.bias is None else lw.qkv.bias.to(self.dtype).contiguous()
            self._keep += norms + ([bias] if bias is not None else [])
            st.attn_norm, st.mlp_norm = norms[0].data_ptr(), norms[1].data_ptr()
            st.qkv, st.o = lw.qkv.panel.packed.data_ptr(), lw.o.panel.packed.data_ptr()
            st.gate_up, st.down = lw.gate_up.panel.packed.data_ptr(), lw.down.panel.packed.data_ptr()
            if lw.qkv.panel.scale is not None:
                st.qkv_s, st.o_s = lw.qkv.panel.scale.data_ptr(), lw.o.panel.scale.data_ptr()
                st.gate_up_s, st.down_s = lw.gate_up.panel.scale.data_ptr(), lw.down.panel.scale.data_ptr()
            st.qkv_bias = None if bias is None else bias.data_ptr()

    @staticmethod
    def applies(lib: ctypes.CDLL, layers, dtype: torch.dtype) -> bool:
        """All four linears of every layer on the panel GEMM in the model's dtype (or int8 weights, in a float32
        or bfloat16 model: cpu_decoder.c widens a bfloat16 model's rows for them), one shape and storage for
        all (o and down both give the hidden size, so their padded widths agree)."""
        if not layers or dtype not in ATTENTION_DTYPES:
            return False
        first = layers[0]
        if first.o.panel is None or first.down.panel is None or first.o.panel.padded != first.down.panel.padded:
            return False
        for lw in layers:
            for name in ("qkv", "o", "gate_up", "down"):
                lin, ref = getattr(lw, name), getattr(first, name)
                if (lin.panel is None or (lin.panel.act_dtype != dtype and lin.panel.scale is None)
                        or lin.panel.dtype != ref.panel.dtype or lin.panel.padded != ref.panel.padded):
                    return False
            if lw.o.bias is not None or lw.gate_up.bias is not None or lw.down.bias is not None:
                return False
        return True

    def __call__(self, h: torch.Tensor, num_layers: int, slot: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor,
                 sin_signed: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor,
                 anc: torch.Tensor | None = None) -> torch.Tensor:
        """Runs layers 0..num_layers-1 on the float32 residual h [N, C] in place and returns it. cos and
        sin_signed are [N, D] float32 per row; cache_k / cache_v [layers, slots, KV, max_len, D]; pos is
        each row's cache row; anc [N] (token trees, opt-in) as in attention()."""
        N, C = h.shape
        if not (h.dtype == torch.float32 and h.is_contiguous() and cache_k.is_contiguous() and cache_v.is_contiguous()
                and cache_k.dtype == self.dtype and cos.dtype == sin_signed.dtype == torch.float32
                and cos.is_contiguous() and sin_signed.is_contiguous() and 0 < num_layers <= len(self.layers)
                and cache_k.shape[0] >= num_layers):
            raise ValueError("spin_decoder: unexpected inputs")
        if not all(t.dtype == torch.long and t.is_contiguous() and t.shape == (N,) for t in (slot, pos)):
            raise ValueError("spin_decoder: slot and pos must be [N] contiguous int64")
        _check_anc(anc, N, "spin_decoder")
        if N == 0:
            return h
        scratch = torch.empty(self.lib.spin_decoder_scratch(N, C, self.H, self.D, self.I, ctypes.byref(self.widths),
                                                            self.es), dtype=torch.uint8)
        layer_bytes = cache_k.stride(0) * cache_k.element_size()
        args = (h.data_ptr(), N, self.layers, num_layers, slot.data_ptr(), pos.data_ptr(), cos.data_ptr(),
                sin_signed.data_ptr(), C, self.H, self.KV, self.D, self.I, ctypes.byref(self.widths), cache_k.shape[3],
                self.eps, self.es, cache_k.data_ptr(), cache_v.data_ptr(), layer_bytes, scratch.data_ptr())
        if self.lib.spin_decoder(*args) if anc is None else self.lib.spin_decoder_tree(*args, anc.data_ptr()):
            raise MemoryError("spin_decoder: out of memory")
        return h
