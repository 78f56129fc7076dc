from __future__ import annotations

from pathlib import Path

import pytest

from pretrain.data.prepare import build_indexed_dataset, synthetic_documents


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 1 MB synthetic corpus as a Megatron indexed dataset (prefix path)."""
    prefix = tmp_path_factory.mktemp("data") / "corpus"
    build_indexed_dataset(synthetic_documents(1.0, seed=0), prefix)
    return prefix
