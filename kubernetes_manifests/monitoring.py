"""Prometheus and Grafana as kube-prometheus-stack takes them: the serving engines scraped by a
ServiceMonitor (relabelled to the labels the fleet's alerts read: job ``vllm``, ``host`` the
node, ``replica`` the pod, ``model`` the spec), the alerts that read vLLM's own metrics as a
PrometheusRule with fixes in kubectl's words, and the fleet's dashboards as ConfigMaps labelled
``grafana_dashboard: "1"``. Pure."""
from __future__ import annotations

import json

from grafana import build as dashboards
from roles.monitoring.rules import thresholds


def service_monitor(release: str, namespace: str) -> dict:
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor",
            "metadata": {"name": f"{release}-engines", "namespace": namespace, "labels": {"release": release}},
            "spec": {"selector": {"matchLabels": {"app.kubernetes.io/instance": release,
                                                  "app.kubernetes.io/component": "serving-engine"}},
                     "endpoints": [{"port": "service-port", "path": "/metrics", "interval": "15s",
                                    "relabelings": [
                                        {"targetLabel": "job", "replacement": "vllm"},
                                        {"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "host"},
                                        {"sourceLabels": ["__meta_kubernetes_pod_name"], "targetLabel": "replica"},
                                        {"sourceLabels": ["__meta_kubernetes_service_label_app_kubernetes_io_name"],
                                         "targetLabel": "model"}]}]}}


def rules(v: dict, release: str, namespace: str) -> dict:
    """The fleet's alerts that read vLLM's metrics (roles/monitoring/templates/rules.yml.j2), with
    the same thresholds; the ones that read the hosts' exporters stay with the SSH fleet."""
    t = thresholds(v)
    ns = f"-n {namespace}"

    def alert(name, expr, seconds, severity, summary, fix):
        rule = {"alert": name, "expr": expr, "labels": {"severity": severity},
                "annotations": {"summary": summary, "fix": fix}}
        if seconds:
            rule["for"] = f"{int(seconds)}s"
        return rule
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
            "metadata": {"name": f"{release}-alerts", "namespace": namespace, "labels": {"release": release}},
            "spec": {"groups": [{"name": "dgemma-replicas", "rules": [
                alert("DgemmaReplicaDown", 'up{job="vllm"} == 0', t["replica_down_seconds"], "critical",
                      "vLLM replica {{ $labels.replica }} on {{ $labels.host }} is down",
                      f"kubectl {ns} describe pod {{{{ $labels.replica }}}}; kubectl {ns} logs {{{{ $labels.replica }}}}"),
                alert("DgemmaFleetDown", '(sum(up{job="vllm"}) == 0) or absent(up{job="vllm"})', 60, "critical",
                      "no vLLM replica answers",
                      f"kubectl {ns} get pods -l app.kubernetes.io/component=serving-engine (Pending: no node has "
                      f"the GPU a spec asks for, see its nodeSelectorTerms)"),
                alert("DgemmaRequestsWaiting", f"min_over_time(vllm:num_requests_waiting[{int(t['waiting_seconds'])}s]) > 0",
                      0, "warning", "requests wait at {{ $labels.replica }} ({{ $labels.model }})",
                      "raise the replicaCount of modelSpec {{ $labels.model }} (values.yaml), or add nodes of its "
                      "hardware; then helm upgrade"),
                alert("DgemmaKvCacheNearlyFull", f"vllm:kv_cache_usage_perc > {t['kv_cache_usage']}", 300, "warning",
                      "the KV cache of {{ $labels.replica }} is nearly full",
                      "lower maxNumSeqs or maxModelLen in modelSpec {{ $labels.model }} (values.yaml), then helm upgrade"),
                alert("DgemmaSlowFirstToken",
                      "histogram_quantile(0.95, sum by (host, replica, model, le) "
                      f"(rate(vllm:time_to_first_token_seconds_bucket[5m]))) > {t['ttft_p95_seconds']}", 600, "warning",
                      f"the first token takes over {t['ttft_p95_seconds']} s at {{{{ $labels.replica }}}}",
                      f"kubectl {ns} top pod {{{{ $labels.replica }}}}; add replicas to modelSpec {{{{ $labels.model }}}}"),
            ]}]}}


def dashboard_maps(release: str, namespace: str) -> list[dict]:
    return [{"apiVersion": "v1", "kind": "ConfigMap",
             "metadata": {"name": f"{release}-dashboard-{name.removesuffix('.json')}", "namespace": namespace,
                          "labels": {"grafana_dashboard": "1"}},
             "data": {name: text if isinstance(text, str) else json.dumps(text, indent=1)}}
            for name, text in sorted(dashboards.render().items())]
