"""The viewer's page: plain HTML, JavaScript and CSS shipped as package data (``static/``).

Nothing is fetched from elsewhere (no CDN, no fonts): the page works on a machine with no
network. The charts are inline SVG drawn by ``app.js``.
"""

from __future__ import annotations

from pathlib import Path

STATIC = Path(__file__).with_name("static")

_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
          ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}


def asset(name: str) -> tuple[bytes, str] | None:
    """The bytes and content type of ``static/name``, or None when there is no such file
    (a name reaching outside ``static/`` is none)."""
    path = (STATIC / name).resolve()
    if STATIC.resolve() not in path.parents or not path.is_file() or path.suffix not in _TYPES:
        return None
    return path.read_bytes(), _TYPES[path.suffix]


__all__ = ["STATIC", "asset"]
