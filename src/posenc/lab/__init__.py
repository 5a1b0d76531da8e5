"""The lab: train a tiny byte-level language model per encoding and measure how each extrapolates.

``posenc lab`` runs it from the command line; ``Lab(make_config("quick"), out).run()`` from Python.
"""

from posenc.lab.config import EXTENSIONS, PRESETS, LabConfig, make_config
from posenc.lab.runner import Lab

__all__ = ["EXTENSIONS", "PRESETS", "Lab", "LabConfig", "make_config"]
