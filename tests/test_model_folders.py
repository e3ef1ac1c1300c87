"""A user's own model folder never gives silently wrong text (issue 30).

A bad folder is refused by `spin-batch validate` without loading weights (safetensors headers,
config.json, the tokenizer), with a message that names what is wrong, and by `run` and at load in
one line, never a traceback: checkpoints whose tensors are not those config.json's architecture
reads, corrupt or truncated safetensors files, no tokenizer, a context past Mistral's sliding
window, an output folder that cannot be written. EOS ids follow transformers' generate.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from spin_batch.cli import main
from spin_batch.models import execution, loader
from spin_batch.models.segments import Segments
from spin_batch.models.spec import CheckpointError

from conftest import build_tiny_model, write_job

WEIGHTS = "model.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


@pytest.fixture(scope="module")
def pristine(tmp_path_factory, tiny_dir) -> Path:
    """A 2-layer untied Llama with the tiny tokenizer: tests copy it and break the copy."""
    return build_tiny_model(tmp_path_factory.mktemp("pristine"), layers=2, seed=5, tokenizer_dir=tiny_dir)


def copy_model(src: Path, dst: Path, *, tokenizer: bool = True) -> Path:
    ignore = shutil.ignore_patterns(*TOKENIZER_FILES) if not tokenizer else None
    shutil.copytree(src, dst, ignore=ignore)
    return dst


def edit_weights(model: Path, edit) -> Path:
    sd = load_file(str(model / WEIGHTS))
    edit(sd)
    save_file(sd, str(model / WEIGHTS), metadata={"format": "pt"})
    return model


def job_file(tmp_path: Path, model: Path, *, name: str = "job", drafters=(), max_model_len: int = 64,
             out: Path | None = None) -> Path:
    return write_job(tmp_path, model, rows=[{"id": "a", "prompt": "the quick brown fox"}], name=name, out=out,
                     target={"dtype": "float32", "device": "cpu"}, drafters=list(drafters),
                     batch={"slots": 1, "max_model_len": max_model_len}, sampling={"temperature": 0.0, "max_tokens": 4})


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def refused(result, *needles: str) -> str:
    """The command exited 1 with a message holding every needle, and no traceback."""
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), (result.output, result.exc_info)
    assert "Traceback" not in result.output, result.output
    for needle in needles:
        assert needle in result.output, result.output
    return result.output


def hf_logits(path: Path, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def our_logits(path: Path, ids: list[int]) -> torch.Tensor:
    model = loader.load_model(path, plan=execution.forced("torch"))
    return model.forward(torch.tensor(ids), Segments.build([(0, len(ids), 0)]), model.allocate_cache(1, 64))


IDS = [5, 17, 42, 99, 3, 250, 8, 61]


# -- 1. every checkpoint tensor read, every tensor read there ----------------------------------------


def _layers(sd) -> int:
    return 1 + max(int(k.split(".")[2]) for k in sd if k.startswith("model.layers."))


BROKEN = {
    # name: (edit of the state dict, the tensor the message must name, what it says of it)
    "untied_without_lm_head": (lambda sd: sd.pop("lm_head.weight"), "lm_head.weight", "missing"),
    "a_layer_tensor_missing": (lambda sd: sd.pop("model.layers.1.mlp.down_proj.weight"),
                               "model.layers.1.mlp.down_proj.weight", "missing"),
    "an_o_bias_the_config_does_not_have": (
        lambda sd: sd.__setitem__("model.layers.0.self_attn.o_proj.bias", torch.zeros(64)),
        "model.layers.0.self_attn.o_proj.bias", "would not use"),
    "quantization_scales": (
        lambda sd: sd.update({f"model.layers.{i}.{m}.weight_scale": torch.ones(1) for i in range(_layers(sd))
                              for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                                        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}),
        "model.layers.0.mlp.down_proj.weight_scale", "14 tensors the decoder would not use"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_checkpoint_tensors_not_those_config_reads_are_refused(tmp_path, pristine, case, monkeypatch):
    edit, name, says = BROKEN[case]
    model = edit_weights(copy_model(pristine, tmp_path / "m"), edit)

    (problem,) = loader.check_model_ref(str(model))  # headers only
    assert name in problem and says in problem, problem
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")) as e:
        loader.load_model(model)
    assert str(model) in str(e.value)
    if case == "quantization_scales":  # a few names and a count, not fourteen
        assert "and 11 more" in problem and problem.count("weight_scale") == 3, problem

    job = job_file(tmp_path, model)
    refused(invoke("validate", job), name, says)
    refused(invoke("run", job, "--no-progress"), name)
    # and where the load itself finds it (check_models skipped): one line too
    import spin_batch.preflight as preflight

    monkeypatch.setattr(preflight, "check_models", lambda job: [])
    refused(invoke("run", job, "--no-progress"), name)


def test_tied_config_with_its_own_lm_head_reads_it_as_transformers_does(tmp_path, tiny_dir):
    """tie_word_embeddings true and an lm_head.weight with values of its own: transformers does not tie
    them (it warns) and uses that head; so do we. Only one of the two saved: it serves as both."""
    base = build_tiny_model(tmp_path / "tied", layers=1, seed=2, tokenizer_dir=tiny_dir,
                            config={"tie_word_embeddings": True})
    assert "lm_head.weight" not in load_file(str(base / WEIGHTS))  # save_pretrained drops a tied head

    own_head = edit_weights(copy_model(base, tmp_path / "own-head"), lambda sd: sd.__setitem__(
        "lm_head.weight", torch.randn_like(sd["model.embed_tokens.weight"])))
    only_head = edit_weights(copy_model(base, tmp_path / "only-head"), lambda sd: sd.__setitem__(
        "lm_head.weight", sd.pop("model.embed_tokens.weight")))
    for model in (base, own_head, only_head):
        assert loader.check_model_ref(str(model)) == []
        torch.testing.assert_close(our_logits(model, IDS), hf_logits(model, IDS), atol=2e-4, rtol=0)


def test_rotary_inverse_frequencies_of_old_checkpoints_are_ignored_as_transformers_does(tmp_path, pristine):
    model = edit_weights(copy_model(pristine, tmp_path / "m"), lambda sd: sd.update(
        {f"model.layers.{i}.self_attn.rotary_emb.inv_freq": torch.ones(8) for i in range(2)}))
    assert loader.check_model_ref(str(model)) == []
    torch.testing.assert_close(our_logits(model, IDS), hf_logits(pristine, IDS), atol=2e-4, rtol=0)


def test_weight_files_are_those_transformers_reads(tmp_path, pristine):
    """Sharded with an index, beside a consolidated.safetensors (Mistral's folders ship both): the
    shards only. A shard the index names that is missing, or a tensor in two files, is refused."""
    model = copy_model(pristine, tmp_path / "sharded")
    sd = load_file(str(model / WEIGHTS))
    (model / WEIGHTS).unlink()
    names = sorted(sd)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for file, keys in shards.items():
        save_file({k: sd[k] for k in keys}, str(model / file), metadata={"format": "pt"})
    (model / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}))
    save_file({"layers.0.attention.wq.weight": torch.zeros(2, 2)}, str(model / "consolidated.safetensors"))
    assert loader.check_model_ref(str(model)) == []
    torch.testing.assert_close(our_logits(model, IDS), hf_logits(pristine, IDS), atol=2e-4, rtol=0)

    (model / "model-00002-of-00002.safetensors").rename(model / "elsewhere.bin")
    (problem,) = loader.check_model_ref(str(model))
    assert "model-00002-of-00002.safetensors" in problem and "not in the folder" in problem, problem

    two = copy_model(pristine, tmp_path / "two-files")
    save_file({"model.norm.weight": sd["model.norm.weight"]}, str(two / "extra.safetensors"))
    (two / WEIGHTS).rename(two / "main.safetensors")
    (problem,) = loader.check_model_ref(str(two))
    assert "model.norm.weight is in both" in problem, problem


@pytest.fixture(scope="module")
def fresh_draft(tmp_path_factory, tiny_dir) -> Path:
    """An untrained distilled draft of the tiny target, written as `spin-batch distill` writes one."""
    from spin_batch.distill.net import DraftArch, DraftNet, save_draft
    from spin_batch.models.distilled import fingerprint

    target = loader.load_model(tiny_dir)
    net = DraftNet(DraftArch(layers=1, hidden=64, heads=1, kv_heads=1, intermediate=96), target.embed, target.norm,
                   torch.arange(0, 40), target.spec.rope_theta, reads_features=True)
    out = tmp_path_factory.mktemp("draft") / "d1x64"
    save_draft(net, out, tiny_dir, fingerprint(tiny_dir), {}, torch.float32)
    return out


def test_distilled_drafts_follow_their_own_rule(tmp_path, tiny_dir, fresh_draft):
    """A distilled draft has no embeddings nor lm_head (it reads the target's): it validates and loads; one
    with a tensor load_draft would not read is refused at validate and at load; one as the target is refused;
    one without tokenizer files is fine (it uses the target's tokenizer)."""
    from spin_batch.models.distilled import load_draft

    target = loader.load_model(tiny_dir)
    assert loader.check_model_ref(str(fresh_draft)) == []
    load_draft(fresh_draft, target, torch.float32, torch.device("cpu"))

    no_tokenizer = copy_model(fresh_draft, tmp_path / "bare-draft", tokenizer=False)
    assert not (no_tokenizer / "tokenizer.json").exists()
    drafter = {"name": "trained", "kind": "model", "model": str(no_tokenizer)}
    assert invoke("validate", job_file(tmp_path, tiny_dir, name="bare", drafters=[drafter])).exit_code == 0

    extra = edit_weights(copy_model(fresh_draft, tmp_path / "extra-draft"), lambda sd: sd.__setitem__(
        "model.embed_tokens.weight", torch.zeros(3, 3)))
    (problem,) = loader.check_model_ref(str(extra))
    assert "model.embed_tokens.weight" in problem and "would not use" in problem, problem
    with pytest.raises(CheckpointError, match=r"model\.embed_tokens\.weight"):
        load_draft(extra, target, torch.float32, torch.device("cpu"))
    refused(invoke("validate", job_file(tmp_path, tiny_dir, name="extra", drafters=[
        {"name": "trained", "kind": "model", "model": str(extra)}])), "drafters.trained", "model.embed_tokens.weight")

    refused(invoke("validate", job_file(tmp_path, fresh_draft, name="as-target")), "is a distilled draft")


# -- 2. corrupt and truncated safetensors files ---------------------------------------------------------


CORRUPT = {
    "garbage_header": (lambda raw: b"\x00" * 8 + b"not a header at all" + raw[40:], "header is not JSON"),
    "header_length_beyond_the_file": (lambda raw: struct.pack("<Q", len(raw) + 1000) + raw[8:],
                                      "header length says"),
    "truncated_data": (lambda raw: raw[: len(raw) - 1000], "truncated"),
    "empty": (lambda raw: b"", "no header"),
}


@pytest.mark.parametrize("case", list(CORRUPT))
def test_corrupt_safetensors_is_a_problem_naming_the_file(tmp_path, pristine, case, monkeypatch):
    corrupt, says = CORRUPT[case]
    model = copy_model(pristine, tmp_path / "m")
    weights = model / WEIGHTS
    weights.write_bytes(corrupt(weights.read_bytes()))

    (problem,) = loader.check_model_ref(str(model))
    assert str(weights) in problem and says in problem, problem
    with pytest.raises(CheckpointError, match=says):
        loader.load_model(model)

    job = job_file(tmp_path, model)
    refused(invoke("validate", job), str(weights), says)
    refused(invoke("run", job, "--no-progress"), str(weights))
    import spin_batch.preflight as preflight

    monkeypatch.setattr(preflight, "check_models", lambda job: [])  # the load's own check: one line too
    refused(invoke("run", job, "--no-progress"), str(weights), says)


# -- 3. EOS ------------------------------------------------------------------------------------------


def test_eos_ids_follow_transformers_generate(tmp_path, tiny_dir):
    """An eos_token_id list in config.json only (no generation_config.json): transformers' generate stops at
    any of them, and so does our loop. A generation_config.json, where there is one, is what counts."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from spin_batch.engine.loop import BatchLoop, LoopSettings
    from spin_batch.selection.fixed import NoSpeculation
    from spin_batch.sampling import SamplingParams
    from spin_batch.records import Request
    from spin_batch.build import eos_ids

    model = build_tiny_model(tmp_path / "m", layers=2, seed=9, tokenizer_dir=tiny_dir)
    tok = AutoTokenizer.from_pretrained(str(model))
    prompt = tok.encode("once upon a time there was")

    def hf_generate(max_new: int, min_new: int = 0) -> list[int]:
        ref = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
        out = ref.generate(torch.tensor([prompt]), max_new_tokens=max_new, min_new_tokens=min_new, do_sample=False,
                           pad_token_id=tok.pad_token_id)
        return out[0, len(prompt):].tolist()

    def ours(max_new: int) -> list[int]:
        ids = eos_ids(model, tok)
        target = loader.load_model(model)
        settings = LoopSettings(slots=1, max_model_len=64, max_num_batched_tokens=32, max_tokens=max_new,
                                sampling=SamplingParams(), eos_token_ids=ids)
        loop = BatchLoop(target, tok, settings, NoSpeculation(), {}, target.allocate_cache(1, 64))
        got = []
        loop.run(iter([Request(source="m#0", id="0", prompt="", messages=None)]), lambda r: prompt,
                 lambda c: got.append(list(c.token_ids)))
        return got[0]

    free = hf_generate(16, 16)
    # a token the greedy completion reaches after a few steps, and not before: the second eos id
    k = next(i for i in range(2, len(free)) if free[i] not in free[:i] and free[i] != tok.eos_token_id)
    stop = free[k]
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "eos_token_id": [tok.eos_token_id, stop]}))
    (model / "generation_config.json").unlink()
    want = hf_generate(16)
    assert want == free[: k + 1]  # transformers stops at config.json's second id
    assert ours(16) == want

    # generation_config.json's eos_token_id wins over config.json's, as in transformers
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": tok.eos_token_id}))
    want = hf_generate(16)
    assert len(want) > k + 1 and ours(16) == want


# -- 4. validate: tokenizer, sliding window, output folder ------------------------------------------------


def test_a_folder_without_tokenizer_files_is_a_validate_problem(tmp_path, tiny_dir, pristine):
    bare = copy_model(pristine, tmp_path / "bare", tokenizer=False)
    job = job_file(tmp_path, bare, name="target")
    refused(invoke("validate", job), "target.model", "no tokenizer files")
    refused(invoke("run", job, "--no-progress"), "no tokenizer files")

    drafter = {"name": "small", "kind": "model", "model": str(bare)}
    refused(invoke("validate", job_file(tmp_path, tiny_dir, name="drafter", drafters=[drafter])),
            "drafters.small", "no tokenizer files")

    broken = copy_model(pristine, tmp_path / "broken-tokenizer")
    (broken / "tokenizer.json").write_text("{ not json")
    refused(invoke("validate", job_file(tmp_path, broken, name="broken")), "its tokenizer does not load")


def test_mistral_window_below_max_model_len_is_a_validate_problem(tmp_path, tiny_dir):
    mistral = build_tiny_model(tmp_path / "mistral", model_type="mistral", layers=1, tokenizer_dir=tiny_dir,
                               config={"sliding_window": 32})
    assert invoke("validate", job_file(tmp_path, mistral, name="fits", max_model_len=32)).exit_code == 0
    job = job_file(tmp_path, mistral, name="long", max_model_len=64)
    refused(invoke("validate", job), "target.model", "max_model_len 64 exceeds the model's sliding window 32")
    refused(invoke("run", job, "--no-progress"), "sliding window 32")
    drafter = {"name": "m", "kind": "model", "model": str(mistral)}
    refused(invoke("validate", job_file(tmp_path, tiny_dir, name="drafter", drafters=[drafter], max_model_len=64)),
            "drafters.m", "sliding window 32")


def test_read_only_output_dir_is_a_validate_problem(tmp_path, tiny_dir, monkeypatch):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    if os.access(locked, os.W_OK):  # root writes anywhere: show validate what another user would see
        real = os.access
        monkeypatch.setattr(os, "access", lambda p, mode, *a, **k: False if Path(p) == locked else real(p, mode))
    try:
        for out, says in ((locked, f"output.dir: {locked} is not writable"),
                          (locked / "below", f"output.dir: cannot create {locked / 'below'}: {locked} is not writable")):
            job = job_file(tmp_path, tiny_dir, out=out)
            refused(invoke("validate", job), says)
            refused(invoke("run", job, "--no-progress"), says)
    finally:
        locked.chmod(0o755)
