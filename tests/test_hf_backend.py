"""The transformers backend (models/hf_backend.py): any causal LM transformers implements, on our packed
attention and cache (issue 34).

Tiny random models of seven families, built here with transformers' config classes and save_pretrained
(no downloads, no tokenizer: ids-level): our greedy loop equals transformers' own generate token for
token at 1 and 3 slots; speculative greedy output equals autoregressive at 1 and 8 slots with an
n-gram, a model and an early-exit drafter; sampling with drafts keeps the target's distribution; the
architecture checks refuse what the packed attention does not do, with the reason.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from spin_batch.drafters.early_exit import EarlyExitDrafter
from spin_batch.drafters.model import ModelDrafter
from spin_batch.drafters.ngram import NgramDrafter
from spin_batch.engine.loop import BatchLoop, LoopSettings
from spin_batch.models import hf_arch, hf_attention
from spin_batch.models.execution import Execution
from spin_batch.models.hf_backend import TransformersModel
from spin_batch.models.segments import Segments
from spin_batch.models.spec import CheckpointError, UnsupportedModelError
from spin_batch.records import Completion, Request
from spin_batch.sampling import SamplingParams
from spin_batch.selection.fixed import FixedDrafter, NoSpeculation
from spin_batch.selection.policy import Policy, StepChoice
from spin_batch.stats import RunStats

from conftest import Cycle

V = 96  # vocabulary of every tiny model here
MAX_TOKENS = 10
COMMON = dict(bos_token_id=None, eos_token_id=None, pad_token_id=0)
SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64)


def families():
    """name -> (config class, its fields): hidden 32, 2 layers, each family's own features switched on."""
    import transformers as T

    return {
        # attention scaled by 1 / (layer + 1) beside 1 / sqrt(D): the attention call's `scaling` is honoured
        "gpt2": (T.GPT2Config, dict(n_embd=32, n_layer=2, n_head=2, n_positions=128, resid_pdrop=0.0,
                                    embd_pdrop=0.0, attn_pdrop=0.0, scale_attn_by_inverse_layer_idx=True)),
        "gpt_neox": (T.GPTNeoXConfig, dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                           intermediate_size=64, rotary_pct=0.5, max_position_embeddings=128)),
        "qwen3": (T.Qwen3Config, dict(SMALL, head_dim=16, tie_word_embeddings=True)),
        # a sliding window of 6 on alternate layers, attention-logit and final-logit soft-capping, its own scale
        "gemma2": (T.Gemma2Config, dict(SMALL, head_dim=16, sliding_window=6, attn_logit_softcapping=5.0,
                                        final_logit_softcapping=8.0, query_pre_attn_scalar=24)),
        # q/k norms, local and global rotary bases; a window of 6 on its first layer
        "gemma3": (T.Gemma3TextConfig, dict(SMALL, head_dim=16, sliding_window=6, query_pre_attn_scalar=24,
                                            layer_types=["sliding_attention", "full_attention"])),
        "phi3": (T.Phi3Config, dict(SMALL, tie_word_embeddings=False)),
        "olmo2": (T.Olmo2Config, dict(SMALL, tie_word_embeddings=False)),
        "llama": (T.LlamaConfig, dict(SMALL, tie_word_embeddings=False)),
    }


# Gemma multiplies its embeddings by sqrt(hidden): smaller ones keep them from drowning out the layers
EMBED_STD = {"gemma2": 0.05, "gemma3": 0.05}


def build(out: Path, name: str, seed: int = 0, vocab: int = V, **fields) -> Path:
    """A random model of family `name` saved with save_pretrained; weights N(0, 0.3) so the logits spread."""
    from transformers import AutoModelForCausalLM

    config_class, own = families()[name]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config_class(**{**COMMON, "vocab_size": vocab, **own, **fields}))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
        model.get_input_embeddings().weight.normal_(0, EMBED_STD.get(name, 0.3))
    model.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf-families")
    return {name: build(root / name, name) for name in families()}


class Ids:
    """The loop's tokenizer, for ids-level runs: Stopping decodes only to check stop strings."""

    def decode(self, ids, skip_special_tokens=True) -> str:
        return " ".join(map(str, ids))


