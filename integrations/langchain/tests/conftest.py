import pytest
from lc_shared import corpus as _corpus, engine as _engine, record_calls


@pytest.fixture(scope="session")
def engine():
    """The one SmolLM2 engine of the session (the corpus uses it too)."""
    return _engine()


@pytest.fixture(scope="session")
def corpus(engine):
    return _corpus()


@pytest.fixture
def asked(engine, monkeypatch):
    """What the adapter asked of the engine, call by call (`Asked`); the real engine runs."""
    return record_calls(engine, monkeypatch)
