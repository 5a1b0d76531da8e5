"""The lab's configuration: one frozen dataclass, three named presets, and the RoPE extensions it applies.

Every field is validated in ``__post_init__`` with a message naming the field and the fix, so a bad command
fails before any training starts. ``make_config(preset, **overrides)`` is how the command line builds one.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from posenc._checks import integer, integer_offset, positive_int
from posenc.registry import ENCODINGS

if TYPE_CHECKING:
    from posenc.lab.model import ModelSpec

# torch.manual_seed takes seeds up to 2**64 - 1.
_MAX_SEED = 2**64 - 1

TASKS = ("copy", "passkey")


def _pi(factor: float, train_len: int) -> dict[str, Any]:
    return {"rope_type": "linear", "factor": factor}


def _ntk(factor: float, train_len: int) -> dict[str, Any]:
    return {"rope_type": "ntk", "factor": factor}


def _dynamic(factor: float, train_len: int) -> dict[str, Any]:
    # Dynamic NTK adapts to the length it sees, so it takes no target: factor 2 is emozilla's setting and makes
    # Hugging Face's alpha = 2 * s - 1 at s times the trained length, Qwen's ntk_alpha at powers of two.
    return {"rope_type": "dynamic", "factor": 2.0}


def _yarn(factor: float, train_len: int) -> dict[str, Any]:
    # beta_fast / beta_slow at the paper's values; the attention factor defaults to 0.1 ln(factor) + 1 (Eq. 22).
    return {
        "rope_type": "yarn",
        "factor": factor,
        "original_max_position_embeddings": train_len,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
    }


def _llama3(factor: float, train_len: int) -> dict[str, Any]:
    return {
        "rope_type": "llama3",
        "factor": factor,
        "original_max_position_embeddings": train_len,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
    }


# Training-free RoPE extensions: name -> rope_parameters for a target of ``factor`` times the training length.
# posenc.rope.register_scaling adds a registered type's (which takes the rotary dim too: its example's first argument).
EXTENSIONS: dict[str, Callable[..., dict[str, Any]]] = {
    "pi": _pi,
    "ntk": _ntk,
    "dynamic": _dynamic,
    "yarn": _yarn,
    "llama3": _llama3,
}
# The extensions their papers fine-tune briefly at the target length (PI Table 3, YaRN §4).
FINETUNABLE = ("pi", "yarn")


def extension_rope_parameters(
    name: str, factor: float, train_len: int, *, rotary_dim: int | None = None
) -> dict[str, Any]:
    """rope_parameters for extension ``name`` extending ``train_len`` by ``factor`` (> 1) for a RoPE of ``rotary_dim``
    channels, which a type registered by ``posenc.rope.register_scaling`` needs (its example parameters take it)."""
    from posenc.rope.scaling import _ExampleExtension

    if name not in EXTENSIONS:
        raise ValueError(f"unknown extension {name!r}; known: {', '.join(EXTENSIONS)}")
    extension = EXTENSIONS[name]
    if isinstance(extension, _ExampleExtension):
        if rotary_dim is None:
            raise ValueError(f"extension {name!r} is a registered rope_type: pass rotary_dim= (its example reads it)")
        return extension(float(factor), train_len, rotary_dim=rotary_dim)
    return extension(float(factor), train_len)


@dataclasses.dataclass(frozen=True)
class LabConfig:
    """One lab run.

    Model: dim, layers, heads. Training: train_len (bytes per training window), steps, batch_size, lr,
    warmup_fraction (of steps, linear), min_lr_fraction (cosine floor), weight_decay, grad_clip.
    Evaluation: eval_lengths (context lengths, each >= train_len), score_len (final bytes of every window that
    are scored, the same bytes at every length), eval_windows (windows per length), eval_batch_size.
    What: encodings, extensions (RoPE, applied to the trained rope model), finetune_steps (for pi and yarn at
    each target length, and plain rope beside them as their control; 0 = none), finetune_lr, task (None, "copy"
    or "passkey"), task_samples.
    Data and seeds: corpus (None = the Python standard library), max_corpus_bytes (None = all),
    val_fraction, seed, num_seeds (seeds seed .. seed + num_seeds - 1).
    hf_config: a Hugging Face config.json whose architecture (a small random model of it) replaces the rope model;
    encodings must then be ("rope",).
    """

    dim: int
    layers: int
    heads: int
    train_len: int
    steps: int
    batch_size: int
    lr: float
    eval_lengths: tuple[int, ...]
    score_len: int
    eval_windows: int
    eval_batch_size: int = 16
    warmup_fraction: float = 0.05
    min_lr_fraction: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    encodings: tuple[str, ...] = tuple(ENCODINGS)
    extensions: tuple[str, ...] = tuple(EXTENSIONS)
    finetune_steps: int = 0
    finetune_lr: float | None = None
    task: str | None = None
    task_samples: int = 32
    corpus: str | None = None
    max_corpus_bytes: int | None = None
    val_fraction: float = 0.1
    seed: int = 0
    num_seeds: int = 1
    hf_config: str | None = None

    def __post_init__(self) -> None:
        for name in (
            "dim", "layers", "heads", "train_len", "steps", "batch_size", "score_len",
            "eval_windows", "eval_batch_size", "task_samples", "num_seeds",
        ):  # fmt: skip
            object.__setattr__(self, name, _positive_int(name, getattr(self, name)))
        if self.train_len < 2:
            raise ValueError(
                f"{_named('train_len')} must be >= 2 (a window of {self.train_len} byte has no earlier byte to predict "
                "from, and the extensions and figures scale from it)"
            )
        for name in ("finetune_steps", "seed"):
            object.__setattr__(self, name, integer(_named(name), getattr(self, name), low=0))
        _positive_float("lr", self.lr)
        if self.finetune_lr is not None:
            _positive_float("finetune_lr", self.finetune_lr)
        for name, low, high in (
            ("warmup_fraction", 0.0, 1.0),
            ("min_lr_fraction", 0.0, 1.0),
            ("val_fraction", 0.0, 1.0),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value < high:
                raise ValueError(f"{name} must be a number in [{low}, {high}), got {value!r}")
        if self.val_fraction == 0:
            raise ValueError("val_fraction must be > 0: evaluation needs held-out text")
        for name in ("weight_decay", "grad_clip"):
            value = getattr(self, name)
            # Not NaN: a NaN grad_clip turned clipping off without a word (train clips where grad_clip > 0), and a
            # NaN weight decay ended in "training diverged ... lower the learning rate".
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        self._check_names(
            "encodings",
            self.encodings,
            tuple(ENCODINGS),
            allow_empty=False,
            hint=" (a family of your own: posenc lab --import the module that posenc.registers it)",
        )
        if self.dim % self.heads:
            # The example must pass the checks below too: dim=33 for 3 heads gives heads of 11 channels (RoPE: odd).
            step = 2 * self.heads if "rope" in self.encodings else self.heads
            step = math.lcm(step, 2) if "sinusoidal" in self.encodings else step
            raise ValueError(
                f"{_given('dim', self.dim)} must be a multiple of {_given('heads', self.heads)}"
                f"{' with an even head_dim (RoPE rotates pairs)' if 'rope' in self.encodings else ''}; "
                f"e.g. dim={step * max(1, round(self.dim / step))}"
            )
        # Only the encodings that work on pairs of channels need them even: RoPE per head, sinusoidal per model.
        if "rope" in self.encodings and (self.dim // self.heads) % 2:
            raise ValueError(
                f"{_given('dim', self.dim)} must be a multiple of {_given('heads', self.heads)} with an even head_dim "
                "(RoPE rotates pairs); "
                f"e.g. dim={2 * self.heads * max(1, round(self.dim / (2 * self.heads)))}"
            )
        if "sinusoidal" in self.encodings and self.dim % 2:
            raise ValueError(
                f"{_given('dim', self.dim)} must be even (the sinusoidal encoding fills channels in sin/cos pairs); "
                f"e.g. dim={2 * self.heads * max(1, round(self.dim / (2 * self.heads)))}"
            )
        self._check_names("extensions", self.extensions, tuple(EXTENSIONS), allow_empty=True)
        if self.hf_config is not None:  # before the extensions' check, whose advice would not fit here
            self._check_hf_config()
        if self.extensions and "rope" not in self.encodings:
            raise ValueError(
                f"extensions {', '.join(self.extensions)} extend the trained rope model: add rope to encodings, "
                "or pass no extensions (extensions=() here, --extensions none on the command line)"
            )
        if not self.eval_lengths or not isinstance(self.eval_lengths, tuple):
            raise ValueError(
                f"{_named('eval_lengths')} must be a non-empty tuple of lengths, got {self.eval_lengths!r}"
            )
        object.__setattr__(self, "eval_lengths", tuple(_positive_int("eval_lengths", n) for n in self.eval_lengths))
        for length in self.eval_lengths:
            if length < self.train_len:
                raise ValueError(
                    f"eval length {length} is shorter than train_len={self.train_len}: the lab measures "
                    "extrapolation, so every eval length must be >= the training length"
                )
        if list(self.eval_lengths) != sorted(set(self.eval_lengths)):
            raise ValueError(f"{_named('eval_lengths')} must be increasing without repeats, got {self.eval_lengths}")
        if self.score_len > self.train_len:
            raise ValueError(
                f"{_given('score_len', self.score_len)} must be <= {_given('train_len', self.train_len)}: every "
                "length, the training length included, scores the same final bytes of each window"
            )
        if self.task is not None and self.task not in TASKS:
            raise ValueError(f"unknown task {self.task!r}; known tasks: {', '.join(TASKS)} (or none)")
        if self.task is not None and self.task_samples > self.eval_windows:
            # Each sample's filler is the text of an eval window: fewer windows gave fewer samples than recorded.
            raise ValueError(
                f"{_named('task_samples')} is {self.task_samples} but only {_given('eval_windows', self.eval_windows)}"
                f" give its samples' text (one window each); pass --task-samples {self.eval_windows} or "
                f"--eval-windows {self.task_samples}"
            )
        if self.max_corpus_bytes is not None:
            object.__setattr__(self, "max_corpus_bytes", _positive_int("max_corpus_bytes", self.max_corpus_bytes))
        if self.seed + self.num_seeds - 1 > _MAX_SEED:
            raise ValueError(
                f"seed={self.seed} with num_seeds={self.num_seeds} runs seeds up to {self.seed + self.num_seeds - 1}, "
                f"past the largest seed torch takes ({_MAX_SEED} = 2**64 - 1)"
            )
        if self.hf_config is None:
            self._check_encodings_build()
        if self.hf_config is None and "rope" in self.encodings:
            self._check_extension_ropes()

    def _check_encodings_build(self) -> None:
        # Each encoding built for the lab's model now, as the extensions' RoPEs are below: a family whose sizes do
        # not fit and that the named checks above do not know (one added to the registry) failed at its own unit,
        # after the encodings before it had trained. fork_rng: a learned table's init must not move the caller's
        # random state.
        import torch

        from posenc.lab.model import encoding_for

        spec = self.model_spec()
        for name in self.encodings:
            try:
                with torch.random.fork_rng(devices=[]):
                    encoding_for(spec, name)
            except (ValueError, TypeError) as error:
                raise ValueError(
                    f"encoding {name} cannot be built for the lab's model (dim={self.dim}, heads={self.heads}, head_dim"
                    f"={spec.head_dim}, train_len={self.train_len}): {error}; change those sizes or leave {name} out "
                    "of encodings"
                ) from error

    def _check_extension_ropes(self) -> None:
        # Each extension's RoPE for the lab's own model, built now: a head too small for it (ntk and dynamic need
        # 4 channels) failed after every model had trained. (--hf-config models are built at the run's prepare.)
        from posenc.lab.model import encoding_for

        spec = self.model_spec()
        for name in self.extensions:
            for length in self.extension_lengths:
                parameters = extension_rope_parameters(
                    name, length / self.train_len, self.train_len, rotary_dim=spec.head_dim
                )
                try:
                    encoding_for(spec, "rope", {"rope_parameters": parameters})
                except ValueError as error:
                    raise ValueError(
                        f"extension {name} cannot extend the rope model's heads of dim / heads = {self.dim} / "
                        f"{self.heads} = {spec.head_dim} channels: {error}; give fewer heads or more dim, or leave "
                        f"{name} out of extensions"
                    ) from error

    def _check_hf_config(self) -> None:
        # Only the file is read here: transformers is imported when the model is built, not to validate.
        from posenc.lab.hf_model import read_hf_config, require_transformers

        if not isinstance(self.hf_config, str):
            raise TypeError(f"hf_config must be a path (str) to a config.json, got {self.hf_config!r}")
        read_hf_config(self.hf_config, warn=True)
        require_transformers()
        if self.encodings != ("rope",):
            raise ValueError(
                f"hf_config builds only the rope model as a Hugging Face architecture, but encodings are "
                f"{', '.join(self.encodings)}; pass --encodings rope (the default with --hf-config)"
            )

    @property
    def architecture(self) -> str:
        """The rope model's architecture: the hf_config's model_type, or "posenc" for the lab's own ByteLM."""
        if self.hf_config is None:
            return "posenc"
        from posenc.lab.hf_model import read_hf_config

        return read_hf_config(self.hf_config)["model_type"]

    @staticmethod
    def _check_names(
        field: str, names: tuple[str, ...], known: tuple[str, ...], *, allow_empty: bool, hint: str = ""
    ) -> None:
        if not isinstance(names, tuple) or not all(isinstance(n, str) for n in names):
            raise TypeError(f"{field} must be a tuple of names, got {names!r}")
        if not names and not allow_empty:
            raise ValueError(f"{_named(field)} must name at least one of: {', '.join(known)}")
        unknown = [n for n in names if n not in known]
        if unknown:
            raise ValueError(f"unknown {field}: {', '.join(unknown)}; known {field}: {', '.join(known)}{hint}")
        if len(set(names)) != len(names):
            raise ValueError(f"{field} names something twice: {', '.join(names)}")

    @property
    def seeds(self) -> tuple[int, ...]:
        """The seeds each encoding trains with: seed .. seed + num_seeds - 1."""
        return tuple(range(self.seed, self.seed + self.num_seeds))

    def model_spec(self) -> ModelSpec:
        """The model every encoding trains: this config's width, layers and heads, at its training length."""
        from posenc.lab.model import ModelSpec  # imported on use, as the config's other checks import the model

        return ModelSpec(dim=self.dim, layers=self.layers, heads=self.heads, max_positions=self.train_len)

    @property
    def extension_lengths(self) -> tuple[int, ...]:
        """The eval lengths past the training length: the targets of the RoPE extensions."""
        return tuple(n for n in self.eval_lengths if n > self.train_len)

    @property
    def resolved_finetune_lr(self) -> float:
        """The fine-tunes' learning rate: finetune_lr where given, else lr / 10."""
        # A tenth of the peak rate: the PI and YaRN fine-tunes use a small fraction of the pretraining rate.
        return self.finetune_lr if self.finetune_lr is not None else self.lr / 10

    def results_key(self) -> dict[str, Any]:
        """The fields that change a unit's numbers. The others (encodings, extensions, seed, num_seeds) only choose
        which units run (a unit's seed is in its folder's name), and fine-tunes carry their step count in their own
        name. Paths are replaced by what they hold: the corpus by nothing (config_id hashes its bytes), hf_config by
        the file's content. Two fields are in it that may leave the numbers as they are: eval_batch_size (batching
        can change float sums) and task_samples where no task runs; they stay, since a folder's config_id is fixed
        once written, and changing either is refused rather than risked."""
        selecting = {"encodings", "extensions", "num_seeds", "seed", "finetune_steps", "hf_config"}
        key = {k: v for k, v in dataclasses.asdict(self).items() if k not in selecting}
        if self.corpus is not None:
            # Where the corpus lies is not a result: config_id hashes its bytes, so the same text spelled another way
            # (relative, ~, through a link) or copied elsewhere resumes the same units. The built-in corpus keeps
            # its None, so that the runs made on it before keep their config_id.
            del key["corpus"]
        if self.hf_config is not None:
            # What the file says, not where it is: an edited config.json must not resume an older run's units.
            # Absent without one, so the runs made before hf_config existed keep their config_id.
            from posenc.lab.hf_model import read_hf_config

            key["hf_config"] = read_hf_config(self.hf_config)
        return key