PROMPTS = [[(7 * i + 3 * j + 1) % V for j in range(3 + 2 * i)] for i in range(4)]
SPEC_PROMPTS = PROMPTS + [[5, 6, 7, 5, 6, 7, 5, 6], [40, 41, 40, 41, 40], [9] * 7, [11, 12, 13, 14, 15, 16, 17, 18, 19],
                          [2, 3], [60, 61, 62, 60, 61, 62, 60]]


def run(model, slots: int, prompts=PROMPTS, policy: Policy | None = None, drafters=None, cache=None,
        sampling: SamplingParams = SamplingParams(), max_tokens: int = MAX_TOKENS, seed: int = 0,
        budget: int = 7, stats: RunStats | None = None) -> dict[int, list[int]]:
    """Token ids per prompt index from a BatchLoop on `model` (budget: max_num_batched_tokens, small so
    prompts are prefilled in chunks beside decode and verify segments)."""
    settings = LoopSettings(slots=slots, max_model_len=48, max_num_batched_tokens=budget, max_tokens=max_tokens,
                            sampling=sampling, seed=seed, ignore_eos=True)
    loop = BatchLoop(model, Ids(), settings, policy or NoSpeculation(), drafters or {}, cache, stats)
    reqs = [Request(f"mem#{i}", str(i), "ids", None) for i in range(len(prompts))]
    done: list[Completion] = []
    loop.run(iter(reqs), lambda r: prompts[int(r.id)], done.append)
    assert all(c.status == "ok" for c in done), [c.error for c in done]
    return {int(c.request.id): list(c.token_ids) for c in done}


def hf_generate(folder: Path, prompts=PROMPTS, max_tokens: int = MAX_TOKENS) -> dict[int, list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    out = {}
    for i, p in enumerate(prompts):
        ids = torch.tensor([p])
        got = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                          min_new_tokens=max_tokens, do_sample=False)
        out[i] = got[0, len(p):].tolist()
    return out


def test_both_backends_implement_the_target_protocol(folders, tiny_dir):
    """Every member of protocol.TargetModel is there on both backends, the loop and the drafters read them
    without defaults; the transformers backend refuses the target features it does not give, in words."""
    from spin_batch.models.execution import ModelPlan
    from spin_batch.models.loader import load_model
    from spin_batch.models.protocol import TargetModel

    members = set(TargetModel.__annotations__) | {n for n, v in vars(TargetModel).items()
                                                  if callable(v) and not n.startswith("_")}
    assert {"spec", "plan", "kernels", "tree_segments", "forward", "forward_with_hidden", "allocate_cache"} <= members
    hf, native = TransformersModel.load(folders["qwen3"], torch.float32, "cpu"), load_model(tiny_dir)
    for model in (hf, native):
        assert isinstance(model, TargetModel) and all(hasattr(model, m) for m in members), type(model)
        assert isinstance(model.plan, ModelPlan) and isinstance(model.tree_segments, bool)
    assert (hf.tree_segments, native.tree_segments) == (False, True)
    seg = Segments.build([(0, 3, 0)])
    with pytest.raises(UnsupportedModelError, match="need the native backend"):
        hf.forward_with_hidden(torch.tensor([1, 2, 3]), seg, hf.allocate_cache(1, 16))


# -- greedy: transformers' generate, token for token ---------------------------------------------------


@pytest.mark.parametrize("name", list(families()))
def test_greedy_equals_transformers_generate(folders, name):
    model = TransformersModel.load(folders[name], torch.float32, "cpu")
    want = hf_generate(folders[name])
    for slots in (1, 3):
        assert run(model, slots) == want, (name, slots)
    assert model.backend()["backend"] == "transformers"


