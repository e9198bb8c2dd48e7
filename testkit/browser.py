"""A page in a real browser: Debian's headless Chromium, with the network off.

``render(path)`` loads a local HTML file, lets its scripts run, and returns the ``<body>``
element's ``data-*`` attributes as the page left them, with everything the browser printed
(console messages and errors included)."""

from __future__ import annotations

import html
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

#: Chromium's name in Debian's package, then other common ones.
_NAMES = ("chromium", "chromium-browser", "google-chrome")

_OFFLINE = [
    # No request leaves the machine: every host name fails to resolve, and any proxy-able
    # request goes to a port where nothing listens.
    "--host-resolver-rules=MAP * ~NOTFOUND",
    "--proxy-server=127.0.0.1:9",
    "--proxy-bypass-list=<-loopback>",
]


def chromium() -> str | None:
    """The path of a Chromium binary, or ``None``."""
    return next((p for p in map(shutil.which, _NAMES) if p), None)


@dataclass
class Rendered:
    body: dict[str, str]
    log: str  # the browser's stderr: console messages at every level, script errors

    @property
    def console_errors(self) -> list[str]:
        """Uncaught exceptions, and ECharts' own complaints (it warns on the console of a
        misused option). Chromium logs every console level alike, so a page's deliberate
        ``console.error`` cannot be told from its ``console.log`` here."""
        return [line for line in self.log.splitlines() if "CONSOLE" in line
                and ("Uncaught" in line or "[ECharts]" in line)]  # fmt: skip


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    binary = chromium()
    if binary is None:
        raise RuntimeError("no Chromium: apt-get install chromium")
    command = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
               "--enable-logging=stderr", "--v=0", *_OFFLINE, *args]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout)


def render(page: Path, timeout: float = 120.0) -> Rendered:
    done = _run(["--virtual-time-budget=10000", "--dump-dom", page.resolve().as_uri()], timeout)
    match = re.search(r"<body([^>]*)>", done.stdout)
    if match is None:
        raise AssertionError(f"no <body> in what Chromium printed:\n{done.stdout[:2000]}\n"
                             f"{done.stderr[-4000:]}")  # fmt: skip
    body = {k: html.unescape(v) for k, v in re.findall(r'data-([\w-]+)="([^"]*)"', match[1])}
    return Rendered(body, done.stderr)


def screenshot(page: Path, out: Path, size: str = "1400,700", timeout: float = 120.0) -> None:
    _run(["--hide-scrollbars", f"--window-size={size}", "--virtual-time-budget=10000",
          f"--screenshot={out.resolve()}", page.resolve().as_uri()], timeout)  # fmt: skip
    if not out.is_file():
        raise AssertionError(f"Chromium wrote no screenshot to {out}")
