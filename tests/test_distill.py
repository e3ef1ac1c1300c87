"""`spin-batch distill`: data, training, the draft format, and drafting with a subset head."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from spin_batch.cli import main
from spin_batch.config import parse_job
from spin_batch.distill.data import TeacherData
from spin_batch.distill.net import DraftArch, DraftNet, parse_sizes, save_draft
from spin_batch.distill.train import agreement
from spin_batch.drafters.base import DraftRequest
from spin_batch.drafters.model import ModelDrafter
from spin_batch.sampling import SamplingParams, make_generator
from spin_batch.models.distilled import DRAFT_KEY, check_pairing, fingerprint, load_draft
from spin_batch.models.loader import load_model, load_tokenizer
from spin_batch.models.segments import Segments
from spin_batch.preflight import check_models
from spin_batch.runner import run_job

from conftest import TRAIN_PROMPTS, write_jsonl


def test_distill_writes_loadable_drafts_and_a_report(tiny_distilled, tiny_dir):
    settings, report = tiny_distilled
    assert [d["name"] for d in report["drafts"]] == ["d1x64-k24", "d2x64"]
    assert [d["vocab_subset"] for d in report["drafts"]] == [24, 40]
    saved = json.loads((settings.out / "report.json").read_text())
    assert saved["drafts"][0]["cost_vs_target_step"].keys() == {"1", "2"}
    assert "| d2x64 |" in (settings.out / "report.md").read_text()
    target = load_model(tiny_dir)
    for d in report["drafts"]:
        cfg = json.loads((settings.out / d["name"] / "config.json").read_text())
        assert cfg[DRAFT_KEY]["target_fingerprint"] == fingerprint(tiny_dir)
        assert (settings.out / d["name"] / "tokenizer.json").exists()
        model = load_draft(settings.out / d["name"], target, torch.float32, torch.device("cpu"))
        assert model.vocab_ids.shape == (d["vocab_subset"],)
        assert set(d["heldout_agreement"]) == {"a", "b", "all"}
        assert d["steps"] == 60 and d["final_loss"] > 0


def test_training_learns_the_teacher(tiny_distilled, tiny_dir):
    """On its own training data a trained draft agrees with the target far more than an untrained one."""
    settings, report = tiny_distilled
    data = TeacherData.load(settings.out / "data" / "train.pt", _key(settings))
    assert data is not None and len(data) == len(TRAIN_PROMPTS)
    target = load_model(tiny_dir)
    trained = DraftNet.from_saved(settings.out / "d2x64", target.embed, target.norm)
    assert trained.reads_features
    fresh = DraftNet(DraftArch.parse("2x64"), target.embed, target.norm, trained.vocab_ids, target.spec.rope_theta,
                     reads_features=True)
    cpu = torch.device("cpu")
    assert agreement(trained, data, cpu)["all"] > agreement(fresh, data, cpu)["all"] + 0.2


def test_weight_decay_shrinks_the_trained_weights(tiny_distilled, tiny_dir):
    from spin_batch.distill.train import TrainSettings, train_draft

    settings, _ = tiny_distilled
    data = TeacherData.load(settings.out / "data" / "train.pt", _key(settings))
    target = load_model(tiny_dir)
    vocab_ids = DraftNet.from_saved(settings.out / "d2x64", target.embed, target.norm).vocab_ids

    def norm(weight_decay: float) -> float:
        train = TrainSettings(steps=30, batch_tokens=256, seed=0, weight_decay=weight_decay)
        net, _ = train_draft(DraftArch.parse("1x64"), data, target, vocab_ids, train, torch.device("cpu"), False)
        return sum(p.detach().norm() ** 2 for p in net.parameters() if p.requires_grad).item()

    assert norm(10.0) < 0.8 * norm(0.0)


def test_bf16_autocast_trains_as_well_as_float32(tiny_distilled, tiny_dir, monkeypatch):
    """precision=bfloat16 really rounds the matmuls (a different result from float32), and learns as well."""
    from spin_batch.distill.train import TrainSettings, autocast_dtype, train_draft

    settings, _ = tiny_distilled
    data = TeacherData.load(settings.out / "data" / "train.pt", _key(settings))
    target = load_model(tiny_dir)
    vocab_ids = DraftNet.from_saved(settings.out / "d2x64", target.embed, target.norm).vocab_ids
    cpu = torch.device("cpu")
    nets = {}
    for precision in ("float32", "bfloat16"):
        train = TrainSettings(steps=40, batch_tokens=256, seed=0, precision=precision)
        nets[precision], info = train_draft(DraftArch.parse("1x64"), data, target, vocab_ids, train, cpu, False)
        assert info["precision"] == precision
        assert all(p.dtype == torch.float32 for p in nets[precision].parameters())
    w32, w16 = (nets[k].layers[0].q_proj.weight for k in ("float32", "bfloat16"))
    assert not torch.equal(w32, w16)
    fresh = DraftNet(DraftArch.parse("1x64"), target.embed, target.norm, vocab_ids, target.spec.rope_theta,
                     reads_features=True)
    a32, a16, a0 = (agreement(n, data, cpu)["all"] for n in (nets["float32"], nets["bfloat16"], fresh))
    assert a16 > a0 + 0.2 and abs(a16 - a32) < 0.1
    assert autocast_dtype("float32", cpu) is None and autocast_dtype("bfloat16", cpu) is torch.bfloat16
    with pytest.raises(ValueError, match="precision 'fp8'"):
        TrainSettings(precision="fp8")
    for native in (True, False):  # auto: bf16 only where the CPU multiplies it natively
        monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: native)
        assert autocast_dtype("auto", cpu) is (torch.bfloat16 if native else None)


def test_sampled_completions_add_teacher_contexts(tmp_path, tiny_distilled, tiny_dir):
    """--samples 2: the greedy generation is reused (same key), two sampled jobs add a sequence per
    prompt each, their completions are not all the greedy ones, and the cache key changes."""
    import shutil
    from dataclasses import replace

    from spin_batch.distill import _teacher, teacher_dtype

    settings, _ = tiny_distilled
    shutil.copytree(settings.out / "data" / "train", tmp_path / "data" / "train")  # the greedy completions
    parts = sorted((tmp_path / "data" / "train").rglob("part-*.parquet"))
    before = [p.stat().st_mtime_ns for p in parts]
    s = replace(settings, out=tmp_path, samples=2, sample_temperature=1.0)
    target = load_model(tiny_dir, teacher_dtype(settings, torch.device("cpu")))  # the dtype the fixture's data has
    tok = load_tokenizer(tiny_dir)
    fp = fingerprint(tiny_dir)
    greedy = TeacherData.load(settings.out / "data" / "train.pt", _key(settings))
    data = _teacher(s, "train", s.prompts, target, tok, fp, progress=False, samples=2)
    n = len(TRAIN_PROMPTS)
    assert len(data) == 3 * n and data.num_tokens() > greedy.num_tokens()
    assert [t.tolist() for t in data.tokens[:n]] == [t.tolist() for t in greedy.tokens]  # greedy first ...
    assert parts and [p.stat().st_mtime_ns for p in parts] == before  # ... and not regenerated
    sampled = {tuple(t.tolist()) for t in data.tokens[n:]}
    assert len(sampled - {tuple(t.tolist()) for t in greedy.tokens}) >= n // 2
    assert all(len(d.tolist()) == len(t) for d, t in zip(data.top_ids, data.tokens))  # every position scored
    # cached under its own key: the greedy-only key does not load it, a rerun with the same samples does
    cached = tmp_path / "data" / "train.pt"
    assert TeacherData.load(cached, _key(settings)) is None
    written = cached.stat().st_mtime_ns
    again = _teacher(s, "train", s.prompts, target, tok, fp, progress=False, samples=2)
    assert len(again) == 3 * n and cached.stat().st_mtime_ns == written  # loaded, not rebuilt


def test_the_bf16_teacher_is_built_for_throughput_and_nothing_else_is(tmp_path, tiny_distilled, monkeypatch):
    """run_distill builds its bfloat16 teacher inside cpu_decoder.throughput_gemm() (the batch-variant
    oneDNN path on AMX CPUs), and the float32 target and the drafts it measures outside it."""
    import shutil
    from dataclasses import replace

    from spin_batch.distill import run_distill
    from spin_batch.models import cpu_decoder

    settings, _ = tiny_distilled
    shutil.copytree(settings.out / "data", tmp_path / "data")  # cached teacher data: only the loads run
    built = []
    real = cpu_decoder.panel_weight
    monkeypatch.setattr(cpu_decoder, "panel_weight",
                        lambda w: built.append((w.dtype, cpu_decoder._throughput.get())) or real(w))
    s = replace(settings, out=tmp_path, teacher_dtype="bfloat16", cost_slots=(1,),
                train=replace(settings.train, steps=2))
    run_distill(s, progress=False)
    teacher = [on for dtype, on in built if dtype == torch.bfloat16 and on]
    assert teacher  # the teacher's weights were built inside the block ...
    assert not any(on for dtype, on in built if dtype == torch.float32)  # ... and the float32 models outside
    assert not cpu_decoder._throughput.get()


def test_rerun_reuses_the_cached_teacher_data(tiny_distilled, tiny_dir):
    settings, _ = tiny_distilled
    data_file = settings.out / "data" / "train.pt"
    assert TeacherData.load(data_file, _key(settings)) is not None
    assert TeacherData.load(data_file, "another-key") is None  # other prompts or settings: regenerate


def _untrained_draft(tmp_path, tiny_dir, features: bool, seed: int):
    """(target, a random 2x128 DraftNet over 30 target ids, the same draft saved in float32 and loaded
    as an inference model)."""
    target = load_model(tiny_dir)
    torch.manual_seed(seed)
    vocab_ids = torch.tensor(sorted(torch.randperm(target.spec.vocab_size)[:30].tolist()))
    net = DraftNet(DraftArch.parse("2x128"), target.embed, target.norm, vocab_ids, target.spec.rope_theta,
                   reads_features=features).eval()
    save_draft(net, tmp_path / "d", tiny_dir, fingerprint(tiny_dir), {}, dtype=torch.float32)
    return target, net, load_draft(tmp_path / "d", target, torch.float32, torch.device("cpu"))


def test_second_step_training_sees_the_cache_the_draft_sees_at_inference(tmp_path, tiny_dir):
    """DraftNet.second_step row r equals the inference draft fed token r with a predicted feature, on a
    cache whose rows < r were written with the target's features (as the drafter's catch-up writes them)."""
    target, net, model = _untrained_draft(tmp_path, tiny_dir, features=True, seed=2)
    T, E = 12, target.spec.hidden_size
    tokens = torch.randint(0, target.spec.vocab_size, (1, T))
    feats, predicted = torch.randn(1, T, E), torch.randn(1, T, E)
    with torch.no_grad():
        _, _, kvs = net.run(tokens, feats)
        want, want_g = net.second_step(tokens, predicted, kvs)
        everything_predicted, _ = net(tokens, predicted)  # what a plain second pass computes instead
    cache = model.allocate_cache(1, 32)

    def feed(r: int, f: torch.Tensor):
        h = model.hidden(tokens[0, r : r + 1], Segments.build([(0, 1, r)]), cache, extra=f[0, r : r + 1])
        return model.feature_head(model.normed(h, model.norm))

    feed(0, feats)
    got = []
    for r in range(1, T):
        got.append(feed(r, predicted)[0])  # the token being drafted reads a predicted feature ...
        feed(r, feats)  # ... and is rewritten with the target's once it is committed
    torch.testing.assert_close(torch.cat(got), want[0, 1:], atol=1e-4, rtol=1e-4)
    assert (everything_predicted[0, 2:] - want[0, 2:]).abs().max() > 1e-2  # the two passes differ


@pytest.mark.parametrize("features", [False, True], ids=["plain", "features"])
def test_inference_model_computes_the_training_function(tmp_path, tiny_dir, features):
    target, net, model = _untrained_draft(tmp_path, tiny_dir, features, seed=1)
    assert (model.feature_head is not None) == features
    tokens = torch.randint(0, target.spec.vocab_size, (1, 21))
    feats = torch.randn(1, 21, target.spec.hidden_size) if features else None
    with torch.no_grad():
        want, want_g = net(tokens, feats)
    cache = model.allocate_cache(1, 64)
    got, got_g = [], []
    for a, b in ((0, 13), (13, 21)):  # a prefill chunk, then a second one on top of the cache
        seg = Segments.build([(0, b - a, a)])
        if features:
            logits, g = model.feature_head(model.normed(model.hidden(tokens[0, a:b], seg, cache, extra=feats[0, a:b]), model.norm))
            got_g.append(g)
        else:
            logits = model.forward(tokens[0, a:b], seg, cache)
        got.append(logits)
    torch.testing.assert_close(torch.cat(got), want[0], atol=1e-4, rtol=1e-4)
    if features:
        torch.testing.assert_close(torch.cat(got_g), want_g[0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("greedy,sampler", [(True, "gumbel"), (False, "rejection"), (False, "gumbel")],
                         ids=["greedy", "sampling-rejection", "sampling-gumbel"])
def test_subset_head_proposes_only_kept_target_ids(tiny_distilled_plain, tiny_dir, greedy, sampler):
    settings, _ = tiny_distilled_plain
    target, tok = load_model(tiny_dir), load_tokenizer(tiny_dir)
    model = load_draft(settings.out / "d1x64", target, torch.float32, torch.device("cpu"))
    kept = set(model.vocab_ids.tolist())
    drafter = ModelDrafter("d", model, model.allocate_cache(4, 128))
    sp = SamplingParams() if greedy else SamplingParams(1.0, sampler=sampler)
    reqs = [DraftRequest(slot=i, tokens=tok.encode(p), gamma=6, gen=make_generator(0, str(i)), sp=sp)
            for i, p in enumerate(TRAIN_PROMPTS[:4])]
    for _ in range(3):  # several proposals per slot; sampling draws different tokens each time
        for r in reqs:
            drafter.on_commit(r.slot, r.tokens)  # nothing was accepted: the drafter rewinds
        prop = drafter.propose(reqs)
        for r, toks, q in zip(reqs, prop.tokens, prop.probs):
            assert len(toks) == 6 and set(toks) <= kept
            if not greedy and sampler == "gumbel":  # drafted with the target's noise: no q to return
                assert q is None
            elif not greedy:  # rejection sampling reads the draft's q: mass only on kept ids
                assert q.shape == (6, target.spec.vocab_size)
                outside = torch.ones(target.spec.vocab_size, dtype=torch.bool)
                outside[model.vocab_ids] = False
                assert q[:, outside].sum() == 0
                torch.testing.assert_close(q.sum(-1), torch.ones(6))
                assert all(q[j, t] > 0 for j, t in enumerate(toks))


def _two_jobs(tmp_path, tiny_dir, draft_dir, selector: str):
    """A plain job and a speculative one, ungated: the tiny drafts are too unsure of the random tiny
    target for the confidence gate to let many chains through (tests/test_spec_equality.py covers
    the gate), and here their drafts must reach the verifier."""
    prompts = write_jsonl(tmp_path / "in.jsonl", [{"id": str(i), "prompt": p} for i, p in enumerate(TRAIN_PROMPTS)])
    out = {}
    for name, sel in (("ar", "none"), ("spec", selector)):
        job = parse_job({
            "input": {"paths": [str(prompts)]}, "output": {"dir": str(tmp_path / name)},
            "target": {"model": str(tiny_dir), "device": "cpu"},
            "drafters": [{"name": "trained", "kind": "model", "model": str(draft_dir)}, {"name": "ngram", "kind": "ngram"}],
            "spin": {"selector": sel, "confidence_gate": False}, "batch": {"slots": 3, "max_model_len": 128},
            "sampling": {"max_tokens": 24, "temperature": 0.0, "ignore_eos": True},
        })
        assert check_models(job) == []
        out[name] = run_job(job, progress=False).summary
    return out


@pytest.mark.parametrize("draft", ["features", "plain"])
@pytest.mark.parametrize("selector", ["fixed:trained", "ucb"])
def test_trained_draft_in_a_job_equals_autoregressive(tmp_path, tiny_distilled, tiny_distilled_plain, tiny_dir,
                                                      selector, draft):
    from spin_batch.io.outputs import read_outputs

    settings, _ = tiny_distilled if draft == "features" else tiny_distilled_plain
    summaries = _two_jobs(tmp_path, tiny_dir, settings.out / ("d2x64" if draft == "features" else "d1x64"),
                          selector)
    ar = dict(zip(*read_outputs(tmp_path / "ar").select("id", "text").to_dict(as_series=False).values()))
    spec = dict(zip(*read_outputs(tmp_path / "spec").select("id", "text").to_dict(as_series=False).values()))
    assert spec == ar and len(ar) == len(TRAIN_PROMPTS)
    drafted = summaries["spec"]["drafters"]["trained"]
    assert drafted["draft_tokens"] > 0
    if selector == "fixed:trained":  # the bandit may drop it for the n-gram drafter after a try
        assert drafted["accepted_draft_tokens"] > 0


@pytest.mark.parametrize("bf16_fast", [True, False])
def test_distilled_drafts_default_to_bf16_where_native_and_share_one_embedding(tiny_distilled, tiny_dir,
                                                                               monkeypatch, bf16_fast):
    from spin_batch.build import build_drafters

    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: bf16_fast)
    settings, _ = tiny_distilled
    job = parse_job({
        "input": {"paths": ["x.jsonl"]}, "output": {"dir": "o"}, "target": {"model": str(tiny_dir)},
        "drafters": [{"name": "a", "kind": "model", "model": str(settings.out / "d1x64-k24")},
                     {"name": "b", "kind": "model", "model": str(settings.out / "d2x64")},
                     {"name": "c", "kind": "model", "model": str(settings.out / "d2x64"), "dtype": "float32"}],
    })
    target = load_model(tiny_dir)
    drafters = build_drafters(job, target, target.allocate_cache(2, 64), torch.device("cpu"))
    a, b, c = (drafters[n].model for n in "abc")
    want = torch.bfloat16 if bf16_fast else torch.float32
    assert a.dtype == b.dtype == want and c.dtype == torch.float32  # an explicit dtype wins
    assert a.embed is b.embed  # one cast copy of the target's embedding, not one per draft
    assert c.embed is target.embed


def test_a_draft_without_tokenizer_files_validates_loads_and_drafts(tmp_path, tiny_distilled, tiny_dir):
    """A distilled draft runs with its target's tokenizer: with the tokenizer files distill copied beside it
    removed (as in the shipped examples/drafts), the job validates and the draft loads as it did with them."""
    import shutil

    settings, _ = tiny_distilled
    bare = tmp_path / "bare"
    shutil.copytree(settings.out / "d2x64", bare, ignore=shutil.ignore_patterns(
        "tokenizer*", "special_tokens_map*", "generation_config*", "vocab*", "merges*", "chat_template*"))
    assert sorted(p.name for p in bare.iterdir()) == ["config.json", "model.safetensors"]
    job = parse_job({
        "input": {"paths": ["x.jsonl"]}, "output": {"dir": "o"}, "target": {"model": str(tiny_dir)},
        "drafters": [{"name": "bare", "kind": "model", "model": str(bare)}], "batch": {"max_model_len": 256},
    })
    assert check_models(job) == []
    target = load_model(tiny_dir)
    a = load_draft(settings.out / "d2x64", target, torch.float32, torch.device("cpu"))
    b = load_draft(bare, target, torch.float32, torch.device("cpu"))
    assert b.spec == a.spec and torch.equal(b.vocab_ids, a.vocab_ids)


def test_draft_for_another_target_is_rejected_before_loading(tiny_distilled, tiny_dir, tiny_qwen_dir):
    settings, _ = tiny_distilled
    assert check_pairing(settings.out / "d2x64", tiny_dir) is None
    why = check_pairing(settings.out / "d2x64", tiny_qwen_dir)
    assert why is not None and "another target" in why
    job = parse_job({
        "input": {"paths": ["x.jsonl"]}, "output": {"dir": "o"}, "target": {"model": str(tiny_qwen_dir)},
        "drafters": [{"name": "trained", "kind": "model", "model": str(settings.out / "d2x64")}],
    })
    assert any("another target" in p for p in check_models(job))


def test_sizes_parse():
    assert DraftArch.parse("2x384") == DraftArch(2, 384, 6, 2, 1024)
    assert DraftArch.parse("1x192:2048") == DraftArch(1, 192, 3, 1, 512, 2048)
    assert [a.name for a in parse_sizes("1x256, 4x384, 1x256:4096")] == ["d1x256", "d4x384", "d1x256-k4096"]
    for bad in ("2", "2x100", "0x64", "2x64,2x64", "1x64:1", "1x64:"):
        with pytest.raises(ValueError):
            parse_sizes(bad)


def test_cli_rejects_bad_arguments_before_loading(tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "x"}])
    r = CliRunner().invoke(main, ["distill", "--target", str(tmp_path / "nope"), "--prompts", str(prompts),
                                  "--out", str(tmp_path / "o")])
    assert r.exit_code != 0 and "no config.json" in r.output
    r = CliRunner().invoke(main, ["distill", "--target", "builtin:smollm2-135m", "--prompts", str(prompts),
                                  "--out", str(tmp_path / "o"), "--sizes", "3x100"])
    assert r.exit_code != 0 and "multiple of 64" in r.output
    r = CliRunner().invoke(main, ["distill", "--target", "builtin:smollm2-135m", "--prompts",
                                  str(tmp_path / "missing*.jsonl"), "--out", str(tmp_path / "o")])
    assert r.exit_code != 0 and not (tmp_path / "o").exists()
    r = CliRunner().invoke(main, ["distill", "--target", "builtin:smollm2-135m", "--prompts", str(prompts),
                                  "--out", str(tmp_path / "o"), "--weight-decay", "-0.1"])
    assert r.exit_code != 0 and "--weight-decay must be >= 0" in r.output and not (tmp_path / "o").exists()
    r = CliRunner().invoke(main, ["distill", "--target", "builtin:smollm2-135m", "--prompts", str(prompts),
                                  "--out", str(tmp_path / "o"), "--samples", "2", "--sample-temperature", "0"])
    assert r.exit_code != 0 and "--sample-temperature must be > 0" in r.output and not (tmp_path / "o").exists()
    r = CliRunner().invoke(main, ["distill", "--target", "builtin:smollm2-135m", "--prompts", str(prompts),
                                  "--out", str(tmp_path / "o"), "--precision", "fp8"])
    assert r.exit_code != 0 and "--precision" in r.output and not (tmp_path / "o").exists()
    for device, message in (("bogus", "--device: "), ("cuda:0", "--device: device 'cuda:0' requested")):
        if device.startswith("cuda") and torch.cuda.is_available():
            continue
        r = CliRunner().invoke(main, ["distill", "--target", "builtin:smollm2-135m", "--prompts", str(prompts),
                                      "--out", str(tmp_path / "o"), "--device", device])
        assert r.exit_code == 1 and message in r.output and r.exception.__class__ is SystemExit, r.output
    r = CliRunner().invoke(main, ["distill", "--target", "builtin:smollm2-135m", "--prompts", str(prompts),
                                  "--out", str(tmp_path / "o"), "--sizes", "1x64:100000,1x128"])
    assert r.exit_code == 1 and "the target's vocabulary has 49152 ids" in r.output, r.output
    assert "d1x64-k100000: 100000 head ids" in r.output and not (tmp_path / "o").exists()


def _key(settings) -> str:
    from spin_batch.distill import teacher_dtype, teacher_key

    return teacher_key(settings, settings.prompts, fingerprint(settings.target),
                       teacher_dtype(settings, torch.device("cpu")))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_teacher_loss_equals_log_softmax_cross_entropy(dtype, monkeypatch):
    """TeacherCE (chunked, one-pass backward) gives log_softmax + gather's value and gradient, with rows
    whose teacher ids are all outside the head (no mass) and rows of weight 0 (padding) in the batch."""
    from spin_batch.distill.train import TeacherCE

    monkeypatch.setattr(TeacherCE, "CHUNK_ELEMS", 3 * 50)  # chunks of 3 rows: a ragged last chunk
    g = torch.Generator().manual_seed(0)
    B, T, K, k = 2, 7, 50, 5
    logits = (torch.randn(B, T, K, generator=g) * 4).to(dtype)
    tid = torch.randint(0, K, (B, T, k), generator=g)
    tp = torch.softmax(torch.randn(B, T, k, generator=g), -1)
    tp[0, 2] = 0  # no teacher id kept here
    w = torch.rand(B, T, generator=g)
    w[1, 5:] = 0  # padding

    x1 = logits.clone().requires_grad_()
    ref = -(tp * torch.log_softmax(x1.float(), -1).gather(-1, tid)).sum(-1)
    ref = (ref * w).sum() / w.sum()
    ref.backward()
    x2 = logits.clone().requires_grad_()
    got = TeacherCE.apply(x2, tid, tp, w)
    got.backward()
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert x2.grad.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 4e-3
    torch.testing.assert_close(x2.grad.float(), x1.grad.float(), atol=tol, rtol=tol)
    assert x2.grad[0, 2].abs().max() == 0 and x2.grad[1, 5:].abs().max() == 0


@pytest.mark.parametrize("native", [True, False])
def test_teacher_dtype_is_bf16_where_native_and_heldout_stays_float32(native, monkeypatch):
    from spin_batch.distill import DistillSettings, teacher_dtype
    from spin_batch.models import loader

    monkeypatch.setattr(loader, "native_bf16", lambda device: native)
    s = DistillSettings(target="t", prompts=(), out=None, sizes=())
    assert teacher_dtype(s, torch.device("cpu")) == ("bfloat16" if native else "float32")
    from dataclasses import replace
    assert teacher_dtype(replace(s, teacher_dtype="float32"), torch.device("cpu")) == "float32"
    with pytest.raises(ValueError, match="teacher dtype"):
        replace(s, teacher_dtype="fp8")


def test_the_report_says_which_dtype_made_the_data(tiny_distilled):
    """The held-out data (what agreement is measured on) is made in float32 whatever the training data's dtype."""
    from spin_batch.distill import teacher_dtype, teacher_key

    settings, report = tiny_distilled
    assert report["settings"]["teacher_dtype"] == teacher_dtype(settings, torch.device("cpu"))
    fp = fingerprint(settings.target)
    held = settings.out / "data" / "heldout.pt"
    assert TeacherData.load(held, teacher_key(settings, settings.heldout, fp, "float32")) is not None
