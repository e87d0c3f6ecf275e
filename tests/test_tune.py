"""`invoke tune` without a lab: its options and prompts files checked (file and line named), the
bound written into an inventory file with its comments and layout kept, the trial's roll held out
of service, the counters' deltas and the report."""
import json
import os
import stat
import subprocess
import sys

import pytest

from converge.errors import InventoryError
from converge.inventory import load_inventory
from converge.inventory_write import file_for, set_variable, with_value
from day2 import tune
from day2.tune import Answer, Prompt, Trial, TuneError
from tests.conftest import ROOT


def test_bounds_are_numbers_in_the_schemas_range_each_once():
    assert tune.parse_bounds("0.05, 0.1,0.2") == [0.05, 0.1, 0.2]
    for text, says in (("0.1,x", "'x' is not a number"), ("0,0.1", "out of range"), ("11", "out of range"),
                       ("0.1,0.1", "given twice"), ("", "give the entropy bounds")):
        with pytest.raises(TuneError, match=says):
            tune.parse_bounds(text)
    assert tune.parse_bound("0.15") == 0.15
    with pytest.raises(TuneError, match="--apply 0.1,0.2: expected one entropy bound"):
        tune.parse_bound("0.1,0.2")


def test_prompts_from_text_and_yaml_with_the_file_and_line_of_a_problem(tmp_path):
    text = tmp_path / "prompts.txt"
    text.write_text("# ten representative prompts\nSummarise this ticket.\n\n  Write a haiku.  \n")
    assert [(p.text, p.max_tokens, p.where) for p in tune.read_prompts(str(text), 300)] == [
        ("Summarise this ticket.", 300, f"{text}:2"), ("Write a haiku.", 300, f"{text}:4")]
    listed = tmp_path / "prompts.yml"
    listed.write_text("- Explain Rayleigh scattering.\n- prompt: |\n    Two lines\n    of prompt\n  max_tokens: 64\n")
    found = tune.read_prompts(str(listed))
    assert [(p.text, p.max_tokens) for p in found] == [("Explain Rayleigh scattering.", 512),
                                                        ("Two lines\nof prompt\n", 64)]
    for body, says in (("- prompt: hi\n  max_tokens: 0\n", ":2: prompt 1: max_tokens"),
                       ("- hi\n- {prompt: hi, temperature: 1}\n", ":2: prompt 2: unknown key 'temperature'"),
                       ("prompt: hi\n", ":1: expected a list of prompts"), ("- [a, b]\n", ":1: prompt 1"),
                       ("- hi\n- 'unterminated\n", "prompts.yml:")):
        listed.write_text(body)
        with pytest.raises(TuneError, match=says):
            tune.read_prompts(str(listed))
    (tmp_path / "empty.txt").write_text("# nothing\n\n")
    with pytest.raises(TuneError, match="no prompt in it"):
        tune.read_prompts(str(tmp_path / "empty.txt"))
    with pytest.raises(TuneError, match="cannot read it"):
        tune.read_prompts(str(tmp_path / "absent.txt"))


def test_the_bound_is_written_in_place_with_the_comments_and_layout_kept(tmp_path):
    path = tmp_path / "rtx01.yml"
    path.write_text("# the desktop\ngpu_memory_utilization: 0.7   # seed 000's trap\n"
                    "diffusion_entropy_bound: 0.1  # Google's default\nconflicts:\n  - ollama.service\n")
    os.chmod(path, 0o640)
    before, after = set_variable(path, "diffusion_entropy_bound", 0.15)
    assert after == ("# the desktop\ngpu_memory_utilization: 0.7   # seed 000's trap\n"
                     "diffusion_entropy_bound: 0.15  # Google's default\nconflicts:\n  - ollama.service\n")
    assert path.read_text() == after and stat.S_IMODE(path.stat().st_mode) == 0o640
    # absent: a line at the end (a file without its last newline gets one)
    path.write_text("max_num_seqs: 4")
    set_variable(path, "diffusion_entropy_bound", 0.2)
    assert path.read_text() == "max_num_seqs: 4\ndiffusion_entropy_bound: 0.2\n"
    new = tmp_path / "host_vars" / "h100-01.yml"
    set_variable(new, "diffusion_entropy_bound", 0.05)
    assert new.read_text() == "diffusion_entropy_bound: 0.05\n"
    # what cannot be written as a line of its own is refused, the file untouched
    for body, says in (("{max_num_seqs: 4}\n", "flow mapping"), ("- a\n", "not a mapping of variables"),
                       ("diffusion_entropy_bound: &b 0.1\n", "not written as a plain value")):
        path.write_text(body)
        with pytest.raises(InventoryError, match=says):
            set_variable(path, "diffusion_entropy_bound", 0.2)
        assert path.read_text() == body
    assert with_value("a: 1\n", "b", "x y", "f") == 'a: 1\nb: "x y"\n'


