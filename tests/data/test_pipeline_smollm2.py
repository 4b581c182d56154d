"""The whole data pipeline on the real SmolLM2-135M-Instruct, through the command line (slow tier)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dflash_train.cli import main
from dflash_train.data import load_prepared
from dflash_train.features.store import FeatureStore
from dflash_train.regeneration.generation import Generator, hf_generate
from dflash_train.runtime.config import EngineConfig
from tests.helpers.paths import REPO

pytestmark = pytest.mark.slow
DEMO = REPO / "data" / "prompts" / "demo_prompts.jsonl"


def test_builtin_generation_equals_hf_generate_on_smollm2() -> None:
    from dflash_train.target import load_target

    target = load_target("smollm2-135m-instruct", dtype=torch.float32)
    prompts = [target.tokenizer.apply_chat_template([{"role": "user", "content": json.loads(line)["prompt"]}],
                                                    add_generation_prompt=True, return_dict=True)["input_ids"]
               for line in DEMO.read_text().splitlines()[:4]]
    config = EngineConfig(batch_size=3, block_size=1, max_new_tokens=24, max_length=512,
                          stop_token_ids=(target.tokenizer.eos_token_id,))
    batched = Generator(target, config).generate([list(p) for p in prompts], [0] * len(prompts))
    assert batched == [hf_generate(target.model, [list(p)], config, pad_id=target.tokenizer.pad_token_id)[0]
                       for p in prompts]


def test_regenerate_prepare_extract_verify(tmp_path: Path) -> None:
    target = ["--target", "smollm2-135m-instruct"]
    assert main(["regenerate", *target, "--data", str(DEMO), "--max-samples", "6", "--max-new-tokens", "40",
                 "--batch-size", "3", "--dtype", "fp32", "--out", str(tmp_path / "regen")]) == 0
    assert main(["prepare", *target, "--data", str(tmp_path / "regen"), "--block-size", "4",
                 "--out", str(tmp_path / "prepared")]) == 0
    data = load_prepared(tmp_path / "prepared")
    assert len(data) == 6 and all(sum(m) >= 8 for m in data["loss_mask"])
    assert main(["extract", *target, "--data", str(tmp_path / "prepared"), "--dtype", "fp8", "--rows-per-shard", "4",
                 "--target-dtype", "fp32", "--out", str(tmp_path / "features")]) == 0
    assert main(["extract", "--verify", *target, "--out", str(tmp_path / "features"), "--data",
                 str(tmp_path / "prepared"), "--recompute", "3", "--target-dtype", "fp32"]) == 0
    store = FeatureStore(tmp_path / "features")
    store.check_compatible([1, 8, 14, 20, 27], 576, store.manifest["target_hash"])
    assert store[0]["features"].shape == (len(data[0]["input_ids"]), 5 * 576)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_openai_backend_against_llama_server(tmp_path: Path) -> None:
    """Against llama.cpp's `llama-server` serving the SmolLM2 GGUF (set LLAMA_SERVER or put it on PATH)."""
    import os
    import shutil
    import subprocess
    import time

    import httpx

    from dflash_train.data.chat import ChatTokenizer
    from dflash_train.data.target_tokenizer import load_target_tokenizer
    from dflash_train.prompts.corpora import CorpusSpec
    from dflash_train.regeneration.backends import OpenAIBackend
    from dflash_train.regeneration.regenerate import RegenerateConfig, regenerate
    from dflash_train.target import DEFAULT_TARGET_ALIASES

    binary = os.environ.get("LLAMA_SERVER") or shutil.which("llama-server")
    if not binary:
        pytest.skip("llama-server not found: build llama.cpp's llama-server and set LLAMA_SERVER to its path")
    port = _free_port()
    gguf = DEFAULT_TARGET_ALIASES["smollm2-135m-instruct"].path()
    server = subprocess.Popen([binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-c", "2048"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(120):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        config = RegenerateConfig([CorpusSpec(str(DEMO), max_samples=4)], max_new_tokens=24, batch_size=2)
        backend = OpenAIBackend(f"http://127.0.0.1:{port}/v1", "smollm2", 24, concurrency=2)
        chat = ChatTokenizer(load_target_tokenizer("smollm2-135m-instruct"))
        assert regenerate(backend, chat, config, tmp_path / "out")["complete"]
        rows = [json.loads(line) for p in sorted((tmp_path / "out").glob("part-*.jsonl")) for line in p.read_text().splitlines()]
        assert len(rows) == 4 and all(r["messages"][-1]["content"].strip() and r["completion_tokens"] > 0 for r in rows)
    finally:
        server.terminate()
        server.wait(timeout=30)
