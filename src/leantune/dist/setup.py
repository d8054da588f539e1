"""The processes of a run under torchrun: who this process is, its device, the process group.

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT in
every process it starts; `leantune train` under it runs one process per GPU (or per CPU process,
on the gloo backend). `accelerate launch --multi_gpu` starts the processes through torchrun's
launcher, so they get the same variables (accelerate 1.15; its own ACCELERATE_* settings, such
as --mixed_precision, are not read: leantune's flags set the run). `accelerate launch --cpu`
starts one process (several only through mpirun, --mpirun_hostfile, whose MPI variables leantune
does not read: it stops with one line rather than let each process train alone into the same
output folder).
Without torchrun's variables nothing here runs: one process stays exactly as it is, with no
process group.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..errors import LeantuneError
from . import launched


@dataclass(frozen=True)
class Ranks:
    """This process's place: global rank and count, and the same on this host."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int

    @property
    def writer(self) -> bool:
        """Rank 0 alone writes the run's files."""
        return self.rank == 0


# each MPI launcher's count of the processes it started: Open MPI, MPICH and Intel MPI, MVAPICH
MPI_WORLD_SIZES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")


def ranks_from_env(environ=os.environ) -> Ranks | None:
    """The launcher's ranks, or None in a process started on its own."""
    if not launched(environ):
        for key in MPI_WORLD_SIZES:
            if environ.get(key, "1").strip() not in ("", "0", "1"):
                raise LeantuneError(
                    f"{key}={environ[key]}: this process is one of several an MPI launcher "
                    "started (mpirun, as accelerate launch --cpu --mpirun_hostfile does), whose "
                    "ranks leantune does not read; start the run with torchrun, or with "
                    "accelerate launch --multi_gpu (on a host without GPUs too)")
        return None
    try:
        rank, world = int(environ["RANK"]), int(environ["WORLD_SIZE"])
        local = int(environ.get("LOCAL_RANK", rank))
        local_world = int(environ.get("LOCAL_WORLD_SIZE", world))
    except ValueError:
        raise LeantuneError("RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE must be integers "
                            "(torchrun sets them); start the run with torchrun, or unset them "
                            "for one process") from None
    if not (0 <= rank < world and 0 <= local < local_world):
        raise LeantuneError(f"RANK {rank} / WORLD_SIZE {world} (LOCAL_RANK {local} / "
                            f"LOCAL_WORLD_SIZE {local_world}) do not fit together; start the "
                            "run with torchrun")
    return Ranks(rank, world, local, local_world)


def rank_device(device: torch.device, ranks: Ranks) -> torch.device:
    """The device of this process: `device` (the run's --device, resolved) with a GPU taken by
    LOCAL_RANK; a CPU run stays on the CPU."""
    if device.type != "cuda":
        return device
    if device.index is not None:
        raise LeantuneError(f"--device {device}: under torchrun each process takes the GPU of "
                            "its LOCAL_RANK; give --device cuda (or leave it out)")
    count = torch.cuda.device_count()
    if ranks.local_rank >= count:
        raise LeantuneError(f"LOCAL_RANK {ranks.local_rank}: torch sees only {count} CUDA "
                            f"GPU(s) on this host; start torchrun with --nproc_per_node {count} "
                            "or fewer")
    return torch.device("cuda", ranks.local_rank)


def init_process_group(device: torch.device) -> None:
    """NCCL between GPUs, gloo between CPU processes; the rendezvous comes from torchrun's
    environment (MASTER_ADDR, MASTER_PORT). A process group the caller made already is used as
    it is."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")


def shutdown() -> None:
    """End the process group, if this process has one, at the end of a run that went well, once
    nothing uses it any more (a DDP reducer torn down after its process group can hang). After
    an error it is left to the process's exit."""
    import gc

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


def agree(error: LeantuneError | None, device: torch.device) -> None:
    """Every process calls this at the same point of its set-up, with the error it met (or
    None). If any brought one, every process raises the error of the lowest such rank, so rank 0
    prints one line for all of them (the others exit quietly). Two collectives; the message
    travels as UTF-8 bytes."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    first = torch.tensor([rank if error is not None else world], device=device)
    dist.all_reduce(first, op=dist.ReduceOp.MIN)
    first = int(first.item())
    if first == world:
        return
    data = str(error).encode() if rank == first else b""
    size = torch.tensor([len(data)], device=device)
    dist.broadcast(size, src=first)
    buf = (torch.tensor(list(data), dtype=torch.uint8, device=device) if rank == first
           else torch.empty(int(size.item()), dtype=torch.uint8, device=device))
    dist.broadcast(buf, src=first)
    message = bytes(buf.cpu().tolist()).decode()
    raise LeantuneError(message if first == 0 else f"rank {first}: {message}")
