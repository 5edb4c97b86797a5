"""A Dask scheduler's address, checked before connecting: its form, then whether a scheduler answers there.

Dask's client would wait out its whole timeout on an address it cannot parse, read a non-Dask
service's first bytes as a message length (and try to allocate exabytes), and print tracebacks
from half-built objects. So the address is parsed here (``tcp://host:port`` or ``host:port``), a
plain socket connects with a short timeout, and the first bytes a Dask scheduler sends on every
new connection (the length of its handshake message, a few hundred bytes) are checked before
Dask is handed the address.
"""

from __future__ import annotations

import ipaddress
import re
import socket
import struct

from qtool.errors import QtoolError

PROBE_SECONDS = 3.0  # connecting to the scheduler and hearing its first bytes
HANDSHAKE_MAX_BYTES = 1 << 20  # a scheduler's handshake is a few hundred bytes
_HOST = re.compile(
    r"^(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$"
)
HINT = "give tcp://HOST:PORT (the address 'dask scheduler' prints), e.g. tcp://10.0.0.5:8786"


def parse_scheduler_address(address: str) -> tuple[str, int]:
    """(host, port) of ``tcp://host:port`` or ``host:port``; a clear error for anything else."""
    shown = address if len(address) <= 80 else address[:80] + "..."
    scheme, sep, rest = address.strip().partition("://")
    if not sep:
        scheme, rest = "tcp", address.strip()
    if scheme.lower() == "tls":
        raise QtoolError(
            f"--scheduler {shown}: TLS schedulers need certificates qtool does not take",
            hint="reach the scheduler over tcp:// (an SSH tunnel, or a private network)",
        )
    if scheme.lower() != "tcp":
        raise QtoolError(f"--scheduler {shown}: qtool connects to tcp:// schedulers only", hint=HINT)
    host, colon, port_text = rest.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not colon or not port_text.isdigit() or not 0 < int(port_text) < 65536 or not _valid_host(host):
        raise QtoolError(f"--scheduler {shown} is not an address of the form tcp://HOST:PORT", hint=HINT)
    return host, int(port_text)


def _valid_host(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return bool(_HOST.match(host))


def probe_scheduler(address: str, timeout: float = PROBE_SECONDS) -> None:
    """Raise unless a Dask scheduler answers at ``address`` within ``timeout`` seconds."""
    host, port = parse_scheduler_address(address)
    try:
        with socket.create_connection((host, port), timeout=timeout) as connection:
            connection.settimeout(timeout)
            first = _receive(connection, 8)
    except TimeoutError:
        raise QtoolError(
            f"cannot reach the Dask scheduler at {address}: no answer within {timeout:g} s",
            hint="start one with 'dask scheduler' and workers with 'dask worker ADDRESS'",
        ) from None
    except OSError as e:
        raise QtoolError(
            f"cannot reach the Dask scheduler at {address}: {e.strerror or e}",
            hint="start one with 'dask scheduler' and workers with 'dask worker ADDRESS'",
        ) from None
    length = struct.unpack("<Q", first)[0] if len(first) == 8 else None
    if length is None or not 0 < length <= HANDSHAKE_MAX_BYTES:
        raise QtoolError(
            f"the service at {address} does not answer as a Dask scheduler",
            hint="is it the scheduler's port (8786 by default), not its dashboard's or another service's?",
        )


def _receive(connection: socket.socket, count: int) -> bytes:
    """Up to ``count`` bytes, fewer when the peer closes the connection first."""
    data = b""
    while len(data) < count:
        chunk = connection.recv(count - len(data))
        if not chunk:
            break
        data += chunk
    return data
