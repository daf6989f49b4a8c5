"""Bearer tokens with scopes (``ELASTIC_API_TOKENS``) for the API and the metrics exporters.

The setting lists ``TOKEN:SCOPE[+SCOPE...]`` entries separated by commas, e.g.
``s3cret-a:read,s3cret-b:read+admin``; ``read`` is the scope every read needs. Tokens are kept
as SHA-256 digests only, and no message here ever contains one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

from pydantic import SecretStr

from controlplane.errors import ConfigurationError

READ = "read"
#: What a token must look like: printable ASCII with no space, comma or colon.
_TOKEN_CHARS = frozenset(chr(c) for c in range(0x21, 0x7F)) - {",", ":"}


class TokenSpecError(ConfigurationError, ValueError):
    """``ELASTIC_API_TOKENS`` is malformed (the message never quotes a token)."""


class Denied(Exception):
    """A request without the scope it needs: 401 (no or unknown token) or 403 (wrong scope)."""

    def __init__(self, status: int, detail: str, challenge: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail
        #: The ``WWW-Authenticate`` header to answer with.
        self.challenge = challenge


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def parse_tokens(spec: str) -> dict[str, frozenset[str]]:
    """``"a:read,b:read+admin"`` -> {"a": {"read"}, "b": {"read", "admin"}}."""
    tokens: dict[str, frozenset[str]] = {}
    for n, entry in enumerate((e.strip() for e in spec.split(",")), start=1):
        if not entry:
            continue
        token, sep, scopes = entry.partition(":")
        if not sep or not token:
            raise TokenSpecError(f"ELASTIC_API_TOKENS entry {n}: expected TOKEN:SCOPE[+SCOPE...]")
        if not set(token) <= _TOKEN_CHARS:
            raise TokenSpecError(f"ELASTIC_API_TOKENS entry {n}: the token has a bad character")
        names = frozenset(s.strip() for s in scopes.split("+") if s.strip())
        if not names:
            raise TokenSpecError(f"ELASTIC_API_TOKENS entry {n}: no scope")
        tokens[token] = tokens.get(token, frozenset()) | names
    if not tokens:
        raise TokenSpecError("ELASTIC_API_TOKENS is set but lists no token")
    return tokens


class TokenAuth:
    """Checks ``Authorization: Bearer <token>`` headers against the configured tokens."""

    def __init__(self, tokens: Mapping[str, frozenset[str]]) -> None:
        self._scopes = {_digest(t): scopes for t, scopes in tokens.items()}

    @classmethod
    def from_setting(cls, secret: SecretStr | None) -> TokenAuth | None:
        """The checker for ``ELASTIC_API_TOKENS``; None when it is unset (no authentication)."""
        if secret is None:
            return None
        return cls(parse_tokens(secret.get_secret_value()))

    def check(self, authorization: str | None, scope: str = READ) -> None:
        """Return if the header carries a token with ``scope``; raise ``Denied`` otherwise."""
        scheme, _, token = (authorization or "").strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise Denied(401, "a bearer token is required", 'Bearer realm="elastic"')
        scopes = self._scopes.get(_digest(token))
        if scopes is None:
            raise Denied(
                401,
                "the bearer token is not valid",
                'Bearer realm="elastic", error="invalid_token"',
            )
        if scope not in scopes:
            raise Denied(
                403,
                f"the bearer token lacks the {scope!r} scope",
                f'Bearer realm="elastic", error="insufficient_scope", scope="{scope}"',
            )
