import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
FIXTURES = ROOT / "tests" / "fixtures"


def pytest_sessionfinish(session, exitstatus):
    """docs/RELIABILITY.md from what the fault suite and the fuzz test measured."""
    from tests import reliability
    reliability.write()
