"""``POST /v1/responses`` of the simulated engine: OpenAI's Responses API, as vLLM serves it.

It generates as a chat does (same timing, same ``tok tok …`` text, same prefix cache), its
prompt being the instructions followed by the input's messages; ``text.format`` shapes the
answer as ``response_format`` shapes a chat's (``structured``). Only whole answers are
given: ``stream`` and ``background`` are refused when true, and so is any field the
simulator does not know, since silently dropping, say, ``tools`` would answer a different
question. An answer cut short by ``max_output_tokens`` is ``incomplete``, as OpenAI marks it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from backfill.simulator import fields, media, replies, structured
from backfill.simulator.fields import BadRequest
from backfill.simulator.prompt import Prompt, PromptBuilder

FIELDS = (
    "model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "metadata",
    "store", "user", "stream", "background", "priority", "text",
)  # fmt: skip
ROLES = ("user", "system", "developer", "assistant")
MAX_METADATA_KEYS = 16


@dataclass(frozen=True)
class ResponsesAsk:
    model: str
    prompt: Prompt
    max_output_tokens: int | None
    priority: int
    echo: dict[str, Any]
    """The request's settings that the Response object repeats."""
    format: structured.Format | None = None
    """What ``text.format`` asks the answer to be; None: plain text."""


def parse(body: dict[str, Any]) -> ResponsesAsk:
    fields.only_known(body, FIELDS)
    model = fields.model(body)
    for name, why in (
        ("stream", "this engine does not stream responses"),
        ("background", "this engine does not run responses in the background"),
    ):
        value = body.get(name)
        if value is not None and not isinstance(value, bool):
            raise BadRequest(name, f"{name} must be true or false")
        if value:
            raise BadRequest(name, why)
    store = body.get("store")
    if store is not None and not isinstance(store, bool):
        raise BadRequest("store", "store must be true or false")
    limit = body.get("max_output_tokens")
    if limit is not None and (not fields.is_int(limit) or limit < 1):
        raise BadRequest("max_output_tokens", "max_output_tokens must be a positive integer")
    instructions = fields.optional_string(body, "instructions")
    prompt = PromptBuilder()
    if instructions is not None:
        prompt.text(instructions, "instructions")
    _input(prompt, body.get("input"))
    fmt, text = structured.of_responses(body)
    return ResponsesAsk(
        model=model,
        prompt=prompt.build(),
        max_output_tokens=limit,
        priority=fields.priority(body),
        echo={
            "instructions": instructions,
            "max_output_tokens": limit,
            "metadata": _metadata(body.get("metadata")),
            "temperature": _number(body, "temperature", 2.0),
            "top_p": _number(body, "top_p", 1.0),
            "user": fields.optional_string(body, "user"),
            "text": text,
        },
        format=fmt,
    )


def reply(
    ask: ResponsesAsk,
    *,
    number: int,
    created: int,
    tokens: int,
    cut_short: bool,
    cached_tokens: int,
    written_tokens: int,
    text: str | None = None,
) -> dict[str, Any]:
    """``text``: the answer's text when it is not the plain words (a structured output)."""
    status = "incomplete" if cut_short else "completed"
    input_tokens = ask.prompt.count
    return {
        "id": f"resp_sim{number}",
        "object": "response",
        "created_at": created,
        "status": status,
        "background": False,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if cut_short else None,
        "model": ask.model,
        "output": [
            {
                "type": "message",
                "id": f"msg_sim{number}",
                "status": status,
                "role": "assistant",
                "content": [
                    {
                        "type": "output_text",
                        "text": replies.answer_text(tokens) if text is None else text,
                        "annotations": [],
                    }
                ],
            }
        ],
        **ask.echo,
        "parallel_tool_calls": True,
        "previous_response_id": None,
        "reasoning": None,
        "service_tier": "auto",
        "tool_choice": "auto",
        "tools": [],
        "truncation": "disabled",
        "usage": {
            "input_tokens": input_tokens,
            "input_tokens_details": {
                "cached_tokens": cached_tokens,
                "cache_write_tokens": written_tokens,
            },
            "output_tokens": tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + tokens,
        },
        replies.REPORT_FIELD: replies.report(ask.prompt.received),
    }


def _number(body: dict[str, Any], name: str, most: float) -> float:
    value = body.get(name)
    if value is None:
        return 1.0  # what vLLM and OpenAI echo when it is not given
    if not fields.is_number(value) or not 0 <= value <= most:
        raise BadRequest(name, f"{name} must be a number from 0 to {most:g}")
    return float(value)


def _metadata(value: object) -> dict[str, str]:
    if value is None:
        return {}
    if (
        not isinstance(value, dict)
        or len(value) > MAX_METADATA_KEYS
        or not all(isinstance(v, str) for v in value.values())
    ):
        raise BadRequest(
            "metadata", f"metadata must be an object of at most {MAX_METADATA_KEYS} strings"
        )
    return value


def _input(prompt: PromptBuilder, value: object) -> None:
    if isinstance(value, str):
        prompt.text(value, "input")
        return
    if not isinstance(value, list) or not value:
        raise BadRequest("input", "input must be a string or a non-empty list of items")
    for i, item in enumerate(value):
        param = f"input[{i}]"
        if not isinstance(item, dict):
            raise BadRequest(param, "an input item must be an object")
        if item.get("type", "message") != "message":
            raise BadRequest(f"{param}.type", f"unsupported input item type {item['type']!r}")
        if item.get("role") not in ROLES:
            raise BadRequest(f"{param}.role", f"role must be one of {', '.join(ROLES)}")
        content = item.get("content")
        if isinstance(content, str):
            prompt.text(content, f"{param}.content")
        elif isinstance(content, list):
            for j, part in enumerate(content):
                _part(prompt, part, f"{param}.content[{j}]")
        else:
            raise BadRequest(f"{param}.content", "content must be a string or a list of parts")


def _part(prompt: PromptBuilder, part: object, param: str) -> None:
    if not isinstance(part, dict):
        raise BadRequest(param, "a content part must be an object")
    kind = part.get("type")
    if kind in ("input_text", "output_text"):
        prompt.text(part.get("text"), f"{param}.text")
    elif kind == "input_image":
        if part.get("file_id") is not None:
            raise BadRequest(f"{param}.file_id", "file_id is not supported: send a data: URL")
        media.detail(part.get("detail"), f"{param}.detail")
        prompt.image(part.get("image_url"), f"{param}.image_url")
    elif kind == "input_audio":
        prompt.audio(part.get("input_audio"), f"{param}.input_audio")
    else:
        raise BadRequest(f"{param}.type", f"unsupported content part type {kind!r}")
