"""A real, throwaway PostgreSQL cluster for tests: `initdb` into a temporary folder, `pg_ctl start` on
127.0.0.1 and a free port with trust authentication, one database per test, `pg_ctl stop -m fast` and
the folder removed at the end.

initdb refuses to run as root, so as root the cluster belongs to the `postgres` user (the packages
create it) and its commands run through `runuser`; as anyone else they run directly. Durability
settings are off (fsync, synchronous_commit): these clusters never outlive a crash of the machine.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path

from tests.servers import free_port

SUPERUSER = "specwire"


def find_bin_dir() -> Path | None:
    """Where `initdb` and `pg_ctl` are: on PATH, else the newest /usr/lib/postgresql/*/bin."""
    initdb = shutil.which("initdb")
    if initdb:
        return Path(os.path.realpath(initdb)).parent
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    return Path(candidates[-1]).parent if candidates else None


class PostgresServer:
    """One running cluster; `create_database()` gives a fresh database's URL.

    Args:
        bin_dir (`Path`): the folder holding `initdb` and `pg_ctl`.
    """

    def __init__(self, bin_dir: Path):
        self.bin_dir = bin_dir
        self.run_as = None
        if os.geteuid() == 0:
            try:
                import pwd

                pwd.getpwnam("postgres")
            except KeyError as exc:
                raise RuntimeError("running as root and there is no `postgres` user to run initdb as") from exc
            self.run_as = "postgres"
        self.root = Path(tempfile.mkdtemp(prefix="specwire-pg-"))
        if self.run_as:
            shutil.chown(self.root, self.run_as)
        self.data = self.root / "data"
        self.log = self.root / "postgres.log"
        self.port = free_port()
        self._pg("initdb", "-D", str(self.data), "-U", SUPERUSER, "--auth=trust", "-E", "UTF8", "--no-sync")
        options = (
            f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.root} -c fsync=off "
            "-c synchronous_commit=off -c full_page_writes=off -c max_connections=200"
        )
        self._pg("pg_ctl", "-D", str(self.data), "-o", options, "-l", str(self.log), "-w", "-t", "60", "start")

    def _pg(self, tool: str, *args: str) -> None:
        command = [str(self.bin_dir / tool), *args]
        if self.run_as:
            command = ["runuser", "-u", self.run_as, "--", *command]
        result = subprocess.run(command, capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            log = self.log.read_text()[-2000:] if self.log.exists() else ""
            raise RuntimeError(f"{' '.join(command)} failed: {result.stdout}{result.stderr}{log}")

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://{SUPERUSER}@127.0.0.1:{self.port}/{database}"

    def admin(self, sql: str) -> None:
        """Run one statement on the `postgres` database, outside a transaction (CREATE DATABASE)."""
        import psycopg

        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(sql)

    def create_database(self) -> str:
        name = f"registry_{uuid.uuid4().hex[:12]}"
        self.admin(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def drop_database(self, url: str) -> None:
        name = url.rsplit("/", 1)[1]
        self.admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def stop(self) -> None:
        try:
            self._pg("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)
