"""The engine: how the model runs fast. The model (leantune.model) is readable on its own; the
engine hands each DecoderLayer an executor that computes the same layer with a hand-written
backward, keeping for backward what the layer's plan says (engine/executor.py), with weights
from a weight provider (engine/weights.py), attention backends that keep the softmax statistics
(engine/attention.py) and an activation store that offloads to pinned host memory and
prefetches (engine/activation_store.py); the planner (engine/planner.py) picks each layer's plan
for a memory budget by asking the executor what it keeps. Imports run one way: the engine
imports the model, never the reverse.

    engine = Engine(EngineOptions())
    engine.attach(model, plans)      # per layer: a LayerPlan, or None for plain autograd
    loss = model(batch=packed, loss_only=True).loss_sum
"""

from __future__ import annotations

from .activation_store import ActivationStore
from .attention import AttentionBackend
from .executor import (CheckpointExecutor, FusedExecutor, Keep, LayerPlan, fused_unsupported,
                       has_expert_lora, lora_ranks)
from .options import EngineOptions
from .weight_stream import WeightStream, layer_weight_bytes, streamable
from .weights import DenseWeights, pack_layer


class Engine:
    """Executors for a model's layers, sharing one activation store, weight provider and
    attention backend, per `options`."""

    def __init__(self, options: EngineOptions | None = None):
        self.options = options or EngineOptions()
        self.store = ActivationStore()
        self.weights = DenseWeights(self.options)
        self.attention = AttentionBackend(self.options)
        self.stream: WeightStream | None = None  # streamed base weights (stream_weights)

    def fused_unsupported(self, model) -> str | None:
        """Why the model's layers can't take the fused path (None if they can)."""
        if not self.options.fused_layers:
            return "fused layers switched off"
        for layer in model.layers:
            why = fused_unsupported(layer)
            if why:
                return why
        return None

    def executor(self, layer, plan: LayerPlan | None):
        """The executor for `layer` under `plan`: the fused one where the layer qualifies,
        torch.utils.checkpoint for a plan that keeps less than everything, else None (plain
        autograd)."""
        if plan is None:
            return None
        if self.options.fused_layers and fused_unsupported(layer) is None:
            ex = FusedExecutor(plan, self.store, self.weights, self.attention, self.options)
            ex.stream = self.stream
            return ex
        return CheckpointExecutor(plan) if plan.keep < Keep.ALL else None

    def attach(self, model, plans: list) -> None:
        """Set each layer's executor for its plan (None: plain autograd)."""
        layers = list(model.layers)
        if len(plans) != len(layers):
            raise ValueError(f"{len(plans)} layer plans for {len(layers)} layers")
        for layer, plan in zip(layers, plans):
            layer.executor = self.executor(layer, plan)

    def pack(self, model) -> None:
        """Pack the projection weights of every layer the fused path can run, now rather than in
        its first step (so that memory is measured, and plans made, with the packed layout)."""
        if not self.options.fused_layers:
            return
        for layer in model.layers:
            if fused_unsupported(layer) is None:
                pack_layer(layer, self.weights)

    # --- streamed base weights (engine/weight_stream.py) ---------------------------------------
    def streamable(self, model) -> list[int]:
        """The layers whose base weights could stream: the fused path takes them, 16-bit,
        packed, dense."""
        if self.stream is not None:
            raise RuntimeError("the model's weights stream already (ask before streaming)")
        if not self.options.fused_layers:
            return []
        return [i for i, layer in enumerate(model.layers)
                if fused_unsupported(layer) is None and streamable(layer, self.weights) is None]

    def layer_weight_bytes(self, model) -> int:
        """The largest streamable layer's packed base weights (what a slot holds)."""
        ok = self.streamable(model)
        return max((layer_weight_bytes(model.layers[i], self.weights) for i in ok), default=0)

    def stream_weights(self, model, indices: list[int]) -> WeightStream | None:
        """Layers `indices`' base weights to pinned host memory, streamed back one layer ahead
        of each use (after `attach`: their executors must be fused). None for no layers."""
        if not indices:
            return None
        if self.stream is not None:
            raise RuntimeError("the model's weights stream already; unstream first")
        layers = list(model.layers)
        for i in indices:
            if getattr(layers[i].executor, "kind", None) != "fused":
                raise ValueError(f"layer {i} is not on the fused path: its weights cannot "
                                 "stream")
        device = layers[indices[0]].self_attn.q_proj.weight.device
        stream = WeightStream(device, fill_ahead=self.options.stream_fill_ahead)
        stream.offload([layers[i] for i in indices], layers, self.weights)
        stream.hook(layers)
        self.stream = stream
        for layer in layers:
            if getattr(layer.executor, "kind", None) == "fused":
                layer.executor.stream = stream
        return stream

    def unstream(self, model) -> None:
        """Every streamed base weight back on the GPU (the end of training: export and
        generation read the weights directly)."""
        if self.stream is None:
            return
        self.stream.unstream()
        self.stream = None
        for layer in model.layers:
            if getattr(layer.executor, "kind", None) == "fused":
                layer.executor.stream = None

    @staticmethod
    def plans(model) -> list:
        """Each layer's plan (None where it runs plainly)."""
        return [getattr(layer.executor, "plan", None) for layer in model.layers]


def attach(model, plans: list, options: EngineOptions | None = None) -> Engine:
    """An Engine with `options` whose executors now run `model`'s layers under `plans`."""
    engine = Engine(options)
    engine.attach(model, plans)
    return engine


def detach(model) -> None:
    """Every layer back to plain autograd."""
    for layer in model.layers:
        layer.executor = None


def compile_layers(model, **kwargs) -> None:
    """torch.compile each decoder layer as one region (layers share the compiled code). Compiled
    layers run plainly: no executor."""
    detach(model)
    for layer in model.layers:
        layer.compile(**kwargs)


__all__ = ["ActivationStore", "AttentionBackend", "CheckpointExecutor", "DenseWeights", "Engine",
           "EngineOptions", "FusedExecutor", "Keep", "LayerPlan", "WeightStream", "attach",
           "compile_layers",
           "detach", "fused_unsupported", "has_expert_lora", "lora_ranks"]
