"""The README documents every setting and every command a user can reach."""

from __future__ import annotations

from pathlib import Path

import typer.main

from controlplane.cli import app
from controlplane.settings import ENV_PREFIX, Settings
from rank_runtime import checkpoint, faults, identity

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def test_every_control_plane_setting_is_in_the_settings_table():
    missing = [
        f"{ENV_PREFIX}{name.upper()}"
        for name in Settings.model_fields
        if f"`{ENV_PREFIX}{name.upper()}`" not in README
    ]
    assert not missing, f"README's settings table lacks {missing}"


def test_every_variable_a_training_process_reads_is_documented():
    names = [
        value
        for module in (identity, checkpoint, faults)
        for key, value in vars(module).items()
        if key.endswith("_ENV") and isinstance(value, str)
    ]
    assert len(names) >= 12
    missing = [n for n in names if n not in README]
    assert not missing, f"README does not document {missing}"


def test_every_command_is_named():
    group = typer.main.get_group(app)
    commands = []
    for name, command in group.commands.items():
        subcommands = getattr(command, "commands", None)
        if subcommands:
            commands += [f"elasticctl {name} {sub}" for sub in subcommands]
        else:
            commands.append(f"elasticctl {name}")
    missing = [c for c in commands if c not in README]
    assert not missing, f"README never names {missing}"
