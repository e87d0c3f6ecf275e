"""The front door on the lab's hosts: TLS from the fleet CA, keys per user (only
their sha256 on hosts), revoked at once without restarting vLLM."""
import json
import shlex
import ssl
import urllib.error
import urllib.request
import uuid

import pytest
import yaml

from lab import config
from tests.lab.conftest import ADDRESS, CA_FILE, deploy_json, front_door, invoke, ssh

VLLM_UNIT = "podman-vllm-diffusiongemma.service"
MODEL = "diffusiongemma"  # the one name every host serves


@pytest.fixture(scope="module")
def deployed(lab):
    proc, _ = deploy_json("--hosts", "spark01,rtx01,h100-01")
    assert proc.returncode == 0, proc.stdout[-3000:]
    return lab


def started_at(host, unit):
    return ssh(host, f"systemctl show -p ActiveEnterTimestampMonotonic -p MainPID {unit}").stdout


def chat(host, key):
    return front_door(host, "/v1/chat/completions", key, {"model": MODEL, "max_tokens": 8,
                                                          "messages": [{"role": "user", "content": "hi"}]})


def test_the_certificate_is_the_fleet_cas_for_the_hosts_name_and_address(deployed):
    for host in ("spark01", "rtx01"):
        status, _, headers = front_door(host, "/health")
        assert status == 200 and headers["X-Frontdoor-Generation"]
    # a client that does not trust the fleet CA is refused the handshake
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        urllib.request.urlopen(f"https://{ADDRESS['rtx01']}:8000/health", timeout=10,
                               context=ssl.create_default_context())
    # the CA's key never leaves the control machine
    assert (config.CREDENTIALS / "ca" / "ca.key").stat().st_mode & 0o077 == 0
    for host in ("spark01", "rtx01"):
        listing = ssh(host, "ls /etc/dgemma/frontdoor; stat -c '%a %n' /etc/dgemma/frontdoor/tls.pem").stdout
        assert "ca.key" not in listing and "600 /etc/dgemma/frontdoor/tls.pem" in listing


def test_a_key_from_keys_add_works_and_is_refused_once_revoked_without_restarting_vllm(deployed, tmp_path):
    invoke("keys.revoke", "lab-user", check=False)  # a leftover of an interrupted run
    before = {h: started_at(h, u) for h, u in (("rtx01", VLLM_UNIT), ("spark01", "docker-vllm-diffusiongemma.service"))}
    added = invoke("keys.add", "lab-user", check=True)
    key = added.stdout.rstrip("\n").splitlines()[-1]
    assert key.startswith("dgk-") and added.stdout.count(key) == 1, added.stdout
    try:
        for host in ("rtx01", "spark01"):
            status, body, _ = chat(host, key)
            assert status == 200 and json.loads(body)["choices"][0]["message"]["content"], body[:300]
            assert chat(host, key + "x")[0] == 401
        # hosts hold the key's sha256, never the key: not in a file, a process's arguments or environment
        for host in ("rtx01", "spark01", "h100-01"):
            # the key goes to grep on its stdin (-f -): on grep's own command line it would be found
            found = ssh(host, "k=$(cat); for p in /proc/[0-9]*; do printf '%s' \"$k\" | grep -qF -f - "
                              "$p/cmdline $p/environ 2>/dev/null && echo $p; done; "
                              "printf '%s' \"$k\" | grep -rlF -f - /etc /var/lib/dgemma /run 2>/dev/null; true",
                        input=key).stdout
            assert found.strip() == "", (host, found)
        listed = invoke("keys.list", check=True).stdout
        assert "lab-user" in listed and key not in listed
    finally:
        revoked = invoke("keys.revoke", "lab-user")
    assert revoked.returncode == 0, revoked.stdout[-2000:] + revoked.stderr[-2000:]
    for host in ("rtx01", "spark01"):
        status, body, _ = chat(host, key)
        assert status == 401, body[:200]
    after = {h: started_at(h, u) for h, u in (("rtx01", VLLM_UNIT), ("spark01", "docker-vllm-diffusiongemma.service"))}
    assert after == before  # vLLM was not restarted: keys are the front door's business
    assert "reloaded" in revoked.stdout and key not in revoked.stdout + revoked.stderr


def test_the_inventorys_api_key_file_keeps_working_as_one_key(deployed):
    key = config.API_KEY_FILE.read_text().strip()
    assert chat("rtx01", key)[0] == 200


def test_a_request_is_logged_once_by_the_front_door_and_once_by_vllm(deployed):
    """podman's passthrough log driver: the container writes to its unit's journal stream
    itself; the journald driver beside the attached `podman run` logged every line twice."""
    key = config.API_KEY_FILE.read_text().strip()
    marker = f"/v1/models?once={uuid.uuid4().hex}"
    assert front_door("rtx01", marker, key)[0] == 200
    counts = ssh("rtx01", "sleep 1; for u in podman-dgemma-frontdoor " + VLLM_UNIT + "; do "
                          f"journalctl -u $u --no-pager -o cat | grep -cF {shlex.quote(marker)}; done").stdout.split()
    assert counts == ["1", "1"], counts
    assert "passthrough" in ssh("rtx01", "podman inspect -f '{{.HostConfig.LogConfig.Type}}' "
                                         "dgemma-frontdoor vllm-diffusiongemma").stdout


