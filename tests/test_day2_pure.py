"""Day-2 pieces that need no host: endpoints lines, benchmark arithmetic."""
from day2 import benchmark as bench
from day2.endpoints import HIDDEN, endpoints, open_webui_lines


def test_endpoints_hide_keys_unless_asked(tmp_path):
    key = tmp_path / "k"
    key.write_text("s3cret\n")
    key.chmod(0o644)
    rows = endpoints({"rtx01": {"ansible_host": "10.0.0.2", "api_key_file": str(key)}})
    assert rows[0]["key"] == "EMPTY" and "is mode 0644" in rows[0]["problem"]  # others could read it: refused
    key.chmod(0o600)
    hostvars = {"rtx01": {"ansible_host": "10.0.0.2", "api_port": 8000, "api_key_file": str(key)},
                "h100-01": {"ansible_host": "10.0.0.3", "api_port": 8001, "state": "stopped"},
                "spark01": {"ansible_host": "10.0.0.1", "api_host": "10.0.0.9"}}
    rows = endpoints(hostvars)
    assert [r["base_url"] for r in rows] == ["http://10.0.0.2:8000/v1", "http://10.0.0.9:8000/v1"]
    assert rows[0]["key"] == HIDDEN and rows[1]["key"] == "EMPTY"
    lines = open_webui_lines(endpoints(hostvars, show_keys=True))
    assert lines == ('OPENAI_API_BASE_URLS="http://10.0.0.2:8000/v1;http://10.0.0.9:8000/v1"\n'
                     'OPENAI_API_KEYS="s3cret;EMPTY"\n')


def test_bench_figures_follow_the_seeds_method():
    seq = [bench.Sample("full_canvas", 1.613, 256), bench.Sample("full_canvas", 1.789, 256),
           bench.Sample("full_canvas", 1.0, 0, ok=False, error="timeout")]
    fig = bench.figure("full_canvas", seq)
    assert fig.errors == 1 and fig.mean_output_tokens == 256
    assert fig.tok_per_s == round((256 / 1.613 + 256 / 1.789) / 2, 1)  # 158.7 and 143.1 -> mean
    conc = bench.figure("concurrency_4", [bench.Sample("c", 3.98, 256)] * 4, wall=3.98)
    assert conc.tok_per_s == 257.3  # seed 004: 1024 tok / 3.980 s
    assert bench.percentile([1, 2, 3, 4], 0.5) == 2.5
    body = bench.request_body("m", "p", full=True)
    assert body["temperature"] == 0 and body["chat_template_kwargs"] == {"enable_thinking": False}
    assert body["stream"] is False and body["ignore_eos"] is True
    assert bench.published_for("NVIDIA GB10")["concurrency_4"] == "257.3"
    assert bench.published_for("NVIDIA GeForce RTX 5090")["full_canvas"] == "700+"
