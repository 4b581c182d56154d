"""The drafter: parameter names, train/inference parity, cache rollback, and that it learns."""

from __future__ import annotations

import torch

from dflash_train.objective import DFlashObjective, build_blocks, dense_mask
from tests.helpers.tiny_drafts import frozen_embed_and_head, tiny_config, tiny_draft


def test_parameter_names_match_published_checkpoints() -> None:
    draft = tiny_draft()
    names = set(draft.state_dict())
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(2):
        p = f"layers.{i}."
        expected |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
        expected |= {f"{p}self_attn.{n}_proj.weight" for n in "qkvo"}
        expected |= {f"{p}self_attn.{n}_norm.weight" for n in "qk"}
        expected |= {f"{p}mlp.{n}_proj.weight" for n in ("gate", "up", "down")}
    assert names == expected
    sd = draft.state_dict()
    assert sd["fc.weight"].shape == (32, 2 * 32)
    assert sd["layers.0.self_attn.k_norm.weight"].shape == (8,)


def test_config_defaults_to_spec_layer_ids() -> None:
    assert tiny_config(num_target_layers=36, num_hidden_layers=5).target_layer_ids == [1, 9, 17, 25, 33]
    assert tiny_config(num_target_layers=32, num_hidden_layers=5).target_layer_ids == [1, 8, 15, 22, 29]


def _training_hidden(draft, embed, input_ids, features, anchors, block):  # type: ignore[no-untyped-def]
    seq_len = input_ids.shape[1]
    valid = torch.ones_like(anchors, dtype=torch.bool)
    loss_mask = torch.ones_like(input_ids, dtype=torch.bool)
    blocks = build_blocks(input_ids, loss_mask, anchors, valid, block, draft.config.mask_token_id)
    mask = dense_mask(anchors, valid, seq_len, block)
    hidden = draft(embed(blocks.input_ids), blocks.positions, features, torch.arange(seq_len)[None], mask)
    return blocks, hidden


def test_training_forward_equals_cached_inference() -> None:
    """Every block of a multi-anchor training forward equals the inference path for that anchor."""
    draft = tiny_draft(block_size=4).eval()
    config = draft.config
    embed, head = frozen_embed_and_head(config)
    gen = torch.Generator().manual_seed(7)
    seq_len = 29
    input_ids = torch.randint(0, 50, (1, seq_len), generator=gen)
    features = torch.randn(1, seq_len, 2 * config.hidden_size, generator=gen)
    anchors = torch.tensor([[0, 3, 11, 12, 27]])  # includes a=0 (no context) and a block past the end
    blocks, hidden = _training_hidden(draft, embed, input_ids, features, anchors, 4)
    for j, a in enumerate(anchors[0].tolist()):
        cache = draft.new_cache(1, 64)
        # commit the context in two uneven pieces: K/V are computed once per token and appended
        cut = a // 2
        draft.extend_context(cache, features[:, :cut], torch.arange(cut)[None])
        draft.extend_context(cache, features[:, cut:a], torch.arange(cut, a)[None])
        assert cache.length == a
        rows = slice(j * 4, (j + 1) * 4)
        got = draft.draft_block(cache, embed(blocks.input_ids[:, rows]), blocks.positions[:, rows])
        torch.testing.assert_close(got, hidden[:, rows], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got @ head.T, hidden[:, rows] @ head.T, atol=1e-4, rtol=1e-4)


def test_cache_rollback_gives_identical_drafts() -> None:
    draft = tiny_draft().eval()
    embed, _ = frozen_embed_and_head(draft.config)
    gen = torch.Generator().manual_seed(0)
    features = torch.randn(1, 20, 64, generator=gen)
    block = embed(torch.tensor([[5, 60, 60, 60]]))
    cache = draft.new_cache(1, 32)
    draft.extend_context(cache, features[:, :9], torch.arange(9)[None])
    first = draft.draft_block(cache, block, torch.arange(9, 13)[None])
    draft.extend_context(cache, features[:, 9:17], torch.arange(9, 17)[None])
    assert not torch.allclose(first, draft.draft_block(cache, block, torch.arange(9, 13)[None]))
    cache.crop(9)
    torch.testing.assert_close(draft.draft_block(cache, block, torch.arange(9, 13)[None]), first)


