"""An http(s) image fetched from the very address its host was checked at.

Checking a host's addresses and then handing the URL to a general HTTP client leaves two
ways around the check: the client resolves the host again, and DNS may answer
differently the second time, and it follows redirects, which may point anywhere (a
cloud's metadata address, a service on the private network). So the connection here
goes to the address that was checked - TLS still verifies the certificate against the
host's name - and a redirect is refused, never followed. No credentials are sent.
"""

from __future__ import annotations

import http.client
import socket
import ssl
from urllib.parse import urlsplit

FETCH_TIMEOUT_S = 30.0
# An encoded image larger than this is refused before it is held whole. Pillow's pixel
# limit bounds the decoded size; this bounds the download.
MAX_IMAGE_BYTES = 256 << 20


def fetch_pinned(
    url: str,
    address: str,
    *,
    timeout: float = FETCH_TIMEOUT_S,
    max_bytes: int = MAX_IMAGE_BYTES,
) -> bytes:
    """GET an http(s) URL from `address` (the host's checked address), as the host.

    Raises:
        ValueError: the server answered anything but 200 (a redirect included), the body
            is over `max_bytes`, or the connection failed - the row's error message.
    """
    parts = urlsplit(url)
    secure = parts.scheme.lower() == "https"
    port = parts.port or (443 if secure else 80)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    try:
        sock = socket.create_connection((address, port), timeout=timeout)
    except OSError as exc:
        raise ValueError(f"URL cannot be reached ({exc.strerror or exc})") from None
    try:
        if secure:
            context = ssl.create_default_context()
            sock = context.wrap_socket(sock, server_hostname=parts.hostname)
            connection = http.client.HTTPSConnection(parts.hostname, port, timeout=timeout)
        else:
            connection = http.client.HTTPConnection(parts.hostname, port, timeout=timeout)
        connection.sock = sock  # connected already: to the checked address, not a new lookup
        connection.request("GET", target, headers={"User-Agent": "tokenmill"})
        response = connection.getresponse()
        if 300 <= response.status < 400:
            location = (response.getheader("Location") or "")[:200]
            raise ValueError(
                f"URL answered a redirect (HTTP {response.status}) to {location!r}: "
                "redirects are not followed; give the image's final URL"
            )
        if response.status != 200:
            raise ValueError(f"URL answered HTTP {response.status} {response.reason}")
        data = response.read(max_bytes + 1)
        if len(data) > max_bytes:
            raise ValueError(f"URL's image is over {max_bytes} bytes")
        return data
    except (OSError, http.client.HTTPException) as exc:
        raise ValueError(f"URL cannot be read ({type(exc).__name__}: {exc})") from None
    finally:
        sock.close()
