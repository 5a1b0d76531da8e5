"""Analysis of positional encodings: functions that return data, computed by the real posenc modules.

Data (no matplotlib): ``relative_invariance``, ``long_term_decay``, ``wavelengths``, ``frequency_table``,
``attention_entropy``, ``bias_matrix``, ``rotary_pairs``, and ``loss_by_length``: the lab's bits per token by context
length and loss by position for any tokens -> logits model (one's own ``nn.Module``, a transformers causal LM).
Figures (``FIGURES``, ``render``, ``write_figures``) and the HTML report (``write_report``) import matplotlib only
when the first figure is drawn, and only its ``Figure`` class: nothing here selects a backend or changes global
state.
"""

from __future__ import annotations

from posenc.analysis.bias import bias_matrix
from posenc.analysis.config import FigureConfig
from posenc.analysis.decay import DecayResult, decay_bound, long_term_decay
from posenc.analysis.entropy import EntropyResult, attention_entropy
from posenc.analysis.frequencies import (
    EXAMPLE_ROPE_PARAMETERS,
    FrequencyTable,
    example_rope_parameters,
    frequency_table,
)
from posenc.analysis.invariance import InvarianceResult, relative_invariance
from posenc.analysis.layout import PairLayout, rotary_pairs
from posenc.analysis.plots import FIGURES, FigureInputs, figure_inputs, render, write_figures
from posenc.analysis.report import write_report
from posenc.analysis.run import read_entropy_csv, read_results, run_entropy, write_entropy_csv
from posenc.analysis.wavelengths import WavelengthResult, wavelengths
from posenc.lab.evaluate import LengthLoss, loss_by_length

__all__ = [
    "EXAMPLE_ROPE_PARAMETERS",
    "FIGURES",
    "DecayResult",
    "EntropyResult",
    "FigureConfig",
    "FigureInputs",
    "FrequencyTable",
    "InvarianceResult",
    "LengthLoss",
    "PairLayout",
    "WavelengthResult",
    "attention_entropy",
    "bias_matrix",
    "decay_bound",
    "example_rope_parameters",
    "figure_inputs",
    "frequency_table",
    "long_term_decay",
    "loss_by_length",
    "read_entropy_csv",
    "read_results",
    "relative_invariance",
    "render",
    "rotary_pairs",
    "run_entropy",
    "wavelengths",
    "write_entropy_csv",
    "write_figures",
    "write_report",
]
