"""SQLite history of evaluated specs (WAL journal: a killed server loses nothing committed)."""
from __future__ import annotations

import csv
import io
import json
import sqlite3
import sys
import threading
import time
from pathlib import Path

from merger.errors import MergerError
from merger.io import inputs
from merger.io.checkpoints import write_text_atomic

DEFAULT_PATH = Path.home() / ".merger" / "history.sqlite"  # the app's and the CLI jobs' history

FRACTION_COLUMNS = ("average_accuracy", "normalized_accuracy", "accuracy")  # in [0, 1]; the page shows percent
COLUMNS = ("id", "time", "pool", "method", "params", "experts", "split", "average_accuracy",
           "normalized_accuracy", "average_loss", "accuracy", "loss", "forward")
# A history written before rows recorded their forwards' precision (fp32, or bf16 autocast): opened, it
# is copied into today's table in one transaction, with that precision unknown (NULL), which no
# resumed job reuses.
COLUMNS_WITHOUT_PRECISION = COLUMNS[:-1]
PRECISIONS = ("fp32", "bf16")  # a row's forward: fp32, or bf16 autocast

SCHEMA = """
CREATE TABLE IF NOT EXISTS evaluations (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    time TEXT NOT NULL,
    pool TEXT NOT NULL,
    method TEXT NOT NULL,
    params TEXT NOT NULL,
    experts TEXT NOT NULL,
    split TEXT NOT NULL,
    average_accuracy REAL,
    normalized_accuracy REAL,
    average_loss REAL,
    accuracy TEXT NOT NULL,
    loss TEXT NOT NULL,
    forward TEXT,
    UNIQUE (pool, method, params, experts, split, forward)
)
"""
KEY = "pool = ? AND method = ? AND params = ? AND experts = ? AND split = ? AND forward = ?"


def params_of(spec) -> dict:
    """A row's params: the method's parameters, and its task/block weights (when any differ from 1)
    under those two names."""
    out = dict(spec.kwargs)
    out.update({k: v for k, v in spec.as_dict().items() if k in ("task_weights", "block_weights")})
    return out


