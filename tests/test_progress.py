"""The transfer display: rich bars on a terminal, plain lines without colour codes elsewhere."""
import io
import re
from pathlib import Path

from rich.console import Console

from converge.changes import Transfer
from converge.progress import Transfers, plain_text
from converge.report import Report
from roles.image.pull_progress import pull_reader
from roles.weights.download import progress_reader

CAPTURES = Path(__file__).parent / "fixtures" / "pulls"


def plain_report(every=0.0):
    out = io.StringIO()
    report = Report(console=Console(file=out, force_terminal=False, width=200))
    report.transfers.plain_every = every
    return report, out


def test_terminal_codes_are_stripped():
    assert plain_text("\x1b[32mok\x1b[0m 50%\r") == "ok 50%"
    assert plain_text("\x1b[?25l\x1b[2K\x1b[1Adone") == "done"


def test_off_a_terminal_plain_lines_with_amount_rate_and_time_left():
    report, out = plain_report()
    total = 2 * 1024 ** 3
    read = progress_reader(total)
    report.progress("rtx01", "weights", "@bytes 0", read)
    report.transfers._seen[("rtx01", "weights")].started -= 10  # ten seconds ago
    report.progress("rtx01", "weights", f"@bytes {total // 2}", read)
    report.progress("rtx01", "weights", "@partial abc 1 2 18 timeout")  # a marker: not for people
    report.progress("rtx01", "image", "\x1b[32mTrying to pull\x1b[0m x")
    report.transfer_done("rtx01", "weights")
    text = out.getvalue()
    assert "\x1b" not in text
    assert re.search(r"rtx01 weights \| 1\.0 GiB of 2\.0 GiB \(50%\), 10[0-9.]+ MiB/s, 1[01] s left", text), text
    assert "@partial" not in text and "@bytes" not in text
    assert "Trying to pull x" in text
    assert ("rtx01", "weights") not in report.transfers._seen


def test_plain_lines_come_at_most_every_period():
    report, out = plain_report(every=3600)
    read = progress_reader(100)
    for done in range(0, 100, 10):
        report.progress("h", "weights", f"@bytes {done}", read)
    assert out.getvalue() == ""
    report.transfers._seen[("h", "weights")].printed -= 3600  # an hour on
    report.progress("h", "weights", "@bytes 95", read)
    report.progress("h", "weights", "@bytes 100", read)
    report.transfer_done("h", "weights")
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and "95 B of 100 B (95%)" in lines[0] and "100 B of 100 B (100%)" in lines[1], lines


def test_a_transfer_too_short_to_show_leaves_no_line():
    report, out = plain_report(every=3600)
    report.progress("h", "weights", "@bytes 100", progress_reader(100))
    report.transfer_done("h", "weights")
    assert out.getvalue() == ""


def test_on_a_terminal_a_bar_per_host_and_step_gone_when_it_ends():
    out = io.StringIO()
    transfers = Transfers(Console(file=out, force_terminal=True, width=120))
    assert transfers.live
    assert transfers.update("spark01", "weights", Transfer(10, 100)) is None
    assert transfers.update("rtx01", "image", Transfer(1, 4, "layers")) is None
    tasks = {t.description: t for t in transfers._bars.tasks}
    assert tasks["spark01 weights"].completed == 10 and tasks["spark01 weights"].total == 100
    assert tasks["rtx01 image"].fields["note"] == "1 of 4 layers"
    transfers.finish("spark01", "weights")
    assert [t.description for t in transfers._bars.tasks] == ["rtx01 image"]
    transfers.finish("rtx01", "image")
    assert transfers._bars is None
    transfers.close()


def test_weights_bytes_are_capped_at_the_manifest_total():
    read = progress_reader(1000)
    assert read("@bytes 1200") == Transfer(1000, 1000)
    assert read("@bytes x") is None and read("something else") is None


def layers_after(path):
    read, last = pull_reader(), None
    for line in (CAPTURES / path).read_text().splitlines():
        last = read(plain_text(line).strip()) or last
    return last


def test_podman_pull_layers_from_a_real_capture():
    assert layers_after("podman-pull.txt") == Transfer(1, 1, "layers")


def test_docker_pull_layers_from_a_real_capture():
    assert layers_after("docker-pull.txt") == Transfer(1, 1, "layers")


def test_podman_layers_are_not_done_until_the_config_is_copied():
    read = pull_reader()
    assert read("Copying blob sha256:" + "a" * 64) == Transfer(0, 1, "layers")
    assert read("Copying blob " + "b" * 64 + " skipped: already exists") == Transfer(1, 2, "layers")
    assert read("Copying config sha256:" + "c" * 64) == Transfer(2, 2, "layers")
    assert read("Writing manifest to image destination") is None
