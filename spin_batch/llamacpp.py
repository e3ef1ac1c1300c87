"""llama.cpp as a reference engine in `spin-batch bench`: methods llamacpp:f32, llamacpp:f16, llamacpp:q8_0,
llamacpp:source.

Optional: it needs `pip install llama-cpp-python` (it builds llama.cpp from source, a few
minutes). The point is a reference measured on the same machine in the same run, since CPUs
differ by 2x in memory bandwidth and the absolute figures mean little across machines.

The weights come from the target's GGUF (builtin: targets ship one; a model directory may hold
one). f32, f16 and q8_0 re-encode it once into the cache: every quantised tensor is dequantised to
float32 and written as F32, F16 or Q8_0 (1-D tensors stay F32, as llama.cpp's converters leave them).
q8_0 is llama.cpp's int8 format (a scale per 32 weights), beside which `target.quantize: int8` runs.
The builtin GGUF is Q4_1, so its f32 re-encoding holds exactly the weights our fp32 safetensors
hold. `source` runs the GGUF as shipped.

Decoding is llama.cpp's own batched API driven like our loop: `slots` sequences decode together,
one token each per llama_decode call, greedy (argmax of the logits), and a finished sequence's
slot is refilled with the next prompt, prefilled in chunks of up to n_batch tokens. Its outputs
are not expected to equal ours token for token (different kernels round differently), so the
bench reports how far they agree rather than failing on them.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import numpy as np

from .cachedir import cache_root, cached_file
from .models import loader

FORMATS = ("f32", "f16", "q8_0", "source")


class LlamaCppUnavailable(RuntimeError):
    pass


def available() -> bool:
    """Whether llama-cpp-python imports here (installed with its dependencies, its library loadable)."""
    try:
        import llama_cpp  # noqa: F401
    except Exception:  # ImportError, or its library failing to load (OSError)
        return False
    return True


def source_gguf(model_spec: str, model_dir: Path) -> Path:
    """The GGUF a target was made from: the builtin package's, or the one .gguf in its directory."""
    name = loader.builtin_name(model_spec)
    if name is not None:
        return loader.builtin_gguf(name)
    found = sorted(Path(model_dir).glob("*.gguf"))
    if len(found) != 1:
        raise LlamaCppUnavailable(
            f"the llamacpp bench methods need the target as a GGUF: a builtin: model, or exactly one .gguf file "
            f"in {model_dir} (found {len(found)})")
    return found[0]


def reencoded(src: Path, fmt: str) -> Path:
    """src re-encoded as fmt ('f32', 'f16' or 'q8_0') in the cache, made once under a lock; 'source' is src."""
    if fmt == "source":
        return src
    if fmt not in FORMATS:
        raise ValueError(f"unknown llama.cpp format {fmt!r}; choose from {', '.join(FORMATS)}")
    return cached_file(cache_root() / "gguf" / f"{src.stem}.{fmt}.gguf",
                              lambda tmp: _reencode(src, tmp, fmt))


