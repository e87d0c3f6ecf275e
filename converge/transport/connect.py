"""Fabric connections as the engine wants them: strict host keys, jump hosts
shared per run, and errors that say what to do.

Fabric gives us ssh_config (HostName, User, Port, IdentityFile, ProxyJump...),
``connect_kwargs``, ``connect_timeout`` and gateways (an inner connection
carried by a ``direct-tcpip`` channel of the bastion's). What we change:
- host keys: Fabric sets ``AutoAddPolicy`` and loads no known_hosts; every
  connection here gets paramiko's ``RejectPolicy`` and the inventory's
  known_hosts before it opens;
- jump hosts: Fabric builds ProxyJump hops itself with a clone of the config
  and the same AutoAddPolicy (fabric #1852), and a new connection to the
  bastion for every host. We build the hops (``JumpHosts``), strict like the
  hosts, and share one connection per bastion among all hosts of a run; hops
  open under a lock, as several host threads may reach one at once;
- the one Fabric config every connection shares is left untouched (``Connection``).
"""
from __future__ import annotations

import logging
import shlex
import socket
import threading

import fabric
import paramiko

from .. import hostkeys, ssh_config
from ..errors import ConnectionFailed, HostKeyError
from ..ssh_settings import Hop, SSHSettings

# paramiko's transport thread logs a failed handshake with its traceback; with no
# handler configured, Python's last-resort handler would print it on stderr beside
# our own one-line error (ConnectionFailed says what happened and what to do)
logging.getLogger("paramiko").addHandler(logging.NullHandler())


class Connection(fabric.Connection):
    """Fabric's connection, with ``inline_ssh_env`` declared. Fabric 3 assigns it in
    ``__init__`` without declaring it, so invoke's DataProxy takes the assignment for a
    change of the config: ``Config.merge()`` then empties and refills the dict that every
    connection of the run shares, and a host thread reading it meanwhile (``open()`` reads
    ``authentication``) finds half a config: "AttributeError: No attribute or config key
    found for 'authentication'", seen on 2 of 16 hosts in a fleet benchmark. Declared,
    it is a plain attribute of this connection."""

    inline_ssh_env = None


def connection(host: str, user: str | None, port: int | None, settings: SSHSettings, gateway) -> fabric.Connection:
    """A Fabric connection (not yet open) that checks host keys against known_hosts."""
    key, timeout = settings.key_file, settings.connect_timeout
    # an explicit key is the key: no agent, no ~/.ssh guessing
    kwargs = {"banner_timeout": timeout, "auth_timeout": timeout, "allow_agent": key is None,
              "look_for_keys": key is None, **({"key_filename": [key]} if key else {})}
    conn = Connection(host, user=user, port=port, config=ssh_config.shared_config(), gateway=gateway,
                             connect_timeout=int(max(timeout, 1)), connect_kwargs=kwargs)
    conn.client.set_missing_host_key_policy(paramiko.RejectPolicy())
    hostkeys.load(hostkeys.files(settings.known_hosts), into=conn.client.get_host_keys())
    return conn


def for_host(settings: SSHSettings, gateway=False) -> fabric.Connection:
    """The host's own Fabric connection (not open): Fabric resolves HostName,
    User and Port from ssh_config."""
    return connection(settings.host, settings.user, settings.port, settings, gateway)


def for_hop(hop: Hop, settings: SSHSettings, gateway=False) -> fabric.Connection:
    return connection(hop.host, hop.user, hop.port, settings, gateway)


