"""The service role's state on the host: every replica's unit as rendered."""


def test_unit_file_is_the_rendered_one(host, expected, fix):
    for replica in expected["replicas"]:
        unit = host.file(replica["unit_path"])
        assert unit.exists, f"replica {replica['index']}: {replica['unit_path']} is missing; {fix}"
        assert unit.content_string == replica["unit_text"], \
            f"replica {replica['index']}: {replica['unit_path']} differs from what the service role renders " \
            f"(edited by hand?); {fix}"


def test_no_replica_left_that_is_not_planned(host, expected, fix):
    """A replica the placement no longer gives (a GPU now busy, `gpus` reduced), or the unit a
    replica ran under before it moved to its family's name, is gone."""
    planned = {replica["unit"] for replica in expected["replicas"]}
    found = host.run(f"for f in {' '.join(expected['replica_unit_globs'])}; do [ -f \"$f\" ] && "
                     f"echo \"${{f##*/}}\"; done; true")
    left = set(found.stdout.split()) - planned
    assert not left, f"{', '.join(sorted(left))}: not planned on this host any more but still installed; {fix}"


def test_environment_file_is_0600_root(host, expected, fix):
    env = host.file(expected["env_path"])
    assert env.exists, f"{expected['env_path']} is missing; {fix}"
    assert (env.mode, env.user, env.group) == (0o600, "root", "root"), \
        f"{expected['env_path']} is {oct(env.mode)} {env.user}:{env.group}, must be 0600 root:root " \
        f"(it holds the API key); {fix}"


def test_enabled_exactly_when_autostart(host, expected, fix):
    for replica in expected["replicas"]:
        enabled = host.service(replica["unit"]).is_enabled
        assert enabled == expected["autostart"], \
            f"{replica['unit']} is {'enabled' if enabled else 'not enabled'} at boot but autostart is " \
            f"{str(expected['autostart']).lower()}; {fix}"


def test_conflicts_as_declared(host, expected, fix):
    for replica in expected["replicas"]:
        line = host.run(f"systemctl show -p Conflicts --value {replica['unit']}").stdout.split()
        for unit in expected["conflicts"]:
            assert unit in line, f"{replica['unit']} does not conflict with {unit}; {fix}"