# LabConfig field -> the `posenc lab` flag that sets it (posenc.cli reads this table): errors name both.
CLI_FLAGS = {
    "encodings": "--encodings",
    "extensions": "--extensions",
    "seed": "--seed",
    "num_seeds": "--seeds",
    "corpus": "--corpus",
    "train_len": "--train-len",
    "eval_lengths": "--eval-lengths",
    "score_len": "--score-len",
    "eval_windows": "--eval-windows",
    "steps": "--steps",
    "batch_size": "--batch-size",
    "lr": "--lr",
    "dim": "--dim",
    "layers": "--layers",
    "heads": "--heads",
    "finetune_steps": "--finetune-steps",
    "task": "--task",
    "task_samples": "--task-samples",
    "hf_config": "--hf-config",
}


def _named(field: str) -> str:
    """The field as errors name it: with its flag, where a flag sets it."""
    return f"{field} ({CLI_FLAGS[field]})" if field in CLI_FLAGS else field


def _given(field: str, value: Any) -> str:
    """'dim=30 (--dim)': a field's value as errors show it, with the flag that sets it."""
    return f"{field}={value}" + (f" ({CLI_FLAGS[field]})" if field in CLI_FLAGS else "")


def _positive_int(name: str, value: Any) -> int:
    """The field's value as a plain int (numpy's integers too, which JSON could not write in the run's config)."""
    return positive_int(_named(name), value)


