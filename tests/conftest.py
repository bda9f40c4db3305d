import os

# Paddle and torch use one thread unless told otherwise.
os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))


import pytest  # noqa: E402

LOG_TAIL_BYTES = 4000


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
