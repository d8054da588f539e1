"""Loss functions on per-sequence quantities, called by the training objectives.

preference   DPO (sigmoid / IPO / hinge), ORPO, SimPO and KTO on summed completion log-probs.
"""

from .preference import (
    DPO_LOSS_TYPES,
    PreferenceLoss,
    dpo_loss,
    kto_kl,
    kto_loss,
    log1m_exp,
    orpo_loss,
    simpo_loss,
    sum_by_document,
)

__all__ = [
    "DPO_LOSS_TYPES",
    "PreferenceLoss",
    "dpo_loss",
    "kto_kl",
    "kto_loss",
    "log1m_exp",
    "orpo_loss",
    "simpo_loss",
    "sum_by_document",
]
