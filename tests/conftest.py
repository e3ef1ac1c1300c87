"""Shared fixtures: tiny random Llama-family models saved as real HF directories.

The tokenizer is a small byte-level BPE trained here with `tokenizers`, so the real loading
path (config.json + safetensors + tokenizer files) runs in every test.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

# Triton fixes at decoration time whether a kernel is compiled or interpreted. Without a GPU only the
# interpreter runs, and it must be chosen before anything imports triton (transformers or torch may),
# whichever test file runs first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The C kernels wherever they apply, not the path measured fastest (cpu_plan.py): a tiny test model may
# measure either way, and each test should run one known path. Tests of the measured choice set auto;
# tests of the torch path build their models with a forced plan.
os.environ.setdefault("SPIN_BATCH_CPU_GEMM", "on")

from spin_batch.selection.policy import Choice, Policy, StepChoice  # noqa: E402  (after the environment above)

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "list three colours: red, green and blue",
    "def add(a, b):\n    return a + b",
    "once upon a time there was a small robot who liked to count numbers",
    "what causes the tides? the moon pulls on the oceans",
    "compute 12 * 7 = 84 and 9 + 10 = 19",
    "rewrite this sentence in a formal tone please",
] * 20


def build_tokenizer(out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))
    return fast


def build_tiny_model(
    out: Path, *, model_type: str = "llama", layers: int = 3, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
    seed: int = 0, init_std: float = 0.08, tokenizer_dir: Path | None = None, config: dict | None = None,
) -> Path:
    """A random Llama/Mistral/Qwen2 model saved with save_pretrained (safetensors) plus tokenizer files.

    config: more config.json fields (attention_bias, head_dim, rope_scaling, sliding_window, tie_word_embeddings...).
    Every attention bias the model has is random, so the bias paths are exercised."""
    from transformers import (AutoTokenizer, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                              Qwen2Config, Qwen2ForCausalLM)

    out.mkdir(parents=True, exist_ok=True)
    if tokenizer_dir is None:
        tok = build_tokenizer(out)
    else:
        tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        tok.save_pretrained(str(out))
    common = dict(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=hidden * 2 + 8, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=512,
        rms_norm_eps=1e-5, initializer_range=init_std, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=False,
        rope_theta=10000.0,
    )
    common.update(config or {})
    torch.manual_seed(seed)
    classes = {"llama": (LlamaConfig, LlamaForCausalLM), "mistral": (MistralConfig, MistralForCausalLM),
               "qwen2": (Qwen2Config, Qwen2ForCausalLM)}
    config_class, model_class = classes[model_type]
    model = model_class(config_class(**common))
    with torch.no_grad():  # random biases (zeros at init), so the bias paths are exercised
        for layer in model.model.layers:
            a = layer.self_attn
            for proj in (a.q_proj, a.k_proj, a.v_proj, a.o_proj):
                if proj.bias is not None:
                    proj.bias.normal_(0, 0.1)
    model.save_pretrained(str(out), safe_serialization=True)
    return out


@pytest.fixture(autouse=True)
def selection_memory_per_test(tmp_path, monkeypatch):
    """Each test's runs keep their selection memory (spin_batch/memory.py) to themselves, subprocesses included:
    a test never starts from what another one learnt."""
    monkeypatch.setenv("SPIN_BATCH_SELECTION_MEMORY", str(tmp_path / "selection-memory"))


@pytest.fixture
def lib():
    """The C kernels' library (cpu_decoder.c), built for this machine; a failed build fails the test."""
    from spin_batch.models import cpu_decoder

    lib = cpu_decoder.library()
    if lib is None:
        pytest.fail("the C decoder library did not build here; the set-up needs a C compiler (cc)")
    return lib


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_qwen_dir(tmp_path_factory, tiny_dir) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), model_type="qwen2", kv_heads=1, seed=1,
                            tokenizer_dir=tiny_dir)


@pytest.fixture(scope="session")
def tiny_draft_dir(tmp_path_factory, tiny_dir) -> Path:
    """A different, smaller random model with the same tokenizer (a never-agreeing drafter)."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-draft"), layers=1, hidden=32, heads=2, kv_heads=1,
                            seed=7, tokenizer_dir=tiny_dir)


def run_all(loop, reqs) -> dict:
    """Runs requests through a BatchLoop to the end; every row must be ok. Returns the Completions by id."""
    done = []
    loop.run(iter(reqs), lambda r: loop.tok.encode(r.prompt), done.append)
    assert len(done) == len(reqs) and all(c.status == "ok" for c in done), [c.error for c in done]
    return {c.request.id: c for c in done}


def token_ids(done: dict) -> dict[str, tuple]:
    """Each completion's (token ids, finish reason), by id: what equality tests compare."""
    return {k: (c.token_ids, c.finish_reason) for k, c in done.items()}