def test_token_trees_are_refused_not_written_to_the_wrong_rows(folders):
    """A tree segment's K/V rows differ from its RoPE positions; this backend writes at the positions,
    so it refuses trees (the native backend verifies them)."""
    model = TransformersModel.load(folders["qwen3"], torch.float32, "cpu")
    cache = model.allocate_cache(1, 16)
    seg = Segments.build([(0, 3, 4)], parents=[[-1, 0, 0]])
    with pytest.raises(NotImplementedError, match="token-tree segments run on the native backend only"):
        model.forward(torch.tensor([1, 2, 3]), seg, cache)
    model.forward(torch.tensor([1, 2, 3]), Segments.build([(0, 3, 4)]), cache)  # the same tokens as a chain run


def test_gemma2_window_and_softcap_change_its_greedy_text(folders, tmp_path):
    """Without its sliding window, or without attention soft-capping, the Gemma 2 model's greedy tokens
    differ: the test above catches either one dropped."""
    want = hf_generate(folders["gemma2"])
    for variant in (dict(sliding_window=4096), dict(attn_logit_softcapping=None)):
        assert hf_generate(build(tmp_path / next(iter(variant)), "gemma2", **variant)) != want, variant


def test_packed_forward_equals_whole_sequence_logits(folders):
    """One forward of mixed segments (two prefill chunks, a decode token, a verify run) over three slots gives
    each row the logits transformers gives that token in its whole sequence."""
    from transformers import AutoModelForCausalLM

    for name in ("gemma2", "gpt2", "phi3"):
        model = TransformersModel.load(folders[name], torch.float32, "cpu")
        hf = AutoModelForCausalLM.from_pretrained(str(folders[name])).eval()
        seqs = [list(range(1, 12)), list(range(20, 29)), list(range(50, 60))]
        cache = model.allocate_cache(3, 32)
        # first forward: the start of each sequence (cache lengths 0)
        first = [6, 8, 5]
        seg = Segments.build([(s, n, 0) for s, n in enumerate(first)])
        model.forward(torch.tensor([t for q, n in zip(seqs, first) for t in q[:n]]), seg, cache)
        # second: slot 0 a chunk of 5, slot 1 one decode token, slot 2 a verify run of 5, slots in mixed order
        parts = [(1, 1, 8), (2, 5, 5), (0, 5, 6)]
        seg = Segments.build(parts)
        flat = torch.tensor([t for s, n, c in parts for t in seqs[s][c:c + n]])
        got = model.forward(flat, seg, cache)  # [11, V]
        with torch.no_grad():
            for row, (s, n, c) in zip(seg.starts, parts):
                whole = hf(torch.tensor([seqs[s][:c + n]])).logits[0, c:c + n]  # [n, V]
                torch.testing.assert_close(got[row:row + n], whole, atol=2e-5, rtol=2e-5, msg=f"{name} slot {s}")


# -- speculative greedy equals autoregressive ----------------------------------------------------------


@pytest.fixture(scope="module")
def spec_models(folders, tmp_path_factory):
    """A Phi-3 target, a GPT-NeoX draft of the same vocabulary (a different family, other weights) and its folder."""
    draft_dir = build(tmp_path_factory.mktemp("hf-draft") / "neox", "gpt_neox", seed=3)
    return (TransformersModel.load(folders["phi3"], torch.float32, "cpu"),
            TransformersModel.load(draft_dir, torch.float32, "cpu"), draft_dir)


@pytest.mark.parametrize("slots", [1, 8])
def test_speculative_greedy_equals_autoregressive(spec_models, slots):
    target, draft, _ = spec_models
    want = run(target, 1, SPEC_PROMPTS, budget=64)
    cache = target.allocate_cache(slots, 48)
    drafters = {"ngram": NgramDrafter("ngram", 1, 3),
                "model": ModelDrafter("model", draft, draft.allocate_cache(slots, 48)),
                "exit": EarlyExitDrafter("exit", target, cache, 1)}
    stats = RunStats()
    assert run(target, slots, SPEC_PROMPTS, Cycle(list(drafters)), drafters, cache, budget=16, stats=stats) == want
    drafted = {name: d["draft_tokens"] for name, d in stats.summary()["drafters"].items()}
    assert all(drafted.get(name) for name in drafters), drafted


