"""The container image's HEALTHCHECK: ``python3 -m backfill.healthcheck`` asks the process in
the same container for /healthz, at the ports its settings give (the file BACKFILL_CONFIG names
and the BACKFILL_* variables, read as ``backfill serve`` reads them): the API's port, or a
worker's ``worker.http_port`` where a worker has one. Exit status 0 when healthy."""

from __future__ import annotations

import sys
import urllib.request

from backfill.settings import Settings


def main() -> int:
    settings = Settings()
    # The role is not in the settings: the API's port, then a worker's, whichever answers.
    ports = [settings.port]
    if settings.worker.http_port is not None:
        ports.append(settings.worker.http_port)
    problems = []
    for port in ports:
        url = f"http://127.0.0.1:{port}/healthz"
        try:
            with urllib.request.urlopen(url, timeout=2) as answer:
                if answer.status == 200:
                    return 0
                problems.append(f"{url}: {answer.status}")
        except OSError as exc:
            problems.append(f"{url}: {exc}")
    print("unhealthy: " + "; ".join(problems), file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
