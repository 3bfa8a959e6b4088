import pytest

from tiny import CLI


@pytest.fixture
def cli(tmp_path):
    return CLI(tmp_path)
