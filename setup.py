"""megatron-odyssey: adaptive fault tolerance (reroute or reconfigure) for Megatron-LM pre-training."""
from setuptools import find_packages, setup

setup(
    name="megatron-odyssey",
    version="0.1.0",
    description="Keeps Megatron-LM pre-training running through accelerator failures without spare nodes",
    packages=find_packages(include=["megatron_odyssey", "megatron_odyssey.*"]),
    package_data={"megatron_odyssey": ["data/*.txt", "data/*.json"]},
    python_requires=">=3.10",
    install_requires=[
        # The planning layer needs only these; torch is pinned by the README's install command
        # (the CPU wheel must be installed first, or pip pulls a multi-GB CUDA build).
        "numpy",
        "scipy",
        "networkx",
        "rich",
        "tqdm",
        "matplotlib",
    ],
    extras_require={
        # psutil: megatron-core's torch_dist checkpoint writers need it (without it a save hangs on 0.13-0.16, the
        # pinned wheel's line, and fails on 0.17+)
        "runtime": ["torch==2.13.0", "megatron-core==0.16.1", "psutil"],
        # dnspython: testing.slow_dns, a late name server (benchmarks/bench_store_names.py and its test)
        "test": ["pytest", "pytest-xdist", "filelock", "dnspython"],
    },
    entry_points={"console_scripts": ["odyssey=megatron_odyssey.cli:main",
                                     "odyssey-launch=megatron_odyssey.launch:main"]},
)
