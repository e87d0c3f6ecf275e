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


@pytest.fixture
def https_to(host, name):
    """curl on the host to its own front door or gateway (``proxy``: what verify expects of
    it, its port, folder and connect address), the certificate checked against the fleet CA
    under the host's inventory name. ``https_to(proxy)(path, method)`` is (status, headers,
    stderr); ``.statuses([(path, method), ...])`` asks them all in one curl (one program start:
    on a host under emulation each start costs ~0.4 s), a status each (0: no answer)."""

    def to(proxy):
        port = proxy["port"]
        options = (f"--max-time 10 --cacert {shlex.quote(proxy['dir'] + '/ca.crt')} "
                   f"--resolve {shlex.quote(f'{name}:{port}:' + proxy['connect'])}")

        def url(path):
            return shlex.quote(f"https://{name}:{port}{path}")

        def call(path, method="GET"):
            out = host.run(f"curl -sS -o /dev/null -D - {options} -X {method} {url(path)}")
            lines = out.stdout.replace("\r", "").splitlines()
            status = int(lines[0].split()[1]) if lines and lines[0].startswith("HTTP/") else 0
            headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:]) if v}
            return status, headers, out.stderr

        def statuses(probes):
            # each transfer its own options (--next), its status on a line of its own
            transfers = " --next ".join(f"-s -o /dev/null -w '%{{http_code}}\\n' {options} -X {method} {url(path)}"
                                        for path, method in probes)
            codes = host.run(f"curl {transfers}").stdout.split()
            return [int(c) for c in codes] + [0] * (len(probes) - len(codes))

        call.statuses = statuses
        return call

    return to
