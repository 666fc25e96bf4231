"""Shared fixtures: the bundled model loaded once, a tiny random Llama with GQA, a PostgreSQL cluster."""

import os

# Triton kernels run on CPU tensors through the interpreter; it must be set
# before anything imports triton.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def bundled_fp32():
    """The bundled SmolLM2-135M-Instruct in float32 (converted once, then cached)."""
    from streamchat.config import ModelConfig
    from streamchat.model.runner import load_model

    return load_model(ModelConfig(dtype="float32"))


@pytest.fixture(scope="session")
def hf_bundled_fp32(bundled_fp32):
    """transformers' own model on the same weights, float32."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(bundled_fp32.source.folder, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def pg_cluster():
    """One throwaway PostgreSQL cluster for the whole run (see pgcluster.py); fails, never skips, without one."""
    import pgcluster

    try:
        cluster = pgcluster.start_cluster()
    except pgcluster.ClusterError as exc:
        pytest.fail(f"cannot start the PostgreSQL test cluster: {exc}", pytrace=False)
    yield cluster
    cluster.stop()


@pytest.fixture
def pg_url(pg_cluster) -> str:
    """A SQLAlchemy URL of a fresh, empty database of its own in the test cluster, dropped afterwards."""
    name = pg_cluster.create_database()
    yield pg_cluster.url(name)
    pg_cluster.drop_database(name)


def pytest_collection_modifyitems(config, items):
    import shutil

    if shutil.which("nvidia-smi"):
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