def test_tree_choices_become_chains_on_this_backend(spec_models):
    """A policy asking for token trees: this backend verifies no tree segment, and its model draft
    grows none (ModelDrafter.trees), so every slot drafts chains, and the text is autoregressive's."""
    from dataclasses import replace

    target, draft, _ = spec_models
    want = run(target, 1, SPEC_PROMPTS, budget=64)
    cache = target.allocate_cache(3, 48)
    drafters = {"model": ModelDrafter("model", draft, draft.allocate_cache(3, 48)),
                "exit": EarlyExitDrafter("exit", target, cache, 1)}
    assert not drafters["model"].trees

    class Trees(Cycle):
        def choose(self, slots, caps):
            return StepChoice.of([replace(c, nodes=6) for c in super().choose(slots, caps).choices])

    stats = RunStats()
    assert run(target, 3, SPEC_PROMPTS, Trees(list(drafters)), drafters, cache, budget=16, stats=stats) == want
    assert all(stats.summary()["drafters"][n]["draft_tokens"] for n in drafters)


def test_early_exit_logits_are_the_first_layers_then_norm_and_head(folders):
    """forward(num_layers=1) gives what transformers gives for the same checkpoint cut to one layer."""
    from transformers import AutoModelForCausalLM

    for name in ("qwen3", "gpt2"):
        model = TransformersModel.load(folders[name], torch.float32, "cpu")
        cut = AutoModelForCausalLM.from_pretrained(str(folders[name]), num_hidden_layers=1).eval()
        seq = [3, 14, 15, 92, 65, 35]
        cache = model.allocate_cache(1, 16)
        got = model.forward(torch.tensor(seq), Segments.build([(0, len(seq), 0)]), cache, num_layers=1)
        full = model.forward(torch.tensor(seq), Segments.build([(0, len(seq), 0)]), cache)
        with torch.no_grad():
            want = cut(torch.tensor([seq])).logits[0]
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
        assert not torch.allclose(got, full, atol=1e-3)  # the second layer matters


# -- sampling stays exact --------------------------------------------------------------------------------

N_REQUESTS = 1000
SIGMAS = 5.0  # per-token bound |freq - p| < 5 sqrt(p (1 - p) / n), as tests/test_verify.py


