"""The fast loop (static caches, device-side decisions, batched rows) against two independent references:
the target's own greedy decoding by full recomputation (lossless) and the plain verify loop
`generate_greedy` (same drafts, so the same acceptance lengths, cycle by cycle)."""

from __future__ import annotations

import pytest
import torch

from dflash_train.models import DFlashDraftModel
from dflash_train.runtime.engine import DecodeEngine, EngineConfig
from dflash_train.runtime.hf_target import HFCacheTarget
from dflash_train.runtime.reference_loop import generate_greedy
from dflash_train.runtime.static_target import StaticTarget
from dflash_train.target import TargetModel
from tests.helpers.decoding import make_draft, own_greedy, prompts
from tests.helpers.tiny_models import make_tiny_target


def engine(target: TargetModel, draft: DFlashDraftModel | None, block_size: int, batch_size: int = 1,
           max_new_tokens: int = 24, stop: tuple[int, ...] = (), cls: type[DecodeEngine] = DecodeEngine) -> DecodeEngine:
    config = EngineConfig(batch_size=batch_size, block_size=block_size, max_new_tokens=max_new_tokens,
                          max_length=64, stop_token_ids=stop, kernels="torch")
    return cls(target, draft, config)


@pytest.mark.parametrize("block_size", [1, 2, 8, 16])
def test_lossless_with_the_same_acceptance_as_the_plain_loop(target: TargetModel, block_size: int) -> None:
    draft = make_draft(target)
    outputs, stats = engine(target, draft, block_size).generate(prompts(2))
    for prompt, output in zip(prompts(2), outputs, strict=True):
        plain, _ = generate_greedy(target, draft, torch.tensor([prompt]), max_new_tokens=24, block_size=block_size)
        assert output.tokens == own_greedy(target, prompt, 24)
        assert output.acceptance_lengths == plain.acceptance_lengths
    assert stats.new_tokens == 48 and stats.cycles > 0


@pytest.mark.parametrize("batch_size", [2, 3])
def test_batched_rows_and_refills_are_lossless_per_row(target: TargetModel, batch_size: int) -> None:
    """Five prompts of different lengths through 2 or 3 rows: rows finish and are refilled mid-run."""
    draft = make_draft(target, seed=3)
    outputs, _ = engine(target, draft, 8, batch_size=batch_size).generate(prompts(5))
    assert len(outputs) == 5
    for prompt, output in zip(prompts(5), outputs, strict=True):
        plain, _ = generate_greedy(target, draft, torch.tensor([prompt]), max_new_tokens=24, block_size=8)
        assert output.tokens == own_greedy(target, prompt, 24)
        assert output.acceptance_lengths == plain.acceptance_lengths
        assert output.num_prompt_tokens == len(prompt)


