"""Reaching hosts as they really are: become, ProxyJump, ssh_config's Include,
secret files. Pure parts here; the lab tests run them against real sshd and sudo."""
import os
import shlex
import subprocess

import pytest

from converge import ssh_config
from converge.become import Become, check_password, diagnose
from converge.errors import ConvergeError, InventoryError, SecretError
from converge.secrets import read_secret_file
from converge.ssh_settings import Hop, SSHSettings, parse_common_args, parse_jumps


def test_proxyjump_in_ansible_common_args_the_ways_people_write_it():
    assert parse_common_args("-o ProxyJump=jump@10.0.0.5")["jump"] == (Hop("10.0.0.5", "jump"),)
    assert parse_common_args("-o 'ProxyJump=a@b1:2222,c2'")["jump"] == (Hop("b1", "a", 2222), Hop("c2"))
    assert parse_common_args("-J bastion.lab -o UserKnownHostsFile=/k -o StrictHostKeyChecking=yes") == \
        {"jump": (Hop("bastion.lab"),), "known_hosts": "/k"}
    assert parse_common_args("-oProxyJump=none") == {"jump": ()}
    assert parse_common_args("") == {}
    assert str(Hop.parse("ssh://u@[fd00::1]:22")) == "u@[fd00::1]:22"


@pytest.mark.parametrize("text,words", [
    ("-o ForwardAgent=yes", "-o ForwardAgent: not understood; the options understood are: ProxyJump="),
    ("-o StrictHostKeyChecking=no", "host keys are always checked"),
    ("-o ProxyJump=root@bad;host", "is not a jump host"),
    ("-C", "'-C' is not understood"),
    ("-o ProxyJump='unclosed", "cannot split"),
    ("-o ConnectTimeout=9999", "expected seconds"),
])
def test_other_ssh_options_are_refused_with_what_is_understood(text, words):
    with pytest.raises(ValueError, match=None) as exc:
        parse_common_args(text)
    assert words in str(exc.value)


def test_too_many_jumps_are_refused():
    with pytest.raises(ValueError, match="more than 8"):
        parse_jumps(",".join(f"h{i}" for i in range(9)))


def test_become_without_password_is_sudo_n_and_may_travel_inline():
    become = Become()
    assert become.command() == "LC_ALL=C sudo -n -u root -- sh -s"
    assert become.command("echo 'x'") == "LC_ALL=C sudo -n -u root -- sh -c 'echo '\"'\"'x'\"'\"''"
    assert become.inline_ok and become.preamble() == b""


def test_become_with_password_puts_it_on_stdin_only(tmp_path):
    become = Become(user="svc", password="s3 cr;et'$x")
    command = become.command()
    assert "s3 cr;et" not in command and "sudo -S -p '' -u svc" in command
    assert "s3 cr;et" not in repr(become) and not become.inline_ok
    assert become.preamble() == f"s3 cr;et'$x\n#\n#\n{become.end}\n".encode()


@pytest.mark.parametrize("sudo_asks", [True, False])
def test_the_root_side_skips_the_preamble_whether_sudo_took_the_password_or_not(tmp_path, sudo_asks):
    """The shell sudo starts, run here without sudo: it must run exactly the script,
    whether sudo consumed the password line (asked) or left it (NOPASSWD)."""
    become = Become(password="hunter2")
    inner = become.command().split(" -- ", 1)[1]  # 'sh -c ...' as sudo would run it
    stdin = become.preamble()
    if sudo_asks:
        stdin = stdin.split(b"\n", 1)[1]  # sudo read the password line
    script = b"echo one\necho \"$((1 + 1))\"\n"
    out = subprocess.run(shlex.split(inner), input=stdin + script, capture_output=True)
    assert out.stdout == b"one\n2\n" and out.stderr == b""


def test_sudos_refusals_read_as_what_to_do():
    b = Become()
    assert diagnose("Sorry, try again.\nsudo: 3 incorrect password attempts\n", "nvidia", b, "spark01") == \
        "sudo refused the password for nvidia on spark01: check --ask-become-pass (-K) or become_password_file"
    assert "run with --ask-become-pass (-K)" in diagnose("sudo: a password is required\n", "nvidia", b, "spark01")
    assert "add nvidia to the sudo group" in diagnose("nvidia is not in the sudoers file.", "nvidia", b, "s")
    assert diagnose("Error: no such image\n", "nvidia", b, "spark01") is None


def test_a_password_must_be_one_line():
    assert check_password("pw\n", "x") == "pw"
    for bad in ("", "a\nb", "a\rb"):
        with pytest.raises(ValueError):
            check_password(bad, "x")


