"""Our packed-forward runtime against transformers' model on the same weights (fp32)."""

from __future__ import annotations

import pytest
import torch

from spin_batch.models import execution
from spin_batch.models.loader import load_model, read_spec
from spin_batch.models.segments import Segments
from spin_batch.models.spec import ModelSpec, UnsupportedModelError

from conftest import build_tiny_model, write_job

ATOL = 2e-4


def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()  # [T, V]


@pytest.mark.parametrize("which", ["tiny_dir", "tiny_qwen_dir"])
def test_prefill_logits_match_transformers(request, which):
    path = request.getfixturevalue(which)
    ours = load_model(path)
    ref = hf_model(path)
    ids = torch.randint(0, ours.spec.vocab_size, (23,), generator=torch.Generator().manual_seed(0)).tolist()
    cache = ours.allocate_cache(slots=2, max_len=64)
    got = ours.forward(torch.tensor(ids), Segments.build([(1, len(ids), 0)]), cache)
    torch.testing.assert_close(got, hf_logits(ref, ids), atol=ATOL, rtol=0)


@pytest.mark.parametrize("which", ["tiny_dir", "tiny_qwen_dir"])
def test_mixed_batch_decode_and_chunks_match_transformers(request, which):
    """Slots at different cache lengths, fed 1, 3 and 5 new tokens in one packed forward."""
    path = request.getfixturevalue(which)
    ours = load_model(path)
    ref = hf_model(path)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, ours.spec.vocab_size, (n,), generator=g).tolist() for n in (9, 17, 4)]
    cache = ours.allocate_cache(slots=4, max_len=64)
    slots = [3, 0, 2]
    prefix = [5, 14, 3]  # tokens prefilled first, in one packed forward of three chunks
    ours.forward(
        torch.tensor(sum((s[:p] for s, p in zip(seqs, prefix)), [])),
        Segments.build([(sl, p, 0) for sl, p in zip(slots, prefix)]),
        cache,
        logits_rows=[],
    )
    new = [len(s) - p for s, p in zip(seqs, prefix)]  # 4, 3, 1
    seg = Segments.build([(sl, n, p) for sl, n, p in zip(slots, new, prefix)])
    got = ours.forward(torch.tensor(sum((s[p:] for s, p in zip(seqs, prefix)), [])), seg, cache)
    for i, (s, p) in enumerate(zip(seqs, prefix)):
        want = hf_logits(ref, s)[p:]
        torch.testing.assert_close(got[seg.starts[i] : seg.starts[i + 1]], want, atol=ATOL, rtol=0)


def test_bfloat16_forward_tracks_float32(tiny_dir):
    """bf16 weights with the float32 residual stream: a packed mixed batch (chunks, then 1/3/5
    new tokens) stays within bf16 rounding of transformers' float32 logits."""
    ours = load_model(tiny_dir, dtype="bfloat16")
    assert ours.dtype == torch.bfloat16 and ours.norm.dtype == torch.float32
    ref = hf_model(tiny_dir)
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, ours.spec.vocab_size, (n,), generator=g).tolist() for n in (9, 17, 4)]
    cache = ours.allocate_cache(slots=3, max_len=64)
    prefix = [8, 14, 3]
    ours.forward(torch.tensor(sum((s[:p] for s, p in zip(seqs, prefix)), [])),
                 Segments.build([(i, p, 0) for i, p in enumerate(prefix)]), cache, logits_rows=[])
    seg = Segments.build([(i, len(s) - p, p) for i, (s, p) in enumerate(zip(seqs, prefix))])
    got = ours.forward(torch.tensor(sum((s[p:] for s, p in zip(seqs, prefix)), [])), seg, cache)
    assert got.dtype == torch.float32
    want = torch.cat([hf_logits(ref, s)[p:] for s, p in zip(seqs, prefix)])
    scale = want.abs().max()
    assert (got - want).abs().max() < 0.03 * scale, ((got - want).abs().max(), scale)
    assert torch.nn.functional.cosine_similarity(got, want, dim=-1).min() > 0.999


