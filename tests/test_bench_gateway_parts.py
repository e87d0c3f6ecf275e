"""bench/gateway/parts.py's variants are the gateway's configuration as the role renders it, less
one part each: every part it takes away is found in today's configuration (a template change that
renames one fails here, not in a bench run on a borrowed machine), and each variant differs from
the whole by that part alone."""
from __future__ import annotations

import pytest

from bench.gateway import loopback, parts


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    folder = tmp_path_factory.mktemp("loopback")
    loopback.prepare(folder)
    return folder, (folder / loopback.KINDS["dedicated"].limits_dir / "haproxy.cfg").read_text()


def _lines(text: str) -> set[str]:
    return set(text.splitlines())


def test_every_variant_takes_away_its_part_and_nothing_else(rendered):
    folder, config = rendered
    sink = folder / loopback.KINDS["dedicated"].limits_dir / "sink.sock"
    every = parts.variants(config, sink)
    whole = _lines(config)
    assert every[parts.EVERYTHING][1] == config
    gone = {name: whole - _lines(text) for name, (_, text) in every.items()}
    assert gone["no filter"] == {"    filter lua.usage"}
    assert len(gone["native reader"]) == 1 and next(iter(gone["native reader"])).startswith("    http-request lua.asks ")
    assert _lines(every["native reader"][1]) - whole == {parts.NATIVE_READER}
    assert len(gone["no record"]) == 1 and "log unix@" in next(iter(gone["no record"]))
    assert gone["no Lua"] == gone["no filter"] | gone["native reader"]
    assert gone["no Lua + no record"] == gone["no Lua"] | gone["no record"]
    assert gone["no L7 retries"] == {"    retry-on conn-failure empty-response 503"}
    assert "    retry-on conn-failure" in _lines(every["no L7 retries"][1])
    assert gone["16 KiB buffers"] == {"    tune.bufsize 131072"}
    assert "    tune.bufsize 16384" in _lines(every["no Lua + no record + 16 KiB"][1])
    # the records go to the sink instead of the usage service's socket, and nowhere else changes
    assert len(gone["records to a sink"]) == 1
    assert f"log unix@{sink} " in every["records to a sink"][1]


def test_a_part_the_configuration_no_longer_has_is_named(rendered):
    _, config = rendered
    with pytest.raises(SystemExit, match="filter lua"):
        parts.variants(config.replace("filter lua.usage", "filter lua.counting"), rendered[0] / "sink.sock")
    with pytest.raises(SystemExit, match="retry-on"):
        parts.variants(config.replace("retry-on conn-failure empty-response 503", "retry-on all-retryable-errors"),
                       rendered[0] / "sink.sock")


def test_the_bench_runs_the_usage_service_the_gateway_role_installs():
    from serving import accounting
    assert loopback.USAGE_SERVICE.is_file(), loopback.USAGE_SERVICE
    assert loopback.USAGE_SERVICE.parent == accounting.FILES, "the bench's usage service is the one the role installs"
