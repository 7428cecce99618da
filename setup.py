"""torch_dsv4_ops: pure Python + Triton; no compiler step at install time."""
from setuptools import find_packages, setup

setup(
    name="torch_dsv4_ops",
    version="0.1.0",
    description="DeepSeek-V4 attention plumbing as torch.library custom ops (dsv4::) with Triton kernels "
                "and pure-torch CPU references: paged KV-cache writes, the fp8_ds_mla K cache, sparse-index ops "
                "and the per-step metadata builders",
    packages=find_packages(include=["torch_dsv4_ops", "torch_dsv4_ops.*"]),
    # tested: Python 3.11 and 3.12, torch 2.11 to 2.13, triton 3.6 to 3.9. Install torch first (the CPU
    # build from https://download.pytorch.org/whl/cpu where there is no GPU; see README.md).
    python_requires=">=3.10",
    install_requires=["torch>=2.11", "triton>=3.6", "numpy"],
    extras_require={
        "test": ["pytest", "pytest-xdist", "expecttest", "hypothesis", "numpy", "ninja"],
        "bench": ["matplotlib"],
    },
    entry_points={"console_scripts": ["dsv4-selfcheck=torch_dsv4_ops.__main__:main"]},
)