class History:
    def __init__(self, path: str | Path):
        self.path = inputs.check_path(path, "--history", MergerError).expanduser()
        if self.path.is_dir():
            raise MergerError(f"--history {self.path}: is a folder; name an SQLite file")
        self._lock = threading.Lock()
        self.write_error: str | None = None  # why recording stopped (a disk that filled up), once said
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(str(self.path), check_same_thread=False, timeout=10)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute(SCHEMA)
            self._db.commit()
            found = self._columns()
            if found == COLUMNS_WITHOUT_PRECISION:
                self._add_precision()
                found = COLUMNS
            if found != COLUMNS:  # another program's table of that name, or another version's
                raise MergerError(f"--history {self.path}: its table 'evaluations' has the columns "
                                  f"{', '.join(found)[:200]}, not merger's ({', '.join(COLUMNS)}); name another file, "
                                  "or '' to turn history off")
            # a write, before any work: an existing database needs none above, so a read-only one
            # (another user's file, a read-only mount) failed only at the first result recorded
            version = self._db.execute("PRAGMA user_version").fetchone()[0]
            self._db.execute(f"PRAGMA user_version = {int(version)}")
            self._db.commit()
        except (OSError, sqlite3.Error) as exc:  # not a database, a damaged one, a folder we cannot write in
            raise MergerError(f"--history {self.path}: cannot be used as the history ({exc}); name another "
                              f"file, or '' to turn history off") from None

    def _columns(self) -> tuple:
        return tuple(row[1] for row in self._db.execute("PRAGMA table_info(evaluations)"))

    def _add_precision(self) -> None:
        """The rows of a history from before the precision was recorded, in today's table (whose
        unique key holds it): every row kept, ids and times with it; all or nothing."""
        columns = ", ".join(COLUMNS_WITHOUT_PRECISION)
        try:
            self._db.execute("BEGIN IMMEDIATE")
            if self._columns() == COLUMNS:  # another process copied it while this one waited for the lock
                self._db.rollback()
                return
            self._db.execute(SCHEMA.replace("IF NOT EXISTS evaluations", "evaluations_with_precision"))
            self._db.execute(f"INSERT INTO evaluations_with_precision ({columns}) SELECT {columns} FROM evaluations")
            # the ids given out so far (a refreshed row spent one too), so that none is given again
            spent = self._db.execute("SELECT seq FROM sqlite_sequence WHERE name = 'evaluations'").fetchone()
            self._db.execute("DROP TABLE evaluations")
            self._db.execute("ALTER TABLE evaluations_with_precision RENAME TO evaluations")
            if spent is not None:
                self._db.execute("UPDATE sqlite_sequence SET seq = max(seq, ?) WHERE name = 'evaluations'", spent)
            self._db.commit()
        except sqlite3.Error:
            self._db.rollback()
            raise

    def record(self, pool: str, spec, result) -> None:
        """Store (or refresh) one evaluated spec. A write that fails (a full disk, a file made
        read-only since) never costs the result it records: recording stops, said once on stderr
        and kept in ``write_error`` for the page to show."""
        if result.forward not in PRECISIONS:  # a NULL would add a row at each record: NULLs never collide
            raise ValueError(f"a result's forwards ran in {result.forward!r}, not one of {', '.join(PRECISIONS)}")
        row = (
            time.strftime("%Y-%m-%d %H:%M:%S"), pool, spec.method, json.dumps(params_of(spec), sort_keys=True),
            ",".join(spec.experts), result.split, result.average_accuracy,
            result.normalized_accuracy if result.expert_accuracy else None, result.average_loss,
            json.dumps(result.accuracy), json.dumps(result.loss), result.forward,
        )
        with self._lock:
            if self.write_error is not None:
                return
            try:
                self._upsert(row)
            except sqlite3.Error as exc:
                self.write_error = (f"--history {self.path}: cannot record results any more ({exc}); nothing "
                                    "after this is kept")
                print(f"warning: {self.write_error}", file=sys.stderr, flush=True)

    def _upsert(self, row: tuple) -> None:
        # A row evaluated before only gets its new time: updated first, since an upsert that finds
        # the row still spends an AUTOINCREMENT id (ids 1, 4 after three of the same). The upsert
        # stays for a row another process adds in between.
        if self._db.execute(f"UPDATE evaluations SET time = ? WHERE {KEY}", (*row[:6], row[-1])).rowcount == 0:
            self._db.execute(f"INSERT INTO evaluations ({', '.join(COLUMNS[1:])}) VALUES ({', '.join('?' * 12)}) "
                             "ON CONFLICT (pool, method, params, experts, split, forward) "
                             "DO UPDATE SET time = excluded.time", row)
        self._db.commit()

    def rows(self, method: str | None = None, pool: str | None = None, split: str | None = None,
             text: str | None = None, limit: int = 500) -> list[dict]:
        where, args = [], []
        for col, value in (("method", method), ("pool", pool), ("split", split)):
            if value:
                where.append(f"{col} = ?")
                args.append(value)
        text = (text or "").strip()
        if text:
            def like(t, tail="%"):  # the text itself: % and _ are not wildcards here
                return "%" + t.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + tail

            # "lam=0.3" as the summary writes it finds the stored '"lam": 0.3' (that value, not 0.35);
            # experts are stored "a,b" and shown "a, b": either form finds them
            ors = [("method", like(text)), ("params", like(text)), ("experts", like(text.replace(", ", ",")))]
            name, sep, value = (part.strip() for part in text.partition("="))
            if sep and name and value:
                try:  # w[shape=0] is stored as 0.0, agree=2.0 as 2
                    number = float(value)
                    forms = {value, json.dumps(number)} | ({str(int(number))} if number.is_integer() else set())
                except (ValueError, OverflowError):
                    forms = {value}
                ors += [("params", like(f'"{name}": {f}', tail)) for f in sorted(forms) for tail in (",%", "}%")]
            where.append("(" + " OR ".join(f"{col} LIKE ? ESCAPE '\\'" for col, _ in ors) + ")")
            args += [pattern for _, pattern in ors]
        sql = "SELECT * FROM evaluations" + (" WHERE " + " AND ".join(where) if where else "")
        sql += " ORDER BY time DESC, id DESC LIMIT ?"
        with self._lock:
            cur = self._db.execute(sql, (*args, int(limit)))
            return [dict(zip(COLUMNS, r)) for r in cur.fetchall()]

    def find(self, pool: str, spec, split: str, forward: str) -> dict | None:
        """The row of one spec on one split with forwards in that precision, or None (a resumed job
        skips what it finds)."""
        key = (pool, spec.method, json.dumps(params_of(spec), sort_keys=True), ",".join(spec.experts), split, forward)
        with self._lock:
            r = self._db.execute(f"SELECT * FROM evaluations WHERE {KEY}", key).fetchone()
        return dict(zip(COLUMNS, r)) if r else None

    def best(self, pool: str, method: str, experts, forward: str, split: str = "val") -> tuple[dict, int] | None:
        """(the row of highest average accuracy, how many rows were compared) among one method's
        evaluations of exactly these experts on one split with forwards in that precision, or None
        when there are none."""
        key = (pool, method, ",".join(experts), split, forward)
        where = "WHERE pool = ? AND method = ? AND experts = ? AND split = ? AND forward = ?"
        with self._lock:
            r = self._db.execute(f"SELECT * FROM evaluations {where} ORDER BY average_accuracy DESC, id LIMIT 1",
                                 key).fetchone()
            n = self._db.execute(f"SELECT COUNT(*) FROM evaluations {where}", key).fetchone()[0]
        return (dict(zip(COLUMNS, r)), n) if r else None

    def get(self, row_id: int) -> dict | None:
        with self._lock:
            r = self._db.execute("SELECT * FROM evaluations WHERE id = ?", (int(row_id),)).fetchone()
        return dict(zip(COLUMNS, r)) if r else None

    def export_csv(self, path: str | Path, **filters) -> Path:
        """The rows as CSV; accuracies as stored, fractions in [0, 1], which the header says (the page
        shows percent)."""
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=COLUMNS)
        csv.writer(buf).writerow([f"{c} (fraction)" if c in FRACTION_COLUMNS else c for c in COLUMNS])
        for r in self.rows(limit=1_000_000, **filters):
            w.writerow(r)
        return write_text_atomic(path, buf.getvalue())

    def close(self) -> None:
        with self._lock:
            self._db.close()
