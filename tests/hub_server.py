"""A fake Hugging Face Hub on 127.0.0.1: the HTTP calls huggingface_hub 2.4 makes, answered from memory.

Read from huggingface_hub's source (``hf_api.model_info``, ``list_repo_tree``, ``file_download``,
``utils/_http.hf_raise_for_status``): repo info ``GET /api/models/{repo}[/revision/{rev}]`` (with
``blobs=True``: every file's size), the tree ``GET /api/models/{repo}/tree/{rev}``, and files
``HEAD``/``GET /{repo}/resolve/{rev}/{file}`` with ``ETag``, ``X-Repo-Commit``, ``Content-Length`` and
``Range`` (206). Errors carry the ``X-Error-Code`` huggingface_hub reads: ``RepoNotFound`` (404),
``RevisionNotFound``, ``EntryNotFound``, ``GatedRepo`` (401 without the repo's token). No ``X-Xet-*``
header is ever sent, so downloads stay plain HTTP. Every request is recorded (``requests``) so tests
can say what was, and was not, fetched. ``stall(file, after_bytes)`` makes the next GET of a file stop mid-way
(an interrupted transfer: the process reading it can be killed there).
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Optional
from urllib.parse import unquote, urlsplit


@dataclass
class FakeRepo:
    """One repo: commits (sha -> file name -> bytes), refs (branch/tag -> sha), and gating."""

    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)
    gated_token: Optional[str] = None  # gated: files answer 401 unless this bearer token is sent

    def commit_of(self, revision: str) -> Optional[str]:
        return revision if revision in self.commits else self.refs.get(revision)


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    range: Optional[str]


def files_of(directory: Path) -> dict[str, bytes]:
    """Every file under ``directory`` by its relative path (as a repo holds them)."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def commit_sha(files: dict[str, bytes], salt: str = "") -> str:
    digest = hashlib.sha1(salt.encode())
    for name, data in sorted(files.items()):
        digest.update(name.encode() + hashlib.sha1(data).digest())
    return digest.hexdigest()


@dataclass
class Stall:
    """A transfer cut after ``after_bytes``: ``reached`` once they are sent, ``release`` ends the hang."""

    after_bytes: int
    reached: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)


