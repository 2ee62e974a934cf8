"""moto's S3 server in its own process, for tests that need more than the in-process ThreadedMotoServer:

- every request it serves is logged, so a test counts the requests a stage made (by method and key);
- `threaded=False` serves one request at a time: a conditional write (`If-None-Match: *`) is then atomic,
  as S3 guarantees (moto's threaded server checks, then writes, without a lock);
- `auth_after=N` turns on moto's authentication after N requests, so wrong credentials are refused;
- `TcpProxy` sits in front of it and can be cut and restored: the store becomes unreachable mid-stage
  without losing what it holds.
"""

from __future__ import annotations

import collections
import os
import re
import selectors
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

SERVE = ("import os, sys, threading, time\n"
         "def orphaned():  # the server dies with the test process, however that ends\n"
         "    while os.getppid() == int(sys.argv[3]):\n"
         "        time.sleep(0.5)\n"
         "    os._exit(0)\n"
         "threading.Thread(target=orphaned, daemon=True).start()\n"
         "from werkzeug.serving import run_simple\n"
         "from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, "
         "create_backend_app\n"
         "run_simple('127.0.0.1', int(sys.argv[1]), DomainDispatcherApplication(create_backend_app),\n"
         "           threaded=sys.argv[2] == '1', request_handler=MotoRequestHandler)\n")
REQUEST_LINE = re.compile(r'"(GET|PUT|HEAD|POST|DELETE) (\S+) HTTP/[\d.]+" (\d{3})')
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
               "AWS_EC2_METADATA_DISABLED": "true"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for_port(port: int, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise TimeoutError(f"{what} did not listen on port {port} within {timeout_s:.0f} s")


class MotoProcess:
    """`python -c SERVE PORT THREADED` in its own process group, its request log in `log_path`."""

    def __init__(self, log_path: Path, *, threaded: bool = False, auth_after: int | None = None) -> None:
        self.log_path, self.port = log_path, free_port()
        env = os.environ | ({"INITIAL_NO_AUTH_ACTION_COUNT": str(auth_after)} if auth_after is not None else {})
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen([sys.executable, "-c", SERVE, str(self.port), "1" if threaded else "0",
                                         str(os.getpid())],
                                        stdout=subprocess.DEVNULL, stderr=self._log, env=env, start_new_session=True)
        try:
            wait_for_port(self.port, 60, "moto's S3 server")
        except TimeoutError:
            self.stop()
            raise TimeoutError(f"moto's S3 server did not start: {log_path.read_text()[-2000:]}") from None
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def requests(self) -> list[tuple[str, str, int]]:
        """(method, path with query, status) of every request served so far."""
        self._log.flush()
        return [(m.group(1), m.group(2), int(m.group(3))) for m in REQUEST_LINE.finditer(self.log_path.read_text())]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self._log.close()


def use_endpoint(monkeypatch: Any, endpoint: str, **env: str) -> None:
    """Point this process's S3 clients at `endpoint` with the test credentials (and `env`), for one test."""
    import s3fs

    for key, value in (CREDENTIALS | env).items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    s3fs.S3FileSystem.clear_instance_cache()  # one S3FileSystem per set of options: a cached one has old settings


def kinds(requests: list[tuple[str, str, int]]) -> collections.Counter:
    """Requests by kind: LIST (a bucket listing), GET, HEAD, PUT, DELETE, POST (multipart, batch delete)."""
    counter: collections.Counter = collections.Counter()
    for method, path, _ in requests:
        listing = method == "GET" and ("list-type=" in path or path.rstrip("/").count("/") == 1 or "prefix=" in path)
        counter["LIST" if listing else method] += 1
    return counter


class TcpProxy:
    """Forwards 127.0.0.1:port to a target port; `cut()` drops every connection and stops listening,
    `restore()` listens again on the same port."""

    def __init__(self, target_port: int) -> None:
        self.target_port, self.port = target_port, free_port()
        self.cut_after: tuple[re.Pattern[bytes], int] | None = None  # (request line, n): cut at the n-th's response
        self._seen = 0
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self.was_cut = threading.Event()  # set by every cut()
        self.restore()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def restore(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        self._thread = threading.Thread(target=self._accept, args=(listener,), daemon=True)
        self._thread.start()

    def cut(self) -> None:
        self.was_cut.set()
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()
        with self._lock:
            for sock in self._sockets:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()
            self._sockets.clear()
        if self._thread is not None:
            self._thread.join(5)

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # cut
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                client.close()
                continue
            with self._lock:
                self._sockets |= {client, upstream}
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()

    def _pump(self, a: socket.socket, b: socket.socket) -> None:
        selector = selectors.DefaultSelector()
        try:
            selector.register(a, selectors.EVENT_READ, b)
            selector.register(b, selectors.EVENT_READ, a)
            cut_on_response = False
            while True:
                for key, _ in selector.select(timeout=1.0):
                    data = key.fileobj.recv(1 << 16)
                    if not data:
                        return
                    key.data.sendall(data)
                    if key.fileobj is b and cut_on_response and not re.match(rb"HTTP/1\.[01] 100 ", data):
                        # Its final response (not a 100 Continue) went through; cut now, not after a delay: on a
                        # fast machine a tiny pass commits every remaining shard within half a second, and then
                        # nothing is left to resume.
                        threading.Thread(target=self.cut, daemon=True).start()
                        return
                    if key.fileobj is a and self.cut_after is not None and self.cut_after[0].search(data):
                        with self._lock:
                            self._seen += 1
                            last = self.cut_after is not None and self._seen >= self.cut_after[1]
                            if last:
                                self.cut_after = None
                        cut_on_response = last
        except (OSError, ValueError):
            return
        finally:
            selector.close()
            with self._lock:
                for sock in (a, b):
                    self._sockets.discard(sock)
                    sock.close()
