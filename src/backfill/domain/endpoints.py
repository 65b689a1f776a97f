"""The endpoints a batch line may target, and which a model serves in batch (SPEC §5.1)."""

from __future__ import annotations

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
EMBEDDINGS_URL = "/v1/embeddings"
RESPONSES_URL = "/v1/responses"
ENDPOINTS = frozenset({CHAT_URL, COMPLETIONS_URL, EMBEDDINGS_URL, RESPONSES_URL})

# What a model serves when its catalog entry does not say: the text generation endpoints every
# OpenAI-compatible server has. Embeddings and Responses are published per model.
DEFAULT_MODEL_ENDPOINTS = frozenset({CHAT_URL, COMPLETIONS_URL})

# Content a model can publish for batch (``batch.modalities``): text always; image and audio
# parts of chat messages only where listed.
MODALITIES = frozenset({"text", "image", "audio"})


def generates(endpoint: str) -> bool:
    """Whether requests to ``endpoint`` produce output tokens (embeddings do not)."""
    return endpoint != EMBEDDINGS_URL
