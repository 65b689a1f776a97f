"""An in-memory ``Engine`` for unit tests; the engine contract tests also run it."""

from __future__ import annotations

from typing import Any

import msgspec
import orjson

from backfill.ports import EngineReply


class FakeEngine:
    def __init__(self, name: str = "fake", models: tuple[str, ...] = ("fake-model",)) -> None:
        self.name = name
        self.max_concurrency = 8
        self._models = models
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.replies: list[EngineReply] = []

    @property
    def models(self) -> tuple[str, ...]:
        return tuple(self._models)

    def serves(self, model: str) -> bool:
        return model in self._models

    async def send(self, path: str, model: str, body: dict[str, Any]) -> EngineReply:
        # What an HTTP engine would parse: raw field values (msgspec.Raw) become plain JSON.
        body = msgspec.json.decode(msgspec.json.encode(body))
        self.calls.append((path, body))
        if self.replies:
            return self.replies.pop(0)
        tokens = int(body.get("max_completion_tokens") or body.get("max_tokens") or 1)
        payload = {
            "id": "chatcmpl-fake",
            "object": "chat.completion",
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "ok"},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 1, "completion_tokens": min(tokens, 1), "total_tokens": 2},
        }
        return EngineReply(status=200, body=orjson.dumps(payload))

    async def healthy(self) -> bool:
        return True

    async def close(self) -> None:
        return None
