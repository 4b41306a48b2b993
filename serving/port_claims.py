"""Claims on the ports a mode's stack is about to bind, taken before anything starts.

A vLLM worker binds its HTTP port only after it has loaded and warmed up its model (a minute or
more on CPU), so "is something listening there?" cannot see a second turnscope that started a
moment earlier and is still loading: both would load a model before one of them fails to bind.
:class:`PortClaims` closes that window among turnscope processes on one machine: for each
``(host, port)`` it takes an exclusive, non-blocking ``flock`` on a file named after it in the
system's temporary directory and holds it until released. The operating system drops the lock when
the holder exits, killed or not, so a stale file never blocks anyone. Ports held by other programs
are still found by ``serving.workers.port_in_use``.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from pathlib import Path

CLAIMS_DIR = Path(tempfile.gettempdir()) / "turnscope-port-claims"


class PortTaken(RuntimeError):
    """Another turnscope process holds the claim on a port; the message names it and its pid."""


class PortClaims:
    """The claims of one process on a set of ``(host, port)``, held until :meth:`release`."""

    def __init__(self, claims_dir: Path = CLAIMS_DIR):
        self.claims_dir = Path(claims_dir)
        self._files: list = []

    def claim(self, host: str, port: int, who: str) -> None:
        """Claim ``host:port`` for ``who`` (a name for messages). Raises PortTaken, naming the
        claiming pid, when another process holds it; the claims taken so far are kept."""
        self.claims_dir.mkdir(parents=True, exist_ok=True)
        path = self.claims_dir / f"{host.replace(':', '_')}-{port}.lock"
        f = open(path, "a+")  # noqa: SIM115 (held open for the claim's life)
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "unknown"
            f.close()
            raise PortTaken(f"port {port} on {host} ({who}) is already claimed by another turnscope that is "
                            f"starting or running (pid {holder}); nothing was started") from None
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
        self._files.append(f)

    def release(self) -> None:
        """Drop every claim (closing the file releases its lock)."""
        for f in self._files:
            f.close()
        self._files.clear()