def _train(draft, objective, embed, head, batch_fn, steps, lr):  # type: ignore[no-untyped-def]
    opt = torch.optim.AdamW(draft.parameters(), lr=lr, weight_decay=0.0)
    for step in range(steps):
        input_ids, loss_mask, features = batch_fn(step)
        out = objective(draft, embed, head, input_ids, loss_mask, features)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    return out


def test_tiny_drafter_overfits_a_tiny_batch() -> None:
    torch.manual_seed(0)
    draft = tiny_draft(block_size=4)
    embed, head = frozen_embed_and_head(draft.config)
    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, 50, (2, 24), generator=gen)
    features = torch.randn(2, 24, 64, generator=gen)
    loss_mask = torch.ones(2, 24, dtype=torch.bool)
    objective = DFlashObjective(block_size=4, mask_token_id=60, num_anchors=24, loss_decay_gamma=4.0)
    out = _train(draft, objective, embed, head, lambda _: (input_ids, loss_mask, features), 150, 1e-2)
    assert out.slot_accuracy.min() > 0.97, out.slot_accuracy
    assert float(out.expected_acceptance_length) > 3.9


def test_drafter_learns_to_read_the_injected_context() -> None:
    """Generalisation through KV injection alone: the feature at position p encodes x_{p+1..p+3}.

    A block at anchor a sees features < a; the newest, at a-1, holds x_a, x_{a+1}, x_{a+2}: slot 1
    and slot 2's labels. Slot 3's x_{a+3} is only in the feature at a, which the strict mask hides,
    so it must stay at chance. Fresh random sequences every step: memorisation cannot solve it.
    """
    torch.manual_seed(0)
    vocab = 16
    draft = tiny_draft(block_size=4, vocab_size=vocab + 1, mask_token_id=vocab, hidden_size=24,
                       num_target_layers=8, head_dim=8, num_attention_heads=3, num_key_value_heads=3)
    embed, head = frozen_embed_and_head(draft.config)
    head = torch.nn.Parameter(torch.randn(vocab + 1, 24) * 0.5, requires_grad=False)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(1000 + step)
        ids = torch.randint(0, vocab, (8, 40), generator=gen)
        padded = torch.cat([ids, torch.zeros(8, 3, dtype=torch.long)], dim=1)
        onehots = torch.nn.functional.one_hot(padded, vocab).float()  # [b, S+3, 16]
        feats = torch.cat([onehots[:, 1 + i : 41 + i] for i in range(3)], dim=-1)  # [b, S, 48]
        loss_mask = torch.ones_like(ids, dtype=torch.bool)
        loss_mask[:, 0] = False  # a "prompt" token: no anchor without any context
        return ids, loss_mask, feats

    objective = DFlashObjective(block_size=4, mask_token_id=vocab, num_anchors=16, loss_decay_gamma=4.0)
    _train(draft, objective, embed, head, batch, 300, 1e-2)
    with torch.no_grad():
        out = objective(draft, embed, head, *batch(99999))  # unseen sequences
    acc = out.slot_accuracy
    assert acc[0] > 0.9 and acc[1] > 0.9, acc
    assert acc[2] < 0.3, "slot 3's token is not in any visible feature: reading it would be a mask leak"


def test_rope_frequencies_survive_a_bf16_cast() -> None:
    draft = tiny_draft()
    exact = draft.rotary_emb.inv_freq.clone()
    draft.to(torch.bfloat16)
    assert draft.rotary_emb.inv_freq.dtype == torch.float32
    assert torch.equal(draft.rotary_emb.inv_freq, exact)
    assert draft.fc.weight.dtype == torch.bfloat16
