"""http(s) images are fetched from the address their host was checked at, never from a
second lookup, and a redirect is refused rather than followed (it could point at a
metadata or private address the check would have refused)."""

from __future__ import annotations

import io
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tokenmill.pipelines import images
from tokenmill.pipelines.image_fetch import fetch_pinned
from tokenmill.pipelines.images import ImageAccess, read_row_images


def _png() -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (4, 3), (200, 10, 10)).save(buffer, format="PNG")
    return buffer.getvalue()


PNG = _png()


class _Handler(BaseHTTPRequestHandler):
    hosts: list[str] = []

    def do_GET(self):  # noqa: N802 (http.server's name)
        _Handler.hosts.append(self.headers["Host"])
        if self.path == "/a.png?v=1":
            self.send_response(200)
            self.send_header("Content-Length", str(len(PNG)))
            self.end_headers()
            self.wfile.write(PNG)
        elif self.path == "/moved.png":
            self.send_response(302)
            self.send_header("Location", "http://169.254.169.254/latest/meta-data")
            self.end_headers()
        else:
            self.send_error(404)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    _Handler.hosts = []
    yield httpd.server_address[1]
    httpd.shutdown()
    httpd.server_close()


def test_the_url_is_fetched_from_the_given_address_as_its_host(server):
    url = f"http://images.invalid:{server}/a.png?v=1"  # .invalid never resolves
    assert fetch_pinned(url, "127.0.0.1") == PNG
    assert _Handler.hosts == [f"images.invalid:{server}"]


def test_a_redirect_is_refused_not_followed(server):
    with pytest.raises(ValueError, match=r"redirect \(HTTP 302\) to 'http://169\.254\.169\.254"):
        fetch_pinned(f"http://images.invalid:{server}/moved.png", "127.0.0.1")
    assert len(_Handler.hosts) == 1  # the redirect's target was never asked


def test_errors_and_oversized_bodies_are_row_errors(server):
    with pytest.raises(ValueError, match="HTTP 404"):
        fetch_pinned(f"http://images.invalid:{server}/gone.png", "127.0.0.1")
    with pytest.raises(ValueError, match="over 16 bytes"):
        fetch_pinned(f"http://images.invalid:{server}/a.png?v=1", "127.0.0.1", max_bytes=16)
    with pytest.raises(ValueError, match="cannot be reached"):
        fetch_pinned("http://images.invalid:9/a.png", "127.0.0.1", timeout=2)


def test_a_job_fetches_from_the_address_it_checked(monkeypatch):
    """The address handed to the fetch is the one the check resolved; the host is never
    resolved a second time."""
    fetched = []
    lookups = []

    def resolve(host):
        lookups.append(host)
        return ["93.184.216.34"]

    monkeypatch.setattr(
        images, "fetch_pinned", lambda url, address: fetched.append((url, address)) or PNG
    )
    access = ImageAccess(url_schemes=("https",), resolve=resolve)
    (row,) = read_row_images(["https://images.example/a.png"], access)
    assert fetched == [("https://images.example/a.png", "93.184.216.34")]
    assert lookups == ["images.example"]
    assert row.error is None and row.data == (PNG,)
