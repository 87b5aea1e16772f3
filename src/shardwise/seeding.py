"""One way to seed every random number generator a run uses."""

from __future__ import annotations

import random

import numpy as np
import torch


def seed_all(seed: int) -> None:
    """Seed python's, numpy's and torch's generators (torch's on every device) with ``seed``.

    Process-wide: the training loop (or the user) calls it; library objects never do.
    """
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
