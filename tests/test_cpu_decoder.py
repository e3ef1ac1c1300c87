"""The C decoder on CPU (spin_batch/models/cpu_decoder.c): its panel GEMMs in float32 and bfloat16, norm,
attention and whole-decoder call: values, batch independence, fallbacks, builds."""

from __future__ import annotations

import re
import shutil
from fnmatch import fnmatch
from pathlib import Path

import pytest
import torch

from spin_batch.models import cpu_decoder
from spin_batch.models import llama
from spin_batch.models.llama import Linear


SHAPES = [(1, 64, 64), (5, 960, 576), (13, 100, 70), (30, 33, 2), (80, 320, 136), (0, 64, 8)]


@pytest.mark.parametrize("M,O,K", SHAPES + [(30, 33, 1)])
def test_matches_float64_reference(lib, M, O, K):
    g = torch.Generator().manual_seed(M * 1000 + O + K)
    w, x = torch.randn(O, K, generator=g), torch.randn(M, K, generator=g)
    y = cpu_decoder.PanelWeight(lib, w)(x)
    assert y.shape == (M, O) and y.dtype == torch.float32
    ref = x.double() @ w.double().T
    # one lane sums K products in order: error bound ~ K * eps * sum |x||w|
    bound = K * 1.2e-7 * (x.double().abs() @ w.double().abs().T) + 1e-30
    assert ((y.double() - ref).abs() <= bound).all()


def test_a_rows_result_does_not_depend_on_its_batch(lib):
    g = torch.Generator().manual_seed(7)
    w, x = torch.randn(3072, 576, generator=g), torch.randn(29, 576, generator=g)
    pw = cpu_decoder.PanelWeight(lib, w)
    full = pw(x)
    for lo, hi in [(0, 1), (3, 4), (5, 10), (12, 25), (28, 29), (0, 29)]:
        assert torch.equal(pw(x[lo:hi]), full[lo:hi]), (lo, hi)


def test_linear_uses_it_for_float32_and_adds_the_bias(lib):
    w, b, x = torch.randn(50, 40), torch.randn(50), torch.randn(3, 40)
    lin = Linear(w, b)
    assert lin.panel is not None and lin.weight is None
    torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("M,O,K", SHAPES)
def test_bf16_matches_float64_reference(lib, M, O, K):
    g = torch.Generator().manual_seed(M * 1000 + O + K)
    w, x = torch.randn(O, K, generator=g).bfloat16(), torch.randn(M, K, generator=g).bfloat16()
    y = cpu_decoder.PanelWeight(lib, w)(x)
    assert y.shape == (M, O) and y.dtype == torch.bfloat16
    ref = x.double() @ w.double().T
    # float32 sums in order (~K * eps32), then one rounding to bfloat16 (half an ulp: at most 2^-8 relative)
    bound = K * 1.2e-7 * (x.double().abs() @ w.double().abs().T) * 1.01 + 2.0 ** -8 * ref.abs() + 1e-30
    assert ((y.double() - ref).abs() <= bound).all()
    # and it is the nearest bfloat16 to the float32 sum almost everywhere
    if M:
        assert (y == (x.float() @ w.float().T).bfloat16()).float().mean() > 0.99


def test_bf16_rows_result_does_not_depend_on_its_batch(lib):
    g = torch.Generator().manual_seed(8)
    w, x = torch.randn(3072, 576, generator=g).bfloat16(), torch.randn(29, 576, generator=g).bfloat16()
    pw = cpu_decoder.PanelWeight(lib, w)
    full = pw(x)
    for lo, hi in [(0, 1), (3, 4), (5, 10), (12, 25), (28, 29), (0, 29)]:
        assert torch.equal(pw(x[lo:hi]), full[lo:hi]), (lo, hi)