def corrupt(tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Deterministic draft errors at some positions, so acceptance lengths vary from 1 to B: another token id,
    inside any vocabulary the token came from."""
    return torch.where(positions % 7 == 3, torch.where(tokens > 0, tokens - 1, tokens + 1), tokens)


class OracleEngine(DecodeEngine):
    """Drafts copied from the target's own greedy continuation (with deterministic errors), row r = prompt r."""

    continuation: torch.Tensor  # [b, W] greedy tokens after each prompt
    prompt_lengths: torch.Tensor  # [b]

    def _propose(self, positions: torch.Tensor) -> tuple[torch.Tensor, None]:
        index = (positions[:, 1:] - self.prompt_lengths[:, None]).clamp(0, self.continuation.shape[1] - 1)
        return corrupt(self.continuation.gather(1, index), positions[:, 1:]), None


@pytest.mark.parametrize("batch_size", [1, 3])
def test_multi_token_acceptance_matches_the_plain_loop(target: TargetModel, batch_size: int) -> None:
    block, new = 6, 30
    batch = prompts(batch_size)
    continuations = [own_greedy(target, p, new + block) for p in batch]
    eng = engine(target, make_draft(target), block, batch_size=batch_size, max_new_tokens=new, cls=OracleEngine)
    eng.continuation = torch.tensor(continuations)
    eng.prompt_lengths = torch.tensor([len(p) for p in batch])
    outputs, _ = eng.generate(batch)
    for prompt, reference, output in zip(batch, continuations, outputs, strict=True):
        def oracle(block_ids: torch.Tensor, positions: torch.Tensor, ref: list[int] = reference,
                   length: int = len(prompt)) -> torch.Tensor:
            drafts = torch.tensor([ref[int(p) - length] for p in positions[0, 1:]])[None]
            return corrupt(drafts, positions[:, 1:])

        plain, _ = generate_greedy(target, eng.drafter.draft, torch.tensor([prompt]), max_new_tokens=new,
                                   block_size=block, proposer=oracle)
        assert output.tokens == reference[:new]
        assert output.acceptance_lengths == plain.acceptance_lengths
        assert max(output.acceptance_lengths) == block and min(output.acceptance_lengths) == 1


def test_stop_token_inside_an_accepted_block(target: TargetModel) -> None:
    block, new = 6, 30
    batch = prompts(1)
    reference = own_greedy(target, batch[0], new + block)
    stop = reference[13]
    eng = engine(target, make_draft(target), block, max_new_tokens=new, stop=(stop,), cls=OracleEngine)
    eng.continuation, eng.prompt_lengths = torch.tensor([reference]), torch.tensor([len(batch[0])])
    (output,), _ = eng.generate(batch)
    assert output.tokens == reference[: reference.index(stop) + 1]

    def oracle(block_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        drafts = torch.tensor([reference[int(p) - len(batch[0])] for p in positions[0, 1:]])[None]
        return corrupt(drafts, positions[:, 1:])

    plain, _ = generate_greedy(target, eng.drafter.draft, torch.tensor(batch), max_new_tokens=new, block_size=block,
                               stop_token_ids=[stop], proposer=oracle)
    assert output.acceptance_lengths == plain.acceptance_lengths


def test_one_new_token_and_stop_as_first_token(target: TargetModel) -> None:
    batch = prompts(2)
    outputs, stats = engine(target, make_draft(target), 4, batch_size=2, max_new_tokens=1).generate(batch)
    assert [o.tokens for o in outputs] == [own_greedy(target, p, 1) for p in batch]
    assert all(o.acceptance_lengths == [] for o in outputs) and stats.cycles == 0
    first = own_greedy(target, batch[0], 1)[0]
    (output,), _ = engine(target, make_draft(target), 4, stop=(first,)).generate(batch[:1])
    assert output.tokens == [first] and output.acceptance_lengths == []


def test_greedy_drafts_take_the_argmax_kernel_unless_turned_off(target: TargetModel,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """With Triton kernels, greedy drafts come from `block_argmax_triton` (tested against torch.argmax with
    the kernels); with `fuse_draft_argmax=False` or PyTorch kernels, from torch.argmax."""
    from dflash_train.runtime import engine as engine_module

    calls = []
    def kernel(logits: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        calls.append(logits)
        return out.copy_(logits.argmax(-1))

    monkeypatch.setattr(engine_module, "block_argmax_triton", kernel)
    logits = torch.randn(1, 3, 11)
    for fused, kernels, picked in [(True, "triton", "kernel"), (False, "triton", "torch"), (True, "torch", "torch")]:
        config = EngineConfig(block_size=4, max_length=64, kernels="torch", fuse_draft_argmax=fused)
        drafted = DecodeEngine(target, make_draft(target, block_size=4), config)
        drafted.kernels = kernels  # what resolve_kernels gives on a GPU; the pick reads nothing else
        calls.clear()
        assert drafted.draft_argmax == picked
        drafted.state.block.fill_(-1)
        assert torch.equal(drafted._pick(logits), logits.argmax(-1)) and len(calls) == (picked == "kernel")
        # the kernel writes the drafts into the block's draft slots (the cycle then copies nothing)
        in_place = torch.equal(drafted.state.block[:, 1:], logits.argmax(-1))
        assert in_place == (picked == "kernel") and (drafted.state.block[:, 0] == -1).all()


def test_target_only_engine_is_plain_greedy(target: TargetModel) -> None:
    outputs, stats = engine(target, None, 16, batch_size=2).generate(prompts(3))
    assert [o.tokens for o in outputs] == [own_greedy(target, p, 24) for p in prompts(3)]
    assert all(set(o.acceptance_lengths) == {1} for o in outputs)


def test_prompt_longer_than_the_cache_is_a_clear_error(target: TargetModel) -> None:
    with pytest.raises(ValueError, match="raise max_length"):
        engine(target, None, 1).generate([[5] * 50])


def test_an_architecture_the_static_runner_lacks_runs_on_its_own_forward(target: TargetModel) -> None:
    """The engine takes the model's own forward and caches; the static runner itself refuses in one line."""
    other = make_tiny_target("llama", num_layers=4)
    other.model.config.model_type = "gpt_neox"
    assert isinstance(engine(other, None, 1).runner, HFCacheTarget)
    with pytest.raises(ValueError, match="static-cache runtime supports"):
        StaticTarget(other, 1, 32)


@pytest.mark.slow
def test_compiled_cycle_gives_the_same_tokens(target: TargetModel) -> None:
    """torch.compile of the target and drafter forwards (on by default on CUDA) changes nothing."""
    draft = make_draft(target, seed=4)
    results = []
    for compiled in (False, True):
        config = EngineConfig(batch_size=2, block_size=8, max_new_tokens=24, max_length=64, kernels="torch",
                              compile=compiled)
        eng = DecodeEngine(target, draft, config)
        outputs, _ = eng.generate(prompts(3))
        assert eng.uses_compile == compiled and eng.compile_error is None
        results.append([(o.tokens, o.acceptance_lengths) for o in outputs])
    assert results[0] == results[1]


@pytest.mark.parametrize("scope, method", [("layer", "_compiled_by_layer"), ("step", "_compiled")])
def test_a_compile_failure_retries_with_sdpa_attention_then_uncompiled(target: TargetModel, scope: str, method: str,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A compiler failure costs speed, not the evaluation: first the split-key attention kernel is dropped
    (compiled with SDPA), and only if that fails too the cycle runs uncompiled; tokens stay the plain ones."""
    from dflash_train.runtime.static_target import StaticTarget

    def fake_compile(failing: set[str]):  # stands in for torch.compile: fails for the attention paths given
        def compiled(self: StaticTarget, options: tuple = ()) -> object:
            if self.attention in failing:
                raise RuntimeError(f"compiler refused the {self.attention} attention")
            return self._forward
        return compiled

    expected = [own_greedy(target, p, 24) for p in prompts(2)]
    for failing, compiled_after, attention_after in [({"triton"}, True, "sdpa"), ({"triton", "sdpa"}, False, "sdpa")]:
        monkeypatch.setattr(StaticTarget, method, fake_compile(failing))
        runner = StaticTarget(target, batch_size=1, max_length=64, kernels="triton")
        config = EngineConfig(batch_size=1, block_size=1, max_new_tokens=24, max_length=64, kernels="torch",
                              compile=True, compile_scope=scope)
        eng = DecodeEngine(target, None, config, runner=runner)
        outputs, _ = eng.generate(prompts(2))
        assert [o.tokens for o in outputs] == expected
        assert (eng.uses_compile, runner.attention) == (compiled_after, attention_after)
        assert "refused the triton attention" in eng.compile_error
        assert ("with SDPA attention" in eng.compile_error) == (not compiled_after)
