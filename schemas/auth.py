"""The keys both sides agree on: how a job's secret and the command-signing key are derived.

One installation secret (``ELASTIC_SECRET``, at least 32 bytes of hex) is known to the control
plane and to ``elasticctl creds``, which issues each node of a job what it needs:

- the job's secret, ``job_secret(master, job_id)``: every member of the job gets it from its
  launcher (``ELASTIC_JOB_SECRET``), never from an event or a command. It keys the MACs of the
  peer store and of the rendezvous store, so no one outside the job can read or write them;
- the control plane's command-verifying key (``ELASTIC_COMMAND_KEY``, an Ed25519 public key):
  the private key is ``command_signing_seed(master)``, so every control plane of one
  installation (a standby too) signs with the same key.

No I/O, no clock; signatures use ``cryptography``'s Ed25519.
"""

from __future__ import annotations

import hashlib
import hmac

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

#: The installation secret (hex), read by the control plane and ``elasticctl creds``.
MASTER_SECRET_ENV = "ELASTIC_SECRET"
#: The job's secret (hex), set by the launcher for its members.
JOB_SECRET_ENV = "ELASTIC_JOB_SECRET"
#: The control plane's Ed25519 public key (hex), set by the launcher for its members.
COMMAND_KEY_ENV = "ELASTIC_COMMAND_KEY"

#: Shortest installation secret accepted, in bytes.
MIN_SECRET_BYTES = 32


class SecretError(ValueError):
    """A secret that is not what it must be (not hex, too short)."""


def parse_secret(text: str, *, what: str = MASTER_SECRET_ENV) -> bytes:
    """Bytes of a hex secret; SecretError naming ``what`` when it is not one."""
    try:
        raw = bytes.fromhex(text.strip())
    except ValueError:
        raise SecretError(f"{what} must be hex (e.g. `openssl rand -hex 32`)") from None
    if len(raw) < MIN_SECRET_BYTES:
        raise SecretError(f"{what} must be at least {MIN_SECRET_BYTES} bytes ({len(raw)} given)")
    return raw


def derive(key: bytes, label: str) -> bytes:
    """A key for one purpose, ``label``, derived from ``key`` (HMAC-SHA256)."""
    return hmac.new(key, label.encode(), hashlib.sha256).digest()


def job_secret(master: bytes, job_id: str) -> bytes:
    """The secret of one job (32 bytes), derived from the installation secret."""
    return derive(master, f"elastic/job/{job_id}")


def command_signing_seed(master: bytes) -> bytes:
    """The 32-byte Ed25519 seed the control plane signs commands with."""
    return derive(master, "elastic/command-signing")


def command_public_key(master: bytes) -> bytes:
    """The raw 32-byte public key that verifies the control plane's commands."""
    key = Ed25519PrivateKey.from_private_bytes(command_signing_seed(master))
    return key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


class CommandSigner:
    """Signs command bytes with the installation's command key."""

    def __init__(self, master: bytes) -> None:
        self._key = Ed25519PrivateKey.from_private_bytes(command_signing_seed(master))

    def sign(self, data: bytes) -> str:
        """The signature of ``data``, as hex (128 characters)."""
        return self._key.sign(data).hex()


class CommandVerifier:
    """Checks a command's signature against the control plane's public key."""

    def __init__(self, public_key: bytes) -> None:
        if len(public_key) != 32:
            raise SecretError(f"{COMMAND_KEY_ENV} must be 32 bytes ({len(public_key)} given)")
        self._key = Ed25519PublicKey.from_public_bytes(public_key)

    @classmethod
    def from_hex(cls, text: str) -> CommandVerifier:
        """From ``ELASTIC_COMMAND_KEY``'s hex; SecretError when it is not a key."""
        try:
            raw = bytes.fromhex(text.strip())
        except ValueError:
            raise SecretError(f"{COMMAND_KEY_ENV} must be hex") from None
        return cls(raw)

    def verify(self, data: bytes, signature: str | None) -> bool:
        """Whether ``signature`` (hex) is the control plane's over ``data``."""
        if not signature:
            return False
        try:
            self._key.verify(bytes.fromhex(signature), data)
        except (InvalidSignature, ValueError):
            return False
        return True


#: The NATS header that carries a command's signature (``CommandSigner.sign`` of
#: ``command_message``); a member with ``ELASTIC_COMMAND_KEY`` refuses a command without it.
SIGNATURE_HEADER = "Elastic-Signature"


def command_message(subject: str, data: bytes) -> bytes:
    """What a command's signature covers: the subject it is published on and its exact bytes
    (so a command signed for one job or member is no command on another's subject)."""
    return b"elastic-command\n" + subject.encode() + b"\n" + data
