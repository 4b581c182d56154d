"""The one typed configuration of a training run: YAML recipe + dotted `key=value` overrides.

    cfg = load_config("recipes/smollm2-135m-dflash-b16.yaml", ["training.learning_rate=3e-4", "data.pack_tokens=8192"])

Every field has a type; unknown keys and badly typed values are one-line `ValueError`s.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml


@dataclass
class ModelConfig:
    target: str = "smollm2-135m-instruct"  # alias, Hub id, local directory or .gguf
    target_dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    num_draft_layers: int = 5
    block_size: int = 16
    target_layer_ids: list[int] | None = None  # None: the default spread (docs/design.md §2)
    mask_token_id: int | str | None = None  # None: the resolution order of target/mask_token.py
    init_from: str | None = None  # start from an existing drafter (ours or z-lab layout)
    freeze: list[str] = field(default_factory=list)  # parameter-name prefixes kept frozen, e.g. ["layers."]
    reinit: list[str] = field(default_factory=list)  # with init_from: re-learn these, e.g. ["fc.", "hidden_norm."]
    # A new drafter's layers start as copies of target layers (attention, MLP, layer norms): by default the
    # target's last num_draft_layers, or init_layer_ids (one per drafter layer).
    init_layers_from_target: bool = False
    init_layer_ids: list[int] | None = None


@dataclass
class DataConfig:
    prepared: str | None = None  # `dflash-train prepare` output (online features)
    features: str | None = None  # `dflash-train extract` output (offline features)
    max_length: int = 3072
    validation_fraction: float = 0.02
    validation_max_samples: int = 256
    min_supervised_tokens: int | None = None  # None: 2 * block_size
    # Batches are right-padded to a multiple of this. None: to max_length where attention is compiled flex
    # (CUDA), so it compiles for one shape only, else to the longest sample. Never changes the loss.
    pad_to_multiple: int | None = None
    # Packed training: each row holds whole chats, exactly this many tokens (one static shape), and each
    # chat attends only to itself. None: one chat per row, right-padded.
    pack_tokens: int | None = None
    # How often an epoch draws each data source's training chats, by the `source` that prepare writes; a
    # source not named draws 1. 2 draws every chat twice, 0.5 a seeded half, chosen anew each epoch, 0 none:
    # steps shift toward what the drafter must learn most, at the same minutes (docs/training.md, 'Source
    # weights'). Validation keeps every source as it is.
    source_weights: dict[str, float] | None = None


@dataclass
class TrainingConfig:
    output_dir: str = "outputs/run"
    seed: int = 0
    deterministic: bool = False
    epochs: float = 6.0
    max_steps: int | None = None  # optimizer steps; overrides epochs when set
    batch_size: int = 1  # sequences per process per micro-step
    gradient_accumulation_steps: int = 1
    learning_rate: float = 6e-4
    weight_decay: float = 0.0
    warmup_ratio: float = 0.04
    min_lr_ratio: float = 0.0
    max_grad_norm: float = 1.0
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    # muon: Muon (momentum 0.95, Nesterov, 5 Newton-Schulz steps) for the weight matrices of fc and the
    # layers at muon_learning_rate, AdamW at learning_rate for the rest; one schedule multiplies both.
    optimizer: Literal["adamw", "muon"] = "adamw"
    muon_learning_rate: float = 0.02
    num_anchors: int = 512
    anchors_per_row: int | None = None  # packed rows' anchor capacity; None: from the data's anchors per token
    anchors: Literal["random", "partition"] = "random"  # partition: fixed block grid (ablation)
    soft_targets: bool = False  # distil the target's next-token distribution instead of its token (online)
    # The per-row loss: ce, the label's cross-entropy (the paper's); kl or tv, (1 - distill_weight) * that CE +
    # distill_weight * KL(target || drafter) or total variation (1 - the acceptance probability), both models'
    # distributions at loss_temperature, the sampling temperature to serve at (objective/distill.py). Online.
    loss: Literal["ce", "kl", "tv"] = "ce"
    loss_temperature: float = 1.0
    distill_weight: float = 1.0
    loss_decay_gamma: float | None = None  # None: paper default for the block size
    # decay: exp(-(k-1)/gamma) per slot; dpace: D-PACE weights from the drafter's own per-slot CE (arXiv
    # 2605.18810), smoothed by dpace_alpha; loss_decay_gamma is then unused.
    position_weighting: Literal["decay", "dpace"] = "decay"
    dpace_alpha: float = 0.5
    mixed_precision: Literal["bf16", "fp16", "no"] = "bf16"
    attention: Literal["auto", "dense", "flex"] = "auto"
    # The drafter's flex mask in tiles of 128 (flex attention's default) or 64 tokens: a tile that holds any
    # visible pair is computed whole, so smaller tiles compute fewer masked-out scores, on smaller kernels.
    flex_tile: Literal[64, 128] = 128
    # The target's attention over packed rows (online features): flex skips the tiles no chat fills, where SDPA
    # computes a dense mask's every score (features/packed_attention.py); varlen attends each chat alone
    # with PyTorch's FlashAttention varlen kernel, nothing compiled (features/varlen.py); auto: flex on CUDA.
    # A failure runs the rest of the run on SDPA. Unpacked rows keep the target's own attention.
    target_attention: Literal["auto", "sdpa", "flex", "varlen"] = "auto"
    compile: bool = False
    # Also torch.compile the frozen target's decoder layers (their forward, one graph every layer reuses) for
    # online features: its eager forward launches ~50 small kernels a layer, which a slow host pays per step.
    compile_target: bool = False
    # Replay the target's pass over packed rows from CUDA graphs (features/graphed.py): one launch instead of
    # the host launching every layer's kernels, which left the GPU idle for much of a SmolLM2 step
    # (docs/benchmarks.md, 'Where the gaps come from'). Needs
    # online features, packed rows, target_attention=varlen and CUDA (elsewhere a note, and no graphs).
    target_cuda_graphs: bool = False
    # Replay the drafter's forward, loss and backward over packed rows from CUDA graphs too
    # (training/step_graph.py): the host then launches a step's few graphs and the optimizer instead of every
    # kernel of the drafter's side. Needs packed rows on CUDA, one process or DDP (its gradients then averaged by
    # hand, training/grad_sync.py), bf16 or fp32 (elsewhere a note, and no graphs).
    step_cuda_graphs: bool = False
    log_every: int = 10
    eval_every: int = 500
    save_every: int = 1000
    keep_last: int = 3
    resume: str = "auto"  # auto | none | path to a checkpoint directory
    time_budget_minutes: float | None = None  # fit the whole run (schedule included) into this wall time
    # True: the budget's clock starts after the first steps (compilation), for ablations at equal minutes
    time_budget_excludes_warmup: bool = False
    stop_after_minutes: float | None = None  # save and stop after this long; a re-launch resumes

    @property
    def reads_target_distribution(self) -> bool:
        """Whether the loss reads the target's final states (its next-token distribution): soft targets, or a
        distillation of nonzero weight. The target then runs its whole body every step."""
        return self.soft_targets or (self.loss != "ce" and self.distill_weight > 0)


@dataclass
class TrackingConfig:
    report_to: Literal["wandb", "none"] = "wandb"
    project: str = "dflash-train"
    run_name: str | None = None
    wandb_mode: Literal["auto", "online", "offline"] = "auto"  # auto: online with a key, else offline


@dataclass
class ExportConfig:
    on_finish: bool = False
    out_dir: str | None = None  # default: <output_dir>/export


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    export: ExportConfig = field(default_factory=ExportConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def validate(self) -> TrainConfig:
        if (self.data.prepared is None) == (self.data.features is None):
            raise ValueError("set exactly one of data.prepared (online features) or data.features (offline)")
        positive = {
            "model.block_size": self.model.block_size, "model.num_draft_layers": self.model.num_draft_layers,
            "training.batch_size": self.training.batch_size, "training.num_anchors": self.training.num_anchors,
            "training.gradient_accumulation_steps": self.training.gradient_accumulation_steps,
            "data.max_length": self.data.max_length, "training.keep_last": self.training.keep_last,
            "data.pad_to_multiple": 1 if self.data.pad_to_multiple is None else self.data.pad_to_multiple,
            "training.log_every": self.training.log_every, "training.save_every": self.training.save_every,
        }
        for name, value in positive.items():
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self._validate_packing()
        self._validate_layer_init()
        if not 0 <= self.data.validation_fraction < 1:
            raise ValueError(f"data.validation_fraction must be in [0, 1), got {self.data.validation_fraction}")
        for source, weight in (self.data.source_weights or {}).items():
            if not 0 <= weight < math.inf:
                raise ValueError(f"data.source_weights.{source} must be a number >= 0 (0: none of its chats), "
                                 f"got {weight}")
        self._validate_loss()
        # 0 or less would not be refused later: max_steps=0 falls back to the epochs, a negative count saves an
        # untrained checkpoint as a finished run, and a gamma of 0 turns the loss into NaN.
        if self.training.max_steps is not None and self.training.max_steps < 1:
            raise ValueError(f"training.max_steps must be >= 1, got {self.training.max_steps} (null: train "
                             "training.epochs)")
        if self.training.max_steps is None and not self.training.epochs > 0:
            raise ValueError(f"training.epochs must be > 0, got {self.training.epochs}")
        gamma = self.training.loss_decay_gamma
        if gamma is not None and not gamma > 0:
            raise ValueError(f"training.loss_decay_gamma must be > 0, got {gamma} (.inf: every block position "
                             "weighs the same; null: the default for the block size)")
        if self.training.position_weighting == "decay":
            from dflash_train.objective.loss import decay_gamma  # torch; this module stays light to import

            decay_gamma(self.model.block_size, gamma)  # no default for this block size: said now, not after loading
        for name in ("time_budget_minutes", "stop_after_minutes"):
            value = getattr(self.training, name)
            if value is not None and value <= 0:
                raise ValueError(f"training.{name} must be > 0 minutes, got {value}")
        self._validate_optimizer()
        return self

    def _validate_loss(self) -> None:
        t = self.training
        if t.loss == "ce":
            for name, default in (("loss_temperature", 1.0), ("distill_weight", 1.0)):
                if getattr(t, name) != default:
                    raise ValueError(f"training.{name} applies to training.loss kl or tv only (the loss is ce): "
                                     f"set training.loss or unset training.{name}")
        else:
            if t.soft_targets:
                raise ValueError(f"training.soft_targets and training.loss={t.loss} both set what the drafter learns "
                                 "from the target's distribution: unset soft_targets (loss kl at "
                                 "loss_temperature 1 has its gradient)")
            if not 0 < t.loss_temperature < float("inf"):
                raise ValueError(f"training.loss_temperature must be a finite number > 0, got {t.loss_temperature} "
                                 "(0 is greedy decoding, whose loss is training.loss=ce)")
            if not 0 <= t.distill_weight <= 1:
                raise ValueError(f"training.distill_weight must be in [0, 1], got {t.distill_weight} (0: the label's "
                                 "cross-entropy alone)")
        if t.reads_target_distribution and self.data.features is not None:
            what = "training.soft_targets" if t.soft_targets else f"training.loss={t.loss}"
            raise ValueError(f"{what} needs the target's final states, computed online: use data.prepared instead "
                             "of data.features")

    def _validate_optimizer(self) -> None:
        t = self.training
        for name in ("learning_rate", "muon_learning_rate"):
            if getattr(t, name) <= 0:
                raise ValueError(f"training.{name} must be > 0, got {getattr(t, name)}")
        if not 0 <= t.dpace_alpha <= 1:
            raise ValueError(f"training.dpace_alpha must be in [0, 1], got {t.dpace_alpha}")
        # Outside [0, 1] the schedule still runs: a min_lr_ratio of 5 ends at 5x the peak learning rate.
        for name in ("warmup_ratio", "min_lr_ratio"):
            if not 0 <= getattr(t, name) <= 1:
                raise ValueError(f"training.{name} must be in [0, 1], got {getattr(t, name)}")
        if len(t.adam_betas) != 2 or not all(0 <= beta < 1 for beta in t.adam_betas):
            raise ValueError(f"training.adam_betas must be two numbers in [0, 1), got {t.adam_betas}")

    def _validate_layer_init(self) -> None:
        m = self.model
        if m.init_layers_from_target and m.init_from:
            raise ValueError("model.init_layers_from_target and model.init_from both set the drafter's layers: "
                             "unset one of them")
        if m.init_layer_ids is None:
            return
        if not m.init_layers_from_target:
            raise ValueError("model.init_layer_ids applies only with model.init_layers_from_target: true")
        if len(m.init_layer_ids) != m.num_draft_layers:
            raise ValueError(f"model.init_layer_ids has {len(m.init_layer_ids)} ids for "
                             f"model.num_draft_layers={m.num_draft_layers}: give one target layer per drafter layer")

    def _validate_packing(self) -> None:
        pack, per_row = self.data.pack_tokens, self.training.anchors_per_row
        if pack is None:
            if per_row is not None:
                raise ValueError("training.anchors_per_row applies to packed rows only: set data.pack_tokens too")
            return
        if pack < self.data.max_length:
            raise ValueError(f"data.pack_tokens={pack} must be >= data.max_length={self.data.max_length}: a "
                             "packed row holds whole chats")
        if self.data.pad_to_multiple is not None:
            raise ValueError("data.pad_to_multiple does not apply with data.pack_tokens (rows are always "
                             "pack_tokens long): unset one of them")
        if per_row is not None and per_row < 1:
            raise ValueError(f"training.anchors_per_row must be >= 1, got {per_row}")


def load_config(path: str | Path | None, overrides: list[str] = ()) -> TrainConfig:
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"config file {path} not found; pass a recipe, e.g. recipes/smollm2-135m-dflash-b16.yaml")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as error:  # a ValueError, but one that names neither the file nor a fix
            raise ValueError(f"{path} is not UTF-8 text ({error}); fix or rewrite the recipe") from None
        raw = _parse_yaml(text, f"{path},") or {}
        if not isinstance(raw, dict):
            raise ValueError(f"{path} must hold a mapping of sections (model, data, training, ...)")
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"override {item!r} must look like section.key=value")
        _set_dotted(raw, key.strip(), _parse_yaml(value, f"override {item!r}: YAML value {value!r},"))
    return _build(TrainConfig, raw, "").validate()


def _parse_yaml(text: str, where: str) -> Any:
    """`yaml.safe_load`, with a syntax error as one line: where, line, column and what is wrong."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ValueError(f"{where} {_yaml_problem(error)}; fix the YAML syntax (quote a value with : or # in it)") from None


def _yaml_problem(error: yaml.YAMLError) -> str:
    # PyYAML's own message spans several lines and quotes the source; the marks hold what is needed.
    if not isinstance(error, yaml.MarkedYAMLError) or error.problem_mark is None:
        return " ".join(str(error).split())
    mark = error.problem_mark
    text = f"line {mark.line + 1}, column {mark.column + 1}: {error.problem or 'invalid YAML'}"
    context = error.context_mark
    if error.context and context is not None and (context.line, context.column) != (mark.line, mark.column):
        text += f" ({error.context} that starts at line {context.line + 1}, column {context.column + 1})"
    return " ".join(text.split())


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for part in parents:
        tree = tree.setdefault(part, {})
        if not isinstance(tree, dict):
            raise ValueError(f"override {dotted}: {part} is not a section")
    tree[leaf] = value


def _build(cls: type, values: Any, where: str) -> Any:
    if not isinstance(values, dict):
        raise ValueError(f"{where or 'config'} must be a mapping, got {values!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in values.items():
        name = f"{where}.{key}" if where else key
        if key not in fields:
            # YAML keys need not be strings (`3:` is an int), and difflib compares strings only.
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f" (did you mean {'.'.join(filter(None, [where, close[0]]))}?)" if close else ""
            raise ValueError(f"unknown config key {name}{hint}")
        hint_type = hints[key]
        if dataclasses.is_dataclass(hint_type):
            kwargs[key] = _build(hint_type, value, name)
        else:
            kwargs[key] = _coerce(value, hint_type, name)
    return cls(**kwargs)


def _coerce(value: Any, hint: Any, name: str) -> Any:
    """Check `value` against a field's type; ints are accepted where floats are expected."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        problems = []
        for option in args:
            try:
                return _coerce(value, option, name)
            except ValueError as problem:
                problems.append((option, problem))
        real = [problem for option, problem in problems if option is not type(None)]
        if value is not None and len(real) == 1:  # an optional field: what is wrong with the value itself
            raise real[0]
        raise ValueError(f"{name}={value!r} does not fit {hint}")
    if hint is type(None):
        if value is None:
            return None
        raise ValueError(f"{name} must be null")
    if origin is Literal:
        if value is False and "no" in args:  # YAML 1.1 reads a bare `no` as false
            value = "no"
        if value not in args:
            raise ValueError(f"{name}={value!r} is not one of {list(args)}")
        return value
    if origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{name} must be a mapping, got {value!r}")
        return {_coerce(k, args[0], name): _coerce(v, args[1], f"{name}.{k}") for k, v in value.items()}
    if origin is list:
        if not isinstance(value, list):
            raise ValueError(f"{name} must be a list, got {value!r}")
        return [_coerce(v, args[0], f"{name}[{i}]") for i, v in enumerate(value)]
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is float and isinstance(value, str):  # YAML 1.1 reads "6e-4" as a string
        try:
            return float(value)
        except ValueError:
            pass
    if isinstance(value, hint) and not (hint is int and isinstance(value, bool)):
        return value
    raise ValueError(f"{name}={value!r} must be of type {getattr(hint, '__name__', hint)}")
