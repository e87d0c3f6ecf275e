"""Several model families on one host (models: in the inventory), on the real captures
of a host with two H200s: placement per family, the image that serves them all, their
units, and the gateway's pools and fallbacks, checked by a real HAProxy."""
import json
import os
import shutil
import ssl
import subprocess
import time
import urllib.error
import urllib.request

import pytest

from serving.fleet import fleet_of
from credentials.keys import digest
from serving.haproxy.pools import gateway_pools, pools_in_config, render_upstream_keys
from serving.haproxy.instance import GATEWAY, container
from serving.haproxy.config import render_config, render_keys
from roles.gateway.role import BACKEND, servers
from serving.gateway_checks import fallback_problems
from roles.preflight.placement import place_declared
from roles.preflight.select import Refused, choose, image_channel
from serving.vllm_serve import serve_args
from tests import openai_upstream
from tests.test_frontdoor import _free_port, reload_as_the_deploy_does, until_reloaded
from tests.test_placement import H200, nvidia
from tests.haproxy_program import haproxy

BOTH = [{"family": "diffusiongemma", "gpus": 1}, {"family": "gemma4"}]


def test_each_family_takes_its_gpus_and_the_default_places_as_before():
    facts = nvidia(H200 / "idle-query.csv")
    placed = place_declared(facts, {}, {"models": BOTH})
    assert [(r.index, r.family, r.model, [g["index"] for g in r.gpus], r.port) for r in placed.replicas] == [
        (0, "diffusiongemma", "google/diffusiongemma-26B-A4B-it", [0], 8100),
        (1, "gemma4", "google/gemma-4-26B-A4B-it", [1], 8101)]
    # named GPUs, the other way round
    named = place_declared(facts, {}, {"models": [{"family": "gemma4", "gpus": [0]},
                                                  {"family": "diffusiongemma", "gpus": [1]}]})
    assert [(r.family, r.gpus[0]["index"]) for r in named.replicas] == [("gemma4", 0), ("diffusiongemma", 1)]
    # without models: DiffusionGemma on every GPU, as before families could be declared
    plain = place_declared(facts, {}, {})
    assert [(r.family, r.model) for r in plain.replicas] == [("diffusiongemma", "google/diffusiongemma-26B-A4B-it")] * 2


def test_a_family_whose_gpus_all_fail_vllms_check_is_refused_with_vllms_words():
    facts = nvidia(H200 / "busy1-query.csv", H200 / "busy1-compute-apps-uuid.csv")
    with pytest.raises(Refused, match=r"models\[1\]: Gemma 4 can serve on none of its GPUs: GPU 1 .*vLLM would "
                                      r"refuse to start on GPU 1: Free memory on device cuda:0"):
        place_declared(facts, {}, {"models": BOTH, "gpu_memory_utilization": 0.9})
    # auto: each family on its GPU, Gemma 4 with what GPU 1 has left
    placed = place_declared(facts, {}, {"models": BOTH})
    assert [(r.family, r.gpus[0]["index"]) for r in placed.replicas] == [("diffusiongemma", 0), ("gemma4", 1)]


@pytest.mark.parametrize("models, words", [
    ([{"family": "llama"}], r"models\[0\].family: 'llama' is not in the model catalog .* it has diffusiongemma, gemma4"),
    ([{"family": "gemma4"}, {"family": "gemma4", "gpus": 1}], r"models\[1\].family: gemma4 is declared twice"),
    ([{"family": "gemma4"}, {"family": "diffusiongemma"}], r"models\[1\].gpus: both gemma4 and diffusiongemma take"),
    ([{"family": "gemma4", "gpus": [0]}, {"family": "diffusiongemma", "gpus": [0]}],
     r"models\[1\].gpus: GPU 0 is taken by gemma4 too"),
    ([{"family": "gemma4", "gpus": 2}, {"family": "diffusiongemma"}], r"models\[1\]: no GPU is left for DiffusionGemma"),
    ([{"family": "gemma4", "quantization": "nvfp4"}], r"Gemma 4 has no nvfp4 variant in the catalog \(it has bf16\)"),
    ([{"family": "gemma4", "model": "google/diffusiongemma-26B-A4B-it"}],
     r"models\[0\].model: google/diffusiongemma-26B-A4B-it is a diffusiongemma variant, not gemma4"),
])
def test_a_declaration_that_cannot_be_placed_is_refused_with_its_key(models, words):
    with pytest.raises(Refused, match=words):
        place_declared(nvidia(H200 / "idle-query.csv"), {}, {"models": models})


def test_one_image_serves_every_family_of_a_host():
    facts = {"arch": "x86_64", "nvidia": nvidia(H200 / "idle-query.csv"), "meminfo": {}}
    assert choose(facts, {"models": BOTH}).image == "vllm/vllm-openai:gemma-x86_64-cu130"
    assert choose(facts, {"models": [{"family": "gemma4"}]}).image == "vllm/vllm-openai:v0.33.0-x86_64"
    assert image_channel({"image_channel": "stable"}, ["diffusiongemma", "gemma4"]) == "stable"


