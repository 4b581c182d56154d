"""training.optimizer: muon — which parameters Muon gets, its update against a hand-written Newton–Schulz
reference, the batched Muon step against `torch.optim.Muon`'s (and their state dicts), AdamW for the rest,
one schedule for both, state dict and trainer resume round trips."""

from __future__ import annotations

import collections
import copy
import io
import math
import pathlib
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dflash_train.training import muon
from dflash_train.training.config import load_config
from dflash_train.training.muon import BatchedMuon, MuonWithAdamW, build_muon_with_adamw
from dflash_train.training.setup import build_optimizer, build_schedule
from dflash_train.training.trainer import run_training
from tests.helpers.paths import CPU_RECIPE
from tests.helpers.tiny_drafts import tiny_draft
from tests.helpers.training import overrides, save_tiny_prepared, save_tiny_target, train_losses

RECIPE = CPU_RECIPE


def newton_schulz(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Keller Jordan's quintic iteration, in float64 (Muon runs it in bf16): approximately U V^T of G = U S V^T."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.double()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x.T if tall else x).float()


def reference_muon_step(param: torch.Tensor, grad: torch.Tensor, buf: torch.Tensor, lr: float) -> None:
    """buf = 0.95·buf + 0.05·g; Nesterov update g + 0.95·(buf - g), orthogonalised, scaled by sqrt(max(1, A/B))."""
    buf.mul_(0.95).add_(grad, alpha=0.05)
    update = grad + 0.95 * (buf - grad)
    scale = math.sqrt(max(1.0, param.shape[0] / param.shape[1]))
    param.sub_(newton_schulz(update), alpha=lr * scale)


def grads_for(draft: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in draft.parameters():
        p.grad = torch.randn(p.shape, generator=gen) if p.requires_grad else None


def test_matrices_go_to_muon_and_the_rest_to_adamw() -> None:
    draft = tiny_draft()
    draft.layers[1].mlp.up_proj.weight.requires_grad_(False)  # frozen: in neither group
    opt = build_muon_with_adamw(draft, 0.02, 1e-3, (0.9, 0.999), 0.0)
    assert isinstance(opt.muon, BatchedMuon)
    names = {id(p): n for n, p in draft.named_parameters()}
    muon = {names[id(p)] for g in opt.muon.param_groups for p in g["params"]}
    adamw = {names[id(p)] for g in opt.adamw.param_groups for p in g["params"]}
    assert "fc.weight" in muon and "layers.0.self_attn.q_proj.weight" in muon
    assert "layers.1.mlp.down_proj.weight" in muon and "layers.1.mlp.up_proj.weight" not in muon | adamw
    assert adamw == {n for n, p in draft.named_parameters() if p.ndim == 1}
    assert {n for n, p in draft.named_parameters() if p.ndim == 2} - muon == {"layers.1.mlp.up_proj.weight"}
    assert [g["lr"] for g in opt.param_groups] == [1e-3, 0.02]  # AdamW's group first


@pytest.mark.parametrize(("ns_dtype", "tolerance"), [(torch.float32, 1e-4), (torch.bfloat16, 0.05)])
def test_two_steps_equal_the_reference_updates(ns_dtype: torch.dtype, tolerance: float) -> None:
    """Newton–Schulz in float32 (a CPU without bf16 matrix instructions) gives the float64 reference's updates
    to rounding; in bf16 (CUDA's, torch's) to about 2 %. A wrong step (no Nesterov, another momentum or
    learning-rate scale, no orthogonalisation) is off by 20 % or more."""
    draft = tiny_draft(seed=3)
    reference = copy.deepcopy(draft)
    opt = build_muon_with_adamw(draft, 0.02, 1e-3, (0.9, 0.999), 0.0)
    opt.muon.ns_dtype = ns_dtype
    norms = [p for p in reference.parameters() if p.ndim == 1]
    adamw = torch.optim.AdamW(norms, lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0)
    buffers = {n: torch.zeros_like(p) for n, p in reference.named_parameters() if p.ndim == 2}
    for seed in (1, 2):
        grads_for(draft, seed)
        grads_for(reference, seed)
        opt.step()
        adamw.step()
        with torch.no_grad():
            for name, p in reference.named_parameters():
                if p.ndim == 2:
                    reference_muon_step(p, p.grad, buffers[name], 0.02)
    start = dict(tiny_draft(seed=3).named_parameters())
    for (name, got), want in zip(draft.named_parameters(), reference.parameters(), strict=True):
        if got.ndim == 1:  # AdamW
            torch.testing.assert_close(got, want, msg=name)
            continue
        got_update, want_update = got - start[name], want - start[name]
        assert (got_update - want_update).norm() < tolerance * want_update.norm(), name


# Interleaved shapes: three wide 32×48, two tall 64×32 (Newton–Schulz on the transpose), two square, a tall
# and a wide one alone in their shapes. At least 32 rows and columns: see `assert_same_run`.
MIXED_SHAPES = [(32, 48), (64, 32), (32, 48), (48, 48), (64, 32), (80, 40), (32, 48), (48, 48), (40, 96)]


def twin_params(shapes: list[tuple[int, int]], seed: int = 0) -> tuple[list[torch.nn.Parameter], ...]:
    gen = torch.Generator().manual_seed(seed)
    start = [torch.randn(shape, generator=gen) for shape in shapes]
    return tuple([torch.nn.Parameter(t.clone()) for t in start] for _ in range(2))


def give_grads(seed: int, *param_lists: list[torch.nn.Parameter], skip: tuple[int, ...] = ()) -> None:
    """The same gradients to every list's i-th parameter; none to the `skip` ones."""
    gen = torch.Generator().manual_seed(100 + seed)
    for i, param in enumerate(param_lists[0]):
        grad = torch.randn(param.shape, generator=gen)
        for params in param_lists:
            params[i].grad = None if i in skip else grad.clone()


def assert_same_run(got: list[torch.Tensor], got_opt: torch.optim.Optimizer, want: list[torch.Tensor],
                    want_opt: torch.optim.Optimizer) -> None:
    """Bit-equal parameters and momentum buffers, not close ones: the momentum, weight decay and update are
    the same elementwise kernels (`_foreach_*` loops over them on CPU), and on CPU the batched bf16 matmuls
    and per-matrix norms sum in the same order as torch's per-matrix ones for matrices of 32 rows and
    columns or more (seen over 200 seeds, at 1 and 2 threads, AVX2 and AVX-512). Smaller ones (16 rows, say)
    can take another CPU bmm kernel, one bf16 step apart in a rare gram element; the drafter's are ≥ 192."""
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(g, w), i
        got_state, want_state = got_opt.state.get(g, {}), want_opt.state.get(w, {})
        assert got_state.keys() == want_state.keys(), i
        if want_state:
            assert torch.equal(got_state["momentum_buffer"], want_state["momentum_buffer"]), i


def test_batched_muon_steps_equal_torch_muon() -> None:
    got, want = twin_params(MIXED_SHAPES)

    def groups(params: list[torch.nn.Parameter]) -> list[dict[str, Any]]:  # the second: no decay nor Nesterov
        return [{"params": params[:6]}, {"params": params[6:], "lr": 0.01, "weight_decay": 0.0, "nesterov": False}]

    got_opt = TorchDtypeBatchedMuon(groups(got), lr=0.03, weight_decay=0.1)
    want_opt = torch.optim.Muon(groups(want), lr=0.03, weight_decay=0.1)
    for seed in range(3):
        give_grads(seed, got, want)
        got_opt.step()
        want_opt.step()
    assert_same_run(got, got_opt, want, want_opt)
    start, _ = twin_params(MIXED_SHAPES)
    assert all((p - p0).abs().max() > 1e-3 for p, p0 in zip(got, start, strict=True))  # it did step


def test_newton_schulz_dtype_follows_the_device(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    avx2, amx = tmp_path / "avx2", tmp_path / "amx"
    avx2.write_text("processor : 0\nflags : fpu sse2 avx avx2 fma\n")
    amx.write_text("processor : 0\nflags : fpu avx2 avx512f avx512_bf16 amx_tile amx_bf16\n")
    assert not muon.cpu_has_bf16_matmul(str(avx2)) and muon.cpu_has_bf16_matmul(str(amx))
    assert not muon.cpu_has_bf16_matmul(str(tmp_path / "missing"))
    opt = BatchedMuon([torch.nn.Parameter(torch.zeros(4, 4))], lr=0.02)
    for has_bf16, on_cpu in ((False, torch.float32), (True, torch.bfloat16)):
        monkeypatch.setattr(muon, "cpu_has_bf16_matmul", lambda has_bf16=has_bf16: has_bf16)
        assert opt._newton_schulz_dtype(torch.device("cpu")) == on_cpu
        assert opt._newton_schulz_dtype(torch.device("cuda")) == torch.bfloat16
    opt.ns_dtype = torch.float32  # asked for: whatever the device
    assert opt._newton_schulz_dtype(torch.device("cuda")) == torch.float32


class TorchDtypeBatchedMuon(BatchedMuon):
    """Newton–Schulz in torch's bf16 on the CPU too, for bit-equal comparisons with torch's Muon."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, ns_dtype=torch.bfloat16, **kwargs)


def test_state_dicts_cross_between_torch_and_batched_muon() -> None:
    """torch's Muon 2 steps → batched 1 step → torch's 1 step is the 4 steps of torch's Muon alone, as
    checkpoints written before `BatchedMuon` resume."""
    straight, *_ = twin_params(MIXED_SHAPES)
    straight_opt = torch.optim.Muon(straight, lr=0.03, weight_decay=0.1)
    for seed in range(4):
        give_grads(seed, straight)
        straight_opt.step()
    params, *_ = twin_params(MIXED_SHAPES)
    opt: torch.optim.Optimizer = torch.optim.Muon(params, lr=0.03, weight_decay=0.1)
    for seed, cls in enumerate((torch.optim.Muon, torch.optim.Muon, TorchDtypeBatchedMuon, torch.optim.Muon)):
        if type(opt) is not cls:  # resume: fresh parameters, saved optimizer state
            buffer = io.BytesIO()
            torch.save(opt.state_dict(), buffer)
            buffer.seek(0)
            resumed, *_ = twin_params(MIXED_SHAPES, seed=seed + 7)
            with torch.no_grad():
                for dst, src in zip(resumed, params, strict=True):
                    dst.copy_(src)
            params, opt = resumed, cls(resumed, lr=0.03, weight_decay=0.1)
            opt.load_state_dict(torch.load(buffer, weights_only=True))
        give_grads(seed, params)
        opt.step()
    assert type(opt) is torch.optim.Muon
    assert_same_run(params, opt, straight, straight_opt)


def test_parameters_without_gradients_are_skipped_as_torch_does() -> None:
    """No momentum, no weight decay for them; the last one never has a gradient, so it gets no state."""
    shapes = [(32, 48), (32, 48), (32, 48), (64, 32), (48, 48)]
    got, want = twin_params(shapes)
    got_opt = TorchDtypeBatchedMuon(got, lr=0.03, weight_decay=0.1)
    want_opt = torch.optim.Muon(want, lr=0.03, weight_decay=0.1)
    for seed, skip in enumerate([(4,), (1, 3, 4), (1, 4), (0, 1, 2, 3, 4)]):  # (64, 32) and then all skipped
        give_grads(seed, got, want, skip=skip)
        before = [p.clone() for p in got]
        got_opt.step()
        want_opt.step()
        assert all(torch.equal(got[i], before[i]) for i in skip), seed
        assert_same_run(got, got_opt, want, want_opt)
    assert got[4] not in got_opt.state and len(got_opt.state) == 4


class CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def test_newton_schulz_launches_are_per_shape_not_per_matrix() -> None:
    """The point of `BatchedMuon`: 5 iterations × 3 matmuls per shape, where torch's Muon runs them per matrix."""
    got, want = twin_params(MIXED_SHAPES)
    counts: dict[type, collections.Counter[str]] = {}
    for opt, params in ((TorchDtypeBatchedMuon(got, lr=0.03), got), (torch.optim.Muon(want, lr=0.03), want)):
        give_grads(0, params)
        with CountOps() as mode:
            opt.step()
        counts[type(opt)] = mode.counts
    batched, single = counts[TorchDtypeBatchedMuon], counts[torch.optim.Muon]
    assert batched["bmm"] + batched["baddbmm"] == 15 * len(set(MIXED_SHAPES)) == 15 * 5
    assert single["mm"] + single["addmm"] == 15 * len(MIXED_SHAPES)


def test_one_schedule_multiplies_both_learning_rates() -> None:
    config = load_config(RECIPE, ["training.optimizer=muon", "training.muon_learning_rate=0.05",
                                  "training.learning_rate=1e-3", "training.warmup_ratio=0.2"])
    draft = tiny_draft()
    opt = build_optimizer(draft, config)
    schedule = build_schedule(opt, 10, config)
    for _ in range(6):
        adamw_lr, muon_lr = (g["lr"] for g in opt.param_groups)
        assert muon_lr / 0.05 == pytest.approx(adamw_lr / 1e-3, rel=1e-9)
        assert opt.muon.param_groups[0]["lr"] == muon_lr and opt.adamw.param_groups[0]["lr"] == adamw_lr
        grads_for(draft, 0)
        opt.step()
        schedule.step()
    assert adamw_lr < 1e-3  # the multiplier moved: warm-up over, decaying


def test_state_dict_round_trip_continues_the_same_run() -> None:
    def make() -> tuple[torch.nn.Module, MuonWithAdamW]:
        draft = tiny_draft(seed=5)
        return draft, build_muon_with_adamw(draft, 0.02, 1e-3, (0.9, 0.999), 0.0)

    straight, straight_opt = make()
    for seed in range(4):
        grads_for(straight, seed)
        straight_opt.step()
    first, first_opt = make()
    for seed in range(2):
        grads_for(first, seed)
        first_opt.step()
    buffer = io.BytesIO()
    torch.save({"model": first.state_dict(), "optimizer": first_opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed, resumed_opt = make()
    resumed.load_state_dict(saved["model"])
    resumed_opt.load_state_dict(saved["optimizer"])
    for seed in range(2, 4):
        grads_for(resumed, seed)
        resumed_opt.step()
    for (name, got), want in zip(resumed.named_parameters(), straight.parameters(), strict=True):
        assert torch.equal(got, want), name
    with pytest.raises(ValueError, match="not a Muon"):
        resumed_opt.load_state_dict(torch.optim.AdamW(resumed.parameters()).state_dict())


@pytest.mark.parametrize("variable", ["ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP"])
def test_muon_is_refused_under_sharded_launches(variable: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(variable, "true")
    with pytest.raises(ValueError, match="training.optimizer: muon does not run under"):
        build_optimizer(tiny_draft(), load_config(RECIPE, ["training.optimizer=muon"]))
    assert isinstance(build_optimizer(tiny_draft(), load_config(RECIPE)), torch.optim.AdamW)


def test_config_defaults_and_checks() -> None:
    config = load_config(RECIPE)
    assert (config.training.optimizer, config.training.muon_learning_rate) == ("adamw", 0.02)
    with pytest.raises(ValueError, match="training.muon_learning_rate must be > 0, got 0.0"):
        load_config(RECIPE, ["training.muon_learning_rate=0"])


def test_stop_then_resume_equals_the_uninterrupted_run(tmp_path: pathlib.Path) -> None:
    """Muon's momentum and AdamW's moments go through accelerate's checkpoint and come back."""
    assets = {"target": save_tiny_target(tmp_path / "target"), "data": save_tiny_prepared(tmp_path / "data")}
    muon = {"training.optimizer": "muon", "training.max_steps": 6, "training.eval_every": 0}
    reference = tmp_path / "reference"
    run_training(load_config(None, overrides(assets, reference, **muon)))
    out = tmp_path / "stopped"
    first = run_training(load_config(None, overrides(assets, out, **muon, **{"training.stop_after_minutes": 1e-9})))
    assert first.steps == 1 and not first.finished
    assert run_training(load_config(None, overrides(assets, out, **muon))).steps == 6
    expected, got = train_losses(reference), train_losses(out)
    assert sorted(got) == list(range(1, 7))
    for step in range(1, 7):
        assert got[step] == pytest.approx(expected[step], rel=1e-6, abs=1e-6), step
    adamw = tmp_path / "adamw"
    run_training(load_config(None, overrides(assets, adamw, **{**muon, "training.optimizer": "adamw"})))
    assert train_losses(adamw)[6] != pytest.approx(expected[6], rel=1e-4)  # Muon did change the run
