"""A throwaway Postgres cluster for the Batch API's Postgres variant, from Debian's
`postgresql` package (`.ci/run` installs it and starts one; its URL comes in
TOKENMILL_TEST_POSTGRES_URL). Without that variable a cluster is started here from the
installed server binaries; the tests skip only when none is installed.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator

URL_ENV = "TOKENMILL_TEST_POSTGRES_URL"


def server_bin() -> str | None:
    """The directory of an installed Postgres server's initdb and pg_ctl (the newest)."""
    on_path = shutil.which("initdb")
    if on_path and shutil.which("pg_ctl"):
        return os.path.dirname(os.path.realpath(on_path))
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=_version)
    return os.path.dirname(found[-1]) if found else None


def _version(path: str) -> tuple[int, ...]:
    name = path.split("/")[-3]
    return tuple(int(p) for p in name.split(".") if p.isdigit())


@contextlib.contextmanager
def cluster(bin_dir: str, port: int) -> Iterator[str]:
    """initdb and start a cluster on 127.0.0.1:`port` (trust auth, loopback only); its
    URL. Postgres refuses to run as root: as root, it runs as the package's user."""
    as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    root = tempfile.mkdtemp(prefix="tokenmill-pg-")
    os.chmod(root, 0o755)
    if as_user:
        shutil.chown(root, "postgres")
    data = os.path.join(root, "data")
    run = lambda *args: subprocess.run(  # noqa: E731
        [*as_user, *args], check=True, capture_output=True, text=True
    )
    try:
        run(os.path.join(bin_dir, "initdb"), "-D", data, "-A", "trust", "-U", "postgres")
        run(
            os.path.join(bin_dir, "pg_ctl"),
            "-D",
            data,
            "-o",
            f"-h 127.0.0.1 -p {port} -k {root}",
            "-l",
            os.path.join(root, "log"),
            "-w",
            "start",
        )
        try:
            yield f"postgresql://postgres@127.0.0.1:{port}/postgres"
        finally:
            run(os.path.join(bin_dir, "pg_ctl"), "-D", data, "-m", "immediate", "stop")
    finally:
        shutil.rmtree(root, ignore_errors=True)


def fresh_database(server_url: str) -> str:
    """A new, empty database on the server; its URL (each test its own tables)."""
    from sqlalchemy import create_engine, text

    name = f"batch_api_{uuid.uuid4().hex[:12]}"
    url = server_url.replace("postgresql://", "postgresql+psycopg://", 1)
    engine = create_engine(url, isolation_level="AUTOCOMMIT")
    with engine.connect() as db:
        db.execute(text(f'CREATE DATABASE "{name}"'))
    engine.dispose()
    return server_url.rsplit("/", 1)[0] + "/" + name
