"""Shared fixtures: the real SmolLM2 (loaded once per session) and tiny random-weight models."""

from __future__ import annotations

import pytest
import torch

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def smollm():
    """(model, tokenizer) of the default model, SmolLM2-135M-Instruct, fp32 on CPU."""
    from rag_promptcache.model.loading import load_model

    return load_model("smollm2-135m-instruct", device="cpu")


@pytest.fixture(scope="session")
def tokenizer(smollm):
    return smollm[1]
