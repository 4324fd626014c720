"""Per-rank distributed context: process groups, the expert range, and the per-forward gathered DPMeta that the
EP dispatcher reads (set before each forward, cleared after; never inferred from local state)."""

from __future__ import annotations

import datetime
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from mtp_ray.parallel.dp_meta import DPMeta, Gathered, gather

log = logging.getLogger(__name__)


def expert_ranges(num_experts: int, ep: int) -> list[tuple[int, int]]:
    """Contiguous expert shards; the first num_experts % ep ranks get one extra expert."""
    if ep > num_experts:
        raise ValueError(f"EP size {ep} (parallel.dp) exceeds num_experts {num_experts}: each rank holds at least one")
    base, extra = divmod(num_experts, ep)
    out, start = [], 0
    for r in range(ep):
        n = base + (1 if r < extra else 0)
        out.append((start, start + n))
        start += n
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


@dataclass
class DistContext:
    rank: int
    world: int
    num_experts: int
    device: torch.device
    timeout_s: float
    group: object = None  # EP collectives (NCCL on GPU, gloo on CPU)
    cpu_group: object = None  # DPMeta gathers, barriers (gloo)
    forward: Gathered | None = None  # the gathered DPMeta of the forward in flight
    local: DPMeta = field(default_factory=DPMeta)  # this rank's last DPMeta (for fault reports)
    collectives: int = 0
    last_ep_mode: int = 0
    inject_ep_flip: bool = False  # test hook: this rank deliberately takes the other EP mode
    check_collectives: bool = True
    on_forward: Callable[[Gathered], None] | None = None  # the EP backend's hook, called by set_forward

    @property
    def expert_range(self) -> tuple[int, int]:
        return expert_ranges(self.num_experts, self.world)[self.rank]

    def owner_table(self) -> torch.Tensor:
        """[num_experts] -> owning rank."""
        owner = torch.empty(self.num_experts, dtype=torch.long)
        for r, (s, e) in enumerate(expert_ranges(self.num_experts, self.world)):
            owner[s:e] = r
        return owner

    def init(self, master_addr: str, master_port: int) -> None:
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=self.timeout_s)
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        if self.rank == 0:  # the rendezvous store listens on the node's address only (tcp:// init: every interface)
            sock = socket.socket(socket.AF_INET6 if ":" in master_addr else socket.AF_INET)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((master_addr, master_port))
            sock.listen(128)
            store = dist.TCPStore(master_addr, master_port, self.world, True, timeout,
                                  master_listen_fd=sock.detach(), use_libuv=False)  # the store owns the socket
        else:
            store = dist.TCPStore(master_addr, master_port, self.world, False, timeout)
        dist.init_process_group(backend, store=store, rank=self.rank, world_size=self.world, timeout=timeout)
        self.group = dist.group.WORLD
        self.cpu_group = dist.new_group(backend="gloo", timeout=timeout)
        log.info("rank %d/%d joined (%s), experts %s", self.rank, self.world, backend, self.expert_range)

    def gather(self, local: DPMeta) -> Gathered:
        local.collectives = self.collectives
        local.ep_mode = self.last_ep_mode
        self.local = local
        return gather(local, self.cpu_group, self.world, self.rank, self.check_collectives)

    def set_forward(self, table: Gathered) -> None:
        """The gathered table of the forward about to run (eager or a graph replay); the EP backend sees it first
        (DeepEP cleans its low-latency buffers when the group moves from the normal protocol to low-latency)."""
        self.forward = table
        if self.on_forward is not None:
            self.on_forward(table)

    def barrier(self) -> None:
        if self.world == 1:  # nobody to wait for (as gather: a group of one runs no collective)
            return
        import torch.distributed as dist

        dist.barrier(group=self.cpu_group)

    def agree_error(self, err: str | None) -> str | None:
        """The ranks' outcomes of a step they take together (a group command's checks, before it changes
        anything): the first rank's error, the same on every rank, or None when every rank succeeded."""
        if self.world == 1:
            return err
        import torch.distributed as dist

        out: list[str | None] = [None] * self.world
        dist.all_gather_object(out, err, group=self.cpu_group)
        return next((e for e in out if e is not None), None)

    def ep_mode(self) -> int:
        """The EP mode of the forward in flight, from the gathered table (flipped only by the test hook)."""
        assert self.forward is not None, "EP collective outside a forward: no gathered DPMeta is set"
        mode = self.forward.ep_mode
        if self.inject_ep_flip:
            mode = 1 - mode
        self.last_ep_mode = mode
        return mode

    def shutdown(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
