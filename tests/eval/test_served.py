"""`python -m dflash_train.eval.served` against a fake OpenAI-compatible server: τ from the metric deltas, later turns
asked after the served answer, and a clear one-line error from a server without the counters."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import NamedTuple

import pytest

from dflash_train.data.prompt_ids import prompt_ids
from dflash_train.eval import served
from tests.helpers.byte_tokenizer import byte_tokenizer

# Completion n (1, 2, 3) adds n + 1 drafts and 3n accepted tokens (n at position 0, n - 1 at position 1) to
# counters that do not start at zero: per request τ 2.5, 3, 3.25 (mean 2.9167); over the set 1 + 18/9 = 3.
METRICS = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{{engine="0",model_name="m"}} {drafts}
vllm:spec_decode_num_accepted_tokens_total{{engine="0",model_name="m"}} {accepted}
vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="m",position="0"}} {pos0}
vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="m",position="1"}} {pos1}
"""
# llama-server's page (with --metrics): the same counters under its own prefix, without labels but the position,
# beside counters of its own whose names must not be mistaken for them.
LLAMACPP_METRICS = """# HELP llamacpp:n_decode_total Total number of llama_decode() calls
# TYPE llamacpp:n_decode_total counter
llamacpp:n_decode_total 123
# TYPE llamacpp:spec_decode_num_draft_tokens_total counter
llamacpp:spec_decode_num_draft_tokens_total 999
# TYPE llamacpp:spec_decode_num_accepted_tokens_total counter
llamacpp:spec_decode_num_accepted_tokens_total {accepted}
# TYPE llamacpp:spec_decode_num_drafts_total counter
llamacpp:spec_decode_num_drafts_total {drafts}
# TYPE llamacpp:spec_decode_num_accepted_tokens_per_pos_total counter
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{{position="0"}} {pos0}
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{{position="1"}} {pos1}
"""


class FakeServer(BaseHTTPRequestHandler):
    metrics: str | None = "vllm"  # "vllm", "llamacpp": the counters; "none": a 404; "plain": a page without them
    prompts: list[list[int]] = []
    bodies: list[dict] = []  # every completion request's body, in order

    def log_message(self, *args: object) -> None:  # keep pytest's output clean
        pass

    def _send(self, code: int, body: str, kind: str = "application/json") -> None:
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body.encode())))
        self.end_headers()
        self.wfile.write(body.encode())

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            self._send(200, json.dumps({"data": [{"id": "fake"}]}))
        elif self.path == "/metrics" and self.metrics in ("vllm", "llamacpp"):
            done = range(1, len(self.prompts) + 1)
            page = (METRICS if self.metrics == "vllm" else LLAMACPP_METRICS).format(
                drafts=7 + sum(n + 1 for n in done), accepted=5 + sum(3 * n for n in done),
                pos0=sum(done), pos1=sum(n - 1 for n in done))
            self._send(200, page, "text/plain")
        elif self.path == "/metrics" and self.metrics == "plain":
            self._send(200, "process_cpu_seconds_total 1.0\n", "text/plain")
        else:
            self._send(404, "{}")

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert self.path == "/v1/completions"
        self.prompts.append(body["prompt"])
        self.bodies.append(body)
        text = f"answer {len(self.prompts)}"
        self._send(200, json.dumps({"choices": [{"text": text, "token_ids": [5, 6, 7]}],
                                    "usage": {"completion_tokens": 3}}))


class Fake(NamedTuple):
    url: str
    handler: type[FakeServer]  # its `prompts`: the token ids of every completion request, in order


@pytest.fixture
def server(request: pytest.FixtureRequest) -> Iterator[Fake]:
    handler = type("Handler", (FakeServer,), {"metrics": getattr(request, "param", "vllm"), "prompts": [],
                                                  "bodies": []})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield Fake(f"http://127.0.0.1:{httpd.server_address[1]}", handler)
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def setup(tmp_path: Path) -> tuple[Path, Path]:
    """A tokenizer directory with a chat template, and a prompt file of one two-turn and one one-turn chat."""
    byte_tokenizer("qwen3").save_pretrained(tmp_path / "tok")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"turns": ["Hi?", "And then?"]}) + "\n" + json.dumps({"turns": ["Yo?"]}) + "\n")
    return tmp_path / "tok", prompts


