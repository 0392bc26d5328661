"""Shared fixtures of the cluster tests: the Qwen3-30B-A3B spec."""

import json

import pytest

from tests.cluster.recipes import QWEN_JSON


@pytest.fixture(scope="session")
def qwen_dict():
    return json.loads(QWEN_JSON.read_text())


@pytest.fixture(scope="session")
def qwen_long(qwen_dict):
    """The -2507 variant: same weights layout, 262144 positions (what the 128K recipes need)."""
    from megatron_sao.models.hf_config import model_spec_from_hf

    return model_spec_from_hf({**qwen_dict, "rope_theta": 1e7, "max_position_embeddings": 262144})
