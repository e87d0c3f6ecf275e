"""The shipped inventory validates; broken ones fail with file:line: key messages."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import roles
from converge.errors import InventoryError
from converge.play import Play
from tests.conftest import ROOT

INVENTORY = ROOT / "inventory"


def play(path, overrides=None):
    return Play.load(str(path), roles.schemas(), roles.defaults(), overrides)


@pytest.fixture
def inv(tmp_path):
    target = tmp_path / "inventory"
    shutil.copytree(INVENTORY, target)
    return target


def problems(path, overrides=None):
    return play(path, overrides).problems()


def test_shipped_inventory_is_valid_and_resolves_with_precedence():
    p = play(INVENTORY, ["max_num_seqs=6"])
    assert p.problems() == []
    rtx = p.hostvars("rtx01")
    assert rtx["container_runtime"] == "podman" and rtx["conflicts"] == ["ollama.service"]
    assert rtx["api_key_file"] == "~/.config/dgemma/rtx01.api-key"  # host_vars
    assert rtx["max_num_seqs"] == 6  # --set beats group_vars/all
    assert rtx["restart_sec"] == 15  # role default
    assert p.hostvars("spark01")["container_runtime"] == "docker"
    assert p.inventory.select("spark,rtx01") == ["spark01", "rtx01"]


def test_out_of_range_names_file_line_and_key(inv):
    (inv / "host_vars" / "rtx01.yml").write_text("api_key_file: /x\n\n\n\n\n\ngpu_memory_utilization: 1.4\n")
    (found,) = problems(inv)
    assert found.endswith("inventory/host_vars/rtx01.yml:7: gpu_memory_utilization: 1.4 is greater than "
                          "the maximum 0.95")


def test_wrong_type_unknown_key_and_shell_metacharacters(inv):
    (inv / "group_vars" / "rtx.yml").write_text(
        "container_runtime: podman\nmax_num_seqs: four\ngpu_memroy_utilization: 0.7\n"
        "conflicts:\n  - ollama.service; rm -rf /\n")
    found = "\n".join(problems(inv))
    assert "group_vars/rtx.yml:2: max_num_seqs: 'four' is str, expected integer" in found
    assert "group_vars/rtx.yml:3: gpu_memroy_utilization: unknown key; did you mean 'gpu_memory_utilization'?" in found
    assert "group_vars/rtx.yml:5: conflicts[0]: 'ollama.service; rm -rf /' is not allowed (contains ' ' ';')" in found


def test_a_fallback_on_a_queue_is_checked_with_its_file_line_and_key(inv):
    (inv / "group_vars" / "rtx.yml").write_text(
        "container_runtime: podman\nmodel_fallback:\n  diffusiongemma: {to: gemma4, after_queued_s: 0}\n")
    found = "\n".join(problems(inv))
    assert "group_vars/rtx.yml:3: model_fallback.diffusiongemma.after_queued_s: 0 is less than the minimum 1" in found


def test_bad_host_address_and_yaml_syntax(inv):
    (inv / "hosts.yml").write_text((inv / "hosts.yml").read_text().replace(
        "ansible_host: rtx01.lab.example", "ansible_host: \"rtx01;reboot\""))
    assert any("hosts.yml:" in p and "ansible_host: 'rtx01;reboot' is not allowed" in p for p in problems(inv))
    (inv / "host_vars" / "rtx01.yml").write_text("a: [\n")
    with pytest.raises(InventoryError, match=r"host_vars/rtx01.yml:\d+: YAML syntax error"):
        play(inv)


def test_unknown_host_lists_known_ones():
    with pytest.raises(InventoryError, match=r"unknown host or group 'rtx1'.*Did you mean 'rtx01'.*"
                                             r"Known hosts: spark01, rtx01, h100-01"):
        play(INVENTORY).inventory.select("rtx1")


def test_vars_file_for_missing_host_is_reported(inv):
    (inv / "host_vars" / "rtx02.yml").write_text("autostart: true\n")
    with pytest.raises(InventoryError, match="no host named 'rtx02'"):
        play(inv)


def test_vars_come_from_each_form_ansible_reads_and_only_from_the_vars_folders(inv):
    """host_vars/NAME with no suffix, NAME.yaml, and group_vars/NAME/ (a folder of files) are
    read, as Ansible reads them; an inventory with no host_vars folder loads too."""
    (inv / "host_vars" / "rtx01.yml").rename(inv / "host_vars" / "rtx01")
    (inv / "host_vars" / "spark01.yaml").write_text("max_num_seqs: 3\n")
    (inv / "group_vars" / "h100").mkdir()
    (inv / "group_vars" / "h100" / "a.yml").write_text("max_num_seqs: 5\n")
    (inv / "group_vars" / "h100" / "b.yaml").write_text("restart_sec: 9\n")
    (inv / "group_vars" / "h100" / "notes.txt").write_text("restart_sec: 99\n")
    p = play(inv)
    assert p.problems() == []
    assert p.hostvars("rtx01")["api_key_file"] == "~/.config/dgemma/rtx01.api-key"
    assert p.hostvars("spark01")["max_num_seqs"] == 3
    assert (p.hostvars("h100-01")["max_num_seqs"], p.hostvars("h100-01")["restart_sec"]) == (5, 9)
    shutil.rmtree(inv / "host_vars")
    assert "api_key_file" not in play(inv).inventory.host("rtx01").vars


def test_ansible_reads_the_same_inventory():
    ansible = shutil.which("ansible-inventory") or str(Path(sys.executable).parent / "ansible-inventory")
    if not Path(ansible).exists():
        pytest.skip("ansible-core is not installed (pip install ansible-core)")
    out = json.loads(subprocess.run([ansible, "-i", str(INVENTORY / "hosts.yml"), "--list"], check=True,
                                    capture_output=True, text=True).stdout)
    hostvars = out["_meta"]["hostvars"]
    assert set(hostvars) == {"spark01", "rtx01", "h100-01"}
    assert set(out["all"]["children"]) >= {"spark", "rtx", "h100"}
    ours = play(INVENTORY)
    for host, theirs in hostvars.items():
        mine = ours.inventory.host(host).vars  # no role defaults: Ansible has none here
        assert {k: v for k, v in theirs.items() if not k.startswith("ansible_") or k in mine} == \
               {k: v for k, v in mine.items()}, host


def test_symbolic_link_loops_in_vars_folders_are_named_not_a_traceback(inv):
    """A vars file that is a link loop (or leads nowhere) is a file:line problem with the remedy."""
    (inv / "group_vars" / "loop1.yml").symlink_to("loop2.yml")
    (inv / "group_vars" / "loop2.yml").symlink_to("loop1.yml")
    (inv / "host_vars" / "rtx01.yaml").symlink_to("rtx01.yaml")
    with pytest.raises(InventoryError) as caught:
        play(inv)
    text = "\n".join(caught.value.problems)
    assert "host_vars/rtx01.yaml:1: a symbolic link that leads nowhere (to 'rtx01.yaml': missing, or a loop)" in text
    assert "group_vars/loop1.yml:1: no group named 'loop1'" in text
    proc = subprocess.run([sys.executable, "-m", "invoke", "inventory.check", "--inventory", str(inv)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr + proc.stdout
    assert "leads nowhere" in proc.stdout + proc.stderr


def test_inventory_check_names_each_file_a_deploy_needs_that_this_machine_lacks(tmp_path):
    """Missing, unreadable or world-readable: each key and secret file the inventory names, with
    the file and line that set it and the host; a good set passes (the secrets never printed)."""
    inv = tmp_path / "inventory"
    (inv / "host_vars").mkdir(parents=True)
    key, secret, token = tmp_path / "id", tmp_path / "api-key", tmp_path / "hf-token"
    (inv / "hosts.yml").write_text(
        "all:\n  vars:\n    ansible_ssh_private_key_file: " + str(key) + "\n"
        "  children:\n    rtx:\n      hosts:\n        rtx01: {ansible_host: 10.0.0.2}\n")
    (inv / "host_vars" / "rtx01.yml").write_text(
        f"# the desktop\napi_key_file: {secret}\nhf_token_file: {token}\nbecome_password_file: {tmp_path / 'nope'}\n")

    def check():
        return subprocess.run([sys.executable, "-m", "invoke", "inventory.check", "--inventory", str(inv)], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)

    key.write_text("PRIVATE KEY\n")
    key.chmod(0o644)
    secret.write_text("sk-very-secret\n")
    secret.chmod(0o644)
    token.write_text("hf_token\n")
    token.chmod(0o600)
    proc = check()
    said = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "Traceback" not in said, said
    assert "hosts.yml:3: rtx01: ansible_ssh_private_key_file: " in said and "chmod 600" in said
    assert f"host_vars/rtx01.yml:2: rtx01: api_key_file: {secret} is mode 0644" in said
    assert f"host_vars/rtx01.yml:4: rtx01: become_password_file: cannot read {tmp_path / 'nope'}" in said
    assert "hf_token_file" not in said and "sk-very-secret" not in said
    key.chmod(0o600)
    secret.chmod(0o600)
    (inv / "host_vars" / "rtx01.yml").write_text(f"api_key_file: {secret}\nhf_token_file: {token}\n")
    proc = check()
    assert proc.returncode == 0 and ": OK" in proc.stdout, proc.stdout + proc.stderr