def write_jsonl(path: Path, rows: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return path


TRAIN_PROMPTS = [
    "the quick brown fox jumps over the lazy dog",
    "list three colours: red, green and blue",
    "def add(a, b):",
    "once upon a time there was",
    "compute 12 * 7 =",
    "what causes the tides?",
    "red green blue red green",
    "the moon pulls on the oceans",
]


def merge(base: dict, extra: dict) -> dict:
    """extra merged into base in place, nested mappings key by key; returns base."""
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            merge(base[key], value)
        else:
            base[key] = value
    return base


def write_job(tmp_path: Path, model, inputs=(), *, rows: list | None = None, name: str = "job",
              out: Path | None = None, **sections) -> Path:
    """Write the job file tmp_path/<name>.yaml and return its path: the input files `inputs` (or `rows`,
    written to tmp_path/in.jsonl), the output folder `out` (default tmp_path/out-<name>), the target model,
    and the other `sections` merged in (nested mappings key by key). Nothing else: the job's defaults hold."""
    import yaml

    if rows is not None:
        inputs = [write_jsonl(tmp_path / "in.jsonl", rows)]
    job = merge({"name": name, "input": {"paths": [str(p) for p in inputs]},
                 "output": {"dir": str(out or tmp_path / f"out-{name}")}, "target": {"model": str(model)}}, sections)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


E2E_SECTIONS = {
    "target": {"dtype": "float32", "device": "cpu"},
    "batch": {"slots": 3, "max_model_len": 128, "max_num_batched_tokens": 64},
    "sampling": {"temperature": 0.0, "max_tokens": 12, "seed": 0},
}


def make_job(tmp_path: Path, model_dir: Path, inputs, *, name: str = "job", **sections) -> tuple[Path, Path]:
    """write_job with the end-to-end tests' settings (E2E_SECTIONS: float32 on CPU, 3 slots, greedy, 12 tokens)
    under `sections`; returns (job path, output folder)."""
    import copy

    path = write_job(tmp_path, model_dir, inputs, name=name, **merge(copy.deepcopy(E2E_SECTIONS), sections))
    return path, tmp_path / f"out-{name}"


SPEC_KEYS = ("id_column", "prompt_column", "messages_column", "params_column", "keep_columns", "fmt")


def spec_of(kwargs: dict):
    """The reader's Spec (io.rows.row_spec) from the column keywords in kwargs, which are taken out of it."""
    from spin_batch.io.rows import row_spec

    return row_spec(**{k: kwargs.pop(k) for k in SPEC_KEYS if k in kwargs})


def distill_tiny(root: Path, target_dir: Path, sizes: str, features: bool):
    """`spin-batch distill` run on the tiny target: a 40-id head, a few seconds of training."""
    from spin_batch.distill import DistillSettings, run_distill
    from spin_batch.distill.net import parse_sizes
    from spin_batch.distill.train import TrainSettings

    prompts = write_jsonl(root / "train.jsonl", [{"id": f"t{i}", "kind": "k", "prompt": p}
                                                 for i, p in enumerate(TRAIN_PROMPTS)])
    held = write_jsonl(root / "held.jsonl", [{"id": f"h{i}", "kind": "a" if i % 2 else "b", "prompt": p[::-1]}
                                             for i, p in enumerate(TRAIN_PROMPTS)])
    settings = DistillSettings(
        target=str(target_dir), prompts=(str(prompts),), out=root / "drafts", sizes=tuple(parse_sizes(sizes)),
        heldout=(str(held),), max_tokens=24, slots=4, vocab=40, topk=8, device="cpu", cost_slots=(1, 2),
        train=TrainSettings(steps=60, batch_tokens=256, lr=3e-3, seed=0, features=features),
    )
    return settings, run_distill(settings, progress=False)


@pytest.fixture(scope="session")
def tiny_distilled(tmp_path_factory, tiny_dir):
    """Two feature-reading drafts (the default kind) distilled from the tiny target."""
    return distill_tiny(tmp_path_factory.mktemp("distill"), tiny_dir, "1x64:24,2x64", features=True)


@pytest.fixture(scope="session")
def tiny_distilled_plain(tmp_path_factory, tiny_dir):
    """A plain (token-only) draft distilled from the tiny target."""
    return distill_tiny(tmp_path_factory.mktemp("distill-plain"), tiny_dir, "1x64", features=False)


class Cycle(Policy):
    """A policy that drafts at every step: drafter and gamma (1..4) vary by slot and step (the
    loop-level equality tests use it to mix drafters and draft lengths in one batch)."""

    def __init__(self, names: list[str]):
        self.names, self.t = names, 0

    def choose(self, slots: list[int], caps: list[int]) -> StepChoice:
        self.t += 1
        return StepChoice.of([Choice(self.names[(s + self.t) % len(self.names)], min(1 + (s + self.t) % 4, cap))
                              if cap else Choice(None, 0) for s, cap in zip(slots, caps)])
