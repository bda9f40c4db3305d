import pytest

from .fake_scheduler import ApiServer, FakeScheduler


@pytest.fixture(scope="module")
def stack():
    """A scripted scheduler and the real api app in front of it, shared by a test module."""
    with FakeScheduler() as fake, ApiServer(fake.addr) as api:
        api.wait_ready()
        yield fake, api