class FakeHub:
    """The server and its repos. ``add(repo_id, files)`` publishes a commit on "main" (and returns its sha)."""

    def __init__(self) -> None:
        self.repos: dict[str, FakeRepo] = {}
        self.requests: list[Request] = []
        self.stalls: dict[str, Stall] = {}
        self._lock = threading.Lock()
        hub = self

        class Handler(_Handler):
            fake = hub

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def add(self, repo_id: str, files: dict[str, bytes], ref: str = "main", gated_token: Optional[str] = None) -> str:
        repo = self.repos.setdefault(repo_id, FakeRepo())
        sha = commit_sha(files, salt=f"{repo_id}@{ref}")
        repo.commits[sha] = dict(files)
        repo.refs[ref] = sha
        repo.gated_token = gated_token if gated_token is not None else repo.gated_token
        return sha

    def record(self, request: Request) -> None:
        with self._lock:
            self.requests.append(request)

    def file_requests(self, method: str = "GET") -> list[Request]:
        return [r for r in self.requests if r.method == method and "/resolve/" in r.path]

    def fetched(self, repo_id: str) -> set[str]:
        """The files of ``repo_id`` sent whole or in part (GETs), by their path in the repo."""
        prefix = f"/{repo_id}/resolve/"
        return {r.path[len(prefix):].split("/", 1)[1] for r in self.file_requests("GET") if r.path.startswith(prefix)}

    def full_weight_reads(self) -> list[Request]:
        """GETs of a .safetensors / .bin / .gguf file without a Range header (a whole weights file)."""
        return [r for r in self.file_requests("GET") if r.range is None
                and r.path.endswith((".safetensors", ".bin", ".gguf"))]

    def stall(self, filename: str, after_bytes: int) -> "Stall":
        """The next GET of ``filename`` (a path in any repo) sends its first ``after_bytes`` bytes, then hangs until
        ``release`` is set (or the hub stops) and closes the connection, the rest unsent. ``reached`` is set once
        those bytes are sent."""
        stall = self.stalls[filename] = Stall(after_bytes)
        return stall

    def stop(self) -> None:
        for stall in self.stalls.values():
            stall.release.set()
        self._server.shutdown()
        self._server.server_close()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    fake: FakeHub

    def log_message(self, *args) -> None:  # quiet
        pass

    # ---- routing ------------------------------------------------------------------------------------
    def do_GET(self) -> None:
        self._route(head=False)

    def do_HEAD(self) -> None:
        self._route(head=True)

    def _route(self, head: bool) -> None:
        path = unquote(urlsplit(self.path).path)
        self.fake.record(Request("HEAD" if head else "GET", path, self.headers.get("Range")))
        if path.startswith("/api/models/"):
            return self._api(path[len("/api/models/"):])
        if "/resolve/" in path:
            repo_id, rest = path.lstrip("/").split("/resolve/", 1)
            revision, _, filename = rest.partition("/")
            return self._resolve(repo_id, revision, filename, head)
        self._error(404, "not a route of the fake hub")

    def _api(self, rest: str) -> None:
        if "/tree/" in rest:
            repo_id, tail = rest.split("/tree/", 1)
            revision = tail.split("/", 1)[0]
            repo, sha = self._commit(repo_id, revision)
            if sha is not None:
                self._json([{"type": "file", "path": name, "size": len(data), "oid": _blob_id(data)}
                            for name, data in sorted(repo.commits[sha].items())])
            return
        repo_id, _, revision = rest.partition("/revision/")
        repo, sha = self._commit(repo_id, revision or "main")
        if sha is None:
            return
        files = repo.commits[sha]
        self._json({"id": repo_id, "modelId": repo_id, "sha": sha, "private": False,
                    "gated": "manual" if repo.gated_token else False, "disabled": False, "tags": [],
                    "siblings": [{"rfilename": name, "size": len(data), "blobId": _blob_id(data)}
                                 for name, data in sorted(files.items())]})

    def _resolve(self, repo_id: str, revision: str, filename: str, head: bool) -> None:
        repo, sha = self._commit(repo_id, revision)
        if sha is None:
            return
        if repo.gated_token and self.headers.get("Authorization") != f"Bearer {repo.gated_token}":
            return self._error(401, f"Access to model {repo_id} is restricted.", "GatedRepo", commit=sha)
        data = repo.commits[sha].get(filename)
        if data is None:
            return self._error(404, "Entry not found", "EntryNotFound", commit=sha)
        status, body, headers = 200, data, {}
        wanted = self.headers.get("Range")
        if wanted and not head:
            start, end = _byte_range(wanted, len(data))
            status, body = 206, data[start:end + 1]
            headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
        self.send_response(status)
        for key, value in {"ETag": f'"{_blob_id(data)}"', "X-Repo-Commit": sha, "Accept-Ranges": "bytes",
                           "Content-Type": "application/octet-stream", "Content-Length": str(len(body)),
                           **headers}.items():
            self.send_header(key, value)
        self.end_headers()
        stall = None if head else self.fake.stalls.pop(filename, None)
        if stall is not None:  # an interrupted transfer: part of the body, a hang, then the connection dropped
            self.wfile.write(body[:stall.after_bytes])
            self.wfile.flush()
            stall.reached.set()
            stall.release.wait(timeout=300)
            self.close_connection = True
            return
        if not head:
            self.wfile.write(body)

    # ---- helpers ------------------------------------------------------------------------------------
    def _commit(self, repo_id: str, revision: str) -> tuple[Optional[FakeRepo], Optional[str]]:
        repo = self.fake.repos.get(repo_id)
        if repo is None:
            self._error(404, "Repository not found", "RepoNotFound")
            return None, None
        sha = repo.commit_of(revision)
        if sha is None:
            self._error(404, f"Invalid rev id: {revision}", "RevisionNotFound")
        return repo, sha

    def _json(self, data) -> None:
        body = json.dumps(data).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _error(self, status: int, message: str, code: Optional[str] = None, commit: Optional[str] = None) -> None:
        body = json.dumps({"error": message}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("X-Error-Message", message)
        if code:
            self.send_header("X-Error-Code", code)
        if commit:
            self.send_header("X-Repo-Commit", commit)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)


def _blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()  # git's blob id


def _byte_range(header: str, size: int) -> tuple[int, int]:
    """'bytes=a-b' / 'bytes=a-' / 'bytes=-n' -> inclusive (start, end), clamped to the file."""
    spec = header.split("=", 1)[1].split(",", 1)[0].strip()
    first, _, last = spec.partition("-")
    if not first:
        return max(0, size - int(last)), size - 1
    return int(first), min(size - 1, int(last)) if last else size - 1


# ---- pytest fixtures: import them into a test module (``from tests.hub_server import hub  # noqa: F401``) ----
import pytest  # noqa: E402


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """A running fake hub, with ``HF_ENDPOINT`` pointing at it, the HF cache in ``tmp_path`` and the suite's
    offline switch and any token unset for this test (set after huggingface_hub was imported: the code under
    test must read them when it runs)."""
    server = FakeHub()
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-home" / "hub"))
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    for variable in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(variable, raising=False)
    server.cache = tmp_path / "hf-home" / "hub"
    yield server
    server.stop()