def _reencode(src: Path, dst: Path, fmt: str) -> None:
    import gguf

    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(dst), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = field.contents()
        if key == "general.file_type":
            value = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                     "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[fmt]
        sub = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, field.types[0], sub_type=sub)
    for t in reader.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        if fmt == "f16" and w.ndim > 1:
            writer.add_tensor(t.name, w.astype(np.float16), raw_dtype=gguf.GGMLQuantizationType.F16)
        elif fmt == "q8_0" and w.ndim > 1:
            q8 = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(t.name, gguf.quants.quantize(w, q8), raw_dtype=q8)
        else:
            writer.add_tensor(t.name, w, raw_dtype=gguf.GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


class LlamaCpp:
    """One llama.cpp model and context sized for `slots` sequences of up to max_len tokens each."""

    def __init__(self, path: Path, slots: int, max_len: int, n_batch: int, threads: int | None = None):
        try:
            import llama_cpp
        except ImportError as e:  # pragma: no cover - depends on the optional package
            raise LlamaCppUnavailable("the llamacpp bench methods need `pip install llama-cpp-python`") from e
        self.lc = llama_cpp
        self.slots, self.max_len, self.n_batch = slots, max_len, max(n_batch, slots)
        threads = threads or len(os.sched_getaffinity(0))
        lc = llama_cpp
        self._quiet = lc.llama_log_callback(lambda level, text, user: None)  # kept: llama.cpp holds the pointer
        lc.llama_log_set(self._quiet, ctypes.c_void_p(0))
        lc.llama_backend_init()
        mparams = lc.llama_model_default_params()
        # No extra weight buffers (repacked or AMX layouts, quantized types only: F32 and F16 have none). With
        # them, llama-cpp-python 0.3.36 crashed in llama_decode on the embedded model's Q4_1 GGUF on an AMX CPU.
        mparams.use_extra_bufts = False
        self.model = lc.llama_model_load_from_file(str(path).encode(), mparams)
        if not self.model:
            raise LlamaCppUnavailable(f"llama.cpp could not load {path}")
        params = lc.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch = slots * max_len, self.n_batch, self.n_batch
        params.n_seq_max, params.kv_unified = slots, True
        params.n_threads = params.n_threads_batch = threads
        self.ctx = lc.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise LlamaCppUnavailable(f"llama.cpp could not make a context for {slots} x {max_len} tokens")
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.batch = lc.llama_batch_init(self.n_batch, 0, 1)

    def close(self) -> None:
        self.lc.llama_batch_free(self.batch)
        self.lc.llama_free(self.ctx)
        self.lc.llama_model_free(self.model)

    def _decode(self, rows: list[tuple[int, int, int, bool]]) -> None:
        """rows: (token, position, sequence, wants logits)."""
        b = self.batch
        b.n_tokens = len(rows)
        for i, (tok, pos, seq, want) in enumerate(rows):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, want
            b.seq_id[i][0] = seq
        rc = self.lc.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def _argmax(self, i: int) -> int:
        ptr = self.lc.llama_get_logits_ith(self.ctx, i)
        return int(np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), (self.n_vocab,)).argmax())

    def generate(self, prompts: list[list[int]], max_tokens: int, eos: set[int]) -> list[list[int]]:
        """Greedy continuations of every prompt, `slots` at a time with refill; EOS included when it ends one."""
        out: list[list[int]] = [[] for _ in prompts]
        queue = list(range(len(prompts)))[::-1]
        active: dict[int, tuple[int, int]] = {}  # sequence -> (prompt index, next position)
        mem = self.lc.llama_get_memory(self.ctx)
        last: dict[int, int] = {}  # sequence -> the token to feed next
        while queue or active:
            for seq in range(self.slots):  # refill free sequences: prefill their prompts
                if seq in active or not queue:
                    continue
                p = queue.pop()
                ids = prompts[p]
                if not ids or len(ids) + 1 > self.max_len:
                    raise ValueError(f"prompt {p} has {len(ids)} tokens; max_model_len {self.max_len} leaves no room")
                self.lc.llama_memory_seq_rm(mem, seq, -1, -1)
                for a in range(0, len(ids), self.n_batch):
                    chunk = ids[a : a + self.n_batch]
                    self._decode([(t, a + j, seq, a + j == len(ids) - 1) for j, t in enumerate(chunk)])
                tok = self._argmax(len(chunk) - 1)
                out[p].append(tok)
                active[seq], last[seq] = (p, len(ids)), tok
                if tok in eos or max_tokens <= 1 or len(ids) + 1 >= self.max_len:
                    del active[seq]
            seqs = sorted(active)
            if not seqs:
                continue
            self._decode([(last[s], active[s][1], s, True) for s in seqs])
            for i, s in enumerate(seqs):
                p, pos = active[s]
                tok = self._argmax(i)
                out[p].append(tok)
                active[s], last[s] = (p, pos + 1), tok
                if tok in eos or len(out[p]) >= max_tokens or pos + 2 >= self.max_len:  # prompt + generated, as our loop
                    del active[s]
        return out
