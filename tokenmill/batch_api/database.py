"""The server's durable state: files and batches, in SQLite (default) or Postgres.

SQLAlchemy Core, not the ORM and not the stdlib's sqlite3: one set of table
declarations and queries runs on both databases (the stdlib would need a second
driver and dialect for Postgres), its pool hands each thread its own connection, and
the queries stay plain SQL a reader can follow. Every write is one transaction, and a
status change is a compare-and-set (`transition`), so the API thread that cancels and
the runner that finishes a batch can never both win.

What a batch's job has done is not stored here: the job's output directory on the store
is its record (a shard is done when its part exists), which is what makes a killed
server's restart resume without a second mechanism.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from typing import Any

from sqlalchemy import (
    BigInteger,
    Column,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    create_engine,
    event,
    func,
    insert,
    inspect,
    select,
    text,
    update,
)
from sqlalchemy import delete as sql_delete
from sqlalchemy.engine import Engine

metadata = MetaData()

files = Table(
    "files",
    metadata,
    Column("seq", Integer, primary_key=True, autoincrement=True),
    Column("id", String(64), unique=True, nullable=False),
    Column("owner", String(64), nullable=False, index=True),
    Column("filename", Text, nullable=False),
    Column("purpose", String(32), nullable=False),
    Column("bytes", BigInteger, nullable=False),
    Column("lines", Integer, nullable=False),
    Column("created_at", BigInteger, nullable=False),
    Column("expires_at", BigInteger),
)

batches = Table(
    "batches",
    metadata,
    Column("seq", Integer, primary_key=True, autoincrement=True),
    Column("id", String(64), unique=True, nullable=False),
    Column("owner", String(64), nullable=False, index=True),
    Column("endpoint", String(64), nullable=False),
    Column("model", Text),
    Column("input_file_id", String(64), nullable=False),
    Column("completion_window", String(16), nullable=False),
    Column("status", String(16), nullable=False, index=True),
    Column("num_lines", Integer, nullable=False),  # the input file's, for the queue bound
    Column("output_file_id", String(64)),
    Column("error_file_id", String(64)),
    Column("errors", Text),  # JSON list of {code, message, line, param}
    Column("metadata", Text),  # JSON object
    Column("output_expires_s", BigInteger),
    Column("created_at", BigInteger, nullable=False),
    Column("in_progress_at", BigInteger),
    Column("expires_at", BigInteger),
    Column("finalizing_at", BigInteger),
    Column("completed_at", BigInteger),
    Column("failed_at", BigInteger),
    Column("expired_at", BigInteger),
    Column("cancelling_at", BigInteger),
    Column("cancelled_at", BigInteger),
    Column("total", Integer, nullable=False, default=0),
    Column("completed", Integer, nullable=False, default=0),
    Column("failed", Integer, nullable=False, default=0),
    Column("input_tokens", BigInteger, nullable=False, default=0),
    Column("cached_tokens", BigInteger, nullable=False, default=0),
    Column("output_tokens", BigInteger, nullable=False, default=0),
    Column("reasoning_tokens", BigInteger, nullable=False, default=0),  # of output_tokens
    Column("flow_run_id", String(64)),  # --runner prefect: the batch's flow run
    Column("work_removed", Integer, nullable=False, default=0),  # retention has run
)


def now() -> int:
    return int(time.time())


def engine_for(url: str) -> Engine:
    """A SQLAlchemy engine for `url`: sqlite:///PATH or postgresql://... (psycopg 3)."""
    if url.startswith(("postgresql://", "postgres://")):
        url = "postgresql+psycopg://" + url.split("://", 1)[1]
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(connection, _record) -> None:
            # WAL: readers (the API) never wait for the writer (the runner); FULL: a
            # committed change survives a power cut, not only a killed process.
            cursor = connection.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA synchronous=FULL")
            cursor.close()

        return engine
    return create_engine(url, pool_pre_ping=True)


def add_missing_columns(engine: Engine) -> None:
    """Add the columns declared here that a database made by an earlier version lacks
    (`create_all` makes missing tables only). A column added later is a count with a
    default or a nullable field, so the rows already there take its default."""
    found = inspect(engine)
    with engine.begin() as db:
        for table in metadata.sorted_tables:
            have = {c["name"] for c in found.get_columns(table.name)}
            for column in table.columns:
                if column.name in have:
                    continue
                kind = column.type.compile(dialect=engine.dialect)
                default = column.default.arg if column.default is not None else None
                if default is None and not column.nullable:
                    raise RuntimeError(
                        f"the database's {table.name} table lacks {column.name}, which has "
                        "no default to give its rows"
                    )
                rule = "" if default is None else f" NOT NULL DEFAULT {int(default)}"
                db.execute(text(f"ALTER TABLE {table.name} ADD COLUMN {column.name} {kind}{rule}"))


