"""The lab's nvidia-smi stand-in (lab/stubs/nvidia-smi) against the real captures of a
host with two H200s (tests/fixtures/nvidia-smi/h200x2/): the same answers per GPU, memory
held on one GPU, and a container that sees only the GPUs it was handed (CDI by uuid)."""
import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from converge.facts.nvidia import APPS_QUERY, QUERY, parse_compute_apps, parse_gpu_query
from lab import rootfs
from tests.conftest import ROOT, standin_on_path

STUB = ROOT / "lab" / "stubs" / "nvidia-smi"
H200 = ROOT / "tests" / "fixtures" / "nvidia-smi" / "h200x2"
PROFILE = ROOT / "lab" / "profiles" / "h200x2.json"
GPU1 = "GPU-4d5f8a85-15cf-7668-0fc3-bb5cece760ec"


@pytest.fixture
def host(tmp_path):
    conf, apps = tmp_path / "conf", tmp_path / "apps"
    conf.mkdir()
    apps.mkdir()
    (conf / "profile.json").write_text(PROFILE.read_text())
    (conf / "state.json").write_text("{}\n")

    def smi(*args, state=None, visible=None):
        if state is not None:
            (conf / "state.json").write_text(json.dumps(state))
        seen = tmp_path / "visible"
        if visible is not None:
            seen.mkdir(exist_ok=True)
            for old in seen.iterdir():
                old.unlink()
            for uuid in visible:
                (seen / uuid).touch()
        env = {"NVIDIA_STUB_DIR": str(conf), "NVIDIA_STUB_APPS": str(apps),
               "NVIDIA_STUB_VISIBLE": str(seen if visible is not None else tmp_path / "none")}
        return subprocess.run([sys.executable, str(STUB), *args], capture_output=True, text=True, env=env)
    return smi


def test_the_standin_answers_as_the_real_two_h200_host_does(host):
    got = parse_gpu_query(host(*QUERY.split()).stdout)
    real = parse_gpu_query((H200 / "idle-query.csv").read_text())
    for gpu in real:
        gpu["mig_mode"] = "Disabled"  # mode.csv: the capture's query predates the field
    assert got == real
    assert host("-L").stdout == (H200 / "list.txt").read_text()


def test_memory_held_on_one_gpu_is_seen_there_and_its_context_on_gpu_0_as_in_the_real_capture(host):
    # busy1: a python3 process allocated 41570 MiB on GPU 1; its context holds 518 MiB on GPU 0
    out = host(*QUERY.split(), state={"held_mib": 41570, "held_gpu": 1, "held_pid": 616}).stdout
    apps = parse_compute_apps(host(*APPS_QUERY.split()).stdout)
    assert apps == parse_compute_apps((H200 / "busy1-compute-apps-uuid.csv").read_text())
    real = parse_gpu_query((H200 / "busy1-query.csv").read_text())
    for got, want in zip(parse_gpu_query(out), real):
        # the real driver counts 9 MiB more on a GPU a process uses: within 10 MiB
        assert abs(got["memory_free_mib"] - want["memory_free_mib"]) <= 10
    table = host().stdout
    assert "|    1   N/A  N/A             616      C   python3" in table and "41570MiB /  143771MiB" in table
    assert "|    0   N/A  N/A             616      C   python3" in table


def test_a_container_sees_only_the_gpus_it_was_handed_numbered_from_0(host):
    assert host("-L", visible=[GPU1]).stdout == f"GPU 0: NVIDIA H200 (UUID: {GPU1})\n"
    got = parse_gpu_query(host(*QUERY.split(), state={"held_mib": 40000, "held_gpu": 1}, visible=[GPU1]).stdout)
    assert [(g["index"], g["uuid"], g["memory_free_mib"]) for g in got] == [(0, GPU1, 103156)]
    # the holder's context on GPU 0 is not this container's to see
    assert [a["gpu_uuid"] for a in parse_compute_apps(host(*APPS_QUERY.split(), visible=[GPU1]).stdout)] == [GPU1]
    assert parse_compute_apps(host(*APPS_QUERY.split(), visible=[GPU1]).stdout)[0]["gpu_uuid"] == GPU1
    none = host("-L", visible=[])
    assert none.returncode == 6 and none.stdout == "No devices were found\n"


def test_the_cdi_spec_names_each_gpu_by_index_and_uuid_and_marks_it(tmp_path):
    rootfs._install_gpu_standin(tmp_path, SimpleNamespace(profile="h200x2"))
    spec = json.loads((tmp_path / "etc/cdi/nvidia.yaml").read_text())
    names = [d["name"] for d in spec["devices"]]
    assert names == ["all", "0", "GPU-c4e45dc5-923e-4dd7-b871-0c1b63d1157c", "1", GPU1]
    by_uuid = next(d for d in spec["devices"] if d["name"] == GPU1)["containerEdits"]["mounts"]
    assert by_uuid == [{"hostPath": f"/etc/nvidia-stub/devices/{GPU1}",
                        "containerPath": f"/etc/nvidia-visible/{GPU1}", "options": ["ro", "bind"]}]
    assert (tmp_path / "etc/nvidia-stub/devices" / GPU1).read_text() == "1\n"
    # "all" hands over every GPU: no marker, the container sees them all
    assert "mounts" not in spec["devices"][0]["containerEdits"]