def second_token_marginal(folder: Path, prompt: list[int]) -> torch.Tensor:
    """[V] p(second generated token) = sum over t1 of p(t1 | prompt) p(t2 | prompt, t1), at temperature 1."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    with torch.no_grad():
        p1 = hf(torch.tensor([prompt])).logits[0, -1].double().softmax(-1)  # [V]
        both = torch.tensor([prompt + [t] for t in range(V)])
        p2 = hf(both).logits[:, -1].double().softmax(-1)  # [V, V]: row t1
    return p1 @ p2


def z_score(p: torch.Tensor, counts: torch.Tensor) -> float:
    n = counts.sum()
    sigma = torch.sqrt(p * (1 - p) / n).clamp_min(1.0 / n)
    return ((counts / n - p).abs() / sigma).max().item()


def test_sampling_with_a_model_draft_keeps_the_targets_distribution(folders, spec_models, tmp_path):
    """Temperature 1 on a Phi-3 target with a GPT-NeoX draft proposing every second token: the second token's
    frequencies over many requests match the target's marginal, and are far from the draft's (so a rule
    that kept the draft's tokens would fail)."""
    target, draft, draft_dir = spec_models
    prompt = [5, 17, 33, 2]
    sampling = SamplingParams(temperature=1.0)
    slots = 16
    drafters = {"model": ModelDrafter("model", draft, draft.allocate_cache(slots, 48))}
    out = run(target, slots, [prompt] * N_REQUESTS, FixedDrafter("model", 1), drafters, sampling=sampling,
              max_tokens=3, budget=128)
    counts = torch.zeros(V, dtype=torch.float64)
    for ids in out.values():
        counts[ids[1]] += 1
    p = second_token_marginal(folders["phi3"], prompt)
    assert z_score(p, counts) < SIGMAS
    # the draft's own proposal for the second token, after the target's first: a different distribution
    from transformers import AutoModelForCausalLM

    draft_hf = AutoModelForCausalLM.from_pretrained(str(draft_dir)).eval()
    with torch.no_grad():
        target_hf = AutoModelForCausalLM.from_pretrained(str(folders["phi3"])).eval()
        p1 = target_hf(torch.tensor([prompt])).logits[0, -1].double().softmax(-1)
        q2 = p1 @ draft_hf(torch.tensor([prompt + [t] for t in range(V)])).logits[:, -1].double().softmax(-1)
    assert z_score(q2, counts) > 3 * SIGMAS


def test_a_seeded_sampled_run_is_reproducible(spec_models):
    target, draft, _ = spec_models
    sampling = SamplingParams(temperature=1.0)

    def once(seed: int):
        drafters = {"ngram": NgramDrafter("ngram", 1, 3),
                    "model": ModelDrafter("model", draft, draft.allocate_cache(4, 48))}
        return run(target, 4, SPEC_PROMPTS, Cycle(list(drafters)), drafters, sampling=sampling, seed=seed)

    a = once(1)
    assert once(1) == a
    assert once(2) != a


# -- what the backend refuses ------------------------------------------------------------------------------


def save_config(out: Path, config) -> Path:
    config.save_pretrained(str(out))
    return out


def test_every_family_here_passes_the_architecture_check(folders):
    for name, folder in folders.items():
        assert hf_arch.check_folder(folder, trust_remote_code=False, max_len=64) is None, name


def refusals():
    import transformers as T

    return {
        "mamba": (T.MambaConfig(hidden_size=32, num_hidden_layers=2, vocab_size=V), "recurrent or state-space"),
        "t5": (T.T5Config(d_model=32, num_layers=1, num_heads=2, vocab_size=V), "encoder-decoder"),
        "gpt_oss": (T.GptOssConfig(**SMALL, head_dim=16, vocab_size=V, num_local_experts=2, num_experts_per_tok=1),
                    "attention sinks"),
        "bloom": (T.BloomConfig(hidden_size=32, n_layer=2, n_head=2, vocab_size=V), "computes attention itself"),
        "falcon_alibi": (T.FalconConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, vocab_size=V,
                                        alibi=True), "computes attention itself"),
        "qwen3_next": (T.Qwen3NextConfig(**SMALL, head_dim=16, vocab_size=V), "recurrent or state-space"),
        "deepseek_v3": (T.DeepseekV3Config(**SMALL, vocab_size=V, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
                                           qk_nope_head_dim=8, v_head_dim=8, n_routed_experts=2, num_experts_per_tok=1,
                                           first_k_dense_replace=2), "K [4, 16] and V [4, 8] differ"),
        "llama4_chunked": (T.Llama4TextConfig(**SMALL, vocab_size=V), "chunked_attention"),
        "gpt2_cross": (T.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=V, add_cross_attention=True),
                       "cross-attention"),
        "gpt2_positions": (T.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=V, n_positions=32),
                           "learned position table (32 positions)"),
    }


@pytest.mark.parametrize("name", list(refusals()))
def test_unsupported_architectures_are_refused_with_the_reason(tmp_path, name):
    config, reason = refusals()[name]
    problem = hf_arch.check_folder(save_config(tmp_path / name, config), trust_remote_code=False, max_len=64)
    assert problem is not None and reason in problem, problem


def test_remote_code_needs_trust_remote_code(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "my_own_lm", "auto_map": {"AutoConfig": "cfg.MyConfig"}}')
    problem = hf_arch.check_folder(tmp_path, trust_remote_code=False, max_len=64)
    assert "trust_remote_code: true" in problem
    (tmp_path / "config.json").write_text('{"model_type": "my_own_lm"}')
    assert "not known to transformers" in hf_arch.check_folder(tmp_path, trust_remote_code=False, max_len=64)


