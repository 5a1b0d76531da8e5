"""The learned tables' module: an ``nn.Embedding`` whose ``reset_parameters`` gives its small initialisation."""

from __future__ import annotations

from torch import nn


class SmallInitEmbedding(nn.Embedding):
    """``nn.Embedding`` initialised N(0, 0.02^2), GPT-2's position table and T5's bias table, also when
    ``reset_parameters()`` is called again: materialising a model built on the meta device (``to_empty``, then each
    module's ``reset_parameters``, as FSDP does) gave a plain Embedding's N(0, 1), 50 times the scale."""

    STD = 0.02

    def reset_parameters(self) -> None:
        # After nn.Embedding's own N(0, 1) fill, which stays drawn: the random stream, and with it every seeded
        # model (the lab's runs), is what it was when the 0.02 was applied after construction.
        super().reset_parameters()
        nn.init.normal_(self.weight, std=self.STD)
