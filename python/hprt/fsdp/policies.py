"""The policies ``fully_shard`` takes, under FSDP2's names: mixed precision, and where the shards
live (``OffloadPolicy`` / ``CPUOffloadPolicy``)."""

from dataclasses import dataclass

import torch

import hprt


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """FSDP2's / hyper_parallel's mixed precision: gather and compute in ``param_dtype``,
    reduce gradients in ``reduce_dtype`` (default: ``param_dtype``), cast module outputs to
    ``output_dtype``, cast floating-point forward inputs to ``param_dtype``. The shards (what the
    optimizer updates) keep the parameters' own dtype."""

    param_dtype: torch.dtype = None
    reduce_dtype: torch.dtype = None
    output_dtype: torch.dtype = None
    cast_forward_inputs: bool = True

    def _hprt(self):
        name = lambda d: None if d is None else str(d)  # noqa: E731  (hprt parses torch names)
        return hprt.MixedPrecisionPolicy(
            param_dtype=name(self.param_dtype),
            reduce_dtype=name(self.reduce_dtype),
            output_dtype=name(self.output_dtype),
        )


class OffloadPolicy:
    """No offload: shards and sharded gradients stay in device memory (FSDP2's base class)."""

    _hprt = "none"


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Shards and sharded gradients live in pinned host memory; only gathered parameters take
    device memory. The optimizer steps on the host copies."""

    pin_memory: bool = True
    _hprt = "pinned_host"

    def __post_init__(self):
        if not self.pin_memory:
            raise ValueError(
                "CPUOffloadPolicy(pin_memory=False): hprt keeps offloaded shards in pinned host "
                "memory (its copies are asynchronous); use pin_memory=True"
            )
