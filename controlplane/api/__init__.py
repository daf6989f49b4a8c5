"""The read-only REST API (``elasticctl api``): job history, incident timelines, events."""

from __future__ import annotations

from controlplane.api.app import create_app

__all__ = ["create_app"]
