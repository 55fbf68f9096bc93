"""The disk tier: one safetensors file per entry, shared safely by several processes.

Layout under `path`: `ab/<key>.safetensors` (sharded by the key's first two hex digits),
`index.json` (sizes, last use and hits per key, for the budget, and the use sequence), `stats.json` (hits and misses of
every process that used the store), `.lock` (flock'd around every index or stats change). Why it is safe:
- a put writes a temp file in the entry's own directory, then `os.replace`s it in: readers see the
  old file or the new one, never half of either;
- every file carries a checksummed header (serialize.py); anything that fails it is a miss and is
  removed;
- the files are the truth and the index only a cache of their sizes: a missing or unreadable index
  is rebuilt from the files, and an index entry whose file is gone is dropped;
- recency is a sequence kept in `index.json` beside the entries, never a clock: a put or a hit takes
  the next number under the lock (a process's hits since its last sync in the order it made them), so
  no two uses tie however coarse the clock, and the numbers of every process compare. An index
  rebuilt from the files alone numbers them in the order of their modification times, the only
  trace of use left;
- hit and miss counts are kept per process and added into `stats.json` under the lock at most every
  `STATS_FLUSH_S` seconds and on close, so `stats()` in any process (`store info`) counts every
  process's lookups of this tier (those a process's memory tier answered never reach it). A process
  killed before its flush loses at most that many seconds of counts; an unreadable stats file
  restarts the counts from zero.
A put that fails for lack of space, on a read-only directory or filesystem (or any other OSError)
is a lost cache entry, counted in `num_write_errors` and logged once per cause, never an error raised
into generation; reads go on. A directory that cannot even hold the `.lock` file is read without the
cross-process lock: nobody can change it through this store.

Out of scope: durability against power loss (no fsync: a torn file fails its checksum and is
recomputed), and network filesystems without working flock.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from . import disk_counts, disk_index
from .base import ModuleKV, StoreStats, VerifyReport
from .codecs import CodecError, EncodedKV, check_codec, decode, encode
from .eviction import BudgetIndex, Entry, Policy
from .serialize import CorruptEntry, WarnOnce, dumps, load_file, read_header

log = logging.getLogger(__name__)
SUFFIX = ".safetensors"
_STALE_TMP_S = 600.0
STATS_FLUSH_S = 5.0


def _write_bytes(path: Path, data: bytes) -> None:
    with open(path, "xb") as f:
        f.write(data)


class DiskStore:
    def __init__(
        self,
        path: str | os.PathLike[str],
        max_bytes: int | None = None,
        codec: str = "native",
        policy: str | Policy = "lru",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.codec = check_codec(codec)
        self.root = Path(path)
        self.root.mkdir(parents=True, exist_ok=True)
        self._index = BudgetIndex(max_bytes, policy)
        self._index_path = self.root / "index.json"
        self._index_stamp: tuple[int, int, int] | None = None
        self._lock = threading.Lock()
        self._error_lock = threading.Lock()
        self._touched: dict[str, int] = {}  # key -> hits not yet written to index.json, least recent first
        self._pending = disk_counts.Counts()  # this process's, not yet added into stats.json
        self._stats_path = self.root / "stats.json"
        self._clock = clock  # seconds, for STATS_FLUSH_S; tests pass a fake one instead of sleeping
        self._flushed_at = clock()
        self._num_errors = 0
        self._num_write_errors = 0
        self._num_corrupt_saved = 0  # this process's corrupt entries added into stats.json (in _num_errors too)
        self._warn = WarnOnce(log)
        self._write_errors: set[int] = set()
        with self._locked():
            self._sync()
        if max_bytes is not None:
            self.resize(max_bytes)  # a budget lowered since the entries were written is held from the start

    @property
    def max_bytes(self) -> int | None:
        return self._index.max_bytes

    def path_for(self, key: str) -> Path:
        if len(key) < 3 or not all(c in "0123456789abcdef" for c in key):
            raise ValueError(f"disk keys are lowercase hex content addresses (module_key), got {key!r}")
        return self.root / key[:2] / f"{key}{SUFFIX}"

    # -- protocol ------------------------------------------------------------------------------

    def get(self, key: str) -> ModuleKV | None:
        found = self.get_encoded(key)
        return None if found is None else found[0]

    def get_encoded(self, key: str) -> tuple[ModuleKV, EncodedKV] | None:
        """`get`, and the entry as stored: a memory tier above keeps that (`MemoryStore.put_encoded`)
        without encoding the decoded KV again."""
        path = self.path_for(key)
        try:
            inode = path.stat().st_ino
            enc = load_file(path, key)
            kv = decode(enc)
        except FileNotFoundError:
            with self._lock:
                self._pending.num_misses += 1
            self._maybe_flush_counts()
            return None
        except (CorruptEntry, CodecError) as e:
            self._warn(key, "disk store %s: dropping bad entry %s (corrupt; recomputed from its text): %s", self.root, key, e)
            self._drop(key, path, inode)
            with self._lock:
                self._pending.num_misses += 1
                self._note_corrupt(key, e)
            try:
                with self._locked():
                    self._flush_counts()  # now: `store info` and `store verify` in another process show it
            except OSError as err:
                self._write_failed(None, err)
            return None
        with self._lock:
            self._pending.num_hits += 1
            self._touched[key] = self._touched.pop(key, 0) + 1  # to the end: the most recent
        self._maybe_flush_counts()
        if enc.codec == "native":  # detach from the file mapping (see serialize.load_file)
            kv = ModuleKV(kv.keys.clone(), kv.values.clone(), kv.start, kv.token_ids, kv.fingerprint, kv.mode)
        return kv, enc

    def put(self, key: str, kv: ModuleKV) -> None:
        path = self.path_for(key)
        data = dumps(key, encode(kv, self.codec))
        if not self._index.fits(len(data)):
            self._warn("too-big", "disk store %s: an entry of %d bytes is larger than the whole budget of %d bytes; "
                       "entries this size are not cached (recomputed on every use): raise the budget",
                       self.root, len(data), self._index.max_bytes)
            return
        tmp = path.parent / f".tmp-{key}-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            path.parent.mkdir(exist_ok=True)
            _write_bytes(tmp, data)
        except OSError as e:
            self._write_failed(tmp, e)
            return
        try:
            with self._locked():
                self._sync()
                os.replace(tmp, path)
                victims = self._index.add(key, len(data), kv.num_tokens)
                for victim in victims:
                    self.path_for(victim.key).unlink(missing_ok=True)
                self._save_index()
        except OSError as e:
            self._write_failed(tmp, e)

    def contains(self, key: str) -> bool:
        return self.path_for(key).exists()

    def delete(self, key: str) -> bool:
        path = self.path_for(key)
        with self._locked():
            self._sync()
            self._index.remove(key)
            existed = path.exists()
            path.unlink(missing_ok=True)
            self._save_index()
        return existed

    def stats(self) -> StoreStats:
        with self._locked():
            self._sync()
            saved = self._saved_counts()
            return StoreStats(
                len(self._index),
                self._index.num_bytes,
                saved.num_hits + self._pending.num_hits,
                saved.num_misses + self._pending.num_misses,
                self._index.num_tokens,
                self._num_errors + saved.num_corrupt - self._num_corrupt_saved,
                self._num_write_errors,
            )

    def corrupt_entries(self) -> list[dict[str, object]]:
        """The entries found corrupt and removed when read or re-indexed (by any process), oldest first,
        the last `disk_counts.MAX_CORRUPT_KEPT`: {"key", "why", "at" (unix time)}."""
        with self._locked():
            return (self._saved_counts() + self._pending).corrupt

    def close(self) -> None:
        with self._locked():
            self._sync()
            self._save_index()
            self._flush_counts()

    # -- management ----------------------------------------------------------------------------

    def evict_to(self, num_bytes: int) -> list[str]:
        """Evict (lowest priority first) until at most `num_bytes` of files remain; returns the keys."""
        with self._locked():
            self._sync()
            victims = self._index.evict_to(num_bytes)
            for victim in victims:
                self.path_for(victim.key).unlink(missing_ok=True)
            self._save_index()
        return [v.key for v in victims]

    def resize(self, max_bytes: int | None) -> list[str]:
        """A new budget (None: unbounded), held now: returns the keys evicted to fit it."""
        with self._locked():
            self._sync()
            self._index.max_bytes = max_bytes
            victims = self._index.evict_to(max_bytes) if max_bytes is not None else []
            for victim in victims:
                self.path_for(victim.key).unlink(missing_ok=True)
            if victims:
                self._save_index()
                log.info("disk store %s: over its budget of %d bytes, evicted %d entries", self.root, max_bytes,
                         len(victims))
        return [v.key for v in victims]

    def verify(self) -> VerifyReport:
        """Check every file's header and checksum; remove the bad ones. Also re-syncs the index. The
        report names the entries found corrupt earlier, when read, too (`corrupt_entries`)."""
        earlier = tuple(self.corrupt_entries())
        bad = []
        files = list(self._files())
        for key, path in files:
            try:
                load_file(path, key)
            except FileNotFoundError:
                continue
            except CorruptEntry as e:
                log.warning("disk store %s: removing bad entry %s: %s", self.root, key, e)
                bad.append(key)
                path.unlink(missing_ok=True)
        with self._locked():
            self._rebuild()
            self._save_index()
        return VerifyReport(len(files), tuple(bad), earlier)

    def keys(self) -> list[str]:
        return [key for key, _ in self._files()]

    # -- internals -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """The in-process lock, then the cross-process one (flock on .lock)."""
        with self._lock, self._lock_file() as f:
            if f is None:  # a read-only directory without a lock file: nothing can change it through us
                yield
                return
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def _lock_file(self) -> contextlib.AbstractContextManager:
        path = self.root / ".lock"
        for mode in ("a+b", "rb"):  # flock works on a read-only descriptor too
            try:
                return open(path, mode)
            except OSError as e:
                if mode == "a+b" and e.errno not in (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT):
                    raise
        return contextlib.nullcontext(None)

    def _files(self) -> Iterator[tuple[str, Path]]:
        for path in self.root.glob(f"??/*{SUFFIX}"):
            yield path.name.removesuffix(SUFFIX), path

    def _stamp(self) -> tuple[int, int, int] | None:
        try:
            st = self._index_path.stat()
        except FileNotFoundError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def _sync(self) -> None:
        """Under the lock: reload index.json if another process changed it, then re-apply our hits."""
        stamp = self._stamp()
        if stamp is None:
            if len(self._index) or any(True for _ in self._files()):
                log.info("disk store %s: index missing, rebuilding it from the files", self.root)
            self._rebuild()
            self._save_index()
        elif stamp != self._index_stamp:
            try:
                self._index = disk_index.parse(json.loads(self._index_path.read_bytes()), self._index.max_bytes,
                                               self._index.policy)
                self._index_stamp = stamp
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                log.warning("disk store %s: unreadable index (%s), rebuilding it from the files", self.root, e)
                self._rebuild()
                self._save_index()
        for key, num_hits in self._touched.items():  # least recent first: each takes the next number
            entry = self._index.entries.get(key)
            if entry is not None:
                entry.last_used = self._index.stamp()
                entry.num_hits += num_hits
                entry.inflation = self._index.inflation
        self._touched.clear()

    def _reset_index(self, seq: int = 0, inflation: float = 0.0) -> None:
        self._index = BudgetIndex(self._index.max_bytes, self._index.policy, seq=seq, inflation=inflation)

    def _rebuild(self) -> None:
        """Under the lock: the index from the files themselves; unreadable files and stale temps go."""
        self._reset_index(self._index.seq, self._index.inflation)  # numbers stay above any a process may still hold
        now = time.time()
        for path in self.root.glob("??/.tmp-*"):
            with contextlib.suppress(OSError):  # gone already, or a read-only directory
                if now - path.stat().st_mtime > _STALE_TMP_S:
                    path.unlink()
        found = []
        for key, path in self._files():
            try:
                meta = read_header(path)
                st = path.stat()
                if meta.get("key") != key:
                    raise CorruptEntry(f"header names key {meta.get('key')}")
                found.append((st.st_mtime_ns, key, st.st_size, int(meta["num_tokens"])))
            except FileNotFoundError:
                continue
            except (CorruptEntry, ValueError, KeyError) as e:
                log.warning("disk store %s: removing unreadable entry %s: %s", self.root, key, e)
                self._note_corrupt(key, e)
                try:
                    path.unlink(missing_ok=True)
                except OSError as err:
                    self._write_failed(None, err)
        for _, key, num_bytes, num_tokens in sorted(found):
            self._index.load(Entry(key, num_bytes, num_tokens, self._index.stamp()))

    def _save_index(self) -> None:
        """Under the lock: write index.json atomically. Failing to is harmless (it is rebuildable)."""
        tmp = self.root / f".index.json.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            tmp.write_text(disk_index.dumps(self._index))
            os.replace(tmp, self._index_path)
        except OSError as e:
            self._write_failed(tmp, e)
            return
        self._index_stamp = self._stamp()

    def _note_corrupt(self, key: str, why: Exception) -> None:
        """Under the lock: one corrupt entry found (and removed), for stats.json."""
        self._num_errors += 1
        self._pending.num_corrupt += 1
        self._pending.corrupt.append({"key": key, "why": str(why), "at": round(time.time(), 3)})

    def _saved_counts(self) -> disk_counts.Counts:
        """Under the lock: the counts in stats.json; zeros if it is missing or unreadable."""
        try:
            return disk_counts.read(self._stats_path)
        except (ValueError, KeyError, TypeError, AttributeError, OSError) as e:
            self._warn("stats.json", "disk store %s: unreadable stats.json (%s); counting hits from zero", self.root, e)
            return disk_counts.Counts()

    def _flush_counts(self) -> None:
        """Under the lock: add this process's counts into stats.json (kept here if that fails)."""
        self._flushed_at = self._clock()
        if not self._pending:
            return
        try:
            disk_counts.write(self._stats_path, self._saved_counts() + self._pending)
        except OSError as e:
            self._write_failed(None, e)
            return
        self._num_corrupt_saved += self._pending.num_corrupt
        self._pending = disk_counts.Counts()

    def _maybe_flush_counts(self) -> None:
        if self._clock() - self._flushed_at < STATS_FLUSH_S:
            return
        try:
            with self._locked():
                if self._clock() - self._flushed_at >= STATS_FLUSH_S:  # another thread may have just done it
                    self._flush_counts()
        except OSError as e:
            self._write_failed(None, e)

    def _drop(self, key: str, path: Path, inode: int) -> None:
        """Remove a bad file, unless a writer has meanwhile replaced it with a new one."""
        try:
            self._drop_locked(key, path, inode)
        except OSError as e:  # a read-only directory: the bad file stays, and stays a miss
            self._write_failed(None, e)

    def _drop_locked(self, key: str, path: Path, inode: int) -> None:
        with self._locked():
            with contextlib.suppress(FileNotFoundError):
                if path.stat().st_ino != inode:
                    return
            self._sync()
            self._index.remove(key)
            path.unlink(missing_ok=True)
            self._save_index()

    def _write_failed(self, tmp: Path | None, e: OSError) -> None:
        if tmp is not None:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
        with self._error_lock:  # not self._lock: this runs both under it (index saves) and outside it
            self._num_errors += 1
            self._num_write_errors += 1
        if e.errno not in self._write_errors:
            self._write_errors.add(e.errno or 0)
            reason = "disk full" if e.errno == errno.ENOSPC else os.strerror(e.errno) if e.errno else str(e)
            log.warning("disk store %s: cannot write (%s); entries are not being cached: %s", self.root, reason, e)
