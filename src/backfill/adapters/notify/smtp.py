"""Plain, content-free notification emails over SMTP."""

from __future__ import annotations

from dataclasses import dataclass
from email.message import EmailMessage
from typing import Literal

import aiosmtplib

from backfill.ports import DeliveryFailed

Security = Literal["starttls", "tls", "none"]


@dataclass(frozen=True, slots=True)
class SmtpSettings:
    host: str
    port: int
    sender: str
    security: Security = "starttls"
    username: str | None = None
    password: str | None = None
    timeout_s: float = 30.0


class SmtpMailer:
    """The ``Mailer``: one connection per message (notifications are rare, and a long-lived
    connection would only time out between them)."""

    def __init__(self, settings: SmtpSettings) -> None:
        self._settings = settings

    async def send(self, to: str, subject: str, text: str) -> None:
        s = self._settings
        message = EmailMessage()
        message["From"] = s.sender
        message["To"] = to
        message["Subject"] = subject
        message.set_content(text)
        try:
            await aiosmtplib.send(
                message,
                # The one envelope recipient, never what a parse of the To header makes of it:
                # an address stored before addresses were checked may read as a list there.
                recipients=[to],
                hostname=s.host,
                port=s.port,
                username=s.username,
                password=s.password,
                use_tls=s.security == "tls",
                # Explicitly on or off: left to the library it would upgrade when offered and
                # go on in the clear when not, which a "starttls" setting must not allow.
                start_tls=s.security == "starttls",
                timeout=s.timeout_s,
            )
        except aiosmtplib.SMTPResponseException as exc:
            raise DeliveryFailed(
                f"the mail server {s.host}:{s.port} answered {exc.code}", status_code=exc.code
            ) from None
        except (aiosmtplib.SMTPException, OSError) as exc:
            reason = type(exc).__name__
            raise DeliveryFailed(
                f"the mail server {s.host}:{s.port} could not be reached ({reason})"
            ) from None