def test_endpoints_name_the_gateway_the_front_doors_and_the_ca(deployed, lab_copy, tmp_path):
    out = tmp_path / "endpoints.json"
    invoke("endpoints", "--json", out, check=True)
    doc = json.loads(out.read_text())
    assert doc["ca_file"] == str(CA_FILE) and doc["gateway"] == f"https://{config.GATEWAY_ADDRESS}:8000/v1"
    assert {"host": "rtx01", "url": "https://10.213.0.12:8000/v1"} in doc["hosts"]
    assert "gateway01" not in {row["host"] for row in doc["hosts"]}  # it serves no model itself
    # an inventory without a gateway: each host's front door is the way in
    hosts = yaml.safe_load((lab_copy / "hosts.yml").read_text())
    del hosts["all"]["children"]["gateway"]
    (lab_copy / "hosts.yml").write_text(yaml.safe_dump(hosts))
    (lab_copy / "group_vars" / "gateway.yml").unlink()
    invoke("endpoints", "--json", out, inventory=lab_copy, check=True)
    doc = json.loads(out.read_text())
    assert doc["gateway"] is None and {"host": "spark01", "url": "https://10.213.0.11:8000/v1"} in doc["hosts"]


STALE = "/run/dgemma-stale-frontdoor"


def serve_a_stale_view(generation=None):
    """Restart rtx01's front door while its folder is covered by a copy (as a remount or a
    replaced folder leaves it), then uncover it: the container goes on reading the copy."""
    d = "/etc/dgemma/frontdoor"
    edit = (f" && sed -i 's/X-Frontdoor-Generation .*/X-Frontdoor-Generation {generation}/' {STALE}/haproxy.cfg"
            if generation else "")
    ssh("rtx01", f"rm -rf {STALE} && cp -a {d} {STALE}{edit} && mount --bind {STALE} {d} && "
                 f"systemctl restart podman-dgemma-frontdoor && sleep 2 && umount {d}", check=True)


def test_a_front_door_reading_stale_files_is_restarted_by_deploy_and_by_keys_add(deployed):
    try:
        serve_a_stale_view("5a1e5a1e5a1e5a1e")
        assert front_door("rtx01", "/health")[2]["X-Frontdoor-Generation"] == "5a1e5a1e5a1e5a1e"
        proc, data = deploy_json("--hosts", "rtx01")
        assert proc.returncode == 0, proc.stdout[-3000:]
        [step] = [t for t in data["hosts"]["rtx01"]["tasks"] if t["role"] == "frontdoor" and t["status"] == "changed"]
        assert "its files are current but it answers as 5a1e5a1e5a1e5a1e" in step["message"], step
        served = front_door("rtx01", "/health")[2]["X-Frontdoor-Generation"]
        assert served != "5a1e5a1e5a1e5a1e"
        # a key added while the front door reads a stale copy: the reload cannot take, a restart does
        serve_a_stale_view()
        added = invoke("keys.add", "stale-user", check=True)
        key = added.stdout.rstrip("\n").splitlines()[-1]
        assert "the reload did not take" in added.stdout, added.stdout[-3000:]
        assert chat("rtx01", key)[0] == 200
    finally:
        invoke("keys.revoke", "stale-user")
        ssh("rtx01", f"umount /etc/dgemma/frontdoor 2>/dev/null; rm -rf {STALE}")


def test_a_flag_a_roll_left_up_is_lowered_by_the_deploy_its_message_names(deployed):
    """The roll says "Mend it: invoke deploy --hosts HOST (it lowers a flag left up)" when the front
    door refuses to lower its flag (roles/service/rollout.py). That state, with every replica in
    service: the gateways' check of the family says 404, so they hold the host out of it; the
    command named clears it (roles/frontdoor/role.py back_in_service)."""
    host, server = "rtx01", "flag_diffusiongemma"
    cli = "curl -sS --unix-socket /run/dgemma-frontdoor/admin.sock telnet://localhost"
    health = ("curl -sk -o /dev/null -w '%{http_code}' -H 'X-Dgemma-Pool: diffusiongemma' "
              "https://127.0.0.1:8000/health")

    def lowered() -> bool:
        out = ssh(host, f"echo 'show servers state rolling' | {cli}").stdout
        # srv_admin_state, the 7th field: the configuration's `disabled` sets the forced maintenance
        # bit (0x01) and its own (0x04); raising the flag (state ready) clears the first alone
        [row] = [line.split() for line in out.splitlines() if len(line.split()) > 6 and line.split()[3] == server]
        return bool(int(row[6]) & 0x01)
    assert lowered() and ssh(host, health).stdout == "200"
    ssh(host, f"echo 'set server rolling/{server} state ready' | {cli}")
    assert not lowered(), "the flag is up"
    assert ssh(host, health).stdout == "404", "the flag up holds the host out of the family"
    proc, data = deploy_json("--hosts", host)
    assert proc.returncode == 0, proc.stdout[-3000:]
    [step] = [t for t in data["hosts"][host]["tasks"] if t["task"] == "replicas in service"]
    assert step["status"] == "changed" and "the roll's flags lowered (flag_diffusiongemma)" in step["message"], step
    assert lowered() and ssh(host, health).stdout == "200"