def test_invoke_facts_local_on_two_h200s_places_gpu_0_and_leaves_the_busy_gpu_out(tmp_path):
    """`invoke facts --local` end to end, the stand-in as this machine's nvidia-smi: two H200s,
    40 GiB held on GPU 1, gpu_memory_utilization 0.9."""
    env = standin_on_path(tmp_path, "h200x2", json.dumps({"held_mib": 40000, "held_gpu": 1}))
    args = [sys.executable, "-m", "invoke", "facts", "--local", "--set", "gpu_memory_utilization=0.9"]
    doc = subprocess.run(args + ["--json", "-"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    choice = json.loads(doc.stdout)["hosts"]["localhost"]["choice"]
    assert [r["gpus"] for r in choice["replicas"]] == [["GPU-c4e45dc5-923e-4dd7-b871-0c1b63d1157c"]]
    (skipped,) = choice["skipped_gpus"]
    assert skipped["uuid"] == GPU1 and "Free memory on device cuda:0 (100.04/139.80 GiB)" in skipped["reason"]
    table = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120).stdout
    assert "replica 0" in table and "GPU left out" in table and GPU1 in table


def test_facts_of_an_8_gpu_host_come_in_one_round_trip(tmp_path, monkeypatch):
    """Every role's facts, the stand-in answering for eight H200s (BUILT from the 4-GPU
    profile): one script, one run on the connection, eight GPUs read."""
    import roles
    from converge.facts import gather
    from converge.transport.local import LocalTransport
    env = standin_on_path(tmp_path, "h200x4")
    profile = json.loads((tmp_path / "stub" / "profile.json").read_text())
    profile["gpus"] += [{"uuid": f"GPU-b1117000-0000-4000-8000-00000000000{i}", "pci_bus_id": f"00000000:00:0{i + 6}.0",
                         "power": "120W /  700W"} for i in range(4, 8)]
    (tmp_path / "stub" / "profile.json").write_text(json.dumps(profile))
    monkeypatch.setenv("PATH", env["PATH"])
    facts = {}
    for role in roles.load():
        facts.update(role.facts({}))
    runs = []

    class Counting(LocalTransport):
        def run(self, *args, **kwargs):
            runs.append(args[0][:40])
            return super().run(*args, **kwargs)

    got = gather(Counting(), facts)
    assert len(runs) == 1
    gpus = got["nvidia"]["gpus"]
    assert [g["index"] for g in gpus] == list(range(8)) and len({g["uuid"] for g in gpus}) == 8
    assert "replica_units" in got.values and got["replica_units"] == {}


H100 = ROOT / "tests" / "fixtures" / "nvidia-smi" / "h100"
METRICS_QUERY = ("--query-gpu=index,uuid,name,pci.bus_id,utilization.gpu,utilization.memory,memory.used,memory.total,"
                 "memory.free,temperature.gpu,temperature.memory,power.draw,power.limit,clocks.sm,clocks.max.sm,"
                 "clocks_throttle_reasons.active,clocks_event_reasons.active,clocks_event_reasons.hw_slowdown,"
                 "clocks_event_reasons.sw_thermal_slowdown,clocks_event_reasons.sw_power_cap,fan.speed,pstate,"
                 "ecc.errors.uncorrected.volatile.total")


def test_the_gpu_metrics_answer_as_the_real_h100_does_and_follow_the_load(tmp_path):
    """The fields a GPU collector reads, idle, in the formats of the real H100's capture
    (with and without units: the header renames two fields, SXM has no fan); then busy."""
    import fcntl
    env = standin_on_path(tmp_path, "h100")
    smi = lambda fmt: subprocess.run(["nvidia-smi", METRICS_QUERY, f"--format={fmt}"], env=env, capture_output=True,
                                     text=True).stdout
    uuid = json.loads((ROOT / "lab" / "profiles" / "h100.json").read_text())["uuid"]
    real_uuid = "GPU-006c44ad-ab74-3351-53cd-8fa1bb220cbf"
    for fmt, capture in (("csv", "metrics-query.csv"), ("csv,noheader,nounits", "metrics-query-nounits.csv")):
        want = (H100 / capture).read_text().replace(real_uuid, uuid)
        assert smi(fmt).replace(" 74.56, ", " 74.57, ") == want, fmt  # the captures are two samples apart
    # a vLLM process on the GPU, running two requests: busy, hot, drawing power, at full clock
    apps, activity = tmp_path / "stub" / "apps", tmp_path / "stub" / "activity"
    apps.mkdir(exist_ok=True)
    activity.mkdir()
    with open(apps / "vllm-4242.json", "w") as entry:
        json.dump({"pid": 4242, "name": "VLLM::EngineCore", "uuid": uuid, "used_mib": 60000}, entry)
        entry.flush()
        fcntl.flock(entry, fcntl.LOCK_EX)
        (activity / "4242.json.gpus").write_text(json.dumps([uuid]))
        (activity / "4242.json").write_text(json.dumps({"pid": 4242, "running": 2}))
        cells = [c.strip() for c in smi("csv,noheader,nounits").split(",")]
    util, mem_util, used, temp, power, clock, reasons = (cells[4], cells[5], cells[6], cells[9], cells[11], cells[13],
                                                         cells[15])
    assert (util, used, clock, reasons) == ("100", "60000", "1980", "0x0000000000000000")
    assert int(temp) > 46 and float(power) > 74.56 and int(mem_util) > 0
