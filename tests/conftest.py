import os

# Paddle and torch use one thread unless told otherwise.
os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))


from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

LOG_TAIL_BYTES = 4000
INTEGRATION_DIR = Path(__file__).resolve().parent / "integration"


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(items):
    """Every test under tests/integration/ is an integration test: `-m "not integration"` runs the unit tests."""
    for item in items:
        if item.path.is_relative_to(INTEGRATION_DIR):
            item.add_marker(pytest.mark.integration)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test shows the tail of each process log it left in its tmp_path (CI keeps no files)."""
    outcome = yield
    report = outcome.get_result()
    tmp_path = getattr(item, "funcargs", {}).get("tmp_path")
    if report.when != "call" or not report.failed or tmp_path is None:
        return
    for log_path in sorted(tmp_path.rglob("*.log")):
        text = log_path.read_bytes()[-LOG_TAIL_BYTES:].decode(errors="replace")
        report.sections.append((f"process log {log_path.name}", text))
