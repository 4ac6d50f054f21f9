"""deepspeed-gift: low-precision ZeRO-1/2 gradient communication in geometry-aware coordinates.

Install: ``pip install -e ".[dev]"`` (see README for the CPU-only set-up script).
torch is a plain requirement here, never pinned: GPU users keep the CUDA build they
have; ``scripts/setup.sh`` installs the CPU build first on machines without a GPU.
"""

import os
import sysconfig

from setuptools import find_packages, setup

# deepspeed_gift.pth goes into site-packages: at interpreter start it loads the tiny
# deepspeed_gift_hook module (no torch, no DeepSpeed), which wraps DeepSpeed's engine class
# when DeepSpeed is imported, so that DEEPSPEED_GIFT=1 / deepspeed_gift.install() reach engines
# that HF Trainer, Accelerate or Lightning build (see README, "Under HF Trainer / Accelerate").
SITE_PACKAGES = os.path.relpath(sysconfig.get_path("purelib"), sysconfig.get_path("data"))

setup(
    name="deepspeed-gift",
    version="0.1.0",
    description="GIFT: geometry-informed low-precision gradient communication for DeepSpeed ZeRO-1/2",
    packages=find_packages(include=["deepspeed_gift", "deepspeed_gift.*"]),
    py_modules=["deepspeed_gift_hook"],
    data_files=[(SITE_PACKAGES, ["deepspeed_gift.pth"])],
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.1",
        # Built and tested against 0.19.8, the only release the package index here holds; the
        # ZeRO internals GIFT reads first appear in 0.19 (zero.ZERO_INTERNALS is probed at attach,
        # so another 0.19.x missing one fails there, naming its version).
        "deepspeed>=0.19.8,<0.20",
        "pydantic>=2",
        "numpy",
    ],
    extras_require={
        "mpi": ["mpi4py>=3.1", "openmpi"],
        "train": ["transformers>=4.40", "accelerate>=1.0", "matplotlib", "tqdm"],
        "dev": ["pytest>=7", "pytest-timeout"],
    },
)
