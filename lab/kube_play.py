"""A rendered Deployment as a cluster would run it, for ``podman kube play`` on a lab host. Two
things a cluster adds that podman does not: NVIDIA's device plugin, which hands a pod that asks
for ``nvidia.com/gpu`` its GPUs (here as the host's CDI spec, ``/etc/cdi/nvidia.yaml``, the lab's
stand-in GPU, says to hand them: hostPath volumes and the spec's environment), and the downward
API's ``status.podIP``, which podman 4.3 refuses (the chart sets POD_IP for LMCache; vLLM does not
read it). And one thing podman 4.3 does that a cluster does not: it publishes every containerPort
on the host (the lab host's front door already listens on vLLM's 8000), so each is published at
the host port ``publish`` gives it instead; and the requests of cpu and memory are the kubelet's to
apply, through cgroup controllers an nspawn host does not have. Everything else of the pod is left as rendered. Pure."""
from __future__ import annotations

import copy


def _edits(cdi: dict, device: str) -> tuple[list, list]:
    found = next((d for d in cdi.get("devices", []) if d["name"] == device), None)
    if found is None:
        raise ValueError(f"the host's CDI spec has no device {device!r}")
    edits = [cdi.get("containerEdits") or {}, found.get("containerEdits") or {}]
    return [m for e in edits for m in e.get("mounts", [])], [v for e in edits for v in e.get("env", [])]


def as_cluster_runs(doc: dict, cdi: dict, devices: list[str], publish: dict[int, int]) -> dict:
    """A Deployment (or Pod) with its GPU containers handed ``devices`` (CDI names: index or uuid),
    one per GPU its limits ask for, in order."""
    out = copy.deepcopy(doc)
    pod = out["spec"]["template"]["spec"] if out["kind"] == "Deployment" else out["spec"]
    volumes = pod.setdefault("volumes", [])
    taken = iter(devices)
    for container in pod["containers"]:
        for port in container.get("ports", []):
            port["hostPort"] = publish[port["containerPort"]]
        container["env"] = [e for e in container.get("env", [])
                            if ((e.get("valueFrom") or {}).get("fieldRef") or {}).get("fieldPath") != "status.podIP"]
        wanted = int(((container.get("resources") or {}).get("limits") or {}).get("nvidia.com/gpu", 0))
        # the kubelet's to apply: the lab host's cgroup tree (nspawn's) has no cpu or memory controller
        container.pop("resources", None)
        for _ in range(wanted):
            device = next(taken)
            mounts, env = _edits(cdi, device)
            for mount in mounts:
                name = f"gpu-{len(volumes)}"
                if any(m["mountPath"] == mount["containerPath"] for m in container.get("volumeMounts", [])):
                    continue
                volumes.append({"name": name, "hostPath": {"path": mount["hostPath"]}})
                container.setdefault("volumeMounts", []).append(
                    {"name": name, "mountPath": mount["containerPath"], "readOnly": "ro" in mount.get("options", [])})
            for item in env:
                key, _, value = item.partition("=")
                container.setdefault("env", []).append({"name": key, "value": value})
    return out


def secret_json(data: dict[str, str]) -> str:
    """A Kubernetes Secret's data as podman 4.3's ``kube play`` reads it from a podman secret (a
    JSON object of base64 values, podman PR 9842): the Secret kind in a kube file is stored as YAML
    there and then refused (podman issue 16269), so the secret is made with ``podman secret create
    NAME -`` from this, on its stdin."""
    import base64
    import json
    return json.dumps({k: base64.b64encode(v.encode()).decode() for k, v in data.items()})


def pod_containers_conf(host_conf: str) -> str:
    """The host's containers.conf as ``podman kube play`` needs it (given to it alone, through
    CONTAINERS_CONF). A pod's infra container needs a cgroup, which the lab's hosts run their other
    containers without (``cgroups = "disabled"``, LAB-NOTES.md); under nspawn that cgroup works
    through systemd (cgroupfs cannot enable controllers in nspawn's tree) and with runc (crun raises
    RLIMIT_MEMLOCK to load the device program, which this machine's 8 MiB cap, without
    CAP_SYS_RESOURCE, refuses); and with no pids limit (no pids controller in that tree)."""
    out = host_conf.replace('cgroups = "disabled"', "pids_limit = 0")
    out = out.replace('cgroup_manager = "cgroupfs"', 'cgroup_manager = "systemd"')
    return out.replace('runtime = "crun"', 'runtime = "runc"')
