"""The engine's request-level errors, which the server maps to HTTP statuses."""

from __future__ import annotations


class RequestError(ValueError):
    """A request the engine refuses (HTTP 400): too long, bad token ids, duplicate id..."""


class EngineOverloaded(RuntimeError):
    """Too many requests are queued; the server answers 503."""