def test_early_exit_logits_match_truncated_model(tiny_dir):
    """num_layers=L equals the HF model's hidden state after L layers, then final norm + head."""
    ours = load_model(tiny_dir)
    ref = hf_model(tiny_dir)
    ids = list(range(3, 15))
    cache = ours.allocate_cache(slots=1, max_len=32)
    got = ours.forward(torch.tensor(ids), Segments.build([(0, len(ids), 0)]), cache, num_layers=1)
    with torch.no_grad():
        out = ref(torch.tensor([ids]), output_hidden_states=True)
        want = ref.lm_head(ref.model.norm(out.hidden_states[1]))[0]
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_rollback_overwrites_stale_cache(tiny_dir):
    """Moving a slot's length back and writing again gives the logits of the new sequence."""
    ours = load_model(tiny_dir)
    ref = hf_model(tiny_dir)
    cache = ours.allocate_cache(slots=1, max_len=32)
    ours.forward(torch.tensor([5, 6, 7, 8, 9, 10]), Segments.build([(0, 6, 0)]), cache)
    # keep 3 tokens, then feed a different continuation
    got = ours.forward(torch.tensor([20, 21]), Segments.build([(0, 2, 3)]), cache)
    torch.testing.assert_close(got, hf_logits(ref, [5, 6, 7, 20, 21])[3:], atol=ATOL, rtol=0)


def test_unsupported_architecture_is_named():
    with pytest.raises(UnsupportedModelError, match="supported: llama, mistral, qwen2"):
        ModelSpec.from_hf_config({"model_type": "gpt2"})