def open_connection(conn: fabric.Connection, name: str, what: str, known_hosts: str | None, timeout: float,
                    via: str | None = None):
    """Open ``conn`` (``what`` names it in messages: "", the host, or "the jump host X"),
    turning paramiko's exceptions into ConnectionFailed / HostKeyError for ``name``."""
    where = hostkeys.known_hosts_name(conn.host, conn.port)
    known_file = known_hosts or hostkeys.USER_KNOWN_HOSTS
    through = f" through {via}" if via else ""
    label, whom = f"{what} {where}".strip(), f"{what + ' ' if what else ''}{conn.user}@{where}"
    try:
        conn.open()
    except paramiko.BadHostKeyException as exc:
        raise HostKeyError(
            f"{name}: the host key of {label} CHANGED: it offered {hostkeys.fingerprint(exc.key)} but "
            f"known_hosts has {hostkeys.fingerprint(exc.expected_key)}. If the machine was reinstalled, remove the "
            f"old key (ssh-keygen -R {shlex.quote(where)} -f {known_file}) and run: invoke trust --hosts {name}. "
            f"Otherwise someone may be intercepting the connection.") from exc
    except paramiko.AuthenticationException as exc:
        raise ConnectionFailed(f"{name}: {whom} refused our key ({exc}): check ansible_user and "
                               f"ansible_ssh_private_key_file") from exc
    except paramiko.ChannelException as exc:
        raise ConnectionFailed(f"{name}: {via} could not reach {where}: {exc.text or exc}") from exc
    except paramiko.SSHException as exc:
        if "not found in known_hosts" in str(exc):
            raise HostKeyError(f"{name}: {label} is not in known_hosts ({known_file}). Check its fingerprint and "
                               f"pin it with: invoke trust --hosts {name}") from exc
        transport = conn.client.get_transport()
        # paramiko words a missing banner several ways ("Error reading SSH protocol banner",
        # "No existing session"): what is known is that the server never said which SSH it is
        if transport is None or not getattr(transport, "remote_version", "") or \
                any(word in str(exc).lower() for word in ("banner", "timeout")):
            raise ConnectionFailed(f"{name}: {label} did not answer as an SSH server within {timeout:g} s"
                                   f"{through} ({exc})") from exc
        raise ConnectionFailed(f"{name}: SSH to {whom}{through} failed: {exc}") from exc
    except (socket.timeout, TimeoutError) as exc:
        raise ConnectionFailed(f"{name}: no answer from {label}{through} within {timeout:g} s: is it up?") from exc
    except OSError as exc:
        raise ConnectionFailed(f"{name}: cannot reach {label}{through}: {exc.strerror or exc}") from exc
    except EOFError as exc:
        raise ConnectionFailed(f"{name}: {label}{through} closed the connection during the handshake") from exc
    transport = conn.client.get_transport()
    if isinstance(transport.sock, socket.socket):
        # Our messages are small requests that wait for their answers: with Nagle's
        # algorithm on, a script behind its exec request waited for a delayed ACK,
        # ~40 ms per command on a LAN. (A connection through a jump host rides a
        # channel: the jump host's own socket carries the option.)
        transport.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    transport.set_keepalive(15)


class JumpHosts:
    """The jump hosts (bastions) of one run: one connection to each, shared by
    every host behind it, closed when the run is over."""

    def __init__(self):
        self._lock = threading.Lock()
        self._hops: dict[tuple, tuple[fabric.Connection, threading.Lock, str, str | None]] = {}

    def gateway(self, settings: SSHSettings):
        """The Fabric gateway for a host: the last hop of its ProxyJump list
        (each hop reached through the one before), or False (no jump)."""
        parent, parent_label = False, None
        for hop in settings.jumps:
            key = (hop.host, hop.user, hop.port, settings.key_file, settings.known_hosts, id(parent))
            with self._lock:
                if key not in self._hops:
                    # a hop without an IdentityFile of its own in ssh_config uses the host's key
                    self._hops[key] = (for_hop(hop, settings, parent), threading.Lock(), str(hop), parent_label)
            parent, parent_label = self._hops[key][0], str(hop)
        return parent

    def open_for(self, settings: SSHSettings, gateway):
        """Open every hop in front of a host (each once per run), the outermost first."""
        chain = []
        while gateway:
            chain.append(gateway)
            gateway = gateway.gateway
        for hop in reversed(chain):
            conn, lock, label, via = next(e for e in self._hops.values() if e[0] is hop)
            with lock:
                if not conn.is_connected:
                    open_connection(conn, settings.name, f"the jump host {label}", settings.known_hosts,
                                    settings.connect_timeout, via=via)
                    # opening a channel to the next hop (or the host) must not wait an hour
                    conn.client.get_transport().channel_timeout = settings.connect_timeout

    def close(self):
        with self._lock:
            hops = list(self._hops.values())
            self._hops.clear()
        for conn, *_ in reversed(hops):  # the innermost first
            conn.close()


def offered_key(conn: fabric.Connection, timeout: float) -> paramiko.PKey:
    """The key the server of ``conn`` (not open) offers, read from its key exchange
    without authenticating: directly, or through its (open) jump host."""
    if conn.gateway:
        sock = conn.gateway.client.get_transport().open_channel(
            "direct-tcpip", (conn.host, int(conn.port)), ("", 0), timeout=timeout)
    else:
        sock = socket.create_connection((conn.host, int(conn.port)), timeout=timeout)
    transport = paramiko.Transport(sock)
    try:
        transport.start_client(timeout=timeout)
        return transport.get_remote_server_key()
    finally:
        transport.close()
