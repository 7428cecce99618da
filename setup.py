"""torch_dsv4_ops: pure Python + Triton; no compiler step at install time."""
from setuptools import find_packages, setup

setup(
    name="torch_dsv4_ops",
    version="0.1.0",
    description="DeepSeek-V4 attention plumbing (paged KV caches, fp8 K cache, sparse indices, "
                "metadata, paged attention) as torch.library custom ops with Triton kernels",
    packages=find_packages(include=["torch_dsv4_ops", "torch_dsv4_ops.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.11", "triton>=3.6", "numpy"],
    extras_require={
        "test": ["pytest", "expecttest", "hypothesis", "numpy", "ninja"],
        "bench": ["matplotlib"],
    },
    entry_points={"console_scripts": ["dsv4-selfcheck=torch_dsv4_ops.__main__:main"]},
)
