import pytest

from shardwise.testing import close_pools


@pytest.fixture(scope="session", autouse=True)
def _rank_pools():
    """Rank pools live for the whole run and are closed at its end."""
    yield
    close_pools()
