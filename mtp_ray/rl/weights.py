"""The trainer's end of a weight update over a process group (verl / OpenRLHF style); the ranks' end is
mtp_ray/engine/weight_sync.py."""

from __future__ import annotations

import torch

from mtp_ray.engine.weight_sync import make_group


class TrainerWeightSender:
    """The trainer's end of the weight-update group (rank 0): broadcast named tensors to every engine rank.

        sender = TrainerWeightSender(addr, port, world_size=1 + dp, group_name="wu")   # then, concurrently,
        engine.init_weights_update_group.remote(addr, port, 1, 1 + dp, "wu", "gloo")
        ref = engine.update_weights_from_distributed.remote(names, dtypes, shapes, "wu"); sender.send(tensors)
    """

    def __init__(self, master_address: str, master_port: int, world_size: int, group_name: str = "weight_update",
                 backend: str = "gloo", timeout_s: float = 300.0):
        self.store, self.pg = make_group(master_address, master_port, 0, world_size, group_name, backend, timeout_s)

    def send(self, named: list[tuple[str, torch.Tensor]]) -> None:
        for _, t in named:
            self.pg.broadcast(t.contiguous(), root=0).wait()
