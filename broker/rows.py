"""Statements for hot paths (the scheduling cycle's bulk inserts, every agent's heartbeat, the token
lookups every request starts with), without Django compiling a statement per call.

`QuerySet.bulk_create` compiles a many-placeholder INSERT (every value prepared and placed by the SQL
compiler) and, on PostgreSQL, psycopg then parses it client-side: for a cycle placing 5,000 jobs that was
most of the commit (bench.service). Here the values are prepared once per field as Django would save them
(defaults, `auto_now_add`, JSON), then sent by `COPY ... FROM STDIN` on PostgreSQL and by one
executemany elsewhere (SQLite prepares the statement once). Constraints still apply: a violated one
raises Django's IntegrityError, so callers roll back as with bulk_create. No signals are sent, as with
bulk_create."""
from __future__ import annotations

import functools
from typing import Any, Callable, Iterable, Sequence

from django.db import DEFAULT_DB_ALIAS, connection, connections, models, transaction
from django.utils import timezone

_UNSET = object()


def values_insert(model: type[models.Model], columns: Sequence[str], rows: Iterable[Sequence[Any]], *,
                  ignore_conflicts: bool = False, integers: bool = False) -> None:
    """Insert rows of already database-ready values for the named fields of `model`. `ignore_conflicts`:
    a row a unique constraint refuses is skipped (`ON CONFLICT DO NOTHING`, one prepared statement sent
    per row: COPY cannot skip rows). `integers`: the caller's word that every value is an int or a bool;
    on PostgreSQL the rows are then written as COPY text in one piece (psycopg's `write_row` adapts
    value by value: 0.1 s of the cycle's 45,000 slot rows)."""
    meta = model._meta
    quote = connection.ops.quote_name
    names = ", ".join(quote(meta.get_field(name).column) for name in columns)
    table = quote(meta.db_table)
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql" and not ignore_conflicts:
            # Errors wrapped as Django's, so an IntegrityError still reaches the caller's rollback.
            with connection.wrap_database_errors, cursor.cursor.copy(f"COPY {table} ({names}) FROM STDIN") as copy:
                if integers:  # str() of an int is its COPY text; of a bool, "True"/"False", which boolean reads
                    copy.write("".join("\t".join(map(str, row)) + "\n" for row in rows))
                else:
                    for row in rows:
                        copy.write_row(row)
        else:
            marks = ", ".join(["%s"] * len(columns))
            tail = " ON CONFLICT DO NOTHING" if ignore_conflicts else ""
            cursor.executemany(f"INSERT INTO {table} ({names}) VALUES ({marks}){tail}", [tuple(row) for row in rows])


def fields_insert(model: type[models.Model], rows: list[dict[str, Any]], *, with_ids: bool = False,
                  ignore_conflicts: bool = False) -> list[int]:
    """Insert rows given as {attname: value} (a foreign key by its id: `job_id`) without a model
    instance per row: every field a row leaves out takes its default, computed once for the insert
    (`auto_now`/`auto_now_add`: one timestamp), and every value is prepared as `save()` would. For
    the cycle's thousands of allocations, state events and meters, building instances only to
    read their fields back was a fifth of the commit (bench.service). Every row must name the same
    fields. `with_ids`: returns the new primary keys in row order (PostgreSQL: drawn from the
    table's sequence in one query, then COPY; elsewhere through instances and `bulk_create`).
    `ignore_conflicts`: as `values_insert`'s (not with `with_ids`)."""
    if not rows:
        return []
    meta = model._meta
    unknown = set(rows[0]) - {f.attname for f in meta.concrete_fields}
    if unknown:
        raise ValueError(f"{meta.label} has no field {', '.join(sorted(unknown))}")
    if with_ids and connection.vendor != "postgresql":
        objs = [model(**row) for row in rows]
        model.objects.bulk_create(objs)
        return [obj.pk for obj in objs]
    given = list(rows[0])
    # The wrapper itself, not the `connection` proxy: each attribute read through the proxy is a
    # thread-local lookup, a third of the preparing time for 5,000 rows.
    wrapper = connections[DEFAULT_DB_ALIAS]
    now = timezone.now()
    ids: list[int] = []
    if with_ids:
        with connection.cursor() as cursor:
            cursor.execute("SELECT nextval(pg_get_serial_sequence(%s, %s)) FROM generate_series(1, %s)",
                           [meta.db_table, meta.pk.column, len(rows)])
            ids = [value for (value,) in cursor.fetchall()]
    names: list[str] = []
    columns: list[list[Any]] = []
    for f in meta.concrete_fields:
        if f.primary_key:
            if with_ids:
                names.append(f.name)
                columns.append(ids)
            continue
        names.append(f.name)
        if f.attname in given:
            last, prepared, values = _UNSET, None, []
            for row in rows:
                value = row[f.attname]
                if value is not last:  # rows often share a value: prepared once
                    last, prepared = value, f.get_db_prep_save(value, wrapper)
                values.append(prepared)
            columns.append(values)
        else:
            stamped = getattr(f, "auto_now", False) or getattr(f, "auto_now_add", False)
            default = now if stamped else (f.get_default() if f.has_default() else None)
            columns.append([f.get_db_prep_save(default, wrapper)] * len(rows))
    values_insert(model, names, zip(*columns), ignore_conflicts=ignore_conflicts)
    return ids


