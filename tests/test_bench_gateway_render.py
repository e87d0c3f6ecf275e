"""The loopback bench's gateways are what deploy renders: for each kind (a dedicated gateway, a
serving one), the configuration `bench/gateway/loopback.py prepare` writes is, line for line, the
one the gateway role's plan writes to its host through the runner's own executor (as `deploy
--check` runs it), from the kind's fleet read as deploy reads an inventory, with only the bench's
own placement (``loopback.localised``: its folder, its ports, no drop to the user haproxy) and its
generation applied. A bench that renders a host otherwise than deploy (its groups lost, a variable
the role reads and the bench does not pass) fails here."""
from __future__ import annotations

import difflib

import pytest

from bench.gateway import loopback
from converge.changes import Decision, File
from serving.handoffs import GATEWAY_GENERATION
from serving.haproxy.instance import GATEWAY
from tests import plans


def deploys(kind: loopback.Kind) -> str:
    """The configuration the gateway role's plan writes on the kind's host, on a new host (the
    gateway case's fresh host's facts), as the executor takes it."""
    from roles.gateway.role import ROLE
    v, every = loopback.fleet_hostvars(kind)
    fresh = plans.load(plans.HERE / "cases" / "gateway" / "fresh-host.json")
    case = {**fresh, "host": kind.host, "group_names": v["group_names"],
            "vars": {k: val for k, val in v.items() if k != "group_names"},
            "fleet": every, "secrets": {"api_key_file": "sk-plan-test-key\n"}}
    done = plans.run(case, run_roles=[ROLE])
    generation = next(t.step.value for t in done.taken
                      if isinstance(t.step, Decision) and t.step.produces is GATEWAY_GENERATION)
    written = [t.step for t in done.taken if isinstance(t.step, File) and t.step.path == f"{GATEWAY.dir}/haproxy.cfg"]
    assert len(written) == 1, [t.step for t in done.taken if isinstance(t.step, File)]
    return written[0].content.replace(generation, loopback.GENERATION)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    folder = tmp_path_factory.mktemp("loopback")
    loopback.prepare(folder)
    return folder


@pytest.mark.parametrize("name", sorted(loopback.KINDS))
def test_the_bench_runs_each_kind_of_gateway_as_deploy_renders_it(prepared, name):
    kind = loopback.KINDS[name]
    files = prepared / kind.limits_dir
    want = loopback.localised(deploys(kind), files, kind.stats, kind.usage).splitlines()
    got = (files / "haproxy.cfg").read_text().splitlines()
    diff = list(difflib.unified_diff(want, got, "deploy renders", "the bench runs", lineterm="", n=1))
    assert not diff, "\n".join(diff[:60])


def test_the_kinds_differ_as_a_dedicated_and_a_serving_gateway_do(prepared):
    """A dedicated gateway takes every core; a serving one keeps to the threads set apart for it."""
    dedicated = (prepared / loopback.KINDS["dedicated"].limits_dir / "haproxy.cfg").read_text()
    serving = (prepared / loopback.KINDS["serving"].limits_dir / "haproxy.cfg").read_text()
    assert "nbthread" not in dedicated
    assert "    nbthread 2\n" in serving
    plan = __import__("json").loads((prepared / "plan.json").read_text())
    assert plan["kinds"]["serving"]["haproxy_args"] == ["-m", "1024"]
    assert plan["kinds"]["dedicated"]["haproxy_args"] == []


def test_the_gateway_without_limits_is_the_same_gateway_less_its_accounting(prepared):
    for kind in loopback.KINDS.values():
        plain = (prepared / kind.plain_dir / "haproxy.cfg").read_text()
        limited = (prepared / kind.limits_dir / "haproxy.cfg").read_text()
        assert "usage.lua" not in plain and "usage.lua" in limited
        assert f"bind 127.0.0.1:{kind.plain} ssl" in plain
        assert ("nbthread" in plain) == ("nbthread" in limited)
