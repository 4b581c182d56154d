"""What the drafter learns is what the eval loop asks of it: at every decode cycle, the drafts the fast
loop proposes equal the training objective's predictions for a block anchored at that cycle's first
position, with the target's features computed over the whole sequence by the training capture.

This ties the two halves end to end: feature capture (layers, offsets), the strict context mask (the
anchor's own feature hidden), block positions, the mask token, and the drafter's context cache filled
from verify passes in which only the accepted prefix becomes visible. To exercise every accepted length,
the drafter's own drafts are recorded but the target verifies oracle drafts (its own greedy continuation
with deterministic errors), so acceptance varies from 0 to B-1 drafted tokens per cycle.
"""

from __future__ import annotations

import pytest
import torch

from dflash_train.features.capture import capture_features
from dflash_train.objective import build_blocks, dense_mask
from dflash_train.runtime.engine import DecodeEngine, EngineConfig
from dflash_train.target import TargetModel
from tests.helpers.decoding import make_draft, own_greedy


class RecordingEngine(DecodeEngine):
    continuation: list[int]
    prompt_length: int

    def _propose(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        drafts, logits = super()._propose(positions)
        self.records.append((int(positions[0, 0]), drafts[0].clone(), logits[0].clone()))
        offsets = (positions[0, 1:] - self.prompt_length).clamp(0, len(self.continuation) - 1)
        oracle = torch.tensor(self.continuation)[offsets]
        wrong = (positions[0, 1:] % 5 == 2) | (positions[0, 1:] % 11 == 0)  # errors at fixed positions
        return torch.where(wrong, (oracle + 1) % 200, oracle)[None], logits


def training_predictions(model: TargetModel, draft, sequence: torch.Tensor, anchor: int):  # type: ignore[no-untyped-def]
    """Slot 1..B-1 logits of the training forward for one block at `anchor` over the full sequence."""
    block = draft.config.block_size
    features = capture_features(model, sequence, draft.config.target_layer_ids)
    anchors, valid = torch.tensor([[anchor]]), torch.tensor([[True]])
    blocks = build_blocks(sequence, torch.ones_like(sequence, dtype=torch.bool), anchors, valid, block,
                          draft.config.mask_token_id)
    mask = dense_mask(anchors, valid, sequence.shape[1], block)
    context_positions = torch.arange(sequence.shape[1])[None]
    hidden = draft(model.embed_tokens(blocks.input_ids), blocks.positions, features, context_positions, mask)
    return model.lm_head(hidden[:, 1:])[0]


@pytest.mark.parametrize("block_size", [4, 16])
@torch.no_grad()
def test_eval_drafts_equal_the_training_forward_at_every_cycle(target: TargetModel, block_size: int) -> None:
    draft = make_draft(target, block_size, seed=3)
    prompt = torch.randint(10, 200, (9,), generator=torch.Generator().manual_seed(5)).tolist()
    new = 40
    continuation = own_greedy(target, prompt, new + block_size)
    config = EngineConfig(block_size=block_size, max_new_tokens=new, max_length=128, kernels="torch")
    engine = RecordingEngine(target, draft, config)
    engine.records, engine.continuation, engine.prompt_length = [], continuation, len(prompt)
    engine.prepare()  # warm-up cycles run on idle rows: not part of the request
    engine.records = []
    outputs, _ = engine.generate([prompt])
    assert outputs[0].tokens == continuation[:new]  # lossless, as always
    accepted = [a - 1 for a in outputs[0].acceptance_lengths]
    assert min(accepted) == 0 and max(accepted) >= min(block_size - 1, 3)  # many accepted lengths
    sequence = torch.tensor([prompt + continuation])
    # Cycle k starts at the prompt length plus the tokens committed before it (the first token comes
    # from the prefill); cycles queued after the row finished change nothing and are not compared.
    starts = [len(prompt) + sum(outputs[0].acceptance_lengths[:k]) for k in range(len(accepted))]
    records = {anchor: (drafts, logits) for anchor, drafts, logits in engine.records}
    assert set(starts) <= set(records)
    for anchor in starts:
        drafts, logits = records[anchor]
        reference = training_predictions(target, draft, sequence, anchor)
        torch.testing.assert_close(logits.float(), reference.float(), atol=1e-4, rtol=1e-4)
        assert drafts.tolist() == reference.argmax(-1).tolist(), anchor


@torch.no_grad()
def per_anchor_hits(model: TargetModel, draft, sequence: torch.Tensor, prompt_length: int) -> dict[int, list[bool]]:  # type: ignore[no-untyped-def]
    """For every anchor a in the answer: which slots' top-1 prediction equals the answer token (one forward each)."""
    block, length = draft.config.block_size, sequence.shape[1]
    hits = {}
    for anchor in range(prompt_length, length - 1):
        predicted = training_predictions(model, draft, sequence, anchor).argmax(-1).tolist()
        labels = sequence[0, anchor + 1 : anchor + block].tolist()
        hits[anchor] = [p == t for p, t in zip(predicted, labels, strict=False)]
    return hits


def test_teacher_forced_accuracy_and_the_acceptance_it_implies(target: TargetModel) -> None:
    """TeacherForcedAccuracy counts exactly what a per-anchor loop counts; and at the decode cycles' starts the
    leading run of correct slots is each cycle's accepted length (greedy), for a drafter trained to be right
    often on this answer."""
    from dflash_train.eval.teacher_forced import TeacherForcedAccuracy
    from dflash_train.objective import DFlashObjective

    block = 4
    draft = make_draft(target, block, seed=3)
    prompt = torch.randint(10, 200, (9,), generator=torch.Generator().manual_seed(5)).tolist()
    answer = own_greedy(target, prompt, 40)
    sequence = torch.tensor([prompt + answer])
    loss_mask = torch.zeros_like(sequence, dtype=torch.bool)
    loss_mask[:, len(prompt):] = True
    features = capture_features(target, sequence, draft.config.target_layer_ids)
    objective = DFlashObjective(block_size=block, mask_token_id=draft.config.mask_token_id, num_anchors=16,
                                loss_decay_gamma=4.0)
    optimizer = torch.optim.AdamW(draft.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    draft.train()
    for _ in range(60):  # partly fit this one answer: accuracies strictly between 0 and 1
        out = objective(draft, target.embed_tokens, target.lm_head.weight, sequence, loss_mask, features, generator)
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
    draft.eval()

    accuracy = TeacherForcedAccuracy(target, draft, block)
    accuracy.add(prompt, answer)
    hits = per_anchor_hits(target, draft, sequence, len(prompt))
    for slot in range(1, block):
        rows = [h[slot - 1] for h in hits.values() if len(h) >= slot]
        assert accuracy.count[slot] == len(rows) and accuracy.correct[slot] == sum(rows), slot
    result = accuracy.result()["teacher_forced_slot_accuracy"]
    assert 0.0 < result[0] < 1.0, result
    split = TeacherForcedAccuracy(target, draft, block, anchors_per_pass=7)  # several passes: the same counts
    split.add(prompt, answer)
    assert torch.equal(split.correct, accuracy.correct) and torch.equal(split.count, accuracy.count)

    config = EngineConfig(block_size=block, max_new_tokens=30, max_length=128, kernels="torch")
    output = DecodeEngine(target, draft, config).generate([prompt])[0][0]
    assert output.tokens == answer[:30]
    start = len(prompt)
    for accepted in output.acceptance_lengths[:-1]:  # the last cycle may be cut by max_new_tokens
        leading = next((i for i, hit in enumerate(hits[start]) if not hit), len(hits[start]))
        assert accepted == leading + 1, start
        start += accepted
