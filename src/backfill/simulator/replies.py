"""What the simulated engine answers: OpenAI completions, whole or as server-sent events.

Every output token is the word ``tok``; the text of ``n`` tokens is ``n`` words joined by
spaces, whether it comes whole or streamed (the first chunk ``tok``, the others `` tok``).
Chunks follow OpenAI's ``chat.completion.chunk`` and streamed ``text_completion`` shapes: the
first chat delta carries the role with the first token, the last token's chunk carries the
finish reason (as vLLM sends it), ``stream_options.include_usage`` adds ``"usage": null`` to
every chunk and one last chunk with no choices and the usage, and ``data: [DONE]`` ends it.

Every answer also carries a field of its own, ``"backfill_simulator": {"received": …}``: the
media the engine got (``media``), so a test can check what reached it. A whole answer has
it at the top level, a stream in its first chunk.
"""

from __future__ import annotations

from typing import Any

import orjson

TOKEN = "tok"
DONE_EVENT = b"data: [DONE]\n\n"
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
REPORT_FIELD = "backfill_simulator"


def report(received: dict[str, Any]) -> dict[str, Any]:
    return {"received": received}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None) -> dict[str, Any]:
    """OpenAI usage; ``cached_tokens`` None leaves out ``prompt_tokens_details`` (no cache)."""
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def completion(
    *,
    chat: bool,
    number: int,
    created: int,
    model: Any,
    tokens: int,
    finish_reason: str,
    usage: dict[str, Any],
    received: dict[str, Any],
    content: str | None = None,
) -> dict[str, Any]:
    """``content``: the answer's text when it is not the plain words (a structured output)."""
    if content is None:
        content = answer_text(tokens)
    if chat:
        return {
            "id": f"chatcmpl-sim{number}",
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": content},
                    "finish_reason": finish_reason,
                }
            ],
            "usage": usage,
            REPORT_FIELD: report(received),
        }
    return {
        "id": f"cmpl-sim{number}",
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "text": content, "finish_reason": finish_reason}],
        "usage": usage,
        REPORT_FIELD: report(received),
    }


def answer_text(tokens: int) -> str:
    return " ".join([TOKEN] * tokens)


class ChunkWriter:
    """Server-sent events of one streamed answer."""

    def __init__(
        self,
        *,
        chat: bool,
        number: int,
        created: int,
        model: Any,
        include_usage: bool,
        received: dict[str, Any],
    ) -> None:
        self._chat = chat
        self._head: dict[str, Any] = {
            "id": f"chatcmpl-sim{number}" if chat else f"cmpl-sim{number}",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created,
            "model": model,
        }
        self._include_usage = include_usage
        self._report = report(received)

    def tokens(self, first: int, count: int, finish_reason: str | None) -> bytes:
        """Events for tokens ``first`` to ``first + count - 1``; the last one carries
        ``finish_reason`` when given. No token and a finish reason: one closing event."""
        events: list[bytes] = []
        for index in range(first, first + count):
            last = index == first + count - 1
            text = TOKEN if index == 0 else " " + TOKEN
            events.append(self._event(index == 0, text, finish_reason if last else None))
        if count == 0 and finish_reason is not None:
            events.append(self._event(first == 0, "" if first == 0 else None, finish_reason))
        return b"".join(events)

    def usage(self, usage: dict[str, Any]) -> bytes:
        return self._sse({**self._head, "choices": [], "usage": usage})

    def _event(self, first: bool, text: str | None, finish_reason: str | None) -> bytes:
        choice: dict[str, Any] = {"index": 0}
        if self._chat:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if text is not None:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        choice["logprobs"] = None
        choice["finish_reason"] = finish_reason
        payload: dict[str, Any] = {**self._head, "choices": [choice]}
        if self._include_usage:
            payload["usage"] = None
        if first:
            payload[REPORT_FIELD] = self._report
        return self._sse(payload)

    @staticmethod
    def _sse(payload: dict[str, Any]) -> bytes:
        return b"data: " + orjson.dumps(payload) + b"\n\n"
