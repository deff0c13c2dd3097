"""Django's SQLite backend, with a process's write transactions queued on a lock instead of polling.

SQLite has one writer at a time. A connection that finds the write lock taken retries in its busy
handler, sleeping up to 100 ms between tries (`sqliteDefaultBusyCallback`), so under 8-32 threads of
one web server a waiter keeps missing the short gaps between other writers' transactions and, after
the busy timeout, fails with `database is locked` although no transaction held the lock for long:
measured on `bench/submit_load.py`, lock waits of 3-10 s behind transactions held 40-200 ms, and
500s. Here the threads of one process take a lock before `BEGIN IMMEDIATE` and give it back at
commit or rollback: a waiter is woken as soon as the lock is free, and only one thread per process
meets SQLite's busy handler (against the other processes: the Celery worker, the management commands).

In-memory databases (the test suite's) are left as Django makes them: they are private to a process
and must not wait on a test's own outer transaction.
"""
from __future__ import annotations

import os
import threading

from django.db.backends.sqlite3 import base

_locks: dict[str, threading.Lock] = {}
_locks_guard = threading.Lock()


def _write_lock(name: str) -> threading.Lock:
    with _locks_guard:
        return _locks.setdefault(name, threading.Lock())


def _fresh_locks_in_child() -> None:
    """A forked child (a prefork worker, a preloading server) must not inherit a lock that a thread of
    its parent held at the fork: nobody in the child would ever release it."""
    global _locks_guard
    _locks_guard = threading.Lock()
    _locks.clear()


os.register_at_fork(after_in_child=_fresh_locks_in_child)


_closed_files: set[str] = set()


def _owner_only(path: str) -> None:
    """The database holds every tenant's jobs and their env: readable by the broker's user only
    (jobs on a demo node run on this machine as another user). SQLite gives its -wal and -shm files
    the database's mode whenever it creates them again, so once per process is enough: a connection
    is opened per request, and these chmods need not be."""
    if path in _closed_files:
        return
    _closed_files.add(path)
    for name in (path, f"{path}-wal", f"{path}-shm"):
        try:
            os.chmod(name, 0o600)
        except FileNotFoundError:
            pass
        except PermissionError:  # another user's database file: SQLite would refuse writes anyway
            pass


class DatabaseWrapper(base.DatabaseWrapper):
    _held_lock: threading.Lock | None = None

    def _start_transaction_under_autocommit(self) -> None:
        if not self.is_in_memory_db():
            lock = _write_lock(str(self.settings_dict["NAME"]))
            # Bounded like SQLite's own wait; past it, BEGIN meets the busy handler as it would without us.
            timeout = float(self.settings_dict.get("OPTIONS", {}).get("timeout", 5))
            if lock.acquire(timeout=timeout):
                self._held_lock = lock
        try:
            super()._start_transaction_under_autocommit()
        except BaseException:
            self._release_write_lock()
            raise

    def _release_write_lock(self) -> None:
        lock, self._held_lock = self._held_lock, None
        if lock is not None:
            lock.release()

    def _commit(self) -> None:
        try:
            super()._commit()
        finally:
            self._release_write_lock()

    def _rollback(self) -> None:
        try:
            super()._rollback()
        finally:
            self._release_write_lock()

    def get_new_connection(self, conn_params):
        connection = super().get_new_connection(conn_params)
        if not self.is_in_memory_db():
            _owner_only(str(self.settings_dict["NAME"]))
        return connection

    def _close(self) -> None:
        try:
            super()._close()
        finally:
            self._release_write_lock()
