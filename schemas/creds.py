"""The per-node NATS credentials ``elasticctl creds`` writes, as their readers see them.

Issuing them is the control plane's (``controlplane/creds.py``, which describes the
identities and their permissions); reading them is the launcher's and every NATS client's:
the directory layout (``<dir>/<job>/<node>/launcher.nk`` and ``member.nk``, the job's
``job-secret`` and ``command-key``), and the connect options of an NKey seed file (the seed,
and the only inbox prefix its identity may receive on).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nkeys

from schemas.auth import COMMAND_KEY_ENV, JOB_SECRET_ENV
from schemas.common import IDENT_PATTERN

#: A directory written by ``elasticctl creds``: the launcher takes its node's credentials there.
CREDS_DIR_ENV = "ELASTIC_NATS_CREDS_DIR"

LAUNCHER = "launcher"
MEMBER = "member"
KINDS = (LAUNCHER, MEMBER)

JOB_SECRET_FILE = "job-secret"
COMMAND_KEY_FILE = "command-key"
#: Prefix of every NKey user seed.
SEED_PREFIX = b"SU"

_IDENT = re.compile(IDENT_PATTERN)


class CredentialsError(ValueError):
    """Credentials that cannot be issued or found (a bad name, a missing file)."""


def check_name(what: str, name: str) -> str:
    """``name`` if it is a valid job or node name; CredentialsError if not."""
    if not _IDENT.match(name):
        raise CredentialsError(
            f"{what} {name!r} is not a valid name (letters, digits, '-', '_'; at most 64)"
        )
    return name


def public_key(seed: bytes) -> str:
    """The public key (``U...``) of an NKey user seed."""
    pair = nkeys.from_seed(bytearray(seed))
    try:
        return str(pair.public_key.decode())
    finally:
        pair.wipe()


def inbox_prefix(public: str) -> str:
    """The only inbox prefix the identity with this public key may receive on."""
    return f"_INBOX_{public}"


@dataclass(frozen=True, slots=True)
class NodeCredentials:
    """The seed files of one node of a job."""

    launcher: Path
    member: Path


def node_dir(directory: Path, job_id: str, node: str) -> Path:
    return Path(directory) / check_name("job", job_id) / check_name("node", node)


def node_credentials(directory: str | Path, job_id: str, node: str) -> NodeCredentials:
    """The launcher's and the members' seed files of ``node``; CredentialsError if absent."""
    where = node_dir(Path(directory), job_id, node)
    found = NodeCredentials(where / f"{LAUNCHER}.nk", where / f"{MEMBER}.nk")
    for path in (found.launcher, found.member):
        if not path.is_file():
            raise CredentialsError(
                f"no NATS credential {path} (issue it: elasticctl creds --job {job_id} "
                f"--node {node} --out {directory})"
            )
    return found


def job_environment(directory: str | Path, job_id: str) -> dict[str, str]:
    """ELASTIC_JOB_SECRET and ELASTIC_COMMAND_KEY from the job's files, those that exist."""
    where = Path(directory) / check_name("job", job_id)
    env = {}
    for name, file in ((JOB_SECRET_ENV, JOB_SECRET_FILE), (COMMAND_KEY_ENV, COMMAND_KEY_FILE)):
        path = where / file
        if path.is_file():
            env[name] = path.read_text().strip()
    return env


def nkey_connect_options(path: str | Path) -> dict[str, Any] | None:
    """nats-py options for an NKey seed file (the seed and its own inbox prefix); None when
    the file is not an NKey seed (a JWT ``.creds`` file, say)."""
    seed = Path(path).read_bytes().strip()
    if not seed.startswith(SEED_PREFIX):
        return None
    return {"nkeys_seed": str(path), "inbox_prefix": inbox_prefix(public_key(seed))}
