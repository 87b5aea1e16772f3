import pytest

from shardwise.testing import close_pools


@pytest.fixture(scope="session", autouse=True)
def _rank_pools():
    """Rank pools live for the whole run and are closed at its end."""
    yield
    close_pools()


@pytest.fixture
def world_of_one():
    """shardwise initialized in this process as a world of one (gloo), torn down after."""
    import shardwise

    shardwise.init(backend="gloo")
    yield
    shardwise.shutdown()  # the next init forms a fresh world, with fresh groups
