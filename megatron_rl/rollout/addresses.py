"""Server addresses: what makes a base URL usable, and when two spellings name one server.

A fleet counts each server once; the same server listed twice would be sent twice the work it can
take, and counted twice in every sync. Two URLs name the same server when they agree once spelled
alike (a port speaks one protocol, so the scheme only gives the default port): the host in lower case, the host's trailing dot dropped, the loopback names
(``localhost``, ``127.0.0.1``, ``::1``, ``0.0.0.0``) one name, the scheme's default port written out,
the path's trailing slashes dropped (:func:`server_key`); at connection, also when their host names
resolve to a common address (:func:`resolved_key`: ``node7:8000`` and ``10.0.0.7:8000``). No import
beyond the standard library: the config checks use it.
"""

from __future__ import annotations

import concurrent.futures as cf
import socket
from urllib.parse import urlsplit

DEFAULT_PORTS = {"http": 80, "https": 443}
LOOPBACK = {"localhost", "localhost.localdomain", "127.0.0.1", "::1", "0.0.0.0", "::"}


def url_problem(url) -> str | None:
    """Why ``url`` cannot be a server's base URL (None: it can)."""
    if not isinstance(url, str) or not url.strip():
        return f"a base URL like http://host:8000 is needed, got {url!r}"
    if url != url.strip():
        return f"has white space around it: {url!r}"
    try:
        parts = urlsplit(url)
        port = parts.port  # (out-of-range or non-numeric ports raise here)
    except ValueError as exc:
        return f"is not a URL ({exc}): {url!r}"
    if parts.scheme not in DEFAULT_PORTS:
        return f"must start with http:// or https://, got {url!r}"
    if not parts.hostname:
        return f"names no host: {url!r}"
    if port == 0:
        return f"port 0 is no server's port: {url!r}"
    if parts.query or parts.fragment or parts.username or parts.password:
        return f"must be a plain base URL (no user, query or fragment), got {url!r}"
    return None


def server_key(url: str) -> tuple[str, int, str]:
    """``url`` spelled the one way, ``(host, port, path)`` (see the module doc)."""
    parts = urlsplit(url)
    host = (parts.hostname or "").lower().rstrip(".")
    if host in LOOPBACK:
        host = "localhost"
    return host, parts.port or DEFAULT_PORTS.get(parts.scheme.lower(), 0), parts.path.rstrip("/")


def same_servers(urls: list[str]) -> list[tuple[int, int]]:
    """Pairs ``(i, j)``, ``i < j``, of entries that name the same server (by :func:`server_key`)."""
    first: dict[tuple, int] = {}
    pairs = []
    for j, url in enumerate(urls):
        key = server_key(url)
        if key in first:
            pairs.append((first[key], j))
        else:
            first[key] = j
    return pairs


def resolved_key(url: str, timeout_s: float = 5.0) -> set[tuple[str, int, str]]:
    """The addresses ``url``'s host resolves to, each with the port and path (empty when the name
    does not resolve within ``timeout_s``: then only its spelling can be compared)."""
    host, port, path = server_key(url)
    if host == "localhost":
        return {("localhost", port, path)}
    pool = cf.ThreadPoolExecutor(max_workers=1)
    try:
        infos = pool.submit(socket.getaddrinfo, host, port, type=socket.SOCK_STREAM).result(timeout=timeout_s)
    except (OSError, cf.TimeoutError):
        return set()
    finally:
        pool.shutdown(wait=False)
    out = set()
    for *_, addr in infos:
        ip = addr[0]
        out.add(("localhost" if ip in LOOPBACK else ip, port, path))
    return out


def same_resolved(urls: list[str], timeout_s: float = 5.0) -> list[tuple[int, int]]:
    """Pairs ``(i, j)`` of entries whose hosts resolve to a common address (same port and path)."""
    keys = [resolved_key(u, timeout_s) for u in urls]
    return [(i, j) for j in range(len(urls)) for i in range(j) if keys[i] & keys[j]]
