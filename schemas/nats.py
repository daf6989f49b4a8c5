"""Connecting to NATS as a node or the control plane: what both sides share of nats-py.

``auth_options`` turns the credentials a process is given (an NKey seed file from
``elasticctl creds``, a JWT ``.creds`` file, or a user and password) into nats-py's connect
options; ``filtered_jetstream`` is the JetStream context a node credential can follow its
job's commands with. The control plane's own adapter (its stream, the ingest's consumer) is
``controlplane/bus.py``.
"""

from __future__ import annotations

import uuid
from typing import Any

from nats.aio.client import Client
from nats.js import JetStreamContext, JetStreamManager
from nats.js.api import ConsumerConfig, ConsumerInfo

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


class _NamedConsumers(JetStreamManager):
    """Creates every consumer under a fresh name, so nats-py uses the filtered create subject
    (``$JS.API.CONSUMER.CREATE.<stream>.<name>.<filter>``) that a node's permissions allow
    for its own job only; a fresh name on every call lets an ordered consumer be re-created
    (after a gap or a server restart) while the previous one still exists."""

    async def add_consumer(
        self,
        stream: str,
        config: ConsumerConfig | None = None,
        timeout: float | None = None,  # noqa: ASYNC109  (nats-py's signature)
        **params: Any,
    ) -> ConsumerInfo:
        config = (config or ConsumerConfig()).evolve(**params)
        config = config.evolve(name=f"elastic-{uuid.uuid4().hex}")
        info: ConsumerInfo = await super().add_consumer(stream, config, timeout)
        return info


class _FilteredJetStream(JetStreamContext):
    @property
    def _jsm(self) -> JetStreamManager:
        return _NamedConsumers(conn=self._nc, prefix=self._prefix, timeout=self._timeout)


def filtered_jetstream(nc: Client) -> JetStreamContext:
    """A JetStream context for following commands with ordered consumers under a node
    credential (``elasticctl creds``): each consumer is created named and filtered."""
    return _FilteredJetStream(nc)
