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
from .weights import DenseWeights, pack_layer


class Engine:
    """Executors for a model's layers, sharing one activation store, weight provider and
    attention backend, per `options`."""

    def __init__(self, options: EngineOptions | None = None):
        self.options = options or EngineOptions()
        self.store = ActivationStore()
        self.weights = DenseWeights(self.options)
        self.attention = AttentionBackend(self.options)

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
            return FusedExecutor(plan, self.store, self.weights, self.attention, self.options)
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
           "EngineOptions", "FusedExecutor", "Keep", "LayerPlan", "attach", "compile_layers",
           "detach", "fused_unsupported", "has_expert_lora", "lora_ranks"]
