"""Shared fixtures: the bundled model loaded once, a tiny random Llama with GQA, a PostgreSQL cluster."""

import os
import shutil
import subprocess
import sys


def _cuda_device() -> bool:
    """Whether torch sees a CUDA device. Asked in a subprocess, and only where nvidia-smi exists (a CPU machine
    pays nothing): this process initialises no CUDA, and the daemons and engine cores the tests start fork."""
    if shutil.which("nvidia-smi") is None:
        return False
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
                           capture_output=True, text=True, timeout=120)
    return probe.stdout.strip() == "True"


# With no CUDA device, Triton kernels run on CPU tensors through the interpreter; with one, the real
# compiled path runs (the `gpu` tests and the kernel tests on the device). Set before anything imports
# triton; a TRITON_INTERPRET given by the caller wins.
CUDA_DEVICE = _cuda_device()
os.environ.setdefault("TRITON_INTERPRET", "0" if CUDA_DEVICE else "1")

import pytest  # noqa: E402

# `make test` runs two pytest-xdist workers on 2 cores: the daemons they start then compute on one thread
# each (TEST_NUM_THREADS, read by the daemon fixtures), so that two of them never oversubscribe the cores
# with OpenMP workers spinning for turns; alone, a run gives them two. In-process tests keep torch's
# default (two here); their equality tests hold at any count since a grouped product gives a row the
# same bits at any batch size (see the note in tests/engine/test_engine.py).
TEST_NUM_THREADS = "1" if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1 else "2"
os.environ["TEST_NUM_THREADS"] = TEST_NUM_THREADS


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
    if CUDA_DEVICE:
        return
    skip = pytest.mark.skip(reason="no CUDA device (torch sees none): the gpu tests need one")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
