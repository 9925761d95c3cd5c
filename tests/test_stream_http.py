"""Shards over HTTP from a real loopback server that fails: the first two requests get 503, the third
response is cut off half way; the reads retry with backoff, resume where they stopped (with and without
Range support on the server) and return exactly the packs of the local file. Credentials in the URL are sent
to the server but appear in no log line and no error message. A server that accepts and never answers costs
data.http_timeout_s per attempt and data.http_retries retries."""
from __future__ import annotations

import base64
import http.server
import logging
import socket
import threading
import time
from pathlib import Path

import pytest

from pretrain.core.config import DataConfig, UsageError
from pretrain.core.redact import redact
from pretrain.data.loader import build_train_loader
from pretrain.data.remote import Retry
from pretrain.data.shards import read_packs
from pretrain.data.stream import StreamSpec, _read_checked

USER, PASSWORD, TOKEN = "alice", "s3cr3t-pass", "t0ken-value"
RETRY = Retry(DataConfig.http_timeout_s, DataConfig.http_retries)  # the defaults


class FlakyServer(http.server.ThreadingHTTPServer):
    """Serves `folder` to clients with alice's credentials; request 1 and 2 get 503, request 3 stops half way."""

    def __init__(self, folder: Path, ranges: bool) -> None:
        super().__init__(("127.0.0.1", 0), FlakyHandler)
        self.folder, self.ranges, self.requests, self.lock = folder, ranges, [], threading.Lock()


class FlakyHandler(http.server.BaseHTTPRequestHandler):
    server: FlakyServer

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        with self.server.lock:
            self.server.requests.append((self.path, dict(self.headers)))
            n = len(self.server.requests)
        expected = "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
        if self.headers.get("Authorization") != expected or not self.path.endswith(f"?token={TOKEN}"):
            return self.send_error(401)
        if n <= 2:
            return self.send_error(503)
        path = self.server.folder / self.path.split("?")[0].lstrip("/")
        if not path.is_file():
            return self.send_error(404)
        data = path.read_bytes()
        start = int(self.headers["Range"][6:].rstrip("-")) if self.server.ranges and "Range" in self.headers else 0
        self.send_response(206 if start else 200)
        self.send_header("Content-Length", str(len(data) - start))
        self.end_headers()
        # request 3: half the promised body, then the connection closes
        self.wfile.write(data[start : len(data) // 2] if n == 3 else data[start:])


@pytest.fixture(params=[True, False], ids=["range", "no-range"])
def flaky(request, shards):
    server = FlakyServer(Path(shards.train), ranges=request.param)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server, f"http://{USER}:{PASSWORD}@127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    thread.join()


def test_reads_retry_and_resume_to_the_exact_packs(flaky, shards, caplog):
    server, base = flaky
    caplog.set_level(logging.WARNING)
    errors: list[Exception] = []
    got = list(read_packs(f"{base}/shard-000000.tar?token={TOKEN}", errors.append, RETRY))
    local = list(read_packs(f"{shards.train}/shard-000000.tar", errors.append))
    assert errors == [] and len(got) == len(local) >= 1
    assert all({**g, "__url__": ""} == {**l, "__url__": ""} for g, l in zip(got, local))
    assert len(server.requests) == 4  # 503, 503, cut off, the rest
    if server.ranges:
        assert server.requests[3][1]["Range"] != "bytes=0-"  # resumed, not read again from the start
    retries = [r.getMessage() for r in caplog.records]
    assert len(retries) == 3 and all("retry" in m for m in retries)
    assert not any(secret in m for m in retries for secret in (PASSWORD, TOKEN))


def test_a_failing_shard_is_reported_without_its_credentials(flaky, caplog):
    server, base = flaky
    server.requests += [("", {})] * 3  # past the failing requests: the server answers
    caplog.set_level(logging.WARNING)
    url = f"{base}/missing.tar?token={TOKEN}"
    spec = StreamSpec(shards=(url,), seed=0, num_streams=1, raw_length=8, input_length=8, target_length=4,
                      block_chunks=1, num_ids=1100, eos_id=1, noise_density=0.15, mean_noise_span_length=3.0,
                      expected_docs=None, retry=RETRY)
    damaged = {}
    assert list(_read_checked(spec, 0, 0, damaged)) == [] and damaged == {0: 0}
    [line] = [r.getMessage() for r in caplog.records]
    assert line == (f"skipping the rest of damaged shard http://***@127.0.0.1:{server.server_address[1]}"
                    f"/missing.tar?token=***: http://***@127.0.0.1:{server.server_address[1]}/missing.tar?token=***: "
                    "HTTP 404 Not Found")


def test_redact_hides_user_info_and_query_values():
    text = "failed https://u:p@host:8/a/b.tar?sig=x&X-Amz-Credential=y and http://h/c.tar, pipe:cat d.tar"
    hidden = "failed https://***@host:8/a/b.tar?sig=***&X-Amz-Credential=*** and http://h/c.tar, pipe:cat d.tar"
    assert redact(text) == hidden and redact(hidden) == hidden


@pytest.fixture
def silent_server():
    """A loopback server that accepts every connection and never answers (a hung proxy or storage node); yields
    its URL and the connections it accepted."""
    server = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                accepted.append(server.accept()[0])
            except OSError:  # closed: the test is over
                return

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}", accepted
    server.shutdown(socket.SHUT_RDWR)
    server.close()
    thread.join()
    for conn in accepted:
        conn.close()


def test_a_server_that_never_answers_costs_the_configured_timeout_and_retries(silent_server, shards, caplog):
    # before, each attempt waited 60 s and 7 were made, per URL, whatever the config said
    url, accepted = silent_server
    caplog.set_level(logging.WARNING)
    cfg = shards.config(train=f"{url}/shard-000000.tar", streams=1, workers=0, http_timeout_s=0.2, http_retries=1)
    loader = build_train_loader(cfg, seed=0, dp_rank=0, dp_size=1, micro_batch=2)  # index.json: none answered
    with pytest.raises(UsageError, match="no readable data in any of the 1 shards"):
        next(iter(loader))
    deadline = time.monotonic() + 900  # a hang guard only: the accepting thread may lag on a loaded machine
    while len(accepted) < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(accepted) == 4  # index.json, then the shard: each tried once and retried once
    assert caplog.text.count("failed (timed out); retry 1 of 1 in 1 s") == 2
    assert (f"skipping the rest of damaged shard {url}/shard-000000.tar: {url}/shard-000000.tar: timed out (the last "
            "of 2 attempts: data.http_retries 1, data.http_timeout_s 0.2)") in caplog.text
