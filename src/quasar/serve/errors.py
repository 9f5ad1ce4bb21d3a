"""The refusal of a request: an HTTP status with an OpenAI error object."""

from __future__ import annotations

from typing import Any


class BadRequest(ValueError):
    """A request the server refuses: HTTP `status` with an OpenAI error object."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, kind: str = "invalid_request_error",
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.param, self.status, self.kind, self.code, self.headers = param, status, kind, code, headers


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