def test_secret_files_must_be_private_one_line_text(tmp_path):
    path = tmp_path / "secret"
    path.write_text(" pass word \n")
    os.chmod(path, 0o644)
    with pytest.raises(SecretError, match="is mode 0644.*chmod 600"):
        read_secret_file(str(path), "become_password_file", "spark01")
    os.chmod(path, 0o600)
    assert read_secret_file(str(path), "become_password_file", "spark01") == " pass word "
    for content in (b"a\nb\n", b"\xff\xfe", b"\n", b"x" * 70000):
        path.write_bytes(content)
        with pytest.raises(SecretError):
            read_secret_file(str(path), "api_key_file", "rtx01")
    with pytest.raises(SecretError, match="cannot read"):
        read_secret_file(str(tmp_path / "missing"), "api_key_file", "rtx01")


def test_become_settings_from_the_inventory(tmp_path):
    path = tmp_path / "pw"
    path.write_text("from-file\n")
    os.chmod(path, 0o600)
    hostvars = {"ansible_host": "10.0.0.9", "ansible_user": "nvidia", "ansible_become": True,
                "ansible_ssh_common_args": "-o ProxyJump=jump@10.0.0.1"}
    s = SSHSettings.from_vars("spark01", hostvars, become_password="typed")
    assert (s.user, s.become.user, s.become.password, s.jumps) == ("nvidia", "root", "typed", (Hop("10.0.0.1", "jump"),))
    s = SSHSettings.from_vars("spark01", {**hostvars, "become_password_file": str(path)}, become_password="typed")
    assert s.become.password == "from-file"  # the host's own file wins over -K
    assert SSHSettings.from_vars("rtx01", {"ansible_host": "10.0.0.2"}).become is None
    with pytest.raises(ConvergeError, match="spark01: ansible_ssh_common_args: -o Compression"):
        SSHSettings.from_vars("spark01", {"ansible_ssh_common_args": "-o Compression=yes"})


def test_ssh_config_include_is_expanded_with_globs_and_bounds(tmp_path, monkeypatch):
    home = tmp_path / "home"
    (home / ".ssh" / "conf.d").mkdir(parents=True)
    (home / ".ssh" / "config").write_text("Include conf.d/*.conf\nHost *\n  User fallback\n")
    (home / ".ssh" / "conf.d" / "lab.conf").write_text("Host h100\n  HostName 10.1.1.3\n  User svc\n"
                                                      "  ProxyJump jump@bastion\n")
    monkeypatch.setenv("HOME", str(home))
    text = ssh_config.expand_includes(str(home / ".ssh" / "config"), str(home / ".ssh"))
    assert "HostName 10.1.1.3" in text and "Include" not in text
    (home / ".ssh" / "conf.d" / "loop.conf").write_text(f"Include {home}/.ssh/conf.d/loop.conf\n")
    with pytest.raises(InventoryError, match="nested more than 16 deep"):
        ssh_config.expand_includes(str(home / ".ssh" / "config"), str(home / ".ssh"))


def test_fabric_reads_the_included_host_and_its_proxyjump(tmp_path, monkeypatch):
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "config").write_text("Include extra\n")
    (home / ".ssh" / "extra").write_text("Host h100\n  HostName 10.1.1.3\n  User svc\n  Port 2222\n"
                                        "  ProxyJump jump@bastion:22\n")
    monkeypatch.setenv("HOME", str(home))
    ssh_config.shared_config.cache_clear()
    try:
        from converge.transport import connect
        settings = SSHSettings.from_vars("h100", {})
        assert settings.jumps == (Hop("bastion", "jump", 22),)
        conn = connect.for_host(settings)
        assert (conn.host, conn.port, conn.user) == ("10.1.1.3", 2222, "svc")
        assert conn.client._policy.__class__.__name__ == "RejectPolicy"  # never Fabric's AutoAddPolicy
    finally:
        ssh_config.shared_config.cache_clear()


def test_making_a_connection_leaves_the_shared_fabric_config_alone(monkeypatch):
    """Fabric's Connection.__init__ assigns inline_ssh_env, which invoke's DataProxy turned
    into a merge() of the config every host thread shares (a thread reading it meanwhile
    saw half a config). Ours declares the attribute: no merge, the config as it was."""
    from converge.transport import connect
    config = ssh_config.shared_config()
    before = dict(config._config)
    merged = []
    original = type(config).merge
    monkeypatch.setattr(type(config), "merge", lambda self: merged.append(self) or original(self))
    settings = SSHSettings.from_vars("rtx01", {"ansible_host": "10.0.0.2"})
    conns = [connect.for_host(settings) for _ in range(3)]
    assert not [c for c in merged if c is config]
    assert dict(config._config) == before and "inline_ssh_env" not in config._modifications
    assert all(c.inline_ssh_env == config.inline_ssh_env for c in conns)
