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

from dflash_train.eval.engine import DecodeEngine, EngineConfig
from dflash_train.objective import build_blocks, dense_mask
from dflash_train.target import TargetModel
from tests.test_eval_engine import make_draft, own_greedy, target  # noqa: F401  (target is a fixture)


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
    features = model.capture_features(sequence, draft.config.target_layer_ids)
    anchors, valid = torch.tensor([[anchor]]), torch.tensor([[True]])
    blocks = build_blocks(sequence, torch.ones_like(sequence, dtype=torch.bool), anchors, valid, block,
                          draft.config.mask_token_id)
    mask = dense_mask(anchors, valid, sequence.shape[1], block)
    context_positions = torch.arange(sequence.shape[1])[None]
    hidden = draft(model.embed_tokens(blocks.input_ids), blocks.positions, features, context_positions, mask)
    return model.lm_head(hidden[:, 1:])[0]


@pytest.mark.parametrize("block_size", [4, 16])
@torch.no_grad()
def test_eval_drafts_equal_the_training_forward_at_every_cycle(target: TargetModel, block_size: int) -> None:  # noqa: F811
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
