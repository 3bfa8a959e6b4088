"""The service's durable state in one embedded SQLite database (`STATE_DIR/registry.sqlite3`):
API keys (stored as SHA-256 digests, never in clear), sessions, training runs and checkpoints.

A checkpoint row is inserted only after its `.state` folder is complete on disk (manifest written,
renamed into place), in one transaction; a server killed mid-save therefore leaves at most an
unregistered folder, which `sweep_orphans` removes at the next start. Every read takes the owner:
a row of another owner is indistinguishable from a missing one.
"""
from __future__ import annotations

import hashlib
import json
import secrets
import sqlite3
import threading
import time
from dataclasses import dataclass

POLICIES = ("rollout-enabled", "actor-only")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS api_keys (key_sha256 TEXT PRIMARY KEY, owner TEXT NOT NULL, policy TEXT NOT NULL,
    created REAL NOT NULL);
CREATE TABLE IF NOT EXISTS sessions (session_id TEXT PRIMARY KEY, owner TEXT NOT NULL, created REAL NOT NULL,
    finished REAL, tags TEXT, user_metadata TEXT);
CREATE TABLE IF NOT EXISTS runs (run_id TEXT PRIMARY KEY, session_id TEXT NOT NULL, owner TEXT NOT NULL,
    base_model TEXT NOT NULL, lora TEXT NOT NULL, user_metadata TEXT, created REAL NOT NULL,
    last_request REAL NOT NULL);
CREATE TABLE IF NOT EXISTS checkpoints (tinker_path TEXT PRIMARY KEY, storage_id TEXT NOT NULL UNIQUE,
    owner TEXT NOT NULL, session_id TEXT NOT NULL, run_id TEXT NOT NULL, kind TEXT NOT NULL, name TEXT NOT NULL,
    step INTEGER NOT NULL, files TEXT NOT NULL, size_bytes INTEGER NOT NULL, created REAL NOT NULL,
    expires_at REAL, user_metadata TEXT, public INTEGER NOT NULL DEFAULT 0);