@pytest.mark.parametrize("server", ["vllm", "llamacpp"], indirect=True)
def test_tau_per_request_and_per_cycle_from_the_counters(server: Fake, setup: tuple[Path, Path], tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    tok, prompts = setup
    out = tmp_path / "served.json"
    code = served.main(["--url", server.url, "--tokenizer", str(tok), "--dataset", str(prompts),
                                     "--json", str(out), "--stop-token-ids", "1", "2"])
    assert code == 0
    result = json.loads(out.read_text())["sets"][0]
    assert (result["requests"], result["drafts"], result["accepted"]) == (3, 9, 18)
    assert [(o["drafts"], o["accepted"]) for o in result["outputs"]] == [(2, 3), (3, 6), (4, 9)]
    assert result["acceptance_length"] == pytest.approx((2.5 + 3 + 3.25) / 3)
    assert result["acceptance_length_cycle_weighted"] == pytest.approx(3.0)
    assert result["per_position_acceptance"] == pytest.approx([6 / 9, 3 / 9])
    assert result["completion_tokens"] == 9
    assert "| prompts | 0 | 3 | 9 | 18 | 2.917 | 3.000 |" in capsys.readouterr().out
    assert all(body["temperature"] == 0.0 and "seed" not in body for body in server.handler.bodies)  # greedy


def test_a_temperature_sweep_measures_every_set_at_each_with_seeded_draws(
        server: Fake, setup: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tok, prompts = setup
    out = tmp_path / "served.json"
    assert served.main(["--url", server.url, "--tokenizer", str(tok), "--dataset", str(prompts), "--json", str(out),
                        "--temperature", "0,0.7", "--seed", "10"]) == 0
    report = json.loads(out.read_text())
    assert report["temperatures"] == [0.0, 0.7] and report["seed"] == 10
    assert [(r["dataset"], r["temperature"], r["requests"]) for r in report["sets"]] == [
        ("prompts", 0.0, 3), ("prompts", 0.7, 3)]
    # The counters of each set's own requests: the fake's 4th to 6th completions at 0.7 (5 + 6 + 7 drafts).
    assert report["sets"][1]["drafts"] == 18
    bodies = server.handler.bodies
    assert [b["temperature"] for b in bodies] == [0.0] * 3 + [0.7] * 3
    assert ["seed" in b for b in bodies[:3]] == [False] * 3 and [b["seed"] for b in bodies[3:]] == [10, 11, 12]
    # sampled from the plain tempered distribution, as the eval samples, whatever the server's defaults truncate
    assert all("top_k" not in b for b in bodies[:3])
    assert all((b["top_p"], b["top_k"], b["min_p"]) == (1.0, -1, 0.0) for b in bodies[3:])
    table = capsys.readouterr().out
    assert "| prompts | 0 | 3 |" in table and "| prompts | 0.7 | 3 |" in table


@pytest.mark.parametrize("value", ["hot", "-1", "0,0", "inf", "nan"])
def test_a_bad_temperature_is_a_one_line_usage_error(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        served.main(["--url", "http://127.0.0.1:1", "--temperature", value])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "--temperature" in err and "Traceback" not in err


def test_a_later_turn_is_asked_after_the_served_answer(server: Fake, setup: tuple[Path, Path]) -> None:
    tok, prompts = setup
    assert served.main(["--url", server.url, "--tokenizer", str(tok), "--dataset", str(prompts)]) == 0
    # Turn by turn, as the eval asks them: both first turns, then the second, after the first reply; each
    # prompt is the very token ids the eval renders.
    history = [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "answer 1"}]
    expected = [[{"role": "user", "content": "Hi?"}], [{"role": "user", "content": "Yo?"}],
                history + [{"role": "user", "content": "And then?"}]]
    tokenizer = byte_tokenizer("qwen3")
    assert server.handler.prompts == [prompt_ids(tokenizer, messages, thinking=False) for messages in expected]


@pytest.mark.parametrize("server", ["none", "plain"], indirect=True)
def test_a_server_without_the_counters_is_a_one_line_error(server: Fake, setup: tuple[Path, Path],
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    tok, prompts = setup
    code = served.main(["--url", server.url, "--tokenizer", str(tok), "--dataset", str(prompts)])
    err = capsys.readouterr().err.strip()
    assert code == 1 and "\n" not in err and err.startswith("error: ") and "metrics" in err
    assert server.handler.prompts == []  # failed before decoding anything


def test_a_json_file_it_did_not_write_is_not_overwritten(server: Fake, setup: tuple[Path, Path], tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    tok, prompts = setup
    notes = tmp_path / "notes.json"
    notes.write_text('{"mine": true}')
    args = ["--url", server.url, "--tokenizer", str(tok), "--dataset", str(prompts), "--json", str(notes)]
    assert served.main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "was not written by this command" in err
    assert notes.read_text() == '{"mine": true}' and server.handler.prompts == []
    ours = tmp_path / "served.json"
    assert served.main([*args[:-1], str(ours)]) == 0 and served.main([*args[:-1], str(ours)]) == 0  # its own: replaced