def test_spec_reads_config(tiny_dir):
    spec = read_spec(tiny_dir)
    assert (spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (3, 4, 2, 16)


def test_segments_padding_accounting():
    seg = Segments.build([(0, 1, 10), (1, 5, 2)])
    assert seg.num_tokens == 6 and seg.last_rows() == [0, 5]
    assert seg.positions.tolist() == [10, 2, 3, 4, 5, 6]
    assert seg.padded_tokens() == 2 * 5 * 11
    assert seg.packed_tokens() == 1 * 11 + 5 * 7


@pytest.mark.parametrize("seed", range(6))
def test_packed_attention_matches_reference_on_any_layout(seed):
    """Grouped short segments (padded per group over a span of slots) and long chunks, against the
    per-segment reference: mixed draft lengths, slots out of order, gaps between them."""
    from spin_batch.models.attention import AttentionPlan, attention, attention_ref

    g = torch.Generator().manual_seed(seed)
    H, KV, D, slots, max_len = 6, 2, 8, 9, 64
    ck = torch.randn(slots, KV, max_len, D, generator=g)
    cv = torch.randn(slots, KV, max_len, D, generator=g)
    used = torch.randperm(slots, generator=g)[: 1 + seed % 8].tolist()
    parts = []
    for slot in used:
        n = int(torch.randint(1, 6, (1,), generator=g)) if seed % 3 else int(torch.randint(1, 24, (1,), generator=g))
        parts.append((slot, n, int(torch.randint(0, max_len - n, (1,), generator=g))))
    seg = Segments.build(parts)
    q = torch.randn(seg.num_tokens, H, D, generator=g)
    plan = AttentionPlan(seg, H // KV, torch.float32, torch.device("cpu"))
    torch.testing.assert_close(attention(q, ck, cv, seg, plan), attention_ref(q, ck, cv, seg), atol=1e-5, rtol=0)


def test_short_segments_group_by_cost():
    """One padded group when lengths are close; a separate group for one long draft among single tokens."""
    from spin_batch.models.attention import AttentionPlan

    alternating = [(s, 1 + s % 2, 10) for s in range(16)]  # lengths 1, 2, 1, 2, ...: one group of 32 rows
    assert len(AttentionPlan(Segments.build(alternating), 3, torch.float32, torch.device("cpu")).groups) == 1
    one_long = [(s, 1, 10) for s in range(15)] + [(15, 5, 10)]  # 80 rows padded vs 15 + 5 + a call
    assert len(AttentionPlan(Segments.build(one_long), 3, torch.float32, torch.device("cpu")).groups) == 2


# -- each architecture feature we accept, against transformers on a tiny random model -------------

# build_tiny_model arguments per feature; the spec facts each must show (so the feature is really there)
ARCHITECTURES = {
    "qwen2_qkv_bias": (dict(model_type="qwen2", kv_heads=1), dict(qkv_bias=True, o_bias=False)),
    "llama_attention_bias": (dict(config={"attention_bias": True}), dict(qkv_bias=True, o_bias=True)),
    "tied_embeddings": (dict(config={"tie_word_embeddings": True}), dict(tie_word_embeddings=True)),
    "untied_embeddings": (dict(), dict(tie_word_embeddings=False)),
    "rope_linear": (dict(config={"rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
                    dict(rope_scaling={"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0})),
    "rope_llama3": (dict(config={"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 32}}),
                    dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "rope_theta": 10000.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
    "head_dim_32_not_64_over_4": (dict(config={"head_dim": 32}), dict(head_dim=32, hidden_size=64, num_heads=4)),
    "mistral_sliding_window": (dict(model_type="mistral", config={"sliding_window": 64}), dict(sliding_window=64)),
}
ARCH_PROMPTS = ["the quick brown fox", "once upon a time there was", "compute 12 * 7 =", "red green blue red green"]
ARCH_TOKENS = 24  # prompt + 24 tokens stays inside the Mistral model's 64-token window


@pytest.fixture(scope="module")
def arch_dir(request, tmp_path_factory, tiny_dir):
    build_kwargs, facts = ARCHITECTURES[request.param]
    path = build_tiny_model(tmp_path_factory.mktemp(request.param), layers=2, seed=11, tokenizer_dir=tiny_dir,
                            **build_kwargs)
    spec = read_spec(path)
    assert {k: getattr(spec, k) for k in facts} == facts
    return path


def _loop_greedy(model, tok, prompts: list[str], slots: int, max_tokens: int) -> tuple[list[list[int]], list[str]]:
    """Our batch loop, greedy with EOS ignored: the generated ids and text of each prompt."""
    from spin_batch.engine.loop import BatchLoop, LoopSettings
    from spin_batch.selection.fixed import NoSpeculation
    from spin_batch.sampling import SamplingParams
    from spin_batch.records import Request

    settings = LoopSettings(slots=slots, max_model_len=64, max_num_batched_tokens=32, max_tokens=max_tokens,
                            sampling=SamplingParams(), ignore_eos=True)
    loop = BatchLoop(model, tok, settings, NoSpeculation(), {}, model.allocate_cache(slots, settings.max_model_len))
    done = []
    reqs = [Request(source=f"mem#{i}", id=str(i), prompt=p, messages=None) for i, p in enumerate(prompts)]
    loop.run(iter(reqs), lambda r: tok.encode(r.prompt), done.append)
    assert [c.status for c in done] == ["ok"] * len(prompts), done
    by_id = {c.request.id: c for c in done}
    return [list(by_id[str(i)].token_ids) for i in range(len(prompts))], [by_id[str(i)].text for i in range(len(prompts))]


@pytest.mark.parametrize("arch_dir", list(ARCHITECTURES), indirect=True)
def test_architecture_logits_match_transformers(arch_dir):
    """Prefill logits over 48 positions (past llama3's 32-token original context), on each CPU path."""
    ref = hf_model(arch_dir)
    ids = torch.randint(0, 300, (48,), generator=torch.Generator().manual_seed(3)).tolist()
    want = hf_logits(ref, ids)
    for path in ("c", "torch"):
        ours = load_model(arch_dir, plan=execution.forced(path))
        got = ours.forward(torch.tensor(ids), Segments.build([(0, len(ids), 0)]), ours.allocate_cache(1, 64))
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0, msg=lambda m: f"{path} path: {m}")


@pytest.mark.parametrize("arch_dir", list(ARCHITECTURES), indirect=True)
def test_architecture_greedy_text_matches_transformers_generate(arch_dir):
    """Our loop's greedy ids and text (3 slots, chunked prefill) equal transformers' generate, on each CPU path."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(arch_dir))
    ref = hf_model(arch_dir)
    want_ids = []
    for p in ARCH_PROMPTS:
        ids = torch.tensor([tok.encode(p)])
        out = ref.generate(ids, max_new_tokens=ARCH_TOKENS, min_new_tokens=ARCH_TOKENS, do_sample=False,
                           pad_token_id=tok.pad_token_id)
        want_ids.append(out[0, ids.shape[1]:].tolist())
    want_text = [tok.decode(ids, skip_special_tokens=True) for ids in want_ids]
    for path in ("c", "torch"):
        ours = load_model(arch_dir, plan=execution.forced(path))
        got_ids, got_text = _loop_greedy(ours, tok, ARCH_PROMPTS, slots=3, max_tokens=ARCH_TOKENS)
        assert got_ids == want_ids, path
        assert got_text == want_text, path


def test_o_proj_bias_runs_off_the_c_decoder(tmp_path, tiny_dir):
    """The C decoder has no o bias: a Llama with attention_bias runs per layer (and is right there, above)."""
    path = build_tiny_model(tmp_path / "m", layers=1, tokenizer_dir=tiny_dir, config={"attention_bias": True})
    ours = load_model(path, plan=execution.forced("c"))
    assert ours.c_decoder is None and ours.layers[0].o.bias is not None
    assert ours.layers[0].o.panel is not None  # still the C linears


def test_mistral_beyond_its_sliding_window_is_refused(tmp_path, tiny_dir):
    path = build_tiny_model(tmp_path / "m", model_type="mistral", layers=1, tokenizer_dir=tiny_dir,
                            config={"sliding_window": 64})
    ours = load_model(path)
    ours.allocate_cache(1, 64)
    with pytest.raises(UnsupportedModelError, match="sliding window 64"):
        ours.allocate_cache(1, 65)


def test_attention_bias_is_llamas_only():
    """transformers reads attention_bias for Llama; a Mistral config carrying it has no biases (nor do we)."""
    cfg = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
           "num_attention_heads": 2, "attention_bias": True}
    assert ModelSpec.from_hf_config({**cfg, "model_type": "llama"}).o_bias
    mistral = ModelSpec.from_hf_config({**cfg, "model_type": "mistral"})
    assert not mistral.qkv_bias and not mistral.o_bias
    qwen2 = ModelSpec.from_hf_config({**cfg, "model_type": "qwen2"})
    assert qwen2.qkv_bias and not qwen2.o_bias


def test_unknown_extra_tensor_is_rejected_at_validate_and_at_load(tmp_path, tiny_dir):
    """A checkpoint with a tensor our runtime would not use (here a q_norm, as Qwen3 has, in a folder that
    says llama) would give wrong text: `validate` (headers only) and loading both refuse it, naming it."""
    from click.testing import CliRunner
    from safetensors.torch import load_file, save_file

    from spin_batch.cli import main

    path = build_tiny_model(tmp_path / "m", layers=1, tokenizer_dir=tiny_dir)
    weights = path / "model.safetensors"
    sd = load_file(str(weights))
    extra = "model.layers.0.self_attn.q_norm.weight"
    sd[extra] = torch.ones(read_spec(path).head_dim)
    save_file(sd, str(weights), metadata={"format": "pt"})

    with pytest.raises(Exception, match=extra.replace(".", r"\.")):
        load_model(path)

    job = write_job(tmp_path, path, rows=[{"id": "a", "prompt": "the quick brown fox"}], name="extra",
                    out=tmp_path / "out", target={"dtype": "float32", "device": "cpu"},
                    batch={"slots": 1, "max_model_len": 64}, sampling={"temperature": 0.0, "max_tokens": 4})
    result = CliRunner().invoke(main, ["validate", str(job)])
    assert result.exit_code != 0 and extra in result.output, result.output
