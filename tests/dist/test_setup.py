"""Which process this is, from the launcher's environment: torchrun's variables, the same set
from `accelerate launch --multi_gpu`, none in one process (`accelerate launch --cpu` starts one
process without mpirun, even with --num_processes 2); an MPI launcher's processes stop with one
line. The environments below are (parts of) what each launcher set in a process (accelerate
1.15, torch 2.13, seen on this machine)."""

from __future__ import annotations

import pytest

from leantune.dist import env_rank, launched
from leantune.dist.setup import Ranks, ranks_from_env
from leantune.errors import LeantuneError

TORCHRUN = dict(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2",
                MASTER_ADDR="127.0.0.1", MASTER_PORT="29500", GROUP_RANK="0",
                TORCHELASTIC_RUN_ID="none")
# accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no
# --dynamo_backend no (rank 1's process; no GPU needed to start it)
ACCELERATE_MULTI_GPU = dict(
    TORCHRUN, ROLE_NAME="default", ROLE_RANK="1", ROLE_WORLD_SIZE="2", GROUP_WORLD_SIZE="1",
    ACCELERATE_MIXED_PRECISION="no", ACCELERATE_DYNAMO_BACKEND="NO", OMP_NUM_THREADS="1")
# accelerate launch --cpu --num_processes 2 --num_machines 1: one plain process (with 1: the
# same without MASTER_ADDR and MASTER_PORT)
ACCELERATE_CPU = dict(ACCELERATE_USE_CPU="True", ACCELERATE_MIXED_PRECISION="no",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29500", OMP_NUM_THREADS="1",
                      KMP_BLOCKTIME="1")


def test_torchrun_and_accelerate_multi_gpu_give_the_ranks():
    for env in (TORCHRUN, ACCELERATE_MULTI_GPU):
        assert launched(env) and env_rank(env) == 1
        assert ranks_from_env(env) == Ranks(rank=1, world_size=2, local_rank=1,
                                            local_world_size=2)
    assert ranks_from_env(dict(RANK="0", WORLD_SIZE="1")) == Ranks(0, 1, 0, 1)


def test_one_process_has_no_ranks():
    for env in ({}, ACCELERATE_CPU, dict(PMI_SIZE="1", PMI_RANK="0")):
        assert not launched(env) and ranks_from_env(env) is None and env_rank(env) == 0


@pytest.mark.parametrize("key", ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE"])
def test_an_mpi_launchers_processes_stop_with_one_line(key):
    with pytest.raises(LeantuneError, match=f"^{key}=2: this process is one of several an MPI "
                       "launcher started .* accelerate launch --multi_gpu"):
        ranks_from_env({key: "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"})


def test_bad_launcher_variables_are_one_line():
    with pytest.raises(LeantuneError, match="must be integers"):
        ranks_from_env(dict(RANK="one", WORLD_SIZE="2"))
    with pytest.raises(LeantuneError, match="RANK 2 / WORLD_SIZE 2 .* do not fit together"):
        ranks_from_env(dict(RANK="2", WORLD_SIZE="2"))
