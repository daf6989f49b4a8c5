"""Write the JSON Schema of every wire model to a directory."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import TypeAdapter

from schemas.commands import Command
from schemas.events import Event


def json_schemas() -> dict[str, dict[str, object]]:
    """Return file name -> JSON Schema for the event union and the command union."""
    return {
        "event.schema.json": TypeAdapter(Event).json_schema(by_alias=True),
        "command.schema.json": TypeAdapter(Command).json_schema(by_alias=True),
    }


def export_json_schemas(directory: Path) -> list[Path]:
    """Write every schema into ``directory`` (created if missing); return the paths."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, schema in json_schemas().items():
        path = directory / name
        path.write_text(json.dumps(schema, indent=2, sort_keys=True) + "\n")
        written.append(path)
    return written