def test_the_file_is_the_one_that_sets_the_variable_else_the_hosts_own(tmp_path):
    (tmp_path / "host_vars" / "rtx01").mkdir(parents=True)
    (tmp_path / "group_vars").mkdir()
    (tmp_path / "hosts.yml").write_text("all:\n  children:\n    rtx:\n      hosts:\n        rtx01:\n        rtx02:\n")
    (tmp_path / "host_vars" / "rtx01" / "a.yml").write_text("max_num_seqs: 4\n")
    (tmp_path / "host_vars" / "rtx01" / "b.yml").write_text("diffusion_entropy_bound: 0.1\n")
    (tmp_path / "group_vars" / "rtx.yml").write_text("container_runtime: podman\n")
    inventory = load_inventory(tmp_path)
    assert file_for(inventory, "host_vars", "rtx01", "diffusion_entropy_bound") == \
        tmp_path / "host_vars" / "rtx01" / "b.yml"
    assert file_for(inventory, "host_vars", "rtx01", "max_denoising_steps") == tmp_path / "host_vars" / "rtx01" / "a.yml"
    assert file_for(inventory, "host_vars", "rtx02", "diffusion_entropy_bound") == tmp_path / "host_vars" / "rtx02.yml"
    assert file_for(inventory, "group_vars", "rtx", "diffusion_entropy_bound") == tmp_path / "group_vars" / "rtx.yml"


def test_the_counters_deltas_and_the_figures_of_a_trial():
    trial = Trial(0.2, [Answer(0, 0, 1.0, 100, "a"), Answer(1, 0, 3.0, 300, "b"), Answer(2, 0, 0.5, error="HTTP 500")],
                  {"denoising_steps": 10, "canvas_positions": 2560, "committed_tokens": 256},
                  {"denoising_steps": 52, "canvas_positions": 13312, "committed_tokens": 768})
    f = trial.figures()
    assert (f["requests"], f["errors"], f["latency_p50_s"], f["tokens_per_s"]) == (3, 1, 2.0, 100.0)
    assert (f["denoising_steps"], f["committed_tokens"], f["steps_per_committed_token"]) == (42, 512, 0.08203)
    assert f["canvas_fill"] == round(512 / 10752, 5)
    # a restart between the readings, or one missing: no figure rather than a wrong one
    assert tune.counter_delta({"denoising_steps": 9, "canvas_positions": 1, "committed_tokens": 1},
                              {"denoising_steps": 1, "canvas_positions": 1, "committed_tokens": 1}) is None
    assert Trial(0.1).figures()["steps_per_committed_token"] is None


def test_the_answers_page_puts_each_bound_in_a_column_every_text_escaped():
    prompts = [Prompt("<b>hi</b>", where="p.txt:1")]
    trials = [Trial(0.05, [Answer(0, 0, 1.2, 8, "<script>x</script>")]), Trial(0.2, [Answer(0, 0, 0.4, 8, "ok")])]
    page = tune.answers_page("rtx01", prompts, trials)
    assert "<script>x" not in page and "&lt;script&gt;x&lt;/script&gt;" in page and "&lt;b&gt;hi" in page
    assert page.index("entropy bound 0.05") < page.index("entropy bound 0.2")
    doc = tune.document("rtx01", 0, 0.1, prompts, 1, trials, "a.html", True, None, None)
    assert [t["bound"] for t in doc["trials"]] == [0.05, 0.2] and doc["trials"][0]["answers"][0]["text"]
    json.dumps(doc)


def test_the_trials_roll_holds_its_replica_out_of_service():
    from roles.service.rollout import script
    from tests.test_rollout import _roll
    assert "HOLD=1\n" in script(_roll(hold=True)) and "HOLD=0\n" in script(_roll())


@pytest.mark.parametrize("args, says", [
    ([], "give --bounds and --prompts"),
    (["--bounds", "0.1"], "--bounds goes with --prompts FILE"),
    (["--bounds", "0.1,0", "--prompts", "README.md"], "out of range"),
    (["--group", "rtx", "--bounds", "0.1", "--prompts", "README.md"], "--group says where --apply writes"),
    (["--apply", "twelve"], "--apply twelve: expected one entropy bound"),
    (["--bounds", "0.1", "--prompts", "/nonexistent"], "cannot read it"),
])
def test_bad_options_exit_2_naming_the_option_before_any_host_is_touched(args, says):
    proc = subprocess.run([sys.executable, "-m", "invoke", "tune", "--hosts", "rtx01", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "DGEMMA_INVENTORY": str(ROOT / "inventory")})
    assert proc.returncode == 2 and says in proc.stderr + proc.stdout, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
