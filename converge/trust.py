"""``invoke trust``: show each key a host's connection meets (its jump hosts'
first, then its own) and pin the unknown ones, on request.

A jump host is reached strictly once its own key is known, and the next key is
read through it: trusting a host behind a bastion never trusts more than the
user saw.
"""
from __future__ import annotations

from dataclasses import dataclass

import paramiko

from . import hostkeys
from .errors import ConnectionFailed
from .ssh_settings import SSHSettings
from .transport import connect


@dataclass
class Seen:
    """One key met on the way to a host."""

    label: str  # the host, or "jump host X"
    where: str  # its known_hosts name
    key: paramiko.PKey
    state: str  # trusted, new, changed
    expected: paramiko.PKey | None = None


def walk(settings: SSHSettings, decide) -> list[Seen]:
    """Meet every key on the way to the host, in order. ``decide(seen)`` is asked
    for each new key and returns whether to pin it; an unpinned or changed key
    stops the walk (nothing behind it can be reached safely).

    Raises ConnectionFailed when a hop or the host cannot be reached."""
    chain = []
    parent = False
    for hop in settings.jumps:
        parent = connect.for_hop(hop, settings, parent)
        chain.append((f"jump host {hop}", parent))
    chain.append((settings.name, connect.for_host(settings, parent)))
    seen: list[Seen] = []
    try:
        for index, (label, conn) in enumerate(chain):
            where = hostkeys.known_hosts_name(conn.host, int(conn.port))
            try:
                key = connect.offered_key(conn, settings.connect_timeout)
            except (OSError, paramiko.SSHException, EOFError) as exc:
                raise ConnectionFailed(f"{settings.name}: cannot reach {label} {where}: {exc}") from exc
            known = hostkeys.load(hostkeys.files(settings.known_hosts)).lookup(where) or {}
            if known.get(key.get_name()) == key:
                seen.append(Seen(label, where, key, "trusted"))
            elif key.get_name() in known:
                seen.append(Seen(label, where, key, "changed", known[key.get_name()]))
                return seen
            else:
                entry = Seen(label, where, key, "new")
                seen.append(entry)
                if not decide(entry):
                    return seen
                hostkeys.pin(settings.known_hosts, where, key)
                entry.state = "pinned"
            if index < len(chain) - 1:  # through this hop to the next, with its key now known
                conn.client.get_host_keys().clear()
                hostkeys.load(hostkeys.files(settings.known_hosts), into=conn.client.get_host_keys())
                connect.open_connection(conn, settings.name, label, settings.known_hosts,
                                           settings.connect_timeout)
    finally:
        for _, conn in reversed(chain):
            conn.close()
    return seen
