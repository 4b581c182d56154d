"""Push an exported drafter directory to the Hugging Face Hub in one commit.

The directory must pass `check_checkpoint` first: a broken drafter on the Hub fails silently in
every runtime. The token comes from `HF_TOKEN` or `hf auth login`; `dry_run` only lists the files.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import HfApi, get_token

from dflash_train.checkpoint.check import check_checkpoint
from dflash_train.checkpoint.hub import describe_hub_error

_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}")


@dataclass(frozen=True)
class PushPlan:
    repo_id: str
    files: list[tuple[str, int]]  # (path inside the repo, bytes)

    @property
    def total_bytes(self) -> int:
        return sum(size for _, size in self.files)


def plan_push(directory: str | Path, repo_id: str) -> PushPlan:
    """Validate the repo id and the directory; list what would be uploaded."""
    directory = Path(directory)
    validate_repo_id(repo_id)
    problems = check_checkpoint(directory)
    if problems:
        raise ValueError(f"{directory} fails `dflash-train check` ({len(problems)} problems, first: {problems[0]}); "
                         f"fix it or re-export before pushing")
    files = sorted((str(p.relative_to(directory)), p.stat().st_size) for p in directory.rglob("*")
                   if p.is_file() and not any(part.startswith(".") for part in p.relative_to(directory).parts))
    return PushPlan(repo_id, files)


def validate_repo_id(repo_id: str) -> None:
    if not _REPO_ID.fullmatch(repo_id) or ".." in repo_id or repo_id.endswith((".", "-")):
        raise ValueError(f"invalid repo id {repo_id!r}: use ORG/NAME (letters, digits, '-', '_', '.')")


def push_checkpoint(
    directory: str | Path,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    commit_message: str | None = None,
    token: str | None = None,
) -> str:
    """Create the repo (and branch) if needed and upload `directory` in one commit; returns the commit URL."""
    plan = plan_push(directory, repo_id)
    token = token or get_token()
    if not token:
        raise ValueError("no Hugging Face token: set HF_TOKEN or run `hf auth login` first")
    api = HfApi(token=token)
    message = commit_message or f"Upload DFlash drafter ({len(plan.files)} files)"
    try:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        if revision:
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        info = api.upload_folder(repo_id=repo_id, folder_path=str(directory), revision=revision,
                                 commit_message=message, ignore_patterns=[".*", "**/.*"])
    except Exception as error:  # every Hub failure becomes one line saying what to do
        raise ValueError(f"push to {repo_id} failed: {describe_hub_error(error)}") from error
    return str(getattr(info, "commit_url", info))
