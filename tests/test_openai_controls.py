"""The controls from OpenAI lines, the params column and the job, and vLLM's meanings for a line:
omitted temperature from the model's generation config, max_tokens past the context refused, the model
named, content as text parts, chat_template_kwargs; and a file of typical vLLM lines with no error row."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spin_batch.build import generation_defaults, make_encoder
from spin_batch.config import ConfigError, parse_job
from spin_batch.engine.controls import LogitControls
from spin_batch.engine.settings import LoopSettings, request_settings
from spin_batch.io.params import column_params
from spin_batch.records import Request, RowParams
from spin_batch.sampling import SamplingParams

from conftest import write_jsonl
from conftest import make_job
from test_cli_e2e import _isolate_process_state, read_rows, run_ok  # noqa: F401
from test_openai_input import chat, completion, one

# ---------------------------------------------------------------------------- parsing


def test_the_controls_from_an_openai_body(tmp_path: Path) -> None:
    request = one(tmp_path, chat(stop_token_ids=[7, 9], min_tokens=3, min_p=0.05, presence_penalty=0.5,
                                 frequency_penalty=-0.25, repetition_penalty=1.1,
                                 logit_bias={"12": 5, "3": -250, "40": 0.5},
                                 chat_template_kwargs={"enable_thinking": False}))
    assert request.ok, request.error
    assert request.params == RowParams(stop_token_ids=(7, 9), min_tokens=3, min_p=0.05, presence_penalty=0.5,
                                       frequency_penalty=-0.25, repetition_penalty=1.1,
                                       logit_bias=((3, -100.0), (12, 5.0), (40, 0.5)),  # clamped as vLLM does
                                       chat_template_kwargs={"enable_thinking": False})


def test_the_controls_from_a_params_column() -> None:
    got = column_params({"min_tokens": 2, "logit_bias": {5: 1.5}, "stop_token_ids": [], "repetition_penalty": 1.2,
                         "chat_template_kwargs": {"x": 1}}, "params")
    assert got == RowParams(min_tokens=2, logit_bias=((5, 1.5),), stop_token_ids=(), repetition_penalty=1.2,
                            chat_template_kwargs={"x": 1})


def test_chat_template_kwargs_on_a_completions_line_is_an_error(tmp_path: Path) -> None:
    request = one(tmp_path, completion(chat_template_kwargs={"enable_thinking": False}))
    assert not request.ok and "body.chat_template_kwargs is for /v1/chat/completions" in request.error


def test_content_as_text_parts_is_joined_with_newlines(tmp_path: Path) -> None:
    parts = [{"type": "text", "text": "Classify the review."}, {"type": "text", "text": "Great film!"}]
    request = one(tmp_path, chat(messages=[{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                                           {"role": "user", "content": parts}]))
    assert request.ok, request.error
    assert [m["content"] for m in request.messages] == ["Be brief.", "Classify the review.\nGreat film!"]
    plain = write_jsonl(tmp_path / "plain.jsonl", [{"id": "a", "messages": [{"role": "user", "content": parts}]}])
    from spin_batch.io.reader import iter_requests
    from spin_batch.io.shards import list_shards

    (row,) = iter_requests(list_shards([str(plain)], "auto"))
    assert row.ok and row.messages[0]["content"] == "Classify the review.\nGreat film!"


def test_the_job_sampling_section_takes_the_controls(tmp_path: Path) -> None:
    raw = {"input": {"paths": ["x.jsonl"], "chat_template_kwargs": {"enable_thinking": False}}, "output": {"dir": "o"},
           "target": {"served_model_name": "Qwen/Qwen3-0.6B"},
           "sampling": {"stop_token_ids": [5], "min_tokens": 2, "min_p": 0.1, "presence_penalty": 0.5,
                        "frequency_penalty": 0.5, "repetition_penalty": 1.2, "logit_bias": {7: 300, "8": -1},
                        "openai_defaults": "job"}}
    job = parse_job(raw)
    s = job.sampling
    assert (s.stop_token_ids, s.min_tokens, s.min_p, s.logit_bias, s.openai_defaults) == (
        (5,), 2, 0.1, ((7, 100.0), (8, -1.0)), "job")
    assert job.input.chat_template_kwargs == {"enable_thinking": False}
    assert job.target.served_names == ("Qwen/Qwen3-0.6B",)
    raw["sampling"] = {"min_tokens": 200, "max_tokens": 100, "repetition_penalty": 0, "logit_bias": {"a": 1}}
    with pytest.raises(ConfigError) as err:
        parse_job(raw)
    text = str(err.value)
    assert "sampling.min_tokens: must be <= sampling.max_tokens (100), got 200" in text
    assert "sampling.repetition_penalty" in text and "sampling.logit_bias" in text


# ---------------------------------------------------------------------------- vLLM's defaults for a line


def test_generation_defaults_are_the_models_else_vllms(tmp_path: Path) -> None:
    assert generation_defaults(tmp_path) == RowParams(temperature=1.0)  # no generation_config.json
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.05,
         "min_p": "x"}))
    assert generation_defaults(tmp_path) == RowParams(temperature=0.6, top_p=0.95, top_k=20, repetition_penalty=1.05)


def test_an_openai_line_without_temperature_samples_as_vllm_does() -> None:
    cfg = LoopSettings(slots=1, max_model_len=64, max_num_batched_tokens=64, max_tokens=8, sampling=SamplingParams(),
                       controls=LogitControls(frequency_penalty=0.5),
                       openai_defaults=RowParams(temperature=0.6, top_p=0.95, repetition_penalty=1.05))
    line = Request("a#0", "a", "hi", None, endpoint="completion")
    sp, _, controls = request_settings(cfg, line)
    assert sp == SamplingParams(0.6, top_p=0.95)
    assert controls == LogitControls(repetition_penalty=1.05, frequency_penalty=0.5)  # the rest: the job's
    own = Request("a#1", "b", "hi", None, endpoint="chat", params=RowParams(temperature=0.0))
    assert request_settings(cfg, own)[0] == SamplingParams(0.0, top_p=0.95)
    plain = Request("a#2", "c", "hi", None)  # a plain row: the job's, greedy
    assert request_settings(cfg, plain)[0] == SamplingParams()
    from dataclasses import replace

    assert request_settings(replace(cfg, openai_defaults=None), line)[0] == SamplingParams()  # openai_defaults: job


class TemplateTokenizer:
    """Records what apply_chat_template was given."""

    chat_template = "{{ x }}"

    def __init__(self):
        self.calls = []

    def get_vocab(self):
        return {"a": 0}

    def apply_chat_template(self, messages, **kwargs):
        self.calls.append(kwargs)
        return "text"

    def encode(self, text, **kwargs):
        return [0] * len(text)


def test_chat_template_kwargs_reach_the_template_and_unknown_models_are_refused(tmp_path: Path) -> None:
    job = parse_job({"input": {"paths": ["x.jsonl"], "chat_template_kwargs": {"enable_thinking": False}},
                     "output": {"dir": "o"}, "target": {"served_model_name": ["served", "alias"]}})
    tok = TemplateTokenizer()
    encode = make_encoder(tok, job)
    msgs = ({"role": "user", "content": "hi"},)
    encode(Request("s#0", "a", None, msgs, endpoint="chat", model="alias"))
    encode(Request("s#1", "b", None, msgs, endpoint="chat", params=RowParams(chat_template_kwargs={"x": 1})))
    assert tok.calls == [{"add_generation_prompt": True, "enable_thinking": False, "tokenize": False},
                         {"add_generation_prompt": True, "x": 1, "tokenize": False}]
    with pytest.raises(ValueError, match="The model `gpt-4o` does not exist"):
        encode(Request("s#2", "c", None, msgs, endpoint="chat", model="gpt-4o"))
    encode(Request("s#3", "d", None, msgs, model="anything"))  # a plain row's model is never checked


# ---------------------------------------------------------------------------- typical vLLM lines, end to end

MODEL = "Qwen/Qwen3-0.6B"
CHAT_URL, COMPLETIONS_URL = "/v1/chat/completions", "/v1/completions"


def vllm_line(cid: str, url: str = CHAT_URL, content: str = "Classify: great movie", **body) -> dict:
    field = {"messages": [{"role": "user", "content": content}]} if url == CHAT_URL else {"prompt": content}
    return {"custom_id": cid, "method": "POST", "url": url, "body": {"model": MODEL, **field, **body}}


TYPICAL = [
    vllm_line("basic", max_tokens=8, temperature=0.7, top_p=0.9),
    vllm_line("no-temperature", max_tokens=8, seed=1),  # vLLM's defaults: the model's generation config, else 1.0
    vllm_line("stop-token-ids", max_tokens=8, temperature=0, stop_token_ids=[0, 2]),
    vllm_line("min-p", max_tokens=8, temperature=1.0, min_p=0.1, seed=3),
    vllm_line("repetition", max_tokens=8, temperature=0, repetition_penalty=1.1),
    vllm_line("penalties", max_tokens=8, temperature=0, presence_penalty=0.5, frequency_penalty=0.5),
    vllm_line("logit-bias", max_tokens=8, temperature=0, logit_bias={"5": -100, "6": 10}),
    vllm_line("min-tokens", max_tokens=10, min_tokens=5, temperature=0),
    {"custom_id": "parts", "method": "POST", "url": CHAT_URL,
     "body": {"model": MODEL, "max_tokens": 8, "temperature": 0,
              "messages": [{"role": "user", "content": [{"type": "text", "text": "Classify:"},
                                                        {"type": "text", "text": "great movie"}]}]}},
    vllm_line("thinking-off", max_tokens=8, chat_template_kwargs={"enable_thinking": False}, temperature=0),
    {"custom_id": "system-n1", "method": "POST", "url": CHAT_URL,
     "body": {"model": MODEL, "n": 1, "stream": False, "user": "u-1", "max_completion_tokens": 6,
              "messages": [{"role": "system", "content": "You label reviews."},
                           {"role": "user", "content": "great movie"}]}},
    vllm_line("completion-stop", url=COMPLETIONS_URL, content="Review: great movie\nLabel:", max_tokens=8,
              temperature=0, stop=["\n"]),
    vllm_line("completion-seed", url=COMPLETIONS_URL, content="Once upon a time", max_tokens=8, temperature=0.8,
              top_k=40, seed=42),
    vllm_line("top-k-off", max_completion_tokens=6, top_k=-1, logprobs=False, temperature=0.5, seed=5),
    {"custom_id": "multi-turn", "method": "POST", "url": CHAT_URL,
     "body": {"model": MODEL, "max_tokens": 6, "stop": ["\n\n", "###"],
              "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                           {"role": "user", "content": "label: great movie"}]}},
    vllm_line("everything", url=COMPLETIONS_URL, content="the quick brown fox", max_tokens=9, min_tokens=3,
              temperature=0.9, top_p=0.95, min_p=0.02, repetition_penalty=1.05, presence_penalty=0.3,
              frequency_penalty=0.2, logit_bias={"11": 2}, stop_token_ids=[1], seed=9),
]


def test_typical_vllm_lines_run_with_no_error_row(tmp_path, tiny_dir):
    assert len(TYPICAL) == 16
    # structured output (tests/test_structured_io.py has more): answered, the text a JSON object's start at least
    structured = vllm_line("json", max_tokens=8, temperature=0, response_format={"type": "json_object"})
    src = write_jsonl(tmp_path / "in" / "batch.jsonl", TYPICAL + [structured])
    job, out = make_job(tmp_path, tiny_dir, [src], output={"format": "openai"}, target={"served_model_name": MODEL})
    run_ok(job)
    rows = {r["id"]: r for r in read_rows(out)}
    assert rows.pop("json")["text"].startswith("{")
    assert {k: r["error"] for k, r in rows.items() if r["status"] != "ok"} == {}
    assert len(rows) == 16
    lines = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    bodies = [x["response"]["body"] for x in lines if x["custom_id"] != "json"]
    assert {b["model"] for b in bodies} == {MODEL}  # the model that answered
    assert 5 <= rows["min-tokens"]["completion_tokens"] <= 10