def test_a_mask_or_sinks_passed_to_the_attention_are_refused_never_dropped():
    seg = Segments.build([(0, 2, 0)])
    state = hf_attention.PackedPass(seg, None)
    q = torch.zeros(1, 2, 2, 4)
    k = torch.zeros(1, 1, 2, 4)
    module = torch.nn.Module()
    module.layer_idx = 0
    for mask, extra, what in ((torch.zeros(1, 1, 2, 2), {}, "attention mask or bias"),
                              (None, {"s_aux": torch.zeros(2)}, "attention sinks"),
                              (None, {"is_causal": False}, "non-causal")):
        with pytest.raises(UnsupportedModelError, match=what):
            hf_attention.packed_attention(module, q, k, k, mask, scaling=0.5,
                                          **{hf_attention.STATE_KWARG: state}, **extra)
    out, _ = hf_attention.packed_attention(module, q, k, k, None, scaling=0.5, **{hf_attention.STATE_KWARG: state})
    assert out.shape == (1, 2, 2, 4)


def test_weights_that_do_not_match_the_config_are_refused_at_load(folders, tmp_path):
    from safetensors.torch import load_file, save_file

    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(folders["olmo2"], broken)
    sd = load_file(str(broken / "model.safetensors"))
    del sd["model.layers.1.self_attn.q_norm.weight"]
    save_file(sd, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="missing: model.layers.1.self_attn.q_norm.weight"):
        TransformersModel.load(broken, torch.float32, "cpu")


def test_the_triton_attention_path_equals_the_torch_path(folders):
    """On the Triton kernels (CPU: the interpreter), the plain causal layers give the same greedy tokens."""
    pytest.importorskip("triton")
    import os

    if not os.environ.get("TRITON_INTERPRET") and not torch.cuda.is_available():
        pytest.skip("Triton needs a GPU or TRITON_INTERPRET=1")
    model = TransformersModel.load(folders["qwen3"], torch.float32, "cpu",
                                   Execution(kernels="triton", cpu="torch", triton=True))
    assert model.kernels is not None and model.backend()["attention"] == "triton"
    torch_model = TransformersModel.load(folders["qwen3"], torch.float32, "cpu")
    assert run(model, 3, PROMPTS[:3], max_tokens=4) == run(torch_model, 3, PROMPTS[:3], max_tokens=4)


# -- the job: target.backend, validate, run, summary.json ---------------------------------------------------


