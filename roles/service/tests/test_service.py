"""The service role's state on the host."""


def test_unit_file_is_the_rendered_one(host, expected, fix):
    unit = host.file(expected["unit_path"])
    assert unit.exists, f"{expected['unit_path']} is missing; {fix}"
    assert unit.content_string == expected["unit_text"], \
        f"{expected['unit_path']} differs from what the service role renders (edited by hand?); {fix}"


def test_environment_file_is_0600_root(host, expected, fix):
    env = host.file(expected["env_path"])
    assert env.exists, f"{expected['env_path']} is missing; {fix}"
    assert (env.mode, env.user, env.group) == (0o600, "root", "root"), \
        f"{expected['env_path']} is {oct(env.mode)} {env.user}:{env.group}, must be 0600 root:root " \
        f"(it holds the API key); {fix}"


def test_enabled_exactly_when_autostart(host, expected, fix):
    enabled = host.service(expected["unit"]).is_enabled
    assert enabled == expected["autostart"], \
        f"{expected['unit']} is {'enabled' if enabled else 'not enabled'} at boot but autostart is " \
        f"{str(expected['autostart']).lower()}; {fix}"


def test_conflicts_as_declared(host, expected, fix):
    line = host.run(f"systemctl show -p Conflicts --value {expected['unit']}").stdout.split()
    for unit in expected["conflicts"]:
        assert unit in line, f"{expected['unit']} does not conflict with {unit}; {fix}"