def _positive_float(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{_named(name)} must be a finite number > 0, got {value!r}")


_FACTORS = (1, 2, 4, 8)

PRESETS: dict[str, LabConfig] = {
    # For tests and a first look: seconds, numbers are noise.
    "quick": LabConfig(
        dim=32,
        layers=1,
        heads=2,
        train_len=16,
        steps=40,
        batch_size=8,
        lr=3e-3,
        eval_lengths=tuple(16 * f for f in _FACTORS),
        score_len=8,
        eval_windows=16,
        task_samples=8,
        max_corpus_bytes=1 << 20,
    ),
    # 3-10 minutes on 2 CPU cores for everything (README), 4.1 for the run in docs/lab.md.
    "default": LabConfig(
        dim=64,
        layers=2,
        heads=4,
        train_len=64,
        steps=1200,
        batch_size=32,
        lr=3e-3,
        eval_lengths=tuple(64 * f for f in _FACTORS),
        score_len=32,
        eval_windows=256,
        finetune_steps=50,
    ),
    # Three seeds, a wider model and longer training: mean and spread over seeds.
    "full": LabConfig(
        dim=128,
        layers=4,
        heads=4,
        train_len=128,
        steps=4000,
        batch_size=32,
        lr=2e-3,
        eval_lengths=tuple(128 * f for f in _FACTORS),
        score_len=64,
        eval_windows=512,
        finetune_steps=200,
        num_seeds=3,
    ),
}


def make_config(preset: str = "default", **overrides: Any) -> LabConfig:
    """A preset with some fields replaced (None values are ignored, so unset command-line flags pass through).

    Changing ``train_len`` without ``eval_lengths`` keeps the preset's multiples (1x, 2x, 4x, 8x), and
    ``score_len`` follows at half the training length unless given. ``hf_config`` without ``encodings`` runs
    ("rope",) alone, the model that the architecture replaces.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; known presets: {', '.join(PRESETS)}")
    base = PRESETS[preset]
    changes: Mapping[str, Any] = {k: v for k, v in overrides.items() if v is not None}
    fields = {f.name for f in dataclasses.fields(LabConfig)}
    unknown = sorted(set(changes) - fields)
    if unknown:
        raise TypeError(f"unknown LabConfig field(s): {', '.join(unknown)}; fields: {', '.join(sorted(fields))}")
    changes = dict(changes)
    if "train_len" in changes:
        train_len = integer_offset(changes["train_len"])  # numpy's integers too
        if "eval_lengths" not in changes and isinstance(train_len, int):
            changes["eval_lengths"] = tuple(train_len * n // base.train_len for n in base.eval_lengths)
        if "score_len" not in changes and isinstance(train_len, int):
            changes["score_len"] = max(1, train_len // 2)
    if changes.get("hf_config") is not None and "encodings" not in changes:
        # A Hugging Face architecture replaces the rope model only, so the run is that model's alone.
        changes["encodings"] = ("rope",)
    for name in ("encodings", "extensions", "eval_lengths"):
        if name in changes and isinstance(changes[name], list):
            changes[name] = tuple(changes[name])
    return dataclasses.replace(base, **changes)
