"""End to end: an OpenAI batch input file (chat and completion lines mixed, each with its own sampling
settings, some bad) -> `spin-batch run` with output.format openai -> results.jsonl, each line parsed by
the `openai` package's types, in input order, one per custom_id."""

from __future__ import annotations

import pytest

from conftest import write_jsonl
from conftest import make_job
from test_cli_e2e import _isolate_process_state, invoke, read_rows, run_ok  # noqa: F401
from test_openai_output import lines_of, parse_line

pytest.importorskip("openai")  # in the test extra (pyproject.toml): CI installs it
from openai.types import BatchError  # noqa: E402
from openai.types import Completion as TextCompletion  # noqa: E402
from openai.types.chat import ChatCompletion  # noqa: E402

CHAT_URL, COMPLETIONS_URL = "/v1/chat/completions", "/v1/completions"


def line(custom_id: str, url: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


LINES = [
    line("c-1", CHAT_URL, model="my-chat", messages=[{"role": "user", "content": "list three colours"}],
         max_tokens=4, temperature=0),
    line("p-1", COMPLETIONS_URL, model="my-base", prompt="the quick brown fox", max_tokens=2),
    line("c-2", CHAT_URL, messages=[{"role": "system", "content": "be brief"},
                                    {"role": "user", "content": "what causes the tides?"}],
         max_completion_tokens=3, temperature=0.8, seed=7),
    line("bad-n", COMPLETIONS_URL, model="my-base", prompt="once upon a time", n=0),
    line("p-2", COMPLETIONS_URL, model="my-base", prompt="def add(a, b):", max_tokens=5, top_k=3, temperature=0.5),
    {"custom_id": "bad-url", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}},
    line("p-3", COMPLETIONS_URL, prompt="compute 12 * 7", temperature=0),
    line("bad-model", COMPLETIONS_URL, model="gpt-4o", prompt="compute 12 * 7"),  # a model the job does not serve
]
MAX_TOKENS = {"c-1": 4, "p-1": 2, "c-2": 3, "p-2": 5, "p-3": 12}  # p-3: the job's sampling.max_tokens


def test_openai_batch_in_openai_batch_out(tmp_path, tiny_dir):
    src = write_jsonl(tmp_path / "in" / "batch.jsonl", LINES)
    job, out = make_job(tmp_path, tiny_dir, [src], name="openai", output={"format": "openai"},
                        target={"served_model_name": [str(tiny_dir), "my-chat", "my-base"]})
    run_ok(job)
    lines = lines_of(out / "results.jsonl")
    assert [x["custom_id"] for x in lines] == [x["custom_id"] for x in LINES]  # input order, each id once
    parsed = {x["custom_id"]: parse_line(x) for x in lines}
    kinds = {cid: type(p) for cid, p in parsed.items()}
    assert kinds == {"c-1": ChatCompletion, "p-1": TextCompletion, "c-2": ChatCompletion, "bad-n": BatchError,
                     "p-2": TextCompletion, "bad-url": BatchError, "p-3": TextCompletion, "bad-model": BatchError}
    for cid, limit in MAX_TOKENS.items():  # each line decoded with its own max_tokens
        body = parsed[cid]
        assert 1 <= body.usage.completion_tokens <= limit, cid
        assert body.usage.total_tokens == body.usage.prompt_tokens + body.usage.completion_tokens
        if body.usage.completion_tokens < limit:
            assert body.choices[0].finish_reason == "stop", cid
    assert parsed["p-1"].choices[0].finish_reason == "length" and parsed["p-1"].usage.completion_tokens == 2
    assert [parsed[c].model for c in ("c-1", "p-1", "c-2", "p-3")] == ["my-chat", "my-base", str(tiny_dir),
                                                                         str(tiny_dir)]
    assert "n" in parsed["bad-n"].message and "/v1/embeddings" in parsed["bad-url"].message
    assert parsed["bad-model"].message.startswith("The model `gpt-4o` does not exist.")  # vLLM's words

    # a /v1/completions prompt is raw text: the same greedy text as a plain row without the chat template
    plain_src = write_jsonl(tmp_path / "in2" / "plain.jsonl", [{"id": "p-3", "prompt": "compute 12 * 7"}])
    plain_job, plain_out = make_job(tmp_path, tiny_dir, [plain_src], name="plain", input={"chat_template": False})
    run_ok(plain_job)
    assert parsed["p-3"].choices[0].text == read_rows(plain_out)[0]["text"]

    # export writes the same lines; a rerun (nothing left to decode) writes them again
    exported = tmp_path / "exported.jsonl"
    assert invoke("export", out, "--to", exported, "--format", "openai").exit_code == 0
    assert exported.read_bytes() == (out / "results.jsonl").read_bytes()
    (out / "results.jsonl").unlink()
    run_ok(job)
    assert (out / "results.jsonl").read_bytes() == exported.read_bytes()
