"""Encodings added to the input embeddings: sinusoidal and learned absolute."""

from posenc.absolute.learned import LearnedAbsolute
from posenc.absolute.sinusoidal import Sinusoidal, sinusoidal_table

__all__ = ["LearnedAbsolute", "Sinusoidal", "sinusoidal_table"]
