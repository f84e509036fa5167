"""numpy's random generator state as tensors and numbers, so that a checkpoint holding it loads
with torch.load(weights_only=True): PowerSGD's generator (steps/powersgd.py) and torch's PowerSGD
hook's (parts/torch_hooks.py) are saved and restored through it.

    state = rng_state(np.random.RandomState(0))
    set_rng_state(rng, state)          # rng draws what the saved one would have drawn next
"""

from __future__ import annotations

import numpy as np
import torch


def rng_state(rng: np.random.RandomState) -> dict:
    """numpy's generator state as tensors and numbers (a checkpoint loads with weights_only)."""
    _, keys, pos, has_gauss, gauss = rng.get_state()
    return {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos), "has_gauss": int(has_gauss),
            "gauss": float(gauss)}


def set_rng_state(rng: np.random.RandomState, state: dict) -> None:
    rng.set_state(("MT19937", state["keys"].numpy().astype(np.uint32), state["pos"], state["has_gauss"],
                   state["gauss"]))
