"""The error hierarchy services raise; only the HTTP adapter turns these into envelopes.

Each error says whether a client should retry it by itself (``retryable``, sent as
``x-should-retry``) and, when known, after how long (``retry_after_s``, sent as
``Retry-After``). The table of decisions is in docs/api.md, "When to retry".
"""

from __future__ import annotations

# The longest wait after which a refusal still tells clients to retry by themselves. The
# openai SDKs obey ``x-should-retry`` first and retry twice by default, sleeping whatever
# Retry-After says (the Node SDK without a bound, the Python SDK up to two minutes): a longer
# wait would hold a default call for minutes, so past this the refusal fails fast and its
# Retry-After is only an estimate for callers who schedule their own retry.
AUTO_RETRY_MAX_S = 10


class BackfillError(Exception):
    """Root of every error Backfill raises on purpose."""

    status = 500
    code = "server_error"
    type = "server_error"
    retryable = True
    retry_after_s: int | None = None

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        line: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        self.param = param
        self.line = line


class InvalidInput(BackfillError):
    status = 400
    code = "invalid_request_error"
    type = "invalid_request_error"
    retryable = False


class Unauthorized(BackfillError):
    status = 401
    code = "invalid_api_key"
    type = "invalid_request_error"
    retryable = False


class Forbidden(BackfillError):
    status = 403
    code = "insufficient_scope"
    type = "invalid_request_error"
    retryable = False


class NotFound(BackfillError):
    status = 404
    code = "not_found"
    type = "invalid_request_error"
    retryable = False


class Conflict(BackfillError):
    status = 409
    code = "conflict"
    type = "invalid_request_error"
    retryable = False


class Gone(BackfillError):
    """What was asked for existed and was removed for good (retention, a deletion)."""

    status = 410
    code = "gone"
    type = "invalid_request_error"
    retryable = False


class PayloadTooLarge(BackfillError):
    status = 413
    code = "file_too_large"
    type = "invalid_request_error"
    retryable = False


class StorageError(BackfillError):
    status = 503
    code = "storage_unavailable"
    type = "server_error"
    retryable = True
    # A passing fault (a lost connection, a busy database) is usually over within a second.
    retry_after_s: int | None = 1


class ContentUnreadable(StorageError):
    """Stored content is missing, damaged or sealed under another master key: a retry cannot
    help, so callers turn it into a final error instead of trying again."""

    status = 500
    code = "content_unreadable"
    retryable = False
    retry_after_s = None


class PaymentRequired(BackfillError):
    status = 402
    code = "insufficient_credit"
    type = "insufficient_credit"
    retryable = False


class SpendCapReached(PaymentRequired):
    """A batch refused by a spend cap (domain/spend_caps.py). ``retry_after_s``: until the
    cap's window resets, when the batch fits an empty window (None: it never does, or the cap
    is all-time)."""

    code = "spend_cap_reached"
    type = "spend_cap_reached"

    def __init__(self, message: str, *, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.retryable = retry_after_s is not None and retry_after_s <= AUTO_RETRY_MAX_S


class RateLimited(BackfillError):
    """Admission refused. ``retry_after_s``: an honest estimate of when waiting helps, or None
    when none can be given (what frees room may take hours: a batch ending, a deletion). Only
    a wait of at most ``AUTO_RETRY_MAX_S`` is left to clients' automatic retries."""

    status = 429
    code = "rate_limit_exceeded"
    type = "rate_limit_error"
    retryable = False

    def __init__(self, message: str, *, code: str, retry_after_s: int | None = None) -> None:
        super().__init__(message, code=code)
        self.retry_after_s = retry_after_s
        self.retryable = retry_after_s is not None and retry_after_s <= AUTO_RETRY_MAX_S


def retained_input_limit(retained: int, adding: int, limit: int) -> RateLimited:
    """The 429 for an org whose input files would keep more than ``limit`` bytes; here
    because uploads (a service) and admission (the database adapter) both refuse with it."""
    adds = f" and this file adds {adding}" if adding else ""
    return RateLimited(
        f"This organization keeps {retained} bytes of input files{adds}; the limit is {limit} "
        "bytes. Delete input files you no longer need (DELETE /v1/files/{id}) and retry.",
        code="retained_input_limit",
    )
