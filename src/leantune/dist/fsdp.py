"""FSDP2 (`torch.distributed.fsdp.fully_shard`), for bases that do not fit one GPU.

Each DecoderLayer is sharded on its own, then the root (embedding, final norm, head). Every
parameter is split by rows across the processes: the frozen base in its dtype, the LoRA adapters
(fp32 masters) too. Gradients are reduce-scattered in fp32 (MixedPrecisionPolicy's reduce_dtype;
the parameters are gathered in their own dtypes). FSDP2's pre-forward hook gathers a layer's
weights before DecoderLayer.forward runs, so the layer's executor, called inside it, reads whole
weights; its pre-backward hook gathers them again (where they were freed after the forward,
`reshard_after_forward`) before the executor's hand-written backward runs, and the LoRA
gradients that backward returns are reduce-scattered after it. Packed projections are off under
FSDP2 (the trainer sets EngineOptions.pack_projections=False): FSDP2 owns the weights' storage,
which packing would replace with views into a buffer of its own.

Loading (`materialise`): the model is built on the meta device, sharded, given storage for this
process's rows only, and filled from the safetensors files reading only those rows, so no
process holds more of the base than its share (host memory near one tensor's rows). The
adapters get the values `apply_lora` draws in one process (same seed, same draws, in the same
order), of which each process keeps its rows.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .tensors import copy_full_into, shard_rows


def shard(model, device: torch.device, reshard_after_forward: bool) -> None:
    """fully_shard each decoder layer, then the root (which FSDP2 keeps gathered from its
    forward to its backward: its weights are needed again at once)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy,
                    reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=policy)


@torch.no_grad()
def materialise(model, device: torch.device, folder: Path, lora=None, seed: int = 0) -> None:
    """Storage on `device` for this process's rows of a sharded meta model, filled from the
    checkpoint `folder` (its rows only) and, with `lora` (a LoRAConfig), the adapters' initial
    values (init_lora)."""
    from ..model.loader import load_safetensors_into, safetensors_files

    model.to_empty(device=device)
    load_safetensors_into(model, safetensors_files(Path(folder)),
                          rows=lambda p: (p.to_local(), shard_rows(p)))
    if lora is not None:
        init_lora(model, lora, seed, device)


@torch.no_grad()
def init_lora(model, lora, seed: int, device: torch.device) -> None:
    """Each process's rows of the adapters of `model` (sharded; LoRAConfig `lora`) as
    `apply_lora(model, lora, seed)` draws them in one process on `device`'s type: the same seed
    and the same draws in the same order, through LoRALinear.add_lora on a stand-in projection
    of each adapted one's shape."""
    from ..lora import LoRALinear, lora_layers

    torch.manual_seed(seed)
    for _, layer in lora_layers(model, lora.targets):
        a, b = layer.lora_A.weight, layer.lora_B.weight
        stand_in = LoRALinear(layer.in_features, layer.out_features, device=device,
                              dtype=torch.bfloat16)
        stand_in.add_lora(lora.r, lora.alpha, lora.dropout, lora.use_rslora, dtype=a.dtype)
        copy_full_into(a, stand_in.lora_A.weight)
        copy_full_into(b, stand_in.lora_B.weight)


def fixed_bytes(model, world_size: int, reshard_after_forward: bool) -> float:
    """GPU bytes of weights and optimizer state per process under FSDP2 (the memory planner's
    fixed part), from the parameters' shapes (the model may still be on the meta device): this
    process's rows of every parameter and of the trainables' fp32 gradient and two AdamW
    moments, plus what FSDP2 holds gathered while it runs: the root's parameters, and two
    layers' (the one running and the next, gathered ahead), or every layer's where they stay
    gathered from forward to backward."""

    def size(params) -> int:
        return sum(p.numel() * p.element_size() + (12 * p.numel() if p.requires_grad else 0)
                   for p in params)

    layers = [size(layer.parameters()) for layer in model.layers]
    in_layers = {id(p) for layer in model.layers for p in layer.parameters()}
    root = size(p for p in model.parameters() if id(p) not in in_layers)
    held = 2 * max(layers) if reshard_after_forward else sum(layers)
    return size(model.parameters()) / world_size + held + root
