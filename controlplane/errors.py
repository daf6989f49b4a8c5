"""Errors of the control plane's adapters; driver errors are translated into these at the edge."""

from __future__ import annotations


class ControlPlaneError(Exception):
    """Base of every error the control plane raises on purpose."""


class ConfigurationError(ControlPlaneError):
    """A setting is missing or malformed."""


class StoreError(ControlPlaneError):
    """The event store failed."""


class StoreUnavailable(StoreError):
    """The event store cannot be reached right now; retrying may succeed."""


class StoreRefused(StoreError):
    """The store refused the input itself (a data, integrity or limit error: SQLSTATE classes
    22, 23, 54, ...): the same input fails again, so it is isolated and dead-lettered, never
    waited for like an unavailable database."""


class SchemaNotMigrated(StoreError):
    """The database lacks the project's tables or is at an older revision."""


class ConcurrencyError(StoreError):
    """The log moved past the position a writer expected."""

    def __init__(self, message: str, *, log_head: int | None = None) -> None:
        super().__init__(message)
        #: The log's head when the writer expected another one (``JobHead.log``), else None.
        self.log_head = log_head


class BusError(ControlPlaneError):
    """The message bus failed."""


class BusUnavailable(BusError):
    """The message bus cannot be reached right now; retrying may succeed."""
