"""An OpenAI batch request line -> a :class:`Request`.

An OpenAI batch file (what ``vllm run-batch -i`` and the OpenAI Batch API take) has one request
a line, ``{"custom_id", "method": "POST", "url", "body"}``. The custom_id is the row's id, kept as
given (a string; any other JSON value as its JSON text, so 7 is "7"); the url picks the endpoint (``/v1/chat/completions`` reads body.messages,
``/v1/completions`` body.prompt, one string); the body's sampling fields become the row's
RowParams (io/params.py). A problem with any of them, named by its field, makes the line an
error row. Kept columns (a named list only) are top-level fields of the line: the body is the
request and is never kept. The response lines written for these rows are io/openai_batch.py's.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ..records import Request
from .identity import digest
from .params import ParamError, body_params
from .rows import BadRow, Row, Spec, kept_columns, parse_messages, type_name, unicode_text

__all__ = ["openai_row"]


# OpenAI batch lines: url -> (Request.endpoint, the body field holding the prompt)
_OPENAI_URLS = {"/v1/chat/completions": ("chat", "messages"), "/v1/completions": ("completion", "prompt")}


def _openai_id(value: Any) -> str:
    """custom_id, kept as given: a string as it is, any other JSON value (OpenAI's type is a string; a
    number is common) as its compact JSON text, so 7 is "7". Missing, null or empty is an error."""
    if value is None:
        raise BadRow("missing custom_id", "missing custom_id")
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    if not text.strip():
        raise BadRow("bad custom_id", "empty custom_id")
    return unicode_text(text, "custom_id")


def _openai_endpoint(line: Mapping[str, Any]) -> tuple[str, str]:
    """The line's (endpoint, body field with the prompt) from its method and url."""
    method, url = line.get("method"), line.get("url")
    if method != "POST":
        raise BadRow("bad method", 'missing method (it must be "POST")' if method is None else
                     f'method must be "POST", got {json.dumps(method)}')
    if url not in _OPENAI_URLS:
        served = " and ".join(_OPENAI_URLS)
        raise BadRow("bad url", f"missing url ({served} are served)" if url is None else
                     f"url {json.dumps(url)} is not supported; spin-batch serves {served}")
    return _OPENAI_URLS[url]


def _openai_prompt(value: Any) -> str:
    """A /v1/completions body's prompt: one string (not a list of prompts or token ids)."""
    if value is None:
        raise BadRow("missing prompt", "body.prompt is missing; /v1/completions needs it")
    if isinstance(value, (list, tuple)):
        raise BadRow("bad prompt type", "body.prompt must be one string; a list of prompts or of token ids is "
                                        "not supported")
    if not isinstance(value, str):
        raise BadRow("bad prompt type", f"body.prompt must be a string, got {type_name(value)}")
    if not value.strip():
        raise BadRow("empty prompt", "body.prompt is empty")
    return unicode_text(value, "body.prompt")


def openai_row(source: str, line: Mapping[str, Any], spec: Spec) -> Row:
    """Turn one OpenAI batch line into a Request; problems (named by field) become an error request."""
    row_id = endpoint = model = keep = None
    text_digest = digest({"method": line.get("method"), "url": line.get("url"), "body": line.get("body")})
    try:
        row_id = _openai_id(line.get("custom_id"))
        keep = kept_columns(line, spec) if isinstance(spec.keep, tuple) else None  # the body is the request
        endpoint, content = _openai_endpoint(line)
        body = line.get("body")
        if not isinstance(body, Mapping):
            raise BadRow("bad body", "missing body" if body is None else
                         f"body must be an object, got {type_name(body)}")
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise BadRow("bad body", f"body.model must be a string, got {type_name(model)}")
        params = body_params(body, content)
        if endpoint == "chat":
            if body.get("messages") is None:
                raise BadRow("bad messages", "body.messages is missing; /v1/chat/completions needs it")
            prompt, messages = None, parse_messages(body["messages"], "body.messages")
        else:
            prompt, messages = _openai_prompt(body.get("prompt")), None
        return Row(Request(source, row_id, prompt, messages, params=params, endpoint=endpoint, model=model,
                           keep=keep, digest=text_digest))
    except (ParamError, BadRow) as bad:
        return Row(Request(source, row_id, None, None, bad.message, endpoint=endpoint, model=model, keep=keep,
                           digest=text_digest), bad.kind)
