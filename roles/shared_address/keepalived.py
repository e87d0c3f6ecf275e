"""keepalived's configuration for the gateways' shared address (VRRP), from the
inventory and the host's own addresses, and what a host's addresses say about who
holds it. Pure functions."""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path

import jinja2

from serving.fleet import SHARED_ADDRESS_CHECK, SHARED_ADDRESS_MANAGED, SHARED_ADDRESS_UNIT
from serving.templates import environment

HERE = Path(__file__).parent
UNIT = SHARED_ADDRESS_UNIT
INSTANCE = "dgemma_gateway"


@dataclass(frozen=True)
class Placement:
    """Where the shared address goes on this host: the interface on its network, that
    network's prefix length, and the host's own address there (VRRP's source)."""
    interface: str
    prefix: int
    source: str


def parse_addresses(text: str) -> list[dict]:
    """``ip -o -4 addr show``: ``[{"interface", "address", "prefix"}]``, in its order."""
    out = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 4 and fields[2] == "inet" and "/" in fields[3]:
            address, _, prefix = fields[3].partition("/")
            out.append({"interface": fields[1].split("@")[0], "address": address, "prefix": int(prefix)})
    return out


def valid_address(text) -> str | None:
    """Why ``text`` cannot be the shared address, or None when it can."""
    try:
        address = ipaddress.IPv4Address(str(text))
    except ValueError:
        return f"{text!r} is not an IPv4 address"
    if address.is_loopback or address.is_multicast or address.is_unspecified or address.is_link_local:
        return f"{text} is a loopback, multicast, link-local or unspecified address"
    return None


def placement(shared: str, addresses: list[dict]) -> Placement | None:
    """The host's address whose network holds ``shared`` (not ``shared`` itself, which the
    holder carries too), or None when no network of the host holds it."""
    target = ipaddress.IPv4Address(shared)
    for entry in addresses:
        if entry["address"] == shared or entry["prefix"] >= 31:
            continue
        network = ipaddress.IPv4Network(f"{entry['address']}/{entry['prefix']}", strict=False)
        if target in network and target not in (network.network_address, network.broadcast_address):
            return Placement(entry["interface"], entry["prefix"], entry["address"])
    return None


def holds(shared: str, addresses: list[dict]) -> bool:
    return any(entry["address"] == shared for entry in addresses)


def peers(host: str, gateways: dict[str, str], place: Placement) -> list[str] | None:
    """The other gateways' addresses, for unicast VRRP (networks that drop multicast, as
    many switches and every cloud do); None when one of them is not an IPv4 address on
    this network (a name, another subnet): multicast then, as VRRP's default."""
    network = ipaddress.IPv4Network(f"{place.source}/{place.prefix}", strict=False)
    out = []
    for name, address in gateways.items():
        if name == host:
            continue
        try:
            if ipaddress.IPv4Address(address) not in network:
                return None
        except ValueError:
            return None
        out.append(address)
    return out


def priority(host: str, gateways: dict[str, str]) -> int:
    """The first gateway of the inventory first: 150, 140, ... (never below 1). The order
    decides the first holder and a split's end, not a move back (nopreempt)."""
    position = list(gateways).index(host) if host in gateways else len(gateways)
    return max(1, 150 - 10 * position)


def _templates() -> jinja2.Environment:
    return environment(HERE / "templates")


def render_config(host: str, v: dict, place: Placement, gateways: dict[str, str]) -> str:
    return _templates().get_template("keepalived.conf.j2").render(
        managed=SHARED_ADDRESS_MANAGED, host=host, instance=INSTANCE, check=SHARED_ADDRESS_CHECK, place=place,
        shared=v["gateway_address"],
        router_id=int(v.get("gateway_vrrp_id", 51)), priority=priority(host, gateways),
        preempt=bool(v.get("gateway_preempt", False)), peers=peers(host, gateways, place))


def render_check(host: str, port: int, ca_file: str) -> str:
    return _templates().get_template("answers.sh.j2").render(managed=SHARED_ADDRESS_MANAGED, host=host, port=port,
                                                             ca=ca_file)
