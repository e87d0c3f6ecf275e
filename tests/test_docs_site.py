"""The documentation site (mkdocs.yml, docs/) builds with --strict: a link to a page or an anchor
that is not there fails it, and so does a page of docs/ that the navigation leaves out."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT


def _nav_pages(items) -> set[str]:
    pages = set()
    for item in items:
        for value in (item.values() if isinstance(item, dict) else [item]):
            pages |= _nav_pages(value) if isinstance(value, list) else {value}
    return pages


def test_the_readme_is_a_front_page():
    """At most 250 lines; the rest of what a user reads is in docs/, which it links."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    for page in ("your-machines.md", "keys.md", "gateways.md", "rolling.md", "monitoring.md", "clients.md",
                 "kubernetes.md", "lab.md", "troubleshooting.md", "architecture.md", "reference/inventory.md",
                 "reference/tasks.md"):
        assert f"](docs/{page})" in readme, page
        assert (ROOT / "docs" / page).is_file(), page


def test_every_page_is_in_the_navigation():
    nav = _nav_pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])
    pages = {str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md")}
    assert pages == nav, {"not in nav": sorted(pages - nav), "not a page": sorted(nav - pages)}


@pytest.mark.compute_only
def test_the_site_builds_strictly(tmp_path):
    mkdocs = Path(sys.executable).with_name("mkdocs")
    proc = subprocess.run([str(mkdocs), "build", "--strict", "-d", str(tmp_path / "site")], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (tmp_path / "site" / "reference" / "inventory" / "index.html").is_file()


@pytest.mark.compute_only
def test_a_broken_link_fails_the_build(tmp_path):
    """The strictness is real: the same site with one link to a page that is not there fails."""
    site = tmp_path / "src"
    (site / "docs").mkdir(parents=True)
    for path in (ROOT / "docs").rglob("*"):
        if path.is_file():
            target = site / "docs" / path.relative_to(ROOT / "docs")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(path.read_bytes())
    (site / "mkdocs.yml").write_text((ROOT / "mkdocs.yml").read_text())
    (site / "docs" / "index.md").write_text((ROOT / "docs" / "index.md").read_text() + "\n[gone](nowhere.md)\n")
    mkdocs = Path(sys.executable).with_name("mkdocs")
    proc = subprocess.run([str(mkdocs), "build", "--strict", "-d", str(tmp_path / "site")], cwd=site,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode != 0 and "nowhere.md" in proc.stdout + proc.stderr