# Rows per statement of rows_update on PostgreSQL: a chunk of the cycle's writes in one statement.
ROWS_PER_UPDATE = 1000


def rows_update(model: type[models.Model], fields: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """`UPDATE model SET fields = values WHERE pk = key` for many rows, each (values..., key) with the
    values already prepared for the database (`get_db_prep_save`). On PostgreSQL one statement per
    `ROWS_PER_UPDATE` rows joins the table to a VALUES list: an executemany sends a statement per row,
    and the cycle's 2,000 node epochs took 0.1 s that way (bench.service). SQLite runs in-process,
    where the executemany is as fast."""
    if not rows:
        return
    meta, quote = model._meta, connection.ops.quote_name
    table, key = quote(meta.db_table), quote(meta.pk.column)
    columns = [meta.get_field(name) for name in fields]
    with connection.cursor() as cursor:
        if connection.vendor != "postgresql":
            cursor.executemany(f"UPDATE {table} SET " + ", ".join(f"{quote(f.column)} = %s" for f in columns)
                               + f" WHERE {key} = %s", [tuple(row) for row in rows])
            return
        names = [f"c{i}" for i in range(len(columns))]
        # VALUES gives literals the type `text` or `integer`: each is cast to its column's type.
        sets = ", ".join(f"{quote(f.column)} = v.{n}::{f.cast_db_type(connection)}" for f, n in zip(columns, names))
        marks = "(" + ", ".join(["%s"] * (len(columns) + 1)) + ")"
        for start in range(0, len(rows), ROWS_PER_UPDATE):
            part = rows[start:start + ROWS_PER_UPDATE]
            cursor.execute(f"UPDATE {table} SET {sets} FROM (VALUES {', '.join([marks] * len(part))}) "
                           f"AS v({', '.join(names)}, k) WHERE {table}.{key} = v.k",
                           [value for row in part for value in row])


def row_update(model: type[models.Model], values: dict[str, Any], where: dict[str, Any], *,
               unless: dict[str, Any] | None = None, returning: str | None = None) -> Any:
    """`UPDATE model SET values WHERE where (AND NOT unless)`, one statement written by hand: for the
    calls every agent makes every few seconds, where compiling `QuerySet.update` was most of its cost.
    Fields by name (a foreign key by its field name, given the id); values prepared as Django saves them
    (JSON included). Returns the number of rows changed, or with `returning` (PostgreSQL; SQLite since
    3.35) that field's value of the changed row, None when no row changed."""
    meta, quote = model._meta, connection.ops.quote_name

    def column(name: str) -> str:
        return quote(meta.pk.column if name in ("pk", "id") else meta.get_field(name).column)

    def prepared(name: str, value: Any) -> Any:
        field = meta.pk if name in ("pk", "id") else meta.get_field(name)
        return field.get_db_prep_save(value, connection)

    unless = unless or {}
    sql = (f"UPDATE {quote(meta.db_table)} SET {', '.join(f'{column(n)} = %s' for n in values)} WHERE "
           + " AND ".join([f"{column(n)} = %s" for n in where] + [f"{column(n)} <> %s" for n in unless])
           + (f" RETURNING {column(returning)}" if returning else ""))
    params = ([prepared(n, v) for n, v in values.items()] + [prepared(n, v) for n, v in where.items()]
              + [prepared(n, v) for n, v in unless.items()])
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        if returning:
            row = cursor.fetchone()
            return row[0] if row else None
        return cursor.rowcount


class CompiledRead:
    """A read on a hot path whose SQL the ORM writes once per database instead of on every call: the
    authentications every API and agent request starts with, where compiling the same query (its
    joins, filters and columns) was most of the lookup's CPU (bench.service, py-spy).

    `build(value)` returns the `values_list` queryset for one value of the query's one varying
    parameter. At first use per database the queryset is compiled with a marker in that value's place;
    each `rows(value)` then runs the SQL with the value put back and applies the columns' converters,
    as the ORM's own iteration would. `varying=False`: a query without one (`build(None)`, `rows()`);
    `INT_MARKER` for a value the ORM prepares as an integer (an id), which a string marker cannot stand for."""

    _MARKER = "\x00compiled-read\x00"
    INT_MARKER = -(2**62) + 12  # no id is ever this

    def __init__(self, build: Callable[[Any], models.QuerySet], *, varying: bool = True, marker: Any = _MARKER) -> None:
        self._build = build
        self._varying = varying
        self._marker = marker
        self._compiled: dict[str, tuple[str, list[Any], int, list[tuple[int, list, Any]]]] = {}

    def _compile(self, alias: str) -> tuple[str, list[Any], int | None, list[tuple[int, list, Any]]]:
        compiler = self._build(self._marker if self._varying else None).query.get_compiler(using=alias)
        sql, params = compiler.as_sql()
        at = [i for i, param in enumerate(params) if type(param) is type(self._marker) and param == self._marker]
        if len(at) != (1 if self._varying else 0):
            raise ValueError(f"the query must use its value once, not {len(at)} times")
        converters = compiler.get_converters([expression for expression, _, _ in compiler.select])
        return (sql, list(params), at[0] if at else None,
                [(i, convs, expression) for i, (convs, expression) in converters.items()])

    def rows(self, value: Any = None, *, using: str = DEFAULT_DB_ALIAS) -> list[list[Any]]:
        compiled = self._compiled.get(using)
        if compiled is None:
            compiled = self._compiled[using] = self._compile(using)
        sql, params, at, converters = compiled
        if at is not None:
            params = [*params[:at], value, *params[at + 1:]]
        connection = connections[using]
        with connection.cursor() as cursor:
            cursor.execute(sql, params)
            found = [list(row) for row in cursor.fetchall()]
        for row in found:
            for index, convs, expression in converters:
                for converter in convs:
                    row[index] = converter(row[index], expression, connection)
        return found


def _insert_columns(obj: models.Model, connection: Any, *, skip: str = "") -> tuple[list[str], list[Any]]:
    """The quoted columns and database-ready values of an unsaved instance, as `save()` would write them:
    `pre_save` stamps `auto_now`/`auto_now_add` (on the instance too), values prepared for the database.
    The primary key is left to the database; `skip` names a field the caller writes itself."""
    fields, columns = _insert_fields(type(obj), connection.vendor, skip)
    return columns, [f.get_db_prep_save(f.pre_save(obj, True), connection) for f in fields]


@functools.cache
def _insert_fields(model: type[models.Model], vendor: str, skip: str) -> tuple[list[Any], list[str]]:
    quote = connections[DEFAULT_DB_ALIAS].ops.quote_name
    fields = [f for f in model._meta.concrete_fields if not f.primary_key and f.name != skip]
    return fields, [quote(f.column) for f in fields]


def _inserted(obj: models.Model, pk: Any, alias: str) -> None:
    obj.pk = pk
    obj._state.adding = False
    obj._state.db = alias


def instance_with_child_insert(parent: models.Model, child: models.Model, link: str) -> None:
    """Insert the unsaved `parent` and the unsaved `child` whose foreign key `link` points to it, both or
    neither, and set both instances' primary keys as `save()` would. On PostgreSQL it is one statement
    (the child's INSERT takes the id the parent's INSERT ... RETURNING gives): in autocommit
    that needs neither BEGIN nor COMMIT, three round trips of every submission (a job and its
    "submitted" event; bench.service). Elsewhere two INSERTs in one transaction. As with bulk inserts,
    no signals are sent and neither `save()` runs; constraints apply as usual."""
    link_field = child._meta.get_field(link)
    connection = connections[DEFAULT_DB_ALIAS]
    quote = connection.ops.quote_name
    parent_columns, parent_values = _insert_columns(parent, connection)
    child_columns, child_values = _insert_columns(child, connection, skip=link)
    parent_pk, child_pk = quote(parent._meta.pk.column), quote(child._meta.pk.column)
    parent_sql = (f"INSERT INTO {quote(parent._meta.db_table)} ({', '.join(parent_columns)}) "
                  f"VALUES ({', '.join(['%s'] * len(parent_values))}) RETURNING {parent_pk}")
    if connection.vendor == "postgresql":
        sql = (f"WITH parent AS ({parent_sql}) INSERT INTO {quote(child._meta.db_table)} "
               f"({quote(link_field.column)}, {', '.join(child_columns)}) "
               f"VALUES ((SELECT {parent_pk} FROM parent), {', '.join(['%s'] * len(child_values))}) "
               f"RETURNING {quote(link_field.column)}, {child_pk}")
        with connection.cursor() as cursor:
            cursor.execute(sql, parent_values + child_values)
            new_parent, new_child = cursor.fetchone()
    else:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(parent_sql, parent_values)
            (new_parent,) = cursor.fetchone()
            cursor.execute(f"INSERT INTO {quote(child._meta.db_table)} ({quote(link_field.column)}, "
                           f"{', '.join(child_columns)}) VALUES ({', '.join(['%s'] * (len(child_values) + 1))}) "
                           f"RETURNING {child_pk}", [new_parent, *child_values])
            (new_child,) = cursor.fetchone()
    _inserted(parent, new_parent, DEFAULT_DB_ALIAS)
    setattr(child, link_field.attname, new_parent)
    _inserted(child, new_child, DEFAULT_DB_ALIAS)