def test_gemma4_is_served_without_diffusion_settings_and_answers_for_the_families_that_fall_back_to_it():
    v = {"model_fallback": {"diffusiongemma": {"to": "gemma4"}}}
    args = serve_args(v, "google/gemma-4-26B-A4B-it", 0.9, 1, 8102, family="gemma4")
    assert "--diffusion-config" not in args and "--hf-overrides" not in args
    # its catalog entry needs no attention backend: vLLM chooses (DiffusionGemma's needs Triton's)
    assert "--attention-backend" not in args
    names = args[args.index("--served-model-name") + 1:args.index("--host")]
    assert names == ["gemma4", "google/gemma-4-26B-A4B-it", "diffusiongemma"]
    dg = serve_args(v, "google/diffusiongemma-26B-A4B-it", 0.9, 1, 8100)
    assert "--diffusion-config" in dg and dg[dg.index("--attention-backend") + 1] == "TRITON_ATTN"
    assert dg[dg.index("--served-model-name") + 1:dg.index("--host")] == ["diffusiongemma",
                                                                           "google/diffusiongemma-26B-A4B-it"]


FALLBACK = {"diffusiongemma": {"to": "gemma4"}}


def fleet(policy=FALLBACK, hgx_policy=FALLBACK):
    return fleet_of({"rtx01": {"ansible_host": "10.0.0.2", "model_fallback": policy},
                     "hgx01": {"ansible_host": "10.0.0.3", "models": BOTH, "model_fallback": hgx_policy},
                     "gateway01": {"group_names": ["gateway"], "model_fallback": policy}})


def test_the_gateway_routes_each_family_to_its_front_doors_and_falls_back_to_another(tmp_path):
    f = fleet()
    pools = gateway_pools(f, lambda doors: servers(f, doors), FALLBACK)
    assert [(p.name, [s.name for s in p.servers]) for p in pools] == [("diffusiongemma", ["rtx01", "hgx01"]),
                                                                     ("gemma4", ["hgx01"])]
    config = render_config("gateway01", {}, servers(f), "g", proxy=GATEWAY, backend=BACKEND, pools=pools)
    assert "use_backend fallback_diffusiongemma if names_diffusiongemma !diffusiongemma_up" in config
    assert "use_backend fallback_diffusiongemma if !names_model !diffusiongemma_up" in config
    fallback = config.split("\nbackend fallback_diffusiongemma", 1)[1].split("\nbackend ", 1)[0]
    assert "http-request set-header X-Dgemma-Pool gemma4" in fallback and "track pool_gemma4/hgx01" in fallback
    assert "http-request del-header ^x-dgemma- -m reg" in config  # a user chooses no pool, no replica
    _haproxy_accepts(tmp_path, config)


def test_an_external_upstream_gets_its_key_from_the_gateways_map(tmp_path):
    policy = {"gemma4": {"url": "https://api.example.com/openai/v1", "key_file": "/k"}}
    f = fleet(policy, policy)
    config = render_config("gateway01", {}, servers(f), "g", proxy=GATEWAY, backend=BACKEND,
                           pools=gateway_pools(f, lambda doors: servers(f, doors), policy))
    upstream = config.split("\nbackend fallback_gemma4", 1)[1]
    assert ('http-request set-header Authorization "Bearer %[str(gemma4),map(/usr/local/etc/haproxy/'
            'upstream-keys.map)]"') in upstream
    assert "http-request replace-path ^/v1(.*) /openai/v1\\1" in upstream
    assert "server upstream api.example.com:443 init-addr libc,none ssl verify required ca-file @system-ca" in upstream
    assert render_upstream_keys({"gemma4": "k"}).endswith("\ngemma4 k\n")
    (tmp_path / "upstream-keys.map").write_text(render_upstream_keys({"gemma4": "k"}))
    _haproxy_accepts(tmp_path, config)
    # the unit does not carry it: a new key or upstream is a reload, not a restart
    assert not [o for o in container({"model_fallback": policy}, GATEWAY)["options"] if "FALLBACK" in o]


