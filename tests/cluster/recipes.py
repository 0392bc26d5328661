"""The cluster recipes and the Qwen3-30B-A3B spec the cluster tests plan for."""

from tests.paths import REPO

RECIPES = REPO / "examples" / "qwen3_30b_a3b"
QWEN_JSON = REPO / "megatron_sao" / "models" / "configs" / "qwen3_30b_a3b.json"
