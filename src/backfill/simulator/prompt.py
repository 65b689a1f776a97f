"""A request's prompt as the simulated engine counts it: text, tokens and media received.

Prompt tokens are the whitespace-separated words of the text, with each image or audio clip
adding its placeholder tokens where it stands (``media``). A chat whose messages are all
strings, or a completion, takes the plain path: one join and one split, as the throughput
benchmarks measure it; content part lists take the slower path that validates each part.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from backfill.simulator import media
from backfill.simulator.fields import BadRequest


@dataclass(slots=True)
class Prompt:
    text: str
    """Every text part joined by newlines: where fault directives are looked for."""
    tokens: list[str]
    """Words and media placeholders, in order: what is counted and hashed into blocks."""
    received: dict[str, Any]
    """The ``backfill_simulator.received`` report of its media."""

    @property
    def count(self) -> int:
        return max(1, len(self.tokens))


def plain(text: str) -> Prompt:
    return Prompt(text, text.split(), media.NOTHING_RECEIVED)


def of_body(body: dict[str, Any]) -> Prompt:
    """The prompt of a chat (it has ``messages``) or completion request body."""
    if "messages" not in body:
        prompt = body.get("prompt")
        return plain(prompt if isinstance(prompt, str) else str(prompt))
    messages = body.get("messages") or []
    if not isinstance(messages, list):
        raise BadRequest("messages", "messages must be a list")
    texts: list[str] = []
    for message in messages:
        if not isinstance(message, dict):
            return _chat_parts(messages)
        content = message.get("content")
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):
            return _chat_parts(messages)
    return plain("\n".join(texts))


class PromptBuilder:
    """Collects text and media in order, refusing what the engine would refuse."""

    def __init__(self) -> None:
        self._texts: list[str] = []
        self._tokens: list[str] = []
        self._media = media.Received()

    def text(self, value: object, param: str) -> None:
        if not isinstance(value, str):
            raise BadRequest(param, "text must be a string")
        self._texts.append(value)
        self._tokens.extend(value.split())

    def image(self, url: object, param: str) -> None:
        self._tokens.extend(media.image(url, param, self._media))

    def audio(self, part: object, param: str) -> None:
        if not isinstance(part, dict):
            raise BadRequest(param, "input_audio must be an object with data and format")
        self._tokens.extend(media.audio(part.get("data"), part.get("format"), param, self._media))

    def build(self) -> Prompt:
        return Prompt("\n".join(self._texts), self._tokens, self._media.report())


def _chat_parts(messages: list[Any]) -> Prompt:
    prompt = PromptBuilder()
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise BadRequest(f"messages[{i}]", "a message must be an object")
        content = message.get("content")
        if content is None or isinstance(content, str):
            prompt.text(content or "", f"messages[{i}].content")
            continue
        if not isinstance(content, list):
            raise BadRequest(f"messages[{i}].content", "content must be a string or a list")
        for j, part in enumerate(content):
            _chat_part(prompt, part, f"messages[{i}].content[{j}]")
    return prompt.build()


def _chat_part(prompt: PromptBuilder, part: object, param: str) -> None:
    if not isinstance(part, dict):
        raise BadRequest(param, "a content part must be an object")
    kind = part.get("type")
    if kind == "text":
        prompt.text(part.get("text"), f"{param}.text")
    elif kind == "image_url":
        image_url = part.get("image_url")
        if not isinstance(image_url, dict):
            raise BadRequest(f"{param}.image_url", "image_url must be an object with a url")
        media.detail(image_url.get("detail"), f"{param}.image_url.detail")
        prompt.image(image_url.get("url"), f"{param}.image_url.url")
    elif kind == "input_audio":
        prompt.audio(part.get("input_audio"), f"{param}.input_audio")
    else:
        raise BadRequest(f"{param}.type", f"unsupported content part type {kind!r}")