def test_linear_uses_it_for_bfloat16_on_every_cpu(lib):
    """Every build has a bfloat16 GEMM: AVX512-BF16's dot products where the CPU has them, else the weights
    widened to float32 (AVX2, AVX-512 without BF16, NEON)."""
    w, b, x = torch.randn(50, 40).bfloat16(), torch.randn(50).bfloat16(), torch.randn(3, 40).bfloat16()
    lin = Linear(w, b)
    assert lin.panel is not None and lin.weight is None
    y = lin(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, torch.nn.functional.linear(x, w, b), rtol=2e-2, atol=2e-2)
    w_odd = torch.randn(8, 7).bfloat16()
    odd = Linear(w_odd)  # the kernel reads inputs in pairs: odd widths go to torch
    assert odd.panel is None and odd.packed == llama.onednn_takes(torch.bfloat16)
    x_odd = torch.randn(2, 7).bfloat16()
    torch.testing.assert_close(odd(x_odd), x_odd @ w_odd.T, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("amx", [True, False], ids=["amx", "no-amx"])
def test_throughput_block_leaves_bfloat16_to_onednn_on_amx_only(lib, monkeypatch, amx):
    """Inside throughput_gemm() (the distill teacher), bfloat16 weights go to oneDNN where the CPU has
    AMX, and the result is the same product; float32 weights, and everything outside the block, keep
    the panel GEMM."""
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    w, x = torch.randn(50, 40).bfloat16(), torch.randn(3, 40).bfloat16()
    with cpu_decoder.throughput_gemm():
        fast, f32 = Linear(w), Linear(w.float())
    to_onednn = amx and llama.onednn_takes(torch.bfloat16)  # oneDNN held to AVX2 cannot use the tiles
    assert (fast.panel is None and fast.packed) if to_onednn else fast.panel is not None
    assert f32.panel is not None
    assert Linear(w).panel is not None  # the block has ended
    torch.testing.assert_close(fast(x), torch.nn.functional.linear(x, w), rtol=2e-2, atol=2e-2)


def test_off_and_unbuildable_fall_back_to_onednn(monkeypatch, tmp_path):
    """A linear kept off the C path, and one where the library cannot be built (said once), run on oneDNN;
    a job that asked for the C decoder is told why it cannot have it."""
    w = torch.randn(64, 32)
    assert Linear(w, panel=False).panel is None and Linear(w).panel is not None
    try:
        monkeypatch.setenv("SPIN_BATCH_CACHE", str(tmp_path))  # nothing built there yet
        monkeypatch.setenv("CC", "no-such-compiler")
        cpu_decoder.reset()
        with pytest.warns(UserWarning, match="using oneDNN and torch instead"):
            lin = Linear(w)
        assert lin.panel is None
        torch.testing.assert_close(lin(torch.ones(2, 32)), torch.ones(2, 32) @ w.T)
        with pytest.raises(cpu_decoder.CpuDecoderUnavailable, match="^target.kernels: c, but .*no-such-compiler"):
            cpu_decoder.require("target.kernels: c")
    finally:
        monkeypatch.undo()
        cpu_decoder.reset()


def test_a_failed_compile_says_why(monkeypatch, tmp_path):
    bad = tmp_path / "cc"
    bad.write_text("#!/bin/sh\necho 'cc: internal error' >&2\nexit 1\n")
    bad.chmod(0o755)
    try:
        monkeypatch.setenv("SPIN_BATCH_CACHE", str(tmp_path / "cache"))
        monkeypatch.setenv("CC", str(bad))
        cpu_decoder.reset()
        with pytest.raises(cpu_decoder.CpuDecoderUnavailable, match="internal error"):
            cpu_decoder.require("SPIN_BATCH_CPU_GEMM=on")
    finally:
        monkeypatch.undo()
        cpu_decoder.reset()


@pytest.mark.parametrize("asked", ["target.kernels: c", "SPIN_BATCH_CPU_GEMM=on"])
@pytest.mark.parametrize("command", ["run", "validate"])
def test_run_says_so_when_the_kernel_is_required_but_cannot_build(monkeypatch, tmp_path, tiny_dir, asked, command):
    """The job (target.kernels: c) or the environment asks for the C decoder where it cannot be built: run and
    validate both stop before any model loads, saying what asked for it and why it cannot be had."""
    from click.testing import CliRunner
    from conftest import write_job

    from spin_batch.cli import main
    from spin_batch.models import loader

    target = {"kernels": "c"} if asked.startswith("target") else {}
    job = write_job(tmp_path, tiny_dir, rows=[{"id": "a", "prompt": "red green"}], out=tmp_path / "out",
                    target=target, sampling={"max_tokens": 2})
    try:
        monkeypatch.setenv("SPIN_BATCH_CACHE", str(tmp_path / "cache"))
        monkeypatch.setenv("CC", "no-such-compiler")
        if asked.startswith("target"):
            monkeypatch.delenv("SPIN_BATCH_CPU_GEMM", raising=False)
        else:
            monkeypatch.setenv("SPIN_BATCH_CPU_GEMM", "on")
        monkeypatch.setattr(loader, "load_state_dict", lambda *a: pytest.fail("a model loaded"))
        cpu_decoder.reset()
        res = CliRunner().invoke(main, [command, str(job)])
        assert res.exit_code == 1, res.output
        assert f"{asked}, but the C decoder cannot be built here: no C compiler ('no-such-compiler'" in res.output
        assert "Traceback" not in res.output
    finally:
        monkeypatch.undo()
        cpu_decoder.reset()


@pytest.mark.parametrize("M,C", [(1, 576), (16, 64), (3, 70), (0, 32)])
def test_rms_norm_matches_torch(lib, M, C):
    g = torch.Generator().manual_seed(M + C)
    x, w = torch.randn(M, C, generator=g) * 3, torch.randn(C, generator=g)
    got = cpu_decoder.rms_norm(lib, x, w, 1e-5)
    torch.testing.assert_close(got, torch.nn.functional.rms_norm(x, (C,), w, 1e-5), rtol=2e-6, atol=2e-6)


def test_the_model_norms_with_it_on_cpu(lib, tiny_dir):
    from spin_batch.models.loader import load_model

    model = load_model(tiny_dir, "float32", torch.device("cpu"))
    assert model.cpu_lib is not None
    h = torch.randn(5, model.spec.hidden_size)
    w = model.layers[0].attn_norm
    torch.testing.assert_close(model.normed(h, w), torch.nn.functional.rms_norm(h, w.shape, w, model.spec.rms_norm_eps))


# -- attention ------------------------------------------------------------------------------


def _attention_case(dtype, seed=0, slots=4, KV=3, H=9, D=64, L=300):
    g = torch.Generator().manual_seed(seed)
    cache = [torch.randn(slots, KV, L, D, generator=g).to(dtype) for _ in range(2)]
    return cache, lambda N: (torch.randn(N, H + KV, D, generator=g).to(dtype),
                             torch.randn(N, KV, D, generator=g).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_writes_the_cache_and_matches_the_torch_reference(lib, dtype):
    from spin_batch.models.attention import attention_ref
    from spin_batch.models.segments import Segments

    (ck, cv), make = _attention_case(dtype)
    seg = Segments.build([(2, 1, 100), (0, 5, 37), (3, 70, 130), (1, 1, 0), (2, 3, 101)][:4])
    qk, v = make(seg.num_tokens)
    want_k, want_v = ck.clone(), cv.clone()
    for i, (s, p) in enumerate(zip(seg.token_slots.tolist(), seg.positions.tolist())):
        want_k[s, :, p], want_v[s, :, p] = qk[i, 9:], v[i]
    out = cpu_decoder.attention(lib, qk[:, :9], qk[:, 9:], v, ck, cv, seg.token_slots, seg.positions)
    assert out.dtype == dtype and out.shape == (seg.num_tokens, 9, 64)
    assert torch.equal(ck, want_k) and torch.equal(cv, want_v)
    ref = attention_ref(qk[:, :9].double(), want_k.double(), want_v.double(), seg)
    tol = 1e-5 if dtype == torch.float32 else 2 ** -8 * ref.abs().max().item()
    assert (out.double() - ref).abs().max() <= tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_attention_does_not_depend_on_its_segment_or_batch(lib, dtype):
    """One row, same cache: alone as a decode step, inside a verify run, inside a prefill chunk and
    next to other slots' rows, bitwise the same (what greedy equality needs of attention)."""
    from spin_batch.models.segments import Segments

    (ck, cv), make = _attention_case(dtype, seed=3)
    qk, v = make(40)  # rows for slot 1, positions 150..189, written once
    cpu_decoder.attention(lib, qk[:, :9], qk[:, 9:], v, ck, cv, torch.full((40,), 1), torch.arange(150, 190))
    want = {}
    for p in (150, 157, 189):  # each row alone, as a decode step over the full cache
        i = p - 150
        want[p] = cpu_decoder.attention(lib, qk[i:i + 1, :9], qk[i:i + 1, 9:], v[i:i + 1], ck, cv,
                                     torch.tensor([1]), torch.tensor([p]))[0]
    for parts, first in [([(1, 40, 150)], 150),  # the prefill chunk
                         ([(0, 2, 10), (1, 8, 150), (3, 1, 77)], 150),  # a verify run among other slots
                         ([(2, 16, 0), (1, 33, 157), (0, 1, 5)], 157)]:
        seg = Segments.build(parts)
        ref_qk, ref_v = make(seg.num_tokens)
        a = seg.starts[[s for s, _, _ in parts].index(1)]
        n = [n for s, n, _ in parts if s == 1][0]
        ref_qk[a:a + n], ref_v[a:a + n] = qk[first - 150:first - 150 + n], v[first - 150:first - 150 + n]
        out = cpu_decoder.attention(lib, ref_qk[:, :9], ref_qk[:, 9:], ref_v, ck.clone(), cv.clone(), seg.token_slots,
                                 seg.positions)
        for p, row in want.items():
            if first <= p < first + n:
                assert torch.equal(out[a + p - first], row), (parts, p)


def test_the_model_attends_with_it_on_cpu(lib, tiny_dir):
    from spin_batch.models.loader import load_model

    assert load_model(tiny_dir, "float32", torch.device("cpu")).plan.attention == "c"
    assert load_model(tiny_dir, "bfloat16", torch.device("cpu")).plan.attention == "c"
    # float16 stays on the torch path
    assert load_model(tiny_dir, "float16", torch.device("cpu")).plan.attention == "torch"


# -- the decoder layers in one call ------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_c_decoder_matches_the_per_layer_path(lib, tiny_dir, tiny_qwen_dir, dtype):
    """Same model, same cache contents: spin_decoder against the torch-glue path over the same kernels
    (prefill, then a decode step and a verify run among other slots; Qwen2 brings the q/k/v bias)."""
    from spin_batch.models.loader import load_model
    from spin_batch.models.segments import Segments

    for model_dir in (tiny_dir, tiny_qwen_dir):
        model = load_model(model_dir, dtype, torch.device("cpu"))
        assert model.c_decoder is not None
        caches = [model.allocate_cache(3, 64), model.allocate_cache(3, 64)]
        g = torch.Generator().manual_seed(5)
        steps = [[(0, 20, 0), (2, 9, 0)], [(0, 1, 20), (1, 7, 0), (2, 4, 9)]]
        for parts in steps:
            seg = Segments.build(parts)
            tokens = torch.randint(0, model.spec.vocab_size, (seg.num_tokens,), generator=g)
            model.path = "c_decoder"
            got = model.hidden(tokens, seg, caches[0])
            model.path = "c"  # the per-layer path: torch glue over the C attention and GEMMs
            want = model.hidden(tokens, seg, caches[1])
            tol = 1e-4 if dtype == "float32" else 0.1 * want.abs().max().item()
            assert (got - want).abs().max().item() <= tol
        model.path = "c_decoder"


def test_a_rows_hidden_state_does_not_depend_on_its_batch(lib, tiny_dir):
    """Through the whole C decoder: a row decoded alone equals the same row inside a verify run next to
    other slots' rows, bit for bit (float32)."""
    from spin_batch.models.loader import load_model
    from spin_batch.models.segments import Segments

    model = load_model(tiny_dir, "float32", torch.device("cpu"))
    assert model.c_decoder is not None
    g = torch.Generator().manual_seed(9)
    prompt = torch.randint(0, model.spec.vocab_size, (12,), generator=g)
    nxt = torch.randint(0, model.spec.vocab_size, (4,), generator=g)
    a, b = model.allocate_cache(4, 64), model.allocate_cache(4, 64)
    for cache in (a, b):
        model.hidden(prompt, Segments.build([(1, 12, 0)]), cache)
    alone = [model.hidden(nxt[i:i + 1], Segments.build([(1, 1, 12 + i)]), a)[0] for i in range(4)]
    other = torch.randint(0, model.spec.vocab_size, (6,), generator=g)
    mixed = model.hidden(torch.cat((other[:3], nxt, other[3:])), Segments.build([(0, 3, 0), (1, 4, 12), (3, 3, 0)]), b)
    for i in range(4):
        assert torch.equal(mixed[3 + i], alone[i]), i


def test_a_new_source_replaces_this_machines_old_build(monkeypatch, tmp_path):
    monkeypatch.setenv("SPIN_BATCH_CACHE", str(tmp_path))
    folder, legacy = tmp_path / "cpu_decoder", tmp_path / "cpu_gemm"
    legacy.mkdir()
    (legacy / "cpu_gemm-0123456789abcdef.so").write_bytes(b"the first naming scheme")
    (legacy / f"cpu_gemm-{cpu_decoder.machine_key()}-0123456789ab.so").write_bytes(b"this machine, the former name")
    (legacy / "cpu_gemm-othermachine0-0123456789ab.so").write_bytes(b"another kind of CPU")
    first = cpu_decoder._build("cc")
    assert first.parent == folder and first.name.startswith("cpu_decoder-")
    assert [p.name for p in legacy.glob("*.so")] == ["cpu_gemm-othermachine0-0123456789ab.so"]
    copy = tmp_path / "src"  # the sources, one part changed: a change to any file is a new source
    shutil.copytree(cpu_decoder.SOURCE.parent / cpu_decoder.PARTS, copy / cpu_decoder.PARTS)
    shutil.copy(cpu_decoder.SOURCE, copy)
    part = copy / cpu_decoder.PARTS / "attention.c"
    part.write_text(part.read_text() + "\n/* a newer version */\n")
    monkeypatch.setattr(cpu_decoder, "SOURCE", copy / cpu_decoder.SOURCE.name)
    second = cpu_decoder._build("cc")
    assert second != first and second.exists() and not first.exists()
    assert [p.name for p in folder.glob("*.so")] == [second.name]
    assert [p.name for p in legacy.glob("*.so")] == ["cpu_gemm-othermachine0-0123456789ab.so"]
    assert cpu_decoder._build("cc") == second  # cached: no rebuild, nothing removed


def test_the_sources_are_every_file_the_build_includes_and_ship_with_the_package():
    """The build key (sources()) covers each file cpu_decoder.c includes, at any depth, and pyproject.toml's
    package data ships each of them."""
    files = cpu_decoder.sources()
    included = set()
    for f in files:
        included |= {(f.parent / name).resolve() for name in re.findall(r'#include "([^"]+)"', f.read_text())}
    assert included and included <= {f.resolve() for f in files}
    assert {f.resolve() for f in files} - included == {cpu_decoder.SOURCE.resolve()}  # nothing unused in csrc/
    tomllib = pytest.importorskip("tomllib")
    pyproject = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["spin_batch.models"]
    for f in files:
        name = f.relative_to(cpu_decoder.SOURCE.parent).as_posix()
        assert any(fnmatch(name, p) for p in patterns), name


def test_bf16_many_rows_in_chunks_keep_each_rows_result(lib):
    """Past 240 rows the widening bfloat16 GEMM (builds without AVX512-BF16: the x86-64-v3 pass) sums in
    row chunks, so its buffer is bounded whatever M is; a row's result still does not depend on its batch."""
    g = torch.Generator().manual_seed(9)
    w, x = torch.randn(96, 64, generator=g).bfloat16(), torch.randn(700, 64, generator=g).bfloat16()
    pw = cpu_decoder.PanelWeight(lib, w)
    full = pw(x)
    for lo, hi in [(0, 1), (239, 241), (250, 251), (480, 700)]:
        assert torch.equal(pw(x[lo:hi]), full[lo:hi]), (lo, hi)
    assert (full == (x.float() @ w.float().T).bfloat16()).float().mean() > 0.99


def test_argmax_in_c_is_torchs_argmax(lib):
    """The first maximum of each row, a NaN counting as the maximum; rows of a padded buffer (a stride wider than
    the row); what C does not take (another dtype) goes to torch."""
    g = torch.Generator().manual_seed(9)
    y = torch.randn(9, 49157, generator=g)
    y[1, 40000] = y[1, 3] = y[1].max() + 1.0  # a tie: the first index
    y[2, 49156] = 50.0  # in the tail past the last full vector
    y[3, 17] = float("nan")
    y[3, 5] = float("nan")
    y[4] = float("-inf")
    y[5, 100] = float("inf")
    y[6] = 0.0
    assert torch.equal(cpu_decoder.argmax(y), y.argmax(-1))
    assert cpu_decoder.argmax(y).tolist()[1:5] == [3, 49156, 5, 0]
    padded = y[:, :49152]
    assert padded.stride(0) == 49157 and torch.equal(cpu_decoder.argmax(padded), padded.argmax(-1))
    assert torch.equal(cpu_decoder.argmax(y[:0]), y[:0].argmax(-1))
    small = torch.randn(3, 5, generator=g)
    assert torch.equal(cpu_decoder.argmax(small), small.argmax(-1))
    assert torch.equal(cpu_decoder.argmax(y.double()), y.double().argmax(-1))
