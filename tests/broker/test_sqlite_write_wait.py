"""The embedded SQLite backend's wait for another process's write lock (broker/sqlite/base.py).

A transaction that finds the write lock held by another process (here a plain sqlite3 connection,
as a process without this backend would hold it) waits for it and then runs, fails with "database
is locked" only after the configured timeout and then holds nothing (neither this process's write
lock nor a transaction), and statements outside a transaction wait as well. Between processes that
use the backend (the web server's processes, the Celery worker) a write transaction holds the
database's lock file: the others queue on it, a forked child does not share its parent's, and one
held past the timeout does not stop a write that SQLite itself allows.
"""
from __future__ import annotations

import fcntl
import os
import sqlite3
import threading
import time
from pathlib import Path

import pytest
from django.db import transaction
from django.db.utils import ConnectionHandler, OperationalError

from broker import file_locks
from broker.sqlite.base import _lock_file, _write_lock


@pytest.fixture
def file_database(tmp_path: Path, monkeypatch, django_db_blocker):
    path = tmp_path / "broker.sqlite3"
    setup = sqlite3.connect(path)
    setup.execute("PRAGMA journal_mode=WAL")
    setup.execute("CREATE TABLE t (value INTEGER)")
    setup.close()
    handler = ConnectionHandler({"default": {
        "ENGINE": "broker.sqlite", "NAME": str(path),
        "OPTIONS": {"timeout": 0.5, "transaction_mode": "IMMEDIATE"}}})
    # transaction.atomic(using=...) looks the alias up in django.db.connections: this file's instead.
    monkeypatch.setattr(transaction, "connections", handler)
    with django_db_blocker.unblock():  # a database of the test's own, not the test database
        yield path, handler["default"]
        handler.close_all()


def other_process_holds_the_write_lock(path: Path) -> sqlite3.Connection:
    holder = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN IMMEDIATE")
    holder.execute("INSERT INTO t VALUES (1)")
    return holder


def test_a_transaction_waits_for_another_process_then_runs(file_database) -> None:
    path, wrapper = file_database
    holder = other_process_holds_the_write_lock(path)
    threading.Timer(0.2, lambda: holder.execute("COMMIT")).start()
    started = time.monotonic()
    with transaction.atomic():
        wrapper.cursor().execute("INSERT INTO t VALUES (2)")
    assert time.monotonic() - started >= 0.19  # it waited for the other writer, it did not fail
    assert [row[0] for row in sqlite3.connect(path).execute("SELECT value FROM t ORDER BY value")] == [1, 2]


def test_past_the_timeout_it_fails_and_the_next_transaction_runs(file_database) -> None:
    path, wrapper = file_database
    holder = other_process_holds_the_write_lock(path)
    started = time.monotonic()
    with pytest.raises(OperationalError, match="locked"):
        with transaction.atomic():
            wrapper.cursor().execute("INSERT INTO t VALUES (2)")
    assert time.monotonic() - started >= 0.49
    assert not _write_lock(str(path)).locked()  # the process's other threads are not kept waiting
    assert not wrapper.in_atomic_block
    holder.execute("COMMIT")
    # Nothing of the failed attempt is held: neither this process's write lock nor a transaction.
    with transaction.atomic():
        wrapper.cursor().execute("INSERT INTO t VALUES (3)")
    assert [row[0] for row in sqlite3.connect(path).execute("SELECT value FROM t ORDER BY value")] == [1, 3]


def test_an_autocommit_write_after_a_transaction_also_waits(file_database) -> None:
    path, wrapper = file_database
    with transaction.atomic():
        wrapper.cursor().execute("INSERT INTO t VALUES (2)")
    holder = other_process_holds_the_write_lock(path)
    threading.Timer(0.2, lambda: holder.execute("COMMIT")).start()
    wrapper.cursor().execute("INSERT INTO t VALUES (3)")  # no transaction: waits, does not fail
    assert [row[0] for row in sqlite3.connect(path).execute("SELECT value FROM t ORDER BY value")] == [1, 2, 3]


def lock_file_is_free(path: Path) -> bool:
    """Whether another process could take the database's lock file now (a descriptor of its own)."""
    fd = os.open(f"{path}-writelock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def test_a_write_transaction_holds_the_lock_file_until_it_ends(file_database) -> None:
    path, wrapper = file_database
    with transaction.atomic():
        wrapper.cursor().execute("INSERT INTO t VALUES (1)")
        assert not lock_file_is_free(path)
    assert lock_file_is_free(path)
    with pytest.raises(ZeroDivisionError):
        with transaction.atomic():
            wrapper.cursor().execute("INSERT INTO t VALUES (2)")
            1 / 0
    assert lock_file_is_free(path)  # a rollback gives it back too


def test_a_transaction_queues_behind_another_process_holding_the_lock_file(file_database) -> None:
    path, wrapper = file_database
    other = os.open(f"{path}-writelock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(other, fcntl.LOCK_EX)
    threading.Timer(0.2, lambda: os.close(other)).start()  # as when that process commits, or dies
    started = time.monotonic()
    with transaction.atomic():
        wrapper.cursor().execute("INSERT INTO t VALUES (1)")
    waited = time.monotonic() - started
    assert 0.19 <= waited < 0.45  # it waited for the file lock, not for the 0.5 s timeout


def test_a_lock_file_held_past_the_timeout_does_not_stop_a_write_sqlite_allows(file_database) -> None:
    path, wrapper = file_database
    other = os.open(f"{path}-writelock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(other, fcntl.LOCK_EX)  # a process stopped while holding it, say
    try:
        with transaction.atomic():
            wrapper.cursor().execute("INSERT INTO t VALUES (1)")
    finally:
        os.close(other)
    assert [row[0] for row in sqlite3.connect(path).execute("SELECT value FROM t")] == [1]
    assert lock_file_is_free(path)


def test_a_forked_child_does_not_share_its_parents_lock_file(file_database) -> None:
    path, wrapper = file_database
    with transaction.atomic():
        wrapper.cursor().execute("INSERT INTO t VALUES (1)")
        pid = os.fork()
        if pid == 0:  # the child: with its parent's descriptor it would "take" the lock its parent holds
            os._exit(0 if not file_locks.take(_lock_file(str(path)), 0.05) else 1)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the child took the lock its parent held"


def test_where_the_lock_file_cannot_be_made_writes_still_run(file_database, monkeypatch) -> None:
    """A database in a directory that is not ours to write: SQLite's busy handler alone, as before."""
    path, wrapper = file_database
    real_open = os.open

    def refuse_lock_file(name, *args, **kwargs):
        if str(name).endswith("-writelock"):
            raise PermissionError(13, "Permission denied", name)
        return real_open(name, *args, **kwargs)

    monkeypatch.setattr(os, "open", refuse_lock_file)
    with transaction.atomic():
        wrapper.cursor().execute("INSERT INTO t VALUES (1)")
    assert [row[0] for row in sqlite3.connect(path).execute("SELECT value FROM t")] == [1]
