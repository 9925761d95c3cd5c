"""Shards over HTTP(S): reads that ride out transient failures, and URLs whose credentials never reach a log.

A shard URL may carry credentials: `https://user:token@host/...` (sent as HTTP basic auth) or a signed query
(`?token=...`, `?X-Amz-Signature=...`, sent as is). Every message that names a URL passes it through `redact`.

Transient failures (refused or reset connections, timeouts, HTTP 408/429/5xx) are retried with exponential
backoff, both when opening and in the middle of a read, which continues at the byte where it stopped (a Range
request; a server without range support sends the whole shard again and the bytes already read are skipped).
Other HTTP errors (404, 403) fail at once. The caller sees an error only after `Retry.retries` consecutive
failures (`data.http_retries`, each attempt waiting at most `data.http_timeout_s` for the connection and for each
read); the loader then counts the shard as damaged and moves on.
"""
from __future__ import annotations

import base64
import http.client
import io
import logging
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import IO

from pretrain.core.redact import redact

log = logging.getLogger(__name__)

BACKOFF_S = 1.0  # the first wait; it doubles per failure in a row (6 retries: 1 ... 32 s ride out a minute's outage)
MAX_BACKOFF_S = 60.0  # more retries wait a minute each, never hours
TRANSIENT_HTTP = frozenset({408, 429, 500, 502, 503, 504})


@dataclass(frozen=True)
class Retry:
    """How patient a read is (data.http_timeout_s, data.http_retries; DataConfig holds the defaults)."""

    timeout_s: float  # per connection attempt and per read: a server that accepts and never answers costs this
    retries: int  # failed attempts in a row retried before the read fails


def open_http(url: str, retry: Retry) -> IO[bytes]:
    """A buffered byte stream of `url` that retries transient failures (see the module docstring)."""
    return io.BufferedReader(_RetryingResponse(url, retry), buffer_size=1 << 20)


class _RetryingResponse(io.RawIOBase):
    def __init__(self, url: str, retry: Retry) -> None:
        self._retry = retry
        parts = urllib.parse.urlsplit(url)
        self._shown = redact(url)
        self._headers = {}
        if parts.username is not None:
            user = urllib.parse.unquote(parts.username) + ":" + urllib.parse.unquote(parts.password or "")
            self._headers["Authorization"] = "Basic " + base64.b64encode(user.encode()).decode()
            parts = parts._replace(netloc=parts.netloc.rpartition("@")[2])
        self._url = urllib.parse.urlunsplit(parts)
        self._pos = 0  # bytes delivered to the reader
        self._end: int | None = None  # the shard's size, when the server says it
        self._failures = 0  # consecutive: reset by every successful read
        self._response = self._open()

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while True:
            try:
                n = self._response.readinto(buffer)
                if n == 0 and len(buffer) and self._end is not None and self._pos < self._end:
                    # http.client reads a connection closed early as the end of the body
                    raise http.client.IncompleteRead(b"", self._end - self._pos)
            except (OSError, http.client.HTTPException) as e:
                self._response.close()
                self._wait(e)
                self._response = self._open()
                continue
            self._pos += n
            self._failures = 0
            return n

    def close(self) -> None:
        if hasattr(self, "_response"):
            self._response.close()
        super().close()

    def _open(self) -> http.client.HTTPResponse:
        while True:
            headers = dict(self._headers, **({"Range": f"bytes={self._pos}-"} if self._pos else {}))
            try:
                response = urllib.request.urlopen(urllib.request.Request(self._url, headers=headers),
                                                  timeout=self._retry.timeout_s)
                length = response.headers.get("Content-Length")
                resumed = response.status == 206
                if self._pos and not resumed:
                    try:
                        _discard(response, self._pos)  # no range support: skip what the reader already has
                    except BaseException:
                        response.close()
                        raise
                if length is not None:
                    self._end = int(length) + (self._pos if resumed else 0)
                return response
            except urllib.error.HTTPError as e:
                if e.code not in TRANSIENT_HTTP:
                    raise OSError(f"{self._shown}: HTTP {e.code} {e.reason}") from None
                self._wait(e)
            except (OSError, http.client.HTTPException) as e:
                self._wait(e)

    def _wait(self, error: Exception) -> None:
        """Sleep before the next attempt, or raise (a redacted one-line OSError) when the retries are spent."""
        why = redact(str(error).splitlines()[0] if str(error) else type(error).__name__)
        retries = self._retry.retries
        if self._failures == retries:
            raise OSError(f"{self._shown}: {why} (the last of {retries + 1} attempts: data.http_retries {retries}, "
                          f"data.http_timeout_s {self._retry.timeout_s:g})") from None
        delay = min(BACKOFF_S * 2**self._failures, MAX_BACKOFF_S)
        self._failures += 1
        log.warning("reading %s at byte %d failed (%s); retry %d of %d in %.0f s",
                    self._shown, self._pos, why, self._failures, retries, delay)
        time.sleep(delay)


def _discard(response: http.client.HTTPResponse, count: int) -> None:
    while count:
        chunk = response.read(min(count, 1 << 20))
        if not chunk:
            raise http.client.IncompleteRead(b"", count)
        count -= len(chunk)
