"""The model card (README.md) of an export, rendered from `export/model_card.md`.

`card_info` keys (all optional): `base_model` (the target's Hub id), `license`, `title`, `repo_id`
(where the export will be pushed; used in the serving commands), `training_data` (markdown), and
`eval`: markdown, or rows (dicts of scalars, e.g. from `dflash-train eval` JSON reports) rendered as
a table. A source config.json may carry `dflash_train.training_data` / `dflash_train.base_model`,
which are used when `card_info` does not give them.
"""

from __future__ import annotations

import json
from pathlib import Path
from string import Template
from typing import Any

from dflash_train.checkpoint.hub import looks_like_hub_id
from dflash_train.json_files import json_type
from dflash_train.models import DFlashConfig

# Targets known by alias here whose Hub id the card should name.
ALIAS_HUB_IDS = {"smollm2-135m-instruct": "HuggingFaceTB/SmolLM2-135M-Instruct"}
NO_TRAINING_DATA = "Not recorded with this checkpoint."
NO_EVAL = "No evaluation report was given at export time; run `dflash-train eval` and re-export with it."


def render_card(
    template: str, config: DFlashConfig, num_parameters: int, card_info: dict[str, Any] | None,
    source_config: dict[str, Any] | None = None,
) -> str:
    info = {**_provenance(source_config), **{k: v for k, v in (card_info or {}).items() if v is not None}}
    base = info.get("base_model")
    base = ALIAS_HUB_IDS.get(base, base) if isinstance(base, str) else None
    values = {
        "base_model": base or "",
        "base_model_display": base or "TARGET_MODEL",
        "license": info.get("license", "apache-2.0"),
        "title": info.get("title") or (f"{base.split('/')[-1]} DFlash drafter (b{config.block_size})" if base
                                       else f"DFlash drafter (b{config.block_size})"),
        "model_ref": info.get("repo_id") or "PATH_TO_THIS_DIRECTORY",
        "num_layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size,
        "num_heads": config.num_attention_heads,
        "num_kv_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "intermediate_size": config.intermediate_size,
        "num_parameters": f"{num_parameters / 1e6:.1f}M",
        "block_size": config.block_size,
        "num_speculative_tokens": max(config.block_size - 1, 1),
        "target_layer_ids": config.target_layer_ids,
        "num_target_layers": config.num_target_layers,
        "mask_token_id": config.mask_token_id,
        "rope_theta": f"{config.rope_theta:g}",
        "training_data": info.get("training_data") or NO_TRAINING_DATA,
        "evaluation": eval_markdown(info.get("eval")),
    }
    text = Template(template).substitute(values)
    # Without a known target the Hub would reject an empty base_model, so the line goes.
    return text if base else text.replace("base_model: \n", "")


def _provenance(source_config: dict[str, Any] | None) -> dict[str, Any]:
    """What a training checkpoint recorded about itself (`dflash_train` in its config.json)."""
    meta = (source_config or {}).get("dflash_train")
    if not isinstance(meta, dict):
        return {}
    info = {k: meta[k] for k in ("training_data", "base_model") if k in meta}
    if "base_model" not in info and names_hub_model(meta.get("target")):
        info["base_model"] = meta["target"]
    if "training_data" not in info and isinstance(meta.get("step"), int):
        info["training_data"] = f"Not recorded with this checkpoint (trained for {meta['step']} optimizer steps)."
    return info


def names_hub_model(target: Any) -> bool:
    """Whether `target` names a model on the Hub (an alias with a known id, or an id that is no local path)."""
    if not isinstance(target, str):
        return False
    return target in ALIAS_HUB_IDS or (looks_like_hub_id(target) and not Path(target).exists())


def eval_markdown(evaluation: Any) -> str:
    """Markdown as is, or rows of scalars as a table (columns in first-seen order)."""
    if not evaluation:
        return NO_EVAL
    if isinstance(evaluation, str):
        return evaluation
    rows = [evaluation] if isinstance(evaluation, dict) else list(evaluation)
    columns: list[str] = []
    for row in rows:
        columns += [k for k, v in row.items() if k not in columns and isinstance(v, (str, int, float, bool))]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return "" if value is None else str(value)


def load_eval_reports(paths: list[str | Path]) -> list[dict[str, Any]]:
    """Rows from JSON reports: `dflash-train eval` reports, lists of rows, dicts with `rows`/`results`,
    or one flat dict each."""
    rows: list[dict[str, Any]] = []
    for path in paths:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as error:
            raise ValueError(f"cannot read eval report {path} ({error}); pass a JSON file") from error
        if isinstance(data, dict) and isinstance(data.get("datasets"), dict):
            data = rows_from_eval_report(data)
        elif isinstance(data, dict):
            data = data.get("rows") or data.get("results") or [data]
        if not isinstance(data, list) or not all(isinstance(row, dict) for row in data):
            raise ValueError(f"eval report {path} must hold a list of objects, or an object with 'rows'")
        rows += data
    return rows


def rows_from_eval_report(report: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per dataset of a `dflash-train eval` report, with the columns a model card needs."""
    settings, environment = report.get("settings") or {}, report.get("environment") or {}
    if not isinstance(settings, dict) or not isinstance(environment, dict):
        raise ValueError("an eval report's 'settings' and 'environment' must be objects; pass a report "
                         "`dflash-train eval` wrote")
    rows = []
    for name, result in report["datasets"].items():
        if not isinstance(result, dict):
            raise ValueError(f"an eval report's dataset {name!r} holds a JSON {json_type(result)}, not an object; "
                             "pass a report `dflash-train eval` wrote")
        rows.append({
            "dataset": name,
            "requests": result.get("requests"),
            "τ (acceptance length)": result.get("acceptance_length"),
            "τ cycle-weighted": result.get("acceptance_length_cycle_weighted"),
            "speedup": result.get("speedup"),
            "lossless": result.get("lossless"),
            "temperature": settings.get("temperature"),
            "max new tokens": settings.get("max_new_tokens"),
            "device": environment.get("device"),
            "dtype": settings.get("dtype"),
        })
    return rows
