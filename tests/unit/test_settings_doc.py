"""docs/settings.md is generated from the code, and says something about every variable."""

from __future__ import annotations

import difflib
from pathlib import Path

from typer.testing import CliRunner

from controlplane.cli import app
from controlplane.settings import (
    ENV_PREFIX,
    REGENERATE,
    Settings,
    env_variables,
    settings_markdown,
)
from rank_runtime import checkpoint, faults, identity, replication
from schemas import auth, creds

DOC = Path(__file__).resolve().parents[2] / "docs" / "settings.md"


def test_docs_settings_is_the_generators_output():
    generated = settings_markdown()
    written = DOC.read_text(encoding="utf-8")
    diff = "".join(
        difflib.unified_diff(
            written.splitlines(keepends=True),
            generated.splitlines(keepends=True),
            "docs/settings.md",
            "generated",
            n=1,
        )
    )
    assert written == generated, f"docs/settings.md is out of date; run `{REGENERATE}`:\n{diff}"


def test_every_setting_has_a_description_and_a_row():
    bare = [name for name, field in Settings.model_fields.items() if not field.description]
    assert not bare, f"Settings fields without a description: {bare}"
    doc = settings_markdown()
    missing = [
        name for name in Settings.model_fields if f"| `{ENV_PREFIX}{name.upper()}` |" not in doc
    ]
    assert not missing, missing


def test_the_training_side_variables_are_found_from_their_constants():
    expected = {
        value
        for module in (identity, checkpoint, faults, replication, auth, creds)
        for key, value in vars(module).items()
        if key.endswith("_ENV") and isinstance(value, str) and value.startswith(ENV_PREFIX)
    }
    found = env_variables()
    assert expected <= {v.name for v in found}
    assert {"ELASTIC_JOB_ID", "ELASTIC_ROLE", "ELASTIC_POLICY", "ELASTIC_JOB_SECRET"} <= expected
    bare = [f"{v.module}.{v.constant}" for v in found if not v.description]
    assert not bare, f"add a `#:` comment above {bare} (it is the variable's description)"
    doc = settings_markdown()
    assert all(f"| `{name}` |" in doc for name in expected)


def test_a_constant_without_a_comment_shares_the_one_above(tmp_path, monkeypatch):
    package = tmp_path / "fakepkg_settings_doc"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "mod.py").write_text(
        "#: Both halves of the pair.\n"
        'A_ENV = "ELASTIC_A"\n'
        'B_ENV = "ELASTIC_B"\n'
        "\n"
        'C_ENV = "ELASTIC_C"\n'
        'NOT_ONE = "ELASTIC_D"\n'
        'OTHER_ENV = "HOME"\n'
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    found = {v.name: v.description for v in env_variables(("fakepkg_settings_doc",))}
    assert found == {
        "ELASTIC_A": "Both halves of the pair.",
        "ELASTIC_B": "Both halves of the pair.",
        "ELASTIC_C": "",
    }


def test_cli_prints_the_reference_and_the_values_in_force():
    runner = CliRunner()
    reference = runner.invoke(app, ["settings", "--markdown"])
    assert reference.exit_code == 0, reference.output
    assert reference.output == settings_markdown()

    secret = "ab" * 32
    values = runner.invoke(
        app,
        ["settings"],
        env={
            "ELASTIC_API_PORT": "9001",
            "ELASTIC_SECRET": secret,
            "ELASTIC_NATS_PASSWORD": "hunter2",
            "ELASTIC_RENDEZVOUS": "false",
        },
    )
    assert values.exit_code == 0, values.output
    lines = values.output.splitlines()
    assert "ELASTIC_API_PORT=9001" in lines
    assert "ELASTIC_RENDEZVOUS=false" in lines
    assert "# ELASTIC_SECRET set (hidden)" in lines
    assert "# ELASTIC_NATS_PASSWORD set (hidden)" in lines
    assert secret not in values.output and "hunter2" not in values.output
    assert len(lines) == len(Settings.model_fields)

    bad = runner.invoke(app, ["settings"], env={"ELASTIC_API_PORT": "seventy"})
    assert bad.exit_code == 2
    assert "api_port" in bad.output
