"""Alembic environment: runs migrations online against the configured database."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine, pool

from controlplane.settings import sqlalchemy_url
from controlplane.store.tables import metadata

config = context.config


def _url() -> str:
    configured = config.get_main_option("sqlalchemy.url")
    if configured:
        return configured
    from controlplane.settings import Settings

    return sqlalchemy_url(Settings().database_url)


def run_migrations_online() -> None:
    """Apply migrations over a fresh connection."""
    connectable = config.attributes.get("connection")
    if connectable is not None:
        context.configure(connection=connectable, target_metadata=metadata)
        with context.begin_transaction():
            context.run_migrations()
        return
    engine = create_engine(_url(), poolclass=pool.NullPool)
    with engine.connect() as connection:
        context.configure(connection=connection, target_metadata=metadata)
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    context.configure(url=_url(), target_metadata=metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()
else:
    run_migrations_online()