def test_a_real_gateway_sends_the_maps_key_upstream_and_a_reload_takes_a_new_one(tmp_path):
    """Every DiffusionGemma front door down (a closed port): the gateway's fallback is an
    external API on this machine; it gets the key of the map, then, after the map is
    rewritten and the gateway reloaded as the deploy does it, the new key, with no request
    failed between."""
    upstream = openai_upstream.serve("127.0.0.1")
    policy = {"diffusiongemma": {"url": f"http://127.0.0.1:{upstream.server_address[1]}/v1", "key_file": "/k"}}
    closed = _free_port()
    f = fleet_of({"rtx01": {"ansible_host": "127.0.0.1", "api_port": closed, "model_fallback": policy},
                  "gateway01": {"group_names": ["gateway"], "model_fallback": policy}})
    port = _free_port()
    v = {"api_host": "127.0.0.1", "api_port": port}
    config = render_config("gateway01", v, servers(f), "g", proxy=GATEWAY, backend=BACKEND,
                           pools=gateway_pools(f, lambda doors: servers(f, doors), policy))
    keys = tmp_path / "upstream-keys.map"
    keys.write_text(render_upstream_keys({"diffusiongemma": "first-key"}))
    proc = _haproxy_runs(tmp_path, config, accepted={"alice": digest("alice-key")})
    context = ssl.create_default_context(cafile=str(tmp_path / "ca" / "ca.crt"))

    def chat():
        req = urllib.request.Request(f"https://127.0.0.1:{port}/v1/chat/completions",
                                     data=json.dumps({"model": "diffusiongemma", "messages": []}).encode(),
                                     headers={"Authorization": "Bearer alice-key", "Host": "gateway01"})
        try:
            with urllib.request.urlopen(req, timeout=5, context=context) as resp:
                return resp.status, resp.headers.get("x-dgemma-pool"), resp.headers.get("x-dgemma-fallback")
        except (urllib.error.URLError, OSError) as exc:
            return getattr(exc, "code", None), None, None

    try:
        deadline = time.monotonic() + 15  # until the checks find the front door down
        while (got := chat()) != (200, "upstream", "diffusiongemma"):
            assert proc.poll() is None and time.monotonic() < deadline, got
            time.sleep(0.2)
        assert upstream.seen[-1][1] == "Bearer first-key"
        keys.write_text(render_upstream_keys({"diffusiongemma": "second-key"}))
        # the servers' states kept: without them, the new worker calls the closed front door
        # up until its checks
        reload_as_the_deploy_does(GATEWAY, config, tmp_path, proc)

        def taken():
            assert chat()[0] == 200, "a request failed during the reload"
            return upstream.seen[-1][1] == "Bearer second-key"
        until_reloaded(proc, taken, said=lambda: upstream.seen[-3:])
        assert {brought for _, brought, _ in upstream.seen} == {"Bearer first-key", "Bearer second-key"}
    finally:
        proc.terminate()
        proc.wait(10)
        upstream.shutdown()
        upstream.server_close()


def test_a_fallback_that_cannot_work_is_refused_with_its_key():
    assert fallback_problems(fleet(), FALLBACK) == []
    deaf = fallback_problems(fleet(hgx_policy={}), FALLBACK)
    assert deaf == ["model_fallback.diffusiongemma: the gemma4 replicas of hgx01 do not answer to 'diffusiongemma' "
                    "(vLLM would refuse its requests): set model_fallback where those hosts read it too "
                    "(group_vars/all)"]
    assert "served by no host" in fallback_problems(fleet(), {"diffusiongemma": {"to": "mistral"}})[0]
    assert "no host of the fleet serves mistral" in fallback_problems(fleet(), {"mistral": {"to": "gemma4"}})[0]


def test_a_run_that_places_nothing_keeps_the_front_doors_pools():
    text = "backend pool_gemma4\n    server replica2 127.0.0.1:8102 track servers/replica2\nbackend rolling\n" \
           "    server flag 127.0.0.1:9 disabled\nbackend pool_diffusiongemma\n    server replica0 127.0.0.1:8100 x\n"
    assert pools_in_config(text) == {"replica2": "gemma4", "replica0": "diffusiongemma"}


def _gateway_files(tmp_path, config: str, accepted: dict | None = None) -> str:
    """The gateway's files in ``tmp_path`` (its certificate from a new fleet CA there), and its
    configuration as it reads them there."""
    haproxy()  # fails, saying how to get it, when it is not there
    from credentials import ca as fleet_ca
    issued = fleet_ca.host_certificate(tmp_path, "gateway01", ["gateway01", "127.0.0.1"], make=True)
    (tmp_path / "tls.pem").write_text(issued.cert_pem + issued.key_pem)
    (tmp_path / "keys.sha256").write_text(render_keys(accepted or {}))
    (tmp_path / "monitoring.sha256").write_text(render_keys({}))
    (tmp_path / "targets.json").write_text("[]\n")
    from serving.haproxy.instance import LIVE_ANSWERS, live_answers
    (tmp_path / LIVE_ANSWERS).write_text(live_answers())
    config = (config.replace("/usr/local/etc/haproxy/ca.crt", str(tmp_path / "ca" / "ca.crt"))
              .replace("/usr/local/etc/haproxy", str(tmp_path)).replace("/run/dgemma-gateway", str(tmp_path))
              .replace("    user haproxy\n    group haproxy\n", ""))  # this test may not run as root
    path = tmp_path / "haproxy.cfg"
    path.write_text(config)
    return str(path)


def _haproxy_accepts(tmp_path, config: str, **env):
    path = _gateway_files(tmp_path, config)
    proc = subprocess.run([haproxy(), "-c", "-f", path], capture_output=True, text=True,
                          env={**os.environ, "GATEWAY_KEY": "g", **env}, timeout=30)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _haproxy_runs(tmp_path, config: str, accepted: dict) -> subprocess.Popen:
    """A real HAProxy (master and worker, as in the container) on the gateway's files."""
    path = _gateway_files(tmp_path, config, accepted)
    return subprocess.Popen([haproxy(), "-W", "-db", "-f", path], env={**os.environ, "GATEWAY_KEY": "g"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
