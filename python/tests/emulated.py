"""The accelerator backends on their emulators, as pytest parameters: each runs where
scripts/test points its variable at the emulator library (HP_ACL_LIB, HP_CUDA_LIB)."""

import os

import pytest

EMULATED = [
    pytest.param(
        "npu",
        marks=pytest.mark.skipif(not os.environ.get("HP_ACL_LIB"), reason="needs the Ascend emulator (HP_ACL_LIB)"),
    ),
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(not os.environ.get("HP_CUDA_LIB"), reason="needs the CUDA emulator (HP_CUDA_LIB)"),
    ),
]
