"""The service's answer to a request it refuses: an HTTP status and a message for the client."""
from __future__ import annotations


class HttpError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def not_found(what: str) -> HttpError:
    """What another owner's object and a missing one both answer: they look the same."""
    return HttpError(404, f"{what} not found (it does not exist, has expired, or belongs to another owner)")
