"""The serving Deployment of one modelSpec as production-stack's chart renders it
(helm/templates/deployment-vllm-multi.yaml at the vendored commit): the same container,
command line, environment, resources, placement and weights volume. For a lab without Helm,
and for ``podman kube play``, which runs a Deployment's pod for real. Pure."""
from __future__ import annotations

from .values import CONTAINER_PORT

# the chart's order of vllmConfig's flags (deployment-vllm-multi.yaml)
CONFIG_FLAGS = [("maxModelLen", "--max-model-len"), ("dtype", "--dtype"), ("tensorParallelSize", "--tensor-parallel-size"),
                ("maxNumSeqs", "--max-num-seqs"), ("gpuMemoryUtilization", "--gpu_memory_utilization"),
                ("maxLoras", "--max_loras")]


def command(spec: dict) -> list[str]:
    """The container's command, as the chart writes it."""
    config = spec.get("vllmConfig") or {}
    cmd = ["vllm", "serve", spec["modelURL"], "--host", "0.0.0.0", "--port", str(CONTAINER_PORT)]
    if "enableChunkedPrefill" in config:
        cmd.append("--enable-chunked-prefill" if config["enableChunkedPrefill"] else "--no-enable-chunked-prefill")
    cmd.append("--enable-prefix-caching" if config.get("enablePrefixCaching") else "--no-enable-prefix-caching")
    for field, flag in CONFIG_FLAGS:
        if field in config:
            cmd += [flag, str(config[field])]
    cmd += [str(a) for a in config.get("extraArgs") or []]
    if spec.get("modelRevision"):
        cmd += ["--revision", spec["modelRevision"]]
    return cmd


def labels(release: str, name: str) -> dict:
    return {"model": name, "helm-release-name": release, "app.kubernetes.io/name": name,
            "app.kubernetes.io/instance": release, "app.kubernetes.io/component": "serving-engine",
            "app.kubernetes.io/part-of": "vllm-stack", "app.kubernetes.io/managed-by": "helm"}


def deployment(values: dict, spec: dict, release: str, namespace: str) -> list[dict]:
    """The modelSpec's PersistentVolumeClaim, Deployment and Service; ``values``: the chart's
    defaults merged with the rendered ones (engine-wide settings: pull policy, runtime class)."""
    name, engine = spec["name"], values["servingEngineSpec"]
    api_key = engine["vllmApiKey"]
    env = [{"name": "PYTHONHASHSEED", "value": "123"}, {"name": "HF_HOME", "value": "/data"},
           {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
           {"name": "PROMETHEUS_MULTIPROC_DIR", "value": "/tmp"},
           {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": spec["hf_token"]["secretName"],
                                                                "key": spec["hf_token"]["secretKey"]}}},
           {"name": "VLLM_API_KEY", "valueFrom": {"secretKeyRef": {"name": api_key["secretName"],
                                                                     "key": api_key["secretKey"]}}},
           *spec.get("env", [])]
    gpus = spec.get("requestGPU", 1)
    resources = {"requests": {"cpu": str(spec["requestCPU"]), "memory": spec["requestMemory"],
                              "nvidia.com/gpu": str(gpus)},
                 "limits": {"nvidia.com/gpu": str(gpus)}}
    meta = labels(release, name)
    claim = f"{release}-{name}-storage-claim"
    container = {"name": "vllm", "image": f"{spec['repository']}:{spec['tag']}", "command": command(spec),
                 "imagePullPolicy": engine.get("imagePullPolicy", "Always"), "env": env,
                 "ports": [{"name": "container-port", "containerPort": CONTAINER_PORT}],
                 "readinessProbe": {"httpGet": {"path": "/health", "port": CONTAINER_PORT},
                                    "initialDelaySeconds": 15, "periodSeconds": 10},
                 "resources": resources,
                 "volumeMounts": [{"name": f"{release}-storage", "mountPath": "/data"}]}
    pod = {"containers": [container],
           "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
               "nodeSelectorTerms": spec["nodeSelectorTerms"]}}},
           "volumes": [{"name": f"{release}-storage", "persistentVolumeClaim": {"claimName": claim}}]}
    if "tensorParallelSize" in (spec.get("vllmConfig") or {}):  # the ranks' shared memory, as the chart gives it
        container["volumeMounts"].append({"name": "shm", "mountPath": "/dev/shm"})
        pod["volumes"].append({"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": spec.get("shmSize", "20Gi")}})
    runtime_class = spec.get("runtimeClassName", engine.get("runtimeClassName"))
    if runtime_class:
        pod["runtimeClassName"] = runtime_class
    return [
        {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
         "metadata": {"name": claim, "namespace": namespace, "labels": meta},
         "spec": {"accessModes": spec["pvcAccessMode"], "resources": {"requests": {"storage": spec["pvcStorage"]}}}},
        {"apiVersion": "apps/v1", "kind": "Deployment",
         "metadata": {"name": f"{release}-{name}-deployment-vllm", "namespace": namespace, "labels": meta},
         "spec": {"replicas": spec["replicaCount"], "selector": {"matchLabels": meta},
                  "template": {"metadata": {"labels": meta}, "spec": pod}}},
        {"apiVersion": "v1", "kind": "Service",
         "metadata": {"name": f"{release}-{name}-engine-service", "namespace": namespace, "labels": meta},
         "spec": {"type": "ClusterIP", "selector": meta,
                  "ports": [{"name": "service-port", "port": 80, "targetPort": "container-port", "protocol": "TCP"}]}},
    ]
