"""Shared test set-up: GPU markers skip cleanly where the hardware is missing; ``slow`` tests
run only with ``--run-slow`` (CI on 2 CPU cores stays short)."""

import pytest
import torch


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", help="also run the tests marked slow")


def pytest_collection_modifyitems(config, items):
    num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_multi = pytest.mark.skip(reason="needs two or more CUDA GPUs")
    skip_slow = pytest.mark.skip(reason="slow: pass --run-slow to run it")
    run_slow = config.getoption("--run-slow")
    for item in items:
        if "multigpu" in item.keywords and num_gpus < 2:
            item.add_marker(skip_multi)
        elif "cuda" in item.keywords and num_gpus < 1:
            item.add_marker(skip_cuda)
        if item.get_closest_marker("slow") and not run_slow:
            item.add_marker(skip_slow)
