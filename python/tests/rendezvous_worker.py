"""The body of test_fsdp's rendezvous test, in its own module so that the spawned processes
import only torch and hprt."""

import os
import types

import hprt
import hprt.torch as ht


class _StandInPlatform:
    """What init_from_process_group needs of a cuda / npu platform, recording what it got."""

    backend = "npu"
    capabilities = types.SimpleNamespace(ranks_are_threads=False, framework_device="npu")

    def __init__(self):
        self.calls = []

    def device_count(self):
        return 8

    def set_device(self, d):
        self.calls.append(("set_device", d))

    def unique_id(self):
        return b"id-of-rank-0-" + str(os.getpid()).encode()

    def comm_init(self, uid, rank, world):
        self.calls.append(("comm_init", bytes(uid), rank, world))
        # A communicator the rank context can hold: a real one-rank cpu world.
        p = hprt.cpu_platform()
        return p.comm_init(p.unique_id(), 0, 1)


def run(rank, world, store_path, results):
    import torch.distributed as dist

    os.environ["LOCAL_RANK"] = str(rank)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    try:
        try:
            ht.init_from_process_group(platform=hprt.cpu_platform())
            cpu_error = None
        except hprt.UnsupportedError as e:
            cpu_error = str(e)
        stand_in = _StandInPlatform()
        got = ht.init_from_process_group(platform=stand_in)
        results.put((rank, got, cpu_error, stand_in.calls))
    finally:
        dist.destroy_process_group()
