import pytest
from li_shared import corpus as _corpus, engine as _engine


@pytest.fixture(scope="session")
def engine():
    """The one SmolLM2 engine of the session (the corpus uses it too)."""
    return _engine()


@pytest.fixture(scope="session")
def corpus(engine):
    return _corpus()
