from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
torch.set_num_threads(min(2, os.cpu_count() or 1))
# On a CPU-only machine every Triton kernel runs through the interpreter (DESIGN section 5);
# this must be set before any `@triton.jit` module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (gpu mark)")
    for item in items:
        if "gpu" in item.keywords or "multi_gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_llama3_dir(tmp_path_factory):
    from tests.tiny_models import llama3_config, save_tiny_target

    return save_tiny_target(llama3_config(), tmp_path_factory.mktemp("llama3"))


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory):
    from tests.tiny_models import qwen3_config, save_tiny_target

    return save_tiny_target(qwen3_config(), tmp_path_factory.mktemp("qwen3"))


@pytest.fixture(scope="session")
def train_env(tmp_path_factory):
    from tests.tiny_models import make_train_env

    return make_train_env(tmp_path_factory.mktemp("train_env"))
