"""The lossless check is exact in bf16. Its baseline is the target alone through the drafted run's own verify
pass with every draft refused (`DecodeEngine(refuse_drafts=True)`): greedy output with a drafter must equal it
token for token, at batch 1 and 8 (rows finishing and refilled), for a drafter good enough that most drafts
are accepted; the check fails for a drafter that commits a wrong token; and the baseline itself is the
target's greedy decoding (float32, against Hugging Face by full recomputation).

What exactness rests on (`dflash_train.runtime.engine`): at a fixed launch shape, a row's results depend on
that row alone. CPU kernels hardly depend on the shape at all, so a matmul whose summation order follows the
launch shape, as GPU kernel choice does, stands in for the GPU here: under it the one-token loop and a
baseline at another batch size diverge from the drafted output, this baseline does not. The GPU tests
(`-m gpu`) run the runtime's checks with the Triton kernels, torch.compile and CUDA graphs.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from dflash_train.cli import main
from dflash_train.eval.console import lossless_mark
from dflash_train.eval.run import EvalSettings, Evaluator
from dflash_train.kernels._triton import HAS_TRITON
from dflash_train.kernels.static_attention import bounds_from_positions, static_attention_triton
from dflash_train.models import DFlashDraftModel
from dflash_train.prompts.eval_sets import Conversation, PromptSet
from dflash_train.runtime.engine import DecodeEngine, EngineConfig
from dflash_train.runtime.static_target import StaticTarget
from dflash_train.target import TargetModel
from tests.helpers.decoding import make_draft, own_greedy
from tests.helpers.kernels import DEVICE, IN_PROCESS, kernels_here, under_interpreter
from tests.helpers.paths import REPO
from tests.helpers.static_target import tiny_target
from tests.helpers.tiny_models import TINY_ARCHS, make_tiny_target, save_tiny_target_dir

BLOCK, NEW = 8, 40


# ---------------------------------------------------------------------------------------------- helpers


def bf16_copy(target: TargetModel, device: str = "cpu") -> TargetModel:
    return TargetModel(copy.deepcopy(target.model).to(device=device, dtype=torch.bfloat16), target.tokenizer)


def many_prompts(count: int = 12) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    lengths = torch.randint(3, 20, (count,), generator=gen).tolist()
    return [torch.randint(10, 300, (n,), generator=gen).tolist() for n in lengths]


# The reference's greedy continuations, shared by the module's OracleEngines: each costs a full recomputation per
# token, which took a third of the module's time when every engine made its own. Per reference model, then by the
# F.linear in force (`shape_dependent_matmul` swaps it, and the continuations with it) and the prompt; a shorter
# one is a prefix of the longest.
_continuations: weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple[object, tuple[int, ...]], list[int]]] = (
    weakref.WeakKeyDictionary())


def greedy_continuation(reference: TargetModel, prompt: tuple[int, ...], width: int) -> list[int]:
    known_here = _continuations.setdefault(reference.model, {})
    key = (F.linear, prompt)
    known = known_here.get(key)
    if known is None or len(known) < width:
        known = known_here[key] = own_greedy(reference, list(prompt), max(width, NEW + BLOCK))
    return known[:width]


class OracleEngine(DecodeEngine):
    """Drafts from each request's greedy continuation by `reference`, the float32 target by full recomputation:
    in bf16 most are accepted, and where bf16 rounding leaves the float32 path they go wrong, as a good
    drafter's do. Keyed by prompt, so rows may finish and be refilled in any order."""

    def __init__(self, target: TargetModel, draft: DFlashDraftModel, config: EngineConfig, reference: TargetModel,
                 runner: StaticTarget | None = None) -> None:
        super().__init__(target, draft, config, runner=runner)
        self.reference = reference
        self.known: dict[tuple[int, ...], list[int]] = {}
        width = config.max_new_tokens + self.block_size
        self.continuation = torch.zeros(config.batch_size, width, dtype=torch.long, device=self.device)
        self.prompt_lengths = torch.zeros(config.batch_size, dtype=torch.long, device=self.device)

    def prefill(self, rows: Sequence[int], prompts: Sequence[Sequence[int]],
                seeds: Sequence[int] | None = None) -> None:
        super().prefill(rows, prompts, seeds)
        for row, prompt in zip(rows, prompts, strict=True):
            key = tuple(prompt)
            if key not in self.known:
                self.known[key] = greedy_continuation(self.reference, key, self.continuation.shape[1])
            self.continuation[row] = torch.tensor(self.known[key], device=self.device)
            self.prompt_lengths[row] = len(prompt)

    def _propose(self, positions: torch.Tensor) -> tuple[torch.Tensor, None]:
        index = (positions[:, 1:] - self.prompt_lengths[:, None]).clamp(0, self.continuation.shape[1] - 1)
        return self.continuation.gather(1, index), None


