"""The packed row layout: the tensors a micro-batch of packed rows is made of, and where each chat sits in them.

A packed row holds whole chats one after another, exactly `pack_tokens` tokens, right-padded. Each chat's
position ids start at 0 (so the target's attention, and the varlen attention that cuts chats out of rows by
them, keep every chat to itself), and the padding at a row's end is numbered as a chat of its own. Which chats
go into which row is the training plan's choice (`training/packing.py`).
"""

from __future__ import annotations

import torch


def collate_packed(rows: list[list[dict[str, torch.Tensor]]], pack_tokens: int, num_rows: int) -> dict[str, torch.Tensor]:
    """`num_rows` rows of exactly `pack_tokens` tokens (missing rows are all padding).

    position_ids restart at 0 with each chat and with the padding at a row's end (Hugging Face then keeps
    every chat's attention inside the chat); sequence_ids number the micro-batch's chats in order (-1:
    padding); `chats` [C, 3] holds each chat's (row, start, length).
    """
    input_ids = torch.zeros(num_rows, pack_tokens, dtype=torch.long)
    loss_mask = torch.zeros(num_rows, pack_tokens, dtype=torch.bool)
    position_ids = torch.arange(pack_tokens).repeat(num_rows, 1)
    sequence_ids = torch.full((num_rows, pack_tokens), -1, dtype=torch.long)
    features = _empty_features(rows, num_rows, pack_tokens)
    chats = []
    for r, row in enumerate(rows):
        used = sum(sample["input_ids"].shape[0] for sample in row)
        if used > pack_tokens:
            raise ValueError(f"row {r} holds {used} tokens, more than pack_tokens={pack_tokens}")
        start = 0
        for sample in row:
            n = sample["input_ids"].shape[0]
            span = slice(start, start + n)
            input_ids[r, span], loss_mask[r, span] = sample["input_ids"], sample["loss_mask"]
            position_ids[r, span] = torch.arange(n)
            sequence_ids[r, span] = len(chats)
            if features is not None:
                features[r, span] = sample["features"]
            chats.append((r, start, n))
            start += n
        position_ids[r, start:] = torch.arange(pack_tokens - start)
    out = {"input_ids": input_ids, "loss_mask": loss_mask, "position_ids": position_ids,
           "sequence_ids": sequence_ids, "chats": torch.tensor(chats, dtype=torch.long).view(-1, 3)}
    if features is not None:
        out["features"] = features
    return out


def _empty_features(rows: list[list[dict[str, torch.Tensor]]], num_rows: int, pack_tokens: int) -> torch.Tensor | None:
    first = next((sample for row in rows for sample in row), None)
    if first is None or "features" not in first:
        return None
    return torch.zeros(num_rows, pack_tokens, first["features"].shape[-1], dtype=first["features"].dtype)


def chat_layout(cpu_batch: dict[str, torch.Tensor]) -> list[tuple[int, int, int]]:
    """(row, start, length) of every chat of a packed or unpacked (one chat per row) CPU batch."""
    if "chats" in cpu_batch:
        return [tuple(chat) for chat in cpu_batch["chats"].tolist()]
    return [(row, 0, n) for row, n in enumerate(cpu_batch["attention_mask"].sum(1).tolist())]