CREATE INDEX IF NOT EXISTS checkpoints_session ON checkpoints (owner, session_id);
CREATE INDEX IF NOT EXISTS checkpoints_run ON checkpoints (owner, run_id);
"""


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def key_id(digest: str) -> str:
    """The public name of a key (its digest's first 12 hex digits): what `keys list` shows and
    `keys revoke` takes, and what a signed URL is bound to."""
    return digest[:12]


@dataclass
class Caller:
    owner: str
    policy: str
    key_id: str = ""
    local: bool = True  # the request came from this machine (loopback)

    @property
    def may_sample(self) -> bool:
        return self.policy == "rollout-enabled"


@dataclass
class CheckpointRow:
    tinker_path: str
    storage_id: str
    owner: str
    session_id: str
    run_id: str
    kind: str  # "training" | "sampler"
    name: str
    step: int
    files: dict  # file name -> {"bytes", "sha256"}
    size_bytes: int
    created: float
    expires_at: float | None
    user_metadata: dict | None
    public: bool = False  # published: loadable (read-only) by every owner of this server

    @property
    def checkpoint_id(self) -> str:
        return self.tinker_path.split("/", 3)[3]  # "weights/NAME" | "sampler_weights/NAME"


class Registry:
    def __init__(self, path):
        self.path = str(path)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)
        columns = {r[1] for r in self._db.execute("PRAGMA table_info(checkpoints)").fetchall()}
        if "public" not in columns:  # a registry written before checkpoints could be published
            self._db.execute("ALTER TABLE checkpoints ADD COLUMN public INTEGER NOT NULL DEFAULT 0")

    def _q(self, sql: str, args=()) -> list[tuple]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    def _tx(self, statements: list[tuple[str, tuple]]) -> None:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                for sql, args in statements:
                    self._db.execute(sql, args)
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    # ---- keys ------------------------------------------------------------------------------------
    def create_key(self, owner: str, policy: str = "rollout-enabled") -> str:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        key = "tml-" + secrets.token_urlsafe(32)
        self._tx([("INSERT INTO api_keys VALUES (?, ?, ?, ?)", (key_digest(key), owner, policy, time.time()))])
        return key

    def has_keys(self) -> bool:
        return bool(self._q("SELECT 1 FROM api_keys LIMIT 1"))

    def caller(self, key: str) -> Caller | None:
        digest = key_digest(key)
        rows = self._q("SELECT owner, policy FROM api_keys WHERE key_sha256 = ?", (digest,))
        return Caller(rows[0][0], rows[0][1], key_id(digest)) if rows else None

    def keys(self) -> list[dict]:
        rows = self._q("SELECT key_sha256, owner, policy, created FROM api_keys ORDER BY created")
        return [{"key_id": key_id(d), "owner": o, "policy": p, "created": c} for d, o, p, c in rows]

    def revoke_key(self, kid: str) -> dict | None:
        """Delete the key named by its id (see key_id); its signed URLs stop working too."""
        if not kid or len(kid) < 6 or any(c not in "0123456789abcdef" for c in kid):
            return None
        rows = self._q("SELECT key_sha256, owner, policy, created FROM api_keys WHERE key_sha256 LIKE ?", (kid + "%",))
        if len(rows) != 1:
            return None
        self._tx([("DELETE FROM api_keys WHERE key_sha256 = ?", (rows[0][0],))])
        return {"key_id": key_id(rows[0][0]), "owner": rows[0][1], "policy": rows[0][2], "created": rows[0][3]}

    def key_owner(self, kid: str) -> str | None:
        """The owner of the live key with this id (None once revoked)."""
        if len(kid) != 12 or any(c not in "0123456789abcdef" for c in kid):
            return None
        rows = self._q("SELECT owner FROM api_keys WHERE key_sha256 LIKE ?", (kid + "%",))
        return rows[0][0] if len(rows) == 1 else None

    # ---- sessions and runs -------------------------------------------------------------------------
    def add_session(self, session_id: str, owner: str, tags, user_metadata) -> None:
        self._tx([("INSERT INTO sessions VALUES (?, ?, ?, NULL, ?, ?)",
                   (session_id, owner, time.time(), json.dumps(tags or []), json.dumps(user_metadata or {})))])

    def session_owner(self, session_id: str) -> str | None:
        rows = self._q("SELECT owner FROM sessions WHERE session_id = ?", (session_id,))
        return rows[0][0] if rows else None

    def finish_session(self, session_id: str, owner: str) -> None:
        self._tx([("UPDATE sessions SET finished = ? WHERE session_id = ? AND owner = ?",
                   (time.time(), session_id, owner))])

    def session(self, session_id: str, owner: str) -> dict | None:
        rows = self._q("SELECT created, finished FROM sessions WHERE session_id = ? AND owner = ?", (session_id, owner))
        if not rows:
            return None
        runs = [r[0] for r in self._q("SELECT run_id FROM runs WHERE session_id = ? ORDER BY created", (session_id,))]
        return {"session_id": session_id, "created": rows[0][0], "finished": rows[0][1], "training_run_ids": runs}

    def add_run(self, run_id: str, session_id: str, owner: str, base_model: str, lora: dict, user_metadata) -> None:
        now = time.time()
        self._tx([("INSERT OR REPLACE INTO runs VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                   (run_id, session_id, owner, base_model, json.dumps(lora), json.dumps(user_metadata or {}), now, now))])

    def touch_run(self, run_id: str) -> None:
        self._tx([("UPDATE runs SET last_request = ? WHERE run_id = ?", (time.time(), run_id))])

    def run(self, run_id: str, owner: str) -> dict | None:
        rows = self._q("SELECT run_id, session_id, owner, base_model, lora, user_metadata, created, last_request "
                       "FROM runs WHERE run_id = ? AND owner = ?", (run_id, owner))
        return _run_dict(rows[0]) if rows else None

    def runs(self, owner: str, limit: int, offset: int) -> tuple[list[dict], int]:
        rows = self._q("SELECT run_id, session_id, owner, base_model, lora, user_metadata, created, last_request "
                       "FROM runs WHERE owner = ? ORDER BY created DESC LIMIT ? OFFSET ?", (owner, limit, offset))
        total = self._q("SELECT COUNT(*) FROM runs WHERE owner = ?", (owner,))[0][0]
        return [_run_dict(r) for r in rows], total

    # ---- checkpoints -------------------------------------------------------------------------------
    def add_checkpoint(self, row: CheckpointRow, replace: bool) -> None:
        stmts = []
        if replace:
            stmts.append(("DELETE FROM checkpoints WHERE tinker_path = ?", (row.tinker_path,)))
        stmts.append((f"INSERT INTO checkpoints ({self._COLS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                      (row.tinker_path, row.storage_id, row.owner, row.session_id, row.run_id, row.kind, row.name,
                       row.step, json.dumps(row.files), row.size_bytes, row.created, row.expires_at,
                       json.dumps(row.user_metadata) if row.user_metadata is not None else None, int(row.public))))
        self._tx(stmts)

    _COLS = ("tinker_path, storage_id, owner, session_id, run_id, kind, name, step, files, size_bytes, created, "
             "expires_at, user_metadata, public")

    def checkpoint(self, tinker_path: str, owner: str) -> CheckpointRow | None:
        rows = self._q(f"SELECT {self._COLS} FROM checkpoints WHERE tinker_path = ? AND owner = ? "
                       "AND (expires_at IS NULL OR expires_at > ?)", (tinker_path, owner, time.time()))
        return _ckpt(rows[0]) if rows else None

    def readable_checkpoint(self, tinker_path: str, owner: str) -> CheckpointRow | None:
        """The owner's own checkpoint, or anyone's published one (read-only uses: load, sample, copy)."""
        rows = self._q(f"SELECT {self._COLS} FROM checkpoints WHERE tinker_path = ? AND (owner = ? OR public = 1) "
                       "AND (expires_at IS NULL OR expires_at > ?)", (tinker_path, owner, time.time()))
        return _ckpt(rows[0]) if rows else None

    def set_public(self, tinker_path: str, owner: str, public: bool) -> bool:
        found = self.checkpoint(tinker_path, owner) is not None
        if found:
            self._tx([("UPDATE checkpoints SET public = ? WHERE tinker_path = ?", (int(public), tinker_path))])
        return found

    def checkpoint_by_storage(self, storage_id: str) -> CheckpointRow | None:
        rows = self._q(f"SELECT {self._COLS} FROM checkpoints WHERE storage_id = ? "
                       "AND (expires_at IS NULL OR expires_at > ?)", (storage_id, time.time()))
        return _ckpt(rows[0]) if rows else None

    def checkpoints(self, owner: str, *, run_id: str | None = None, session_id: str | None = None,
                    limit: int = 100, offset: int = 0) -> tuple[list[CheckpointRow], int]:
        where, args = ["owner = ?", "(expires_at IS NULL OR expires_at > ?)"], [owner, time.time()]
        if run_id is not None:
            where.append("run_id = ?")
            args.append(run_id)
        if session_id is not None:
            where.append("session_id = ?")
            args.append(session_id)
        cond = " AND ".join(where)
        rows = self._q(f"SELECT {self._COLS} FROM checkpoints WHERE {cond} ORDER BY created DESC, tinker_path "
                       "LIMIT ? OFFSET ?", (*args, limit, offset))
        total = self._q(f"SELECT COUNT(*) FROM checkpoints WHERE {cond}", tuple(args))[0][0]
        return [_ckpt(r) for r in rows], total

    def set_ttl(self, tinker_path: str, owner: str, expires_at: float | None) -> bool:
        found = bool(self._q("SELECT 1 FROM checkpoints WHERE tinker_path = ? AND owner = ?", (tinker_path, owner)))
        if found:
            self._tx([("UPDATE checkpoints SET expires_at = ? WHERE tinker_path = ?", (expires_at, tinker_path))])
        return found

    def delete_checkpoint(self, tinker_path: str, owner: str) -> CheckpointRow | None:
        row = self.checkpoint(tinker_path, owner)
        if row is not None:
            self._tx([("DELETE FROM checkpoints WHERE tinker_path = ?", (tinker_path,))])
        return row

    def expired(self) -> list[CheckpointRow]:
        rows = self._q(f"SELECT {self._COLS} FROM checkpoints WHERE expires_at IS NOT NULL AND expires_at <= ?",
                       (time.time(),))
        return [_ckpt(r) for r in rows]

    def forget(self, tinker_path: str) -> None:
        self._tx([("DELETE FROM checkpoints WHERE tinker_path = ?", (tinker_path,))])

    def disk_bytes(self, owner: str) -> int:
        """Bytes of the owner's registered (unexpired) checkpoints."""
        return int(self._q("SELECT COALESCE(SUM(size_bytes), 0) FROM checkpoints WHERE owner = ? AND "
                           "(expires_at IS NULL OR expires_at > ?)", (owner, time.time()))[0][0])

    def storage_ids(self) -> set[str]:
        return {r[0] for r in self._q("SELECT storage_id FROM checkpoints")}


def _run_dict(r) -> dict:
    return {"run_id": r[0], "session_id": r[1], "owner": r[2], "base_model": r[3], "lora": json.loads(r[4]),
            "user_metadata": json.loads(r[5]) if r[5] else None, "created": r[6], "last_request": r[7]}


def _ckpt(r) -> CheckpointRow:
    return CheckpointRow(r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7], json.loads(r[8]), r[9], r[10], r[11],
                         json.loads(r[12]) if r[12] else None, bool(r[13]))
