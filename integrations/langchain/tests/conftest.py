import pytest
from lc_shared import corpus as _corpus

from tests.adapter_shared import asked, engine_fixture

__all__ = ["asked", "corpus", "engine_fixture"]  # the fixtures: engine, asked (tests/adapter_shared.py), corpus


@pytest.fixture(scope="session")
def corpus(engine):
    return _corpus()
