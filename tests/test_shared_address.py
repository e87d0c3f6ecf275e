"""The gateways' shared address: keepalived's configuration, where the address goes on a
host, who holds it, and what `invoke status` makes of the gateways' answers."""
from pathlib import Path

import pytest

from day2.status_table import shared_address
from roles.shared_address import keepalived

HOLDER = (Path(__file__).parent / "fixtures/ip/gateway-holder.txt").read_text()
GATEWAYS = {"gateway01": "10.213.0.110", "gateway02": "10.213.0.111"}


def test_addresses_parsed_from_ip_o():
    found = keepalived.parse_addresses(HOLDER)
    assert [a["interface"] for a in found] == ["lo", "host0", "host0", "host1"]
    assert found[2] == {"interface": "host0", "address": "10.213.0.200", "prefix": 24}
    assert keepalived.holds("10.213.0.200", found)
    assert not keepalived.holds("10.213.0.201", found)


def test_the_address_goes_on_the_interface_of_its_network():
    found = keepalived.parse_addresses(HOLDER)
    place = keepalived.placement("10.213.0.200", found)
    assert place == keepalived.Placement("host0", 24, "10.213.0.110")  # its own address, not the shared one
    assert keepalived.placement("10.213.1.50", found).interface == "host1"
    assert keepalived.placement("10.9.0.1", found) is None
    assert keepalived.placement("10.213.0.255", found) is None  # the broadcast address is no host's


@pytest.mark.parametrize("text,why", [("10.0.0.300", "not an IPv4"), ("127.0.0.5", "loopback"),
                                      ("224.0.0.18", "multicast"), ("0.0.0.0", "unspecified")])
def test_unusable_shared_addresses_are_named(text, why):
    assert why in keepalived.valid_address(text)
    assert keepalived.valid_address("10.213.0.200") is None


def test_unicast_to_the_other_gateways_multicast_when_one_is_a_name_or_elsewhere():
    place = keepalived.Placement("host0", 24, "10.213.0.110")
    assert keepalived.peers("gateway01", GATEWAYS, place) == ["10.213.0.111"]
    assert keepalived.peers("gateway01", {**GATEWAYS, "gw3": "gw3.lab"}, place) is None
    assert keepalived.peers("gateway01", {**GATEWAYS, "gw3": "10.9.0.3"}, place) is None


def test_config_every_gateway_a_backup_no_preemption_unless_asked():
    place = keepalived.Placement("host0", 24, "10.213.0.110")
    v = {"gateway_address": "10.213.0.200", "gateway_vrrp_id": 51}
    text = keepalived.render_config("gateway01", v, place, GATEWAYS)
    assert "state BACKUP" in text and "\n    nopreempt\n" in text and "priority 150" in text
    assert "unicast_src_ip 10.213.0.110" in text and "        10.213.0.111\n" in text
    assert "10.213.0.200/24 dev host0" in text and "virtual_router_id 51" in text
    second = keepalived.render_config("gateway02", v, keepalived.Placement("host0", 24, "10.213.0.111"), GATEWAYS)
    assert "priority 140" in second and "        10.213.0.110\n" in second
    assert "nopreempt" not in keepalived.render_config("gateway01", {**v, "gateway_preempt": True}, place, GATEWAYS)


def test_status_names_the_holder_a_split_and_an_outage():
    def gw(held, unit="active", reachable=True):
        return {"reachable": reachable, "gateway_servers": [], "errors": [],
                "shared_address": {"address": "10.213.0.200", "held": held, "keepalived": unit}}
    one = shared_address({"gateway01": gw(False), "gateway02": gw(True), "rtx01": {"reachable": True}})
    assert one == {"address": "10.213.0.200", "holders": ["gateway02"], "problem": None}
    split = shared_address({"gateway01": gw(True), "gateway02": gw(True)})
    assert split["problem"].startswith("split: gateway01 and gateway02 each hold 10.213.0.200")
    none = shared_address({"gateway01": gw(False, "failed"), "gateway02": gw(False)})
    assert "keepalived is not running on gateway01" in none["problem"]
    assert shared_address({"rtx01": {"reachable": True}}) is None


def test_status_prints_the_holder_and_a_split_on_a_terminal_and_through_a_pipe():
    import io

    from rich.console import Console

    from day2.status_table import print_status
    hosts = {g: {"reachable": True, "errors": [], "drift": [], "gateway_servers": [],
                 "shared_address": {"address": "10.213.0.200", "held": True, "keepalived": "active"}}
             for g in ("gateway01", "gateway02")}
    split = {"ok": False, "hosts": hosts, "shared_address": shared_address(hosts)}
    for terminal in (True, False):
        out = io.StringIO()
        print_status(split, Console(file=out, width=100, force_terminal=terminal, color_system=None))
        text = " ".join(out.getvalue().split())
        assert "split: gateway01 and gateway02 each hold 10.213.0.200" in text, text
    hosts["gateway02"]["shared_address"]["held"] = False
    held = {"ok": True, "hosts": hosts, "shared_address": shared_address(hosts)}
    out = io.StringIO()
    print_status(held, Console(file=out, width=100, force_terminal=False))
    assert "shared_address 10.213.0.200 held_by=gateway01\n" in out.getvalue()
    out = io.StringIO()
    print_status(held, Console(file=out, width=100, force_terminal=True, color_system=None))
    assert "SHARED ADDRESS 10.213.0.200: held by gateway01" in out.getvalue()
    assert "STATUS" not in out.getvalue()  # no replica in this status: no empty table
