"""Output rows as OpenAI batch response lines, the lines the OpenAI Batch API and `vllm run-batch` write.

One JSON object a line::

    {"id": "batch_req_<key>", "custom_id": <the row id>,
     "response": {"status_code": 200, "request_id": "req_<key>", "body": <a chat.completion or
                  text_completion object>},
     "error": null}

The body is a ``chat.completion`` (``choices[0].message``) for a row whose endpoint is "chat"
and a ``text_completion`` (``choices[0].text``) otherwise, with ``usage`` from the row's token
counts. A request decoded as n samples (rows with ``index`` 0 .. n - 1, one after another) answers
in one line with n choices, as OpenAI's ``n`` does: ``usage`` counts the prompt once and the
completion tokens of every choice. An error row answers as vLLM's batch runner does: ``status_code`` 400, no body, and
``error`` ``{"code": "invalid_request_error", "message": <the row's error>}``.

``<key>`` is derived from the row's source and creation time, so exporting the same rows twice
gives the same bytes. A row from a part written before the endpoint, model and created columns
existed answers as a text completion, by ``default_model``, created at 0.

A row with token logprobs (the ``logprobs`` column) answers with ``choices[0].logprobs`` in its
endpoint's shape: chat's ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}],
"refusal": null}``, completions' ``{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}],
"text_offset"}``. As in vLLM: a token's text is the token decoded alone, its bytes that text's UTF-8,
a log-probability of -inf is written -9999.0 (JSON has no infinity), and ``text_offset`` counts
characters from the start of the completion. A row with prompt logprobs also carries vLLM's
``prompt_logprobs`` in its body: per prompt token null (the first) or ``{token id: {"logprob", "rank",
"decoded_token"}}`` for the token and its top ones.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping
from typing import Any

import pyarrow as pa

ERROR_CODE = "invalid_request_error"


def _key(row: Mapping[str, Any]) -> str:
    return hashlib.sha256(f"{row['source']}\0{row.get('created')}".encode()).hexdigest()[:24]


_FLOOR = -9999.0  # vLLM's stand-in for a log-probability of -inf


def _lp(value: float) -> float:
    return max(value, _FLOOR)


def _chat_logprobs(entries: list[Mapping[str, Any]]) -> dict[str, Any]:
    def one(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": _lp(logprob), "bytes": list(token.encode("utf-8", errors="replace"))}

    return {"content": [{**one(e["token"], e["logprob"]),
                         "top_logprobs": [one(t, v) for t, v in zip(e["top_tokens"], e["top_logprobs"])]}
                        for e in entries], "refusal": None}


def _completion_logprobs(entries: list[Mapping[str, Any]]) -> dict[str, Any]:
    offsets, at = [], 0
    for e in entries:
        offsets.append(at)
        at += len(e["token"])
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [_lp(e["logprob"]) for e in entries],
            "top_logprobs": [{t: _lp(v) for t, v in zip(e["top_tokens"], e["top_logprobs"])} for e in entries],
            "text_offset": offsets}


def _prompt_logprobs(entries: list[Mapping[str, Any] | None]) -> list[dict[str, Any] | None]:
    """vLLM's prompt_logprobs: per prompt token, its entry and its top ones by token id."""
    out: list[dict[str, Any] | None] = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        top = {str(i): {"logprob": _lp(v), "rank": r, "decoded_token": t}
               for r, (i, t, v) in enumerate(zip(e["top_ids"], e["top_tokens"], e["top_logprobs"]), 1)}
        out.append({str(e["token_id"]): {"logprob": _lp(e["logprob"]), "rank": e["rank"], "decoded_token": e["token"]},
                    **{i: v for i, v in top.items() if i != str(e["token_id"])}})
    return out


def _choice(row: Mapping[str, Any], chat: bool) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": row.get("index") or 0, "finish_reason": row["finish_reason"], "logprobs": None}
    if row.get("logprobs") is not None:
        choice["logprobs"] = (_chat_logprobs if chat else _completion_logprobs)(row["logprobs"])
    if chat:
        choice["message"] = {"role": "assistant", "content": row["text"]}
    else:
        choice["text"] = row["text"]
    return choice


def _body(row: Mapping[str, Any], key: str, default_model: str, samples: list[Mapping[str, Any]] = ()) -> dict:
    chat = row.get("endpoint") == "chat"
    completion = row["completion_tokens"] + sum(s["completion_tokens"] for s in samples)
    body = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{key}",
        "object": "chat.completion" if chat else "text_completion",
        "created": row.get("created") or 0,
        "model": row.get("model") or default_model,
        "choices": [_choice(r, chat) for r in (row, *samples)],
        "usage": {"prompt_tokens": row["prompt_tokens"], "completion_tokens": completion,
                  "total_tokens": row["prompt_tokens"] + completion},
    }
    if row.get("prompt_logprobs") is not None:
        body["prompt_logprobs"] = _prompt_logprobs(row["prompt_logprobs"])
    return body


def response_line(row: Mapping[str, Any], default_model: str, samples: list[Mapping[str, Any]] = ()) -> dict[str, Any]:
    """One output row (OUTPUT_SCHEMA's columns) as an OpenAI batch response line; `samples`: the rows of the
    request's samples 1 .. n - 1, in order, where it has more than one."""
    key = _key(row)
    if row["status"] == "error":
        return {"id": f"batch_req_{key}", "custom_id": row["id"],
                "response": {"status_code": 400, "request_id": f"req_{key}", "body": None},
                "error": {"code": ERROR_CODE, "message": row["error"]}}
    return {"id": f"batch_req_{key}", "custom_id": row["id"],
            "response": {"status_code": 200, "request_id": f"req_{key}", "body": _body(row, key, default_model, samples)},
            "error": None}


def response_lines(table: pa.Table, default_model: str) -> Iterator[str]:
    """Each request of ``table``, in order, as one JSON line (without the newline): a row, with the rows of
    its later samples (index > 0, same source) that follow it."""
    group: list[dict] = []
    for batch in table.to_batches(max_chunksize=4096):
        for row in batch.to_pylist():
            if group and (row.get("index") or 0) > 0 and row["source"] == group[0]["source"]:
                group.append(row)
                continue
            if group:
                yield json.dumps(response_line(group[0], default_model, group[1:]), ensure_ascii=False)
            group = [row]
    if group:
        yield json.dumps(response_line(group[0], default_model, group[1:]), ensure_ascii=False)
