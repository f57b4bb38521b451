"""A throwaway PostgreSQL server for the tests: ``initdb`` and ``pg_ctl`` (Debian's ``postgresql``
package; ``.ci/run`` installs it) on a free loopback port, in a temporary folder, run as the ``postgres``
user when the tests run as root (the server refuses to run as root), and removed afterwards."""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path


def server_bin() -> Path | None:
    """The folder holding ``initdb`` and ``pg_ctl`` (the newest Debian install, else PATH), or None."""
    for candidate in sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(p.split("/")[-2]),
                            reverse=True):
        if (Path(candidate) / "initdb").exists():
            return Path(candidate)
    found = shutil.which("initdb")
    return Path(found).parent if found else None


class Cluster:
    """``start()`` / ``stop()`` a server on ``port``; ``url`` reaches it as the ``postgres`` superuser."""

    def __init__(self, bin_dir: Path, *, fsync: bool = False):
        self.bin = bin_dir
        self.fsync = fsync  # off for tests (nothing to keep); on to measure as a deployment runs
        self.root = Path(tempfile.mkdtemp(prefix="memplan-pg-"))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"
        self._as_root = os.geteuid() == 0
        if self._as_root:
            shutil.chown(self.root, "postgres", "postgres")
        self._run("initdb", "-D", str(self.root / "data"), "-U", "postgres", "-A", "trust", "--no-sync",
                  "-E", "UTF8", "--locale=C")

    def _run(self, tool: str, *args: str) -> None:
        cmd = [str(self.bin / tool), *args]
        if self._as_root:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=self.root, timeout=60)
        if done.returncode != 0:
            raise RuntimeError(f"{tool} failed ({done.returncode}): {done.stderr.strip() or done.stdout.strip()}")

    def start(self) -> None:
        self._run("pg_ctl", "-D", str(self.root / "data"), "-l", str(self.root / "server.log"), "-w", "-t", "60",
                  "-o", f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 "
                        f"-c fsync={'on' if self.fsync else 'off'} "
                        f"-c max_connections=100", "start")

    def stop(self) -> None:
        self._run("pg_ctl", "-D", str(self.root / "data"), "-m", "fast", "-w", "-t", "60", "stop")

    def remove(self) -> None:
        try:
            self.stop()
        except (RuntimeError, subprocess.TimeoutExpired):
            pass  # not running
        shutil.rmtree(self.root, ignore_errors=True)
