"""Apply and check the schema's alembic migrations."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine

import migrations
from controlplane.errors import SchemaNotMigrated

MIGRATIONS_DIR = Path(migrations.__file__).parent


def alembic_config(url: str) -> Config:
    """An alembic configuration for ``url`` that needs no ini file."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config


def head_revision() -> str:
    """The newest revision this build knows."""
    head = ScriptDirectory.from_config(alembic_config("")).get_current_head()
    assert head is not None
    return head


def upgrade(engine: Engine) -> str:
    """Migrate the database to the newest revision; return it."""
    config = alembic_config(engine.url.render_as_string(hide_password=False))
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        command.upgrade(config, "head")
    return head_revision()


def current_revision(engine: Engine) -> str | None:
    """The database's revision, None when it was never migrated."""
    with engine.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()


def check_schema(engine: Engine) -> None:
    """Raise ``SchemaNotMigrated`` unless the database is at the newest revision."""
    current = current_revision(engine)
    head = head_revision()
    if current != head:
        found = "no schema" if current is None else f"revision {current}"
        raise SchemaNotMigrated(
            f"the database has {found}, this build needs revision {head}: "
            "run `elasticctl migrate` first"
        )
