"""``key=value,...``: the policy text ``elasticctl run --policy`` and ``replay --policy`` take."""

from __future__ import annotations

import json


def parse_overrides(text: str) -> dict[str, object]:
    """``a=1,b=2.5,c={"x":1}`` -> {"a": 1, "b": 2.5, "c": {"x": 1}}: values are JSON where
    they parse as JSON, else strings; commas inside braces or brackets do not split.
    ValueError when ``text`` is not that."""
    parts, depth, current = [], 0, ""
    for char in text:
        depth += {"{": 1, "[": 1, "}": -1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    parts.append(current)
    out: dict[str, object] = {}
    for part in filter(None, (p.strip() for p in parts)):
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--policy entry {part!r}: expected key=value")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value.strip()
    if not out:
        raise ValueError("--policy: expected key=value[,key=value...]")
    return out