class CorruptEngine(OracleEngine):
    """A drafted run that is wrong on purpose: on each request's third cycle the verify commits the token
    after the target's own (logits rolled by one over the vocabulary)."""

    def _verify(self, logits: torch.Tensor, *args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        third = (self.state.n_cycles == 2)[:, None, None]
        return super()._verify(torch.where(third, logits.roll(1, dims=-1), logits), *args)


def config(batch_size: int, device: str = "cpu", **overrides: Any) -> EngineConfig:
    settings: dict[str, Any] = dict(batch_size=batch_size, block_size=BLOCK, max_new_tokens=NEW, max_length=96,
                                    kernels="torch" if device == "cpu" else "triton")
    return EngineConfig(**{**settings, **overrides})


def tokens(engine: DecodeEngine, prompts: list[list[int]]) -> list[list[int]]:
    outputs, _ = engine.generate(prompts)
    return [output.tokens for output in outputs]


@contextmanager
def shape_dependent_matmul(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every linear layer sums over K in 1, 2 or 4 partial products, each rounded to the activations' dtype,
    picked by the launch's row count: like a GPU library choosing a split-K kernel by shape. A row's result
    depends only on its own inputs and the shape, which is all the exact baseline relies on."""
    with monkeypatch.context() as patch:
        patch.setattr(F, "linear", _split_k_linear)
        yield


_plain_linear = F.linear


def _split_k_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`shape_dependent_matmul`'s linear (one function for the module, so that `greedy_continuation` knows it)."""
    pieces = (1, 2, 4)[(x.numel() // x.shape[-1]) % 3]  # rows 1, 8, 64 -> 2, 4, 2 pieces
    parts = [_plain_linear(xs, ws) for xs, ws in zip(x.chunk(pieces, -1), weight.chunk(pieces, -1), strict=True)]
    out = sum(parts[1:], parts[0])
    return out if bias is None else out + bias


@pytest.fixture(scope="module")
def targets() -> tuple[TargetModel, TargetModel]:
    """A tiny Qwen3 in float32, and the same weights in bf16."""
    fp32 = make_tiny_target("qwen3", num_layers=6, seed=1)
    return fp32, bf16_copy(fp32)


# ---------------------------------------------------------------------------------------------- the runtime


@pytest.mark.parametrize("batch_size", [1, 8])
def test_drafted_bf16_output_equals_the_verify_shaped_baseline(targets: tuple[TargetModel, TargetModel],
                                                               batch_size: int) -> None:
    """Twelve prompts: at batch 8 rows finish at different times and take the next request."""
    fp32, bf16 = targets
    draft = make_draft(bf16, block_size=BLOCK).to(torch.bfloat16)
    prompts = many_prompts()
    drafted_engine = OracleEngine(bf16, draft, config(batch_size), reference=fp32)
    outputs, _ = drafted_engine.generate(prompts)
    baseline = DecodeEngine(bf16, draft, config(batch_size), refuse_drafts=True)
    assert baseline.drafter is None and baseline.block_size == BLOCK
    reference = tokens(baseline, prompts)
    assert [o.tokens for o in outputs] == reference
    cycles = [n for o in outputs for n in o.acceptance_lengths]
    assert sum(cycles) / len(cycles) > 3 and max(cycles) == BLOCK  # most drafts were accepted
    # bf16 left the float32 path somewhere: the drafts went wrong there, and a near-tie was decided in bf16.
    assert any(out != drafted_engine.known[tuple(p)][:NEW] for p, out in zip(prompts, reference, strict=True))


@pytest.mark.parametrize("batch_size", [1, 8])
def test_a_shape_dependent_matmul_breaks_other_baselines_not_this_one(
        targets: tuple[TargetModel, TargetModel], batch_size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    fp32, bf16 = targets
    draft = make_draft(bf16, block_size=BLOCK).to(torch.bfloat16)
    prompts = many_prompts()
    with shape_dependent_matmul(monkeypatch):
        drafted = tokens(OracleEngine(bf16, draft, config(batch_size), reference=fp32), prompts)
        baseline = tokens(DecodeEngine(bf16, draft, config(batch_size), refuse_drafts=True), prompts)
        one_token = tokens(DecodeEngine(bf16, None, config(batch_size)), prompts)
        other_batch = tokens(DecodeEngine(bf16, draft, config(9 - batch_size), refuse_drafts=True), prompts)
    assert drafted == baseline
    # What the check compared against before, and the right pass at the wrong batch size: both would cry wolf.
    assert one_token != drafted and other_batch != drafted


def committed_logits(runner: StaticTarget, sequences: torch.Tensor, prompt_length: int,
                     advances: list[list[int]], layer_ids: list[int], compiled: bool = False) -> dict[int, torch.Tensor]:
    """Row 0's logits for each position it reaches, from the pass that commits it: every row prefilled with its
    first `prompt_length` tokens, then blocks of BLOCK tokens of `sequences` [b, L], row r moving on by
    advances[r][i] tokens after pass i (a drafted run's a+1); of each pass, the slots a drafted run commits."""
    b, device = sequences.shape[0], sequences.device
    runner.forward(sequences[:, :prompt_length], torch.arange(prompt_length, device=device).expand(b, -1),
                   row_index=runner.all_rows, kv_len=prompt_length, feature_layer_ids=layer_ids)
    start, kept = [prompt_length] * b, {}
    offsets = torch.arange(BLOCK, device=device)
    for step in range(len(advances[0])):
        block = torch.stack([sequences[r, s: s + BLOCK] for r, s in enumerate(start)])
        positions = torch.tensor(start, device=device)[:, None] + offsets
        logits = runner.forward(block, positions, feature_layer_ids=layer_ids, compiled=compiled).logits
        for k in range(advances[0][step]):
            kept[start[0] + k + 1] = logits[0, k].cpu()
        start = [s + rows[step] for s, rows in zip(start, advances, strict=True)]
    return kept


def check_rows_depend_on_the_launch_shape_only(arch: str, device: str, kernels: str, compiled: bool,
                                               **runner_options: Any) -> None:
    """Row 0 reaches the same 24 positions one token per pass (the baseline) and in uneven strides (a drafted
    run), while the other rows hold other tokens and move differently: the same bits at every position.
    `runner_options`: the static target's, beside its defaults. `arch` beyond the tokenizer-backed four: a target
    of `tests/helpers/static_target.tiny_target` (the models' own layers, windows of 5)."""
    target = make_tiny_target(arch, num_layers=6, seed=1) if arch in TINY_ARCHS else tiny_target(arch)
    if arch == "mistral":
        target.model.config.sliding_window = 5  # windows start mid-block, and mid key tile
    bf16 = bf16_copy(target, device)
    gen = torch.Generator().manual_seed(0)
    first, second = (torch.randint(10, 300, (4, 128), generator=gen).to(device) for _ in range(2))
    second[0] = first[0]
    runner = StaticTarget(bf16, batch_size=4, max_length=128, kernels=kernels, **runner_options)  # as in eval
    results = []
    for sequences, advances in [(first, [[1] * 24, [2] * 24, [8] * 5 + [1] * 19, [3] * 24]),
                                (second, [[3, 8, 1, 5, 2, 1, 4], [1] * 7, [8] * 7, [5, 1] * 3 + [2]])]:
        results.append(committed_logits(runner, sequences, 9, advances, [1, 3], compiled))
    assert sorted(results[0]) == sorted(results[1]) == list(range(10, 34))
    for position, logits in results[0].items():
        assert torch.equal(logits, results[1][position]), position


@pytest.mark.parametrize("arch", ["qwen3", "mistral", "gemma2", "cohere2", "qwen3_5"])
def test_rows_depend_on_the_launch_shape_only(arch: str) -> None:
    check_rows_depend_on_the_launch_shape_only(arch, "cpu", "torch", compiled=False)


@pytest.mark.slow
@kernels_here
def test_rows_depend_on_the_launch_shape_only_on_the_fused_products_with_carried_norm_statistics() -> None:
    """The opt-in fused products whose norms read the statistics the product before them left: each row's
    shares depend on that row alone, so its bits do too (kernels interpreted on CPU, about 5 minutes)."""
    check_rows_depend_on_the_launch_shape_only("qwen3", DEVICE, "triton", compiled=DEVICE == "cuda",
                                               skinny_matmul=True, skinny_fusion=True, carry_norm_stats=True)


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON or IN_PROCESS, reason="the kernels run in this process")
def test_carried_norm_statistics_rows_under_the_interpreter() -> None:
    """The test above, re-run in a process that sets TRITON_INTERPRET=1 before triton is imported (the
    session's shared interpreted process runs the fast tier only)."""
    test = f"{__file__}::test_rows_depend_on_the_launch_shape_only_on_the_fused_products_with_carried_norm_statistics"
    done = subprocess.run([sys.executable, "-m", "pytest", test, "-q", "-m", "slow", "-p", "no:cacheprovider"],
                          env={**os.environ, "TRITON_INTERPRET": "1"}, cwd=REPO, capture_output=True, text=True,
                          timeout=1800)
    assert done.returncode == 0 and "1 passed" in done.stdout, done.stdout[-6000:] + done.stderr[-2000:]


def test_the_baseline_is_plain_greedy_decoding_in_float32(targets: tuple[TargetModel, TargetModel]) -> None:
    """An independent reference: Hugging Face's forward, no cache, one token at a time."""
    fp32, _ = targets
    draft = make_draft(fp32, block_size=BLOCK)
    prompts = many_prompts(9)
    expected = [own_greedy(fp32, p, NEW) for p in prompts]
    for batch_size in (1, 8):
        assert tokens(DecodeEngine(fp32, draft, config(batch_size), refuse_drafts=True), prompts) == expected


def test_refusing_drafts_needs_a_drafter_and_greedy_decoding(targets: tuple[TargetModel, TargetModel]) -> None:
    fp32, _ = targets
    with pytest.raises(ValueError, match="needs the drafter and temperature 0"):
        DecodeEngine(fp32, None, config(1), refuse_drafts=True)
    with pytest.raises(ValueError, match="needs the drafter and temperature 0"):
        DecodeEngine(fp32, make_draft(fp32, block_size=BLOCK), config(1, temperature=0.5), refuse_drafts=True)


# ---------------------------------------------------------------------------------------------- the evaluation

CONVERSATIONS = [Conversation([text]) for text in (
    "hello who are you", "what is the capital of france", "you are a helpful assistant . be brief",
    "is paris the capital of france ?", "who am i", "what is it", "the capital of france is paris . yes or no ?",
    "i am an assistant", "hello !", "what is the capital", "be brief : who is the assistant ?", "yes",
)]


class OracleEvaluator(Evaluator):
    """The evaluator with the drafted engine replaced by `engine` (an `OracleEngine`)."""

    def __init__(self, target: TargetModel, draft: DFlashDraftModel, settings: EvalSettings, reference: TargetModel,
                 engine: type[OracleEngine] = OracleEngine) -> None:
        super().__init__(target, draft, settings)
        self.reference, self.engine = reference, engine

    def _new_engine(self, draft: DFlashDraftModel | None, config: EngineConfig, runner: StaticTarget | None = None,
                    refuse_drafts: bool = False) -> DecodeEngine:
        if draft is None or refuse_drafts:
            return super()._new_engine(draft, config, runner, refuse_drafts)
        return self.engine(self.target, draft, config, reference=self.reference, runner=runner)


def evaluate(targets: tuple[TargetModel, TargetModel], batch_size: int,
             engine: type[OracleEngine] = OracleEngine) -> dict[str, Any]:
    fp32, bf16 = targets
    draft = make_draft(bf16, block_size=BLOCK).to(torch.bfloat16)
    settings = EvalSettings(EngineConfig(batch_size=batch_size, block_size=BLOCK, max_new_tokens=24, kernels="torch"))
    evaluator = OracleEvaluator(bf16, draft, settings, reference=fp32, engine=engine)
    return evaluator.evaluate_set(PromptSet("tiny", CONVERSATIONS, "test"))


@pytest.mark.parametrize("batch_size", [1, 8])
def test_the_lossless_column_says_yes_for_a_good_drafter(targets: tuple[TargetModel, TargetModel], batch_size: int,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Under the shape-dependent matmul too, where a comparison with one-token decoding would say NO."""
    with shape_dependent_matmul(monkeypatch):
        row = evaluate(targets, batch_size)
    assert row["acceptance_length"] > 3
    assert row["lossless"] is True and row["lossless_requests"] == row["requests"] == 12 and row["mismatches"] == []
    assert lossless_mark(row) == "yes" and row["decode_seconds_lossless_check"] > 0
    assert "divergences_at_ties" not in row and "lossless_up_to_ties" not in row


def test_the_check_fails_for_a_wrong_drafter(targets: tuple[TargetModel, TargetModel]) -> None:
    row = evaluate(targets, 8, engine=CorruptEngine)
    assert row["lossless"] is False and row["lossless_requests"] < row["requests"]
    assert lossless_mark(row) == f"NO ({row['lossless_requests']}/12)"
    first = row["mismatches"][0]
    assert first["first_divergence"] >= 2 and set(first) == {"conversation", "turn", "first_divergence",
                                                              "target_tokens", "dflash_tokens"}


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_target_dir(tmp_path_factory.mktemp("target"))


def run_eval(target_dir: Path, out: Path, *extra: str) -> dict[str, Any]:
    assert main(["eval", "--target", str(target_dir), "--draft", "random", "--random-draft-layers", "2",
                 "--block-size", "4", "--max-new-tokens", "16", "--dtype", "bfloat16", "--device", "cpu",
                 "--dataset", "math-synthetic", "--num-prompts", "10", "--no-progress", "--no-plot",
                 "--out", str(out), *extra]) == 0
    return json.loads(out.read_text())


def test_the_eval_command_checks_bf16_exactly_and_can_skip_the_check(target_dir: Path, tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    report = run_eval(target_dir, tmp_path / "checked.json", "--batch-size", "8")
    row = report["datasets"]["math-synthetic"]
    assert report["settings"]["dtype"] == "bfloat16" and report["settings"]["lossless_check"] is True
    assert row["lossless"] is True and row["lossless_requests"] == 10 and row["decode_seconds_lossless_check"] > 0
    assert "refused" in report["definitions"]["lossless"] and "lossless_up_to_ties" not in report["definitions"]
    assert row["tokens_per_s_target_only"] > 0 and row["speedup"] is not None  # the speed baseline is unchanged
    skipped = run_eval(target_dir, tmp_path / "skipped.json", "--no-lossless-check")
    row = skipped["datasets"]["math-synthetic"]
    assert skipped["settings"]["lossless_check"] is False and row["lossless"] is None
    assert row["lossless_requests"] is None and row["decode_seconds_lossless_check"] is None
    assert lossless_mark(row) == "n/a" and row["speedup"] is not None
    capsys.readouterr()


# ---------------------------------------------------------------------------------------------- kernels

test_under_interpreter = under_interpreter(f"{__file__}::test_a_query_gets_the_same_bits_whatever_its_block")


@kernels_here
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("window", "sinks"), [(None, False), (37, False), (100, False), (None, True), (100, True)])
def test_a_query_gets_the_same_bits_whatever_its_block(window: int | None, sinks: bool, dtype: torch.dtype) -> None:
    """The split-key kernel on the last query of a block of 8 (position 150; 131 in row 1) while the block's
    other queries sit 0 to 12 slots further back: with a sliding window the block's first visible slot moves
    with them, mid key tile; with sink logits (gpt-oss) merged with the splits. The query keeps its place in
    the block, because the interpreter's matrix products (numpy's) may round a row by where it sits, which
    the GPU's do not; float32 shows what a bf16 output's rounding may hide."""
    gen = torch.Generator().manual_seed(0)
    n, heads, kv_heads, keys, dim = 2, 4, 2, 256, 16
    queries = torch.randn(n, keys, heads, dim, generator=gen).to(DEVICE, dtype)
    k = (torch.randn(n, kv_heads, keys, dim, generator=gen) * 2).to(DEVICE, dtype)
    v = torch.randn(n, kv_heads, keys, dim, generator=gen).to(DEVICE, dtype)
    sink_logits = torch.linspace(-1.0, 3.0, heads).to(DEVICE, dtype) if sinks else None
    last = torch.tensor([[150], [131]])
    outputs = {}
    for back in range(0, 13, 2):
        positions = torch.cat([last - BLOCK - back + torch.arange(1, BLOCK), last], dim=1).to(DEVICE)
        q = queries[torch.arange(n, device=DEVICE)[:, None], positions].transpose(1, 2)  # [n, heads, T, D]
        out = static_attention_triton(q, k, v, bounds_from_positions(positions, window), dim ** -0.5,
                                      sinks=sink_logits)
        outputs[back] = out[:, -1]
    for back, out in outputs.items():
        assert torch.equal(out, outputs[0]), back


# ---------------------------------------------------------------------------------------------- on a GPU


def needs_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen3", "mistral", "gemma2", "gemma3_text", "cohere2", "granite", "qwen3_5"])
def test_gpu_rows_depend_on_the_launch_shape_only(arch: str) -> None:
    """Triton attention and fused prologue, the target forward compiled as in the decode cycle; the models' own
    layers on the attention kernel too, gemma2's soft-capped scores on the PyTorch path."""
    needs_cuda()
    check_rows_depend_on_the_launch_shape_only(arch, "cuda", "triton", compiled=True)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen3", "mistral"])
def test_gpu_rows_depend_on_the_launch_shape_only_with_carried_norm_statistics(arch: str) -> None:
    """The same on the opt-in fused products whose norms read the statistics the product before them left
    (`carry_norm_stats`): a row's shares depend on that row alone."""
    needs_cuda()
    check_rows_depend_on_the_launch_shape_only(arch, "cuda", "triton", compiled=True, skinny_matmul=True,
                                               skinny_fusion=True, carry_norm_stats=True)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen3", "mistral", "gemma2", "cohere2", "qwen3_5", "qwen3_next", "lfm2",
                                  "nemotron_h", "falcon_h1", "deepseek_v3"])
@pytest.mark.parametrize("batch_size", [1, 8])
def test_gpu_drafted_bf16_output_equals_the_verify_shaped_baseline(arch: str, batch_size: int) -> None:
    """Triton kernels, torch.compile and CUDA graphs, both engines on one runner as in the evaluation; gemma2 and
    cohere2 with the models' own layers (`tests/helpers/static_target.tiny_target`), Qwen3.5 and Qwen3-Next with
    their linear-attention layers on the state rings."""
    needs_cuda()
    fp32 = make_tiny_target(arch, num_layers=6, seed=1) if arch in TINY_ARCHS else tiny_target(arch)
    if arch == "mistral":
        fp32.model.config.sliding_window = 5
    bf16 = bf16_copy(fp32, "cuda")
    # the matrix's tiny targets have 4 layers, too few for the default spread of two feature layers
    layer_ids = None if arch in TINY_ARCHS else [1, 2]
    draft = make_draft(bf16, block_size=BLOCK, target_layer_ids=layer_ids).to(device="cuda", dtype=torch.bfloat16)
    prompts = many_prompts()
    drafted_engine = OracleEngine(bf16, draft, config(batch_size, "cuda"), reference=fp32)
    drafted = tokens(drafted_engine, prompts)
    baseline = DecodeEngine(bf16, draft, config(batch_size, "cuda", compile=drafted_engine.uses_compile),
                            runner=drafted_engine.runner, refuse_drafts=True)
    assert tokens(baseline, prompts) == drafted
    for engine in (drafted_engine, baseline):
        assert engine.uses_cuda_graph and engine.uses_compile and engine.kernels == "triton", (
            engine.graph_error, engine.compile_error)