def with_tokenizer(out: Path, tokenizer_dir: Path, name: str, **fields) -> Path:
    """A family's tiny model over the tiny tokenizer's vocabulary, with its tokenizer files (a job needs them)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    build(out, name, vocab=len(tok), **fields)
    tok.save_pretrained(str(out))
    return out


def job(tmp_path: Path, model: Path, name: str = "job", drafters=(), max_model_len: int = 64, **target) -> Path:
    from conftest import write_job

    rows = [{"id": "a", "prompt": "the quick brown fox"}, {"id": "b", "prompt": "list three colours"}]
    return write_job(tmp_path, model, rows=rows, name=name, target={"dtype": "float32", "device": "cpu", **target},
                     drafters=list(drafters), batch={"slots": 2, "max_model_len": max_model_len},
                     sampling={"temperature": 0.0, "max_tokens": 5})


def invoke(*args):
    from click.testing import CliRunner

    from spin_batch.cli import main

    return CliRunner().invoke(main, [str(a) for a in args])


def refused(result, *needles: str) -> None:
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), (result.output, result.exc_info)
    assert "Traceback" not in result.output
    for needle in needles:
        assert needle in result.output, result.output


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory, tiny_dir) -> Path:
    return with_tokenizer(tmp_path_factory.mktemp("job-gpt2") / "gpt2", tiny_dir, "gpt2")


def test_target_backend_and_trust_remote_code_parse():
    from spin_batch.config import ConfigError, parse_job

    base = {"name": "j", "input": {"paths": ["x.jsonl"]}, "output": {"dir": "out"}}
    job_ = parse_job({**base, "target": {"model": "m", "backend": "transformers", "trust_remote_code": True},
                      "drafters": [{"name": "d", "kind": "model", "model": "m2", "backend": "native"}]})
    assert job_.target.backend == "transformers" and job_.target.trust_remote_code
    assert job_.drafters[0].backend == "native" and not job_.drafters[0].trust_remote_code
    assert parse_job(base).target.backend == "auto" and not parse_job(base).target.trust_remote_code
    with pytest.raises(ConfigError, match="target.backend"):
        parse_job({**base, "target": {"model": "m", "backend": "vllm"}})
    with pytest.raises(ConfigError, match="target.trust_remote_code"):
        parse_job({**base, "target": {"model": "m", "trust_remote_code": "yes"}})


def test_auto_runs_a_gpt2_folder_on_transformers_and_summary_records_it(tmp_path, gpt2_dir, tiny_dir):
    import json

    path = job(tmp_path, gpt2_dir, drafters=[{"name": "ngram", "kind": "ngram"}, {"name": "exit", "kind": "early_exit",
                                                                                   "layers": 1}])
    result = invoke("validate", path)
    assert result.exit_code == 0, result.output
    assert "target: transformers backend" in result.output
    result = invoke("run", path, "--no-progress")
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "out-job" / "summary.json").read_text())
    assert summary["rows_ok"] == 2
    target = summary["backends"]["target"]
    assert target["backend"] == "transformers" and target["model_class"] == "GPT2LMHeadModel"
    # the Llama folder next to it still runs natively
    native = job(tmp_path, tiny_dir, name="native")
    assert "target: native backend" in invoke("validate", native).output


def test_validate_refuses_with_the_reason_before_loading_weights(tmp_path, gpt2_dir, tiny_dir):
    refused(invoke("validate", job(tmp_path, gpt2_dir, name="n", backend="native")),
            "model_type 'gpt2' is not supported")
    refused(invoke("validate", job(tmp_path, gpt2_dir, name="p", max_model_len=256)),
            "the transformers backend cannot run it", "max_model_len 256 exceeds the model's learned position table")
    refused(invoke("validate", job(tmp_path, gpt2_dir, name="c", kernels="c")), "target.kernels: c")
    refused(invoke("validate", job(tmp_path, gpt2_dir, name="e", drafters=[{"name": "x", "kind": "early_exit",
                                                                            "layers": 5}])),
            "early_exit layers must be in 1..2")
    # a Llama draft next to the GPT-2 target runs natively; one forced onto transformers is fine too
    ok = job(tmp_path, gpt2_dir, name="d", drafters=[
        {"name": "small", "kind": "model", "model": str(tiny_dir), "backend": "transformers"}])
    result = invoke("validate", ok)
    assert result.exit_code == 0 and "small: transformers backend" in result.output, result.output


# -- the C kernels on CPU ---------------------------------------------------------------------------------


def test_the_c_kernels_give_torchs_logits_and_greedy_tokens(folders):
    """On CPU the backend runs every nn.Linear on our GEMM and plain causal attention on the C attention
    (Qwen3 here: head_dim 16, which the C attention takes); the torch path (cpu: torch) is transformers' own.
    Same logits within float32 rounding, same greedy tokens."""
    from spin_batch.models import cpu_decoder

    if cpu_decoder.library() is None:
        pytest.skip(f"the C kernels do not build here: {cpu_decoder.unavailable_reason()}")
    fast = TransformersModel.load(folders["qwen3"], torch.float32, "cpu")
    plain = TransformersModel.load(folders["qwen3"], torch.float32, "cpu", Execution(cpu="torch"))
    assert fast.backend()["attention"] == "c" and fast.backend()["c_linears"] > 0
    assert plain.backend()["attention"] == "torch" and plain.backend()["c_linears"] == 0
    assert not any(type(m) is torch.nn.Linear for m in fast.hf.modules())
    seg = Segments.build([(0, 6, 0), (1, 3, 0)])
    tokens = torch.tensor([3, 9, 4, 1, 7, 2, 8, 8, 5])
    got = fast.forward(tokens, seg, fast.allocate_cache(2, 16), logits_rows=[5, 8])  # [2, V]
    want = plain.forward(tokens, seg, plain.allocate_cache(2, 16), logits_rows=[5, 8])
    assert got.shape == want.shape == (2, fast.spec.vocab_size)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    assert run(fast, 3) == run(plain, 3)
