"""Install the csa_frontend Python package (sources under python/)."""
import re
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent
VERSION = re.search(r'^__version__ = "([^"]+)"', (ROOT / "python/csa_frontend/__init__.py").read_text(),
                    re.M).group(1)

setup(
    name="csa-frontend",
    version=VERSION,
    description="Fused CSA compressor gated pooling (DeepSeek-V4-style KV compression) with a "
                "cuDNN-frontend-style operator API",
    long_description=(ROOT / "README.md").read_text(),
    long_description_content_type="text/markdown",
    package_dir={"": "python"},
    packages=find_packages("python"),
    python_requires=">=3.10",
    install_requires=[
        "torch",
        "nvidia-cutlass-dsl>=4.8.1",  # the CuTe DSL the kernels are written and tested against
        "cuda-bindings",
        "apache-tvm-ffi",
    ],
    extras_require={"test": ["pytest", "pytest-benchmark"]},
)
