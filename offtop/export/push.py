"""Pushing a pprof profile per interval to a Pyroscope-compatible `/ingest`.

The request is the one Pyroscope's own clients send (Pyroscope's HTTP API,
"Ingestion", format `pprof`):

    POST {url}/ingest?name=APP{k=v,...}&from=UNIX_S&until=UNIX_S&format=pprof&spyName=offtop
    Content-Type: multipart/form-data; boundary=...

    part "profile"            (profile.pprof): the gzipped pprof profile
    part "sample_type_config" (JSON): {"off_cpu": {"units": "nanoseconds", ...}}

`name` is the application name followed by the series labels in braces;
Pyroscope parses it up to `,` and `}`, so label keys must be identifiers and
values may contain neither (checked when the `Pusher` is made, as a
`ValueError` whose message can be shown as is). `sampleRate` is not sent:
it applies to the text formats only; a pprof profile carries its own sample
types and period. The sample-type config names `off_cpu` for servers that
split a profile by its sample types and skip the types they do not know.

Credentials in the URL (`https://USER:TOKEN@host`, as Grafana Cloud gives
them) are sent as HTTP basic auth and never shown; extra headers (such as
`X-Scope-OrgID` for a multi-tenant Pyroscope) are passed through.

Capture never waits for the network: `push()` puts the snapshot in a bounded
queue and returns; a background thread encodes and sends, retrying with
exponential backoff. When the queue is full the oldest profile is dropped
and counted, so a dead endpoint costs a fixed amount of memory.
"""

from __future__ import annotations

import base64
import collections
import json
import math
import re
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from offtop import __version__
from offtop.export.accumulator import ProfileData
from offtop.export.pprof import pprof_bytes
from offtop.model import Snapshot
from offtop.safe_text import printable

if TYPE_CHECKING:  # urllib.request (with http.client, ssl, email) is imported when pushing:
    import urllib.request  # ~25 ms of every start-up otherwise

_APP_NAME = re.compile(r"[A-Za-z0-9_./-]+")
_LABEL_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_BAD_VALUE = re.compile(r"[,{}=\x00-\x1f\x7f]")

#: What a server that splits profiles by sample type needs to know about ours.
SAMPLE_TYPE_CONFIG = {
    "off_cpu": {"units": "nanoseconds", "display-name": "off_cpu", "aggregation": "sum"},
}


def series_name(app: str, labels: Mapping[str, str]) -> str:
    """`app{k=v,...}`, labels sorted; `ValueError` for what Pyroscope would misparse."""
    if not _APP_NAME.fullmatch(app):
        raise ValueError(f"invalid push name {app!r}: use letters, digits and _ . / -")
    for k, v in labels.items():
        if not _LABEL_KEY.fullmatch(k) or k == "__name__":
            raise ValueError(f"invalid push label {k!r}: use letters, digits and _")
        if not v or v != v.strip() or _BAD_VALUE.search(v):
            raise ValueError(f"invalid value {v!r} for push label {k!r}: "
                             "it must be non-empty, without , { } = or control characters")
    inner = ",".join(f"{k}={labels[k]}" for k in sorted(labels))
    return f"{app}{{{inner}}}"


