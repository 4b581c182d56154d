"""What the regeneration tests share: words the tiny tokenizer knows, for prompts, and an OpenAI-compatible
chat-completions server on loopback backed by a tiny transformers model (in the test's process)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from dflash_train.regeneration.generation import hf_generate
from dflash_train.runtime.config import EngineConfig
from dflash_train.target import TargetModel

WORDS = ["hello", "who", "are", "you", "the", "capital", "of", "france", "paris", "is", "what", "yes", "no", "brief"]


class ChatCompletionsServer(ThreadingHTTPServer):
    """``POST /v1/chat/completions`` answered by a transformers model with its own chat template."""

    def __init__(self, target: TargetModel, stop_ids: tuple[int, ...] | None = None) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.target, self.lock, self.requests = target, threading.Lock(), []
        self.stop_ids = stop_ids or (target.tokenizer.eos_token_id,)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1"


class _Handler(BaseHTTPRequestHandler):
    server: ChatCompletionsServer

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests.append(body)
        if self.path != "/v1/chat/completions":
            self.send_error(404)
            return
        tokenizer = self.server.target.tokenizer
        ids = tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True, return_dict=True)["input_ids"]
        with self.server.lock:
            config = EngineConfig(max_new_tokens=body["max_tokens"], stop_token_ids=self.server.stop_ids)
            (out,) = hf_generate(self.server.target.model, [list(ids)], config)
        reply = {"choices": [{"index": 0, "finish_reason": out.finish_reason,
                              "message": {"role": "assistant", "content": tokenizer.decode(out.token_ids, skip_special_tokens=True)}}],
                 "usage": {"prompt_tokens": len(ids), "completion_tokens": len(out.token_ids)}}
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass
