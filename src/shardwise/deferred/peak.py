"""What a rank holds while a model is initialized and loaded: the engine's own bytes plus the
largest transient set beside them."""

from __future__ import annotations


class InitPeak:
    """The most bytes this rank held while its engine was initialized and loaded: what the
    engine keeps (``base``, counted from the tensors once they exist) plus the largest
    transient tensor set held beside it (a read slice, one module's parameters)."""

    def __init__(self) -> None:
        self.base = 0
        self.peak = 0
        self.largest_transient = 0

    def set_base(self, nbytes: int) -> None:
        """What the engine holds once its buffers exist (before they are filled)."""
        self.base = nbytes
        self.peak = max(self.peak, nbytes)

    def note(self, transient: int) -> None:
        """``transient`` bytes are held beside the engine's own now."""
        self.largest_transient = max(self.largest_transient, transient)
        self.peak = max(self.peak, self.base + transient)