def ingest_url(url: str) -> tuple[str, str | None]:
    """The `/ingest` endpoint of `url`, and basic-auth credentials from its userinfo."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"invalid push URL {printable(_redact(url))!r}: expected http(s)://host[:port][/path]")
    auth = None
    if parts.username is not None:
        user = urllib.parse.unquote(parts.username)
        password = urllib.parse.unquote(parts.password or "")
        auth = base64.b64encode(f"{user}:{password}".encode()).decode("ascii")
    netloc = parts.hostname if ":" not in parts.hostname else f"[{parts.hostname}]"
    if parts.port is not None:
        netloc += f":{parts.port}"
    path = parts.path.rstrip("/")
    if not path.endswith("/ingest"):
        path += "/ingest"
    return urllib.parse.urlunsplit((parts.scheme, netloc, path, "", "")), auth


def _redact(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    if parts.username is None:
        return url
    host = parts.netloc.rpartition("@")[2]
    return urllib.parse.urlunsplit((parts.scheme, f"***@{host}", parts.path, parts.query, ""))


def multipart_body(fields: list[tuple[str, str, str, bytes]]) -> tuple[bytes, str]:
    """A multipart/form-data body of (name, filename, content type, data) parts.

    Returns the body and its Content-Type. The boundary is random and checked
    not to occur in any part (a profile is binary and could contain anything).
    """
    while True:
        boundary = uuid.uuid4().hex
        if not any(boundary.encode() in data for *_, data in fields):
            break
    out = bytearray()
    for name, filename, ctype, data in fields:
        out += (f"--{boundary}\r\nContent-Disposition: form-data; name=\"{name}\"; "
                f"filename=\"{filename}\"\r\nContent-Type: {ctype}\r\n\r\n").encode()
        out += data
        out += b"\r\n"
    out += f"--{boundary}--\r\n".encode()
    return bytes(out), f"multipart/form-data; boundary={boundary}"


@dataclass(frozen=True, slots=True)
class PushStats:
    """How pushing goes; nothing lost is hidden."""

    sent: int = 0
    """Profiles the server accepted."""
    failed: int = 0
    """Profiles given up on after the last retry, or refused by the server (4xx)."""
    dropped: int = 0
    """Profiles dropped because the queue was full (the oldest go first)."""
    retries: int = 0
    """Retried requests."""
    queued: int = 0
    """Profiles waiting now."""
    last_error: str = ""
    """The last failure, printable, without credentials."""


class _Retry(Exception):
    """A failure worth retrying: network, timeout, 429, 5xx."""


class Pusher:
    """Sends one pprof profile per pushed snapshot, from a background thread.

    `name` and `labels` make the series name (see `series_name`); `queue_max`
    bounds the profiles waiting; `retries` is how many times a failed request
    is tried again (backoff `backoff_s`, doubling, at most `max_backoff_s`);
    `timeout` bounds each request. `cgroup_name(cgroup_id)` names the cgroups
    that long blocks report, for the `cgroup` sample label.
    """

    def __init__(
        self,
        url: str,
        *,
        name: str = "offtop",
        labels: Mapping[str, str] | None = None,
        queue_max: int = 16,
        retries: int = 3,
        timeout: float = 10.0,
        backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
        headers: Mapping[str, str] | None = None,
        spy_name: str = "offtop",
        cgroup_name: Callable[[int], str | None] | None = None,
    ) -> None:
        if queue_max < 1:
            raise ValueError("queue_max must be at least 1")
        if retries < 0 or timeout <= 0 or backoff_s < 0:
            raise ValueError("retries, timeout and backoff must be positive")
        self.endpoint, auth = ingest_url(url)
        self.series = series_name(name, labels or {})
        self._headers = {"User-Agent": f"offtop/{__version__}", **(headers or {})}
        if auth is not None:
            self._headers["Authorization"] = f"Basic {auth}"
        self._spy_name = spy_name
        self._retries = retries
        self._timeout = timeout
        self._backoff_s = backoff_s
        self._max_backoff_s = max_backoff_s
        self._cgroup_name = cgroup_name
        self._queue: collections.deque[Snapshot] = collections.deque()
        self._queue_max = queue_max
        self._cond = threading.Condition()
        self._closing = False
        self._deadline = math.inf
        self._thread: threading.Thread | None = None
        self._cgroups: dict[int, int] = {}
        self._sent = self._failed = self._dropped = self._retried = 0
        self._last_error = ""

    # --- capture side: never blocks ------------------------------------------

    def start(self) -> None:
        """Start the sending thread (once)."""
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="offtop-push", daemon=True)
                self._thread.start()

    def push(self, snap: Snapshot) -> bool:
        """Queue one interval's profile; False if an older one had to be dropped."""
        with self._cond:
            if self._closing:
                self._dropped += 1
                return False
            dropped = len(self._queue) >= self._queue_max
            if dropped:
                self._queue.popleft()
                self._dropped += 1
            self._queue.append(snap)
            self._cond.notify()
        return not dropped

    @property
    def stats(self) -> PushStats:
        """A consistent copy of the counters."""
        with self._cond:
            return PushStats(sent=self._sent, failed=self._failed, dropped=self._dropped,
                             retries=self._retried, queued=len(self._queue),
                             last_error=self._last_error)

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued for at most `timeout` seconds, then stop.

        What is still queued at the deadline is counted as dropped.
        """
        with self._cond:
            self._closing = True
            self._deadline = time.monotonic() + timeout
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout + self._timeout + 1.0)
        with self._cond:
            self._dropped += len(self._queue)
            self._queue.clear()

    # --- sending thread ------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if not self._queue or time.monotonic() >= self._deadline:
                    return
                snap = self._queue.popleft()
            self._send(snap)

    def _request(self, snap: Snapshot) -> urllib.request.Request:
        import urllib.request  # see the module's imports
        for b in snap.long_blocks:
            if b.cgroup_id:
                self._cgroups.pop(b.tid, None)
                self._cgroups[b.tid] = b.cgroup_id
        while len(self._cgroups) > 50_000:
            del self._cgroups[next(iter(self._cgroups))]
        names: dict[int, str] = {}

        def cgroup_of(tid: int) -> str:
            cid = self._cgroups.get(tid, 0)
            if not cid:
                return ""
            if cid not in names:
                resolved = self._cgroup_name(cid) if self._cgroup_name else None
                names[cid] = resolved or str(cid)
            return names[cid]

        start, end = snap.time - snap.interval_s, snap.time
        data = ProfileData.from_stacks(snap.stacks, start=start, end=end,
                                       threshold_ns=snap.threshold_ns, cgroup_of=cgroup_of)
        body, ctype = multipart_body([
            ("profile", "profile.pprof", "application/octet-stream", pprof_bytes(data)),
            ("sample_type_config", "sample_type_config.json", "application/json",
             json.dumps(SAMPLE_TYPE_CONFIG).encode()),
        ])
        frm = math.floor(start)
        query = urllib.parse.urlencode({
            "name": self.series,
            "from": frm,
            "until": max(frm + 1, math.ceil(end)),
            "format": "pprof",
            "spyName": self._spy_name,
        })
        return urllib.request.Request(f"{self.endpoint}?{query}", data=body, method="POST",
                                      headers={**self._headers, "Content-Type": ctype})

    def _send(self, snap: Snapshot) -> None:
        try:
            req = self._request(snap)
        except Exception as e:  # a bug in encoding must not kill the thread
            self._fail(f"encoding failed: {e!r}")
            return
        for attempt in range(self._retries + 1):
            try:
                self._post(req)
            except _Retry as e:
                with self._cond:
                    self._last_error = str(e)
                if attempt == self._retries or not self._wait_backoff(attempt):
                    self._fail(str(e))
                    return
                with self._cond:
                    self._retried += 1
                continue
            except ValueError as e:  # refused (4xx): the same request would be refused again
                self._fail(str(e))
                return
            with self._cond:
                self._sent += 1
            return

    def _post(self, req: urllib.request.Request) -> None:
        import urllib.error
        import urllib.request
        try:
            with urllib.request.urlopen(req, timeout=self._timeout) as resp:
                resp.read()
        except urllib.error.HTTPError as e:
            try:
                detail = printable(e.read(200).decode("utf-8", "replace").strip())
            except OSError:  # the body could not be read: the status says enough
                detail = ""
            msg = f"HTTP {e.code} from {self.endpoint}: {detail}" if detail else \
                f"HTTP {e.code} from {self.endpoint}"
            if e.code == 429 or e.code >= 500:
                raise _Retry(msg) from None
            raise ValueError(msg) from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise _Retry(f"{self.endpoint}: {printable(str(reason))}") from None

    def _wait_backoff(self, attempt: int) -> bool:
        """Sleep before the next try; False when closing leaves no time for it."""
        delay = min(self._max_backoff_s, self._backoff_s * (2 ** attempt))
        with self._cond:
            end = time.monotonic() + delay
            while True:
                now = time.monotonic()
                if now >= self._deadline:
                    return False
                if now >= end:
                    return True
                self._cond.wait(min(end, self._deadline) - now)

    def _fail(self, msg: str) -> None:
        with self._cond:
            self._failed += 1
            self._last_error = msg
