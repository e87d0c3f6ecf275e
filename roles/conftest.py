"""Shared fixtures of the roles' testinfra checks (run by `invoke verify`)."""
import json
import shlex

import pytest

from converge.verify import EXPECTED


@pytest.fixture
def name(host):
    return host.backend.get_hostname()


@pytest.fixture
def expected(name, request):
    """What the roles render for this host (verify computes it before the run). A
    gateway serves no model: only the gateway's own checks run there."""
    if not EXPECTED:
        pytest.skip("run through `invoke verify`")
    data = EXPECTED.get(name)
    if not data:
        pytest.fail(f"{name}: nothing was deployed here or its facts could not be read; run: invoke deploy --hosts {name}")
    role = next((r for r in ("gateway", "shared_address", "monitoring", "exporters")
                 if f"/roles/{r}/" in str(request.node.fspath)), None)
    if role == "exporters":  # every host
        return data
    wanted = {"gateway": bool(data.get("gateway")), "shared_address": bool(data.get("gateway")),
              "monitoring": bool(data.get("monitoring")), None: bool(data.get("serving"))}[role]
    if not wanted:
        pytest.skip("n/a: a gateway" if data.get("gateway") else "n/a: a monitoring host" if data.get("monitoring")
                    else "n/a")
    return data


@pytest.fixture
def fix(name):
    return f"run: invoke deploy --hosts {name}"


@pytest.fixture
def api(host, expected):
    """curl on the host itself; the API key is read there from the 0600 file and fed to
    curl on stdin, so it is on no command line and in no log."""
    env = shlex.quote(expected["env_path"])

    def call(path, body=None, key=True, port=None):
        """``port``: a replica's (replica 0's when None)."""
        base = f"http://127.0.0.1:{port or expected['replicas'][0]['vllm_port']}"  # vLLM itself, on loopback
        data = f"-H 'Content-Type: application/json' --data-binary {shlex.quote(json.dumps(body))}" if body else ""
        auth = (f"key=$(sed -n 's/^VLLM_API_KEY=//p' {env}); "
                f"printf 'header = \"Authorization: Bearer %s\"\\n' \"$key\" | ") if key else ""
        cmd = (f"{auth}curl -sS --max-time 60 {'-K -' if key else ''} -o /tmp/.verify-body -w '%{{http_code}}' "
               f"{data} {base}{path}; echo; cat /tmp/.verify-body; rm -f /tmp/.verify-body")
        out = host.run(cmd)
        code, _, body_text = out.stdout.partition("\n")
        return int(code or 0), body_text

    return call
