"""Django's SQLite backend, with a process's write transactions queued on a lock instead of polling.

SQLite has one writer at a time. A connection that finds the write lock taken retries in its busy
handler, sleeping up to 100 ms between tries (`sqliteDefaultBusyCallback`), so under 8-32 threads of
one web server a waiter keeps missing the short gaps between other writers' transactions and, after
the busy timeout, fails with `database is locked` although no transaction held the lock for long:
measured on `bench/submit_load.py`, lock waits of 3-10 s behind transactions held 40-200 ms, and
500s. Here the threads of one process take a lock before `BEGIN IMMEDIATE` and give it back at
commit or rollback: a waiter is woken as soon as the lock is free, and only one thread per process
would meet SQLite's busy handler (against the other processes: the web server's other processes, the
Celery worker, the management commands). Between processes the writer then takes an exclusive `flock` on
`<database>-writelock`, polled every half millisecond: the next process's writer starts within about half
a millisecond of a commit instead of after the busy handler's next sleep (up to 100 ms), and a process
that dies releases it with its descriptors. Anything that writes without this backend (the `sqlite3`
shell) still meets the busy handler, as before.

In-memory databases (the test suite's) are left as Django makes them: they are private to a process
and must not wait on a test's own outer transaction.
"""
from __future__ import annotations

import os
import threading
import time

from django.db.backends.sqlite3 import base

from broker import file_locks

_locks: dict[str, threading.Lock] = {}
_locks_guard = threading.Lock()


def _write_lock(name: str) -> threading.Lock:
    with _locks_guard:
        return _locks.setdefault(name, threading.Lock())


def _lock_file(name: str) -> int | None:
    """This process's descriptor of the database's lock file (called with the process's write lock held);
    None where it cannot be opened (a directory that is not ours to write): SQLite's busy handler alone
    then, as before there was a lock file."""
    try:
        return file_locks.lock_descriptor(f"{name}-writelock")
    except OSError:
        return None


def _fresh_locks_in_child() -> None:
    """A forked child (a prefork worker, a preloading server) must not inherit a lock that a thread of
    its parent held at the fork: nobody in the child would ever release it. (The lock file's descriptors
    are broker/file_locks.py's, which a child opens afresh.)"""
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
    _held_file: int | None = None

    def _start_transaction_under_autocommit(self) -> None:
        if not self.is_in_memory_db():
            name = str(self.settings_dict["NAME"])
            lock = _write_lock(name)
            # Bounded like SQLite's own wait; past it, BEGIN meets the busy handler as it would without us.
            timeout = float(self.settings_dict.get("OPTIONS", {}).get("timeout", 5))
            started = time.monotonic()
            if lock.acquire(timeout=timeout):
                self._held_lock = lock
                try:
                    fd = _lock_file(name)
                    if fd is not None and file_locks.take(fd, max(0.0, timeout - (time.monotonic() - started))):
                        self._held_file = fd
                except BaseException:
                    self._release_write_lock()
                    raise
        try:
            super()._start_transaction_under_autocommit()
        except BaseException:
            self._release_write_lock()
            raise

    def _release_write_lock(self) -> None:
        fd, self._held_file = self._held_file, None
        lock, self._held_lock = self._held_lock, None
        try:
            if fd is not None:
                file_locks.give_back(fd)
        finally:
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
