"""``agentenv view``'s options and what the command does with them."""

from __future__ import annotations

import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError
from ..options import option


@dataclass(frozen=True)
class ViewConfig:
    """``agentenv view``'s options."""

    paths: list[Path] = option(
        help="a rollout JSONL (its event log OUT.log beside it), an eval report (.json) or a training run "
             "directory; two rollout files or reports: compared task by task", flag="paths", factory=list)
    port: int = option(8765, "port to serve on (default {default}; 0: any free port)")
    host: str = option("127.0.0.1", "address to serve on (default {default}: this machine only)")
    browser: bool = option(True, "do not open a browser (print the URL only)", flag="--no-browser")

    def __post_init__(self) -> None:
        if not self.paths:
            raise ConfigError("give a rollout file, an eval report or a training run directory")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port must be between 0 and 65535, got {self.port}")


def _can_open_browser() -> bool:
    """A browser can be shown: macOS and Windows always, elsewhere only with a display."""
    return sys.platform in ("darwin", "win32") or bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))


def view(opts: ViewConfig) -> int:
    """Serve the runs until interrupted (Ctrl-C); open the page in the browser unless told not to."""
    from .runs import open_run
    from .server import ViewServer, Viewer

    viewer = Viewer([open_run(p) for p in opts.paths])
    with ViewServer(viewer, opts.host, opts.port) as server:
        try:  # Ctrl-C is how a viewer is closed
            if opts.browser and _can_open_browser():
                import webbrowser

                webbrowser.open(server.url)
            kinds = ", ".join(f"{r.label} ({r.kind})" for r in viewer.runs)
            print(f"agentenv view: {kinds} at {server.url}  (Ctrl-C stops)", flush=True)
            threading.Event().wait()
        except KeyboardInterrupt:
            pass
    return 0


__all__ = ["ViewConfig", "view"]
