"""Connecting to NATS as a node or the control plane: what both sides share of nats-py.

``auth_options`` turns the credentials a process is given (an NKey seed file from
``elasticctl creds``, a JWT ``.creds`` file, or a user and password) into nats-py's connect
options. The control plane's own adapter (its stream, the ingest's consumer) is
``controlplane/bus.py``.
"""

from __future__ import annotations

from typing import Any

from schemas.creds import nkey_connect_options


def auth_options(creds: str | None, user: str | None, password: str | None) -> dict[str, Any]:
    """nats-py connect options for a credentials file, else a user and password.

    ``creds`` is an NKey seed file issued by ``elasticctl creds`` (schemas/creds.py: the
    seed, and the inbox prefix that identity alone may receive on) or a JWT ``.creds`` file.
    """
    if creds:
        return nkey_connect_options(creds) or {"user_credentials": creds}
    if user:
        return {"user": user, "password": password or ""}
    return {}