class Database:
    """The files and batches tables, and the few queries the server makes of them."""

    def __init__(self, url: str) -> None:
        self.engine = engine_for(url)
        metadata.create_all(self.engine)
        add_missing_columns(self.engine)

    def close(self) -> None:
        self.engine.dispose()

    # -- files -----------------------------------------------------------------------

    def add_file(self, **row: Any) -> dict[str, Any]:
        with self.engine.begin() as db:
            db.execute(insert(files).values(**row))
        return row

    def file(self, owner: str, file_id: str) -> dict[str, Any] | None:
        with self.engine.connect() as db:
            found = db.execute(
                select(files).where(files.c.id == file_id, files.c.owner == owner)
            ).first()
        return None if found is None else dict(found._mapping)

    def list_files(
        self, owner: str, *, purpose: str | None, after: str | None, limit: int, order: str
    ) -> tuple[list[dict[str, Any]], bool]:
        query = select(files).where(files.c.owner == owner)
        if purpose is not None:
            query = query.where(files.c.purpose == purpose)
        return self._page(query, files, owner, after, limit, descending=order == "desc")

    def remove_file(self, owner: str, file_id: str) -> bool:
        with self.engine.begin() as db:
            done = db.execute(
                sql_delete(files).where(files.c.id == file_id, files.c.owner == owner)
            )
        return done.rowcount == 1

    def expired_files(self, at: int) -> list[dict[str, Any]]:
        with self.engine.connect() as db:
            rows = db.execute(
                select(files).where(files.c.expires_at.is_not(None), files.c.expires_at <= at)
            )
            return [dict(r._mapping) for r in rows]

    # -- batches -----------------------------------------------------------------------

    def add_batch(self, **row: Any) -> dict[str, Any]:
        row = {**row, "metadata": _json(row.get("metadata"))}
        with self.engine.begin() as db:
            db.execute(insert(batches).values(**row))
        return self.batch_by_id(row["id"])

    def batch(self, owner: str, batch_id: str) -> dict[str, Any] | None:
        with self.engine.connect() as db:
            found = db.execute(
                select(batches).where(batches.c.id == batch_id, batches.c.owner == owner)
            ).first()
        return None if found is None else _batch_row(found)

    def batch_by_id(self, batch_id: str) -> dict[str, Any]:
        with self.engine.connect() as db:
            return _batch_row(db.execute(select(batches).where(batches.c.id == batch_id)).one())

    def list_batches(
        self, owner: str, *, after: str | None, limit: int
    ) -> tuple[list[dict[str, Any]], bool]:
        rows, more = self._page(
            select(batches).where(batches.c.owner == owner),
            batches,
            owner,
            after,
            limit,
            descending=True,
        )
        return [_decoded(r) for r in rows], more

    def batches_in(self, statuses: Iterable[str]) -> list[dict[str, Any]]:
        """Every batch in one of `statuses`, in creation order."""
        with self.engine.connect() as db:
            rows = db.execute(
                select(batches).where(batches.c.status.in_(list(statuses))).order_by(batches.c.seq)
            )
            return [_batch_row(r) for r in rows]

    def batches_using(self, owner: str, file_id: str, statuses: Iterable[str]) -> list[str]:
        with self.engine.connect() as db:
            rows = db.execute(
                select(batches.c.id).where(
                    batches.c.owner == owner,
                    batches.c.input_file_id == file_id,
                    batches.c.status.in_(list(statuses)),
                )
            )
            return [r.id for r in rows]

    def queued_lines(self, owner: str, statuses: Iterable[str]) -> int:
        with self.engine.connect() as db:
            total = db.execute(
                select(func.coalesce(func.sum(batches.c.num_lines), 0)).where(
                    batches.c.owner == owner, batches.c.status.in_(list(statuses))
                )
            ).scalar_one()
        return int(total)

    def update_batch(self, batch_id: str, **changes: Any) -> None:
        if "errors" in changes:
            changes["errors"] = _json(changes["errors"])
        with self.engine.begin() as db:
            db.execute(update(batches).where(batches.c.id == batch_id).values(**changes))

    def transition(self, batch_id: str, from_statuses: Iterable[str], **changes: Any) -> bool:
        """Apply `changes` (a new status among them) only if the batch is in one of
        `from_statuses`; whether it was."""
        if "errors" in changes:
            changes["errors"] = _json(changes["errors"])
        with self.engine.begin() as db:
            done = db.execute(
                update(batches)
                .where(batches.c.id == batch_id, batches.c.status.in_(list(from_statuses)))
                .values(**changes)
            )
        return done.rowcount == 1

    def finished_batches_before(self, at: int) -> list[dict[str, Any]]:
        """Finished batches created before `at` whose work is still on the store."""
        with self.engine.connect() as db:
            rows = db.execute(
                select(batches).where(batches.c.created_at <= at, batches.c.work_removed == 0)
            )
            return [_batch_row(r) for r in rows]

    # -- pages -------------------------------------------------------------------------

    def _page(self, query, table, owner, after, limit, *, descending):
        if after is not None:
            with self.engine.connect() as db:
                anchor = db.execute(
                    select(table.c.seq).where(table.c.id == after, table.c.owner == owner)
                ).scalar()
            if anchor is None:  # a cursor that is not one of ours: an empty page
                return [], False
            query = query.where(table.c.seq < anchor if descending else table.c.seq > anchor)
        query = query.order_by(table.c.seq.desc() if descending else table.c.seq).limit(limit + 1)
        with self.engine.connect() as db:
            rows = [dict(r._mapping) for r in db.execute(query)]
        return rows[:limit], len(rows) > limit


def _json(value: Any) -> str | None:
    return None if value is None else json.dumps(value)


def _decoded(row: dict[str, Any]) -> dict[str, Any]:
    row = dict(row)
    for key in ("errors", "metadata"):
        row[key] = None if row.get(key) is None else json.loads(row[key])
    return row


def _batch_row(found) -> dict[str, Any]:
    return _decoded(dict(found._mapping))
