"""A training process carries no server: the rank runtime and its launcher import nothing of the
control plane, and work where its packages (the ``server`` extra) are not installed.

Each check runs in a fresh interpreter, so what other tests imported does not count.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: What the ``server`` extra installs: none of it may reach a training process.
SERVER_PACKAGES = (
    "sqlalchemy",
    "psycopg",
    "psycopg_binary",
    "alembic",
    "fastapi",
    "starlette",
    "uvicorn",
    "httptools",
    "prometheus_client",
    "uvloop",
    "pydantic_settings",
)
#: The modules a training process and its launcher are made of (with any other found there).
RANK_RUNTIME = (
    "rank_runtime.elastic",
    "rank_runtime.launcher",
    "rank_runtime.launcher_cli",
    "rank_runtime.client",
    "rank_runtime.rendezvous",
    "rank_runtime.replication",
    "rank_runtime.snapshot",
    "rank_runtime.checkpoint",
    "rank_runtime.faults",
    "rank_runtime.data",
    "rank_runtime.zero",
    "rank_runtime.ddp",
    "rank_runtime.identity",
)


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, at its top or inside a function (lazily)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def launcher_entry_point() -> str:
    """The ``elastic-run`` script's target (``module:function``), from pyproject.toml."""
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    target: str = scripts["elastic-run"]
    assert not target.startswith("controlplane"), target
    return target


#: Imports every rank_runtime module, then names, per module, the server or control plane
#: modules that importing it loaded.
_IMPORT_ALL = """
import importlib, json, pkgutil, sys
import rank_runtime

server, explicit, entry = set(sys.argv[1].split(",")), sys.argv[2].split(","), sys.argv[3]
found = [m.name for m in pkgutil.walk_packages(rank_runtime.__path__, "rank_runtime.")]
names = list(dict.fromkeys([*explicit, *found, entry.partition(":")[0]]))

def offending():
    return {m for m in sys.modules
            if m.partition(".")[0] in server or m.partition(".")[0] == "controlplane"}

before = offending()
loaded = {}
for name in names:
    seen = offending()
    module = importlib.import_module(name)
    if name == entry.partition(":")[0]:
        assert callable(getattr(module, entry.partition(":")[2]))
    if offending() - seen:
        loaded[name] = sorted(offending() - seen)
print(json.dumps({"imported": names, "before": sorted(before), "loaded": loaded}))
"""

#: Makes the server packages unimportable, as on a trainer-only install, then runs the
#: launcher's --help, imports the rank runtime, and asks ``elasticctl`` for a server command.
_WITHOUT_SERVER = """
import importlib.abc, io, json, sys
from contextlib import redirect_stderr, redirect_stdout

server = set(sys.argv[1].split(","))
entry = sys.argv[2]
already = sorted(m for m in sys.modules if m.partition(".")[0] in server)

class NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in server:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NotInstalled())

def call(main, argv):
    out, err = io.StringIO(), io.StringIO()
    sys.argv = argv
    code = 0
    with redirect_stdout(out), redirect_stderr(err):
        try:
            main()
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
    return {"code": code, "out": out.getvalue(), "err": err.getvalue()}

module, _, function = entry.partition(":")
launcher_help = call(getattr(importlib.import_module(module), function), ["elastic-run", "--help"])
import rank_runtime.elastic
from controlplane import cli
run_help = call(cli.main, ["elasticctl", "run", "--help"])
serve = call(cli.main, ["elasticctl", "serve"])
print(json.dumps({"already": already, "launcher_help": launcher_help, "run_help": run_help,
                  "serve": serve, "elastic": rank_runtime.elastic.__name__}))
"""


def _python(code: str, *args: str) -> dict[str, object]:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def test_the_rank_runtime_and_its_launcher_load_no_server_package_nor_the_control_plane():
    entry = launcher_entry_point()
    result = _python(_IMPORT_ALL, ",".join(SERVER_PACKAGES), ",".join(RANK_RUNTIME), entry)
    assert result["before"] == [], "the interpreter loaded them before any import"
    imported = result["imported"]
    assert isinstance(imported, list) and set(RANK_RUNTIME) <= set(imported)
    assert result["loaded"] == {}, (
        "importing these rank_runtime modules loaded server or control plane modules "
        f"(a training process must not): {result['loaded']}"
    )


def test_a_trainer_install_without_the_server_extra_launches_and_trains():
    entry = launcher_entry_point()
    result = _python(_WITHOUT_SERVER, ",".join(SERVER_PACKAGES), entry)
    assert result["already"] == []
    launcher_help = result["launcher_help"]
    assert isinstance(launcher_help, dict)
    assert launcher_help["code"] == 0, launcher_help
    assert "--nproc" in launcher_help["out"] and "--fault" in launcher_help["out"]
    assert result["elastic"] == "rank_runtime.elastic"
    # elasticctl run is the same command there; a server command says what is missing.
    run_help = result["run_help"]
    assert isinstance(run_help, dict)
    assert run_help["code"] == 0 and "--nproc" in run_help["out"], run_help
    serve = result["serve"]
    assert isinstance(serve, dict)
    assert serve["code"] == 2, serve
    assert "elasticctl serve: needs the server extra" in serve["err"]
    assert "pip install 'elastic-controlplane[server]'" in serve["err"]


def test_no_rank_runtime_or_schemas_source_imports_a_server_package_even_lazily():
    """The shared package imports neither side; the rank runtime only the shared package."""
    refused = {
        "rank_runtime": {"controlplane", *SERVER_PACKAGES},
        "schemas": {"controlplane", "rank_runtime", *SERVER_PACKAGES},
    }
    bad = {}
    for package, forbidden in refused.items():
        sources = sorted((ROOT / package).rglob("*.py"))
        assert sources
        for path in sources:
            hits = sorted(m for m in imported_modules(path) if m.partition(".")[0] in forbidden)
            if hits:
                bad[str(path.relative_to(ROOT))] = hits
    assert not bad, f"imports a training process must not make: {bad}"
